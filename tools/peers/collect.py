#!/usr/bin/env python3
"""Merges lily's bench CSV and the peers' results into a markdown section for bench/RESULTS.md and a
PNG of the prefill and decode curves of every engine.

Usage: python3 tools/peers/collect.py --lily bench/runs/DATE-COMMIT.csv PEER_DIR... \
           [--lily-label "lily (Q4, CUDA)"] [--md bench/peers.md] [--png bench/peers.png]
A PEER_DIR holds results.csv and meta.json as run.sh writes them (transformers, mlx, llama, ...).
Directories of the same engine (a second run of the contexts the first skipped) are merged: a measured
row wins over a skipped one.
"""
import argparse
import csv
import json
from pathlib import Path

OK = "ok"


def read_lily(path):
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            rows[int(r["context"])] = {"prefill": float(r["prefill_tok_s"]), "decode": float(r["decode_tok_s"]),
                                       "status": OK}
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return rows


def read_peer(directory):
    results, meta = directory / "results.csv", directory / "meta.json"
    for p in (results, meta):
        if not p.is_file():
            raise SystemExit(f"{p} is missing: is {directory} a peer's output directory?")
    rows = {}
    with open(results) as f:
        for r in csv.DictReader(f):
            ok = r["status"] == OK
            rows[int(r["context"])] = {"prefill": float(r["prefill_tok_s"]) if ok else None,
                                       "decode": float(r["decode_tok_s"]) if ok else None, "status": r["status"]}
    return json.loads(meta.read_text()), rows


def merge_same_engine(peers):
    merged = {}
    for meta, rows in peers:
        if meta["engine"] not in merged:
            merged[meta["engine"]] = (meta, dict(rows))
            continue
        first_meta, first_rows = merged[meta["engine"]]
        for c, r in rows.items():
            if r["status"] == OK or c not in first_rows:
                first_rows[c] = r
        first_meta["command"] = f"{first_meta.get('command')}; {meta.get('command')}"
    return list(merged.values())


def ctx_label(c):
    return f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else str(c)


def fmt(v, digits=0):
    return "—" if v is None else f"{v:,.{digits}f}"


def ratio(a, b):
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}×"


def markdown(lily, lily_label, peers):
    contexts = sorted(set(lily) | {c for _, rows in peers for c in rows})
    out = ["## lily and its peers on the same H200", "",
           "Batch 1, prompt = context, synthetic token ids, one prefill (to the first token) then 64 decode "
           "steps, warm-up at the exact shape, median of 2 rounds; models of the full Qwen3.6-35B-A3B shape with "
           "random weights. Ratios are lily / peer (above 1: lily is faster). Made by tools/peers (README there).", "",
           "| context | engine | prefill tok/s | decode tok/s | lily/peer prefill | lily/peer decode |",
           "|---:|---|---:|---:|---:|---:|"]
    for c in contexts:
        lp = lily.get(c, {})
        out.append(f"| {ctx_label(c)} | {lily_label} | {fmt(lp.get('prefill'))} | {fmt(lp.get('decode'), 1)} | | |")
        for meta, rows in peers:
            r = rows.get(c)
            if r is None:
                continue
            if r["status"] != OK:
                out.append(f"| {ctx_label(c)} | {meta['engine']} | {r['status']} | | | |")
                continue
            out.append(f"| {ctx_label(c)} | {meta['engine']} | {fmt(r['prefill'])} | {fmt(r['decode'], 1)} | "
                       f"{ratio(lp.get('prefill'), r['prefill'])} | {ratio(lp.get('decode'), r['decode'])} |")
    out += ["", "| engine | weights | versions | details | command |", "|---|---|---|---|---|"]
    for meta, _ in peers:
        versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items() if v)
        skip = {"engine", "weights", "versions", "command", "decode_steps"}
        details = "; ".join(f"{k}: {_short(v)}" for k, v in meta.items() if k not in skip and v is not None)
        out.append(f"| {meta['engine']} | {meta.get('weights', '?')} | {versions} | {details} | "
                   f"`{meta.get('command', '?')}` |")
    return "\n".join(out) + "\n"


def _short(v):
    if isinstance(v, dict):
        return ", ".join(f"{k}={_short(x)}" for k, x in v.items())
    if isinstance(v, int) and v > 10**8:
        return f"{v / 1e9:.1f} GB" if v > 10**9 else str(v)
    return str(v).replace("|", "/")


def plot(lily, lily_label, peers, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    series = [(lily_label, lily)] + [(meta["engine"], rows) for meta, rows in peers]
    for ax, key, title in ((axes[0], "prefill", "prefill tok/s"), (axes[1], "decode", "decode tok/s")):
        for label, rows in series:
            pts = sorted((c, r[key]) for c, r in rows.items() if r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(title + " (batch 1, H200)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lily", required=True, type=Path, help="lily bench CSV (lily bench --out)")
    parser.add_argument("--lily-label", default="lily (MLX Q4 g64, CUDA)")
    parser.add_argument("peers", nargs="+", type=Path, help="peer output directories")
    parser.add_argument("--md", type=Path, default=Path("bench/peers.md"))
    parser.add_argument("--png", type=Path, default=Path("bench/peers.png"))
    args = parser.parse_args()
    lily = read_lily(args.lily)
    peers = merge_same_engine([read_peer(d) for d in args.peers])
    args.md.write_text(markdown(lily, args.lily_label, peers))
    plot(lily, args.lily_label, peers, args.png)
    print(f"wrote {args.md} and {args.png}")


if __name__ == "__main__":
    main()
