"""How a transfer's legs run, chosen at start-up: ``DirectLegs`` sends them as the
connector says (serial, or both at once), ``PushLegs`` (``--kv-connector nixl-push``)
decides per request and holds the client's request id while its legs may still be paired
by it. The orchestrator hands its legs to the runner and checks for neither."""

from __future__ import annotations

from typing import Any, Protocol

from pdproxy.connectors import KVConnector, Transfer
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.legs import Legs, LegSize


class LegRunner(Protocol):
    def concurrent(self, request: ClientRequest, transfer: Transfer) -> bool:
        """Whether ``transfer``'s legs go at once."""
        ...

    def claim(self, request: ClientRequest) -> str | None:
        """Hold what ``request`` needs for itself while it is served (``release`` it)."""
        ...

    def release(self, claimed: str | None) -> None: ...

    async def run(self, request: ClientRequest, transfer: Transfer, size: LegSize) -> ProxyResponse:
        """Both legs at once."""
        ...

    async def decode(
        self, request: ClientRequest, transfer: Transfer, answer: dict[str, Any]
    ) -> ProxyResponse:
        """A serial transfer's decode leg, its prefill answered ``answer``."""
        ...

    def status(self) -> dict[str, Any] | None:
        """``/status``' section of the runner (None: nothing to show)."""
        ...

    async def aclose(self) -> None: ...


class DirectLegs:
    """The legs as the connector runs them: nothing held, nothing to show."""

    def __init__(self, legs: Legs, connector: KVConnector) -> None:
        self._legs = legs
        self._connector = connector

    def concurrent(self, request: ClientRequest, transfer: Transfer) -> bool:
        return self._connector.runs_concurrently(transfer)

    def claim(self, request: ClientRequest) -> str | None:
        return None

    def release(self, claimed: str | None) -> None:
        pass

    async def run(self, request: ClientRequest, transfer: Transfer, size: LegSize) -> ProxyResponse:
        return await self._legs.concurrent(request, transfer, size)

    async def decode(
        self, request: ClientRequest, transfer: Transfer, answer: dict[str, Any]
    ) -> ProxyResponse:
        return await self._legs.decode(request, transfer, answer)

    def status(self) -> dict[str, Any] | None:
        return None

    async def aclose(self) -> None:
        pass  # the legs are the orchestrator's to close
