"""Every pdproxy flag and PDPROXY_* variable that deploy/ (and docs/deploy.md) uses exists in
pdproxy's parser, and each deployment's whole configuration parses, so the manifests, the
unit and the image cannot rot when a flag is renamed."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from engines import register
from pdproxy.cli.flags import build_parser
from pdproxy.cli.main import ENV_PREFIX, config_from_args, parse_config
from tests.deploy.conftest import DEPLOYABLE, TARGETS
from tests.deploy.manifests import (
    DEPLOY,
    DOCKERFILE,
    ENV_EXAMPLE,
    ROOT,
    UNIT,
    commented_env_names,
    container_env,
    containers,
    env_file,
    is_pdproxy,
    is_register,
    of_kind,
    unit_settings,
)

# Read by pdproxy without the prefix (pdproxy/cli/main.py: the admin key has a file flag only).
UNPREFIXED = {"ADMIN_API_KEY"}
# The base names no engines (its overlays do); pdproxy refuses to start without any.
SOME_ENGINES = {"PDPROXY_PREFILL": "http://p:8100", "PDPROXY_DECODE": "http://d:8200"}


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings}


def env_names() -> set[str]:
    """PDPROXY_<DEST> of every flag, as pdproxy.cli.main reads them."""
    return {ENV_PREFIX + a.dest.upper() for a in build_parser()._actions if a.option_strings} - {
        "PDPROXY_HELP"
    }


def flags_in(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def parses(argv: list[str], environ: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """pdproxy would start with this configuration (parse_config exits 2 otherwise)."""
    try:
        parse_config(argv, environ)
    except SystemExit as exc:
        pytest.fail(f"pdproxy refuses {argv} {environ}: {capsys.readouterr().err.strip()}")
        raise AssertionError from exc


def test_admin_key_variable_is_the_one_pdproxy_reads() -> None:
    args = build_parser().parse_args(["--prefill", "p:8100", "--decode", "d:8200"])
    assert config_from_args(args, {"ADMIN_API_KEY": "k"}).admin_api_key == "k"
    assert config_from_args(args, {"PDPROXY_ADMIN_API_KEY": "k"}).admin_api_key is None


@pytest.mark.parametrize("target", DEPLOYABLE)
def test_manifest_configuration_is_valid(rendered, target: str, capsys) -> None:
    objects = rendered(target)
    known_env = env_names() | UNPREFIXED
    for deployment in of_kind(objects, "Deployment"):
        for c in containers(deployment):
            if not is_pdproxy(c):
                continue
            args = list(c.get("args", []))
            env = container_env(objects, c)
            assert set(flags_in(args)) <= options(build_parser()), args
            unknown = {k for k in env if k.startswith(ENV_PREFIX)} - known_env
            assert not unknown, f"not pdproxy variables: {sorted(unknown)}"
            if not target.startswith("overlays/"):
                assert not env.keys() & SOME_ENGINES.keys()
                env = {**SOME_ENGINES, **env}
            parses(args, env, capsys)


@pytest.mark.parametrize("target", TARGETS)
def test_sidecar_flags_exist(rendered, target: str) -> None:
    for deployment in of_kind(rendered(target), "Deployment"):
        for c in containers(deployment):
            if is_register(c):
                assert set(flags_in(c["args"])) <= options(register.build_parser())


def test_unit_and_env_file_configuration_is_valid(capsys) -> None:
    [exec_start] = unit_settings()["ExecStart"]
    command, *args = exec_start.split()
    assert Path(command).name == "pdproxy"
    assert set(flags_in(args)) <= options(build_parser())
    values = env_file()
    offered = set(values) | commented_env_names()
    unknown = {k for k in offered if k.startswith(ENV_PREFIX)} - env_names()
    assert not unknown, f"{ENV_EXAMPLE.name}: not pdproxy variables: {sorted(unknown)}"
    assert offered - env_names() <= UNPREFIXED
    parses(args, values, capsys)


def test_dockerfile_uses_real_variables_and_ports() -> None:
    text = DOCKERFILE.read_text()
    assert set(re.findall(r"PDPROXY_[A-Z0-9_]+", text)) <= env_names()
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    defaults = build_parser().parse_args([])
    assert defaults.port in exposed


def test_variables_named_in_deploy_and_its_doc_exist() -> None:
    """Prose and comments too: a renamed flag must not survive in an example."""
    ours = ("docker", "kubernetes", "systemd")
    files = [p for d in ours for p in (DEPLOY / d).rglob("*") if p.is_file()]
    files.append(ROOT / "docs" / "deploy.md")
    known = env_names() | UNPREFIXED
    for path in files:
        names = set(re.findall(r"\bPDPROXY_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
        assert names <= known, f"{path.relative_to(ROOT)}: {sorted(names - known)}"
    assert UNIT.exists()


def test_flags_in_the_doc_exist() -> None:
    """`--flag`s on the doc's pdproxy and pdproxy-register command lines."""
    proxy, sidecar = options(build_parser()), options(register.build_parser())
    text = (ROOT / "docs" / "deploy.md").read_text().replace("\\\n", " ")
    for line in re.findall(r"^\s*(?:\$ )?(?:\S*/)?(pdproxy(?:-register)? .*)$", text, re.M):
        known = sidecar if line.startswith("pdproxy-register") else proxy
        used = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line))
        assert used <= known, f"docs/deploy.md: {sorted(used - known)} in {line!r}"
