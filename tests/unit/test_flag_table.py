"""Every flag keeps its spelling, help sentence, default, PDPROXY_* name and the config field it
sets: compared with tests/unit/flags_snapshot.json, taken from the parser before the flags were
declared in one table (issue 18 item 4). ``python -m tests.unit.test_flag_table --write``
rewrites the snapshot (only on purpose: a change there is a change operators see)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdproxy.cli.flag import GROUPS, config_default
from pdproxy.cli.flags import FLAGS, build_parser
from pdproxy.cli.main import ENV_PREFIX, _apply_env, config_from_args, parse_config

SNAPSHOT = Path(__file__).with_name("flags_snapshot.json")
BASE = ["--prefill", "p:8100", "--decode", "d:8200"]
# What to give the flags whose value is not a number (the numbers are found below).
SAMPLES: dict[str, list[str]] = {
    "--prefill": ["--prefill", "q:8101", "9000"],
    "--decode": ["--decode", "e:8300"],
    "--prefill-capacity": ["--prefill-capacity", "8"],
    "--decode-capacity": ["--decode-capacity", "8"],
    "--kv-connector": ["--kv-connector", "example"],
    "--model": ["--model", "m"],
    "--lora-modules": ["--lora-modules", "sql=/a"],
    "--lora-load-on-demand": ["--lora-load-on-demand", "--lora-modules", "sql=/a"],
    "--transfer-mode": ["--transfer-mode", "write"],
    "--push-dispatch": ["--push-dispatch", "concurrent"],
    "--policy": ["--policy", "round_robin"],
    "--kv-events-endpoint": ["--kv-events-endpoint", "tcp://{host}:5557"],
    "--kv-events-replay-endpoint": [
        "--kv-events-endpoint",
        "tcp://{host}:5557",
        "--kv-events-replay-endpoint",
        "tcp://{host}:5558",
    ],
    "--kv-events-topic": ["--kv-events-topic", "kv"],
    "--tokenizer": ["--tokenizer", "/models/m", "chat=/models/c"],
    "--prefill-policy": ["--prefill-policy", "random"],
    "--decode-policy": ["--decode-policy", "random"],
    "--model-policy": ["--model-policy", "sticky=consistent_hash"],
    "--session-header": ["--session-header", "X-User"],
    "--decode-only-fallback": ["--decode-only-fallback"],
    "--host": ["--host", "127.0.0.1"],
    "--no-dashboard": ["--no-dashboard"],
    "--log-level": ["--log-level", "debug"],
    "--log-format": ["--log-format", "json"],
    "--access-log": ["--no-access-log"],
    "--otlp-traces-endpoint": ["--otlp-traces-endpoint", "http://c:4318"],
    "--health-check-endpoint": ["--health-check-endpoint", "/ready"],
    "--registry-port": ["--registry-port", "30001"],
    "--registry-host": ["--registry-host", "127.0.0.1"],
    "--registry-allow-cidr": ["--registry-allow-cidr", "10.0.0.0/8"],
    "--registry-backend": ["--registry-backend", "etcd://h:2379,i:2380"],
    "--etcd-prefix": ["--etcd-prefix", "/x/"],
    "--admin-api-key-file": ["--admin-api-key-file", "{dir}/admin"],
    "--admin-allow-cidr": ["--admin-allow-cidr", "10.0.0.0/8"],
    "--api-key": ["--api-key", "k1"],
    "--api-key-file": ["--api-key-file", "{dir}/keys"],
    "--protect-metrics": ["--protect-metrics", "--api-key", "k1"],
    "--engine-api-key": ["--engine-api-key", "e1"],
    "--engine-api-key-file": ["--engine-api-key-file", "{dir}/engine"],
    "--ssl-keyfile": ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
    "--ssl-certfile": ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"],
    "--ssl-ca-certs": ["--ssl-ca-certs", "ca.pem"],
    "--ssl-cert-reqs": [
        "--ssl-cert-reqs",
        "2",
        "--ssl-certfile",
        "c.pem",
        "--ssl-keyfile",
        "k.pem",
        "--ssl-ca-certs",
        "ca.pem",
    ],
    "--engine-ca-certs": ["--engine-ca-certs", "ca.pem"],
    "--engine-client-cert": ["--engine-client-cert", "c.pem", "--engine-client-key", "k.pem"],
    "--engine-client-key": ["--engine-client-cert", "c.pem", "--engine-client-key", "k.pem"],
    "--render-once": ["--render-once"],
    "--max-queued-requests": ["--max-queued-requests", "4", "--max-concurrent-requests", "2"],
    "--render": ["--render-once", "--render", "r:8400"],
    "--first-token-from-prefill": ["--first-token-from-prefill"],
    "--tenants": ["--tenants", "{dir}/tenants.json"],
    "--lora-path-root": ["--lora-path-root", "/models/adapters"],
    "--registry-kv-events-host": ["--registry-kv-events-host", "10.0.0.9"],
    "--tenant-header": ["--tenant-header", "X-Tenant"],
}
FILES = {
    "admin": "a-key\n",
    "keys": "k2\n# comment\nk3 tenant=t3\n",
    "engine": "e2\n",
    "tenants.json": '{"t3": {"weight": 2, "priority": 1}, "default": {"requests_per_minute": 60}}',
}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            if f.name != "hop_id":
                out.update(_flat(getattr(value, f.name), f"{prefix}{f.name}."))
        return out
    if isinstance(value, Mapping):
        return {
            prefix[:-1]: {
                k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                for k, v in value.items()
            }
        }
    if isinstance(value, tuple):
        return {prefix[:-1]: [_flat(v) if dataclasses.is_dataclass(v) else v for v in value]}
    return {prefix[:-1]: value}


def _config(argv: list[str]) -> dict[str, Any] | None:
    parser = build_parser()
    try:
        args = parser.parse_args([*BASE, *argv])
        return _flat(config_from_args(args, {}))
    except (SystemExit, Exception):  # a sample the config refuses
        return None


def _number_samples(action: argparse.Action) -> list[list[str]]:
    default = action.default
    kind: Any = action.type  # int or float: every flag without a sample is a number
    picks = [default * 2, default + 1, default / 2, 0.5, 1, 2, 3, 0, 1024]
    name = action.option_strings[0]
    return [[name, str(kind(p))] for p in picks if kind(p) != default]


def _sets(action: argparse.Action, base: dict[str, Any], d: str) -> dict[str, Any]:
    """The config fields (dotted) this flag sets, with the sample's values."""
    name = action.option_strings[0]
    if name in SAMPLES:
        candidates = [[a.replace("{dir}", d) for a in SAMPLES[name]]]
    else:
        candidates = _number_samples(action)
    for argv in candidates:
        config = _config(argv)
        if config is not None and config != base:
            changed = {
                k: v.replace(d, "{dir}") if isinstance(v, str) else v
                for k, v in config.items()
                if base.get(k) != v
            }
            return {"argv": [a.replace(d, "{dir}") for a in argv], "config": changed}
    raise AssertionError(f"no sample of {name} reaches the config")


