"""Every sampling option of the real tier's matrix (tests/e2e/test_real_sampling.py) through
pdproxy with the id-embedding connectors, against sims: the fast tier's guard on shaping.

For each option: the answer equals a single engine's; a request served through both legs
sent the prefill the client's options clamped to one token (no stream, no stream options, no
minimum) and the decode the client's options untouched; a request vLLM cannot split (``n``,
``best_of`` > 1, prompt logprobs) went to a decode alone, exactly as the client sent it
(P2P-NCCL, whose decodes cannot serve a request alone, answers 400 instead). The sims are
strict: a prefill leg with ``n`` > 1 or prompt logprobs is refused with 400, as the
transfer it would start is not one a decode can read correctly.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from tests.e2e.test_real_sampling import CASES, CHAT, TWO_LEGS
from tests.integration.conftest import MODEL
from tests.integration.test_id_connectors_e2e import Case, fleet

CONNECTORS = [Case("moriio", "moriio", "READ"), Case("p2p-nccl", "p2p"), Case("mooncake", None)]
CLAMPED = {"stream", "stream_options", "min_tokens", "min_completion_tokens", "max_tokens"}
LEG_FIELDS = {"kv_transfer_params"}


def _choices(raw: bytes, stream: bool, chat: bool) -> list[tuple[int, str]]:
    if not stream:
        out = orjson.loads(raw)["choices"]
        return [(c["index"], (c.get("message") or {}).get("content") or c.get("text")) for c in out]
    texts: dict[int, str] = {}
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for c in orjson.loads(line[6:]).get("choices", []):
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return sorted(texts.items())


def _sent(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in LEG_FIELDS}


@pytest.mark.parametrize("connector", CONNECTORS, ids=lambda c: c.connector)
async def test_every_option_is_shaped_right_for_id_connectors(connector):
    async with fleet(connector) as (proxy, prefills, decodes, single), aiohttp.ClientSession() as s:
        for name, case in CASES.items():
            for engine in prefills + decodes:
                engine.clear_requests()
            chat, stream = case.path == CHAT, case.fields.get("stream") is True
            request = {"model": MODEL, "max_tokens": 8, "temperature": 0, **case.fields}
            async with s.post(proxy.url + case.path, json=request) as r:
                if case.served is not TWO_LEGS and connector.connector == "p2p-nccl":
                    # its decodes cannot serve a request alone: a clear 400, no engine asked
                    assert r.status == 400, (name, await r.text())
                    assert "cannot serve" in (await r.json())["error"]["message"]
                    assert not any(e.generation_requests() for e in prefills + decodes)
                    continue
                assert r.status == 200, (name, await r.text())
                got = _choices(await r.read(), stream, chat)
            plain = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
            async with s.post(single.url + case.path, json=plain) as r:
                assert r.status == 200, (name, await r.text())
                assert got == _choices(await r.read(), False, chat), name
            p_legs = [r.body for p in prefills for r in p.generation_requests()]
            d_legs = [r.body for d in decodes for r in d.generation_requests()]
            assert len(d_legs) == 1, name
            assert _sent(d_legs[0]) == request, name  # the decode: the client's options
            if case.served is TWO_LEGS:
                assert len(p_legs) == 1, name
                p_leg = _sent(p_legs[0])
                assert p_leg["max_tokens"] == 1 and p_leg["stream"] is False, name
                kept = {k: v for k, v in request.items() if k not in CLAMPED}
                assert {k: p_leg[k] for k in kept} == kept, name
                assert not CLAMPED - {"stream", "max_tokens"} & p_leg.keys(), name
            else:
                assert p_legs == [], (name, "served by a decode alone")
        assert all(e.counters.contract_violations == 0 for e in prefills + decodes)
