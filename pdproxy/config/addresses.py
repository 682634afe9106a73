"""Instance addresses: parsed once, written one way, and checked for what they may carry
(stdlib only, no I/O).

The rules (docs/security.md, "Instances: loops, aliases and registrations"):

* ``host:port`` (IPv6 as ``[::1]:port``); a port is 1-65535 in ASCII digits only
  (``str.isdigit`` also accepts ``²`` and Arabic-Indic digits, which ``int`` reads).
* A literal address is written one way: IPv6 compressed, an IPv4-mapped IPv6 address as
  its IPv4, the legacy numeric forms the resolver accepts (``127.1``, ``2130706433``,
  ``0x7f.0.0.1``) as a dotted quad, a name in lower case. An unroutable address
  (``0.0.0.0``, ``::``, multicast, broadcast) is refused: nothing can connect to it.
* An instance's identity (``identity``) is its canonical host and port, with every
  loopback spelling (``localhost``, ``*.localhost``, ``127.0.0.0/8``, ``::1``) one host. A
  DNS name is not resolved here: its address may change while the name stays right.
* A registration string that goes into a header or a request id (``kv_address_problem``)
  is a ``host:port`` or MoRIIO's ``host:IP,handshake:PORT,notify:PORT``: printable ASCII,
  never a line break, a control character or a non-Latin-1 character.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from pdproxy.errors import ConfigError

LOOPBACK = "[loopback]"  # the identity host of every loopback spelling; never a host name

_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
_PORT_DIGITS = 5
_MORIIO_KV = re.compile(r"host:([^,]+),handshake:([0-9]{1,5}),notify:([0-9]{1,5})")
_MAX_KV_ADDRESS = 512
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_host_port(text: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:port``), validate both parts and return the
    host in its canonical form; raises ``ConfigError``."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{text!r} is not host:port")
    return canonical_host(host, text), parse_port(port_text, text)


def parse_port(port_text: str, text: str) -> int:
    """A port in ASCII digits, 1-65535."""
    if not (port_text.isascii() and port_text.isdigit()) or len(port_text) > _PORT_DIGITS:
        raise ConfigError(f"{text!r} is not host:port (the port must be ASCII digits)")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigError(f"port {port} in {text!r} is outside 1-65535")
    return port


def canonical_host(host: str, text: str) -> str:
    """``host`` written one way (see the module's rules); raises ``ConfigError``."""
    if host.startswith("[") and host.endswith("]"):
        ip = _ip(host[1:-1])
        if ip is None or ip.version != 6:
            raise ConfigError(f"{host!r} in {text!r} is not an IPv6 address")
        return _routable(ip, text)
    ip = _ip(host)
    if ip is not None:
        return _routable(ip, text)
    if not _HOSTNAME_RE.fullmatch(host):
        raise ConfigError(f"{host!r} in {text!r} is not a host name or IP address")
    legacy = _legacy_ipv4(host)
    if legacy is not None:
        return _routable(legacy, text)
    return host.lower()


def _ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _legacy_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """What the resolver makes of an all-numeric name (``127.1``, ``0x7f.1``)."""
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _routable(ip: IPAddress, text: str) -> str:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified or ip.is_multicast or ip == _BROADCAST:
        raise ConfigError(f"{ip} in {text!r} is not a routable address")
    return str(ip)


def format_url(scheme: str, host: str, port: int) -> str:
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def parse_engine_url(text: str) -> str:
    """Normalise ``host:port`` or ``http(s)://host:port`` to ``scheme://host:port``."""
    scheme, sep, rest = text.strip().partition("://")
    if not sep:
        scheme, rest = "http", text.strip()
    if scheme not in ("http", "https"):
        raise ConfigError(f"{text!r}: scheme must be http or https")
    rest = rest.rstrip("/")
    if "/" in rest:
        raise ConfigError(f"{text!r}: give host:port only, without a path")
    host, port = parse_host_port(rest)
    return format_url(scheme, host, port)


def url_host_port(url: str) -> tuple[str, int]:
    """The canonical host and the port of an instance URL (``scheme://host:port``)."""
    return parse_host_port(url.partition("://")[2])


def is_loopback(host: str) -> bool:
    """``host`` (canonical) names this machine's loopback: RFC 6761 keeps ``localhost``
    and every name under it there."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def identity_host(host: str) -> str:
    return LOOPBACK if is_loopback(host) else host


def identity(host: str, port: int) -> str:
    """One key per instance, whatever literal spelling names it."""
    return f"{identity_host(host)} {port}"


def url_identity(url: str) -> str:
    return identity(*url_host_port(url))


def listens_everywhere(listen_host: str) -> bool:
    """A listener on every interface (``--host 0.0.0.0`` or ``::``)."""
    return listen_host in ("", "0.0.0.0", "::")


def listener_hosts(listen_host: str) -> frozenset[str]:
    """The identity hosts that certainly reach a listener bound to ``listen_host``, known
    without I/O: its loopback when it listens everywhere, else its own host."""
    if listens_everywhere(listen_host):
        return frozenset({LOOPBACK})
    try:
        return frozenset({identity_host(canonical_host(listen_host, listen_host))})
    except ConfigError:
        return frozenset({listen_host.lower()})


def header_safe(text: str) -> bool:
    """Printable ASCII: safe in a header line and in a request id."""
    return text.isascii() and text.isprintable()


def kv_address_problem(text: str) -> str | None:
    """Why a registered KV address (P2P-NCCL's or MoRIIO's ``zmq_address``) cannot be
    used, or None. It is kept as the engine wrote it (its peers parse it back)."""
    if not text or len(text) > _MAX_KV_ADDRESS or not header_safe(text):
        return "must be printable ASCII, at most 512 characters"
    moriio = _MORIIO_KV.fullmatch(text)
    try:
        if moriio is None:
            parse_host_port(text)
        else:
            canonical_host(moriio[1], text)
            parse_port(moriio[2], text)
            parse_port(moriio[3], text)
    except ConfigError:
        return "must be host:port or host:IP,handshake:PORT,notify:PORT"
    return None
