"""Who a request is, for flow control: its tenant, priority, deadline and cost."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdproxy.config.tenants import DEFAULT_TENANT, TenantsConfig, TenantSpec, valid_name
from pdproxy.errors import BadRequest

DEADLINE_HEADER = "x-slo-ttft-ms"  # milliseconds to the first token (llm-d's name)
_MAX_DEADLINE_MS = 86_400_000.0  # a day: longer is no deadline worth ordering by
DEFAULT_MAX_TOKENS = 16  # vLLM's completions default when a body asks for none
_PRIORITY_BOUND = 2**63  # vLLM reads an int; past int64 it is not one an engine takes


@dataclass(frozen=True, slots=True)
class Ticket:
    """One request as flow control sees it. ``cost`` is in tokens: its prompt's estimate
    plus the tokens it asks for; ``deadline`` is monotonic seconds (or None)."""

    tenant: str
    spec: TenantSpec
    priority: int
    cost: float
    prompt_tokens: float
    deadline: float | None = None
    deadline_ms: float | None = None


DEFAULT_TICKET = Ticket(DEFAULT_TENANT, TenantSpec(), 0, 1.0, 0.0)


def body_priority(body: Mapping[str, Any]) -> int | None:
    """The body's ``priority`` as vLLM's OpenAI server reads it (an integer, lower is
    served sooner); None when absent; 400 when it is not an integer."""
    value = body.get("priority")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest("priority must be an integer", param="priority")
    if not -_PRIORITY_BOUND <= value < _PRIORITY_BOUND:
        raise BadRequest("priority is out of range", param="priority")
    return value


def deadline_ms(headers: Mapping[str, str]) -> float | None:
    """``x-slo-ttft-ms``: a positive number of milliseconds, else 400."""
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw.strip()[:32])
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise BadRequest(f"{DEADLINE_HEADER} must be a positive number of milliseconds")
    return min(value, _MAX_DEADLINE_MS)


def tenant_name(config: TenantsConfig, key_tenant: str | None, headers: Mapping[str, str]) -> str:
    """The client key's tenant, else the tenant header's, else the default; a name the
    tenants file does not list is served as the default tenant."""
    if key_tenant is not None:
        return config.known(key_tenant)
    if config.header is not None:
        named = headers.get(config.header)
        if named is not None:
            if not valid_name(named):
                raise BadRequest(
                    f"the {config.header} header must name a tenant in 1-128 printable"
                    " ASCII characters without spaces"
                )
            return config.known(named)
    return DEFAULT_TENANT


def asked_tokens(body: Mapping[str, Any]) -> int:
    """The tokens a body asks for (``max_tokens``, ``max_completion_tokens``), else
    vLLM's default for a completion; odd values count as that default."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, 10**7)
    return DEFAULT_MAX_TOKENS


def make_ticket(
    config: TenantsConfig,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    key_tenant: str | None,
    prompt_tokens: float,
    now: float,
) -> Ticket:
    """Who the request is; raises ``BadRequest`` for a bad priority, deadline or tenant
    header (nothing was counted yet)."""
    tenant = tenant_name(config, key_tenant, headers)
    spec = config.spec(tenant)
    own = body_priority(body)
    ms = deadline_ms(headers)
    return Ticket(
        tenant=tenant,
        spec=spec,
        priority=spec.priority if own is None else own,
        cost=max(prompt_tokens, 1.0) + asked_tokens(body),
        prompt_tokens=prompt_tokens,
        deadline=None if ms is None else now + ms / 1000.0,
        deadline_ms=ms,
    )
