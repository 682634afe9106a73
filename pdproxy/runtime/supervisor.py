"""``--workers N``: N serving processes on one port, supervised, and one membership owner.

The parent process is both the supervisor and the membership owner. It binds the ZMQ
registry, applies the admin API's writes (the workers forward them), runs the active health
checks, the engines' ``/metrics`` scrapes and the sweeper on its own asyncio loop, and
publishes the membership to the workers (``pdproxy.runtime.owner``, ``.hub``); it serves no
HTTP. Why the parent and not a worker or a process of its own:

* one owner for the process's life: a worker may die and be restarted, the parent does not
  (when it does, every worker follows it out), so membership never changes hands, and a
  worker's restart loses nothing but its own in-flight requests;
* the owner's work is periodic and small (probes, scrapes, heartbeats), so it needs no core
  of its own, and the serving loops carry none of it: with N workers the fleet is probed and
  scraped once, not N times;
* one fewer process to supervise, and the registry port, like the HTTP port, belongs to the
  process an operator started.

The supervisor creates a private run directory (mode 0700) for the owner's ``ipc://``
sockets and prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set before
any metric exists), checks that the port is free (and resolves ``--port 0`` once), starts
the owner (the static instances' first probes awaited), then the workers, each in its own
session so a terminal's Ctrl-C reaches only the supervisor. A worker that dies is restarted
after a backoff (``pdproxy.runtime.restart``) and its live gauges are marked dead; one that
cannot start the first time (exit status 3) stops the whole tree with status 1. The first
SIGTERM or SIGINT is passed to every worker as SIGTERM (each drains as a single pdproxy
does); a second one is passed as SIGINT (uvicorn's forced exit). When every worker has
exited (or was killed past ``--shutdown-timeout-secs`` and uvicorn's own grace), the owner
stops, the run directory is removed, and the exit status is 0 unless a worker had to be
killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.workers import BOOT_FAILURE, METRICS_ENV, RunDir, WorkerSpec
from pdproxy.runtime.child import listen_socket
from pdproxy.runtime.restart import RestartBackoff

logger = logging.getLogger(__name__)

_POLL = 0.1  # seconds between checks of the workers
# Past the drain's grace: its aftermath (lifecycle) and uvicorn's own graceful shutdown.
_STOP_MARGIN = 15.0


def supervise(config: ProxyConfig) -> int:
    """Run the owner and ``config.workers`` workers until a signal; the exit status."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("--workers: prometheus_client was imported before its directory")
    run_dir = RunDir(tempfile.mkdtemp(prefix="pdproxy-"))
    try:
        os.mkdir(run_dir.metrics, 0o700)
        os.environ[METRICS_ENV] = run_dir.metrics
        try:
            port = _free_port(config)
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", config.host, config.port, exc.strerror)
            return 1
        return _run(_Supervisor(config, run_dir, port).run())
    finally:
        shutil.rmtree(run_dir.path, ignore_errors=True)


def _free_port(config: ProxyConfig) -> int:
    """The port the workers share, checked free (a bind, released at once)."""
    with contextlib.closing(listen_socket(config.host, config.port)) as probe:
        port: int = probe.getsockname()[1]
        return port


def _run(main: object) -> int:
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return int(runner.run(main))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return int(asyncio.run(main))  # type: ignore[arg-type]


@dataclass(slots=True)
class _Slot:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float = 0.0
    starts: int = 0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)


class _Supervisor:
    def __init__(self, config: ProxyConfig, run_dir: RunDir, port: int) -> None:
        # The resolved port: the membership owner refuses pdproxy's own address as an instance.
        self._config = dataclasses.replace(config, port=port)
        self._run_dir = run_dir
        self._port = port
        self._slots = [_Slot(i) for i in range(config.workers)]
        self._stop = asyncio.Event()
        self._signals = 0
        self._failed = False  # a worker could not start at all: stop, exit 1

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled, sig)
        # SIGHUP reloads the tenants file in every worker (each holds its own admission)
        loop.add_signal_handler(signal.SIGHUP, self._send, signal.SIGHUP)
        from pdproxy.runtime.owner import MembershipOwner  # after PROMETHEUS_MULTIPROC_DIR

        owner = MembershipOwner(self._config, self._run_dir)
        try:
            await owner.start()
            logger.info(
                "supervising %d workers on port %d (pid %d owns the membership)",
                len(self._slots),
                self._port,
                os.getpid(),
            )
            await self._watch()
            status = await self._stop_workers()
            return 1 if self._failed else status
        finally:
            await owner.aclose()

    def _signalled(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info("%s: draining %d workers", signal.Signals(sig).name, len(self._slots))
            self._stop.set()
        else:  # a second signal forces the workers out, as it does a single pdproxy
            self._send(signal.SIGINT)

    async def _watch(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for slot in self._slots:
                if slot.proc is not None and slot.proc.poll() is not None:
                    self._died(slot, now)
                if slot.proc is None and now >= slot.restart_at:
                    self._spawn(slot)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), _POLL)

    def _spawn(self, slot: _Slot) -> None:
        spec = WorkerSpec(slot.index, len(self._slots), self._port, self._run_dir, os.getpid())
        env = {**os.environ, METRICS_ENV: self._run_dir.metrics}
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdproxy.runtime.child"],
            stdin=subprocess.PIPE,
            env=env,
            start_new_session=True,  # the supervisor passes signals on, once
        )
        assert proc.stdin is not None
        with proc.stdin:
            proc.stdin.write(pickle.dumps((self._config, spec)))
        slot.proc, slot.started = proc, time.monotonic()
        slot.starts += 1
        logger.info("worker %d/%d started (pid %d)", slot.index + 1, len(self._slots), proc.pid)

    def _died(self, slot: _Slot, now: float) -> None:
        assert slot.proc is not None
        pid, status = slot.proc.pid, slot.proc.returncode
        self._forget(pid)
        if status == BOOT_FAILURE and slot.starts == 1:
            # As gunicorn does: a worker that cannot boot the first time will not later
            # (its certificate, its port); a restart loop would only hide it.
            logger.error("worker %d (pid %d) could not start; stopping", slot.index + 1, pid)
            slot.proc, self._failed = None, True
            self._stop.set()
            return
        delay = slot.backoff.delay(now - slot.started)
        slot.proc, slot.restart_at = None, now + delay
        logger.warning(
            "worker %d (pid %d) exited with status %d; restarting it in %.1f s",
            slot.index + 1,
            pid,
            status,
            delay,
        )

    def _forget(self, pid: int) -> None:
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self._run_dir.metrics)  # type: ignore[no-untyped-call]

    def _send(self, sig: int) -> None:
        for slot in self._slots:
            if slot.proc is not None and slot.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(sig)

    async def _stop_workers(self) -> int:
        """SIGTERM every worker, wait for their drains, kill what outlives them."""
        self._send(signal.SIGTERM)
        deadline = time.monotonic() + self._config.shutdown_timeout + _STOP_MARGIN
        live = [s.proc for s in self._slots if s.proc is not None]
        # A poll: a child's exit has no event on the loop (its pidfd aside), and this runs
        # once, while shutting down.
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL)
        status = 0
        for proc in live:
            if proc.poll() is None:
                logger.error("worker pid %d did not stop in time; killing it", proc.pid)
                proc.kill()
                await asyncio.to_thread(proc.wait)
                status = 1
            self._forget(proc.pid)
        logger.info("all workers stopped")
        return status