def current() -> list[dict[str, Any]]:
    """Each flag as the parser, the environment and the config see it today."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for file, text in FILES.items():
            Path(d, file).write_text(text)
        base = _config([])
        assert base is not None
        for action in build_parser()._actions:
            if not action.option_strings or action.dest == "help":
                continue
            rows.append(
                {
                    "flags": list(action.option_strings),
                    "help": action.help,
                    "default": action.default,
                    "env": ENV_PREFIX + action.dest.upper(),
                    "dest": action.dest,
                    "type": getattr(action.type, "__name__", None),
                    "nargs": action.nargs,
                    "choices": list(action.choices) if action.choices is not None else None,
                    "metavar": action.metavar,
                    "sets": _sets(action, base, d),
                }
            )
    rows.sort(key=lambda r: r["flags"][0])
    return list(json.loads(json.dumps(rows)))  # as the snapshot reads back: lists, not tuples


def test_every_flag_is_as_before() -> None:
    assert current() == json.loads(SNAPSHOT.read_text())


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")


def test_each_flag_reads_its_environment_variable_the_same() -> None:
    """PDPROXY_<NAME>=value sets what ``--flag value`` sets (a switch: =1)."""
    rows = json.loads(SNAPSHOT.read_text())
    checked = 0
    for row in rows:
        argv = row["sets"]["argv"]
        one = argv[0] in row["flags"] and len(argv) <= 2 and "{dir}" not in argv[-1]
        if not one or argv[0] in BASE:  # BASE's lists: the flag's items come after the env's
            continue
        negated = argv[0] != row["flags"][0] and argv[0].startswith("--no-")  # --no-access-log
        value = argv[1] if len(argv) == 2 else "0" if negated else "1"
        parser = build_parser()
        _apply_env(parser, {row["env"]: value})
        from_env = _flat(config_from_args(parser.parse_args(BASE), {}))
        assert from_env == _config(argv), row["flags"]
        checked += 1
    assert checked > 60


def test_help_shows_the_groups_and_every_flag_sits_in_one() -> None:
    groups = {g.title: g._group_actions for g in build_parser()._action_groups}
    for title in ("listener", "fleet", "scheduling", "resilience", "security", "observability"):
        assert any(str(t).startswith(title) and actions for t, actions in groups.items()), title
    assert any(str(t).startswith("scale-out") for t in groups)
    assert [a.dest for a in groups["options"]] == ["help"]  # argparse's default group: -h only
    assert {f.group for f in FLAGS} == set(GROUPS)


def test_each_field_is_a_config_field_and_each_flag_reaches_the_config() -> None:
    read_by_others = {
        "policy",
        "api_key_file",
        "engine_api_key_file",
        "admin_api_key",
        "tenant_header",
    }
    for flag in FLAGS:
        if flag.field is None:
            assert flag.dest in read_by_others, flag.names
        else:
            config_default(flag.field)  # raises KeyError for a field ProxyConfig does not have
    assert len({f.dest for f in FLAGS}) == len(FLAGS)


def test_admin_key_precedence(tmp_path: Path) -> None:
    """--admin-api-key-file, then PDPROXY_ADMIN_API_KEY, then ADMIN_API_KEY."""
    key_file = tmp_path / "admin"
    key_file.write_text("from-file\n")
    both = {"PDPROXY_ADMIN_API_KEY": "prefixed", "ADMIN_API_KEY": "plain"}
    assert parse_config(BASE, both).admin_api_key == "prefixed"
    assert parse_config(BASE, {"ADMIN_API_KEY": "plain"}).admin_api_key == "plain"
    assert parse_config(BASE, {"PDPROXY_ADMIN_API_KEY": "prefixed"}).admin_api_key == "prefixed"
    with_file = [*BASE, "--admin-api-key-file", str(key_file)]
    assert parse_config(with_file, both).admin_api_key == "from-file"
    assert parse_config(BASE, {}).admin_api_key is None
    options = {o for a in build_parser()._actions for o in a.option_strings}
    assert "--admin-api-key" not in options  # the key itself never on a command line (ps)


def test_every_flag_is_documented_and_every_documented_flag_exists() -> None:
    root = Path(__file__).parents[2]
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in docs)
    names = {n for f in FLAGS for n in f.names}
    for flag in FLAGS:
        assert not flag.names or flag.names[0] in text, flag.names
    rows = [
        line for line in (root / "README.md").read_text().splitlines() if line.startswith("| `--")
    ]
    in_table = set(re.findall(r"--[a-z][a-z0-9-]*", " ".join(r.split("|")[1] for r in rows)))
    assert in_table - {"--no-access-log"} <= names
