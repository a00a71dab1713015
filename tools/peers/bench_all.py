#!/usr/bin/env python3
"""lily and its peers back to back on the GPU machine, over as few device calls as their inputs allow
(`scripts/bench-all.sh run` calls this; tools/peers/README.md gives the call sequence).

Each call runs, in JOBS order, every job that is not done yet and can run now: lily's sweep when its
binary was carried, then each peer that `run.sh ready PEER` says is ready (a peer still waiting for the
llama.cpp build comes after the ready ones). A job starts only if the call's time budget still holds its
minimum; it gets its cap or what is left of the budget, whichever is less, and is killed a minute after
that at the latest, so the call ends in time. Once every job has had its turn, jobs whose time cap
skipped contexts run again on those contexts with the time left (OUTDIR JOB-2, JOB-3, ...).

State lives in STATE (default /tmp/bench-all; it lasts while the machine stays warm between calls):
STATE/DATE-COMMIT/ holds state.json, output.log (what the peers' commands print) and one folder per job
run. Each call ends by packing that folder, whole, into OUT/bench-all.tar (so the last call's archive
holds everything) and its own log into OUT/summary.txt.
"""
import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep  # noqa: E402

# (job, cap s, minimum s to start it): the caps are what each needed on the H200 for most of its sweep
# (README); the minimum is what its set-up and first context take (mlx-lm: 233 s for the first one).
JOBS = [("lily", 360, 360), ("transformers", 280, 120), ("llama", 400, 150), ("mlx", 270, 240),
        ("transformers-nofla", 170, 120)]
# A job may run this long past its cap (a cap is checked between contexts) before it is killed.
GRACE_S = 60
LILY_WEIGHTS = "MLX affine Q4 g64 (router, shared-expert gate Q8), random, generated on the GPU"
LILY_DTYPES = "Q4 g64 weights with bf16 scales; bf16 activations and KV cache; fp32 GDN state"

READY, WAITS, MISSING = "ready", "waits for its build", "inputs missing"


def lily_command(lily, out_dir):
    """The same sweep as scripts/gpu-check.sh's bench, over the peers' contexts."""
    return [str(lily), "bench", "--synthetic", "qwen3.6-35b-a3b", "--quant", "q4", "--device", "cuda",
            "--contexts", ",".join(map(str, sweep.CONTEXTS)), "--decode-steps", str(sweep.DECODE_STEPS),
            "--rounds", str(sweep.ROUNDS), "--out", str(out_dir)]


def next_job(jobs, state, readiness, remaining_s):
    """The job to run next, as (name, contexts or None for all, cap s), or None. `readiness(name)` says
    READY, WAITS or MISSING. First passes come first (a ready one before one that waits for its build),
    then second passes over the contexts a time cap skipped."""
    first = [(name, cap, min_s) for name, cap, min_s in jobs if name not in state["jobs"]]
    for wanted in (READY, WAITS):
        for name, cap, min_s in first:
            if min_s <= remaining_s and readiness(name) == wanted:
                return name, None, min(cap, remaining_s)
    for name, cap, min_s in jobs:
        job = state["jobs"].get(name, {})
        if job.get("retry") and min_s <= remaining_s and readiness(name) == READY:
            return name, job["skipped"], min(cap, remaining_s)
    return None


def read_sweep(out_dir):
    """(contexts the time cap skipped, whether a context failed) from a peer's results.csv."""
    rows = [line.split(",") for line in (out_dir / "results.csv").read_text().splitlines()[1:] if line]
    skipped = [int(r[0]) for r in rows if r[4] == sweep.NOT_RUN]
    return skipped, any(r[4].startswith("error") for r in rows)


