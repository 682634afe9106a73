"""Where things live (venv, model, run dir) and how to prepare them; shared constants and errors.

Standard library only, like the rest of the launcher (see launch.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ENGINES_DIR = Path(__file__).resolve().parent
HOOKS_DIR = ENGINES_DIR / "hooks"
SERVED_MODEL_NAME = "tiny-llama"
CONNECTORS = ("nixl", "example")
ROLES = ("prefill", "decode")


class EngineError(RuntimeError):
    """An engine failed to start, or the venv/model could not be prepared."""


class PortInUseError(EngineError):
    """An engine could not bind one of its ports (HTTP or KV side channel); fresh ports may work."""


def log(msg: str) -> None:
    print(f"[engines] {msg}", file=sys.stderr, flush=True)


def _setting(override: object, env_name: str, default: object) -> str:
    """First of: the explicit override, the environment variable, the default."""
    return str(override or os.environ.get(env_name) or default)


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    venv: Path
    model_dir: Path
    python: str = "python3.11"

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        home_cache = Path.home() / ".cache" / "pdproxy"
        cache = Path(_setting(overrides.get("cache_dir"), "PDPROXY_CACHE", home_cache))
        cache = cache.expanduser()
        venv = Path(_setting(overrides.get("venv"), "VLLM_VENV", cache / "vllm-venv"))
        model_default = cache / "models" / "tiny-llama"
        model = Path(_setting(overrides.get("model_dir"), "TINY_MODEL_DIR", model_default))
        python = _setting(overrides.get("python"), "VLLM_PYTHON", "python3.11")
        return cls(
            cache_dir=cache, venv=venv.expanduser(), model_dir=model.expanduser(), python=python
        )

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
            TINY_MODEL_DIR=str(self.model_dir),
        )
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
    """Build the tiny model if needed (a few seconds); return its directory."""
    settings = settings or Settings.from_env()
    ensure_venv(settings)
    proc = subprocess.run(
        [
            str(settings.venv_python),
            str(ENGINES_DIR / "build_model.py"),
            "--out",
            str(settings.model_dir),
        ],
        env=settings.script_env(),
    )
    if proc.returncode != 0:
        raise EngineError(f"build_model.py failed with exit code {proc.returncode}")
    return settings.model_dir


def ensure_ready(settings: Settings | None = None) -> Settings:
    settings = settings or Settings.from_env()
    ensure_model(settings)
    return settings
