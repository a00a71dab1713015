#!/usr/bin/env python3
"""mlx-lm's qwen3_5_moe on MLX (its CUDA backend on the GPU machine) through the peers' context sweep.

The model is mlx-lm's own class with random weights drawn by MLX, quantised as mlx-community's
Qwen3.6-35B-A3B-4bit is (affine 4-bit, group 64; the router and shared-expert gate 8-bit, mlx-lm's
quant_predicate), layer by layer so the float weights never all exist at once. Generation is
mlx-lm's `generate_step` (prefill in chunks of 2,048 tokens, greedy, decode pipelined with
async_eval), the path `mlx_lm.generate` takes: prefill time = until the first token is on the host.

Note: mlx-lm's gated-delta kernel is Metal-only (models/gated_delta.py uses it when
mx.metal.is_available()); on CUDA the 30 GDN layers run `gated_delta_ops`, a per-token loop.

Usage (GPU machine):  python3 tools/peers/bench_mlx.py --out DIR [--time-cap S]
CPU check (here):     python tools/peers/bench_mlx.py --config tiny --contexts 64,128 --out /tmp/x
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_config  # noqa: E402
import sweep  # noqa: E402


def build_model(mx, nn, config_dict):
    from mlx.utils import tree_map_with_path
    from mlx_lm.models.qwen3_5_moe import Model, ModelArgs

    mx.random.seed(time.time_ns() % (1 << 32))
    model = Model(ModelArgs.from_dict({"model_type": "qwen3_5_moe", "text_config": config_dict}))
    # Lazy until evaluated: cast, quantise, then materialise one layer at a time.
    # bf16 like the published checkpoint, except what mlx-lm's cast_predicate keeps (A_log, f32).
    keep = model.cast_predicate
    model.update(tree_map_with_path(
        lambda path, v: v.astype(mx.bfloat16) if keep(path) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    predicate = model.quant_predicate

    def quantize(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % 64 != 0:
            return False
        return predicate(path, module) if predicate else True

    nn.quantize(model, group_size=64, bits=4, class_predicate=quantize)
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweep.add_sweep_args(parser)
    parser.add_argument("--config", default="full", choices=list(model_config.CONFIGS))
    parser.add_argument("--prefill-step-size", type=int, default=2048, help="mlx-lm's default chunk")
    args = parser.parse_args()
    cap = sweep.TimeCap(args.time_cap)
    contexts = sweep.parse_contexts(args.contexts)

    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx.utils import tree_flatten

    device = str(mx.default_device())
    backend = "cuda" if mx.cuda.is_available() else ("metal" if mx.metal.is_available() else "cpu")
    config_dict = model_config.get(args.config)
    t0 = time.monotonic()
    model = build_model(mx, nn, config_dict)
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    print(f"model: {nbytes / 1e9:.2f} GB (Q4 g64) on {device} ({backend}) in {time.monotonic() - t0:.1f} s", flush=True)
    vocab = config_dict["vocab_size"]

    def measure_once(context, decode_steps):
        prompt = mx.array(sweep.synthetic_ids(context, vocab))
        cache = make_prompt_cache(model)
        steps = generate_step(prompt, model, max_tokens=decode_steps + 1, prompt_cache=cache,
                              prefill_step_size=args.prefill_step_size)
        t = time.perf_counter()
        next(steps)  # the first token, as an int on the host
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        n = sum(1 for _ in steps)
        if n != decode_steps:
            raise RuntimeError(f"generate_step gave {n} decode tokens, expected {decode_steps}")
        return prefill_s, time.perf_counter() - t

    rows = sweep.run_sweep(sweep.warm_then_rounds(measure_once), contexts, args.decode_steps, args.rounds, cap)
    sweep.write_results(args.out, rows, args.decode_steps, {
        "engine": "mlx-lm",
        "weights": "MLX Q4 g64 (router, shared-expert gate Q8)",
        "dtypes": "Q4 g64 weights with bf16 scales; bf16 activations and KV cache",
        "weights_bytes": nbytes,
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "backend": backend, "config": args.config,
        "peak_memory_bytes": mx.get_peak_memory(),
        "gated_delta": "Metal kernel" if mx.metal.is_available() else "gated_delta_ops (per-token loop of array ops)",
    })


if __name__ == "__main__":
    main()
