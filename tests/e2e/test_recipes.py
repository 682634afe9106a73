"""The GPU fleet recipes (deploy/recipes) checked with vLLM's own argument parser and
KVTransferConfig (vLLM's CPU build) and pdproxy's own CLI, so a typo fails CI.

The checker imports vLLM (about 17 s on two cores), so it runs once for the module, on the
real recipes and on one broken copy of each kind of mistake side by side; each test then
reads its own recipe's verdict from that run's report.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engines.vllm.launch import ensure_ready

pytestmark = pytest.mark.real_engine

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "engines" / "vllm" / "check_recipes.py"
RECIPES = sorted((ROOT / "deploy" / "recipes").glob("*.toml"))
BROKEN = [
    ("nixl-2p1d", '"--tensor-parallel-size"', '"--tensor-paralel-size"'),  # vLLM flag typo
    ("nixl-2p1d", '"NixlConnector"', '"NixlConector"'),  # unknown connector
    ("moriio-write", '"--transfer-mode", "WRITE"', '"--transfer-mode", "WRIT"'),  # pdproxy CLI
    ("moriio-read", '"--kv-connector", "moriio"', '"--kv-connector", "nixl"'),  # mismatch
]


def _broken_name(index: int) -> str:
    return f"broken-{index}-{BROKEN[index][0]}.toml"


def _verdicts(stdout: str) -> dict[str, list[str]]:
    """Each recipe the checker reported on, with its BAD lines (none: it passed)."""
    verdicts: dict[str, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        if line.startswith("recipe "):
            current = line.removeprefix("recipe ")
            verdicts[current] = []
        elif line.strip().startswith("BAD ") and current is not None:
            verdicts[current].append(line.strip())
    return verdicts


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], dict[str, list[str]]]:
    broken_dir = tmp_path_factory.mktemp("broken-recipes")
    broken = []
    for index, (recipe, old, new) in enumerate(BROKEN):
        source = (ROOT / "deploy" / "recipes" / f"{recipe}.toml").read_text()
        assert old in source, (recipe, old)
        path = broken_dir / _broken_name(index)
        path.write_text(source.replace(old, new, 1))
        broken.append(path)
    python = ensure_ready().venv_python
    result = subprocess.run(
        [str(python), str(CHECKER), *map(str, RECIPES), *map(str, broken)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result, _verdicts(result.stdout)


def test_every_recipe_parses(report):
    result, verdicts = report
    assert {p.stem for p in RECIPES} >= {
        "nixl-2p1d",
        "moriio-read",
        "moriio-write",
        "mooncake-1p1d",
        "lmcache-1p1d",
    }
    for recipe in RECIPES:
        assert verdicts.get(recipe.name) == [], result.stdout + result.stderr
    total = len(RECIPES) + len(BROKEN)
    assert f"{len(RECIPES)} passed, {len(BROKEN)} failed" in result.stdout, result.stdout
    assert len(verdicts) == total and result.returncode == 1


@pytest.mark.parametrize("index", range(len(BROKEN)), ids=[f"{r}-{o}-{n}" for r, o, n in BROKEN])
def test_a_broken_recipe_fails(report, index):
    result, verdicts = report
    bad = verdicts.get(_broken_name(index))
    assert bad, result.stdout + result.stderr
