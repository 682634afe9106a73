"""`python -m engines.sim` runs standalone; --help documents every flag."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys

import aiohttp
import pytest

from engines.sim import Faults
from engines.sim.cli import build_parser, config_from_args


def test_help_documents_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "engines.sim", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    for action in build_parser()._actions:
        assert action.help, action.dest
        for flag in action.option_strings:
            assert flag in out


def test_flags_map_to_config():
    args = build_parser().parse_args(
        [
            "--role",
            "prefill",
            "--connector",
            "example",
            "--kv-dir",
            "/tmp/x",
            "--strict",
            "--engine-id",
            "e1",
            "--fault-status",
            "503",
            "--decode-tps",
            "5",
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.role, cfg.connector, cfg.kv_dir, cfg.strict) == (
        "prefill",
        "example",
        "/tmp/x",
        True,
    )
    assert cfg.engine_id == "e1" and cfg.faults.status == 503 and cfg.decode_tps == 5


async def test_standalone_process_serves_and_stops(session):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engines.sim",
        "--port",
        "0",
        "--role",
        "prefill",
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 20)
        match = re.search(rb"listening on (http://\S+) \(kv port (\d+)\)", line)
        assert match, line
        async with session.get(match.group(1).decode() + "/health") as resp:
            assert resp.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


def test_fault_flags_map_to_config():
    args = build_parser().parse_args(
        [
            "--fault-headers-delay-s=0.5",
            "--fault-reset-after-bytes=10",
            "--fault-hang-after-tokens=3",
            "--fault-error-after-tokens=2",
            "--fault-fail-kv-load",
            "--fault-health-delay-s=2",
            "--fault-health-status=503",
        ]
    )
    assert config_from_args(args).faults == Faults(
        headers_delay_s=0.5,
        reset_after_bytes=10,
        hang_after_tokens=3,
        error_after_tokens=2,
        fail_kv_load=True,
        health_delay_s=2,
        health_status=503,
    )
    assert config_from_args(build_parser().parse_args([])).faults == Faults()


async def test_sigusr1_crashes_the_standalone_process(session):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engines.sim", "--port", "0", stderr=subprocess.PIPE
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 20)
        match = re.search(rb"listening on (http://\S+) ", line)
        assert match, line
        url = match.group(1).decode()
        async with session.get(url + "/health") as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGUSR1)
        assert await asyncio.wait_for(proc.wait(), 10) == 137
        assert b"shutting down" not in await proc.stderr.read()  # no graceful stop
        with pytest.raises(aiohttp.ClientConnectorError):
            async with aiohttp.ClientSession() as fresh, fresh.get(url + "/health"):
                pass
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_id_connector_and_register_flags_map_to_config():
    args = build_parser().parse_args(
        [
            "--role=decode",
            "--connector=moriio",
            "--transfer-mode=WRITE",
            "--tp-size=2",
            "--kv-wait-timeout-s=1.5",
            "--bootstrap-port=8998",
            "--register=tcp://127.0.0.1:36367",
            "--register-format=moriio-legacy",
            "--register-interval-s=0.5",
            "--zmq-address=host:h,handshake:1,notify:2",
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.connector, cfg.transfer_mode, cfg.tp_size) == ("moriio", "WRITE", 2)
    assert (cfg.kv_wait_timeout_s, cfg.bootstrap_port) == (1.5, 8998)
    assert (cfg.register, cfg.register_format, cfg.register_interval_s) == (
        "tcp://127.0.0.1:36367",
        "moriio-legacy",
        0.5,
    )
    assert cfg.zmq_address == "host:h,handshake:1,notify:2"
