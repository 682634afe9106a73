#!/usr/bin/env python3
"""Drive both legs of a NIXL push request by hand against a running push pair (stdlib only).

    python3 launch.py up --connector nixl-push --model smollm2-135m-instruct
    python3 probe_push.py [--prefill URL] [--decode URL] [--model NAME] [--repeat N] [--out JSON]

The pair must run vLLM's NixlPushConnector (``--connector nixl-push``); the token-in family
(``/inference/v1/generate``) is probed when the engines serve it (``--enable-scale-out``).

Each PD request has its own ``X-Request-Id`` on both legs and one endpoint family:

* P: the body with ``max_tokens`` 1, not streamed, ``kv_transfer_params: {do_remote_decode:
  true}`` (a longer prefill would shift the KV it writes);
* D: the body as the client sent it. **Serial**: after P answered, with P's
  ``kv_transfer_params`` verbatim. **Concurrent**: at the same time as P, with
  ``do_remote_prefill: true, do_remote_decode: false`` and P's coordinates
  (``remote_engine_id, remote_host, remote_port, tp_size, pp_size``) from the first serial
  request's P answer, and ``remote_request_id`` (vLLM's scheduler dies without it).

Every answer (temperature 0) is compared with a single engine's: the same body sent to D
alone with a fresh ``cache_salt``, so it computes the prompt itself. For each PD request it
also records D's ``prompt_tokens_by_source_total`` deltas (the pushed tokens count as
``external_kv_transfer``; NIXL's own ``vllm:nixl_xfer_time_seconds`` counts on P in push mode,
P being the writer) and D's time to its status line and to its first token (a streamed D sends
its 200 at once, before the KV). Every HTTP call has a timeout: a decode whose push never comes
is reported, not waited for.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engines.vllm.engine import http_get, metric_value, parse_metrics
from engines.vllm.settings import SMOLLM2

COMPLETIONS, CHAT, GENERATE = "completions", "chat", "generate"
PATHS = {
    COMPLETIONS: "/v1/completions",
    CHAT: "/v1/chat/completions",
    GENERATE: "/inference/v1/generate",
}
# P's coordinates, as its answers carry them: all a concurrent D leg needs besides the id.
COORDINATES = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size")
TEXT = (
    "Pushing the prefill's KV cache into blocks the decode has already allocated saves a "
    "round trip. Explain in one paragraph what a proxy must do when the prefill fails.\n"
)


@dataclass
class Answer:
    """One HTTP answer with its timing (seconds from the request's send)."""

    status: int = 0
    headers_s: float | None = None  # status line and headers received
    first_s: float | None = None  # first SSE event (streamed) or the whole body
    total_s: float | None = None
    body: bytes = b""
    error: str = ""


def send(
    base: str, path: str, body: dict[str, Any], *, request_id: str = "", timeout: float = 60.0
) -> Answer:
    """POST body to base+path; the socket timeout bounds every read, so a hung leg returns."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    answer = Answer()
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, json.dumps(body).encode(), headers)
        resp = conn.getresponse()
        answer.status, answer.headers_s = resp.status, time.perf_counter() - t0
        answer.body = _read(resp, answer, t0)
        answer.total_s = time.perf_counter() - t0
    except OSError as exc:  # timeouts included
        answer.error = f"{type(exc).__name__}: {exc} after {time.perf_counter() - t0:.1f} s"
    finally:
        conn.close()
    return answer


def _read(resp: http.client.HTTPResponse, answer: Answer, t0: float) -> bytes:
    if not resp.getheader("Content-Type", "").startswith("text/event-stream"):
        data = resp.read()
        answer.first_s = time.perf_counter() - t0
        return data
    lines = []
    for line in resp:
        if answer.first_s is None and line.startswith(b"data: {"):
            answer.first_s = time.perf_counter() - t0
        lines.append(line)
    return b"".join(lines)


def events(raw: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in raw.split(b"\n")
        if line.startswith(b"data: {")  # [DONE] and blank lines are no events
    ]


def output(family: str, raw: bytes, stream: bool) -> str | list[int]:
    """The generated text (token ids for generate) of a whole or streamed answer."""
    choices = [c for e in events(raw) for c in e.get("choices", [])] if stream else []
    if not stream:
        choices = json.loads(raw)["choices"]
    if family == GENERATE:
        return [t for c in choices for t in c.get("token_ids") or []]
    if family == CHAT:
        return "".join(
            ((c.get("delta") or c.get("message") or {}).get("content") or "") for c in choices
        )
    return "".join(c.get("text") or "" for c in choices)


@dataclass(frozen=True)
class Prompt:
    """One prompt in every family's shape (token ids as D's tokenizer gives them)."""

    text: str
    token_ids: tuple[int, ...]

    def body(self, family: str, model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        if family == GENERATE:
            params = {"max_tokens": max_tokens, "temperature": 0}
            return {
                "model": model,
                "token_ids": list(self.token_ids),
                "sampling_params": params,
                "stream": stream,
            }
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if family == CHAT:
            body["messages"] = [{"role": "user", "content": self.text}]
        else:
            body["prompt"] = self.text
        return body


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """P's leg: one token, not streamed, a producer."""
    leg = dict(body, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "sampling_params" in body:
        leg["sampling_params"] = dict(body["sampling_params"], max_tokens=1)
    else:
        leg["max_tokens"] = 1
    return leg


def concurrent_params(coordinates: dict[str, Any], request_id: str) -> dict[str, Any]:
    """D's kv_transfer_params when P has not answered yet (every key: a missing one kills D)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        **coordinates,
        "remote_request_id": request_id,
    }


def decode_counters(decode: str) -> dict[str, float]:
    status, text = http_get(decode + "/metrics", 10.0)
    metrics = parse_metrics(text) if status == 200 else {}
    name = "vllm:prompt_tokens_by_source_total"
    sources = ("external_kv_transfer", "local_compute", "local_cache_hit")
    counters = {s: metric_value(metrics, name, source=s) for s in sources}
    counters["kv_cache_usage_perc"] = metric_value(metrics, "vllm:kv_cache_usage_perc")
    return counters


@dataclass
class PushResult:
    """One PD request: both legs, D's output against the reference, D's counter deltas."""

    family: str
    mode: str  # serial or concurrent
    stream: bool
    request_id: str
    prefill: Answer
    decode: Answer
    equal: bool = False
    output: Any = None
    reference: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    deltas: dict[str, float] = field(default_factory=dict)


class Probe:
    """A push pair and the model's name; runs PD requests one at a time."""

    def __init__(self, prefill: str, decode: str, model: str, timeout: float = 60.0) -> None:
        self.prefill, self.decode, self.model, self.timeout = prefill, decode, model, timeout
        self.coordinates: dict[str, Any] | None = None

    def prompt(self, tag: str) -> Prompt:
        """A prompt no earlier request cached (its first line is the tag)."""
        text = f"[{tag}] {TEXT}"
        answer = send(
            self.decode, "/tokenize", {"model": self.model, "prompt": text}, timeout=self.timeout
        )
        return Prompt(text, tuple(json.loads(answer.body)["tokens"]))

    def reference(self, family: str, prompt: Prompt, max_tokens: int) -> tuple[Any, int]:
        """The single engine's output and its prompt's length (chat's includes the template)."""
        body = dict(prompt.body(family, self.model, max_tokens, False), cache_salt=uuid.uuid4().hex)
        answer = send(self.decode, PATHS[family], body, timeout=self.timeout)
        if answer.status != 200:
            raise RuntimeError(
                f"single-engine {family} answered {answer.status}: {answer.body[:300]!r}"
            )
        usage = json.loads(answer.body).get("usage") or {}
        return output(family, answer.body, False), int(usage.get("prompt_tokens") or 0)

    def serial(self, family: str, body: dict[str, Any], request_id: str) -> tuple[Answer, Answer]:
        p = send(
            self.prefill,
            PATHS[family],
            prefill_body(body),
            request_id=request_id,
            timeout=self.timeout,
        )
        params = json.loads(p.body).get("kv_transfer_params") if p.status == 200 else None
        if params is None:
            return p, Answer(error="P gave no kv_transfer_params: no decode leg sent")
        self.coordinates = self.coordinates or {k: params.get(k) for k in COORDINATES}
        d_body = dict(body, kv_transfer_params=params)
        return p, send(
            self.decode, PATHS[family], d_body, request_id=request_id, timeout=self.timeout
        )

    def concurrent(
        self, family: str, body: dict[str, Any], request_id: str, p_delay: float = 0.0
    ) -> tuple[Answer, Answer]:
        """Both legs at once (P's leg p_delay seconds after D's)."""
        if self.coordinates is None:
            raise RuntimeError("no coordinates yet: a serial request first")
        d_body = dict(body, kv_transfer_params=concurrent_params(self.coordinates, request_id))
        p_body = prefill_body(body)

        def p_leg() -> Answer:
            time.sleep(p_delay)
            return send(
                self.prefill, PATHS[family], p_body, request_id=request_id, timeout=self.timeout
            )

        def d_leg() -> Answer:
            return send(
                self.decode, PATHS[family], d_body, request_id=request_id, timeout=self.timeout
            )

        return run_both(p_leg, d_leg)

    def push(
        self, family: str, mode: str, stream: bool, *, max_tokens: int = 24, p_delay: float = 0.0
    ) -> PushResult:
        request_id = f"probe{uuid.uuid4().hex}"  # no trailing -<8hex>: vLLM strips those
        prompt = self.prompt(request_id)
        reference, prompt_tokens = self.reference(family, prompt, max_tokens)
        body = prompt.body(family, self.model, max_tokens, stream)
        before = decode_counters(self.decode)
        if mode == "serial":
            p, d = self.serial(family, body, request_id)
        else:
            p, d = self.concurrent(family, body, request_id, p_delay)
        after = decode_counters(self.decode)
        result = PushResult(family, mode, stream, request_id, p, d, reference=reference)
        result.kv_transfer_params = (
            json.loads(p.body).get("kv_transfer_params") if p.status == 200 else None
        )
        result.deltas = {k: after[k] - before[k] for k in before if k != "kv_cache_usage_perc"}
        result.deltas["prompt_tokens"] = prompt_tokens or len(prompt.token_ids)
        if d.status == 200:
            result.output = output(family, d.body, stream)
            result.equal = result.output == reference
        return result


def run_both(first: Callable[[], Answer], second: Callable[[], Answer]) -> tuple[Answer, Answer]:
    """Run both calls on threads at once; their answers in the same order."""
    answers: list[Answer] = [Answer(), Answer()]

    def run(i: int, call: Callable[[], Answer]) -> None:
        answers[i] = call()

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers[0], answers[1]


def families(probe: Probe) -> list[str]:
    """The families this pair serves (generate only with --enable-scale-out: 404 without)."""
    answer = send(probe.decode, PATHS[GENERATE], {}, timeout=probe.timeout)
    return [COMPLETIONS, CHAT] + ([GENERATE] if answer.status not in (0, 404) else [])


def summary_line(r: PushResult) -> str:
    d = r.decode
    timing = f"D headers {fmt(d.headers_s)} first {fmt(d.first_s)} total {fmt(d.total_s)}"
    pushed = f"external {r.deltas.get('external_kv_transfer', 0):.0f}/{r.deltas['prompt_tokens']}"
    pushed += f" local {r.deltas.get('local_compute', 0):.0f}"
    verdict = "EQUAL" if r.equal else f"DIFFERENT ({d.status} {d.error or ''})"
    return f"{r.family:11} {r.mode:10} stream={r.stream!s:5} {verdict:9} {pushed}  {timing}"


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prefill", default="http://127.0.0.1:8100")
    ap.add_argument("--decode", default="http://127.0.0.1:8200")
    ap.add_argument("--model", default=SMOLLM2, help="the served model name")
    ap.add_argument("--repeat", type=int, default=1, help="PD requests per family, mode and stream")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds for any one read")
    ap.add_argument("--out", type=Path, help="write every result as JSON")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    probe = Probe(args.prefill, args.decode, args.model, args.timeout)
    first = probe.push(COMPLETIONS, "serial", False)  # teaches the coordinates
    print(f"[probe] P's kv_transfer_params: {json.dumps(first.kv_transfer_params)}", flush=True)
    results = [first]
    for family in families(probe):
        for stream in (False, True):
            for mode in ("serial", "concurrent"):
                for _ in range(args.repeat):
                    results.append(probe.push(family, mode, stream))
                    print(f"[probe] {summary_line(results[-1])}", flush=True)
    ok = all(r.equal for r in results)
    print(f"[probe] {sum(r.equal for r in results)}/{len(results)} equal a single engine's answer")
    if args.out:
        rows = [
            dict(asdict(r), prefill=None, decode=None, decode_timing=_timing(r.decode))
            for r in results
        ]
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    return 0 if ok else 1


def _timing(a: Answer) -> dict[str, Any]:
    return {
        "status": a.status,
        "headers_s": a.headers_s,
        "first_s": a.first_s,
        "total_s": a.total_s,
        "error": a.error,
    }


if __name__ == "__main__":
    sys.exit(main())
