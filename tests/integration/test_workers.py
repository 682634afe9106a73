"""``pdproxy --workers 2`` as real processes (the supervisor owning the membership, two
SO_REUSEPORT workers) in front of sims: both workers serve, /status shows the whole proxy, an
admin write on one is routed by the other within 100 ms, ZMQ-registered engines are routable
on both, /metrics sums both, a SIGKILLed worker loses only its own requests and is replaced,
SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from bench.procs import process
from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from tests.metrics_contract import load_contract, parse_exposition
from tests.workers_harness import (
    MODEL,
    admin,
    complete,
    exit_code,
    pid_alive,
    status,
    workers_tree,
)

STREAM = {"stream": True, "max_tokens": 30}


async def test_both_workers_answer_on_one_port(tmp_path):
    async with workers_tree(tmp_path) as tree:
        assert len(await tree.fresh_pids(60)) == 2
        assert await tree.fresh_pids(1) <= tree.worker_pids()
        for session, pid in await tree.one_of_each():
            code, body = await complete(session, tree.url)
            assert code == 200 and orjson.loads(body)["choices"][0]["text"]
            body = await status(session, tree.url)  # still the same worker: keep-alive
            assert body["worker"] == {"pid": pid, "index": body["worker"]["index"], "workers": 2}
            for page in ("/dashboard", "/dashboard/data"):  # served by every worker
                async with session.get(tree.url + page) as r:
                    assert r.status == 200, page


async def test_an_admin_add_on_one_worker_is_routed_by_the_other_within_100_ms(tmp_path):
    async with (
        workers_tree(tmp_path) as tree,
        running_sim(SimConfig(role="decode", connector="nixl", model=MODEL)) as extra,
    ):
        (a, _), (b, _) = await tree.one_of_each()
        address = extra.url.split("://")[1]
        code, answer = await admin(a, tree.url, "add", {"type": "decode", "instance": address})
        added = time.monotonic()
        assert code == 200 and answer["instance"]["url"] == extra.url
        assert answer["instance"]["state"] == "ready" and answer["instance"]["routable"]
        while extra.url not in await _routable(b, tree.url):
            assert time.monotonic() - added < 0.1, "the other worker did not see the addition"
        for _ in range(2):  # round robin over the two decodes: one of them is the new one
            assert (await complete(b, tree.url))[0] == 200
        assert len(extra.generation_requests()) == 1
        # The owner's refusals reach the client as they are, through either worker.
        code, answer = await admin(b, tree.url, "add", {"type": "decode", "instance": address})
        assert code == 409 and answer["error"]["type"] == "AdminError"
        code, _ = await admin(b, tree.url, "remove", {"instance": "127.0.0.1:1"})
        assert code == 404
        code, answer = await admin(
            b, tree.url, "add", {"type": "decode", "instance": "127.0.0.1:9"}
        )
        assert code == 400 and "did not answer its probe" in answer["error"]["message"]
        code, _ = await admin(b, tree.url, "add", {"type": "bogus", "instance": address})
        assert code == 400  # refused by the worker itself, before the owner
        code, answer = await admin(b, tree.url, "remove", {"instance": address})
        assert code == 200 and answer["status"] == "draining"
        removed = time.monotonic()
        while extra.url in await _routable(a, tree.url):
            assert time.monotonic() - removed < 0.1, "the other worker still routes to it"


async def _routable(session: aiohttp.ClientSession, url: str) -> set[str]:
    return {i["url"] for i in (await status(session, url))["instances"] if i["routable"]}


async def test_zmq_registered_engines_are_routable_on_every_worker(tmp_path):
    async with workers_tree(tmp_path, register=True, n_prefill=2, n_decode=2) as tree:
        urls = {s.url for s in tree.prefills + tree.decodes}
        for session, _ in await tree.one_of_each():
            deadline = time.monotonic() + 5
            while await _routable(session, tree.url) != urls:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            for _ in range(2):
                assert (await complete(session, tree.url))[0] == 200
        assert all(len(d.generation_requests()) == 2 for d in tree.decodes)


async def test_metrics_sum_both_workers(tmp_path):
    async with workers_tree(tmp_path) as tree:
        (a, _), (b, _) = await tree.one_of_each()
        for session, count in ((a, 7), (b, 5)):
            for _ in range(count):
                assert (await complete(session, tree.url))[0] == 200
        for session in (a, b):  # the same figures whichever worker answers
            text = await _settled_metrics(session, tree.url)
            assert (
                _value(text, 'pdproxy_requests_total{endpoint="/v1/completions",outcome="ok"}')
                == 12
            )
            legs = f'pdproxy_endpoint_requests_total{{role="decode",url="{tree.decodes[0].url}"}}'
            assert _value(text, legs) == 12
            assert _value(text, "pdproxy_requests_in_flight") == 0
            assert _value(text, 'pdproxy_endpoints{role="decode",state="ready"}') == 1
            assert _value(text, 'pdproxy_engine_scrapes_total{outcome="ok"}') > 0  # the owner's


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def _settled_metrics(session: aiohttp.ClientSession, url: str) -> str:
    """``/metrics`` once the in-flight gauge reads 0. Counters are summed from the workers'
    files as they change, but a worker writes its live gauges every 0.25 s (its sampler): the
    other worker's gauge may still show a request that ended since. Bounded at 4 s."""
    deadline = time.monotonic() + 4
    while True:
        text = await _metrics(session, url)
        if _value(text, "pdproxy_requests_in_flight") == 0 or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.05)


