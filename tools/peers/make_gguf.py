#!/usr/bin/env python3
"""Writes a Qwen3.6-35B-A3B-shaped GGUF (llama.cpp arch `qwen35moe`) with random weights, quantised
like a Q4_K_M, for llama-bench.

The metadata keys, tensor names, shapes and F32 tensors are those llama.cpp's own converter
(convert_hf_to_gguf.py, class Qwen3_5MoeTextModel) writes for a transformers checkpoint of the same
config without MTP layers; tools/peers/check_gguf.py compares the two on a tiny config. Quantised
types follow llama.cpp's Q4_K_M rules (src/llama-quant.cpp) in simplified form: Q6_K for output.weight
and for attn_v / ffn_down(_exps, _shexp) on the "use more bits" layers, Q4_K for the other matrices,
Q8_0 where a row is not a multiple of 256, F32 for norms, the router, the conv and the decay
parameters. Quantised blocks are random bytes with f16 scales chosen so weights are about
N(0, 0.02)-sized. The tokenizer metadata is the real Qwen3.6 vocabulary (a tokenizer.json, as
tools/make_tokenizer_json.py writes it; .gz accepted).

Speed: the header goes through gguf-py (from the llama.cpp source); the ~20 GB of tensor data is
written by a pool of processes with os.pwrite at the offsets gguf-py assigned.

Usage: python3 make_gguf.py --gguf-py LLAMA_SRC/gguf-py --tokenizer tokenizer.json.gz --out M.gguf [--config tiny]
"""
import argparse
import gzip
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_config  # noqa: E402

CHUNK_BYTES = 64 << 20

# Where the f16 scales sit in each block of the types we write (ggml-common.h), and values that give
# weights of roughly N(0, 0.02) size with random 4/6/8-bit codes and sub-block scales. Every other
# byte of a block is a random code.
SCALES = {
    # block_q4_K (144 B): d f16, dmin f16, scales[12], qs[128]; value = d * sc * q - dmin * m with
    # q in 0..15 and 6-bit sc, m: dmin = 7.5 d centres it.
    "Q4_K": (144, {0: 1.0e-4, 2: 7.5e-4}),
    # block_q6_K (210 B): ql[128], qh[64], int8 scales[16], d f16; value = d * scale * (q - 32).
    "Q6_K": (210, {208: 1.0e-5}),
    # block_q8_0 (34 B): d f16, int8 qs[32]; value = d * q.
    "Q8_0": (34, {0: 3.0e-4}),
}


