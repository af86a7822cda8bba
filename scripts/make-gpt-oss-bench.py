#!/usr/bin/env python3
"""A gpt-oss-shaped MoE of a few hundred million parameters, random weights,
for bench/gpt-oss.sh (issue 44): transformers writes it with save_pretrained,
as the fixtures in tests/fixtures/hf-families-2026 were written, with their
512-token tokenizer (decode speed does not depend on the vocabulary's words;
the LM head is small, so the figure is the layers').

The shape follows gpt-oss-20b scaled down: alternating sliding (128) and
full attention layers with sinks and biases, 64-wide heads (12 query heads
over 4 key/value heads), experts as wide as the hidden size, 4 of 16
active per token, YaRN.

    python3 scripts/make-gpt-oss-bench.py OUT_DIR

Needs transformers >= 5.19 and torch (PyPI).
"""
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import GptOssConfig, GptOssForCausalLM

out = Path(sys.argv[1])
fixture = Path(__file__).resolve().parent.parent / "tests/fixtures/hf-families-2026/gpt_oss"
layers = 12
config = GptOssConfig(
    vocab_size=512,
    hidden_size=768,
    intermediate_size=768,
    num_hidden_layers=layers,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    num_local_experts=16,
    num_experts_per_tok=4,
    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    sliding_window=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    attention_bias=True,
    tie_word_embeddings=False,
    eos_token_id=2,
    pad_token_id=0,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 1024,
        "truncate": False,
    },
)
torch.manual_seed(44)
model = GptOssForCausalLM(config).eval()
# transformers initializes the experts' biases and the sinks to zeros and
# the router's bias too; random ones make the routing and the sinks real.
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("bias") or name.endswith("sinks"):
            p.normal_(0.0, 0.02)
n = sum(p.numel() for p in model.parameters())
model.save_pretrained(out)
for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
    shutil.copy(fixture / f, out / f)
print(json.dumps({"parameters": n, "out": str(out)}))