class Call:
    """One device call: its time budget, its log, and the commands it runs."""

    def __init__(self, budget_s):
        self.budget_s = budget_s
        self.start = time.monotonic()
        self.log_lines = []

    def log(self, msg):
        line = f"[bench-all {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_lines.append(line)

    def remaining(self):
        return int(self.budget_s - (time.monotonic() - self.start))

    def execute(self, cmd, cap_s, log_path, env=None):
        """Runs cmd (in its own process group, so that a kill reaches its children) with its output in
        log_path; kills it GRACE_S after cap_s. Returns (exit code or 'killed', seconds)."""
        self.log("$ " + shlex.join(cmd))
        t0 = time.monotonic()
        with open(log_path, "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ, **(env or {})))
            try:
                rc = proc.wait(timeout=cap_s + GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "killed"
        return rc, round(time.monotonic() - t0)


def load_state(state_dir, build, fresh):
    """The series of calls this one continues (the newest in state_dir), or a new one: with `fresh`, when
    there is none, or when the carried lily binary is another build than the series'."""
    series = sorted(state_dir.glob("*/state.json"), key=lambda p: p.stat().st_mtime) if state_dir.is_dir() else []
    if series and not fresh:
        state = json.loads(series[-1].read_text())
        if not build or build == state["build"]:
            return series[-1].parent, state
    state = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": build.get("commit", "unknown"),
             "gpu": gpu_name(), "build": build, "calls": [], "jobs": {}, "not_run": {}}
    name = f"{state['date']}-{state['commit']}"
    n = 1
    while (state_dir / name).exists():
        n += 1
        name = f"{state['date']}-{state['commit']}-{n}"
    (state_dir / name).mkdir(parents=True)
    return state_dir / name, state


def gpu_name():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown GPU"
    if not out:
        return "unknown GPU"
    name, _, driver = out[0].partition(", ")
    return f"{name}, driver {driver}" if driver else name


def run_lily(call, lily, run_dir, build, cap):
    out_dir = run_dir / "lily"
    out_dir.mkdir(exist_ok=True)
    cmd = lily_command(lily, out_dir)
    rc, seconds = call.execute(cmd, cap, out_dir / "log.txt")
    meta = {"engine": "lily", "weights": LILY_WEIGHTS, "dtypes": LILY_DTYPES,
            "versions": {"lily": build.get("commit", "unknown"), "rustc": build.get("rustc"),
                         "nvcc": build.get("nvcc")},
            "profile": build.get("profile"), "command": shlex.join(cmd[:-1] + ["DIR"])}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    done = rc == 0 and (out_dir / "bench.csv").is_file()
    return {"status": "done" if done else f"failed (exit {rc})", "seconds": seconds, "dirs": ["lily"]}


def run_peer(call, peer_cmd, run_dir, job, name, contexts, cap):
    """One pass of a peer: all contexts (job is None) or, for the second pass, those its cap skipped."""
    job = job or {"dirs": [], "seconds": 0, "skipped": []}
    dir_name = name if not job["dirs"] else f"{name}-{len(job['dirs']) + 1}"
    out_dir = run_dir / dir_name
    out_dir.mkdir(exist_ok=True)
    env = {"PEERS_CONTEXTS": ",".join(map(str, contexts))} if contexts else {}
    rc, seconds = call.execute(peer_cmd + [name, str(out_dir), str(cap)], cap, run_dir / "output.log", env)
    done = rc == 0 and (out_dir / "results.csv").is_file()
    skipped, error = read_sweep(out_dir) if done else (job["skipped"], True)
    # Another pass only for contexts a cap skipped, not after an error (out of memory, say) and not
    # when this pass measured none of them.
    retry = done and not error and bool(skipped) and skipped != contexts
    return {"status": "done" if done else f"failed (exit {rc})", "seconds": job["seconds"] + seconds,
            "dirs": job["dirs"] + [dir_name], "skipped": skipped, "retry": retry}


def run(args):
    call = Call(args.budget)
    build_path = args.lily.parent / "build.json"
    build = json.loads(build_path.read_text()) if build_path.is_file() else {}
    run_dir, state = load_state(args.state, build, args.fresh)
    found = [p for p in (str(args.lily), ".peers/carry", ".peers/mlx-cuda-1", ".peers/mlx-cuda-2") if Path(p).exists()]
    this_call = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "found": found, "ran": [],
                 "command": shlex.join(["bench_all.py"] + sys.argv[1:])}
    state["calls"].append(this_call)
    call.log(f"call {len(state['calls'])} of {run_dir.name}; budget {args.budget} s; "
             f"found {', '.join(found) or 'nothing carried'}")
    jobs = [j for j in JOBS if j[0] not in args.skip]

    def readiness(name):
        if name == "lily":
            return READY if os.access(args.lily, os.X_OK) else MISSING
        rc = subprocess.run(args.peer_cmd + ["ready", name], capture_output=True, text=True).returncode
        return {0: READY, 3: WAITS}.get(rc, MISSING)

    def save():
        (run_dir / "state.json").write_text(json.dumps(state, indent=2) + "\n")

    def run_job(job):
        name, contexts, cap = job
        call.log(f"{name}: cap {cap} s" + (f", second pass over {contexts}" if contexts else ""))
        if name == "lily":
            state["jobs"]["lily"] = run_lily(call, args.lily, run_dir, state["build"], cap)
        else:
            state["jobs"][name] = run_peer(call, args.peer_cmd, run_dir, state["jobs"].get(name), name, contexts, cap)
        result = state["jobs"][name]
        skipped = f", its cap skipped {result['skipped']}" if result.get("skipped") else ""
        call.log(f"{name}: {result['status']} in {result['seconds']} s{skipped}")
        if result["status"] != "done":  # the end of its log, for the call's output
            log = run_dir / result["dirs"][-1] / "log.txt"
            for line in (log if log.is_file() else run_dir / "output.log").read_text().splitlines()[-8:]:
                call.log(f"  | {line}")
        this_call["ran"].append(f"{name}{' (second pass)' if contexts else ''}: {result['status']}")
        save()

    # lily first, before the peers' set-up: the llama.cpp build that it starts would share the CPU.
    lily = next_job([j for j in jobs if j[0] == "lily"], state, readiness, call.remaining())
    if lily:
        run_job(lily)
    rc, _ = call.execute(args.peer_cmd + ["setup"], max(call.remaining(), 1), run_dir / "output.log")
    call.log(f"peers' set-up: exit {rc}")
    peers = [j for j in jobs if j[0] != "lily"]
    while job := next_job(peers, state, readiness, call.remaining()):
        run_job(job)
    state["not_run"] = {}
    for name in [j[0] for j in JOBS if j[0] not in state["jobs"]]:
        why = "skipped (--skip)" if name in args.skip else {
            READY: "too little time left in the call", WAITS: "too little time left; its build was still running",
            MISSING: "its inputs were not carried"}[readiness(name)]
        state["not_run"][name] = why
        call.log(f"{name}: not run yet: {why}")
    save()
    args.out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.out / "bench-all.tar", "w") as tar:
        tar.add(run_dir, arcname=run_dir.name)
    call.log(f"wrote {args.out / 'bench-all.tar'} ({run_dir.name}/); {call.remaining()} s of the budget left")
    (args.out / "summary.txt").write_text("\n".join(call.log_lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lily", type=Path, default=Path("carry-bench/lily"), help="lily binary (build.json beside it)")
    parser.add_argument("--peer-cmd", type=shlex.split, default=["bash", "tools/peers/run.sh"],
                        help="the peers' driver: CMD setup | CMD ready PEER | CMD PEER OUTDIR CAP")
    parser.add_argument("--state", type=Path, default=Path("/tmp/bench-all"))
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="default: $OUT")
    parser.add_argument("--budget", type=int, default=500, help="seconds this call may spend (run it with timeout_s 600)")
    parser.add_argument("--skip", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help="jobs not to run, e.g. transformers-nofla,mlx")
    parser.add_argument("--fresh", action="store_true", help="start a new series even if STATE holds one")
    args = parser.parse_args()
    if args.out is None:
        raise SystemExit("give --out DIR or set OUT (the device machine sets it)")
    unknown = set(args.skip) - {name for name, _, _ in JOBS}
    if unknown:
        raise SystemExit(f"--skip: unknown jobs {sorted(unknown)}; jobs: {', '.join(j[0] for j in JOBS)}")
    run(args)


if __name__ == "__main__":
    main()
