"""Tenants' limits shared exactly by the ``--workers`` processes: one memory-mapped file in
the run directory (``RunDir.limits``), a slot per tenant, a whole-file ``flock`` around each
admission of a limited tenant.

A slot holds the tenant's two buckets (limit, level, time of the last refill on the
host's monotonic clock, which every process shares) and each worker's requests in flight
in a column of its own: a worker that restarts zeroes its column, so a crashed worker's
requests never stay counted. Every worker charges and refunds the same buckets, so the
limits hold across workers exactly, whichever worker the kernel gives a connection to.

The file is the one piece of ``pdproxy.flow`` that touches the operating system (a memory
map and a lock; the standard library only). A single process needs none of it: its
``TenantLimits`` keeps the same state in memory.

Layout: ``_SLOTS`` slots (a name's hash and the name, the six figures, one in-flight count
per worker), found by linear probing from the hash of the name (at most ``MAX_TENANTS``
listed tenants and the default: under two thirds full).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

from pdproxy.config.tenants import MAX_NAME

_SLOTS = 1 << 14  # 16,384: MAX_TENANTS (10,000) and the default fill it under 2/3
_HEAD = struct.Struct(f"<Q{MAX_NAME}s")  # the name's hash (0: a free slot), the name
_FIGURES = struct.Struct("<6d")
_FIGURES_AT = _HEAD.size
_COLUMNS_AT = _FIGURES_AT + _FIGURES.size  # then one int32 per worker


@dataclass(slots=True)
class Figures:
    """A tenant's shared state: each bucket's limit (0: none), level and refill time, and
    its requests in flight over every worker."""

    rpm: float
    rpm_level: float
    rpm_at: float
    tpm: float
    tpm_level: float
    tpm_at: float
    in_flight: int = 0


class LimitsFile:
    """The file of ``workers`` processes, opened by worker number ``worker``."""

    def __init__(self, path: str, worker: int, workers: int) -> None:
        if not 0 <= worker < workers:
            raise ValueError(f"worker {worker} of {workers}")
        self._worker = worker
        self._columns = struct.Struct(f"<{workers}i")
        self._slot = _COLUMNS_AT + self._columns.size
        size = _SLOTS * self._slot
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked_fd():
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)  # sparse: zero pages cost nothing
        self._map = mmap.mmap(self._fd, size)
        self._slots: dict[str, int] = {}  # name -> slot index, found once
        with self.locked():
            self._zero_own_column()

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Every process's admissions of limited tenants, one at a time."""
        with self._locked_fd():
            yield

    @contextlib.contextmanager
    def _locked_fd(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def read(self, tenant: str) -> Figures | None:
        """``tenant``'s figures (under ``locked``); None when no worker has written any."""
        offset = self._offset(tenant, create=False)
        if offset is None:
            return None
        figures = Figures(*_FIGURES.unpack_from(self._map, offset + _FIGURES_AT))
        figures.in_flight = sum(self._columns.unpack_from(self._map, offset + _COLUMNS_AT))
        return figures

    def write(self, tenant: str, figures: Figures, own_in_flight: int) -> None:
        """``tenant``'s buckets, and this worker's requests in flight (under ``locked``)."""
        offset = self._offset(tenant, create=True)
        assert offset is not None
        _FIGURES.pack_into(
            self._map,
            offset + _FIGURES_AT,
            figures.rpm,
            figures.rpm_level,
            figures.rpm_at,
            figures.tpm,
            figures.tpm_level,
            figures.tpm_at,
        )
        struct.pack_into("<i", self._map, offset + _COLUMNS_AT + 4 * self._worker, own_in_flight)

    def _offset(self, tenant: str, *, create: bool) -> int | None:
        index = self._slots.get(tenant)
        if index is not None:
            return index * self._slot
        name = tenant.encode()[:MAX_NAME]
        key = int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little") or 1
        start = key % _SLOTS
        for probe in range(_SLOTS):
            index = (start + probe) % _SLOTS
            offset = index * self._slot
            (held,) = struct.unpack_from("<Q", self._map, offset)
            if held == 0:
                if not create:
                    return None
                _HEAD.pack_into(self._map, offset, key, name)
                self._slots[tenant] = index
                return offset
            if held == key and self._map[offset + 8 : offset + 8 + MAX_NAME].rstrip(b"\0") == name:
                self._slots[tenant] = index
                return offset
        raise RuntimeError("the shared limits file is full")  # bounded by MAX_TENANTS

    def _zero_own_column(self) -> None:
        """A worker starting (or restarting) has no request in flight."""
        column = 4 * self._worker
        for index in range(_SLOTS):
            offset = index * self._slot
            if struct.unpack_from("<Q", self._map, offset)[0]:
                struct.pack_into("<i", self._map, offset + _COLUMNS_AT + column, 0)
