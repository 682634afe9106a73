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
from pdproxy.wire.local_tokenizer import prompt_chars

logger = logging.getLogger(__name__)

_CHARS_PER_TOKEN = 4.0  # as the scheduler's default estimate (scheduling.features)


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
    """A cheap estimate of a body's prompt tokens: token ids counted, text by what renders
    (``prompt_chars``, bounded, the local tokenizer's own measure) at 4 characters a token."""
    for key in ("prompt_token_ids", "token_ids"):
        ids = body.get(key)
        if isinstance(ids, list):
            return float(len(ids))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return float(len(prompt))  # a completion's prompt as token ids
    return prompt_chars(body) / _CHARS_PER_TOKEN


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
        fresh = load_tenants(path, current.header)
    except ConfigError as exc:
        logger.error("tenants file not reloaded, the old one stays: %s", exc)
        raise
    admission.reload(fresh)
    message = f"tenants reloaded from {path}: {len(fresh.tenants)} tenants and the default"
    logger.info(message)
    return message