def _value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert match is not None, series
    return float(match.group(1))


async def test_a_killed_worker_loses_only_its_requests_and_is_restarted(tmp_path):
    async with workers_tree(tmp_path, decode_tps=15) as tree:
        (a, pid_a), (b, pid_b) = await tree.one_of_each()
        async with _streams_in_flight(tree, 16) as streams:
            on_a = await _legs_in_flight(a, tree.url)
            on_b = await _legs_in_flight(b, tree.url)
            assert on_a + on_b == 16
            os.kill(pid_a, signal.SIGKILL)
            results = await asyncio.gather(*streams)
        assert results.count("whole") == on_b and results.count("cut") == on_a
        deadline = time.monotonic() + 15
        while not (await tree.fresh_pids(4)) - {pid_a, pid_b}:
            assert time.monotonic() < deadline, "the killed worker was not replaced"
            await asyncio.sleep(0.1)
        assert len(tree.worker_pids()) == 2 and pid_a not in tree.worker_pids()
        assert "exited with status -9; restarting it" in tree.log.read_text()
        # Its in-flight gauges left with it (mark_process_dead), its counts stayed.
        text = await _metrics(b, tree.url)
        assert _value(text, "pdproxy_requests_in_flight") == 0


@contextlib.asynccontextmanager
async def _streams_in_flight(tree: Any, count: int) -> AsyncIterator[list[asyncio.Task[str]]]:
    """``count`` streams, each on a fresh connection (so the kernel spreads them over the
    workers), returned once the decode has every one of them."""
    clients = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        for _ in range(count)
    ]
    try:
        streams = [asyncio.create_task(_stream(c, tree.url)) for c in clients]
        deadline = time.monotonic() + 5
        while len(tree.decodes[0].generation_requests()) < count:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        yield streams
    finally:
        for c in clients:
            await c.close()


async def _stream(session: aiohttp.ClientSession, url: str) -> str:
    try:
        code, body = await complete(session, url, **STREAM)
    except aiohttp.ClientError:
        return "cut"
    if code == 200 and body.rstrip().endswith(b"data: [DONE]"):
        return "whole"
    return f"{code}: {body[-200:]!r}"


async def _legs_in_flight(session: aiohttp.ClientSession, url: str) -> int:
    """The answering worker's own legs on the decodes (its figures are written as it answers)."""
    body = await status(session, url)
    decodes = {i["url"] for i in body["instances"] if i["role"] == "decode"}
    (own,) = (w for w in body["workers"] if w["pid"] == body["worker"]["pid"])
    return sum(n for url, n in own["legs"].items() if url in decodes)


async def test_status_and_the_dashboard_show_the_whole_proxy(tmp_path):
    """In flight, legs per instance and the queue are summed over both workers (each worker's
    figures at most 0.25 s old), with each worker's share; back to 0 when the streams end."""
    async with workers_tree(tmp_path, decode_tps=10) as tree:
        decode = tree.decodes[0].url
        async with _streams_in_flight(tree, 20) as streams:
            body = await _status_until(tree, lambda b: b["in_flight"] == 20)
            for _ in range(5):  # any worker, any moment: the same whole-proxy figures
                async with aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(force_close=True)
                ) as fresh:
                    body = await status(fresh, tree.url)
                _assert_whole(body, tree, decode, 20)
                await asyncio.sleep(0.1)
            assert all(w["in_flight"] > 0 for w in body["workers"]), body["workers"]
            data = await _dashboard(tree.url)
            assert data["proxy"]["in_flight"] == 20 and len(data["proxy"]["workers"]) == 2
            assert {i["url"]: i["in_flight"] for i in data["instances"]}[decode] == 20
            assert await asyncio.gather(*streams) == ["whole"] * 20
        body = await _status_until(tree, lambda b: b["in_flight"] == 0)
        _assert_whole(body, tree, decode, 0)
        data = await _dashboard(tree.url)
        assert data["totals"]["requests"]["ok"] == 20  # both workers' requests


