"""The OpenAI Python SDK works against pdproxy unchanged; streams arrive chunk by chunk."""

from __future__ import annotations

import time

import openai
import pytest

from tests.integration.conftest import MODEL, deployment

PROMPT = "an operator reads the proxy logs on a quiet sunday"


async def test_sdk_completions_and_chat(nixl_2p2d):
    d = nixl_2p2d
    via_proxy = openai.AsyncOpenAI(base_url=d.proxy.url + "/v1", api_key="sk-x", max_retries=0)
    direct = openai.AsyncOpenAI(base_url=d.single.url + "/v1", api_key="sk-x", max_retries=0)
    async with via_proxy, direct:
        got = await via_proxy.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0
        )
        ref = await direct.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0
        )
        assert got.choices[0].text == ref.choices[0].text and got.usage.completion_tokens == 10

        messages = [{"role": "user", "content": PROMPT}]
        chat = await via_proxy.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10
        )
        chat_ref = await direct.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10
        )
        assert chat.choices[0].message.content == chat_ref.choices[0].message.content

        stream = await via_proxy.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            pieces.extend(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        assert (
            "".join(pieces) == chat_ref.choices[0].message.content and usage.completion_tokens == 10
        )

        models = await via_proxy.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_sdk_sees_errors_as_exceptions(nixl_2p2d):
    for dec in nixl_2p2d.decodes:
        dec.set_faults(close_after_tokens=2)
    client = openai.AsyncOpenAI(base_url=nixl_2p2d.proxy.url + "/v1", api_key="sk-x", max_retries=0)
    async with client:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=10, stream=True
        )
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass


async def test_stream_is_flushed_chunk_by_chunk():
    async with deployment(1, 1, decode_tps=50) as d:
        client = openai.AsyncOpenAI(base_url=d.proxy.url + "/v1", api_key="sk-x", max_retries=0)
        async with client:
            started = time.monotonic()
            stream = await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=10, stream=True
            )
            arrivals = [time.monotonic() - started async for _ in stream]
        # 10 tokens at 50 tokens/s take ~0.2 s; the first must not wait for the last
        assert len(arrivals) >= 10
        assert arrivals[-1] - arrivals[0] > 0.1
