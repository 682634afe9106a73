"""The only module that imports aiohttp (and ``pdproxy.upstream.http1``): pooled HTTP to the
engines.

The request legs go through pdproxy's own HTTP/1.1 client (``pdproxy.upstream.http1``, on
httptools), the probes and scrapes through one small aiohttp ``ClientSession``; both are created in
the app's lifespan. Their exceptions are mapped here to ``pdproxy.errors`` (httpx's
``map_httpcore_exceptions`` pattern) so nothing above this module sees either. The mapping
keeps retry-safety apart: ``UpstreamConnectError`` means nothing reached the engine. An
answer that is not usable HTTP (``http1.MalformedResponse``) is an ``UpstreamProtocolError``
(502, retried before the client's response starts, counted against the engine); a body
past ``--max-response-body-bytes`` a plain ``UpstreamError`` (502, neither retried nor
counted: the size is the request's doing as much as the engine's).

``https://`` engines are verified by aiohttp's defaults, or, given ``EngineTLS``, by one
``SSLContext`` (its CA, and a client certificate for mTLS) shared by both pools. A failed
or refused TLS handshake is a connect error: the engine never read the request. (A TLS 1.3
engine that refuses pdproxy's certificate by a reset, as uvicorn does, looks like any reset.)
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson

from pdproxy.config.upstream import EngineTLS, PoolLimits, Timeouts
from pdproxy.errors import (
    ConfigError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from pdproxy.upstream import http1

_PROBE_CONNECTIONS = 16


_FAILURES = (aiohttp.ClientError, OSError, asyncio.TimeoutError)
_LEG_FAILURES = (http1.HTTPError, OSError, asyncio.TimeoutError)

# OpenSSL reasons of the alerts a server sends when it refuses the handshake over
# certificates; TLS 1.3 lets one arrive after the client's handshake has ended (so aiohttp
# raises it while reading), but the server never read the request.
_REFUSED_HANDSHAKE = re.compile(r"ALERT_(\w*CERTIFICATE\w*|UNKNOWN_CA|ACCESS_DENIED)")


def _translate(exc: BaseException, leg: str, url: str) -> UpstreamError:
    """The most specific pdproxy error for an aiohttp/asyncio failure."""
    tls_reason = _tls_failure(exc)
    if tls_reason is not None:
        return UpstreamConnectError(
            f"TLS handshake with {leg} engine {url} failed ({tls_reason})", leg=leg
        )
    if isinstance(exc, http1.ResponseTooLarge):
        return UpstreamError(
            f"{leg} engine {url} answered over {exc.limit} bytes (--max-response-body-bytes)",
            leg=leg,
        )
    if isinstance(exc, http1.MalformedResponse):
        return UpstreamProtocolError(f"{leg} engine {url} answered malformed HTTP: {exc}", leg=leg)
    connect_errors = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
    if isinstance(exc, (*connect_errors, http1.ConnectFailed)):
        return UpstreamConnectError(f"cannot connect to {leg} engine {url}", leg=leg)
    timeouts = (aiohttp.SocketTimeoutError, asyncio.TimeoutError, http1.ReadTimeout)
    if isinstance(exc, timeouts):
        return UpstreamTimeout(f"{leg} engine {url} did not answer in time", leg=leg)
    return UpstreamProtocolError(
        f"{leg} engine {url} broke the connection ({type(exc).__name__})", leg=leg
    )


def _tls_failure(exc: BaseException) -> str | None:
    """OpenSSL's reason when ``exc`` is a failed or refused handshake, else None."""
    if isinstance(exc, http1.ConnectFailed) and exc.tls is not None:
        return _ssl_reason(exc.tls)
    if isinstance(exc, aiohttp.ClientSSLError):  # failed while connecting
        return _ssl_reason(exc.os_error)
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLError) and _REFUSED_HANDSHAKE.search(cause.reason or ""):
        return str(cause.reason)
    return None


def _ssl_reason(error: OSError) -> str:
    if isinstance(error, ssl.SSLCertVerificationError):  # which check: CA, name, dates
        return f"{error.reason}: {error.verify_message}"
    return getattr(error, "reason", None) or "TLS error"


