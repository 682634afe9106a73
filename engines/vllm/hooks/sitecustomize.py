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

_TARGETS = {"nixl._api", "nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"}


def _patch(module) -> None:
    cls = getattr(module, "nixl_agent_config", None)
    if cls is None or getattr(cls, "_pdproxy_patched", False):
        return
    orig_init = cls.__init__
    force = os.environ.get("PDPROXY_NIXL_HOOK_FORCE") == "1"

    def __init__(self, *args, **kwargs):  # noqa: N807
        if not args and ("enable_prog_thread" not in kwargs or force):
            kwargs["enable_prog_thread"] = False
        orig_init(self, *args, **kwargs)

    __init__.__doc__ = orig_init.__doc__
    __init__.__wrapped__ = orig_init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    cls._pdproxy_patched = True
    if os.environ.get("PDPROXY_NIXL_HOOK_VERBOSE") == "1":
        print(f"[pdproxy hook] {module.__name__}.nixl_agent_config: enable_prog_thread=False "
              f"(pid {os.getpid()})", file=sys.stderr, flush=True)


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


if os.environ.get("PDPROXY_NIXL_PROG_THREAD", "0") != "1":
    # Already imported (unlikely at start-up)? Patch in place.
    for _name in _TARGETS:
        if _name in sys.modules:
            _patch(sys.modules[_name])
    sys.meta_path.insert(0, _Finder())