def use_more_bits(i, n):
    """llama.cpp's rule for which layers Q4_K_M gives Q6_K (attn_v, ffn_down)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_specs(c):
    """(name, shape in ggml order [ne0, ne1, ...], kind) for every tensor, kind one of
    'quant' | 'more_bits' | 'output' | 'norm' | 'ssm_a' | 'dt_bias' | 'small' (F32 random)."""
    h, n_layer = c["hidden_size"], c["num_hidden_layers"]
    head_dim, n_head, n_kv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    n_exp, ff, ff_sh = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    key_dim, value_dim = dk * nk, dv * nv
    out = [("output.weight", [h, c["vocab_size"]], "output"),
           ("token_embd.weight", [h, c["vocab_size"]], "quant")]
    for i, kind in enumerate(c["layer_types"]):
        b = f"blk.{i}."
        more = "more_bits" if use_more_bits(i, n_layer) else "quant"
        out.append((b + "attn_norm.weight", [h], "norm"))
        if kind == "linear_attention":
            out += [(b + "ssm_a", [nv], "ssm_a"),
                    (b + "ssm_conv1d.weight", [c["linear_conv_kernel_dim"], 2 * key_dim + value_dim], "small"),
                    (b + "ssm_dt.bias", [nv], "dt_bias"),
                    (b + "ssm_alpha.weight", [h, nv], "quant"),
                    (b + "ssm_beta.weight", [h, nv], "quant"),
                    (b + "attn_qkv.weight", [h, 2 * key_dim + value_dim], "quant"),
                    (b + "attn_gate.weight", [h, value_dim], "quant"),
                    (b + "ssm_norm.weight", [dv], "norm"),
                    (b + "ssm_out.weight", [value_dim, h], "quant")]
        out += [(b + "ffn_down_exps.weight", [ff, h, n_exp], more),
                (b + "ffn_gate_exps.weight", [h, ff, n_exp], "quant"),
                (b + "ffn_up_exps.weight", [h, ff, n_exp], "quant"),
                (b + "ffn_gate_inp.weight", [h, n_exp], "small"),
                (b + "ffn_down_shexp.weight", [ff_sh, h], more),
                (b + "ffn_gate_shexp.weight", [h, ff_sh], "quant"),
                (b + "ffn_up_shexp.weight", [h, ff_sh], "quant"),
                (b + "ffn_gate_inp_shexp.weight", [h, 1], "small"),
                (b + "post_attention_norm.weight", [h], "norm")]
        if kind == "full_attention":
            out += [(b + "attn_k_norm.weight", [head_dim], "norm"),
                    (b + "attn_k.weight", [h, head_dim * n_kv], "quant"),
                    (b + "attn_output.weight", [head_dim * n_head, h], "quant"),
                    (b + "attn_q_norm.weight", [head_dim], "norm"),
                    (b + "attn_q.weight", [h, 2 * head_dim * n_head], "quant"),  # query and its output gate
                    (b + "attn_v.weight", [h, head_dim * n_kv], more)]
    out.append(("output_norm.weight", [h], "norm"))
    return out


def ggml_type(gguf, kind, ne0):
    q = gguf.GGMLQuantizationType
    if kind in ("quant", "more_bits", "output"):
        if ne0 % 256 == 0:
            return q.Q4_K if kind == "quant" else q.Q6_K
        if ne0 % 32 == 0:
            return q.Q8_0
        return q.F16
    return q.F32


def add_metadata(gguf, w, c, name):
    arch = "qwen35moe"
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    rope = c["rope_parameters"]
    w.add_rope_dimension_sections(list(rope["mrope_section"]) + [0] * (4 - len(rope["mrope_section"])))
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    w.add_recurrent_layers([t == "linear_attention" for t in c["layer_types"]])
    w.add_full_attention_interval(c["full_attention_interval"])
    w.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    assert w.arch == arch


def add_tokenizer(gguf, w, path, vocab_size, eos_id):
    """The GPT-2-style BPE metadata llama.cpp's converter writes for Qwen3.5/3.6: byte-level token
    strings by id, their types (normal; control for special added tokens and <|...|>; user-defined
    for the other added ones; unused for the padding up to the embedding's row count) and the merges."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        tok = json.load(f)
    T = gguf.TokenType
    tokens = [None] * vocab_size
    types = [T.UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, T.NORMAL
    for a in tok["added_tokens"]:
        text = a["content"]
        # As the converter: <|...|> tokens are control tokens even when not marked special.
        control = a["special"] or (text.startswith("<|") and text.endswith("|>"))
        tokens[a["id"]], types[a["id"]] = text, T.CONTROL if control else T.USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for setter in (w.add_eos_token_id, w.add_unk_token_id, w.add_pad_token_id, w.add_bos_token_id):
        setter(eos_id)


def f32_values(kind, n, rng):
    if kind == "norm":
        return 1.0 + rng.normal(0.0, 0.02, n)
    if kind == "ssm_a":
        return -np.exp(rng.uniform(0.0, 2.7, n))  # -A, A in [1, 16)
    if kind == "dt_bias":
        return rng.uniform(-4.0, 0.0, n)
    return rng.normal(0.0, 0.02, n)


def fill(job):
    """Writes one chunk of one tensor at its file offset."""
    path, offset, nbytes, type_name, kind, seed = job
    rng = np.random.default_rng(seed)
    if type_name == "F32":
        data = f32_values(kind, nbytes // 4, rng).astype("<f4").view(np.uint8)
    elif type_name == "F16":
        data = rng.normal(0.0, 0.02, nbytes // 2).astype("<f2").view(np.uint8)
    else:
        block_bytes, scales = SCALES[type_name]
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        blocks = data.reshape(-1, block_bytes)
        for at, value in scales.items():
            d = (value * rng.uniform(0.5, 1.5, len(blocks))).astype("<f2")
            blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    fd = os.open(path, os.O_WRONLY)
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)
    return nbytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf-py", required=True, type=Path, help="llama.cpp's gguf-py directory")
    parser.add_argument("--tokenizer", required=True, type=Path, help="tokenizer.json (or .json.gz) of Qwen3.6")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--config", default="full", choices=list(model_config.CONFIGS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--layout-only", action="store_true",
                        help="leave the tensor data a sparse run of zeros (takes no disk): to check that llama.cpp loads the layout")
    args = parser.parse_args()
    sys.path.insert(0, str(args.gguf_py))
    import gguf

    t0 = time.monotonic()
    # The vocabulary is the real one at every size: the embedding has its padded row count.
    c = model_config.get(args.config, vocab_size=model_config.FULL["vocab_size"])
    eos_id = model_config.FULL["eos_token_id"]
    w = gguf.GGUFWriter(str(args.out), "qwen35moe")
    add_metadata(gguf, w, c, f"lily peers synthetic qwen3.6-35b-a3b ({args.config})")
    add_tokenizer(gguf, w, args.tokenizer, c["vocab_size"], eos_id)

    layout = []  # (name, ggml type, kind, nbytes)
    for name, shape, kind in tensor_specs(c):
        qtype = ggml_type(gguf, kind, shape[0])
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape))
        if n % block:
            raise SystemExit(f"{name}: {n} values is not a whole number of {qtype.name} blocks")
        nbytes = n // block * type_size
        # gguf-py takes numpy-order shapes (the reverse of ggml's ne order).
        w.add_tensor_info(name, list(reversed(shape)), np.dtype(np.float32), nbytes, raw_dtype=qtype)
        layout.append((name, qtype, kind, nbytes))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    data_start = fout.tell()
    fout.close()

    total = sum(gguf.GGUFWriter.ggml_pad(nb, w.data_alignment) for _, _, _, nb in layout)
    with open(args.out, "r+b") as f:
        f.truncate(data_start + total)
    seed = int.from_bytes(os.urandom(8), "little")
    jobs, offset = [], data_start
    for name, qtype, kind, nbytes in layout:
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        step = max(block_bytes, CHUNK_BYTES // block_bytes * block_bytes)
        for start in range(0, nbytes, step):
            jobs.append((str(args.out), offset + start, min(step, nbytes - start), qtype.name, kind, seed + len(jobs)))
        offset += gguf.GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    if args.layout_only:
        jobs = []
    with ProcessPoolExecutor(args.jobs) as pool:
        written = sum(pool.map(fill, jobs, chunksize=4))
    counts = {}
    for _, qtype, _, nbytes in layout:
        counts[qtype.name] = counts.get(qtype.name, 0) + nbytes
    print(f"wrote {args.out}: {len(layout)} tensors, {written / 1e9:.2f} GB of tensor data "
          f"({', '.join(f'{k} {v / 1e9:.2f} GB' for k, v in sorted(counts.items()))}) in {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    main()
