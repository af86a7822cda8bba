# Makes tests/fixtures/gemma3-variants/: two variants of the transformers-written Gemma 3 fixture
# (tests/fixtures/hf-families-2026/gemma3), each with transformers' own float32 outputs in reference.json (same fields as
# the hf-families fixtures), so that Pagoda's Gemma 3 is checked against transformers on config values and forms the
# shared fixture does not cover:
#
#   v4-softcap  the same weights minus lm_head (tied embeddings), and a config in transformers 4's form (rope_theta,
#               rope_scaling, rope_local_base_freq, sliding_window_pattern instead of layer_types) with other values:
#               an 8-token window on every other layer, other RoPE bases and linear factor, query_pre_attn_scalar 24,
#               final_logit_softcapping 3.0.
#   bf16        the same checkpoint stored in bfloat16; the reference is transformers' float32 forward over those
#               bfloat16 weights (upcast exactly), so a float32 serve of it must agree as closely as the f32 fixture.
#
# Needs torch, transformers (5.x) and safetensors. Run from the repository root:
#   python scripts/make-gemma3-fixture.py
import json, os, shutil, sys

import torch
import transformers as T
from safetensors.torch import load_file, save_file

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
src = os.path.join(root, "tests/fixtures/hf-families-2026/gemma3")
out = os.path.join(root, "tests/fixtures/gemma3-variants")
prompts = [c["prompt_ids"] for c in json.load(open(os.path.join(src, "reference.json")))["cases"]]
base_config = json.load(open(os.path.join(src, "config.json")))
weights = load_file(os.path.join(src, "model.safetensors"))


def write_reference(d, name, expect):
    m = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    c = m.config
    # What transformers made of the config: the values the variant is meant to exercise.
    for k, v in expect.items():
        got = getattr(c, k)
        assert got == v, f"{name}: transformers read {k} = {got!r}, meant {v!r}"
    ref = {"family": name, "architecture": "Gemma3ForCausalLM", "transformers": T.__version__,
           "torch": torch.__version__, "cases": []}
    for t in prompts:
        ids = torch.tensor([t])
        with torch.no_grad():
            lp = torch.log_softmax(m(ids).logits[0].double(), -1)
            g = m.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, pad_token_id=0)
        gaps = [round((lambda v: (v[0] - v[1]).item())(torch.topk(torch.log_softmax(s[0].double(), -1), 2).values), 5)
                for s in g.scores]
        top5 = torch.topk(lp, 5, dim=-1)
        ref["cases"].append({
            "prompt_ids": t,
            "prompt_logprobs": [None] + [round(lp[j - 1, t[j]].item(), 7) for j in range(1, len(t))],
            "top5_ids": top5.indices.tolist(),
            "top5_logprobs": [[round(x, 7) for x in r] for r in top5.values.tolist()],
            "greedy_ids": g.sequences[0, len(t):].tolist(),
            "greedy_top2_gap": gaps,
        })
    json.dump(ref, open(os.path.join(d, "reference.json"), "w"))
    print(name, "min greedy gap", min(min(cs["greedy_top2_gap"]) for cs in ref["cases"]))


def folder(name, config, tensors):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, f), d)
    json.dump(config, open(os.path.join(d, "config.json"), "w"), indent=2)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d


# v4-softcap: transformers 4's config form, other values, tied embeddings.
v4 = {k: v for k, v in base_config.items()
      if k not in ("rope_parameters", "layer_types", "_sliding_window_pattern", "transformers_version", "dtype")}
v4.update({
    "torch_dtype": "float32",
    "rope_theta": 50000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "rope_local_base_freq": 2500.0,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 3.0,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
})
tied = {k: v for k, v in weights.items() if k != "lm_head.weight"}
d = folder("v4-softcap", v4, tied)
write_reference(d, "gemma3 v4-softcap", {
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 8,
    "query_pre_attn_scalar": 24,
    "final_logit_softcapping": 3.0,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 2500.0},
    },
})

# bf16: the shared fixture's checkpoint stored in bfloat16.
bf16 = dict(base_config, dtype="bfloat16")
d = folder("bf16", bf16, {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()})
write_reference(d, "gemma3 bf16", {"sliding_window": 16, "query_pre_attn_scalar": 16})
print("transformers", T.__version__, "torch", torch.__version__)
