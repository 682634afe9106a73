"""Where a bench run's load goes: the engines' own URL, pdproxy's (and a variant's, an
anchor's) and the pids whose CPU is counted. Its own module so that ``bench.run``, which
starts the deployments, and ``bench.variants``, which measures one of them, need not import
each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """One way to the engines that the load goes through: its name, URL and the pid whose
    CPU is counted (0: none, the direct connection)."""

    name: str
    url: str
    pid: int = 0


@dataclass(frozen=True)
class Deployment:
    decode_url: str
    proxy_url: str
    proxy_pid: int
    model: str
    variant_url: str | None = None  # a second pdproxy, configured as the --variant says
    variant_pid: int = 0
    anchor_url: str | None = None  # vllm-router in front of the same engines
    anchor_pid: int = 0

    def paths(self) -> list[Route]:
        out = [Route("direct", self.decode_url), Route("pdproxy", self.proxy_url, self.proxy_pid)]
        if self.anchor_url is not None:
            out.append(Route("vllm-router", self.anchor_url, self.anchor_pid))
        return out
