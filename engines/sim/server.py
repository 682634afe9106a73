"""Lifecycle of one sim engine: start on the current loop, refuse/restore, stop or crash.

With ``ssl_certfile`` the HTTP listener speaks HTTPS, as vLLM's ``--ssl-*`` flags make
uvicorn do; the KV side channel and the Mooncake bootstrap server stay plain TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from engines.sim import registration
from engines.sim.app import SimApp
from engines.sim.config import Faults, SimConfig
from engines.sim.engine import Engine
from engines.sim.http import Connection, ServerState
from engines.sim.kv_events import KVEventPublisher
from engines.sim.kvstore import KVEvents
from engines.sim.metrics import Counters, Gauges, parse_metrics, render
from engines.sim.openai_api import GENERATE_PATH
from engines.sim.records import RequestRecord

log = logging.getLogger("engines.sim")


class SimServer:
    """One running sim: HTTP listener, side channel (via its connector), lease timers."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.app = SimApp(config, self.engine)
        self.app.on_faults = self._apply_faults
        self.state = ServerState(self.app.handle, config.keep_alive_s)
        self.port = config.port
        self._listener: asyncio.Server | None = None
        self._ssl: ssl.SSLContext | None = None
        self._restore: asyncio.TimerHandle | None = None
        self._relisten: asyncio.Task[None] | None = None
        self.heartbeat: registration.Heartbeat | None = None
        self.kv_events: KVEventPublisher | None = None  # --kv-events-endpoint

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://{_url_host(self.config.host)}:{self.port}"

    @property
    def zmq_address(self) -> str:
        """The zmq_address this engine registers and peers embed in request ids."""
        cfg = self.config
        if cfg.zmq_address:
            return cfg.zmq_address
        port = self.engine.connector.kv_port
        if cfg.connector == "moriio" or cfg.register_format != "p2p":
            return registration.moriio_zmq_address(cfg.kv_host, port, port)
        return f"{cfg.kv_host}:{port}"

    def registrant(self) -> registration.Registrant:
        cfg = self.config
        host = cfg.kv_host if cfg.host in ("0.0.0.0", "", "::") else cfg.host
        return registration.Registrant(
            role=registration.ROLE_CODES.get(cfg.role, "P"),
            http_address=f"{host}:{self.port}",
            zmq_address=self.zmq_address,
            dp_size=cfg.dp_size,
            tp_size=cfg.tp_size,
            transfer_mode=cfg.transfer_mode,
        )

    async def start(self) -> None:
        self._ssl = server_ssl_context(self.config)
        await self.engine.connector.start()
        await self._listen()
        self._publish_kv_events()  # after the listener: its endpoint may name the HTTP port
        self._apply_faults(self.config.faults)
        log.info(
            "pdproxy-sim %s role=%s connector=%s listening on %s (kv port %d)",
            self.config.engine_id,
            self.config.role,
            self.config.connector,
            self.url,
            self.engine.connector.kv_port,
        )
        if self.engine.connector.bootstrap_port is not None:
            log.info(
                "bootstrap server on http://%s:%d/query",
                _url_host(self.config.kv_host),
                self.engine.connector.bootstrap_port,
            )
        self._start_heartbeat()

    def _publish_kv_events(self) -> None:
        cfg = self.config
        if cfg.kv_events_endpoint is None:
            return
        replay = cfg.kv_events_replay_endpoint
        publisher = KVEventPublisher(
            cfg.kv_events_endpoint.format(port=self.port),
            replay.format(port=self.port) if replay else None,
            encoding=cfg.kv_events_encoding,
        )
        publisher.start()
        self.kv_events = publisher
        prefix = self.engine.prefix
        prefix.events = KVEvents(prefix.block_size, cfg.kv_events_encoding, publisher.publish)

    def _start_heartbeat(self) -> None:
        cfg = self.config
        if cfg.register is None:
            return
        if cfg.role == "both":
            log.info("role both does not register with %s", cfg.register)
            return
        payload = registration.build_payload(cfg.register_format, self.registrant())
        identity = self.zmq_address if cfg.register_format == "p2p" else None
        self.heartbeat = registration.Heartbeat(
            cfg.register, payload, cfg.register_interval_s, identity=identity
        )
        self.heartbeat.start()
        log.info(
            "registering with %s every %gs: %s", cfg.register, cfg.register_interval_s, payload
        )

    async def stop(self) -> None:
        """Stop cleanly: open connections are closed. A second call (or after kill) is a no-op."""
        await self._shut_down(Connection.abort)

    async def kill(self) -> None:
        """Stop as a crashed process would: open connections are reset (RST). Idempotent."""
        await self._shut_down(Connection.reset)

    async def _shut_down(self, drop: Callable[[Connection], None]) -> None:
        if self.state.stopping:
            return
        self.state.stopping = True
        # registration heartbeats stop (no goodbye is sent: vLLM has none)
        if self.heartbeat is not None:
            await self.heartbeat.stop()
        # stop accepting, cancel the restore timer and a pending re-listen
        self._close_listener()
        if self._restore is not None:
            self._restore.cancel()
        if self._relisten is not None:
            self._relisten.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._relisten
            self._close_listener()
        # drop every connection and cancel the request tasks
        tasks = [c.task for c in self.state.connections if c.task is not None]
        for conn in list(self.state.connections):
            drop(conn)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # connection_lost runs: aborts recorded, idle timers cancelled
        # the connector: side channel, leases, background pushes, bootstrap server
        await self.engine.connector.stop()
        if self.kv_events is not None:  # a crashed engine's sockets close with it
            await self.kv_events.aclose()

    async def _listen(self) -> None:
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(
            lambda: Connection(self.state),
            self.config.host,
            self.port,
            reuse_address=True,
            backlog=2048,
            ssl=self._ssl,
        )
        self.port = self._listener.sockets[0].getsockname()[1]

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _apply_faults(self, faults: Faults) -> None:
        if self.state.stopping:  # a stopped or killed server never listens again
            return
        refuse = faults.refuse_connections
        if self._restore is not None:
            self._restore.cancel()
            self._restore = None
        if refuse is False or refuse == 0:
            if self._listener is None and (self._relisten is None or self._relisten.done()):
                self._relisten = asyncio.get_running_loop().create_task(self._listen())
            return
        self._close_listener()
        if refuse is not True:
            loop = asyncio.get_running_loop()
            self._restore = loop.call_later(float(refuse), self.app.set_faults, Faults())


