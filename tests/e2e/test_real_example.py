"""pdproxy in front of real vLLM CPU engines with the ExampleConnector (shared storage)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import external_tokens, output_text, post
from tests.e2e.test_real_nixl import body, isolated, path, prompt, proxy_config
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine


@pytest.mark.parametrize(("kind", "stream"), [("completions", False), ("chat", True)])
async def test_output_equals_single_engine_and_kv_loaded(example_pair, kind, stream):
    pair = example_pair
    text = prompt(f"example-{kind}")
    before = external_tokens(pair)
    async with running_proxy(proxy_config(pair)) as proxy:
        status, raw = await post(proxy.url, path(kind), body(pair, kind, text, stream))
    assert status == 200, raw
    moved = external_tokens(pair) - before
    _, ref_raw = await post(pair.decode_url, path(kind), isolated(body(pair, kind, text, False)))
    got = output_text(raw, chat=kind == "chat", stream=stream)
    assert got and got == output_text(ref_raw, chat=kind == "chat", stream=False)
    # the ExampleConnector moves whole 32-token blocks only
    assert moved >= 32 and moved % 32 == 0, moved
