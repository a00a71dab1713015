#!/usr/bin/env python3
"""Reference fixtures for lily's MTP head (src/model/cpu/mtp.rs), from transformers' own layers.

transformers has no MTP code (it ignores `mtp.*` on load), so the head is composed here from
its public pieces, as vLLM's `qwen3_5_mtp.py` composes it (MODEL.md §4.1):
    u  = fc(concat(RMSNorm_e(embed(x_{t+1})), RMSNorm_h(h_t)))      embedding first
    u  = one full-attention decoder layer with the full MoE, at position t, causal
    h' = RMSNorm(u, mtp.norm);  logits = lm_head(h')
The decoder layer, its norm and the LM head are a one-layer `Qwen3_5MoeForCausalLM` (layer type
full_attention) fed `inputs_embeds = u`: its forward is exactly "layer, final norm, lm_head".
h_t is the model's final-normed hidden state (`last_hidden_state`).

Pinned as tools/make_fixtures.py (torch 2.11, transformers 5.17: the GPU machine has both; it
runs on the CPU there, in float32). Run after make_fixtures.py, from the repository root:
    python3 tools/make_mtp_fixtures.py --models tests/fixtures/models
It reads tiny-a and writes tiny-a-mtp: config.json (mtp_num_hidden_layers 1), model.safetensors
(tiny-a's tensors plus random `mtp.*` ones in the release's naming) and reference.safetensors
with, per prompt p:
    p{p}.ids        I32 [T]     the prompt
    p{p}.next       I32 [T]     the token after each prompt token (the prompt shifted, then the
                                model's greedy token after it)
    p{p}.hidden     F32 [T, H]  the model's final-normed hidden states of the prompt
    p{p}.mtp_hidden F32 [T, H]  the head's normed outputs over (hidden, next), positions 0..T-1
    p{p}.mtp_logits F32 [T, V]  its logits (row t predicts the token at t + 2)
    p{p}.draft2     F32 [V]     logits of a second draft step: the last row's h' with its argmax
                                as the token, at position T
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_fixtures import check_versions, randomize  # noqa: E402

PROMPT_LENGTHS = [1, 7, 40]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True, help="the fixtures folder holding tiny-a")
    ap.add_argument("--seed", type=int, default=4321)
    args = ap.parse_args()
    check_versions()
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    src = os.path.join(args.models, "tiny-a")
    with open(os.path.join(src, "config.json")) as f:
        config_json = json.load(f)
    text = dict(config_json["text_config"])
    cfg = Qwen3_5MoeTextConfig(**text)
    cfg._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(cfg).to(torch.float32).eval()
    official = load_file(os.path.join(src, "model.safetensors"))
    # The release's names back to the causal LM's.
    sd = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
          for k, v in official.items()}
    model.load_state_dict(sd, strict=True)

    # The head's layer, final norm and the shared LM head: a one-layer causal LM.
    head_cfg = Qwen3_5MoeTextConfig(**dict(text, num_hidden_layers=1, layer_types=["full_attention"]))
    head_cfg._attn_implementation = "eager"
    head = Qwen3_5MoeForCausalLM(head_cfg).to(torch.float32).eval()
    h = cfg.hidden_size
    norm_cls = type(model.model.norm)
    extra = torch.nn.ModuleDict({
        "pre_fc_norm_embedding": norm_cls(h, eps=cfg.rms_norm_eps),
        "pre_fc_norm_hidden": norm_cls(h, eps=cfg.rms_norm_eps),
        "fc": torch.nn.Linear(2 * h, h, bias=False),
    }).eval()
    gen = torch.Generator().manual_seed(args.seed)
    randomize(head, gen)
    randomize(extra, gen)
    with torch.no_grad():
        head.lm_head.weight.copy_(model.lm_head.weight)
        head.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)

    def run_head(hidden, nxt):
        """The head over rows (hidden [T, H], next [T]) at positions 0..T-1: (h', logits)."""
        e = extra["pre_fc_norm_embedding"](model.model.embed_tokens(nxt))
        u = extra["fc"](torch.cat([e, extra["pre_fc_norm_hidden"](hidden)], dim=-1))
        out = head.model(inputs_embeds=u[None], use_cache=False)
        normed = out.last_hidden_state[0]
        return normed, head.lm_head(normed)

    mtp = {}
    for k, v in head.state_dict().items():
        if k.startswith("model.layers.0."):
            mtp["mtp.layers.0." + k[len("model.layers.0."):]] = v
    mtp["mtp.norm.weight"] = head.model.norm.weight
    mtp["mtp.fc.weight"] = extra["fc"].weight
    mtp["mtp.pre_fc_norm_embedding.weight"] = extra["pre_fc_norm_embedding"].weight
    mtp["mtp.pre_fc_norm_hidden.weight"] = extra["pre_fc_norm_hidden"].weight
    assert "mtp.layers.0.self_attn.q_proj.weight" in mtp and "mtp.layers.0.mlp.experts.gate_up_proj" in mtp, sorted(mtp)

    out_dir = os.path.join(args.models, "tiny-a-mtp")
    os.makedirs(out_dir, exist_ok=True)
    config_json["text_config"]["mtp_num_hidden_layers"] = 1
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    tensors = dict(official)
    tensors.update({k: v.detach().contiguous() for k, v in mtp.items()})
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    ref = {}
    pgen = torch.Generator().manual_seed(args.seed + 1)
    for pi, n in enumerate(PROMPT_LENGTHS):
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=pgen)
        with torch.no_grad():
            out = model.model(input_ids=ids, use_cache=False)
            hidden = out.last_hidden_state[0]
            first = model.lm_head(hidden[-1]).argmax()
            nxt = torch.cat([ids[0, 1:], first[None]])
            normed, logits = run_head(hidden, nxt)
            # A second draft step: the last row's h' and its draft, one position on (the whole
            # causal pass again with one more row equals running the row against the cache).
            draft = logits[-1].argmax()
            e = extra["pre_fc_norm_embedding"](model.model.embed_tokens(torch.cat([nxt, draft[None]])))
            hh = extra["pre_fc_norm_hidden"](torch.cat([hidden, normed[-1:]]))
            u = extra["fc"](torch.cat([e, hh], dim=-1))
            step2 = head.lm_head(head.model(inputs_embeds=u[None], use_cache=False).last_hidden_state[0, -1])
        ref[f"p{pi}.ids"] = ids[0].to(torch.int32).contiguous()
        ref[f"p{pi}.next"] = nxt.to(torch.int32).contiguous()
        ref[f"p{pi}.hidden"] = hidden.float().contiguous()
        ref[f"p{pi}.mtp_hidden"] = normed.float().contiguous()
        ref[f"p{pi}.mtp_logits"] = logits.float().contiguous()
        ref[f"p{pi}.draft2"] = step2.float().contiguous()
    save_file(ref, os.path.join(out_dir, "reference.safetensors"))
    print("tiny-a-mtp: ok", flush=True)


if __name__ == "__main__":
    main()
