"""The marker every leg carries, ``Via: 1.1 pdproxy-<id>`` after the client's own ``Via`` entries
(RFC 9110 7.6.3). A request that arrives with this pdproxy's marker is one of its own legs come
back: refused (508) before any work. Another pdproxy's marker is a chain of proxies, allowed; it
is forwarded, so a cycle through several of them ends when it comes back to any one. The id is
random per run and shared by ``--workers`` processes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Hop:
    token: str  # "pdproxy-<id>"
    via: str  # "1.1 pdproxy-<id>"

    @classmethod
    def of(cls, hop_id: str) -> Hop:
        token = f"pdproxy-{hop_id}"
        return cls(token, f"1.1 {token}")

    def returned(self, via: str | None) -> bool:
        """The request is one of this pdproxy's own legs (one substring test)."""
        return via is not None and self.token in via

    def forward(self, via: str | None) -> str:
        """The ``Via`` a leg carries: the client's entries, then this pdproxy's."""
        return f"{via}, {self.via}" if via else self.via
