#!/usr/bin/env python3
"""Writes random LoRA adapters in PEFT's on-disk form (adapter_config.json
as PEFT 0.21 writes it, adapter_model.safetensors with PEFT's tensor names)
for a base model's shapes, for benchmarks: nothing here is trained.

    python3 scripts/make-lora.py OUT_DIR COUNT --rank 16 [--layers 30 --hidden 576
        --heads 9 --kv-heads 3 --head-dim 64 --ffn 1536]

The defaults are SmolLM2-135M's (the demo model). Each adapter adapts all
seven projections of every layer; B is small and nonzero, so outputs move.
"""
import argparse
import json
import os
import struct

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("count", type=int)
p.add_argument("--rank", type=int, default=16)
p.add_argument("--alpha", type=float, default=32)
p.add_argument("--layers", type=int, default=30)
p.add_argument("--hidden", type=int, default=576)
p.add_argument("--heads", type=int, default=9)
p.add_argument("--kv-heads", type=int, default=3)
p.add_argument("--head-dim", type=int, default=64)
p.add_argument("--ffn", type=int, default=1536)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()

q, kv, d, f = a.heads * a.head_dim, a.kv_heads * a.head_dim, a.hidden, a.ffn
# (block, module, in, out)
MODULES = [
    ("self_attn", "q_proj", d, q),
    ("self_attn", "k_proj", d, kv),
    ("self_attn", "v_proj", d, kv),
    ("self_attn", "o_proj", q, d),
    ("mlp", "gate_proj", d, f),
    ("mlp", "up_proj", d, f),
    ("mlp", "down_proj", f, d),
]


def write_safetensors(path, tensors):
    """The safetensors format: an 8-byte header length, a JSON header, the data."""
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(h)))
        out.write(h)
        for b in blobs:
            out.write(b)


rng = np.random.default_rng(a.seed)
for n in range(a.count):
    folder = os.path.join(a.out, f"lora{n}")
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for layer in range(a.layers):
        for block, module, fan_in, fan_out in MODULES:
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 1 / np.sqrt(fan_in), (a.rank, fan_in))
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.01, (fan_out, a.rank))
    write_safetensors(os.path.join(folder, "adapter_model.safetensors"), tensors)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": a.rank, "lora_alpha": a.alpha,
        "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "target_modules": [m for _, m, _, _ in MODULES], "inference_mode": True,
    }
    with open(os.path.join(folder, "adapter_config.json"), "w") as out:
        json.dump(config, out, indent=2)
    print(folder)