def _client_ssl(tls: EngineTLS | None) -> ssl.SSLContext | bool:
    """The context both pools verify ``https://`` engines with; True: aiohttp's default."""
    if tls is None or (tls.ca_certs is None and tls.certfile is None):
        return True
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_certs)
    except OSError as exc:
        raise _unloadable(f"--engine-ca-certs {tls.ca_certs}", exc) from exc
    if tls.certfile is not None:
        try:
            context.load_cert_chain(tls.certfile, tls.keyfile)
        except OSError as exc:
            raise _unloadable(f"--engine-client-cert {tls.certfile} (or its key)", exc) from exc
    return context


def _unloadable(what: str, exc: OSError) -> ConfigError:
    # strerror only: OpenSSL's reason or the OS's, never the file's bytes
    return ConfigError(f"cannot load {what}: {exc.strerror or type(exc).__name__}")


@contextlib.contextmanager
def _mapped_errors(leg: str, url: str) -> Iterator[None]:
    try:
        yield
    except _FAILURES as exc:
        raise _translate(exc, leg, url) from exc


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or ``UpstreamError`` (the connection dropped) past ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            response.close()
            raise UpstreamError(f"{response.url} answered over {limit} bytes", leg="probe")
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass(slots=True)
class UpstreamResponse:
    """An engine's answer whose headers have arrived. The caller must ``close()`` it (or
    ``release()`` it once read whole)."""

    status: int
    content_type: str
    leg: str
    url: str
    _response: http1.Response
    _read_timeout: float | None = None  # each silence of the body; None: a stream's

    async def read_all(self) -> bytes:
        """The whole body (bounded by the read timeout unless the leg was a stream); then the
        connection is pooled again, or dropped if reading failed."""
        try:
            data = await self._response.read_all(self._read_timeout)
        except BaseException as exc:
            self.close()
            if isinstance(exc, _LEG_FAILURES):
                raise _translate(exc, self.leg, self.url) from exc
            raise
        self.release()
        return data

    async def read_chunk(self) -> bytes:
        """Whatever body bytes have arrived (waiting for some), unparsed; b"" at the end.

        Per streamed token, so a plain coroutine rather than layers of async generators.
        """
        try:
            return await self._response.read_chunk()
        except _LEG_FAILURES as exc:
            raise _translate(exc, self.leg, self.url) from exc

    def push_to(self, sink: Callable[[bytes], bool] | None) -> None:
        """Offer the body's bytes to ``sink`` as they arrive (``http1.Response.push_to``)."""
        self._response.push_to(sink)

    def header(self, name: str) -> str | None:
        """One of the answer's headers (case-insensitive), if it has it: a repeated one's
        values joined with ", " (Set-Cookie and singletons: the first); all of them are in
        ``http1.Response.headers``."""
        return self._response.headers.get(name.lower())

    def release(self) -> None:
        """Done with a fully read body: the connection goes back to the pool."""
        self._response.release()

    def close(self) -> None:
        """Abandon the answer: the connection is dropped, and vLLM aborts the request."""
        self._response.close()


_Session = TypeVar("_Session", aiohttp.ClientSession, http1.Pool)


