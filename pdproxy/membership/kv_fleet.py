"""One KV-event subscriber per engine rank of the fleet (``--kv-events-endpoint``).

Follows the registry: an instance that joins gets a subscriber per data-parallel rank, on
the endpoint its registration or admin add names (``EngineAddress.kv_events_endpoint``)
or else the flag's template (an instance with neither is scored approximately); one
that leaves takes its subscribers and its entries in the index with it. A rank is scored
from the index (``KVIndex.live``) from its subscriber's first replay until it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from pdproxy.config.addresses import url_host_port
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.kv_subscriber import KVEventSubscriber
from pdproxy.scheduling.kv_events import KVIndex
from pdproxy.scheduling.kv_keys import instance_name

logger = logging.getLogger(__name__)

_PORT = re.compile(r":(\d+)$")


def endpoint_for(template: str, url: str, rank: int) -> str:
    """``template`` for the instance at ``url`` and DP rank ``rank``: ``{host}``,
    ``{port}`` and ``{dp_rank}`` filled; without ``{dp_rank}`` the endpoint's port is
    offset by the rank (vLLM's ``offset_endpoint_port``)."""
    host, port = url_host_port(url)
    if ":" in host:
        host = f"[{host}]"
    filled = template.format(host=host, port=port, dp_rank=rank)
    if "{dp_rank}" in template or rank == 0:
        return filled
    match = _PORT.search(filled)
    if match is None:  # ipc://: vLLM appends the rank to the path
        return f"{filled}_dp{rank}"
    return f"{filled[: match.start()]}:{int(match.group(1)) + rank}"


@dataclass(slots=True)
class _Running:
    subscriber: KVEventSubscriber
    task: asyncio.Task[None]


class KVEventFleet:
    def __init__(
        self, config: SchedulingConfig, registry: EndpointRegistry, index: KVIndex
    ) -> None:
        self._template = config.kv_events_endpoint
        self._replay = config.kv_events_replay_endpoint
        self._topic = config.kv_events_topic
        self._max_subscribers = config.kv_events_max_subscribers
        self._capped = False
        self._registry = registry
        self.index = index
        self._context: zmq.asyncio.Context | None = None
        self._running: dict[str, _Running] = {}  # instance_name -> its subscriber

    def start(self) -> None:
        self._context = zmq.asyncio.Context()
        self._registry.on_change(self.reconcile)
        self.reconcile()

    def reconcile(self) -> None:
        """Start subscribers for new instance ranks, stop those of instances gone."""
        if self._context is None:
            return
        wanted: dict[str, tuple[str, str | None]] = {}
        for endpoint in self._registry.all():
            address = endpoint.address
            events = address.kv_events_endpoint or self._template
            if events is None:  # neither its own nor the flag's: the approximate index
                continue
            replay = address.kv_events_replay_endpoint or (
                None if address.kv_events_endpoint else self._replay
            )
            for rank in range(max(endpoint.dp_size, 1)):
                if len(wanted) >= self._max_subscribers:
                    break
                wanted[instance_name(endpoint.url, rank)] = (
                    endpoint_for(events, endpoint.url, rank),
                    endpoint_for(replay, endpoint.url, rank) if replay else None,
                )
        if len(wanted) >= self._max_subscribers and not self._capped:
            logger.warning(
                "following the KV events of %d engine ranks, --kv-events-max-subscribers;"
                " the others are scored from the approximate index",
                self._max_subscribers,
            )
        self._capped = len(wanted) >= self._max_subscribers
        for name, running in list(self._running.items()):
            target = wanted.get(name)
            if target != (running.subscriber.endpoint, running.subscriber.replay_endpoint):
                self._stop(name, replaced=target is not None)  # gone, or new endpoints
        for name, (events, replay) in wanted.items():
            if name not in self._running:
                self._start(name, events, replay)

    def _start(self, name: str, events: str, replay: str | None) -> None:
        assert self._context is not None
        subscriber = KVEventSubscriber(
            self._context, self.index, name, events, replay, topic=self._topic
        )
        task = asyncio.get_running_loop().create_task(subscriber.run())
        self._running[name] = _Running(subscriber, task)
        logger.info("following the KV events of %s at %s", name, subscriber.endpoint)

    def _stop(self, name: str, *, replaced: bool = False) -> None:
        running = self._running.pop(name)
        running.subscriber.replaced = replaced  # then its successor owns the name's entries
        running.task.cancel()
        self.index.unfollow(name)
        self.index.release(name)

    async def aclose(self) -> None:
        tasks = [r.task for r in self._running.values()]
        self._running.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._context is not None:
            self._context.term()
            self._context = None

    def status(self) -> dict[str, Any]:
        """For ``/status``: the index's size against its cap, and each rank's subscriber."""
        return {
            "indexed_blocks": len(self.index),
            "max_blocks": self.index.max_blocks,
            "unchained_blocks": self.index.unchained,
            "instances": {
                name: {
                    "endpoint": r.subscriber.endpoint,
                    # subscribed and replayed: its events feed the index
                    "followed": name in self.index.followed,
                    "indexed_blocks": self.index.held(name),
                    "live": name in self.index.live,  # followed, trusted, not stale
                    "stale": name in self.index.staleness.stale,
                    "self_check": _figures(self.index, name),
                    "batches": r.subscriber.stats.batches,
                    "malformed": r.subscriber.stats.malformed,
                    "gaps": r.subscriber.sequence.gaps,
                    "restarts": r.subscriber.sequence.restarts,
                    "replays": r.subscriber.stats.replays,
                    "reconnects": r.subscriber.stats.reconnects,
                }
                for name, r in self._running.items()
            },
        }


def _figures(index: KVIndex, name: str) -> dict[str, Any] | None:
    figures = index.check.figures.get(name)
    return None if figures is None else dataclasses.asdict(figures)
