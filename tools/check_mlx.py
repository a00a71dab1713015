#!/usr/bin/env python3
"""lily's MLX support checked against the real mlx and mlx-lm (pinned in tools/requirements-mlx.txt).

(a) Quantises small models with mlx-lm's own converter (`mlx_lm.convert.convert(..., quantize=True)`)
    and with `lily quantize`, and compares every tensor bit for bit (names, dtypes, shapes, bytes:
    packed weights, scales, biases, unquantised tensors) and the config.json each writes.
(b) Runs lily's CPU forward pass (examples/logits.rs) on mlx-lm's output and compares the logits with
    mlx-lm's own forward pass on the same prompts.
(c) Reports how far quantisation moves the next-token distribution: KL(unquantised ‖ quantised) and
    top-1 agreement, per position, from lily's logits (the unquantised model vs mlx-lm's Q4/Q8 of it).

Models: the transformers fixtures tiny-a (f32) and tiny-a-bf16 (hidden 32: only the attention and GDN
output projections, 128 and 64 wide, take group 64; the rest checks renames, +1 norms, conv layout and
dtypes of unquantised tensors); tiny-q, made here (bf16, every width a multiple of 64 except the shared expert's 96, which stays
bf16); and `lily synth --config tiny` (bf16; expert down projections of width 32 stay bf16).
tiny-b is skipped: mlx-lm derives layer kinds from full_attention_interval and ignores its
explicit layer_types.

Run from the repository root (Linux CPU wheels exist for mlx):
    python3 -m venv /tmp/venv-mlx && /tmp/venv-mlx/bin/pip install -r tools/requirements-mlx.txt
    /tmp/venv-mlx/bin/python tools/check_mlx.py            # writes tests/fixtures/mlx/REPORT.md
    /tmp/venv-mlx/bin/python tools/check_mlx.py --write-fixture
The second form also rewrites tests/fixtures/mlx/tiny-q4 (mlx-lm's Q4 of tiny-q plus mlx's logits),
which tests/mlx.rs loads. lily is built with `cargo build` (debug; what `cargo test` already built).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.convert import convert
from mlx_lm.utils import load_model

T_START = time.time()

PINNED = {"mlx": "0.32.4", "mlx_lm": "0.32.2"}
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
OUT = FIXTURES / "mlx"
PROMPT_LENGTHS = [1, 9, 70]  # 70 > the GDN chunk of 64
# lily computes in f32 from the stored weights; mlx run in f32 (`set_dtype(float32)` on the same
# quantised weights) differs only in summation order and a few fused operations.
F32_TOLERANCE = 1e-4

TINY_Q = {
    "hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 256,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96,
    "full_attention_interval": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": 0,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [4, 2, 2]},
    "model_type": "qwen3_5_moe_text", "dtype": "bfloat16",
}


def check_versions():
    have = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
    for k, want in PINNED.items():
        if have[k] != want:
            sys.exit(f"{k} {have[k]} found, {want} pinned (tools/requirements-mlx.txt)")


# --- safetensors, read raw so that bf16 bytes compare exactly -----------------------------------

def read_tensors_file(path):
    """{name: (dtype, shape, bytes)} of one safetensors file."""
    buf = Path(path).read_bytes()
    n = struct.unpack("<Q", buf[:8])[0]
    header = json.loads(buf[8:8 + n])
    return {k: (v["dtype"], v["shape"], buf[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def read_tensors(d):
    """{name: (dtype, shape, bytes)} over every model*.safetensors in d."""
    out = {}
    for f in sorted(Path(d).glob("model*.safetensors")):
        out.update(read_tensors_file(f))
    return out


def write_tensors(path, tensors):
    """tensors: {name: np.ndarray} (float32 / int32)."""
    dt = {np.dtype("float32"): "F32", np.dtype("int32"): "I32"}
    header, blobs, off = {}, [], 0
    for k, v in tensors.items():
        b = np.ascontiguousarray(v).tobytes()
        header[k] = {"dtype": dt[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def f32_of(dtype, shape, raw):
    if dtype == "F32":
        return np.frombuffer(raw, np.float32).reshape(shape)
    if dtype == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    raise ValueError(dtype)


# --- models -------------------------------------------------------------------------------------

def make_tiny_q(d, seed=5):
    """A bf16 model in the official layout whose widths suit group 64 (weights as make_fixtures.py
    draws them: linear N(0, 1/in), embedding N(0, 1), random norms, A_log, dt_bias and conv)."""
    rng = np.random.default_rng(seed)
    c = TINY_Q
    h, e, i, si = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    kd, vd = c["linear_num_key_heads"] * c["linear_key_head_dim"], c["linear_num_value_heads"] * c["linear_value_head_dim"]
    conv, nv = 2 * kd + vd, c["linear_num_value_heads"]
    qo, kvo = 2 * c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    lin = lambda *s: rng.standard_normal(s) / np.sqrt(s[-1])
    t = {"model.language_model.embed_tokens.weight": rng.standard_normal((c["vocab_size"], h)),
         "model.language_model.norm.weight": rng.standard_normal(h) * 0.2,
         "lm_head.weight": lin(c["vocab_size"], h)}
    for l in range(c["num_hidden_layers"]):
        p = f"model.language_model.layers.{l}."
        if c["layer_types"][l] == "full_attention":
            t.update({p + "self_attn.q_proj.weight": lin(qo, h), p + "self_attn.k_proj.weight": lin(kvo, h),
                      p + "self_attn.v_proj.weight": lin(kvo, h), p + "self_attn.o_proj.weight": lin(h, qo // 2),
                      p + "self_attn.q_norm.weight": rng.standard_normal(c["head_dim"]) * 0.2,
                      p + "self_attn.k_norm.weight": rng.standard_normal(c["head_dim"]) * 0.2})
        else:
            a = p + "linear_attn."
            t.update({a + "in_proj_qkv.weight": lin(conv, h), a + "in_proj_z.weight": lin(vd, h),
                      a + "in_proj_b.weight": lin(nv, h), a + "in_proj_a.weight": lin(nv, h),
                      a + "conv1d.weight": rng.standard_normal((conv, 1, c["linear_conv_kernel_dim"])) * 0.5,
                      a + "A_log": np.log(rng.uniform(0.5, 8.0, nv)), a + "dt_bias": rng.standard_normal(nv) * 0.5,
                      a + "norm.weight": 1.0 + rng.standard_normal(c["linear_value_head_dim"]) * 0.2,
                      a + "out_proj.weight": lin(h, vd)})
        m = p + "mlp."
        t.update({p + "input_layernorm.weight": rng.standard_normal(h) * 0.2,
                  p + "post_attention_layernorm.weight": rng.standard_normal(h) * 0.2,
                  m + "gate.weight": lin(e, h), m + "experts.gate_up_proj": lin(e, 2 * i, h),
                  m + "experts.down_proj": lin(e, h, i), m + "shared_expert.gate_proj.weight": lin(si, h),
                  m + "shared_expert.up_proj.weight": lin(si, h), m + "shared_expert.down_proj.weight": lin(h, si),
                  m + "shared_expert_gate.weight": lin(1, h)})
    d.mkdir(parents=True)
    mx.save_safetensors(str(d / "model.safetensors"), {k: mx.array(v.astype(np.float32)).astype(mx.bfloat16) for k, v in t.items()})
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "tie_word_embeddings": False, "text_config": c}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def gpu_rule_differences(src):
    """How many 4-bit codes of src's quantisable bf16 matrices would differ had they been quantised by
    MLX's Metal/CUDA kernels, which round half away from zero and start their running maximum at 0
    (emulated from the kernel source; the CPU rule is mx.quantize itself)."""
    differ = total = 0
    for name, (dtype, shape, raw) in read_tensors(src).items():
        if len(shape) < 2 or shape[-1] % 64 or "conv1d" in name or dtype != "BF16":
            continue
        w = f32_of(dtype, shape, raw).reshape(-1, 64)
        wq, _, _ = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=64, bits=4)
        cpu = (np.array(wq).reshape(-1, 1) >> (4 * np.arange(8, dtype=np.uint32))) & 15
        w_max, w_min = np.maximum(w.max(1), 0), w.min(1)
        side = np.abs(w_min) > np.abs(w_max)
        scale = np.maximum((w_max - w_min) / np.float32(15), np.float32(1e-7)).astype(np.float32)
        scale = np.where(side, scale, -scale)
        edge = np.where(side, w_min, w_max)
        away = lambda x: np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))
        q0 = away(edge / scale).astype(np.float32)
        nz = q0 != 0
        scale = np.where(nz, edge / np.where(nz, q0, 1), scale).astype(np.float32)
        bias = np.where(nz, edge, 0).astype(np.float32)
        gpu = np.clip(away((w - bias[:, None]) / scale[:, None]), 0, 15)
        differ += int((gpu.reshape(-1) != cpu.reshape(-1)).sum())
        total += w.size
    return differ, total


def add_tokenizer(d, vocab):
    """mlx-lm's converter saves a tokenizer, so give the model a trivial one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}))


