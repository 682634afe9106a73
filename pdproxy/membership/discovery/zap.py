"""A ZAP handler (ZeroMQ RFC 27) that admits registry connections by the peer's IP address.

libzmq asks ``inproc://zeromq.zap.01`` on the socket's context before it accepts a
connection to a socket that has a ``ZAP_DOMAIN``, for the NULL mechanism too (libzmq >= 4.3),
and closes the connection unless the answer is 200. The request carries the peer's address
as the kernel reports it, so a peer cannot claim another one. With ``ZAP_ENFORCE_DOMAIN`` the
guarded socket fails closed: while no handler answers, nobody gets in.

Runs on the event loop (``zmq.asyncio``, no threads), beside the registry's ROUTER.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Iterable

import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_BACKOFF_MIN, _BACKOFF_MAX = 0.1, 5.0  # seconds between restarts after unexpected errors


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """``10.0.0.0/8``-style networks; host bits are ignored (the config validated them)."""
    return tuple(ipaddress.ip_network(cidr, strict=False) for cidr in cidrs)


def allowed(address: str, networks: Iterable[Network]) -> bool:
    """Whether a peer address lies in one of the networks; an unparsable one never does.

    An IPv4 peer of a dual-stack socket arrives as ``::ffff:a.b.c.d`` and is matched as IPv4.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in network for network in networks)


class ZapAllowList:
    """Answers ZAP requests: 200 for peers inside ``networks``, 400 (and ``on_refused``)
    for the rest.

    ``start`` must run before the guarded socket binds, and ``aclose`` after it is closed.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        networks: tuple[Network, ...],
        on_refused: Callable[[str], None],
    ) -> None:
        self._context = context
        self._networks = networks
        self._on_refused = on_refused
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        sock = self._context.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ZAP_ENDPOINT)
        self._socket = sock
        self._task = asyncio.create_task(self._serve(sock), name="pdproxy-zap")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        """Answer forever; an unexpected error is logged and the loop resumes after a backoff
        (meanwhile handshakes wait, so the registry fails closed)."""
        backoff = _BACKOFF_MIN
        while True:
            try:
                request = await sock.recv_multipart()
                await sock.send_multipart(self._reply(request))
            except Exception:
                logger.exception("registry: ZAP handler failed; resuming in %.1f s", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
            else:
                backoff = _BACKOFF_MIN

    def _reply(self, request: list[bytes]) -> list[bytes]:
        # Request: version, request id, domain, address, routing id, mechanism, credentials...
        # Reply: version, request id, status code, status text, user id, metadata.
        if len(request) < 6 or request[0] != b"1.0":  # never from libzmq; answer anyway
            return [b"1.0", b"", b"500", b"bad request", b"", b""]
        address = request[3].decode("ascii", "replace")
        if allowed(address, self._networks):
            return [b"1.0", request[1], b"200", b"OK", b"", b""]
        self._on_refused(address)
        return [b"1.0", request[1], b"400", b"address not allowed", b"", b""]
