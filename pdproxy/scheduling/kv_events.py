"""vLLM's KV cache events, decoded, and an exact index of which engine holds which blocks.

Wire format (PROTOCOLS.md §8, ``vllm/distributed/kv_events.py``): a batch is
``[ts, [event, ...], data_parallel_rank]``. An event is a tagged map in vLLM 0.32
(``{"type": "BlockStored", "block_hashes": [...], ...}``) and a positional array with the
tag first in earlier releases (``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``,
``["AllBlocksCleared"]``); both are read. Unknown event types and unknown fields are
ignored (the next vLLM adds some); a batch whose shape is wrong raises ``MalformedEvents``
(the subscriber counts and drops it).

The index is keyed on pdproxy's own hash of each block's token ids, chained to its
parent's key and rooted in the LoRA name and the first block's extra keys (the cache
salt), as vLLM chains its own: engines' hashes depend on a per-process seed and on
``--prefix-caching-hash-algo``, so they are only kept, per engine, to apply removals.
Python's ``hash`` of int tuples is the same in every process, so a request's keys
(``block_keys``) equal the keys of the events that stored its blocks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdproxy.scheduling.kv_awaited import AwaitedStores
from pdproxy.scheduling.kv_check import SelfCheck
from pdproxy.scheduling.kv_keys import root_key
from pdproxy.scheduling.kv_stale import Staleness
from pdproxy.scheduling.prefix_index import PrefixIndex

STORED = "BlockStored"
REMOVED = "BlockRemoved"
logger = logging.getLogger(__name__)

CLEARED = "AllBlocksCleared"
MAX_BLOCK_SIZE = 4096  # tokens a block of any vLLM configuration holds at most
_FULL_ATTENTION = ("full_attention", "FullAttentionSpec", "full")
_HASH_TYPES = frozenset((int, bytes))
# the positional fields of the arrays sent before events became tagged maps
_STORED_FIELDS: tuple[str, ...] = ("block_hashes", "parent_block_hash", "token_ids")
_STORED_FIELDS += ("block_size", "lora_id", "medium", "lora_name")
_REMOVED_FIELDS = ("block_hashes", "medium")


class MalformedEvents(ValueError):
    """A batch or event whose shape is not vLLM's."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: tuple[Hashable, ...]
    parent: Hashable | None
    token_ids: Sequence[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    first_extra: tuple[Any, ...] = ()  # the first block's extra keys (its cache salt)


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: tuple[Hashable, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def decode_batch(batch: Any) -> tuple[list[Event], int | None]:
    """A batch's events (those of the full-attention group) and its DP rank."""
    if not isinstance(batch, list | tuple) or len(batch) < 2:
        raise MalformedEvents("a batch is [ts, events, dp_rank]")
    events = batch[1]
    if not isinstance(events, list | tuple):
        raise MalformedEvents("a batch's events are a list")
    rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else None
    decoded = [e for e in map(decode_event, events) if e is not None]
    return decoded, rank


def decode_event(raw: Any) -> Event | None:
    """One event, or None for a type this version does not know (or another KV group)."""
    if isinstance(raw, Mapping):
        fields: Mapping[Any, Any] = raw
        kind = raw.get("type")
    elif isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == STORED else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise MalformedEvents(f"an event is a map or a tagged array, not {type(raw).__name__}")
    if kind == STORED:
        return _stored(fields)
    if kind == REMOVED:
        return Removed(_hashes(fields), _str(fields.get("medium")))
    if kind == CLEARED:
        return Cleared()
    return None


def _stored(fields: Mapping[Any, Any]) -> Stored | None:
    kind = fields.get("kv_cache_spec_kind")
    if kind is not None and kind not in _FULL_ATTENTION:
        return None  # sliding-window or mamba groups say nothing of a prefix hit
    hashes = _hashes(fields)
    tokens, size = fields.get("token_ids"), fields.get("block_size")
    if not isinstance(tokens, list | tuple) or not isinstance(size, int) or size < 1:
        raise MalformedEvents("BlockStored needs token_ids and a block_size")
    if size > MAX_BLOCK_SIZE:
        raise MalformedEvents(f"a block_size over {MAX_BLOCK_SIZE}")
    if len(tokens) < len(hashes) * size:
        raise MalformedEvents("BlockStored has fewer token ids than its blocks")
    extra = fields.get("extra_keys")
    first = extra[0] if isinstance(extra, list | tuple) and extra else None
    return Stored(
        hashes,
        _hash_or_none(fields.get("parent_block_hash")),
        tokens,
        size,
        _str(fields.get("lora_name")),
        _str(fields.get("medium")),
        tuple(first) if isinstance(first, list | tuple) else (),
    )


def _hashes(fields: Mapping[Any, Any]) -> tuple[Hashable, ...]:
    hashes = fields.get("block_hashes")
    # the types' set, not isinstance per hash: a batch at the subscriber's bound has
    # half a million (msgpack gives exactly int or bytes; a bool is refused)
    if not isinstance(hashes, list | tuple) or not _HASH_TYPES.issuperset(map(type, hashes)):
        raise MalformedEvents("block_hashes is a list of ints or bytes")
    return tuple(hashes)


def _hash_or_none(value: Any) -> Hashable | None:
    if value is None or isinstance(value, int | bytes):
        return value
    raise MalformedEvents("parent_block_hash is an int, bytes or null")


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def pieces(events: Sequence[Event], most: int) -> Iterator[list[Event]]:
    """``events`` in runs of at most ``most`` blocks each, applied one after the other to
    the same effect as all at once: a stored event longer than that is cut into parts,
    each part after the first chained to the last block of the one before (so a hostile
    batch of a million blocks is applied in turns the subscriber yields between)."""
    run: list[Event] = []
    room = most
    for event in events:
        if isinstance(event, Cleared) or not event.block_hashes:
            if room == 0:  # a clear or an empty event is work too: a turn holds so many
                yield run
                run, room = [], most
            run.append(event)
            room -= 1
            continue
        hashes, start = event.block_hashes, 0
        while start < len(hashes):
            if room == 0:
                yield run
                run, room = [], most
            part = _part(event, start, start + room)
            run.append(part)
            room -= len(part.block_hashes)
            start += len(part.block_hashes)
    if run:
        yield run


def _part(event: Stored | Removed, start: int, stop: int) -> Stored | Removed:
    if start == 0 and stop >= len(event.block_hashes):
        return event
    hashes = event.block_hashes[start:stop]
    if isinstance(event, Removed):
        return replace(event, block_hashes=hashes)
    size = event.block_size
    parent = event.parent if start == 0 else event.block_hashes[start - 1]
    tokens = event.token_ids[start * size : (start + len(hashes)) * size]
    return replace(event, block_hashes=hashes, parent=parent, token_ids=tokens)


class KVIndex:
    """Which engine (by URL) holds which blocks, exactly, from its events.

    Bounded: at most ``max_blocks`` keys (LRU, as ``PrefixIndex``), and per engine at
    most ``max_blocks`` engine hashes remembered for removals (the oldest go first: a
    removal of a forgotten hash is a no-op, and the key then ages out of the LRU).
    ``stale_after``: seconds without a batch, while sent work, before a rank is stale
    (``kv_stale``; 0: never).

    One per process, owned by the ``Scheduler`` (``Scheduler.kv_index``), read by the
    ``kv-events`` scorers (``kv_scorer``, ``kv_cost``). Fed from three modules: each
    rank's ``membership.kv_subscriber`` (``follow``, ``apply``, ``heard``, ``clear``,
    ``detach``/``drop``, ``unfollow``/``release``), ``membership.kv_fleet`` when a rank
    leaves (``unfollow``, ``release``), and the ``Scheduler`` itself with what its picks
    and the prefills' answers teach (``sweep``, ``expect``, ``await_stores``;
    ``verify`` through ``Scheduler.verify_prefill``, the prefill leg's ``kv_check``).
    """

    def __init__(self, max_blocks: int, *, stale_after: float = 0.0) -> None:
        self.prefixes = PrefixIndex(max_blocks)
        # engine ranks (``instance_name``) whose events are followed; of them, those the
        # self-check trusts and that are not stale are ``live``: scored from this index,
        # the others approximately
        self.followed: set[str] = set()
        self.live: set[str] = set()
        self.live_version = 0  # bumped by every change of ``live``
        self.check = SelfCheck()
        self.awaited = AwaitedStores()  # decodes' predictions, checked by their stores
        self.staleness = Staleness(stale_after)
        self.max_blocks = max_blocks
        # the fleet's block size: the one most engines' events state; the requests' keys
        # are cut at it, so an engine whose own differs is scored approximately alone
        self.block_size = 0
        self.block_sizes: dict[str, int] = {}  # each engine rank's, from its own events
        # url -> engine hash -> own key, oldest first (popitem(last=False) is O(1); a plain
        # dict's first key is found past every deleted slot before it, which made each
        # store into a full index cost 35-80 us a block instead of 2)
        self._keys: dict[str, OrderedDict[Hashable, int]] = {}
        self.unchained = 0  # stored blocks whose parent this index never saw

    def __len__(self) -> int:
        return len(self.prefixes)

    def apply(self, url: str, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, Stored):
                self._store(url, event)
            elif isinstance(event, Removed):
                self._remove(url, event)
            else:
                self.clear(url)

    def follow(self, name: str) -> None:
        """``name``'s events are followed: score it from this index (once trusted)."""
        self.followed.add(name)
        self._refresh(name)
        self.live_version += 1

    def unfollow(self, name: str) -> None:
        self.followed.discard(name)
        self.awaited.forget(name)
        self.block_sizes.pop(name, None)
        self.live.discard(name)
        self.check.forget(name)
        self.staleness.forget(name)
        self.live_version += 1

    def verify(self, name: str, predicted: int, actual: int) -> None:
        """The engine ``name`` found ``actual`` cached tokens where ``predicted`` were
        expected (``kv_check``): it may lose or regain its place in ``live``."""
        if name in self.followed:
            self.check.record(name, predicted, actual, self.block_size)
            self._refresh(name)

    def heard(self, name: str) -> None:
        """A batch from ``name`` (applied or not): its events flow."""
        if self.staleness.heard(name):
            self._refresh(name)

    def await_stores(self, name: str, keys: tuple[int, ...], predicted: int, now: float) -> None:
        """A decode leg for a prompt of ``keys`` went to ``name``, ``predicted`` tokens
        cached there: checked when ``name`` stores the first block it lacked (``kv_awaited``)."""
        if name in self.followed and self.block_size > 0:
            self.awaited.add(name, keys, predicted // self.block_size, now)

    def expect(self, name: str, now: float) -> None:
        """A leg that should store new blocks on ``name`` was sent at ``now``."""
        if name in self.followed:
            self.staleness.sent(name, now)

    def sweep(self, now: float) -> None:
        """Ranks whose events went stale by ``now`` leave ``live``."""
        for name in self.staleness.sweep(now):
            self._refresh(name)
        self.awaited.sweep(now)

    def _refresh(self, name: str) -> None:
        """``name`` is live iff followed, trusted by the self-check and not stale."""
        live = (
            name in self.followed
            and not self.check.distrusted(name)
            and name not in self.staleness.stale
            and self.block_sizes.get(name, self.block_size) == self.block_size
        )
        if live != (name in self.live):
            if live:
                self.live.add(name)
            else:
                self.live.discard(name)
            self.live_version += 1

    def _learn_size(self, url: str, size: int) -> None:
        """``url``'s events state its block size ``size``: one that changed makes what it
        held unreadable (its keys were cut at the old size); the fleet's size is the one
        most engines state, and an engine of another is not live (one publisher's block
        size of 1e18 once zeroed every engine's predictions)."""
        if url in self.block_sizes:
            self.clear(url)
            logger.warning("KV events of %s: block size now %d, rebuilding", url, size)
        self.block_sizes[url] = size
        counts: dict[int, int] = {}
        for value in self.block_sizes.values():
            counts[value] = counts.get(value, 0) + 1
        fleet = max(counts, key=lambda v: (counts[v], v == self.block_size))
        if fleet != self.block_size:
            self.block_size = fleet
            for name in list(self.followed):
                self._refresh(name)
        else:
            self._refresh(url)

    def clear(self, url: str) -> None:
        """Everything ``url`` held is gone (its engine cleared or restarted): O(what it
        held), never a walk of the whole index (``detach`` and ``drop`` do it in turns)."""
        self.drop(url, self.detach(url))

    def release(self, url: str) -> None:
        """``url`` left: what it held goes, and its place in the prefix index."""
        self.clear(url)
        self.prefixes.release(url)

    def detach(self, url: str) -> list[int]:
        """Forget ``url``'s engine hashes at once (its next stores start afresh); returns
        its keys, which ``drop`` takes out of the prefix index, all at once or in turns."""
        known = self._keys.pop(url, None)
        self.awaited.forget(url)  # what it was predicted to hold is gone with it
        return list(known.values()) if known else []

    def drop(self, url: str, keys: Sequence[int]) -> None:
        self.prefixes.remove(keys, url)

    def held(self, url: str) -> int:
        """The blocks ``url`` (an engine rank) holds as its events told them (at most
        ``max_blocks``)."""
        return len(self._keys.get(url, ()))

    def match(self, keys: tuple[int, ...]) -> dict[str, int]:
        return self.prefixes.match(keys)

    def _store(self, url: str, event: Stored) -> None:
        if self.block_sizes.get(url) != event.block_size:
            self._learn_size(url, event.block_size)
        known = self._keys.get(url)
        if known is None:
            known = self._keys[url] = OrderedDict()
        if event.parent is None:
            key = root_key(event.lora_name, event.first_extra)
        else:
            parent = known.get(event.parent)
            if parent is None:
                self.unchained += len(event.block_hashes)
                return
            key = parent
        size, tokens = event.block_size, event.token_ids
        keys = []
        stale = []
        for i, engine_hash in enumerate(event.block_hashes):
            key = hash((key, tuple(tokens[i * size : (i + 1) * size])))
            old = known.get(engine_hash)
            if old is not None and old != key:
                stale.append(old)  # the same hash re-stored as another block
            known[engine_hash] = key
            keys.append(key)
        self.prefixes.insert(keys, url)
        checked = self.awaited.stored(url, keys)
        if checked is not None:  # a decode's first missing block: its hit, in blocks
            self.verify(url, checked[0] * size, checked[1] * size)
        while len(known) > self.max_blocks:
            stale.append(known.popitem(last=False)[1])
        if stale:  # every key of url's in the prefix index stays one of ``known``'s
            self.prefixes.remove(stale, url)

    def _remove(self, url: str, event: Removed) -> None:
        known = self._keys.get(url)
        if not known:
            return
        keys = [k for k in map(known.pop, event.block_hashes, [None] * len(event.block_hashes))]
        self.prefixes.remove([k for k in keys if k is not None], url)
