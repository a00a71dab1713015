#!/usr/bin/env python3
"""lily's GGUF support checked against gguf-py, llama.cpp's own Python package (pinned in
tools/requirements-gguf.txt).

(a) Writes a GGUF file of random blocks of every type lily reads (Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16,
    F32; fresh random data each run) with gguf-py's writer, dequantises it with gguf-py
    (`gguf.quants.dequantize`) and with lily (examples/gguf_dequant.rs), and compares every value
    bit for bit.
(b) With --write-fixtures, rewrites tests/fixtures/gguf/: fixture models converted the way llama.cpp's
    convert_hf_to_gguf.py converts Qwen3.5/3.6 MoE (arch `qwen35moe`: tensor names, `+1` norms,
    `ssm_a = −exp(A_log)`, value heads in tiled order, conv kernels squeezed, experts split), written
    with gguf-py's writer:
    - tiny-a-bf16.gguf: the transformers fixture tiny-a-bf16, every matrix BF16 as in the source;
    - tiny-a-mtp.gguf: the fixture tiny-a-mtp (tiny-a with an MTP head), F32, the head as blk.N;
    - tiny-k.gguf: `lily synth --config tests/fixtures/gguf/tiny-k.json --seed 7 --dtype f32`
      quantised to a llama-quantize-like mix of Q4_K, Q5_K, Q6_K, Q8_0, F16 and F32 (hidden 256 so
      that the K-quants apply). gguf-py has no K-quant quantisers; the simple ones here (per
      sub-block min/max, scales rounded to 6 bits) make valid blocks, which is all the fixture needs.
      It also carries a vocabulary (Qwen3.6's added tokens over the 256 byte tokens) and a chat template.
    tests/gguf.rs loads them and compares with the safetensors models.

Run from the repository root (what scripts/test.sh does):
    python3 -m venv target/gguf-venv && target/gguf-venv/bin/pip install -r tools/requirements-gguf.txt
    target/gguf-venv/bin/python tools/check_gguf.py [--write-fixtures]
"""
import argparse
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

PINNED = "0.19.0"
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
OUT = FIXTURES / "gguf"
ARCH = "qwen35moe"
QK_K = 256


# --- safetensors ----------------------------------------------------------------------------------

