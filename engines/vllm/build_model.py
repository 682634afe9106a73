#!/usr/bin/env python3
"""Build a tiny random Llama model with a byte-level BPE tokenizer, locally (no model hub).

Runs in the vLLM venv (needs torch, transformers, tokenizers). Deterministic: files are read in sorted
order, BPE training is deterministic for a fixed corpus, and weights come from a fixed torch seed.
Idempotent: if OUT/.pdproxy-model.stamp matches the requested parameters, nothing is rebuilt.

    python build_model.py --out DIR [--vocab-size 2048] [--seed 0] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def log(msg: str) -> None:
    print(f"[engines-model] {msg}", file=sys.stderr, flush=True)


def corpus_files(max_bytes: int) -> list[str]:
    """Python standard-library sources in sorted order, up to max_bytes in total."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    total = 0
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if rel and rel[0] in ("site-packages", "test", "idlelib", "lib2to3"):
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if total + size > max_bytes:
            break
        files.append(str(path))
        total += size
    return files


# head_dim values that vLLM's CPU attention backend supports.
SUPPORTED_HEAD_DIMS = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--max-position-embeddings", type=int, default=1024)
    ap.add_argument("--initializer-range", type=float, default=0.2)
    ap.add_argument("--corpus-bytes", type=int, default=4_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    return ap.parse_args()


def train_tokenizer(args: argparse.Namespace, files: list[str], digest: str, out: Path):
    """Byte-level BPE on the corpus, with the ChatML template; saved to out; returns the tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    log(
        f"training byte-level BPE (vocab {args.vocab_size}) on {len(files)} stdlib files "
        f"({sum(os.path.getsize(f) for f in files) / 1e6:.1f} MB, sha256 {digest[:12]})"
    )
    bpe = ByteLevelBPETokenizer()
    bpe.train(
        files=files,
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        model_max_length=args.max_position_embeddings,
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.save_pretrained(out)
    return tok


def build_weights(args: argparse.Namespace, tok, head_dim: int, out: Path):
    """A random-weight Llama (fixed torch seed) sized for tok; saved to out; returns the model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    log(
        f"building random Llama: hidden {args.hidden_size}, {args.layers} layers, {args.heads} heads / "
        f"{args.kv_heads} KV heads (head_dim {head_dim}), vocab {len(tok)}, seed {args.seed}"
    )
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=head_dim,
        max_position_embeddings=args.max_position_embeddings,
        initializer_range=args.initializer_range,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    return model


def self_check(tok) -> None:
    """The tokenizer round-trips and the chat template renders."""
    text = "def hello(world):\n    return world"
    assert tok.decode(tok(text)["input_ids"]) == text, "tokenizer does not round-trip"
    tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )


def build(args: argparse.Namespace, params: dict, head_dim: int, tmp: Path) -> None:
    """Tokenizer, weights and pdproxy-model.json into tmp."""
    files = corpus_files(args.corpus_bytes)
    digest = hashlib.sha256()
    for f in files:
        digest.update(Path(f).read_bytes())
    tok = train_tokenizer(args, files, digest.hexdigest(), tmp)
    model = build_weights(args, tok, head_dim, tmp)
    (tmp / "pdproxy-model.json").write_text(
        json.dumps(
            {
                **params,
                "corpus_files": len(files),
                "corpus_sha256": digest.hexdigest(),
                "parameters": sum(p.numel() for p in model.parameters()),
            },
            indent=2,
            sort_keys=True,
        )
    )
    self_check(tok)


def main() -> int:
    args = parse_args()
    head_dim = args.hidden_size // args.heads
    if head_dim not in SUPPORTED_HEAD_DIMS:
        log(
            f"ERROR: head_dim {head_dim} is not supported by vLLM's CPU attention backend {sorted(SUPPORTED_HEAD_DIMS)}"
        )
        return 2

    params = {k: v for k, v in vars(args).items() if k not in ("out", "force")}
    params["format"] = 1
    stamp = args.out / ".pdproxy-model.stamp"
    want = json.dumps(params, sort_keys=True)
    if not args.force and stamp.is_file() and stamp.read_text() == want:
        log(f"reusing {args.out}")
        return 0

    t0 = time.time()
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(args, params, head_dim, tmp)
    (tmp / stamp.name).write_text(want)
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    log(f"model ready in {time.time() - t0:.1f} s: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
