#!/usr/bin/env python3
"""Reference fixtures for lily's CPU forward pass, produced by Hugging Face transformers' own
`qwen3_5_moe` implementation on small random-weight models that keep the real structure.

Pinned: torch 2.11.0, transformers 5.17.0 (what the GPU machine carries; the script refuses others).
Run (the GPU machine has both; it runs on the CPU there, in float32):
    python3 tools/make_fixtures.py --out tests/fixtures/models
Each model directory gets config.json, model.safetensors (weights in the official layout) and
reference.safetensors with, per prompt p:
    p{p}.ids       I32 [T]       prompt token ids
    p{p}.logits    F32 [T, V]    logits at every prompt position (one full-prompt forward)
    p{p}.greedy    I32 [32]      32-token greedy continuation (model.generate, KV/recurrent cache)
and for the bf16 model also p{p}.logits_f32 (the same bf16 weights computed in float32), which
measures how far bf16 arithmetic itself moves the logits.
"""
import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

PINNED = {"torch": "2.11", "transformers": "5.17"}
GREEDY_TOKENS = 32

# Small models that keep the real structure: full attention every 4th layer (or an explicit
# layer_types list), GQA, key heads != value heads, partial rotary 0.25, a shared expert, top-k <
# experts. Shapes differ between models so that transposed or swapped axes cannot cancel out.
MODELS = {
    # Official multimodal layout: config nests text_config; tensors under model.language_model.
    "tiny-a": dict(
        layout="official",
        dtype="float32",
        text=dict(
            hidden_size=32, num_hidden_layers=8, vocab_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=3,
            moe_intermediate_size=16, shared_expert_intermediate_size=24,
            full_attention_interval=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_interleaved": True, "mrope_section": [2, 1, 1]},
        ),
    ),
    # Text-only layout (model.layers.*), explicit layer_types, dk != dv, 3 value heads per key head.
    "tiny-b": dict(
        layout="text",
        dtype="float32",
        text=dict(
            hidden_size=48, num_hidden_layers=5, vocab_size=320,
            num_attention_heads=6, num_key_value_heads=3, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
            linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=20, shared_expert_intermediate_size=12,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25,
                             "mrope_interleaved": True, "mrope_section": [1, 1, 0]},
        ),
    ),
    # The tiny-a shape in bf16 (weights stored and computed in bf16, as the real release).
    "tiny-a-bf16": dict(layout="official", dtype="bfloat16", text=None),
    # Every matrix width a multiple of 64 (the quantisation group and the GPU kernels' tiles):
    # the fixture for CUDA-vs-CPU and 4-bit checks. bf16 weights keep it small.
    "tiny-c": dict(
        layout="official",
        dtype="bfloat16",
        text=dict(
            hidden_size=128, num_hidden_layers=4, vocab_size=512,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=64, shared_expert_intermediate_size=64,
            full_attention_interval=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_interleaved": True, "mrope_section": [3, 3, 2]},
        ),
    ),
}
MODELS["tiny-a-bf16"]["text"] = MODELS["tiny-a"]["text"]

PROMPT_LENGTHS = [1, 7, 40, 150]  # 150 > the GDN chunk size 64: exercises several chunks


def check_versions():
    for name, want in PINNED.items():
        have = sys.modules[name].__version__
        if not have.startswith(want):
            sys.exit(f"{name} {have} found, {want}.x pinned: fixtures must come from the pinned versions")


def randomize(model, gen):
    """Transformers-like init with every parameter non-trivial: linear weights ~ N(0, 1/in), the
    embedding ~ N(0, 1), zero-centred norm weights, A_log, dt_bias and conv weights all random."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("A_log"):
                v = torch.log(torch.empty(shape).uniform_(0.5, 8.0, generator=gen))
            elif name.endswith("dt_bias"):
                v = torch.randn(shape, generator=gen) * 0.5
            elif name.endswith("linear_attn.norm.weight"):
                v = 1.0 + torch.randn(shape, generator=gen) * 0.2  # plain weight, not 1+w
            elif "norm" in name:
                v = torch.randn(shape, generator=gen) * 0.2  # zero-centred: effective 1+w
            elif name.endswith("conv1d.weight"):
                v = torch.randn(shape, generator=gen) * 0.5
            elif "embed_tokens" in name:
                v = torch.randn(shape, generator=gen)
            else:
                v = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))


def official_name(name):
    # Qwen3_5MoeForCausalLM names its text model `model.`; the release nests it under
    # `model.language_model.` (lm_head stays top level).
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    check_versions()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    summary = {"torch": torch.__version__, "transformers": transformers.__version__, "models": {}}
    for mi, (name, spec) in enumerate(MODELS.items()):
        if args.only and name not in args.only:
            continue
        gen = torch.Generator().manual_seed(args.seed + {"tiny-a": 0, "tiny-a-bf16": 0, "tiny-b": 17}.get(name, 29))
        text = dict(spec["text"], eos_token_id=0, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                    max_position_embeddings=4096, rms_norm_eps=1e-6)
        cfg = Qwen3_5MoeTextConfig(**text)
        cfg._attn_implementation = "eager"
        dtype = getattr(torch, spec["dtype"])
        model = Qwen3_5MoeForCausalLM(cfg).to(torch.float32).eval()
        randomize(model, gen)
        model = model.to(dtype)

        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        want = f"model.layers.0.mlp.experts.gate_up_proj"
        assert want in sd, f"unexpected state_dict naming: {sorted(sd)[:20]}"
        assert list(sd[want].shape) == [text["num_experts"], 2 * text["moe_intermediate_size"], text["hidden_size"]]
        if spec["layout"] == "official":
            sd = {official_name(k): v for k, v in sd.items()}
            config_json = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                           "tie_word_embeddings": False, "text_config": dict(cfg.to_dict(), model_type="qwen3_5_moe_text")}
        else:
            config_json = dict(cfg.to_dict(), architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config_json, f, indent=2, default=str)
        save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})

        ref = {}
        pgen = torch.Generator().manual_seed(args.seed + 100 + mi)
        for pi, n in enumerate(PROMPT_LENGTHS):
            ids = torch.randint(0, text["vocab_size"], (1, n), generator=pgen)
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits[0]
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                                     min_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            ref[f"p{pi}.ids"] = ids[0].to(torch.int32)
            ref[f"p{pi}.logits"] = logits.float().contiguous()
            ref[f"p{pi}.greedy"] = out[0, n:].to(torch.int32).contiguous()
            if dtype != torch.float32:
                m32 = model.to(torch.float32)
                with torch.no_grad():
                    ref[f"p{pi}.logits_f32"] = m32(input_ids=ids, use_cache=False).logits[0].float().contiguous()
                model = m32.to(dtype)
        save_file(ref, os.path.join(d, "reference.safetensors"))
        summary["models"][name] = {"layout": spec["layout"], "dtype": spec["dtype"], "prompt_lengths": PROMPT_LENGTHS,
                                   "greedy_tokens": GREEDY_TOKENS}
        print(f"{name}: ok", flush=True)
    with open(os.path.join(args.out, "SOURCE.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
