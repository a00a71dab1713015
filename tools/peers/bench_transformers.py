#!/usr/bin/env python3
"""transformers' qwen3_5_moe (bf16, random weights made on the device) through the peers' context sweep.

transformers picks its gated-delta-rule kernels when the modeling module is imported
(`use_kernel_func_from_hub_with_fallback` in transformers/integrations/hub_kernels.py): it imports
`fla.ops.gated_delta_rule` (flash-linear-attention, Triton) and uses its `chunk_gated_delta_rule`
(prefill) and `fused_recurrent_gated_delta_rule` (decode) when that works, else its own reference
PyTorch loops. The short convolution likewise uses the `causal_conv1d` package if present, else
F.conv1d. Hub kernels (the `kernels` package) are not installed on the GPU machine. `--no-fla` hides
fla from the import so the PyTorch path runs; meta.json records which function each path resolved to.
Experts run through `grouped_mm` (transformers' default when torch has it), attention through sdpa.

Usage (GPU machine):  python3 tools/peers/bench_transformers.py --out DIR [--no-fla] [--time-cap S]
CPU check (here):     python tools/peers/bench_transformers.py --config tiny --device cpu --contexts 64,128 --out /tmp/x
"""
import argparse
import importlib.abc
import inspect
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_config  # noqa: E402
import sweep  # noqa: E402

KERNEL_FUNCTIONS = ["torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                    "causal_conv1d_fn", "causal_conv1d_update"]


class HideFla(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fla" or name.startswith("fla."):
            raise ImportError(f"{name} hidden by --no-fla")
        return None


def kernel_paths(modeling):
    """Which implementation each of transformers' kernel hooks resolved to, e.g.
    'fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule' or 'transformers...torch_chunk_gated_delta_rule'."""
    out = {}
    for name in KERNEL_FUNCTIONS:
        fn = getattr(modeling, name)
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
        impl = getattr(impl, "__wrapped__", impl) if impl is not fn else impl
        out[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', repr(impl))}"
    return out


def build_model(torch, config_dict, device):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(**config_dict)
    # Built under the device context so that transformers' own weight init (N(0, 0.02) matrices, the
    # norms' offsets, the gated delta rule's decay ranges) runs on the GPU: seconds for 35B
    # parameters, where a CPU init takes many minutes. The seed is fresh each run.
    torch.manual_seed(time.time_ns() % (1 << 63))
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.eval()
    bad = [n for n, p in model.named_parameters() if p.device.type != torch.device(device).type]
    if bad:
        raise SystemExit(f"{len(bad)} parameters not on {device}, e.g. {bad[0]}")
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweep.add_sweep_args(parser)
    parser.add_argument("--config", default="full", choices=list(model_config.CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-fla", action="store_true", help="hide flash-linear-attention: PyTorch reference path")
    args = parser.parse_args()
    cap = sweep.TimeCap(args.time_cap)
    contexts = sweep.parse_contexts(args.contexts)
    if args.no_fla:
        sys.meta_path.insert(0, HideFla())

    import torch
    import transformers
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    paths = kernel_paths(modeling)
    print("kernel paths:", paths, flush=True)
    uses_fla = paths["torch_chunk_gated_delta_rule"].startswith("fla.")
    if args.no_fla == uses_fla:
        raise SystemExit(f"asked for {'no ' if args.no_fla else ''}fla but the chunk kernel is {paths['torch_chunk_gated_delta_rule']}")

    config_dict = model_config.get(args.config)
    t0 = time.monotonic()
    model = build_model(torch, config_dict, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.2f}B parameters (bf16) on {args.device} in {time.monotonic() - t0:.1f} s, "
          f"experts: {model.config._experts_implementation}, attention: {model.config._attn_implementation}", flush=True)
    vocab = config_dict["vocab_size"]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    @torch.inference_mode()
    def measure_once(context, decode_steps):
        ids = torch.tensor([sweep.synthetic_ids(context, vocab)], device=args.device)
        sync()
        t = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        next_id = out.logits[:, -1:].argmax(-1)
        next_id.item()  # the first token is on the host: TTFT
        prefill_s = time.perf_counter() - t
        cache = out.past_key_values
        t = time.perf_counter()
        for _ in range(decode_steps):
            out = model(input_ids=next_id, past_key_values=cache, use_cache=True)
            next_id = out.logits[:, -1:].argmax(-1)
        sync()
        return prefill_s, time.perf_counter() - t

    rows = sweep.run_sweep(sweep.warm_then_rounds(measure_once), contexts, args.decode_steps, args.rounds, cap)
    peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None
    sweep.write_results(args.out, rows, args.decode_steps, {
        "engine": "transformers" + ("" if uses_fla else " (no fla)"),
        "weights": "bf16", "dtypes": "bf16 weights, activations and KV cache",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "fla": _version("flash-linear-attention") if uses_fla else None},
        "config": args.config, "parameters": n_params, "kernel_paths": paths,
        "experts_implementation": model.config._experts_implementation,
        "attn_implementation": model.config._attn_implementation,
        "peak_memory_bytes": peak,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
    })


def _version(dist):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
