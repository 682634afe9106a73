"""Port choice and start-up failure handling of the engine launchers (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engines import ports
from engines.vllm import lifecycle
from engines.vllm.engine import Engine, wait_healthy
from engines.vllm.settings import EngineError, PortInUseError


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    picked = ports.free_ports(8)
    assert len(set(picked)) == 8
    assert all(p < low for p in picked)
    assert all(ports.bindable(p) for p in picked)


def test_free_ports_fall_back_to_the_kernel_when_there_is_no_room(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 60999))
    picked = ports.free_ports(3)
    assert len(set(picked)) == 3 and all(ports.bindable(p) for p in picked)


def test_a_port_in_use_is_not_bindable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.free_port()))
        s.listen()
        assert not ports.bindable(s.getsockname()[1])


def test_an_engine_that_cannot_bind_fails_start_up_at_once(tmp_path: Path):
    """The engine lives on, never healthy: its log is the only sign, and wait_healthy reads it."""
    log_path = tmp_path / "decode.log"
    log_path.write_text(
        "Exception in thread nixl_handshake_listener:\n"
        "zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:36275')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        eng = Engine("decode", ports.free_port(), proc.pid, log_path)
        with pytest.raises(PortInUseError, match="could not bind"):
            wait_healthy([eng], timeout=30, progress=False)
    finally:
        proc.kill()
        proc.wait()


class _FakePair:
    stopped = False

    def stop(self) -> None:
        self.stopped = True


def _fake_start(calls: list[dict], failures: int):
    def start_engines(connector, prefill_port, decode_port, **kwargs):
        calls.append(dict(prefill=prefill_port, decode=decode_port, **kwargs))
        if len(calls) <= failures:
            raise PortInUseError("decode engine could not bind a port\nlog")
        return _FakePair()

    return start_engines


def test_chosen_ports_are_chosen_afresh_after_a_bind_failure(monkeypatch, tmp_path):
    calls: list[dict] = []
    monkeypatch.setattr(lifecycle, "start_engines", _fake_start(calls, failures=1))
    with lifecycle.vllm_engines("nixl", run_dir=tmp_path) as pair:
        assert isinstance(pair, _FakePair)
    keys = ("prefill", "decode", "prefill_side_channel_port", "decode_side_channel_port")
    first, second = ({c[k] for k in keys} for c in calls)
    assert len(calls) == 2 and len(first) == 4 and len(second) == 4 and first != second
    assert pair.stopped


def test_an_operators_ports_are_not_changed(monkeypatch, tmp_path):
    calls: list[dict] = []
    monkeypatch.setattr(lifecycle, "start_engines", _fake_start(calls, failures=1))
    with (
        pytest.raises(PortInUseError),
        lifecycle.vllm_engines("example", 28100, 28200, run_dir=tmp_path),
    ):
        pass
    assert len(calls) == 1


def test_retries_are_bounded(monkeypatch, tmp_path):
    calls: list[dict] = []
    monkeypatch.setattr(lifecycle, "start_engines", _fake_start(calls, failures=99))
    with pytest.raises(EngineError), lifecycle.vllm_engines("example", run_dir=tmp_path):
        pass
    assert len(calls) == lifecycle._PORT_ATTEMPTS
