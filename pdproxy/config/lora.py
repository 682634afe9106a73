"""LoRA adapters: where each one's weights are, and whether pdproxy loads them on demand."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdproxy.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    """``modules``: (name, path) of each adapter pdproxy may load (``--lora-modules
    NAME=PATH``, vLLM's spelling); ``load_on_demand``: a request for one that no routable
    pair holds loads it on the chosen pair first (vLLM's runtime LoRA API);
    ``max_loras``: how many adapters pdproxy keeps loaded per instance, the least recently
    used one unloaded to make room (0: no limit; the engine's own ``--max-loras`` and
    ``--max-cpu-loras`` still bound what it holds at once)."""

    modules: tuple[tuple[str, str], ...] = ()
    load_on_demand: bool = False
    max_loras: int = 0
    # --lora-path-root: directories a /v1/load_lora_adapter's lora_path must lie under
    # (besides the modules' own paths); () = any path the admin names
    path_roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ConfigError("--max-loras must be >= 0")
        if self.load_on_demand and not self.modules:
            raise ConfigError("--lora-load-on-demand needs --lora-modules NAME=PATH")
        if any(not root.startswith("/") for root in self.path_roots):
            raise ConfigError("--lora-path-root takes absolute directories")
        names = [name for name, _ in self.modules]
        if len(set(names)) != len(names):
            raise ConfigError("--lora-modules names each adapter once")

    @property
    def paths(self) -> dict[str, str]:
        return dict(self.modules)


def parse_lora_modules(specs: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH`` pairs; raises ``ConfigError`` for one that is not."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora-modules: {spec!r} is not NAME=PATH")
        pairs.append((name.strip(), path.strip()))
    return tuple(pairs)
