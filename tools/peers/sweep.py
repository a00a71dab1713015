"""The context sweep every peer runs, with its time cap and its output files (one place for the protocol).

Protocol (the same as `lily bench` and Perplexity's Lily): batch 1, prompt length = context, synthetic
token ids, one prefill (timed to the first token, which is included) then `decode_steps` greedy decode
steps at that depth; a warm-up run at the exact shape first, then the median of `rounds` runs.

A peer gives `run_sweep` a function that measures one context (`warm_then_rounds` builds it from one
that times a single run).
The time cap covers the whole peer (model set-up included): before each context the sweep predicts
that context's cost from the previous one and skips it and every longer context when the cap would be
exceeded; those rows say "not run (time cap)".

Output: OUT/results.csv (context,prefill_s,prefill_tok_s,decode_tok_s,status) and OUT/meta.json
(engine, weights, versions, command, notes), which tools/peers/collect.py reads.
"""
import json
import statistics
import sys
import time
from pathlib import Path

CONTEXTS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
DECODE_STEPS = 64
ROUNDS = 2
NOT_RUN = "not run (time cap)"
CSV_HEADER = "context,prefill_s,prefill_tok_s,decode_tok_s,status"
# Lily's synthetic prompt: token i is (i * 2654435761 mod 2^32) mod vocab.
HASH = 2654435761


def synthetic_ids(n, vocab_size):
    return [(i * HASH % (1 << 32)) % vocab_size for i in range(n)]


def parse_contexts(text):
    """'256,512,4K' -> [256, 512, 4096]."""
    out = []
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        scale = 1024 if part[-1] in "kK" else 1
        try:
            out.append(int(part.rstrip("kK")) * scale)
        except ValueError:
            raise SystemExit(f"bad context '{part}': expected a number like 4096 or 4K")
    if not out or min(out) < 1:
        raise SystemExit(f"no valid contexts in '{text}'")
    return sorted(out)


def add_sweep_args(parser):
    parser.add_argument("--out", required=True, type=Path, help="directory for results.csv and meta.json")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="comma-separated, e.g. 256,4K")
    parser.add_argument("--decode-steps", type=int, default=DECODE_STEPS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--time-cap", type=float, default=float("inf"), help="seconds for the whole peer")


class TimeCap:
    """Predicts the next context's wall time from the last one's: its prefill part grows at least
    linearly with the context (attention makes it superlinear, hence the margin), the rest (decode,
    set-up per context) slowly."""

    PREFILL_GROWTH_MARGIN = 1.25
    OTHER_GROWTH = 1.15

    def __init__(self, cap_s, clock=time.monotonic):
        self.cap_s = cap_s
        self.clock = clock
        self.start = clock()
        self.last = None  # (context, prefill part s, other part s)

    def elapsed(self):
        return self.clock() - self.start

    def predicted(self, context):
        if self.last is None:
            return 0.0
        ctx, prefill_part, other_part = self.last
        return prefill_part * context / ctx * self.PREFILL_GROWTH_MARGIN + other_part * self.OTHER_GROWTH

    def allows(self, context):
        return self.elapsed() + self.predicted(context) <= self.cap_s

    def record(self, context, wall_s, prefill_part_s):
        prefill_part_s = min(prefill_part_s, wall_s)
        self.last = (context, prefill_part_s, wall_s - prefill_part_s)


def warm_then_rounds(measure_once):
    """measure_all for a peer that times one run: a warm-up run at the exact shape, then `rounds` runs."""
    def measure_all(context, decode_steps, rounds):
        measure_once(context, decode_steps)
        return [measure_once(context, decode_steps) for _ in range(rounds)]
    return measure_all


def run_sweep(measure_all, contexts, decode_steps, rounds, cap, prefills_per_context=None, log=print):
    """measure_all(context, decode_steps, rounds) -> [(prefill_s, decode_s)] per round, warm-up included.
    prefills_per_context: how many prompt-length prefills that costs (default rounds + 1), for the
    time cap's prediction. Returns rows (context, prefill_s, decode_s, status) for every context."""
    prefills = rounds + 1 if prefills_per_context is None else prefills_per_context
    rows = []
    stopped = False
    for context in contexts:
        if stopped or not cap.allows(context):
            stopped = True
            log(f"ctx {context}: {NOT_RUN} ({cap.elapsed():.0f} s used, ~{cap.predicted(context):.0f} s more needed, cap {cap.cap_s:.0f} s)")
            rows.append((context, None, None, NOT_RUN))
            continue
        t0 = cap.clock()
        try:
            runs = measure_all(context, decode_steps, rounds)
        except Exception as e:  # e.g. out of memory at the longest contexts: say so, skip the longer ones
            log(f"ctx {context}: error: {type(e).__name__}: {e}")
            rows.append((context, None, None, f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            stopped = True
            continue
        prefill_s = statistics.median(r[0] for r in runs)
        decode_s = statistics.median(r[1] for r in runs)
        cap.record(context, cap.clock() - t0, prefills * prefill_s)
        log(f"ctx {context}: prefill {context / prefill_s:,.0f} tok/s ({prefill_s:.3f} s), "
            f"decode {decode_steps / decode_s:.1f} tok/s  [{cap.elapsed():.0f} s used]")
        rows.append((context, prefill_s, decode_s, "ok"))
    return rows


def write_results(out_dir, rows, decode_steps, meta):
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [CSV_HEADER]
    for context, prefill_s, decode_s, status in rows:
        if status == "ok":
            lines.append(f"{context},{prefill_s:.6f},{context / prefill_s:.1f},{decode_steps / decode_s:.2f},ok")
        else:
            lines.append(f"{context},,,,{status.replace(',', ';')}")
    (out_dir / "results.csv").write_text("\n".join(lines) + "\n")
    meta = dict(meta, decode_steps=decode_steps, command=" ".join(sys.argv))
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out_dir / 'results.csv'} and meta.json")
