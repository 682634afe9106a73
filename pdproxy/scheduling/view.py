"""What scheduling may read of an endpoint: read-only views over the owners' records.

``Endpoint`` (``pdproxy.types``) satisfies these Protocols as it is, so a view costs
nothing per decision; the plugins take views, so mypy refuses a write from them. (Only
``SpeedTracker``, the owner of ``Speed``, takes the writable ``Endpoint``.)
"""

from __future__ import annotations

from typing import Protocol

from pdproxy.types import EngineAddress, EngineLoad


class LegCountsView(Protocol):
    """``LegCounts``, read-only."""

    @property
    def work(self) -> float: ...
    @property
    def queued_tokens(self) -> float: ...
    @property
    def rank_in_flight(self) -> list[int]: ...


class EngineFiguresView(Protocol):
    """``EngineFigures``, read-only."""

    @property
    def engine_load(self) -> EngineLoad | None: ...
    @property
    def others(self) -> float: ...
    @property
    def others_until(self) -> float: ...


class SpeedView(Protocol):
    """``Speed``, read-only."""

    @property
    def slowness(self) -> float: ...


class EndpointView(Protocol):
    """An ``Endpoint`` as the scheduler sees it within one decision."""

    @property
    def url(self) -> str: ...
    @property
    def address(self) -> EngineAddress: ...
    @property
    def models(self) -> tuple[str, ...]: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def legs(self) -> LegCountsView: ...
    @property
    def load(self) -> EngineFiguresView: ...
    @property
    def speed(self) -> SpeedView: ...
