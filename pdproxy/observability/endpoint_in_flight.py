"""A gauge family computed at scrape time: the legs in flight on each instance."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class EndpointInFlight(Collector):
    """``pdproxy_endpoint_in_flight{role,url}``, read at scrape time from ``read()``'s
    ``(role, url, legs)``."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        self._read = read

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for role, url, legs in self._read():
            family.add_metric((role, url), legs)
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "pdproxy_endpoint_in_flight",
            "Legs in flight on an instance.",
            labels=("role", "url"),
        )