def read_safetensors(path):
    """{name: float32 array} of one safetensors file (F32 / BF16 / F16)."""
    buf = Path(path).read_bytes()
    n = struct.unpack("<Q", buf[:8])[0]
    header = json.loads(buf[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        raw = buf[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
        if v["dtype"] == "F32":
            a = np.frombuffer(raw, np.float32)
        elif v["dtype"] == "BF16":
            a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif v["dtype"] == "F16":
            a = np.frombuffer(raw, np.float16).astype(np.float32)
        else:
            raise ValueError(f"{k}: {v['dtype']}")
        out[k] = a.reshape(v["shape"])
    return out


def lily_example(name, *args):
    subprocess.run(["cargo", "run", "-q", "--example", name, "--", *map(str, args)], cwd=ROOT, check=True)


# --- block encoders (any valid blocks will do: the decoders are what is checked) -------------------

def f16_bytes(x):
    return np.asarray(x, np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def pack_scales_k4(sc, m):
    """The 12 scale bytes of Q4_K / Q5_K: 6-bit scales and mins of 8 sub-blocks. sc, m: [n, 8] uint8."""
    s = np.zeros((sc.shape[0], 12), np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    return s


def encode_kx(blocks, bits):
    """Q4_K (bits 4) or Q5_K (bits 5) of [n, 256] values: w ≈ d·sc·q − dmin·m per sub-block of 32."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    top = (1 << bits) - 1
    step = (sub.max(-1) - lo) / top
    d = np.maximum(step.max(-1), 1e-10) / 63
    dmin = np.maximum((-lo).max(-1), 1e-10) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / d16[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / dmin16[:, None]), 0, 63).astype(np.uint8)
    scale = (d16[:, None] * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin16[:, None] * m)[..., None]) / scale), 0, top).astype(np.uint8)
    # 32-byte chunk c holds sub-blocks 2c (low nibble) and 2c + 1 (high nibble).
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)
    parts = [f16_bytes(d), f16_bytes(dmin), pack_scales_k4(sc, m)]
    if bits == 5:
        high = (q >> 4) & 1  # [n, 8, 32]: bit j of qh[l] is the fifth bit of value l of sub-block j
        qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def encode_q6_k(blocks):
    """Q6_K of [n, 256] values: w ≈ d·sc·(q − 32) per sub-block of 16, sc an int8."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = np.maximum(step.max(-1), 1e-10) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(step / d16[:, None]), 1, 127).astype(np.int8)
    q = np.clip(np.rint(sub / (d16[:, None] * sc)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(n, 2, 128).astype(np.uint8)  # halves of 128
    ql = np.zeros((n, 2, 64), np.uint8)
    qh = np.zeros((n, 2, 32), np.uint8)
    ql[:] = (q[:, :, 0:64] & 15) | ((q[:, :, 64:128] & 15) << 4)
    for s in range(4):
        qh |= ((q[:, :, 32 * s:32 * s + 32] >> 4) & 3) << (2 * s)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), f16_bytes(d16)], axis=1)


def quantize(values, t):
    """The bytes of a 2-D or 3-D float array in ggml type t: shape [..., row bytes]."""
    v = np.ascontiguousarray(values, np.float32)
    if t == T.F32:
        return v
    if t in (T.F16, T.BF16, T.Q8_0):
        return gguf.quants.quantize(v, t)
    rows = v.reshape(-1, v.shape[-1])
    blocks = rows.reshape(-1, QK_K)
    enc = {T.Q4_K: lambda b: encode_kx(b, 4), T.Q5_K: lambda b: encode_kx(b, 5), T.Q6_K: encode_q6_k}[t](blocks)
    return enc.reshape(*v.shape[:-1], -1)


# --- (a) dequantisation, bit for bit ---------------------------------------------------------------

def random_blocks(t, rows, rng):
    """Random rows of blocks of type t, with finite half-precision scales."""
    size, nbytes = gguf.GGML_QUANT_SIZES[t]
    if t == T.F32:
        return rng.standard_normal((rows, 512)).astype(np.float32)
    if t == T.F16:
        return rng.standard_normal((rows, 512)).astype(np.float16)
    nblocks = 512 // size
    b = rng.integers(0, 256, (rows * nblocks, nbytes), dtype=np.uint8)
    scale = lambda k: f16_bytes(rng.standard_normal(rows * nblocks) * 10.0 ** rng.integers(-4, 1, rows * nblocks))
    if t == T.BF16:
        b = (rng.standard_normal(rows * 512).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return b.view(np.uint8).reshape(rows, -1)
    if t == T.Q8_0:
        b[:, 0:2] = scale(0)
    elif t in (T.Q4_K, T.Q5_K):
        b[:, 0:2], b[:, 2:4] = scale(0), scale(1)
    elif t == T.Q6_K:
        b[:, 208:210] = scale(0)
    return b.reshape(rows, -1)


def check_dequantisation(tmp, rng):
    path = tmp / "blocks.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    types = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
    for t in types:
        data = random_blocks(t, 6, rng)
        w.add_tensor(f"t.{t.name}", data, raw_dtype=t if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lily_example("gguf_dequant", path, tmp / "lily.safetensors")
    ours = read_safetensors(tmp / "lily.safetensors")
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        got = ours[t.name]
        if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            diff = np.abs(got - want).max() if got.shape == want.shape else f"shapes {got.shape} vs {want.shape}"
            sys.exit(f"FAIL {t.name}: lily's dequantisation differs from gguf-py's ({diff})")
        print(f"  {t.name:8} {want.size:6} values identical to gguf-py")


# --- (b) fixture models as llama.cpp converts them -------------------------------------------------

def tiled(x, axis, key_heads, value_heads, head):
    """llama.cpp's value-head reorder along `axis` (heads of `head` entries): grouped → tiled."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(key_heads, value_heads // key_heads, head, *rest).swapaxes(0, 1)
    return np.moveaxis(x.reshape(value_heads * head, *rest), 0, axis)


def gguf_tensors(src, c):
    """{gguf name: float32 array} of a Hugging Face checkpoint, transformed as llama.cpp's converter
    transforms qwen35moe; torch shapes (GGUF ne reversed)."""
    p = "model.language_model." if "model.language_model.embed_tokens.weight" in src else "model."
    out = {"token_embd.weight": src[p + "embed_tokens.weight"],
           "output_norm.weight": src[p + "norm.weight"] + 1}
    if "lm_head.weight" in src:
        out["output.weight"] = src["lm_head.weight"]
    for i, kind in enumerate(c["layer_types"]):
        block(out, src, f"{p}layers.{i}.", f"blk.{i}.", kind, c)
    if "mtp.fc.weight" in src:
        # The MTP head as the block after the last, with its nextn tensors (MODEL.md §5.2).
        b = f"blk.{len(c['layer_types'])}."
        block(out, src, "mtp.layers.0.", b, "full_attention", c)
        out[b + "nextn.eh_proj.weight"] = src["mtp.fc.weight"]
        out[b + "nextn.enorm.weight"] = src["mtp.pre_fc_norm_embedding.weight"] + 1
        out[b + "nextn.hnorm.weight"] = src["mtp.pre_fc_norm_hidden.weight"] + 1
        out[b + "nextn.shared_head_norm.weight"] = src["mtp.norm.weight"] + 1
    return out


def block(out, src, s, b, kind, c):
    """The tensors of one decoder layer (HF prefix `s`) as GGUF block `b`."""
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    inter = c["moe_intermediate_size"]
    out[b + "attn_norm.weight"] = src[s + "input_layernorm.weight"] + 1
    out[b + "post_attention_norm.weight"] = src[s + "post_attention_layernorm.weight"] + 1
    if kind == "full_attention":
        a = s + "self_attn."
        for hf, g in [("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")]:
            out[f"{b}{g}.weight"] = src[f"{a}{hf}.weight"]
        out[b + "attn_q_norm.weight"] = src[a + "q_norm.weight"] + 1
        out[b + "attn_k_norm.weight"] = src[a + "k_norm.weight"] + 1
    else:
        a = s + "linear_attn."
        qkv = src[a + "in_proj_qkv.weight"]
        qk = 2 * hk * dk
        out[b + "attn_qkv.weight"] = np.concatenate([qkv[:qk], tiled(qkv[qk:], 0, hk, hv, dv)])
        out[b + "attn_gate.weight"] = tiled(src[a + "in_proj_z.weight"], 0, hk, hv, dv)
        out[b + "ssm_beta.weight"] = tiled(src[a + "in_proj_b.weight"], 0, hk, hv, 1)
        out[b + "ssm_alpha.weight"] = tiled(src[a + "in_proj_a.weight"], 0, hk, hv, 1)
        conv = src[a + "conv1d.weight"].reshape(qkv.shape[0], -1)
        out[b + "ssm_conv1d.weight"] = np.concatenate([conv[:qk], tiled(conv[qk:], 0, hk, hv, dv)])
        out[b + "ssm_dt.bias"] = tiled(src[a + "dt_bias"], 0, hk, hv, 1)
        out[b + "ssm_a"] = tiled(-np.exp(src[a + "A_log"]), 0, hk, hv, 1)
        out[b + "ssm_norm.weight"] = src[a + "norm.weight"]
        out[b + "ssm_out.weight"] = tiled(src[a + "out_proj.weight"], 1, hk, hv, dv)
    m = s + "mlp."
    gate_up = src[m + "experts.gate_up_proj"]
    out[b + "ffn_gate_inp.weight"] = src[m + "gate.weight"]
    out[b + "ffn_gate_exps.weight"] = gate_up[:, :inter]
    out[b + "ffn_up_exps.weight"] = gate_up[:, inter:]
    out[b + "ffn_down_exps.weight"] = src[m + "experts.down_proj"]
    out[b + "ffn_gate_inp_shexp.weight"] = src[m + "shared_expert_gate.weight"].reshape(-1)
    for hf, g in [("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")]:
        out[f"{b}{g}.weight"] = src[f"{m}shared_expert.{hf}.weight"]


def write_model(path, c, tensors, type_of, vocabulary=False):
    """A qwen35moe GGUF with llama.cpp's metadata keys; type_of(name, array) picks each tensor's type."""
    w = gguf.GGUFWriter(str(path), ARCH)
    if vocabulary:
        add_vocabulary(w, c["vocab_size"])
    mtp = int(f"blk.{c['num_hidden_layers']}.nextn.eh_proj.weight" in tensors)
    w.add_block_count(c["num_hidden_layers"] + mtp)
    if mtp:
        w.add_nextn_predict_layers(mtp)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    rope = c["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))
    w.add_rope_dimension_sections(list(rope["mrope_section"]) + [0])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    w.add_ssm_state_size(c["linear_key_head_dim"])
    w.add_ssm_group_count(c["linear_num_key_heads"])
    w.add_ssm_time_step_rank(c["linear_num_value_heads"])
    w.add_ssm_inner_size(c["linear_num_value_heads"] * c["linear_value_head_dim"])
    kinds = c["layer_types"]
    interval = kinds.index("full_attention") + 1
    assert all((k == "full_attention") == ((i + 1) % interval == 0) for i, k in enumerate(kinds))
    w.add_full_attention_interval(interval)
    w.add_eos_token_id(c["eos_token_id"])
    for name, values in tensors.items():
        t = type_of(name, values)
        data = quantize(values, t)
        w.add_tensor(name, data, raw_dtype=t if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"  wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


# Qwen3.6's added tokens in id order (src/tokenizer.rs ADDED_TOKENS).
ADDED_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
                "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"]
# A short template, so that a test can tell it from the built-in one.
TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level(b):
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def add_vocabulary(w, vocab_size):
    """A Qwen-style vocabulary as llama.cpp writes it: the 256 byte tokens (a BPE without merges),
    the added tokens, then padding up to the model's vocabulary size."""
    tokens = [byte_level(b) for b in range(256)] + ADDED_TOKENS
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(ADDED_TOKENS)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_chat_template(TINY_TEMPLATE)


def text_config(d):
    c = json.loads((d / "config.json").read_text())
    return c.get("text_config", c)


def k_mix(name, values):
    """A llama-quantize-like choice: norms and vectors F32, the router F16, K-quants where rows are
    whole 256-blocks, Q8_0 where they are not."""
    if values.ndim == 1 or "ssm_conv1d" in name:
        return T.F32
    if name.endswith("ffn_gate_inp.weight"):
        return T.F16
    if values.shape[-1] % QK_K:
        return T.Q8_0
    if name == "output.weight":
        return T.Q6_K
    for part, t in [("attn_qkv", T.Q5_K), ("ffn_up", T.Q5_K), ("attn_k.", T.Q6_K),
                    ("ffn_gate_shexp", T.Q6_K), ("ssm_beta", T.Q8_0), ("ssm_alpha", T.Q8_0)]:
        if part in name:
            return t
    return T.Q4_K


def write_fixtures(tmp):
    OUT.mkdir(parents=True, exist_ok=True)
    src = FIXTURES / "models" / "tiny-a-bf16"
    c = text_config(src)
    tensors = gguf_tensors(read_safetensors(src / "model.safetensors"), c)
    # The source is bf16: matrices stay BF16 (exact); vectors become F32 as llama.cpp writes them.
    write_model(OUT / "tiny-a-bf16.gguf", c, tensors, lambda n, v: T.F32 if v.ndim == 1 or "conv1d" in n else T.BF16)
    # With the MTP head a current converter appends as blk.N with its nextn tensors; F32 throughout.
    src = FIXTURES / "models" / "tiny-a-mtp"
    c = text_config(src)
    write_model(OUT / "tiny-a-mtp.gguf", c, gguf_tensors(read_safetensors(src / "model.safetensors"), c),
                lambda n, v: T.F32)

    synth = tmp / "tiny-k"
    subprocess.run(["cargo", "run", "-q", "--", "synth", "--config", OUT / "tiny-k.json", "--out", synth,
                    "--seed", "7", "--dtype", "f32"], cwd=ROOT, check=True)
    c = text_config(synth)
    src = {}
    for f in sorted(synth.glob("*.safetensors")):
        src.update(read_safetensors(f))
    write_model(OUT / "tiny-k.gguf", c, gguf_tensors(src, c), k_mix, vocabulary=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-fixtures", action="store_true")
    args = ap.parse_args()
    version = getattr(gguf, "__version__", None) or __import__("importlib.metadata").metadata.version("gguf")
    if version != PINNED:
        sys.exit(f"gguf {version} found, {PINNED} pinned (tools/requirements-gguf.txt)")
    rng = np.random.default_rng()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("== (a) dequantisation against gguf-py, bit for bit")
        check_dequantisation(tmp, rng)
        if args.write_fixtures:
            print("== (b) fixtures")
            write_fixtures(tmp)
    print("OK")


if __name__ == "__main__":
    main()
