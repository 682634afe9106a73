"""Whom a leg's failure counts against: a leg whose request could not be built (a header
the instance's registration made unsendable) fails as ``UpstreamRequestError`` against the
instance that registered it, so it is retried elsewhere like a connect failure."""

from __future__ import annotations

from pdproxy.config.addresses import header_safe
from pdproxy.errors import ProxyError, UpstreamRequestError
from pdproxy.types import Endpoint, PairDecision, Role


def unbuildable(endpoint: Endpoint, pair: PairDecision | None) -> UpstreamRequestError:
    """The error of a leg to ``endpoint`` whose request could not be built. At fault is the
    instance whose registered KV address (in the pair's request id) cannot be sent, else
    ``endpoint``; the error's ``leg`` is that instance's role, so the retry replaces it."""
    culprit = endpoint
    if pair is not None:
        unsafe = [e for e in (pair.prefill, pair.decode) if not header_safe(e.kv_address)]
        culprit = unsafe[0] if unsafe else endpoint
    leg = "prefill" if culprit.role is Role.PREFILL else "decode"
    return UpstreamRequestError(
        f"cannot build a request for {leg} engine {culprit.url}: what it registered cannot be sent",
        leg=leg,
    )


def at_fault(error: ProxyError, endpoint: Endpoint, pair: PairDecision | None) -> Endpoint:
    """The instance a leg's failure counts against: the one whose registration made its
    request unbuildable, else the leg's own."""
    if isinstance(error, UpstreamRequestError) and pair is not None:
        return pair.prefill if error.leg == "prefill" else pair.decode
    return endpoint
