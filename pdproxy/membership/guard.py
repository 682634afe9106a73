"""What keeps the membership from admitting pdproxy itself, or one instance twice.

* ``OwnListener``: the port and the hosts that reach pdproxy's own listener: every loopback
  spelling; with ``--host 0.0.0.0`` (or ``::``) also the host's interface addresses (Linux:
  ``/proc/net``), its host name and the addresses that name resolves to; else its ``--host``
  (and, for a name, its addresses).
* ``InstanceGuard``: membership's address checks, made before an instance is admitted: not this
  pdproxy (400 for the admin API), not a second name of a known instance (409). Literal
  spellings are compared by ``addresses.identity``; a DNS name is resolved only where awaiting
  is allowed (the admin API), never for a heartbeat.

A request that comes back through pdproxy itself is refused by its ``Via`` marker
(``pdproxy.wire.hop``)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pdproxy.config.addresses import (
    canonical_host,
    identity,
    identity_host,
    is_loopback,
    listener_hosts,
    listens_everywhere,
    url_host_port,
)
from pdproxy.errors import ConfigError

_FIB_TRIE = "/proc/net/fib_trie"  # every local IPv4 address, secondary ones included
_IF_INET6 = "/proc/net/if_inet6"


class OwnListener:
    """The listener's port and the identity hosts (``addresses.identity_host``) that reach it."""

    def __init__(self, port: int, hosts: Iterable[str]) -> None:
        self.port = port
        self.hosts = frozenset(hosts)

    @classmethod
    def discover(cls, listen_host: str, port: int) -> OwnListener:
        """Blocking, once at start: the host name's resolution reads /etc/hosts or DNS."""
        hosts = set(listener_hosts(listen_host))
        if listens_everywhere(listen_host):
            hosts |= set(_interface_hosts())
            name = socket.gethostname()
            hosts |= {name.lower(), *_resolved_hosts(name)}
        elif not _is_literal(listen_host):
            hosts |= set(_resolved_hosts(listen_host))
        return cls(port, hosts)

    def listening(self, port: int) -> None:
        """The port the listener got (``--port 0`` is known only once it is bound)."""
        self.port = port

    def is_self(self, host: str, port: int) -> bool:
        return port == self.port and identity_host(host) in self.hosts


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int  # what the admin API answers
    reason: str


class InstanceGuard:
    """Which instance each identity names (literal spellings; a name's resolved addresses
    where it was resolved), and whether an address is this pdproxy's own listener.
    ``known(url)`` tells whether an instance is still in the registry."""

    def __init__(self, own: OwnListener, known: Callable[[str], object]) -> None:
        self.own = own
        self._known = known
        self._by_identity: dict[str, str] = {}
        self._identities: dict[str, tuple[str, ...]] = {}  # url -> its keys above

    def check(self, url: str) -> Refusal | None:
        """Refused when ``url`` is pdproxy itself or another name of a known instance.
        (A URL that is not ``scheme://host:port``, which no parser here produced, is
        neither.)"""
        parsed = _host_port(url)
        if parsed is None:
            return None
        if self.own.is_self(*parsed):
            return _SELF
        return self._alias(url, identity(*parsed))

    async def check_resolved(
        self, url: str, timeout: float
    ) -> tuple[Refusal | None, tuple[str, ...]]:
        """``check``, then the same for every address a DNS name resolves to now; with
        the identities of those addresses (for ``admitted``)."""
        refusal, parsed = self.check(url), _host_port(url)
        if refusal is not None or parsed is None or is_loopback(parsed[0]):
            return refusal, ()
        host, port = parsed
        if _is_literal(host):
            return None, ()
        try:
            async with asyncio.timeout(timeout):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )
        except (OSError, TimeoutError, UnicodeError):
            return Refusal(400, f"cannot resolve {host!r}"), ()
        resolved = [h for h in (_canonical(str(info[4][0])) for info in infos) if h is not None]
        for ip in resolved:
            if self.own.is_self(ip, port):
                return _SELF, ()
            refusal = self._alias(url, identity(ip, port))
            if refusal is not None:
                return refusal, ()
        return None, tuple({identity(ip, port) for ip in resolved})

    def admitted(self, url: str, *also: str) -> None:
        """``url`` is in the registry; ``also``: the identities its name resolved to."""
        parsed = _host_port(url)
        keys = (*(() if parsed is None else (identity(*parsed),)), *also)
        self.forgot(url)
        self._identities[url] = keys
        for key in keys:
            self._by_identity[key] = url

    def forgot(self, url: str) -> None:
        for key in self._identities.pop(url, ()):
            if self._by_identity.get(key) == url:
                del self._by_identity[key]

    def known_as(self, url: str) -> str | None:
        """The known instance ``url`` is another spelling of (``/instances/remove``)."""
        parsed = _host_port(url)
        other = None if parsed is None else self._by_identity.get(identity(*parsed))
        return other if other is not None and self._known(other) is not None else None

    def _alias(self, url: str, key: str) -> Refusal | None:
        other = self._by_identity.get(key)
        if other is None or other == url or self._known(other) is None:
            return None
        return Refusal(409, f"it is another name of instance {other}")


_SELF = Refusal(400, "it is pdproxy's own listener (a routing loop)")


def _host_port(url: str) -> tuple[str, int] | None:
    try:
        return url_host_port(url)
    except ConfigError:
        return None


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _canonical(text: str) -> str | None:
    try:
        return canonical_host(text.partition("%")[0], text)
    except ConfigError:
        return None


def _resolved_hosts(name: str) -> Iterator[str]:
    """The addresses ``name`` resolves to, and its canonical name; none when it fails."""
    with contextlib.suppress(OSError, UnicodeError):
        for *_, canonname, sockaddr in socket.getaddrinfo(
            name, None, type=socket.SOCK_STREAM, flags=socket.AI_CANONNAME
        ):
            if canonname:
                yield canonname.lower()
            host = _canonical(str(sockaddr[0]))
            if host is not None:
                yield identity_host(host)


def _interface_hosts() -> Iterator[str]:
    """This host's own interface addresses, from the kernel's tables (Linux; none
    elsewhere)."""
    for text in (*_local_ipv4(), *_local_ipv6()):
        host = _canonical(text)
        if host is not None:
            yield identity_host(host)


def _local_ipv4() -> list[str]:
    found: list[str] = []
    with contextlib.suppress(OSError), open(_FIB_TRIE, encoding="ascii") as table:
        last = ""
        for line in table:
            item = line.strip()
            if item.startswith("|-- "):
                last = item[4:]
            elif item == "/32 host LOCAL" and last:
                found.append(last)
    return found


def _local_ipv6() -> list[str]:
    found: list[str] = []
    with contextlib.suppress(OSError), open(_IF_INET6, encoding="ascii") as table:
        for line in table:
            digits = line.split(maxsplit=1)[0] if line.strip() else ""
            if len(digits) == 32:
                found.append(":".join(digits[i : i + 4] for i in range(0, 32, 4)))
    return found
