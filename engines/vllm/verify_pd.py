#!/usr/bin/env python3
"""Check by hand that KV really moves between a running prefill and decode engine (stdlib only).

    python3 verify_pd.py --connector nixl    [--prefill URL] [--decode URL] [--out result.json]
    python3 verify_pd.py --connector example [--baseline nixl-result.json] [--store DIR --venv-python PY]

What it does (temperature 0, completions API, prompts sent as token-id lists of an exact length):

* baseline: the request sent straight to D without kv_transfer_params. With NIXL it carries a
  ``cache_salt`` so D computes the prompt itself and its prefix cache holds nothing unsalted for
  it afterwards. (ExampleConnector loads from its store on any engine, so its baseline comes from
  ``--baseline``, the JSON of an earlier NIXL run with the same model, prompts and flags.)
* disaggregated: P leg (max_tokens=1, stream false, kv_transfer_params do_remote_decode for NIXL),
  then the original body to D, with P's ``kv_transfer_params`` verbatim (NIXL). Checks D's output
  equals the baseline, and D's /metrics: prompt_tokens_by_source_total{source=external_kv_transfer}
  and (NIXL) nixl_xfer_time_seconds_count rose.
* negative control: NIXL: D gets prompt C with the params of another prompt D' of the same length;
  its output must differ from C's baseline. Example: overwrite the stored tensors of a prompt with
  noise (needs the vLLM venv's python for safetensors) and check D's output changes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import SERVED_MODEL_NAME, metric_value, parse_metrics

TEXTS = {
    "A": "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description='demo')\n"
    "    parser.add_argument('--path', default=os.getcwd())\n    args = parser.parse_args(argv)\n"
    "    for name in sorted(os.listdir(args.path)):\n        print(name)\n    return 0\n\n\n"
    "class Cache(dict):\n    def __missing__(self, key):\n        value = self[key] = len(key)\n"
    "        return value\n\n\nif __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n",
    "B": "class Queue:\n    '''A simple FIFO queue built on a list.'''\n\n    def __init__(self, maxsize=0):\n"
    "        self.maxsize = maxsize\n        self._items = []\n\n    def put(self, item):\n"
    "        if self.maxsize and len(self._items) >= self.maxsize:\n            raise ValueError('full')\n"
    "        self._items.append(item)\n\n    def get(self):\n        return self._items.pop(0)\n\n"
    "    def __len__(self):\n        return len(self._items)\n\n    def __repr__(self):\n"
    "        return f'Queue({self._items!r})'\n",
    "C": "def read_config(filename, encoding='utf-8'):\n    result = {}\n    with open(filename, encoding=encoding) as f:\n"
    "        for line in f:\n            line = line.strip()\n            if not line or line.startswith('#'):\n"
    "                continue\n            key, _, value = line.partition('=')\n"
    "            result[key.strip()] = value.strip()\n    return result\n\n\n"
    "def write_config(filename, data):\n    with open(filename, 'w') as f:\n"
    "        for key, value in data.items():\n            f.write(f'{key} = {value}\\n')\n",
    "D": "try:\n    import json\nexcept ImportError:\n    json = None\n\n\ndef dump(obj, stream=None, indent=4):\n"
    "    text = json.dumps(obj, indent=indent, sort_keys=True)\n    if stream is None:\n        return text\n"
    "    stream.write(text)\n    stream.flush()\n\n\ndef load(stream):\n    data = stream.read()\n"
    "    if not data:\n        raise EOFError('empty stream')\n    return json.loads(data)\n\n\n"
    "__all__ = ['dump', 'load']\n",
}


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[dict, float]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read())
    return data, time.perf_counter() - t0


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return parse_metrics(resp.read().decode())


def counters(url: str) -> dict[str, float]:
    m = metrics(url)
    return {
        "external_kv_transfer": metric_value(
            m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        ),
        "local_compute": metric_value(
            m, "vllm:prompt_tokens_by_source_total", source="local_compute"
        ),
        "local_cache_hit": metric_value(
            m, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"
        ),
        "nixl_xfer_count": metric_value(m, "vllm:nixl_xfer_time_seconds_count"),
        "external_prefix_cache_hits": metric_value(m, "vllm:external_prefix_cache_hits_total"),
    }


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def tokens(url: str, text: str, n: int) -> list[int]:
    data, _ = post(url + "/tokenize", {"model": SERVED_MODEL_NAME, "prompt": text})
    ids = data["tokens"]
    if len(ids) < n:
        raise SystemExit(f"text has only {len(ids)} tokens, need {n}")
    return ids[:n]


def body(prompt: list[int], max_tokens: int, **extra) -> dict:
    return {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        **extra,
    }


def p_leg(p_url: str, b: dict, connector: str) -> tuple[dict | None, float]:
    pb = dict(b, max_tokens=1, stream=False)
    if connector == "nixl":
        pb["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    data, dt = post(p_url + "/v1/completions", pb)
    return data.get("kv_transfer_params"), dt


def text_of(resp: dict) -> str:
    return resp["choices"][0]["text"]


def noise_store(store: Path, venv_python: str) -> int:
    code = (
        "import sys, torch, pathlib\nfrom safetensors.torch import load_file, save_file\nn=0\n"
        "for p in pathlib.Path(sys.argv[1]).rglob('*.safetensors'):\n"
        "    d = load_file(str(p)); torch.manual_seed(1)\n"
        "    save_file({k: torch.randn_like(v) * 3 for k, v in d.items()}, str(p)); n += 1\n"
        "print(n)\n"
    )
    out = subprocess.run(
        [venv_python, "-c", code, str(store)], check=True, capture_output=True, text=True
    )
    return int(out.stdout.strip().splitlines()[-1])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--connector", choices=("nixl", "example"), default="nixl")
    ap.add_argument("--prefill", default="http://127.0.0.1:8100")
    ap.add_argument("--decode", default="http://127.0.0.1:8200")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--baseline", type=Path, help="JSON from an earlier NIXL run (for --connector example)"
    )
    ap.add_argument(
        "--store", type=Path, help="ExampleConnector shared_storage_path (for the noise control)"
    )
    ap.add_argument("--venv-python", help="the vLLM venv's python (for the noise control)")
    ap.add_argument("--out", type=Path)
    return ap.parse_args()


class Verification:
    """One run against a P/D pair: the prompts, the result document and the checks so far."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.P, self.D, self.n = args.prefill, args.decode, args.prompt_tokens
        self.nixl = args.connector == "nixl"
        self.prompts = {k: tokens(self.D, v, self.n) for k, v in TEXTS.items()}
        self.res: dict[str, Any] = {
            "connector": args.connector,
            "prompt_tokens": self.n,
            "max_tokens": args.max_tokens,
            "baseline": {},
            "checks": {},
        }
        self.ok = True

    def check(self, name: str, cond: bool, **info: Any) -> None:
        self.ok &= bool(cond)
        self.res["checks"][name] = {"ok": bool(cond), **info}
        print(f"[verify] {'PASS' if cond else 'FAIL'} {name}: {json.dumps(info)}", flush=True)

    def body(self, key_or_prompt: str | list[int], **extra: Any) -> dict[str, Any]:
        prompt = self.prompts[key_or_prompt] if isinstance(key_or_prompt, str) else key_or_prompt
        return body(prompt, self.args.max_tokens, **extra)

    def decode(self, b: dict[str, Any]) -> tuple[dict[str, Any], float]:
        return post(self.D + "/v1/completions", b)

    def baseline_text(self, key: str) -> str:
        return str(self.res["baseline"][key]["text"])

    def warm_up(self) -> None:
        """The first request compiles/allocates: an unrelated salted prompt to each engine."""
        post(
            self.D + "/v1/completions", body(self.prompts["B"][:40], 2, cache_salt=uuid.uuid4().hex)
        )
        post(
            self.P + "/v1/completions", body(self.prompts["B"][:40], 2, cache_salt=uuid.uuid4().hex)
        )

    def baseline(self) -> None:
        if self.nixl:
            for k in ("A", "C", "D"):
                data, dt = self.decode(self.body(k, cache_salt=uuid.uuid4().hex))
                self.res["baseline"][k] = {"text": text_of(data), "latency_s": round(dt, 3)}
        else:
            if not self.args.baseline:
                raise SystemExit("--connector example needs --baseline (JSON of a NIXL run)")
            self.res["baseline"] = json.loads(self.args.baseline.read_text())["baseline"]
        print(f"[verify] baseline: {json.dumps(self.res['baseline'])}", flush=True)

    def disaggregated(self) -> None:
        """(a)/(b): prompt A through P then D; D's output and metrics."""
        before = counters(self.D)
        b = self.body("A")
        t0 = time.perf_counter()
        params, p_dt = p_leg(self.P, b, self.args.connector)
        d_resp, d_dt = self.decode(dict(b, kv_transfer_params=params) if self.nixl else b)
        total = time.perf_counter() - t0
        dd = delta(before, counters(self.D))
        self.res["disagg"] = {
            "kv_transfer_params": params,
            "text": text_of(d_resp),
            "p_latency_s": round(p_dt, 3),
            "d_latency_s": round(d_dt, 3),
            "total_s": round(total, 3),
            "decode_metric_deltas": dd,
        }
        print(f"[verify] P kv_transfer_params: {json.dumps(params)}", flush=True)
        self.check(
            "disagg_output_equals_baseline",
            text_of(d_resp) == self.baseline_text("A"),
            disagg=text_of(d_resp),
            baseline=self.baseline_text("A"),
        )
        self.check("external_kv_tokens_rose", dd["external_kv_transfer"] > 0, deltas=dd)
        if self.nixl:
            self.check("nixl_xfer_count_rose", dd["nixl_xfer_count"] >= 1, deltas=dd)
            self.check(
                "p_returned_kv_transfer_params", bool(params and params.get("remote_block_ids"))
            )
        else:
            self.check(
                "external_prefix_cache_hits_rose", dd["external_prefix_cache_hits"] > 0, deltas=dd
            )

    def negative_nixl(self) -> None:
        """(c) NIXL: D gets prompt C with the params of prompt D; its output must differ."""
        before = counters(self.D)
        other_params, _ = p_leg(self.P, self.body("D"), "nixl")
        wrong, _ = self.decode(self.body("C", kv_transfer_params=other_params))
        dd = delta(before, counters(self.D))
        self.res["negative"] = {"text": text_of(wrong), "decode_metric_deltas": dd}
        self.check(
            "negative_control_output_differs",
            text_of(wrong) != self.baseline_text("C"),
            wrong=text_of(wrong),
            baseline_C=self.baseline_text("C"),
            baseline_D=self.baseline_text("D"),
            deltas=dd,
        )

    def negative_example(self) -> None:
        """(c) Example: P stores C, noise overwrites the store, D loads noise; output must differ."""
        p_leg(self.P, self.body("C"), "example")
        nfiles = noise_store(self.args.store, self.args.venv_python)
        before = counters(self.D)
        noisy, _ = self.decode(self.body("C"))
        dd = delta(before, counters(self.D))
        self.res["negative"] = {
            "text": text_of(noisy),
            "files_noised": nfiles,
            "decode_metric_deltas": dd,
        }
        self.check(
            "negative_control_noise_changes_output",
            text_of(noisy) != self.baseline_text("C"),
            noisy=text_of(noisy),
            baseline_C=self.baseline_text("C"),
            files=nfiles,
            deltas=dd,
        )

    def latency_sample(self) -> None:
        """5 disaggregated requests with fresh prompts (rotated token lists)."""
        lat = []
        for i in range(5):
            pr = self.prompts["B"][i + 1 :] + self.prompts["B"][: i + 1]
            t0 = time.perf_counter()
            params, _ = p_leg(self.P, self.body(pr), self.args.connector)
            self.decode(
                dict(self.body(pr), **({"kv_transfer_params": params} if self.nixl else {}))
            )
            lat.append(round(time.perf_counter() - t0, 3))
        self.res["disagg_latencies_s"] = lat
        print(
            f"[verify] 1P1D end-to-end latency ({self.n} prompt + {self.args.max_tokens} output tokens): {lat}",
            flush=True,
        )


def main() -> int:
    args = parse_args()
    v = Verification(args)
    v.warm_up()
    v.baseline()
    v.disaggregated()
    if v.nixl:
        v.negative_nixl()
    elif args.store and args.venv_python:
        v.negative_example()
    v.latency_sample()
    v.res["ok"] = v.ok
    if args.out:
        args.out.write_text(json.dumps(v.res, indent=2))
    print(f"[verify] {'ALL PASS' if v.ok else 'SOME CHECKS FAILED'}")
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())
