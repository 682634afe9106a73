"""``--first-token-from-prefill`` through pdproxy in front of NIXL sims: the prefill's token
is the stream's first chunk, byte for byte the decode's, and the decode continues after it
(prompt ids + [t1], max_tokens one lower), the answer equal to a single engine's; t1 that
ends the request sends no decode; the block-size edge and what cannot be kept exact take
the usual path. The sim's decode dies on the block-size edge as vLLM's does, so a proxy
that sent such a decode would fail here."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from engines.sim import model
from tests.integration.conftest import MODEL, deployment
from tests.sim.helpers import wait_for

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BLOCK = 16  # the sims' block size
ON = {"first_token_from_prefill": True}


def _words(n: int, salt: str = "w") -> str:
    return " ".join(f"{salt}{i}" for i in range(n))


def _generate(prompt: str, tokens: int = 6, **sampling: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "token_ids": model.tokenize(prompt),
        "sampling_params": {"max_tokens": tokens, "temperature": 0, **sampling},
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _post(
    url: str, path: str, body: dict[str, Any], rid: str = "first-token"
) -> tuple[int, bytes]:
    headers = {"X-Request-Id": rid}  # the same id on both paths: the same chunks
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        return r.status, await r.read()


def _events(raw: bytes) -> list[bytes]:
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-300:]
    return events[:-1]


def _ids(raw: bytes) -> list[int]:
    chunks = [orjson.loads(e) for e in _events(raw)]
    return [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]


def _usage(raw: bytes) -> dict[str, Any]:
    (usage,) = [u for e in _events(raw) if (u := orjson.loads(e).get("usage"))]
    return usage  # type: ignore[no-any-return]


async def _learned(d) -> None:
    """Two requests that bound the prefill's block size to 16 (32 tokens in 2 blocks, 33
    in 3): until then a prompt of one block might be on the edge (the usual path)."""
    for length in (2 * BLOCK, 2 * BLOCK + 1):
        status, raw = await _post(d.proxy.url, GENERATE, _generate(_words(length, "learn")))
        assert status == 200, raw
    for sim in (*d.decodes, *d.prefills):
        sim.clear_requests()


async def _both(d, body: dict[str, Any], path: str = GENERATE) -> tuple[bytes, bytes]:
    status, got = await _post(d.proxy.url, path, body)
    assert status == 200, got
    _, reference = await _post(d.single.url, path, body)
    return got, reference


@pytest.mark.parametrize("length", [5, 17, 31, 47])
async def test_first_chunk_is_the_prefills_token_and_the_stream_equals_one_engines(length):
    async with deployment(n_prefill=1, n_decode=1, proxy=ON) as d:
        await _learned(d)
        transfers = d.decodes[0].counters.kv_transfers
        body = _generate(_words(length))
        got, reference = await _both(d, body)
        assert _events(got) == _events(reference)  # every chunk, byte for byte
        assert _usage(got)["prompt_tokens"] == length and _usage(got)["completion_tokens"] == 6
        (d_leg,) = d.decodes[0].generation_requests()
        t1 = _ids(got)[0]
        assert d_leg.body["token_ids"] == [*body["token_ids"], t1]
        assert d_leg.body["sampling_params"]["max_tokens"] == 5
        assert d.decodes[0].counters.kv_transfers == transfers + 1  # it read the prompt's KV


async def test_text_mode_and_min_tokens_continue_exactly():
    async with deployment(n_prefill=1, n_decode=1, proxy=ON) as d:
        await _learned(d)
        body = {**_generate(_words(9), min_tokens=3), "output_mode": "text"}
        got, reference = await _both(d, body)
        assert _events(got) == _events(reference)
        (p_leg,) = d.prefills[0].generation_requests()
        assert p_leg.body["sampling_params"]["min_tokens"] == 1  # EOS masked at t1 as well
        (d_leg,) = d.decodes[0].generation_requests()
        assert d_leg.body["sampling_params"]["min_tokens"] == 2


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_render_once_streams_start_with_the_prefills_token(path):
    proxy = {**ON, "render_once": True}
    async with deployment(n_prefill=1, n_decode=1, proxy=proxy) as d:
        await _learned(d)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if path == CHAT:
            body["messages"] = [{"role": "user", "content": _words(7)}]
        else:
            body["prompt"] = _words(7)
        got, reference = await _both(d, body, path)
        # what a PD answer has of its own (the decode's cache writes: none) aside
        strip = ("id", "created", "system_fingerprint", "usage")
        mine = [{k: v for k, v in orjson.loads(e).items() if k not in strip} for e in _events(got)]
        ref = [
            {k: v for k, v in orjson.loads(e).items() if k not in strip} for e in _events(reference)
        ]
        assert mine == ref
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [_usage(got)[k] for k in counts] == [_usage(reference)[k] for k in counts]
        (d_leg,) = [r for r in d.decodes[0].generation_requests() if r.path == GENERATE]
        assert d_leg.body["sampling_params"]["max_tokens"] == 5


@pytest.mark.parametrize("multiple", [1, 2, 3])
async def test_a_prompt_on_the_block_size_edge_takes_the_usual_decode(multiple):
    async with deployment(n_prefill=1, n_decode=1, proxy=ON) as d:
        body = _generate(_words(BLOCK * multiple, "edge"))
        got, reference = await _both(d, body)
        assert _ids(got) == _ids(reference)
        (d_leg,) = d.decodes[0].generation_requests()
        assert d_leg.body["token_ids"] == body["token_ids"]  # no t1: the decode would die
        assert d.decodes[0].engine.dead is None


async def test_the_block_size_is_learned_and_then_only_multiples_are_kept_back():
    async with deployment(n_prefill=1, n_decode=1, proxy=ON) as d:
        for length in (BLOCK * 2, BLOCK + 1, 2 * BLOCK + 1, 24, 30):  # bounds: 16..16
            _, raw = await _post(d.proxy.url, GENERATE, _generate(_words(length, f"l{length}")))
            assert _ids(raw)
        legs = d.decodes[0].generation_requests()
        continued = [len(r.body["token_ids"]) for r in legs]
        # 32: on the edge; 24 = 3 * 8 and 30 = 2 * 15 would be if B were 8 or 15: known not
        assert continued == [32, BLOCK + 2, 2 * BLOCK + 2, 25, 31]


async def test_a_decode_sent_prompt_and_t1_on_the_edge_dies_in_the_sim():
    """The negative control: what the proxy avoids kills the sim's decode, as vLLM's."""
    async with deployment(n_prefill=1, n_decode=1) as d:
        ids = model.tokenize(_words(BLOCK * 2, "dead"))
        p_body = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 1}}
        p_body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
        _, raw = await _post(d.prefills[0].url, GENERATE, p_body)
        answer = orjson.loads(raw)
        t1 = answer["choices"][0]["token_ids"][0]
        d_body = {"model": MODEL, "token_ids": [*ids, t1], "sampling_params": {"max_tokens": 4}}
        d_body["kv_transfer_params"] = answer["kv_transfer_params"]
        status, _ = await _post(d.decodes[0].url, GENERATE, d_body)
        assert status == 500
        assert d.decodes[0].engine.dead is not None
        status, _ = await _post(d.decodes[0].url, GENERATE, {**d_body, "kv_transfer_params": None})
        assert status == 500  # dead for every later request


@pytest.mark.parametrize("ending", ["stop", "max_tokens"])
async def test_t1_that_ends_the_request_sends_no_decode_and_releases_the_kv(ending):
    async with deployment(n_prefill=1, n_decode=1, proxy=ON) as d:
        prompt = _words(10, "stop")
        _, probe = await _post(d.single.url, GENERATE, _generate(prompt, tokens=1))
        first = model.detokenize(_ids(probe))
        body = _generate(prompt, stop=[first]) if ending == "stop" else _generate(prompt, tokens=1)
        got, reference = await _both(d, body)
        assert _events(got) == _events(reference)
        assert _usage(got)["completion_tokens"] == 1
        assert orjson.loads(_events(got)[0])["choices"][0]["finish_reason"] == (
            "stop" if ending == "stop" else "length"
        )
        # no decode of the request: the one leg a decode got is the release of P's KV
        registry = d.proxy.state.metrics.registry
        labels = {"outcome": "released"}
        await wait_for(lambda: registry.get_sample_value("pdproxy_released_kv_total", labels))
        assert d.prefills[0].engine.connector.held_blocks() == 0
        for leg in d.decodes[0].generation_requests():
            assert leg.body["sampling_params"]["max_tokens"] == 1  # the release leg


@pytest.mark.parametrize(
    ("sampling", "top"),
    [
        ({"n": 2}, {}),
        ({"logprobs": 1}, {}),
        ({"presence_penalty": 0.5}, {}),
        ({"stop": ["never seen"]}, {}),
        ({}, {"stream": False}),
        ({}, {"return_token_ids": True}),
    ],
    ids=["n", "logprobs", "penalty", "stop", "whole", "return_token_ids"],
)
async def test_what_cannot_be_kept_exact_takes_the_usual_path(sampling, top):
    async with deployment(n_prefill=1, n_decode=1, proxy=ON) as d:
        await _learned(d)
        body = {**_generate(_words(9, "usual"), **sampling), **top}
        if top.get("stream") is False:
            body.pop("stream_options")
        status, raw = await _post(d.proxy.url, GENERATE, body)
        assert status == 200, raw
        (d_leg,) = d.decodes[0].generation_requests()
        assert d_leg.body["token_ids"] == body["token_ids"]
        assert d_leg.body["sampling_params"] == body["sampling_params"]


async def test_a_sampled_request_gets_a_valid_sample_continued_after_t1():
    async with deployment(n_prefill=1, n_decode=1, proxy=ON) as d:
        await _learned(d)
        body = _generate(_words(9, "seeded"), tokens=8, temperature=0.9, seed=7)
        status, raw = await _post(d.proxy.url, GENERATE, body)
        assert status == 200, raw
        assert len(_ids(raw)) == 8 and _usage(raw)["completion_tokens"] == 8
        (d_leg,) = d.decodes[0].generation_requests()
        assert d_leg.body["token_ids"] == [*body["token_ids"], _ids(raw)[0]]
        assert d_leg.body["sampling_params"]["seed"] == 7  # the decode's generator restarts


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_render_once_stream_that_t1_ends_is_the_text_paths(path):
    proxy = {**ON, "render_once": True}
    async with deployment(n_prefill=1, n_decode=1, proxy=proxy) as d:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if path == CHAT:
            body["messages"] = [{"role": "user", "content": _words(7, "one")}]
        else:
            body["prompt"] = _words(7, "one")
        got, reference = await _both(d, body, path)
        strip = ("id", "created", "system_fingerprint", "usage")
        mine = [{k: v for k, v in orjson.loads(e).items() if k not in strip} for e in _events(got)]
        ref = [
            {k: v for k, v in orjson.loads(e).items() if k not in strip} for e in _events(reference)
        ]
        assert mine == ref
        assert _usage(got)["completion_tokens"] == 1
        legs = [r for r in d.decodes[0].generation_requests() if r.path == GENERATE]
        assert not [r for r in legs if r.body.get("stream")]  # the release leg only