class EngineClient:
    def __init__(
        self,
        timeouts: Timeouts,
        pool: PoolLimits,
        probe_authorization: str | None = None,
        *,
        tls: EngineTLS | None = None,
    ) -> None:
        self._timeouts = timeouts
        self._pool = pool
        self._tls = tls
        # Engines started with vLLM's --api-key answer their /v1/* probes only with it.
        self._probe_headers = (
            {"Authorization": probe_authorization} if probe_authorization is not None else {}
        )
        self._legs: http1.Pool | None = None
        self._probe_session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open both pools; raises ``ConfigError`` when the engine TLS files do not load."""
        verify = _client_ssl(self._tls)
        # The legs: pdproxy's own HTTP/1.1 client (``pdproxy.upstream.http1``), a third of the CPU
        # of a short request cheaper than aiohttp's. A stream's body has no read timeout:
        # its silence is bounded by the relay's watchdog.
        self._legs = http1.Pool(
            limit=self._pool.max_connections,
            limit_per_host=self._pool.max_connections_per_host,
            keepalive_expiry=self._pool.keepalive_expiry,
            connect_timeout=self._timeouts.connect,
            ssl_context=verify if isinstance(verify, ssl.SSLContext) else None,
            max_body=self._pool.max_response_body_bytes,
        )
        probes = aiohttp.TCPConnector(
            limit=_PROBE_CONNECTIONS, keepalive_timeout=self._pool.keepalive_expiry, ssl=verify
        )
        self._probe_session = aiohttp.ClientSession(
            connector=probes,
            timeout=aiohttp.ClientTimeout(total=self._timeouts.probe),
            headers=self._probe_headers,
        )

    async def aclose(self) -> None:
        if self._legs is not None:
            self._legs.close()
        if self._probe_session is not None:
            await self._probe_session.close()
        self._legs = self._probe_session = None

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        leg: str,
        stream: bool,
        headers_within: float | None = None,
        within: float | None = None,
    ) -> UpstreamResponse:
        """POST and wait for the response headers, at most ``headers_within`` seconds for a
        stream (default: the read timeout); the body is left to the caller. A ``stream``
        body's silence is the caller's to bound. ``within`` bounds a whole answer, body
        included."""
        read = self._timeouts.read
        if stream:
            return await self._send("POST", url, body, headers, leg, headers_within or read)
        return await self._send("POST", url, body, headers, leg, read, within, read)

    async def get(self, url: str, headers: Mapping[str, str], *, leg: str) -> UpstreamResponse:
        """GET on the legs' pool and wait for the response headers (a pass-through such as
        ``/version``); the body is left to the caller, its silence bounded by the read
        timeout."""
        read = self._timeouts.read
        return await self._send("GET", url, b"", headers, leg, read, None, read)

    async def _send(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        leg: str,
        headers_within: float,
        within: float | None = None,
        read_timeout: float | None = None,
    ) -> UpstreamResponse:
        pool = self._require(self._legs)
        try:
            response = await pool.request(
                method, url, body, headers, headers_within=headers_within, total=within
            )
        except _LEG_FAILURES as exc:
            raise _translate(exc, leg, url) from exc
        content_type = response.headers.get("content-type", "application/json")
        return UpstreamResponse(response.status, content_type, leg, url, response, read_timeout)

    async def post_read(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        leg: str,
        within: float | None = None,
    ) -> tuple[UpstreamResponse, bytes]:
        """POST and read the whole answer, in at most ``within`` seconds if given (else each
        silence is bounded by the read timeout); the connection is pooled again or dropped."""
        upstream = await self.post(url, body, headers, leg=leg, stream=False, within=within)
        return upstream, await upstream.read_all()

    async def probe(self, url: str, timeout: float) -> bool:
        """An active health check: True when ``GET url`` answers 200 within ``timeout``."""
        session = self._require(self._probe_session)
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                await response.read()
                return response.status == 200
        except _FAILURES:
            return False

    async def get_json(self, url: str) -> Any:
        """A probe (``/v1/models``, ``/health``): short timeout, its own pool, the body
        capped as the legs' are."""
        session = self._require(self._probe_session)
        with _mapped_errors("probe", url):
            async with session.get(url) as response:
                if response.status != 200:
                    raise UpstreamError(f"{url} answered HTTP {response.status}", leg="probe")
                body = await _read_at_most(response, self._pool.max_response_body_bytes)
        return orjson.loads(body)

    async def get_text(self, url: str, timeout: float, limit: int) -> str:
        """A scrape (``/metrics``) on the probe pool, whole within ``timeout``: the body as
        text. Raises ``UpstreamError`` on a non-200 answer or a body (decompressed) over
        ``limit`` bytes, and its subclasses when the engine cannot be reached in time."""
        session = self._require(self._probe_session)
        with _mapped_errors("probe", url):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                if response.status != 200:
                    raise UpstreamError(f"{url} answered HTTP {response.status}", leg="probe")
                body = await _read_at_most(response, limit)
        return body.decode("utf-8", "replace")

    def prepare(self, url: str, wanted: int) -> None:
        """Open connections for ``wanted`` legs soon to go to ``url``'s instance, in the
        background, unless enough are pooled there already (``Pool.prepare``)."""
        if self._legs is not None:
            self._legs.prepare(url, wanted)

    def connections_in_use(self) -> int:
        """Upstream connections currently held by a leg (pooled idle ones excluded); 0 when
        nothing is in flight, or a leg leaked its response. aiohttp has no public count."""
        return 0 if self._legs is None else self._legs.in_use()

    @property
    def read_timeout(self) -> float:
        return self._timeouts.read

    @property
    def stream_limits(self) -> tuple[int, int]:
        """(one SSE event's, a whole relayed stream's) bytes at most."""
        return self._pool.max_stream_event_bytes, self._pool.max_stream_bytes

    @staticmethod
    def _require(session: _Session | None) -> _Session:
        if session is None:
            raise RuntimeError("EngineClient used before start() or after aclose()")
        return session
