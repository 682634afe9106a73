"""pdproxy-sim: a simulated vLLM engine that proves the KV handoff happened.

async with running_sim(SimConfig(role="prefill")) as p:
    ...  # p.url, p.kv_port, p.requests, p.metrics(), p.set_faults(status=503)
"""

from __future__ import annotations

from engines.sim.config import Faults, SimConfig
from engines.sim.server import SimHandle, SimServer, running_sim

__all__ = ["Faults", "SimConfig", "SimHandle", "SimServer", "running_sim"]
