"""kv-events on the real tier: a vLLM CPU NIXL pair (SmolLM2) started with
``--kv-events-config`` (prefix caching is on by default) publishes its KV events over
ZMQ; pdproxy follows both engines and predicts, for a second request sharing a long
prefix, exactly the ``cached_tokens`` vLLM then reports through PD. The pair is then
restarted on the same ports (a new process numbers its events from 0 and holds nothing):
pdproxy clears what it knew of it and relearns it.

This module starts a pair of its own: the events are bound on endpoints per engine,
which the session's shared pairs do not have.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from engines.ports import free_ports
from engines.vllm.launch import SMOLLM2, EnginePair, start_engines
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.scheduling.kv_events import KVIndex
from pdproxy.scheduling.kv_keys import block_keys, instance_name
from pdproxy.types import EngineAddress
from pdproxy.wire.local_tokenizer import LocalTokenizer
from tests.e2e.conftest import SHARED_FLAGS, post, wait_until
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

GENERATE = "/inference/v1/generate"
BLOCK = 32  # engines/vllm's --block-size
SHARED = "The scheduler keeps every engine busy and routes each prompt to the cache. " * 12


def _events_config(directory: Path, port: int) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{directory}/{port}.events",
        "replay_endpoint": f"ipc://{directory}/{port}.replay",
        "topic": "",
    }
    return ["--kv-events-config", json.dumps(config)]


class Pair:
    """A SmolLM2 NIXL pair publishing KV events on ipc endpoints named by its HTTP ports;
    ``restart`` starts it again on the same ports."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvev", dir="/tmp"))  # ipc paths are short
        self.ports = free_ports(4)
        self.engines: EnginePair | None = None

    def start(self) -> EnginePair:
        p, d, p_side, d_side = self.ports
        self.engines = start_engines(
            "nixl",
            p,
            d,
            run_dir=self.dir / "run",
            prefill_side_channel_port=p_side,
            decode_side_channel_port=d_side,
            model=SMOLLM2,
            extra_args=SHARED_FLAGS,
            timeout=900,  # a loaded 2-core machine shared with other real-tier runs
            role_args={
                "prefill": _events_config(self.dir, p),
                "decode": _events_config(self.dir, d),
            },
        )
        return self.engines

    def stop(self) -> None:
        if self.engines is not None:
            self.engines.stop()
            self.engines = None

    def restart(self) -> EnginePair:
        self.stop()
        return self.start()


@pytest.fixture(scope="module")
def kv_pair() -> Iterator[Pair]:
    pair = Pair()
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()
        shutil.rmtree(pair.dir, ignore_errors=True)


def _config(pair: Pair, tokenizer: str | None = None) -> ProxyConfig:
    engines = pair.engines
    assert engines is not None
    scheduling = SchedulingConfig(
        prefill_policy="kv-events",
        decode_policy="kv-events",
        kv_events_endpoint=f"ipc://{pair.dir}/{{port}}.events",
        kv_events_replay_endpoint=f"ipc://{pair.dir}/{{port}}.replay",
        tokenizers=() if tokenizer is None else (("", tokenizer),),
    )
    return ProxyConfig(
        prefill=(EngineAddress(url=engines.prefill_url),),
        decode=(EngineAddress(url=engines.decode_url),),
        kv_connector="nixl",
        scheduling=scheduling,
    )


async def _token_ids(url: str, model: str, text: str) -> list[int]:
    status, raw = await post(url, "/v1/completions/render", {"model": model, "prompt": text})
    assert status == 200, raw
    (request,) = orjson.loads(raw)
    ids: list[int] = request["token_ids"]
    return ids


