"""The GPU fleet recipes (deploy/recipes) checked with vLLM's own argument parser and
KVTransferConfig (vLLM's CPU build) and pdproxy's own CLI, so a typo fails CI."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engines.vllm.launch import ensure_ready

pytestmark = pytest.mark.real_engine

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "engines" / "vllm" / "check_recipes.py"
RECIPES = sorted((ROOT / "deploy" / "recipes").glob("*.toml"))


def _check(*paths: Path) -> subprocess.CompletedProcess[str]:
    python = ensure_ready().venv_python
    return subprocess.run(
        [str(python), str(CHECKER), *map(str, paths)], capture_output=True, text=True, timeout=300
    )


def test_every_recipe_parses():
    assert {p.stem for p in RECIPES} >= {
        "nixl-2p1d",
        "moriio-read",
        "moriio-write",
        "mooncake-1p1d",
        "lmcache-1p1d",
    }
    result = _check(*RECIPES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(RECIPES)} passed, 0 failed" in result.stdout


@pytest.mark.parametrize(
    ("recipe", "old", "new"),
    [
        ("nixl-2p1d", '"--tensor-parallel-size"', '"--tensor-paralel-size"'),  # vLLM flag typo
        ("nixl-2p1d", '"NixlConnector"', '"NixlConector"'),  # unknown connector
        ("moriio-write", '"--transfer-mode", "WRITE"', '"--transfer-mode", "WRIT"'),  # pdproxy CLI
        ("moriio-read", '"--kv-connector", "moriio"', '"--kv-connector", "nixl"'),  # mismatch
    ],
)
def test_a_broken_recipe_fails(tmp_path, recipe, old, new):
    source = (ROOT / "deploy" / "recipes" / f"{recipe}.toml").read_text()
    assert old in source
    broken = tmp_path / f"{recipe}.toml"
    broken.write_text(source.replace(old, new, 1))
    result = _check(broken)
    assert result.returncode != 0 and "0 passed, 1 failed" in result.stdout, result.stdout