class SimHandle:
    """What `running_sim` yields: addresses, records, counters, faults, kill and restart.

    Everything reads the current server, so after `restart()` the same handle serves the new
    engine (its records and counters start empty).
    """

    def __init__(self, server: SimServer) -> None:
        self._server = server
        self.config = server.config

    async def kill(self) -> None:
        """Crash the engine; idempotent.

        Heartbeats stop, the listener closes (connect is refused), open connections are
        reset, request tasks, lease timers and the KV side channel stop, and the in-memory
        KV (held blocks, prefix cache) is lost.
        """
        await self._server.kill()

    async def restart(self) -> None:
        """Kill (if running), then start a fresh engine on the same ports.

        Same config, HTTP port, KV port and bootstrap port (registrations and peers' KV
        params stay valid); new empty state: records, counters, KV, and the faults of the
        config (run-time `set_faults` and `pause_registration` do not survive).
        """
        old = self._server
        await old.kill()
        connector = old.engine.connector
        events = old.kv_events
        config = dataclasses.replace(
            old.config,
            port=old.port,
            kv_events_endpoint=events.endpoint if events else old.config.kv_events_endpoint,
            kv_events_replay_endpoint=(
                events.replay_endpoint if events else old.config.kv_events_replay_endpoint
            ),
            kv_port=connector.kv_port,
            bootstrap_port=connector.bootstrap_port or old.config.bootstrap_port,
        )
        server = SimServer(config)
        await server.start()
        self._server = server

    async def aclose(self) -> None:
        """Stop the current server cleanly (a no-op if it was killed)."""
        await self._server.stop()

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def kv_events(self) -> KVEventPublisher | None:
        """The KV events publisher (its ``faults``: drop batches, stop, no replay)."""
        return self._server.kv_events

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def kv_port(self) -> int:
        return self._server.engine.connector.kv_port

    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def engine_ids(self) -> list[str]:
        """Engine id per DP rank (what MoRIIO/Mooncake report as remote_engine_id)."""
        return self.config.engine_ids

    @property
    def zmq_address(self) -> str:
        """The zmq_address it registers (and a proxy embeds in request ids)."""
        return self._server.zmq_address

    @property
    def bootstrap_port(self) -> int | None:
        return self._server.engine.connector.bootstrap_port

    @property
    def bootstrap_url(self) -> str | None:
        port = self.bootstrap_port
        return None if port is None else f"http://{_url_host(self.config.kv_host)}:{port}"

    @property
    def heartbeat(self) -> registration.Heartbeat | None:
        """The registration sender, or None when the sim does not register."""
        return self._server.heartbeat

    def registration_payload(self) -> dict[str, Any]:
        """The dict the sim sends (or would send) in its configured format."""
        return registration.build_payload(self.config.register_format, self._server.registrant())

    def pause_registration(self) -> None:
        if self._server.heartbeat is not None:
            self._server.heartbeat.pause()

    def resume_registration(self) -> None:
        if self._server.heartbeat is not None:
            self._server.heartbeat.resume()

    @property
    def requests(self) -> list[RequestRecord]:
        return self._server.app.recorder.all()

    def generation_requests(self) -> list[RequestRecord]:
        return [
            r
            for r in self.requests
            if r.method == "POST" and (r.path.startswith("/v1/") or r.path == GENERATE_PATH)
        ]

    def clear_requests(self) -> None:
        self._server.app.recorder.clear()

    @property
    def counters(self) -> Counters:
        return self._server.engine.counters

    @property
    def engine(self) -> Engine:
        """The current engine core (``dead`` once it died; its connector's held KV)."""
        return self._server.engine

    def gauges(self) -> Gauges:
        return self._server.engine.gauges()

    def metrics_text(self) -> str:
        return render(self.counters, self.gauges(), self.config.model)

    def metrics(self) -> dict[str, float]:
        """The /metrics values: `name{labels}` keys, and bare `name` summed over labels."""
        return parse_metrics(self.metrics_text())

    def set_faults(self, faults: Faults | None = None, **kwargs: Any) -> None:
        self._server.app.set_faults(faults or Faults.from_dict(kwargs))

    def clear_faults(self) -> None:
        self._server.app.set_faults(Faults())

    @property
    def faults(self) -> Faults:
        return self._server.app.faults

    def records_json(self) -> bytes:
        return orjson.dumps([r.as_dict() for r in self.requests])


@contextlib.asynccontextmanager
async def running_sim(
    config: SimConfig | None = None, **overrides: Any
) -> AsyncIterator[SimHandle]:
    """Run a sim on the current loop; everything is stopped on exit."""
    if config is None:
        config = SimConfig(**overrides)
    elif overrides:
        config = dataclasses.replace(config, **overrides)
    server = SimServer(config)
    await server.start()
    handle = SimHandle(server)
    try:
        yield handle
    finally:
        await handle.aclose()


def server_ssl_context(config: SimConfig) -> ssl.SSLContext | None:
    """The listener's context, built as uvicorn builds vLLM's; None for plain HTTP."""
    if config.ssl_certfile is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    context.verify_mode = ssl.VerifyMode(config.ssl_cert_reqs)
    if config.ssl_ca_certs is not None:
        context.load_verify_locations(config.ssl_ca_certs)
    return context


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    with contextlib.suppress(OSError):
        if socket.inet_pton(socket.AF_INET6, host):
            return f"[{host}]"
    return host