async def _generate(url: str, model: str, ids: list[int]) -> dict[str, Any]:
    body = {"model": model, "token_ids": ids, "sampling_params": {"max_tokens": 2}}
    status, raw = await post(url, GENERATE, body)
    assert status == 200, raw
    answer: dict[str, Any] = orjson.loads(raw)
    return answer


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def _predicted(index: KVIndex, url: str, ids: list[int]) -> int:
    depth = index.match(block_keys(ids, BLOCK)).get(instance_name(url, 0), 0)
    return min(depth, (len(ids) - 1) // BLOCK) * BLOCK


async def test_prediction_equals_vllms_cached_tokens_and_a_restart_is_relearned(kv_pair):
    engines = kv_pair.engines
    assert engines is not None
    async with running_proxy(_config(kv_pair)) as proxy:
        fleet = proxy.state.kv_events
        names = {instance_name(engines.prefill_url, 0), instance_name(engines.decode_url, 0)}
        await wait_until(lambda: names <= fleet.index.live, timeout=30)
        first = await _token_ids(proxy.url, engines.model, SHARED + "First question: why?")
        second = await _token_ids(proxy.url, engines.model, SHARED + "Second: and how?")
        assert len(first) > 4 * BLOCK
        await _generate(proxy.url, engines.model, first)
        # vLLM publishes the prefill's blocks (its tokens, hashes as 64-bit ints) ...
        await wait_until(lambda: _predicted(fleet.index, engines.prefill_url, second) > 0, 30)
        predicted = _predicted(fleet.index, engines.prefill_url, second)
        answer = await _generate(proxy.url, engines.model, second)
        # ... and the prediction is exactly the hit it reports through PD.
        assert _cached(answer) == predicted > 2 * BLOCK
        assert fleet.status()["instances"][instance_name(engines.prefill_url, 0)]["malformed"] == 0
        # The decode's own predictions are checked by the first block it stores
        # (kv_awaited): vLLM stores exactly the prompt blocks it lacked. A prompt with new
        # whole blocks past the shared prefix (predicted: the prefix), and a new one
        # (predicted: nothing).
        decode = instance_name(engines.decode_url, 0)
        tail = " ".join(f"tail{i}" for i in range(3 * BLOCK))
        for text in (SHARED + tail, tail + " and a prompt of its own"):
            await _generate(
                proxy.url, engines.model, await _token_ids(proxy.url, engines.model, text)
            )

        def checked() -> int:
            figures = fleet.index.check.figures.get(decode)
            return 0 if figures is None else figures.checked

        await wait_until(lambda: checked() >= 2, 30)
        figures = fleet.index.check.figures[decode]
        assert figures.wrong == 0 and figures.predicted_tokens > 2 * BLOCK, figures

        restarted = kv_pair.restart()  # the same ports; new processes, empty caches
        assert restarted.prefill_url == engines.prefill_url
        name = instance_name(engines.prefill_url, 0)
        await wait_until(lambda: fleet.status()["instances"][name]["reconnects"] >= 1, 60)
        assert _predicted(fleet.index, engines.prefill_url, second) == 0  # cleared
        snapshot = proxy.state.registry.snapshot
        await wait_until(lambda: snapshot().prefill and snapshot().decode, 60)
        await _generate(proxy.url, engines.model, first)
        await wait_until(lambda: _predicted(fleet.index, engines.prefill_url, second) > 0, 30)
        predicted = _predicted(fleet.index, engines.prefill_url, second)
        answer = await _generate(proxy.url, engines.model, second)
        assert _cached(answer) == predicted > 2 * BLOCK


async def test_a_text_completion_is_predicted_exactly_by_the_local_tokenizer(kv_pair, caplog):
    """No --render-once: pdproxy tokenizes the text with the model directory's
    tokenizer.json (--tokenizer), and its prediction is the hit vLLM reports."""
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    engines = kv_pair.engines
    assert engines is not None and engines.model_dir is not None
    async with running_proxy(_config(kv_pair, str(engines.model_dir))) as proxy:
        fleet = proxy.state.kv_events
        names = {instance_name(engines.prefill_url, 0), instance_name(engines.decode_url, 0)}
        await wait_until(lambda: names <= fleet.index.live, timeout=30)
        shared = "A local tokenizer gives pdproxy each prompt's token ids without a render. " * 12
        first, second = shared + "First question: why?", shared + "Second: and how?"
        ids = await _token_ids(proxy.url, engines.model, second)  # vLLM's own tokenization
        assert LocalTokenizer.load(str(engines.model_dir)).prompt_ids({"prompt": second}) == ids
        body = {"model": engines.model, "max_tokens": 2}
        status, raw = await post(proxy.url, "/v1/completions", {**body, "prompt": first})
        assert status == 200, raw
        await wait_until(lambda: _predicted(fleet.index, engines.prefill_url, ids) > 0, 30)
        status, raw = await post(proxy.url, "/v1/completions", {**body, "prompt": second})
        assert status == 200, raw
        access = [r.fields for r in caplog.records if r.name == "pdproxy.access"]
        predicted = access[-1].get("predicted_prefill_cached")
        assert _cached(orjson.loads(raw)) == predicted > 2 * BLOCK
