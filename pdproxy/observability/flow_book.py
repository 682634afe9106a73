"""Flow control's figures: who waits at which stage, who was admitted or refused, who met
its deadline, and how far the time-to-first-token prediction was from what happened.

One ``FlowBook`` per process, written by admission (``proxying.admission``), the legs'
waits (``proxying.leg_room``) and a request's end (``api.access``); read by ``/status``
and the dashboard (``status()``) and by Prometheus (the ``pdproxy_flow_*`` series). Labels
are bounded by the tenants file: a tenant the file does not list is ``default`` already
(``flow.ticket``), and a priority that is neither 0 nor one of the file's is ``other``.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pdproxy.config.tenants import TenantsConfig
from pdproxy.flow.ticket import Ticket
from pdproxy.observability.metrics import ProxyMetrics

_ERRORS_KEPT = 1024  # the last predictions' errors the median is taken over
_TENANTS_SHOWN = 100  # a larger file shows the tenants seen since the start only
STAGES = ("admission", "prefill", "decode")


@dataclass(slots=True)
class _TenantFigures:
    in_flight: int = 0
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    slo_met: int = 0
    slo_missed: int = 0


class FlowBook:
    def __init__(self, metrics: ProxyMetrics, tenants: TenantsConfig) -> None:
        self._metrics = metrics
        self._tenants = tenants
        self._bands: frozenset[int] = frozenset()
        self._figures: dict[str, _TenantFigures] = {}
        self._waiting: dict[tuple[str, str, str], Any] = {}  # gauge children by labels
        self._waits: dict[tuple[str, str, str], Any] = {}  # histogram children by labels
        self._depths: dict[tuple[str, int, str], int] = {}  # waiting: (stage, priority, tenant)
        self._errors: deque[float] = deque(maxlen=_ERRORS_KEPT)
        self._predictions = 0
        self.reconfigure(tenants)

    def reconfigure(self, tenants: TenantsConfig) -> None:
        """A new tenants file: its priorities name the bands' labels from now on."""
        self._tenants = tenants
        specs = [tenants.default, *tenants.tenants.values()]
        self._bands = frozenset({0, *(spec.priority for spec in specs)})

    def band(self, priority: int) -> str:
        """The ``priority`` label of a request's band (bounded by the file)."""
        return str(priority) if priority in self._bands else "other"

    # -- waits ---------------------------------------------------------------------------

    def queued(self, stage: str, ticket: Ticket) -> None:
        self._waiting_child(stage, ticket).inc()
        key = (stage, ticket.priority, ticket.tenant)
        self._depths[key] = self._depths.get(key, 0) + 1

    def dequeued(self, stage: str, ticket: Ticket, waited: float) -> None:
        labels = (stage, self.band(ticket.priority), ticket.tenant)
        self._waiting_child(stage, ticket).dec()
        key = (stage, ticket.priority, ticket.tenant)
        left = self._depths.get(key, 1) - 1
        if left > 0:
            self._depths[key] = left
        else:
            self._depths.pop(key, None)
        child = self._waits.get(labels)
        if child is None:
            child = self._waits[labels] = self._metrics.flow.wait_seconds.labels(*labels)
        child.observe(waited)

    def _waiting_child(self, stage: str, ticket: Ticket) -> Any:
        labels = (stage, self.band(ticket.priority), ticket.tenant)
        child = self._waiting.get(labels)
        if child is None:
            child = self._waiting[labels] = self._metrics.flow.waiting.labels(*labels)
        return child

    # -- admission -----------------------------------------------------------------------

    def admitted(self, ticket: Ticket) -> None:
        figures = self._tenant(ticket.tenant)
        figures.admitted += 1
        figures.in_flight += 1

    def finished(self, ticket: Ticket) -> None:
        figures = self._tenant(ticket.tenant)
        figures.in_flight = max(figures.in_flight - 1, 0)

    def refused(self, ticket: Ticket, reason: str) -> None:
        refused = self._tenant(ticket.tenant).refused
        refused[reason] = refused.get(reason, 0) + 1
        self._metrics.admission_rejected.labels(reason).inc()
        self._metrics.flow.refused.labels(ticket.tenant, reason).inc()

    # -- deadlines -----------------------------------------------------------------------

    def answered(self, ticket: Ticket, first_byte: float, predicted: float | None) -> None:
        """A request with a deadline got its first byte ``first_byte`` seconds after it
        arrived; ``predicted`` is what was predicted for it when it was sent (if anything)."""
        if ticket.deadline_ms is None:
            return
        met = first_byte * 1000.0 <= ticket.deadline_ms
        figures = self._tenant(ticket.tenant)
        if met:
            figures.slo_met += 1
        else:
            figures.slo_missed += 1
        outcome = "met" if met else "missed"
        self._metrics.flow.slo.labels(ticket.tenant, self.band(ticket.priority), outcome).inc()
        if predicted is not None:
            error = abs(predicted - first_byte)
            self._errors.append(error)
            self._predictions += 1
            self._metrics.flow.ttft_prediction_error.observe(error)

    def median_error(self) -> float | None:
        """The median of the last predictions' absolute errors, seconds."""
        return statistics.median(self._errors) if self._errors else None

    # -- reading -------------------------------------------------------------------------

    def _tenant(self, name: str) -> _TenantFigures:
        figures = self._figures.get(name)
        if figures is None:
            figures = self._figures[name] = _TenantFigures()
        return figures

    def status(self) -> dict[str, Any]:
        """``/status``'s ``flow`` section."""
        tenants = self._tenants
        order = {stage: i for i, stage in enumerate(STAGES)}
        rows = [
            {"stage": stage, "priority": priority, "tenant": tenant, "waiting": count}
            for (stage, priority, tenant), count in sorted(
                self._depths.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2])
            )
        ]
        listed = tenants.tenants if len(tenants.tenants) <= _TENANTS_SHOWN else ()
        names = sorted({*listed, "default", *self._figures})
        error = self.median_error()
        return {
            "tenants_file": tenants.path,
            "queued": sum(row["waiting"] for row in rows),
            "waiting": rows,
            "tenants": {name: self._tenant_row(name) for name in names},
            "prediction": {
                "samples": self._predictions,
                "median_error_ms": None if error is None else round(error * 1000.0, 1),
            },
        }

    def _tenant_row(self, name: str) -> dict[str, Any]:
        spec = self._tenants.spec(name)
        figures = self._figures.get(name) or _TenantFigures()
        return {
            "weight": spec.weight,
            "priority": spec.priority,
            "in_flight": figures.in_flight,
            "admitted": figures.admitted,
            "refused": dict(figures.refused),
            "slo_met": figures.slo_met,
            "slo_missed": figures.slo_missed,
        }
