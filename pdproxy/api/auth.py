"""Client API keys, checked as vLLM checks its own ``--api-key``: ``Authorization: Bearer KEY``.

Every configured key is compared, in constant time, whatever the header holds, so the time
an answer takes says nothing about which key or how much of one matched. No key ever
appears in a log line or an error body.
"""

from __future__ import annotations

import hmac

_BEARER = "bearer "


class ClientKeys:
    def __init__(self, keys: tuple[str, ...], tenants: tuple[tuple[str, str], ...] = ()) -> None:
        self._keys = [key.encode("utf-8") for key in keys]
        named = dict(tenants)
        self._tenants = [named.get(key) for key in keys]  # each key's tenant, or None

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        """True when ``authorization`` is ``Bearer <one of the keys>``."""
        value = authorization or ""
        scheme_ok = value[: len(_BEARER)].lower() == _BEARER
        given = value[len(_BEARER) :].strip().encode("utf-8", "replace")
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(given, key)
        return scheme_ok and matched

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant the matching key's line names (``KEY tenant=NAME``), or None; every
        key is compared, as in ``allows``."""
        value = authorization or ""
        if value[: len(_BEARER)].lower() != _BEARER:
            return None
        given = value[len(_BEARER) :].strip().encode("utf-8", "replace")
        found = None
        for key, tenant in zip(self._keys, self._tenants, strict=True):
            if hmac.compare_digest(given, key):
                found = tenant
        return found
