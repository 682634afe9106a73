#!/usr/bin/env python3
"""Validate the GPU fleet recipes in deploy/recipes/*.toml with vLLM's own parsers (run in the vLLM venv).

For every engine of every recipe: parse `--model M <args> --kv-transfer-config JSON` with vLLM's
OpenAI-server argument parser, build KVTransferConfig from the JSON, and check that kv_connector is
a name registered in KVConnectorFactory (the registry of names only: MoRIIO/Mooncake/LMCache modules
need GPU packages and are not imported). Also checks roles, distinct ports per host, and the pdproxy
command line. Exits non-zero if any recipe is bad.

    python check_recipes.py [DIR_OR_FILES...] [--render]    # --render prints the shell commands
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

import tomllib

EXPECTED_PDPROXY = {
    "NixlConnector": "nixl",
    "NixlPullConnector": "nixl",
    "NixlPushConnector": "nixl-push",
    "MoRIIOConnector": "moriio",
    "MooncakeConnector": "mooncake",
    "LMCacheConnectorV1": "example",
    "ExampleConnector": "example",
}


def pdproxy_config(args: list[str]):
    """pdproxy's own ProxyConfig for a recipe's command line; SystemExit(2) when invalid."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from pdproxy.cli.main import parse_config

    return parse_config(args, environ={})


def vllm_parser():
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser  # type: ignore
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # vLLM 0.32
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser  # type: ignore
    return make_arg_parser(FlexibleArgumentParser(prog="vllm-serve"))


def expand(value, variables: dict[str, str]):
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)\}", lambda m: variables[m.group(1)], value)
    if isinstance(value, list):
        return [expand(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: expand(v, variables) for k, v in value.items()}
    return value


def engine_argv(recipe: dict, eng: dict) -> list[str]:
    return [
        "--model",
        recipe["model"],
        *eng.get("args", []),
        "--kv-transfer-config",
        json.dumps(eng["kv_transfer_config"], separators=(",", ":")),
    ]


def render(recipe: dict) -> str:
    out = [f"# recipe {recipe['name']}: {recipe.get('hardware', '')}"]
    for eng in recipe["engines"]:
        env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in eng.get("env", {}).items())
        out.append(f"# {eng['name']} ({eng['role']}) on {eng.get('host', '?')}")
        out.append(
            f"{env} vllm serve "
            + " ".join(shlex.quote(a) for a in [recipe["model"], *engine_argv(recipe, eng)[2:]])
        )
    out.append(f"# proxy on {recipe['proxy'].get('host', '?')}")
    out.append("pdproxy " + " ".join(shlex.quote(a) for a in recipe["proxy"]["args"]))
    return "\n".join(out)


def load_recipe(path: Path) -> dict:
    """The recipe with its [vars] expanded (and the vars table itself dropped)."""
    raw = tomllib.loads(path.read_text())
    return expand({k: v for k, v in raw.items() if k != "vars"}, raw.get("vars", {}))


def check(path: Path, parser, registry: set[str], KVTransferConfig) -> list[str]:
    recipe = load_recipe(path)
    errors = [
        f"missing top-level key {key!r}"
        for key in ("name", "model", "engines", "proxy")
        if key not in recipe
    ]
    if errors:
        return errors
    roles: set = set()
    ports: set = set()
    for eng in recipe["engines"]:
        roles.add(eng.get("role"))
        errors += check_engine(recipe, eng, parser, registry, KVTransferConfig, ports)
    if roles != {"prefill", "decode"}:
        errors.append(
            f"needs at least one prefill and one decode engine, has roles {sorted(map(str, roles))}"
        )
    return errors + check_proxy(recipe, parser)


def check_engine(
    recipe: dict, eng: dict, parser, registry: set[str], KVTransferConfig, ports: set
) -> list[str]:
    """One engine's role, vLLM arguments and KV transfer config; adds its (host, port) to ports."""
    errors: list[str] = []
    where = eng.get("name", "?")
    if eng.get("role") not in ("prefill", "decode"):
        errors.append(f"{where}: role must be prefill or decode")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(engine_argv(recipe, eng))
    except SystemExit:
        errors.append(
            f"{where}: vLLM rejected the arguments: {err.getvalue().strip().splitlines()[-1:]}"
        )
        return errors
    hp = (eng.get("host"), ns.port)
    if hp in ports:
        errors.append(f"{where}: port {ns.port} used twice on {eng.get('host')}")
    ports.add(hp)
    try:
        kv = KVTransferConfig(**eng["kv_transfer_config"])
    except Exception as exc:  # pydantic ValidationError and friends
        errors.append(f"{where}: KVTransferConfig rejected {eng['kv_transfer_config']}: {exc}")
        return errors
    errors += check_kv_config(where, eng, kv, ns, registry)
    print(
        f"  ok  {recipe['name']}/{where}: {kv.kv_connector} {kv.kv_role}, port {ns.port}, "
        f"tp {ns.tensor_parallel_size}"
    )
    return errors


