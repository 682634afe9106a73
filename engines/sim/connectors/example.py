"""ExampleConnector-like shared storage: P writes KV files to kv_dir, D reads them.

Keys follow vLLM's ExampleConnector: the file name is md5 of the prompt's first n token ids.
P stores n = ((N-1)//bs)*bs tokens and D looks up n = ((N-2)//bs)*bs, so short prompts and
(N-1) % bs == 0 miss and D recomputes (PROTOCOLS.md 5.1).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engines.sim import model
from engines.sim.connectors import ConnectorDeps
from engines.sim.openai_api import GenRequest

log = logging.getLogger("engines.sim.example")


class ExampleConnector:
    bootstrap_port: int | None = None

    def __init__(self, deps: ConnectorDeps) -> None:
        self.cfg = deps.config
        self.counters = deps.counters
        self.kv_port = 0
        self.dir = Path(self.cfg.kv_dir) if self.cfg.kv_dir else None
        self.stores = self.dir is not None and self.cfg.role in ("prefill", "both")
        self.loads = self.dir is not None and self.cfg.role in ("decode", "both")

    async def start(self) -> None:
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    async def stop(self) -> None:
        return None

    def held_blocks(self) -> int:
        return 0

    def reject(self, params: dict[str, Any]) -> None:
        return None  # nothing is held for a decode

    def must_fetch(self, req: GenRequest) -> bool:
        return False

    async def fetch(self, req: GenRequest) -> list[bytes] | None:
        return self.load_now(req)

    def load_now(self, req: GenRequest) -> list[bytes] | None:
        n = ((len(req.prompt_tokens) - 2) // self.cfg.block_size) * self.cfg.block_size
        if not self.loads or n <= 0:
            return None
        path = self._path(req.prompt_tokens[:n])
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(data) != n * model.KV_BYTES_PER_TOKEN:
            log.warning(
                "KV file %s has %d bytes, expected %d",
                path,
                len(data),
                n * model.KV_BYTES_PER_TOKEN,
            )
            self.counters.kv_load_failures += 1
            return None
        log.info("External Cache Hit! Inject KV cache of %d tokens", n)
        self.counters.kv_bytes_received += len(data)
        self.counters.kv_transfers += 1
        return model.unpack_blocks([data])

    def finished(self, req: GenRequest, kv: Sequence[bytes]) -> dict[str, Any] | None:
        n = ((len(req.prompt_tokens) - 1) // self.cfg.block_size) * self.cfg.block_size
        if not self.stores or n <= 0:
            return None
        data = b"".join(kv[:n])
        path = self._path(req.prompt_tokens[:n])
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(path)
        self.counters.kv_bytes_sent += len(data)
        self.counters.kv_transfers += 1
        return None

    def _path(self, tokens: Sequence[int]) -> Path:
        assert self.dir is not None
        raw = b"".join(t.to_bytes(8, "big", signed=True) for t in tokens)
        return self.dir / f"{hashlib.md5(raw).hexdigest()}.kv"
