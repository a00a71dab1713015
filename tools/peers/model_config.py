"""The model shapes the peers run: the full Qwen3.6-35B-A3B text model (the same values as lily's
`synth --config qwen3.6-35b-a3b` preset in src/checkpoint/synth.rs) and a tiny one of the same
architecture for checking the scripts on a CPU. Keys are Hugging Face `text_config` keys."""

FULL = {
    "model_type": "qwen3_5_moe_text", "hidden_act": "silu", "attention_bias": False, "attn_output_gate": True,
    "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4, "vocab_size": 248320,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 248044, "eos_token_id": 248044,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
}

# Every width a multiple of 256 (a K-quant block) so the tiny GGUF quantises like the full one, except
# the attention output (2 heads x 64) which, as in a real Q4_K_M, falls back to a 32-wide format.
TINY = dict(FULL, **{
    "hidden_size": 256, "num_hidden_layers": 4, "vocab_size": 1024,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "max_position_embeddings": 32768, "bos_token_id": 0, "eos_token_id": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [4, 2, 2]},
})

CONFIGS = {"full": FULL, "tiny": TINY}


def layer_types(c):
    """Layer i is full attention when (i + 1) % full_attention_interval == 0."""
    n = c["full_attention_interval"]
    return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(c["num_hidden_layers"])]


def get(name, vocab_size=None):
    if name not in CONFIGS:
        raise SystemExit(f"unknown config '{name}': expected one of {', '.join(CONFIGS)}")
    c = dict(CONFIGS[name])
    if vocab_size is not None:
        c["vocab_size"] = vocab_size
    c["layer_types"] = layer_types(c)
    return c
