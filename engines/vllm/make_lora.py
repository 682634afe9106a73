#!/usr/bin/env python3
"""A small LoRA adapter with random weights for a local Llama-shaped model, in PEFT's layout
(``adapter_config.json`` + ``adapter_model.safetensors``), as vLLM's ``--enable-lora`` and
``/v1/load_lora_adapter`` read it.

Standard library only (the safetensors file is written by hand: an 8-byte little-endian
header length, a JSON header, then the raw float32 tensors), so the proxy's test venv,
which has neither torch nor peft, can make one at test time. The weights are seeded, so
one seed always makes the same adapter; both matrices are random (PEFT initialises B to
zero, which would change nothing), scaled so that greedy decoding differs from the base.

    python3 make_lora.py MODEL_DIR OUT_DIR [--rank 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import array
import json
import random
import struct
import sys
from pathlib import Path

TARGETS = ("q_proj", "v_proj")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return {"q_proj": (heads * head_dim, hidden), "v_proj": (kv_heads * head_dim, hidden)}


def _random(n: int, std: float, rng: random.Random) -> bytes:
    values = array.array("f", (rng.gauss(0.0, std) for _ in range(n)))
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def write_random_lora(
    model_dir: Path | str, out_dir: Path | str, *, rank: int = 8, seed: int = 0
) -> Path:
    """Write the adapter into ``out_dir`` (created); returns it."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = _shapes(config)
    rng = random.Random(seed)
    header: dict[str, dict] = {}
    chunks: list[bytes] = []
    offset = 0
    for layer in range(int(config["num_hidden_layers"])):
        for target in TARGETS:
            out_features, in_features = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            for name, shape, std in (
                ("lora_A", (rank, in_features), in_features**-0.5),
                ("lora_B", (out_features, rank), 0.1),
            ):
                data = _random(shape[0] * shape[1], std, rng)
                header[f"{prefix}.{name}.weight"] = {
                    "dtype": "F32",
                    "shape": list(shape),
                    "data_offsets": [offset, offset + len(data)],
                }
                chunks.append(data)
                offset += len(data)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data to 8 bytes
    with (out / "adapter_model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for chunk in chunks:
            f.write(chunk)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_random_lora(args.model_dir, args.out_dir, rank=args.rank, seed=args.seed))


if __name__ == "__main__":
    main()
