"""The OpenAI Python SDK talks to a sim unchanged."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from engines.sim import SimConfig, running_sim
from tests.sim.helpers import MODEL, PROMPT


async def test_completions_stream_and_not():
    async with (
        running_sim(SimConfig()) as sim,
        AsyncOpenAI(base_url=sim.url + "/v1", api_key="x") as client,
    ):
        full = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
        assert full.usage is not None and full.usage.completion_tokens == 5
        stream = await client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == full.usage.total_tokens


async def test_chat_stream_and_not():
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": PROMPT}]
    async with (
        running_sim(SimConfig()) as sim,
        AsyncOpenAI(base_url=sim.url + "/v1", api_key="x") as client,
    ):
        full = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=4,
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=4,
            stream=True,
        )
        chunks = [c async for c in stream]
        models = await client.models.list()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert full.choices[0].finish_reason == "length"
    assert [m.id for m in models.data] == [MODEL]


async def test_sdk_sees_vllm_errors():
    async with (
        running_sim(SimConfig()) as sim,
        AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="x", max_tokens=1)
        sim.set_faults(status=503)
        with pytest.raises(openai.InternalServerError):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
