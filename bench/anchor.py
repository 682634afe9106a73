"""vllm-router, the Rust router of the vLLM project, as the benchmark's anchor.

`make bench ANCHOR=vllm-router` installs it from PyPI (a Rust extension in a wheel, with a
small Python launcher) into its own venv, once, and runs it in vLLM PD mode in front of the
same prefill and decode sims as pdproxy, so both are measured alike in one run.

What it sends the engines (read from its requests to the sim, vllm-router 0.1.17, NIXL):
the prefill gets the body with ``max_tokens: 1``, ``min_tokens: 1``, ``stream: false`` and
``kv_transfer_params: {"do_remote_decode": true, ...}``; the decode gets the client's body
with the ``kv_transfer_params`` of the prefill's answer. Both legs carry
``X-Request-Id: ___prefill_addr_HOST:PORT___decode_addr_HOST:PORT_<uuid>`` (the P2P NCCL
connector's convention; NIXL ignores it). Before serving it reads each engine's ``/health``
and ``/metrics`` (the engine count). The sim's vLLM contract covers all of it unchanged.

    python -m bench.anchor install   # the venv alone (idempotent)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

NAME = "vllm-router"
VERSION = "0.1.17"
VENV = Path.home() / ".cache" / "pdproxy" / "vllm-router-venv"
STAMP = ".pdproxy-venv.stamp"
Runner = Callable[[list[str]], object]


def _run(args: list[str]) -> object:
    return subprocess.run(args, check=True)


@dataclass(frozen=True)
class Anchor:
    """An installed vllm-router: its launcher and version."""

    binary: Path
    version: str
    # as users run it: its own default policy (cache_aware) and log level (info), as
    # pdproxy runs on its defaults in the headline; else round robin, logs at warning
    defaults: bool = False

    def command(self, port: int, prefill: str, decode: str, metrics_port: int) -> list[str]:
        """PD mode over one prefill and one decode, round robin on both, logs at warning
        (its cheapest configuration), or its own defaults (``defaults``). Its Prometheus
        listener defaults to a fixed port (29000), so it gets a free one; the startup check
        polls every second (the default 30 s would only delay the start: the sims answer
        before it runs)."""
        if self.defaults:
            return self.fleet_command(port, [prefill], [decode], metrics_port, None, None)
        return self.fleet_command(port, [prefill], [decode], metrics_port)

    def fleet_command(
        self,
        port: int,
        prefills: Sequence[str],
        decodes: Sequence[str],
        metrics_port: int,
        policy: str | None = "round_robin",
        log_level: str | None = "warning",
    ) -> list[str]:
        """PD mode over every prefill and decode with one policy for both roles (None:
        its default, cache_aware) and a log level (None: its default, info)."""
        fleet = [a for url in prefills for a in ("--prefill", url)]
        fleet += [a for url in decodes for a in ("--decode", url)]
        return [
            str(self.binary),
            *("--host", "127.0.0.1", "--port", str(port)),
            "--vllm-pd-disaggregation",
            *fleet,
            *(("--policy", policy) if policy is not None else ()),
            *("--kv-connector", "nixl"),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
            *("--worker-startup-check-interval", "1"),
            *(("--log-level", log_level) if log_level is not None else ()),
        ]


def installed(venv: Path = VENV, version: str = VERSION) -> Anchor | None:
    """The anchor in ``venv`` if its stamp says ``version`` was installed there."""
    binary = venv / "bin" / NAME
    stamp = venv / STAMP
    if binary.exists() and stamp.exists() and stamp.read_text().strip() == version:
        return Anchor(binary, version)
    return None


def ensure(venv: Path = VENV, version: str = VERSION, run: Runner = _run) -> Anchor:
    """Install vllm-router ``version`` into its own venv unless the stamp says it is there.
    A lock beside the venv keeps two benchmarks from installing it at once; an interrupted
    install leaves no stamp, so the next call starts over."""
    found = installed(venv, version)
    if found is not None:
        return found
    venv.parent.mkdir(parents=True, exist_ok=True)
    with _locked(venv.with_name(venv.name + ".lock")):
        found = installed(venv, version)
        if found is not None:
            return found
        print(f"==> installing {NAME} {version} into {venv}", file=sys.stderr, flush=True)
        shutil.rmtree(venv, ignore_errors=True)
        run([sys.executable, "-m", "venv", str(venv)])
        python = str(venv / "bin" / "python")
        run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
        run([python, "-m", "pip", "install", "-q", f"{NAME}=={version}"])
        if not (venv / "bin" / NAME).exists():
            raise RuntimeError(f"{NAME} {version} did not install into {venv}")
        (venv / STAMP).write_text(version + "\n")
    return Anchor(venv / "bin" / NAME, version)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["install"])
    p.add_argument("--venv", type=Path, default=VENV)
    p.add_argument("--version", default=VERSION)
    a = p.parse_args(argv)
    anchor = ensure(a.venv, a.version)
    print(f"{NAME} {anchor.version}: {anchor.binary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
