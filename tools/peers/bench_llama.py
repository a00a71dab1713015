#!/usr/bin/env python3
"""llama.cpp (llama-bench) on a qwen35moe GGUF through the peers' context sweep.

llama-bench times prefill and decode separately, on synthetic tokens, with a warm-up run per test and
`-r` repetitions (we report the median of its samples):
  prefill of N tokens from an empty cache:     -p N -n 0            ("pp N")
  64 decode steps after N tokens of context:   -p 0 -n 64 -d N      ("tg64 @ dN"; the depth prefill is
                                                                      untimed and done once per test)
Two llama-bench processes stream JSON lines: all prefills (ascending), then all decodes at depth for the
contexts whose prefill ran. Before each context the time cap is checked against a prediction of that
context's whole cost (three prefills in the first process, one prefill and the decodes in the second);
the first process is stopped when the next context would not fit, and the rest are "not run (time cap)".
Flash attention on, all layers on the GPU.

Usage: python3 bench_llama.py --llama-bench BIN --model M.gguf --out DIR [--time-cap S] [--extra "-ub 2048"]
"""
import argparse
import contextlib
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402


# Per context in the decode process: warm-up + rounds x 64 steps at >= 50 tok/s, and a new context.
DECODE_ALLOWANCE_S = 5.0


def stream(cmd):
    """Runs llama-bench with JSON-lines output and yields each test's result as it finishes; closing
    the generator (contextlib.closing) stops the process."""
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    stopped = False
    try:
        for line in proc.stdout:
            if line.startswith("{"):
                yield json.loads(line)
    except GeneratorExit:
        stopped = True
        raise
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait()
        if proc.returncode != 0 and not stopped:
            raise RuntimeError(f"llama-bench exited with {proc.returncode}")


def median_s(result):
    return statistics.median(result["samples_ns"]) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweep.add_sweep_args(parser)
    parser.add_argument("--llama-bench", required=True, type=Path)
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--extra", default="", help="more llama-bench arguments, e.g. '-ub 2048'")
    args = parser.parse_args()
    cap = sweep.TimeCap(args.time_cap)
    contexts = sweep.parse_contexts(args.contexts)
    base = [str(args.llama_bench), "-m", str(args.model), "-ngl", "99", "-fa", "1", "-r", str(args.rounds),
            "-o", "jsonl"] + shlex.split(args.extra)

    prefill = {}  # context -> median seconds
    info = {}

    def predicted_total(context):
        """A context's cost in both processes: warm-up + rounds prefills, one depth prefill, decodes."""
        last = max(prefill)
        per_prefill = prefill[last] * context / last * cap.PREFILL_GROWTH_MARGIN
        return (args.rounds + 2) * per_prefill + DECODE_ALLOWANCE_S

    def next_fits(context):
        later = [c for c in contexts if c > context]
        # Still owed to the decode process: one depth prefill and the decodes per context run so far.
        owed = sum(prefill.values()) + DECODE_ALLOWANCE_S * len(prefill)
        return bool(later) and cap.elapsed() + owed + predicted_total(later[0]) <= cap.cap_s

    failure = {}  # phase -> why llama-bench stopped (e.g. out of memory at the longest context)
    cmd = base + ["-p", ",".join(map(str, contexts)), "-n", "0"]
    try:
        with contextlib.closing(stream(cmd)) as results:
            for result in results:
                c = result["n_prompt"]
                prefill[c] = median_s(result)
                info.update(result)
                print(f"pp{c}: {c / prefill[c]:,.0f} tok/s  [{cap.elapsed():.0f} s used]", flush=True)
                if not next_fits(c):
                    break
    except RuntimeError as e:
        failure["prefill"] = str(e)
    decode = {}
    if prefill:
        cmd = base + ["-p", "0", "-n", str(args.decode_steps), "-d", ",".join(map(str, sorted(prefill)))]
        try:
            for result in stream(cmd):
                d = result["n_depth"]
                decode[d] = median_s(result)
                print(f"tg{args.decode_steps} @ d{d}: {args.decode_steps / decode[d]:.1f} tok/s  [{cap.elapsed():.0f} s used]",
                      flush=True)
        except RuntimeError as e:
            failure["decode"] = str(e)
    rows = []
    for c in contexts:
        if c in prefill and c in decode:
            rows.append((c, prefill[c], decode[c], "ok"))
        elif c in prefill:
            rows.append((c, None, None, f"error: decode: {failure.get('decode', 'no result')}"))
        elif "prefill" in failure and c == min(x for x in contexts if x not in prefill):
            rows.append((c, None, None, f"error: {failure['prefill']}"))
        else:
            rows.append((c, None, None, sweep.NOT_RUN))
    sweep.write_results(args.out, rows, args.decode_steps, {
        "engine": "llama.cpp",
        "weights": f"GGUF {info.get('model_type', '?')} ({info.get('model_size', 0) / 1e9:.2f} GB)",
        "dtypes": f"Q4_K/Q6_K weights, F32 norms and small tensors; KV cache {info.get('type_k')}/{info.get('type_v')}",
        "versions": {"llama.cpp": f"{info.get('build_commit', '?')} (build {info.get('build_number', '?')})"},
        "gpu": info.get("gpu_info"), "backends": info.get("backends"),
        "flash_attn": info.get("flash_attn"), "n_batch": info.get("n_batch"), "n_ubatch": info.get("n_ubatch"),
        "type_k": info.get("type_k"), "type_v": info.get("type_v"), "n_gpu_layers": info.get("n_gpu_layers"),
        "llama_bench": shlex.join(base),
        "note": "prefill = llama-bench pp N (batch decode of the prompt, no sampling); decode = tg64 at depth N",
    })


if __name__ == "__main__":
    main()
