"""pdproxy in front of real vLLM CPU engines serving a real model (SmolLM2-135M-Instruct, NIXL).

The tiny random model proves that KV moves; this one proves the answer still makes sense after
the handoff: a chat question through pdproxy's prefill/decode pair gets the right English answer,
the one the decode engine gives on its own.
"""

from __future__ import annotations

import orjson
import pytest

from tests.e2e.conftest import external_tokens, output_text, post
from tests.e2e.test_real_nixl import isolated, proxy_config
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

QUESTION = "What is the capital of France?"


def chat(pair, stream: bool) -> dict:
    return {
        "model": pair.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 32,
        "temperature": 0,
        "stream": stream,
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_answer_through_the_pd_pair_names_paris(smollm2_nixl, stream, record_property):
    pair = smollm2_nixl
    before = external_tokens(pair)
    async with running_proxy(proxy_config(pair)) as proxy:
        # each test its own cache salt: the decode's prefix cache keeps what an earlier test
        # transferred, which would stand in for this test's transfer
        status, raw = await post(proxy.url, "/v1/chat/completions", isolated(chat(pair, stream)))
    assert status == 200, raw
    moved = external_tokens(pair) - before
    answer = output_text(raw, chat=True, stream=stream)
    record_property("answer", answer)
    print(f"{QUESTION!r} through pdproxy (stream={stream}): {answer!r}")
    assert "Paris" in answer, answer
    # the decode engine alone (its own cache salt: no transferred blocks) says the same
    ref_status, ref_raw = await post(
        pair.decode_url, "/v1/chat/completions", isolated(chat(pair, False))
    )
    assert ref_status == 200
    assert answer == output_text(ref_raw, chat=True, stream=False)
    # and the decode got the prompt as KV from the prefill
    prompt_tokens = orjson.loads(ref_raw)["usage"]["prompt_tokens"]
    assert prompt_tokens - 1 <= moved <= prompt_tokens, (moved, prompt_tokens)