async def _dashboard(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as page, page.get(url + "/dashboard/data") as r:
        assert r.status == 200
        data: dict[str, Any] = orjson.loads(await r.read())
        return data


def _assert_whole(body: dict[str, Any], tree: Any, decode: str, streams: int) -> None:
    workers = body["workers"]
    assert [w["index"] for w in workers] == [0, 1]
    assert {w["pid"] for w in workers} == tree.worker_pids()
    assert body["worker"]["pid"] in tree.worker_pids() and body["worker"]["workers"] == 2
    assert body["in_flight"] == sum(w["in_flight"] for w in workers) == streams
    assert body["queue_depth"] == 0
    by_url = {i["url"]: i["in_flight"] for i in body["instances"]}
    assert by_url == {tree.prefills[0].url: 0, decode: streams}
    assert sum(w["legs"].get(decode, 0) for w in workers) == streams


async def _status_until(tree: Any, done: Any) -> dict[str, Any]:
    """``/status`` once ``done(body)``: a worker writes its figures every 0.25 s. Bounded."""
    deadline = time.monotonic() + 3
    async with aiohttp.ClientSession() as session:
        while True:
            body = await status(session, tree.url)
            if done(body):
                return body
            assert time.monotonic() < deadline, body
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_sigterm_drains_every_worker_and_exits_0(tmp_path, sig):
    async with workers_tree(tmp_path, decode_tps=15) as tree:
        workers = tree.worker_pids()
        run_dir = _metrics_dir(next(iter(workers)))
        async with _streams_in_flight(tree, 10) as streams:
            tree.proc.send_signal(sig)
            results = await asyncio.gather(*streams)
        assert results == ["whole"] * 10  # drained, not cut
        assert await exit_code(tree.proc, 20) == 0
        assert not any(pid_alive(p) for p in workers)
        assert not _exists(run_dir)


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _metrics_dir(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return env[b"PROMETHEUS_MULTIPROC_DIR"].decode()


async def test_metrics_hold_the_committed_contract_under_workers(tmp_path):
    async with workers_tree(tmp_path, n_decode=2) as tree:
        (a, _), (b, _) = await tree.one_of_each()
        tree.decodes[0].set_faults(status=500)  # its legs fail and are retried on the other
        for session in (a, b, a, b):
            assert (await complete(session, tree.url, stream=True))[0] == 200
        tree.decodes[0].clear_faults()
        texts = [await _metrics(s, tree.url) for s in (a, b)]
    contract = load_contract()
    for text in texts:
        types, samples = parse_exposition(text)
        assert {n for n in types if n.startswith("pdproxy_")} == set(contract)
        for name, family in contract.items():
            assert types[name] == family.type, name
            for labels in samples.get(name, ()):
                assert labels == family.labels, (name, sorted(labels))
        assert "# HELP pdproxy_requests_total Client requests by endpoint" in text
        assert _value(text, 'pdproxy_retries_total{leg="decode",reason="5xx"}') >= 1


async def test_a_worker_that_cannot_start_stops_the_tree_with_status_1(tmp_path):
    """As gunicorn: a boot failure is not retried forever (here a certificate that is not one)."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    args = [sys.executable, "-m", "pdproxy", "--workers", "2", "--host", "127.0.0.1"]
    args += ["--port", str(free_port()), "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9"]
    args += ["--ssl-certfile", str(bad), "--ssl-keyfile", str(bad)]
    log = tmp_path / "pdproxy.log"
    with process(args, str(log)) as proc:
        assert await exit_code(proc, 30) == 1
    assert "could not start; stopping" in log.read_text()


async def test_a_configuration_only_the_connector_refuses_exits_2_before_any_worker(tmp_path):
    args = [sys.executable, "-m", "pdproxy", "--workers", "2", "--host", "127.0.0.1"]
    args += ["--port", str(free_port()), "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9"]
    args += ["--kv-connector", "p2p-nccl", "--pd-threshold-tokens", "64"]
    log = tmp_path / "pdproxy.log"
    with process(args, str(log)) as proc:
        assert await exit_code(proc, 30) == 2
    text = log.read_text()
    assert "--pd-threshold-tokens and --decode-only-fallback need decodes" in text
    assert "worker 1/2 started" not in text


async def test_a_tenants_limits_hold_exactly_across_the_workers(tmp_path):
    # tokens_per_minute 1000 and ~100 tokens a request: 10 a minute, whichever worker
    # takes them. Dividing the limit between two workers would let the first serve only
    # 5, and the second 5 more.
    tenants = tmp_path / "tenants.json"
    tenants.write_text('{"metered": {"tokens_per_minute": 1000}}')
    extra = ("--tenants", str(tenants), "--tenant-header", "X-Tenant")
    async with workers_tree(tmp_path, extra=extra) as tree:
        (a, _), (b, _) = await tree.one_of_each()
        head = {"X-Tenant": "metered"}
        prompt = "flow " * 72  # ~90 tokens by pdproxy's estimate, and 10 asked for
        answers = []
        for _ in range(12):
            answers.append(await complete(a, tree.url, prompt=prompt, max_tokens=10, headers=head))
        codes = [code for code, _ in answers]
        assert codes == [200] * 10 + [429, 429], codes
        code, body = await complete(b, tree.url, prompt=prompt, max_tokens=10, headers=head)
        assert code == 429 and b"rate_limit_exceeded" in body  # the other worker's minute too
