#!/usr/bin/env python3
"""A Qwen3.5-shaped hybrid model of a few hundred million parameters, random
weights, for bench/hybrid.sh (issue 43): transformers writes it with
save_pretrained, as the fixtures in tests/fixtures/hf-families-2026 were
written, with their 512-token tokenizer (decode speed does not depend on
the vocabulary's words; the LM head is small, so the figure is the layers').

    python3 scripts/make-hybrid-bench.py OUT_DIR

Needs transformers >= 5.19 and torch (PyPI).
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

out = Path(sys.argv[1])
fixture = Path(__file__).resolve().parent.parent / "tests/fixtures/hf-families-2026/qwen3_5"
layers = 24
config = Qwen3_5TextConfig(
    vocab_size=512,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=layers,
    # Three Gated DeltaNet layers to one gated attention layer, as Qwen3.5.
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [6, 5, 5],
    },
)
torch.manual_seed(43)
model = Qwen3_5ForCausalLM(config).eval()
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(out)
for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
    shutil.copy(fixture / f, out / f)
print(json.dumps({"parameters": n, "out": str(out)}))
