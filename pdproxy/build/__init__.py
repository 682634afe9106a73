"""Every stateful object of one pdproxy, built once from its config and handed to whoever uses
it, composed into one immutable ``AppState`` (``pdproxy.api.state``): the shared objects
(``core``), the request path (``request_path``), and the control plane and this process's own
parts (``state``)."""

from __future__ import annotations

from pdproxy.build.state import build_state

__all__ = ["build_state"]
