"""How many client connections one pdproxy process keeps open
(``pdproxy.runtime.listener`` closes or refuses past it)."""

from __future__ import annotations

from pdproxy.config.listener import ClientLimits

UNLIMITED_FILES_CAP = 1 << 16  # the connection cap when the open-file limit is unlimited


def connection_cap(limits: ClientLimits) -> int:
    """``limits.max_connections``, or (0) half this process's soft open-file limit, so
    upstream legs, probes and logs keep the other half."""
    if limits.max_connections:
        return limits.max_connections
    try:
        import resource
    except ImportError:  # not a Unix: no limit to read
        return UNLIMITED_FILES_CAP
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return UNLIMITED_FILES_CAP if soft == resource.RLIM_INFINITY else max(1, soft // 2)
