"""The engine launchers' KV connector settings (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.vllm import launch
from engines.vllm.command import EngineSpec, engine_command, kv_transfer_config
from engines.vllm.settings import Settings


def _settings(tmp_path: Path) -> Settings:
    return Settings(cache_dir=tmp_path, venv=tmp_path / "venv", model_dir=tmp_path / "model")


@pytest.mark.parametrize(
    ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")]
)
def test_nixl_push_names_vllms_push_connector_with_the_lease(role, kv_role):
    assert kv_transfer_config("nixl-push", role, kv_lease_duration=5) == {
        "kv_connector": "NixlPushConnector",
        "kv_role": kv_role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": 5},
    }


def test_no_engine_id_is_fixed():
    """vLLM's fresh id per start: a fixed one outlives a restart and strands push decodes."""
    for connector in ("nixl", "nixl-push"):
        assert "engine_id" not in kv_transfer_config(connector, "decode")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_both_push_engines_listen_on_their_side_channel(tmp_path, role):
    """A push P handshakes back with the decode its registration names."""
    spec = EngineSpec(role, 8100, "0", 5611)
    argv, env = engine_command(_settings(tmp_path), spec, "nixl-push")
    assert '"kv_connector":"NixlPushConnector"' in argv[argv.index("--kv-transfer-config") + 1]
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5611"


def test_the_cli_still_starts_a_pull_pair_by_default(monkeypatch):
    monkeypatch.delenv("CONNECTOR", raising=False)
    assert launch._parser().parse_args(["up"]).connector == "nixl"
    assert "nixl-push" in launch.CONNECTORS