def check_kv_config(where: str, eng: dict, kv, ns, registry: set[str]) -> list[str]:
    """The parsed KVTransferConfig: a registered connector, the role's kv_role, MoRIIO's ports."""
    errors: list[str] = []
    if kv.kv_connector not in registry:
        errors.append(
            f"{where}: kv_connector {kv.kv_connector!r} is not registered in KVConnectorFactory"
        )
    want_role = "kv_producer" if eng.get("role") == "prefill" else "kv_consumer"
    if kv.kv_role != want_role:
        errors.append(
            f"{where}: kv_role {kv.kv_role!r} but role {eng.get('role')} wants {want_role!r}"
        )
    extra = kv.kv_connector_extra_config or {}
    if kv.kv_connector == "MoRIIOConnector":
        for k in ("proxy_ip", "proxy_ping_port", "http_port", "handshake_port", "notify_port"):
            if k not in extra:
                errors.append(f"{where}: MoRIIO needs kv_connector_extra_config.{k}")
        if str(extra.get("http_port")) != str(ns.port):
            errors.append(f"{where}: MoRIIO http_port {extra.get('http_port')} != --port {ns.port}")
    return errors


def check_proxy(recipe: dict, parser) -> list[str]:
    """The pdproxy command line, parsed by pdproxy's own CLI (stdlib + msgpack, both in this venv)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            pns = pdproxy_config(recipe["proxy"]["args"])
    except SystemExit as exc:
        return [f"proxy: bad pdproxy arguments: {exc} {err.getvalue().strip()}"]
    errors: list[str] = []
    connectors = {e["kv_transfer_config"]["kv_connector"] for e in recipe["engines"]}
    for c in connectors:
        if EXPECTED_PDPROXY.get(c, pns.kv_connector) != pns.kv_connector:
            errors.append(f"proxy: --kv-connector {pns.kv_connector} does not fit engines' {c}")
    served = {s for e in recipe["engines"] for s in [ns_served(parser, recipe, e)] if s}
    if pns.model and served and served != {pns.model}:
        errors.append(f"proxy: --model {pns.model} but engines serve {sorted(served)}")
    if "MoRIIOConnector" in connectors:
        errors += check_moriio_proxy(recipe, pns)
    return errors


def check_moriio_proxy(recipe: dict, pns) -> list[str]:
    """MoRIIO engines ping pdproxy's registry and must agree with its transfer mode."""
    errors: list[str] = []
    if pns.transfer_mode is None or pns.registry.port is None:
        errors.append("proxy: MoRIIO needs --registry-port and --transfer-mode")
    for e in recipe["engines"]:
        extra = e["kv_transfer_config"].get("kv_connector_extra_config", {})
        if int(extra.get("proxy_ping_port", -1)) != pns.registry.port:
            errors.append(
                f"{e['name']}: proxy_ping_port != pdproxy --registry-port {pns.registry.port}"
            )
        read = str(extra.get("read_mode", "")).lower() in ("true", "1")
        if (pns.transfer_mode == "READ") != read:
            errors.append(
                f"{e['name']}: read_mode {extra.get('read_mode')!r} does not fit --transfer-mode "
                f"{pns.transfer_mode}"
            )
    return errors


def ns_served(parser, recipe, eng):
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            ns = parser.parse_args(engine_argv(recipe, eng))
        except SystemExit:
            return None
    names = ns.served_model_name or [recipe["model"]]
    return names[0]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "paths",
        nargs="*",
        default=[str(Path(__file__).resolve().parents[2] / "deploy" / "recipes")],
    )
    ap.add_argument("--render", action="store_true", help="print each recipe's shell commands")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    files: list[Path] = []
    for p in map(Path, args.paths):
        files += sorted(p.glob("*.toml")) if p.is_dir() else [p]
    if not files:
        print("no recipes found", file=sys.stderr)
        return 2
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = set(KVConnectorFactory._registry)
    parser = vllm_parser()
    bad = 0
    for f in files:
        print(f"recipe {f.name}")
        try:
            errors = check(f, parser, registry, KVTransferConfig)
        except Exception as exc:
            errors = [f"could not check: {exc!r}"]
        for e in errors:
            print(f"  BAD {f.name}: {e}")
        bad += bool(errors)
        if args.render and not errors:
            print(render(load_recipe(f)))
    print(f"{len(files) - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