def source_copy(src, d):
    """The model files of src (not transformers' reference outputs) plus a tokenizer."""
    d.mkdir(parents=True)
    for f in ["config.json", "model.safetensors"]:
        shutil.copy(src / f, d / f)
    cfg = json.loads((d / "config.json").read_text())
    add_tokenizer(d, cfg.get("text_config", cfg)["vocab_size"])
    return d


# --- lily ---------------------------------------------------------------------------------------

def target_dir():
    return Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug"


def build_lily():
    subprocess.run(["cargo", "build", "--bin", "lily", "--example", "logits"], cwd=ROOT, check=True)


def run(*cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{r.stderr}")


def lily(*args):
    run(target_dir() / "lily", *args)


def lily_logits(model_dir, prompts, work):
    """lily's logits for each prompt (examples/logits.rs), [T, vocab] each."""
    out = work / "logits" / f"{model_dir.parent.name}-{model_dir.name}.safetensors"
    out.parent.mkdir(exist_ok=True)
    run(target_dir() / "examples" / "logits", model_dir, out, *[",".join(map(str, p)) for p in prompts])
    t = read_tensors_file(out)
    return [f32_of(*t[f"p{i}.logits"]) for i in range(len(prompts))]


# --- mlx ----------------------------------------------------------------------------------------

def mlx_logits(model_dir, prompts, f32):
    """mlx-lm's logits, in float32 or in the model's own dtype; None where mlx's CPU backend cannot
    run the model in its own dtype (gather_mm of unquantised bf16 experts is float32-only)."""
    model, _ = load_model(Path(model_dir))
    if f32:
        model.set_dtype(mx.float32)
    try:
        return [np.array(model(mx.array([p]))[0].astype(mx.float32)) for p in prompts]
    except RuntimeError as e:
        if f32:
            raise
        print(f"[check_mlx] {model_dir}: no native-dtype run on the CPU: {e}", flush=True)
        return None


# --- comparisons --------------------------------------------------------------------------------

def compare_tensors(a_dir, b_dir):
    a, b = read_tensors(a_dir), read_tensors(b_dir)
    problems = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            problems.append(f"{name}: only in {'mlx-lm' if name in a else 'lily'}")
        elif a[name][:2] != b[name][:2]:
            problems.append(f"{name}: mlx-lm {a[name][:2]}, lily {b[name][:2]}")
        elif a[name][2] != b[name][2]:
            x, y = np.frombuffer(a[name][2], np.uint8), np.frombuffer(b[name][2], np.uint8)
            problems.append(f"{name}: {int((x != y).sum())} of {x.size} bytes differ")
    return len(a), sum(1 for k in a if k.endswith(".scales")), problems


def compare_configs(a_dir, b_dir):
    """Differences between the config.json files (as `key` or `text_config.key`), the quantisation
    block, and whether the index files agree (metadata and weight map)."""
    a = json.loads((Path(a_dir) / "config.json").read_text())
    b = json.loads((Path(b_dir) / "config.json").read_text())
    diffs = []
    for k in sorted(set(a) | set(b)):
        if k == "text_config" and isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            diffs += [f"text_config.{t}" for t in sorted(set(a[k]) | set(b[k])) if a[k].get(t) != b[k].get(t)]
        elif a.get(k) != b.get(k):
            diffs.append(k)
    ia = json.loads((Path(a_dir) / "model.safetensors.index.json").read_text())
    ib = json.loads((Path(b_dir) / "model.safetensors.index.json").read_text())
    return diffs, a.get("quantization"), ia == ib


def rel_error(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def kl_top1(ref, q):
    """Mean and max KL(softmax(ref) ‖ softmax(q)) over positions, and top-1 agreement."""
    def logsoftmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    lp, lq = logsoftmax(ref), logsoftmax(q)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return float(kl.mean()), float(kl.max()), float((ref.argmax(-1) == q.argmax(-1)).mean())


def median_margin(logits):
    """Median gap between the top two logits (nats): how decided the model is."""
    top2 = np.sort(logits, -1)[:, -2:]
    return float(np.median(top2[:, 1] - top2[:, 0]))


def bf16_row():
    t = read_tensors_file(FIXTURES / "models" / "tiny-a-bf16" / "reference.safetensors")
    n = sum(1 for k in t if k.endswith(".ids"))
    f32 = np.concatenate([f32_of(*t[f"p{i}.logits_f32"]) for i in range(n)])
    bf16 = np.concatenate([f32_of(*t[f"p{i}.logits"]) for i in range(n)])
    kl_mean, kl_max, top1 = kl_top1(f32, bf16)
    return (f"| tiny-a-bf16: bf16 vs f32 arithmetic (transformers) | {f32.shape[0]} | {median_margin(f32):.3f} | "
            f"{kl_mean:.2e} | {kl_max:.2e} | {100 * top1:.1f} % |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-fixture", action="store_true")
    ap.add_argument("--keep", help="keep the work directory here")
    args = ap.parse_args()
    check_versions()
    t_build = time.time()
    build_lily()
    t_build = time.time() - t_build
    work = Path(args.keep or tempfile.mkdtemp(prefix="check-mlx-"))
    work.mkdir(parents=True, exist_ok=True)

    sources = {}
    for name in ["tiny-a", "tiny-a-bf16"]:
        sources[name] = source_copy(FIXTURES / "models" / name, work / "src" / name)
    make_tiny_q(work / "src" / "tiny-q")
    add_tokenizer(work / "src" / "tiny-q", TINY_Q["vocab_size"])
    # mlx-lm moves generation_config.json's eos_token_id into config.json; so must lily.
    (work / "src" / "tiny-q" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    sources["tiny-q"] = work / "src" / "tiny-q"
    lily("synth", "--config", "tiny", "--out", work / "src" / "synth-tiny", "--dtype", "bf16", "--seed", "3")
    add_tokenizer(work / "src" / "synth-tiny", 1024)
    sources["synth-tiny"] = work / "src" / "synth-tiny"

    rng = np.random.default_rng(11)
    rows_a, rows_b, rows_c, notes = [], [], [], []
    fixture = None
    for name, src in sources.items():
        cfg = json.loads((src / "config.json").read_text())
        vocab = cfg.get("text_config", cfg)["vocab_size"]
        prompts = [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]
        unquantised = lily_logits(src, prompts, work)
        for bits in [4, 8]:
            tag = f"{name} q{bits}"
            m_dir, l_dir = work / "mlx" / f"{name}-q{bits}", work / "lily" / f"{name}-q{bits}"
            m_dir.parent.mkdir(exist_ok=True)
            print(f"[check_mlx] {tag}", flush=True)
            convert(str(src), str(m_dir), quantize=True, q_bits=bits, q_group_size=64)
            lily("quantize", "--model", src, "--out", l_dir, "--bits", bits, "--group-size", 64)
            n, n_q, problems = compare_tensors(m_dir, l_dir)
            cfg_diffs, qblock, same_index = compare_configs(m_dir, l_dir)
            overrides = sum(1 for v in qblock.values() if isinstance(v, dict))
            # mlx-lm's argument parsing renames rope_parameters.rope_type to `type` in place and so
            # writes it that way; lily keeps the source's spelling (everyone reads both).
            expected = ["text_config.rope_parameters"]
            rows_a.append(f"| {tag} | {n} | {n_q} ({overrides} at 8-bit by override) | "
                          f"{'identical' if not problems else f'**{len(problems)} differ**'} | "
                          f"{'identical' if 'quantization' not in cfg_diffs else '**differs**'} | "
                          f"{'identical' if not [d for d in cfg_diffs if d not in expected] else '**differ: ' + ', '.join(cfg_diffs) + '**'} | "
                          f"{'identical' if same_index else '**differs**'} |")
            notes += [f"{tag}: {p}" for p in problems[:20]]

            lily_q = lily_logits(m_dir, prompts, work)
            mlx_f32 = mlx_logits(m_dir, prompts, f32=True)
            mlx_native = mlx_logits(m_dir, prompts, f32=False)
            e32 = max(rel_error(a, b) for a, b in zip(lily_q, mlx_f32))
            ok = "ok" if e32 <= F32_TOLERANCE else "**FAIL**"
            if mlx_native is None:
                rows_b.append(f"| {tag} | {e32:.2e} ({ok}) | n/a (mlx CPU: bf16 gather_mm unsupported) | n/a |")
            else:
                enat = max(rel_error(a, b) for a, b in zip(lily_q, mlx_native))
                noise = max(rel_error(a, b) for a, b in zip(mlx_native, mlx_f32))
                rows_b.append(f"| {tag} | {e32:.2e} ({ok}) | {enat:.2e} | {noise:.2e} |")

            ref, q = np.concatenate(unquantised), np.concatenate(lily_q)
            kl_mean, kl_max, top1 = kl_top1(ref, q)
            rows_c.append(f"| {tag} | {ref.shape[0]} | {median_margin(ref):.3f} | {kl_mean:.2e} | {kl_max:.2e} | {100 * top1:.1f} % |")
            if name == "tiny-q" and bits == 4:
                fixture = (m_dir, prompts, mlx_f32, mlx_native)
    gpu_differ, gpu_total = gpu_rule_differences(sources["tiny-q"])
    elapsed = time.time() - T_START

    if args.write_fixture:
        m_dir, prompts, mlx_f32, mlx_native = fixture
        d = OUT / "tiny-q4"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        for f in ["config.json", "model.safetensors"]:
            shutil.copy(m_dir / f, d / f)
        ref = {}
        for i, p in enumerate(prompts):
            ref[f"p{i}.ids"] = np.array(p, np.int32)
            ref[f"p{i}.logits_f32"] = mlx_f32[i].astype(np.float32)
            ref[f"p{i}.logits"] = mlx_native[i].astype(np.float32)
        write_tensors(d / "reference.safetensors", ref)
        (d / "SOURCE.md").write_text(
            "mlx-lm's Q4 (group 64) of the tiny-q model made by tools/check_mlx.py, and mlx's logits for the\n"
            "prompts in reference.safetensors: `p{i}.logits_f32` from the model run in float32\n"
            "(`set_dtype(mx.float32)`), `p{i}.logits` in its own bfloat16. Regenerate with\n"
            "`python tools/check_mlx.py --write-fixture` (mlx 0.32.4, mlx-lm 0.32.2).\n")

    report = [
        "# lily vs mlx / mlx-lm",
        "",
        f"Generated by `tools/check_mlx.py` with mlx {mx.__version__} and mlx-lm {mlx_lm.__version__} (CPU, Linux).",
        f"The run took {elapsed:.0f} s in all, of which {t_build:.0f} s building lily (`cargo build`, a no-op after `cargo test`).",
        "",
        "## (a) `lily quantize` vs `mlx_lm.convert -q`, group 64",
        "",
        "Every tensor compared byte for byte (packed weights, scales, biases, unquantised tensors), and config.json",
        "compared as parsed JSON (key for key; quantization and quantization_config blocks included).",
        "",
        "| model | tensors | quantised modules | tensor bytes | quantization block | rest of config.json | index |",
        "|---|---|---|---|---|---|---|",
        *rows_a,
        "",
        "\"Rest of config.json\" ignores one expected difference: mlx-lm renames `rope_parameters.rope_type` to",
        "`type` (a side effect of its argument parsing); lily keeps the source's spelling. mlx-lm, transformers and",
        "lily read both. mlx-lm also writes a README.md model card, lily does not.",
        "",
        *([f"- {n}" for n in notes] or ["No differences."]),
        "",
        "Both match mlx's CPU quantiser. mlx's Metal and CUDA kernels (what mlx-community uploads were made",
        "with) round halves away from zero instead of to even: emulating their rule from the kernel source,",
        f"{gpu_differ} of tiny-q's {gpu_total} 4-bit codes ({100 * gpu_differ / gpu_total:.2f} %) would differ,",
        "each by a step or two. Such checkpoints load and dequantise exactly all the same.",
        "",
        "## (b) lily's forward pass on mlx-lm's output vs mlx-lm's forward pass",
        "",
        f"Relative error = max |lily − mlx| / max |mlx| over all logits of prompts of {PROMPT_LENGTHS} tokens. lily",
        "computes in f32 from the stored (bf16) scales, biases and weights; against mlx run in f32 on the same",
        f"weights the tolerance is {F32_TOLERANCE:g}. mlx's own bf16 run is shown with how far bf16 arithmetic moves",
        "mlx itself (its bf16 vs f32 runs), the yardstick for that column.",
        "",
        "| model | vs mlx f32 | vs mlx native dtype | mlx native vs mlx f32 |",
        "|---|---|---|---|",
        *rows_b,
        "",
        "## (c) How much quantisation changes the model (lily, unquantised source vs mlx-lm's quantisation of it)",
        "",
        "KL(unquantised ‖ quantised) of the next-token distributions in nats, and how often the top-1 token agrees,",
        "over every position of the prompts. These are random-weight models whose top two logits are typically",
        "close (the margin column: median gap between them in the unquantised model), so top-1 agreement says",
        "little about a trained model and KL is the number to watch. For scale, the last row is what bf16",
        "arithmetic alone does to tiny-a-bf16 (transformers' bf16 run vs its f32 run of the same weights).",
        "",
        "| model | positions | top-1 margin | mean KL | max KL | top-1 agreement |",
        "|---|---|---|---|---|---|",
        *rows_c,
        bf16_row(),
        "",
    ]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "REPORT.md").write_text("\n".join(report))
    print("\n".join(report))
    bad = any("differ" in r for r in rows_a) or any("FAIL" in r for r in rows_b)
    if not args.keep:
        shutil.rmtree(work)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
