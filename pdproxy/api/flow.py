"""Who a generation request is, for admission (``pdproxy.flow``): read from its body, its
headers and its key, before it queues. Also the tenants file's reload."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pdproxy.api.state import AppState
from pdproxy.config.tenants import load_tenants
from pdproxy.errors import ConfigError
from pdproxy.flow.ticket import DEADLINE_HEADER, DEFAULT_TICKET, Ticket, make_ticket

logger = logging.getLogger(__name__)

_CHARS_PER_TOKEN = 4.0  # as the scheduler's default estimate (scheduling.features)
_MAX_WALK = 4096  # list items looked at for a size; past them the estimate stops growing


def ticket_for(state: AppState, body: Mapping[str, Any], headers: Mapping[str, str]) -> Ticket:
    """The request's ticket; the shared default when flow control has nothing to say (no
    tenants, no priority, no deadline: today's first come, first served at no cost)."""
    admission = state.admission
    if admission is None:
        return DEFAULT_TICKET
    tenants = admission.tenants
    if not tenants.enabled and "priority" not in body and DEADLINE_HEADER not in headers:
        return DEFAULT_TICKET
    key_tenant = state.keys.tenant_of(headers.get("authorization")) if state.keys.enabled else None
    return make_ticket(tenants, body, headers, key_tenant, prompt_tokens(body), state.clock())


def prompt_tokens(body: Mapping[str, Any]) -> float:
    """A cheap estimate of a body's prompt tokens: token ids counted, text by characters."""
    for key in ("prompt_token_ids", "token_ids"):
        ids = body.get(key)
        if isinstance(ids, list):
            return float(len(ids))
    prompt = body.get("prompt")
    if prompt is not None:
        return _size(prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        total = 0.0
        for message in messages[:_MAX_WALK]:
            if isinstance(message, dict):
                total += _size(message.get("content")) + 4.0  # the role's tokens
        return total
    return 0.0


def _size(value: object) -> float:
    if isinstance(value, str):
        return len(value) / _CHARS_PER_TOKEN
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value[:8]):
            return float(len(value))  # token ids
        total = 0.0
        for item in value[:_MAX_WALK]:
            if isinstance(item, str):
                total += len(item) / _CHARS_PER_TOKEN
            elif isinstance(item, dict):
                text = item.get("text")
                total += len(text) / _CHARS_PER_TOKEN if isinstance(text, str) else 1.0
            elif isinstance(item, list):
                total += len(item)
        return total
    return 0.0


def reload_tenants(state: AppState) -> str:
    """Read the tenants file again (SIGHUP, ``POST /admin/tenants/reload``); queued requests
    keep their place. Returns what happened, for the log or the admin answer; a bad file
    changes nothing."""
    admission = state.admission
    current = state.config.tenants
    if admission is None or admission.tenants.path is None:
        return "no --tenants file to reload"
    path = admission.tenants.path
    try:
        fresh = load_tenants(path, current.header).divided(state.config.workers)
    except ConfigError as exc:
        logger.error("tenants file not reloaded, the old one stays: %s", exc)
        raise
    admission.reload(fresh)
    message = f"tenants reloaded from {path}: {len(fresh.tenants)} tenants and the default"
    logger.info(message)
    return message
