"""KV connectors of the sim, one module per connector, chosen by name.

A connector sees each request twice: before prefill (`must_fetch`/`fetch` for a remote pull,
`load_now` for a local load) and after generation (`finished`, which may hold or store the KV
and returns the kv_transfer_params for the response); `reject` is told of a decode the handler
refused before admission. `fetch` may raise KVTransferError when
the request cannot be served without its KV (a push that never came): the request fails.
The id-embedding connectors (MoRIIO, P2P-NCCL, Mooncake) share `transfer.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engines.sim.config import SimConfig
from engines.sim.kvstore import BlockPool
from engines.sim.metrics import Counters
from engines.sim.openai_api import GenRequest

CONNECTORS: dict[str, str] = {
    "nixl": "engines.sim.connectors.nixl:NixlConnector",
    "nixl-push": "engines.sim.connectors.nixl_push:NixlPushConnector",
    "example": "engines.sim.connectors.example:ExampleConnector",
    "moriio": "engines.sim.connectors.moriio:MoriioConnector",
    "p2p-nccl": "engines.sim.connectors.p2p_nccl:P2pNcclConnector",
    "mooncake": "engines.sim.connectors.mooncake:MooncakeConnector",
}


@dataclass(frozen=True)
class ConnectorDeps:
    """What a connector may touch: the config, the counters and the block pool."""

    config: SimConfig
    counters: Counters
    pool: BlockPool


class Connector(Protocol):
    kv_port: int
    bootstrap_port: int | None  # Mooncake's bootstrap server; None for the others

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def held_blocks(self) -> int: ...

    def must_fetch(self, req: GenRequest) -> bool:
        """True when KV must be pulled over the network before prefill."""
        ...

    async def fetch(self, req: GenRequest) -> list[bytes] | None:
        """Pull or await the request's KV (per-token entries), or None to recompute locally.

        Raises KVTransferError when the request must fail instead of recomputing.
        """
        ...

    def load_now(self, req: GenRequest) -> list[bytes] | None:
        """Load KV without waiting (e.g. from shared storage), or None."""
        ...

    def finished(self, req: GenRequest, kv: Sequence[bytes]) -> dict[str, Any] | None:
        """Hold or store the KV of a finished request; return kv_transfer_params or None."""
        ...

    def reject(self, params: dict[str, Any]) -> None:
        """The handler rejected a decode carrying these `do_remote_prefill` params.

        Must not block or raise: a connector that tells the prefill to free the KV does it in
        the background (vLLM's `notify_kv_transfer_request_rejected`). Only NIXL does.
        """
        ...


def create(deps: ConnectorDeps) -> Connector:
    """Build the connector named by deps.config.connector."""
    target = CONNECTORS.get(deps.config.connector)
    if target is None:
        raise ValueError(
            f"unknown connector {deps.config.connector!r}; known: {sorted(CONNECTORS)}"
        )
    module, _, cls = target.partition(":")
    factory: Any = getattr(importlib.import_module(module), cls)
    connector: Connector = factory(deps)
    return connector
