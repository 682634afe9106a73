"""The models one sim serves: its base models and its LoRA adapters, loaded and unloaded at
run time with vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Bodies, statuses and messages are vLLM's (``entrypoints/openai/models/serving.py``): a
load answers 200 with a plain-text line, 400 ``InvalidUserInput`` for a missing field, a
name that is a base model's or one already loaded; an unload answers 404 ``NotFoundError``
for an adapter it does not hold. A request naming a model not served gets vLLM's 404 with
``param: "model"``. Mutated only on the sim's event loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engines.sim.errors import ApiError

INVALID = "InvalidUserInput"


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    parent: str


def parse_lora_modules(specs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH`` pairs, as vLLM's ``--lora-modules``; raises ValueError."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora module {spec!r} is not NAME=PATH")
        pairs.append((name, path))
    return tuple(pairs)


class ServedModels:
    """Base model names (the first is the default) and the adapters loaded on them."""

    def __init__(
        self,
        bases: tuple[str, ...],
        lora_modules: tuple[tuple[str, str], ...] = (),
        max_model_len: int = 4096,
    ) -> None:
        self.bases = bases
        self.max_model_len = max_model_len
        self.adapters: dict[str, Adapter] = {
            name: Adapter(name, path, bases[0]) for name, path in lora_modules
        }
        self.loads = 0
        self.unloads = 0

    @property
    def default(self) -> str:
        return self.bases[0]

    def serves(self, name: str) -> bool:
        return name in self.bases or name in self.adapters

    def resolve(self, name: object) -> str:
        """The served name a request's ``model`` asks for (the default when absent);
        raises vLLM's 404 when it is not served."""
        if name is None:
            return self.default
        if isinstance(name, str) and self.serves(name):
            return name
        raise ApiError(404, f"The model `{name}` does not exist.", param="model")

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``' data: the bases, then the adapters with their ``parent``."""
        created = int(time.time())
        cards = [self._card(name, name, None, created) for name in self.bases]
        cards += [self._card(a.name, a.path, a.parent, created) for a in self.adapters.values()]
        return cards

    def _card(self, name: str, root: str, parent: str | None, created: int) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": self.max_model_len if parent is None else None,
            "permission": [],
        }
        return card

    def load(self, body: dict[str, Any]) -> str:
        """``/v1/load_lora_adapter``; its success line, or raises ``ApiError``."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", INVALID)
        if name in self.bases:
            raise ApiError(
                400, f"The lora adapter '{name}' conflicts with a served base model.", INVALID
            )
        if name in self.adapters and not body.get("load_inplace"):
            raise ApiError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the"
                " adapter in place, set 'load_inplace' to True.",
                INVALID,
            )
        self.adapters[name] = Adapter(name, path, self.default)
        self.loads += 1
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict[str, Any]) -> str:
        """``/v1/unload_lora_adapter``; its success line, or raises ``ApiError``."""
        name = body.get("lora_name")
        if not name or not isinstance(name, str):
            raise ApiError(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", INVALID
            )
        if name not in self.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.")
        del self.adapters[name]
        self.unloads += 1
        return f"Success: LoRA adapter '{name}' removed successfully."
