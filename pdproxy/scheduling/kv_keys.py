"""The keys of ``KVIndex``: an engine rank's name, and pdproxy's own chained hash of a
prompt's whole blocks, which equals the key of the event that stored each block. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def instance_name(url: str, rank: int) -> str:
    """An engine rank's name in ``KVIndex`` (each data-parallel rank has its own cache)."""
    return f"{url}|{rank}"


def root_key(lora_name: str | None, first_extra: tuple[Any, ...]) -> int:
    """The key a prompt's first block chains to: its LoRA and cache salt."""
    return hash(("pdproxy-kv-root", lora_name, first_extra))


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    limit: int = 4096,
) -> tuple[int, ...]:
    """The chained keys of a prompt's whole blocks (at most ``limit``), as ``KVIndex``
    keys the engine's events. The first block's extra keys are vLLM's: the LoRA name,
    then the cache salt."""
    first: tuple[Any, ...] = tuple(k for k in (lora_name, cache_salt) if k is not None)
    key = root_key(lora_name, first)
    keys: list[int] = []
    for start in range(0, min(len(token_ids) // block_size, limit) * block_size, block_size):
        key = hash((key, tuple(token_ids[start : start + block_size])))
        keys.append(key)
    return tuple(keys)
