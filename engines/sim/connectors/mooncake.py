"""Mooncake-like connector (vLLM 0.33, PROTOCOLS.md 1.6): concurrent legs, pull by transfer_id.

* P runs a bootstrap HTTP server (`bootstrap_port`, vLLM's default 8998) answering
  `GET /query` with `{dp_rank: {"engine_id", "worker_addr": {tp_rank: {pp_rank: "ip:port"}}}}`.
  Every rank's worker address is the one side channel.
* P holds a `do_remote_decode` request's blocks under its `transfer_id` and DP rank. Without
  a `transfer_id` it logs vLLM's "Missing transfer_id in kv_transfer_params from router!"
  and counts a contract violation.
* D resolves `remote_bootstrap_addr` /query, picks the rank whose engine id is
  `remote_engine_id` and pulls by `transfer_id`; P answers once its prefill is done, up to
  `kv_wait_timeout_s` (the legs run concurrently). An unknown engine id, the engine id of
  another rank than P ran on, or an unreachable P is a load failure (D recomputes); no KV
  within the timeout fails the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import orjson

from engines.sim import model
from engines.sim.connectors import ConnectorDeps, sidechannel
from engines.sim.connectors.transfer import (
    EXCHANGE_TIMEOUT_S,
    SIDE_CHANNEL_ERRORS,
    SideChannelConnector,
    accept_kv,
    load_failed,
    wait_failed,
)
from engines.sim.openai_api import GenRequest

log = logging.getLogger("engines.sim.mooncake")


class MooncakeConnector(SideChannelConnector):
    def __init__(self, deps: ConnectorDeps) -> None:
        super().__init__(deps)
        self._bootstrap: asyncio.Server | None = None

    async def start(self) -> None:
        await super().start()
        if self.cfg.role == "decode":
            return
        self._bootstrap = await asyncio.start_server(
            self._answer_query, self.cfg.kv_host, self.cfg.bootstrap_port
        )
        self.bootstrap_port = self._bootstrap.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._bootstrap is not None:
            self._bootstrap.close()
            await self._bootstrap.wait_closed()
        await super().stop()

    def query(self) -> dict[str, Any]:
        """The bootstrap /query answer (JSON object keys are strings)."""
        addr = f"{self.cfg.kv_host}:{self.kv_port}"
        return {
            str(rank): {"engine_id": engine_id, "worker_addr": {"0": {"0": addr}}}
            for rank, engine_id in enumerate(self.cfg.engine_ids)
        }

    async def _answer_query(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line = head.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/query":
                status, body = b"200 OK", orjson.dumps(self.query())
            else:
                status, body = b"404 Not Found", b'{"detail":"Not Found"}'
            writer.write(
                b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%s" % (status, len(body), body)
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    # decode side
    def must_fetch(self, req: GenRequest) -> bool:
        return bool((req.kv_transfer_params or {}).get("do_remote_prefill"))

    async def fetch(self, req: GenRequest) -> list[bytes] | None:
        params = req.kv_transfer_params or {}
        transfer_id, engine_id = params.get("transfer_id"), params.get("remote_engine_id")
        bootstrap = params.get("remote_bootstrap_addr")
        if not transfer_id or not engine_id or not bootstrap:
            return load_failed(req, self.counters, f"incomplete kv_transfer_params {params}")
        try:
            worker = _worker_for(await fetch_query(str(bootstrap)), str(engine_id))
        except SIDE_CHANNEL_ERRORS as exc:
            return load_failed(req, self.counters, f"bootstrap {bootstrap}: {exc!r}")
        if worker is None:
            return load_failed(req, self.counters, f"engine {engine_id} not in {bootstrap}/query")
        wait_s = self.cfg.kv_wait_timeout_s
        msg = {"op": "pull", "transfer_id": transfer_id, "engine_id": engine_id, "wait_s": wait_s}
        try:
            reply = await sidechannel.request(*worker, msg, wait_s + EXCHANGE_TIMEOUT_S)
        except SIDE_CHANNEL_ERRORS as exc:
            return load_failed(req, self.counters, f"side channel {worker}: {exc!r}")
        if reply.get("timeout"):
            raise wait_failed(req, self.counters, str(reply.get("error")))
        if not reply.get("ok"):
            return load_failed(req, self.counters, str(reply.get("error")))
        return accept_kv(req, reply.get("blocks") or [], self.counters)

    # prefill side
    def finished(self, req: GenRequest, kv: Sequence[bytes]) -> dict[str, Any] | None:
        params = req.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return None
        transfer_id = params.get("transfer_id")
        if not transfer_id:
            log.error("Missing transfer_id in kv_transfer_params from router!")
            self.counters.contract_violations += 1
            return None
        blocks = model.pack_blocks(kv, self.cfg.block_size)
        self.mailbox.put(str(transfer_id), blocks, {"dp_rank": req.dp_rank or 0})
        return None

    async def serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") != "pull":
            return await super().serve(msg)
        transfer_id = str(msg.get("transfer_id"))
        wait_s = min(float(msg.get("wait_s") or 0), self.cfg.kv_lease_s)
        parcel = await self.mailbox.ready(transfer_id, wait_s)
        if parcel is None:
            error = f"no KV for transfer {transfer_id} within {wait_s:g} s"
            return {"ok": False, "timeout": True, "error": error}
        owner = self.cfg.engine_ids[int(parcel.meta["dp_rank"])]
        if msg.get("engine_id") != owner:
            return {
                "ok": False,
                "error": f"transfer {transfer_id} is held by {owner}, not {msg.get('engine_id')}",
            }
        self.mailbox.take(transfer_id)
        self.sent_from(parcel)
        return {"ok": True, "blocks": parcel.blocks}


async def fetch_query(bootstrap_url: str) -> dict[str, Any]:
    """GET <bootstrap_url>/query with a one-shot HTTP/1.1 exchange."""
    parts = urlsplit(bootstrap_url)
    if not parts.hostname or parts.port is None:
        raise ValueError(f"bad bootstrap address {bootstrap_url!r}")
    return await asyncio.wait_for(_get_query(parts.hostname, parts.port), EXCHANGE_TIMEOUT_S)


async def _get_query(host: str, port: int) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"GET /query HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        raw = await reader.read()  # Connection: close, so EOF ends the answer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        status = head.split(b"\r\n", 1)[0]
        raise ValueError(f"/query answered {status!r}")
    answer = orjson.loads(body)
    if not isinstance(answer, dict):
        raise ValueError("/query answer is not an object")
    return answer


def _worker_for(answer: dict[str, Any], engine_id: str) -> tuple[str, int] | None:
    for info in answer.values():
        if isinstance(info, dict) and info.get("engine_id") == engine_id:
            addr = str(info["worker_addr"]["0"]["0"])
            host, _, port = addr.rpartition(":")
            return host, int(port)
    return None
