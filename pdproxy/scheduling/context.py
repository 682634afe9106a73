"""What the scheduling plugins know about one request and the moment it is scheduled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdproxy.scheduling.view import EndpointView


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """The request as scheduling sees it; built by ``scheduling.features``.

    ``blocks`` are chained hashes of the rendered prompt, one per ``block_chars``
    characters (empty unless a prefix index needs them): block ``i`` stands for the whole
    prompt up to its end, as vLLM's block hashes do.
    """

    model: str | None = None
    tokens: float = 0.0  # estimated prompt tokens
    session: str | None = None  # consistent-hash key
    blocks: tuple[int, ...] = ()
    # why the request must not be split across two legs (``features.one_leg_reason``)
    one_leg: str | None = None
    # the prompt's token ids when the body carries them (token-in, --render-once) and a
    # ``kv-events`` policy needs them; the body's own list, never copied
    token_ids: Sequence[int] | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class Context:
    """One scheduling decision's inputs: the request, the time, how old load figures may
    be, and what was already computed for it (prefix matches, loads), shared by plugins."""

    features: RequestFeatures
    now: float  # monotonic
    max_age: float  # engine load figures older than this are ignored
    matches: dict[int, dict[str, int]] = field(default_factory=dict)  # id(index) -> url -> depth
    keys: dict[int, tuple[int, ...]] = field(default_factory=dict)  # id(index) -> block keys
    _loads_of: Sequence[EndpointView] | None = None  # the last ``loads`` call, reused by plugins
    _loads: list[float] = field(default_factory=list)

    def load(self, endpoint: EndpointView) -> float:
        """An endpoint's load, in requests at its role's typical speed, the new one
        included: ``(requests + 1) * slowness``.

        The requests are the proxy's own legs in flight (``Endpoint.work``, a prefill leg
        weighted by its prompt size) plus those bound for it whose leg has not started
        (exact, live), plus, when its engine's last scrape is fresh, the ones the engine runs
        or queues for others (other replicas, other clients): its running + waiting less
        this proxy's legs at that scrape (``Endpoint.others``, fresh until
        ``others_until``, both set by the scraper). Trusting the raw engine
        figure instead would make a burst the proxy already moved elsewhere look like load
        for a whole scrape interval, and herd the next burst. ``slowness`` is measured by
        ``scheduling.speed``: an idle prefill four times slower than its peers weighs as
        much as a fast one with three requests."""
        return self.loads((endpoint,))[0]

    def loads(self, endpoints: Sequence[EndpointView]) -> list[float]:
        """``load`` of each endpoint in one pass (the hot loop of every load-aware policy);
        a second call for the same sequence reuses the first's answer."""
        if endpoints is self._loads_of:
            return self._loads
        now = self.now
        self._loads_of = endpoints
        self._loads = [
            (e.legs.work + e.load.others + 1.0) * e.speed.slowness
            if e.load.others_until >= now
            else (e.legs.work + 1.0) * e.speed.slowness
            for e in endpoints
        ]
        return self._loads

    def remember_loads(self, endpoints: Sequence[EndpointView], loads: list[float]) -> None:
        """``loads`` are ``endpoints``' (a filter's survivors, from a computed list)."""
        self._loads_of, self._loads = endpoints, loads

    def kv_usage(self, endpoint: EndpointView) -> float | None:
        """The engine's KV-cache usage (0..1) when its last scrape is fresh."""
        figures = endpoint.load.engine_load
        if figures is None or self.now - figures.scraped_at > self.max_age:
            return None
        return figures.kv_usage
