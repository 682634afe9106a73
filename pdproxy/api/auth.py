"""Client API keys, checked as vLLM checks its own ``--api-key``: ``Authorization: Bearer KEY``.

Every configured key is compared, in constant time, whatever the header holds, so the time
an answer takes says nothing about which key or how much of one matched. No key ever
appears in a log line or an error body.
"""

from __future__ import annotations

import hmac

_BEARER = "bearer "


class ClientKeys:
    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [key.encode("utf-8") for key in keys]

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
