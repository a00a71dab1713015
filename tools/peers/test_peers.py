#!/usr/bin/env python3
"""Tests of the peers' shared pieces that need no GPU and no ML library: the sweep's time cap, its
output files, bench_all.py's calls (with a fake lily and fake peers) and collect.py's section of
RESULTS.md. Run: python3 tools/peers/test_peers.py (stdlib only)."""
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import bench_all  # noqa: E402
import collect  # noqa: E402
import sweep  # noqa: E402


class FakeClock:
    def __init__(self):
        self.now = random.uniform(0, 1e6)

    def __call__(self):
        return self.now


def fake_engine(clock, prefill_tok_s, decode_tok_s):
    """measure_all for an engine whose prefill costs context / rate and decode steps / rate."""
    def measure_all(context, steps, rounds):
        runs = []
        for _ in range(rounds + 1):
            p, d = context / prefill_tok_s, steps / decode_tok_s
            clock.now += p + d
            runs.append((p, d))
        return runs[1:]
    return measure_all


class SweepTest(unittest.TestCase):
    def test_parse_contexts(self):
        self.assertEqual(sweep.parse_contexts("4K, 256,1k"), [256, 1024, 4096])
        with self.assertRaises(SystemExit):
            sweep.parse_contexts("4x")

    def test_synthetic_ids_in_vocab(self):
        vocab = random.randint(100, 1000)
        ids = sweep.synthetic_ids(500, vocab)
        self.assertTrue(all(0 <= i < vocab for i in ids))
        self.assertEqual(ids[1], 2654435761 % (1 << 32) % vocab)

    def test_cap_skips_the_longest_contexts_and_is_kept(self):
        clock = FakeClock()
        rate = random.uniform(500, 2000)
        cap = sweep.TimeCap(random.uniform(60, 300), clock=clock)
        rows = sweep.run_sweep(fake_engine(clock, rate, 30.0), sweep.CONTEXTS, 64, 2, cap, log=lambda _: None)
        statuses = [r[3] for r in rows]
        ran = statuses.count("ok")
        self.assertGreater(ran, 0)
        self.assertLess(ran, len(rows), "a cap this small cannot fit 128K")
        self.assertEqual(statuses[ran:], [sweep.NOT_RUN] * (len(rows) - ran), "only the longest are skipped")
        self.assertLessEqual(cap.elapsed(), cap.cap_s)
        for context, prefill_s, decode_s, _ in rows[:ran]:
            self.assertAlmostEqual(context / prefill_s, rate, delta=rate * 1e-9)
            self.assertAlmostEqual(64 / decode_s, 30.0)

    def test_no_cap_runs_everything(self):
        clock = FakeClock()
        rows = sweep.run_sweep(fake_engine(clock, 1e4, 100.0), [256, 512], 64, 2, sweep.TimeCap(float("inf"), clock),
                               log=lambda _: None)
        self.assertEqual([r[3] for r in rows], ["ok", "ok"])

    def test_error_stops_the_sweep_with_a_reason(self):
        def measure_all(context, steps, rounds):
            if context > 512:
                raise MemoryError("out of memory")
            return [(0.01, 0.1)] * rounds
        rows = sweep.run_sweep(measure_all, [256, 512, 1024, 2048], 64, 2, sweep.TimeCap(float("inf")),
                               log=lambda _: None)
        self.assertEqual([r[3] for r in rows][:2], ["ok", "ok"])
        self.assertTrue(rows[2][3].startswith("error: MemoryError"))
        self.assertEqual(rows[3][3], sweep.NOT_RUN)

    def test_merge_keeps_measured_rows(self):
        def run(statuses):
            return ({"engine": "e", "command": "x"},
                    {c: {"prefill": 1.0 if st == "ok" else None, "decode": 1.0 if st == "ok" else None, "status": st}
                     for c, st in statuses.items()})
        first = run({256: "ok", 512: sweep.NOT_RUN})
        second = run({512: "ok"})
        other = ({"engine": "f"}, {})
        merged = collect.merge_same_engine([first, other, second])
        self.assertEqual([m["engine"] for m, _ in merged], ["e", "f"])
        self.assertEqual({c: r["status"] for c, r in merged[0][1].items()}, {256: "ok", 512: "ok"})


def write_lily(run_dir, rates):
    """lily's outputs as bench_all.run_lily leaves them; rates: {context: (prefill, decode)}."""
    (run_dir / "lily").mkdir(parents=True)
    lines = ["context,prefill_s,prefill_tok_s,decode_tok_s,peak_memory_bytes"]
    lines += [f"{c},{c / p:.6f},{p:.1f},{d:.1f},1" for c, (p, d) in rates.items()]
    (run_dir / "lily" / "bench.csv").write_text("\n".join(lines) + "\n")
    (run_dir / "lily" / "meta.json").write_text(json.dumps({"engine": "lily", "weights": "Q4", "command": "lily bench"}))


def write_peer(run_dir, dir_name, engine, rates, not_run=()):
    """A peer's outputs as sweep.write_results leaves them: measured contexts, then skipped ones."""
    rows = [(c, c / p, 64 / d, "ok") for c, (p, d) in rates.items()] + [(c, None, None, sweep.NOT_RUN) for c in not_run]
    sweep.write_results(run_dir / dir_name, rows, 64, {"engine": engine, "weights": "w", "dtypes": f"{engine} types",
                                                       "versions": {engine: "1.0"}})


def random_rates(contexts):
    return {c: (round(random.uniform(1e3, 4e4), 1), round(random.uniform(5, 500), 1)) for c in contexts}


def context_tables(md):
    """{'4K': {engine: [cells]}} from the generated section."""
    tables = {}
    for block in md.split("\n### ")[1:]:
        title, *lines = block.splitlines()
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
        tables[title] = {r[0]: r[1:] for r in rows[1:]}
    return tables


class CollectTest(unittest.TestCase):
    def make_run(self, d):
        """A series where lily has no 128K point, transformers' cap skipped 8K and above, llama's first pass
        skipped 64K and 128K and its second pass measured them, nofla failed and mlx never ran."""
        run_dir = d / "2026-12-01-abc1234"
        contexts = sweep.CONTEXTS
        lily = random_rates(contexts[:-1])
        write_lily(run_dir, lily)
        tf = random_rates(contexts[:5])
        write_peer(run_dir, "transformers", "transformers", tf, contexts[5:])
        llama, llama2 = random_rates(contexts[:8]), random_rates(contexts[8:])
        write_peer(run_dir, "llama", "llama.cpp", llama, contexts[8:])
        write_peer(run_dir, "llama-2", "llama.cpp", llama2)
        state = {"date": "2026-12-01", "commit": "abc1234", "gpu": "NVIDIA H200, driver 580", "build": {},
                 "calls": [{"started": "t1", "found": ["carry-bench/lily"], "ran": ["lily: done"]},
                           {"started": "t2", "found": [], "ran": ["llama (second pass): done"]}],
                 "jobs": {"lily": {"status": "done", "dirs": ["lily"]},
                          "transformers": {"status": "done", "dirs": ["transformers"]},
                          "llama": {"status": "done", "dirs": ["llama", "llama-2"]},
                          "transformers-nofla": {"status": "failed (exit 1)", "dirs": ["transformers-nofla"]}},
                 "not_run": {"mlx": "its inputs were not carried"}}
        (run_dir / "state.json").write_text(json.dumps(state))
        return run_dir, lily, tf, {**llama, **llama2}

    def test_a_table_per_context_with_ratios_and_gaps(self):
        with tempfile.TemporaryDirectory() as d:
            run_dir, lily, tf, llama = self.make_run(Path(d))
            state, engines = collect.read_run(run_dir)
            self.assertEqual([e.label for e in engines],
                             ["lily", "transformers", "llama.cpp", "mlx", "transformers-nofla"])
            md = collect.markdown(run_dir.name, state, engines, "peers.png")
        tables = context_tables(md)
        self.assertEqual(list(tables)[:-2], [collect.ctx_label(c) for c in sweep.CONTEXTS])
        self.assertEqual(list(tables)[-2:], ["Engines", collect.NOT_RUN_HEADING])
        for c in sweep.CONTEXTS:
            t = tables[collect.ctx_label(c)]
            self.assertEqual(t["mlx"][0], "not run: its inputs were not carried")
            self.assertEqual(t["transformers-nofla"][0], "no results: failed (exit 1)")
            # llama.cpp: every context, the last two from the second pass.
            self.assertEqual(t["llama.cpp"][:2], [collect.fmt(llama[c][0]), collect.fmt(llama[c][1], 1)])
            if c in lily:
                self.assertEqual(t["lily"][:2], [collect.fmt(lily[c][0]), collect.fmt(lily[c][1], 1)])
                self.assertEqual(t["llama.cpp"][2:], [f"{lily[c][0] / llama[c][0]:.2f}×", f"{lily[c][1] / llama[c][1]:.2f}×"])
            else:
                self.assertEqual(t["lily"][0], "not measured")
                self.assertEqual(t["llama.cpp"][2:], ["—", "—"])
            if c in tf:
                self.assertEqual(t["transformers"][3], f"{lily[c][1] / tf[c][1]:.2f}×")
            else:
                self.assertEqual(t["transformers"][0], sweep.NOT_RUN)
        engines_table = tables["Engines"]
        self.assertIn("llama.cpp types", engines_table["llama.cpp"][1])
        self.assertIn("llama.cpp 1.0", engines_table["llama.cpp"][2])
        self.assertIn("test_peers.py", engines_table["llama.cpp"][4], "the exact command of each pass")
        self.assertIn("2026-12-01, commit abc1234, NVIDIA H200", md)
        self.assertIn("![prefill and decode tok/s of every engine](peers.png)", md)

    def test_later_series_fill_the_jobs_the_first_did_not_run(self):
        """A second series (a later session) that ran mlx and lily again: mlx comes from it, every other
        engine (lily included) from the first, and the calls of both are listed with their series."""
        with tempfile.TemporaryDirectory() as d:
            first, lily, tf, llama = self.make_run(Path(d))
            second = Path(d) / "2026-12-02-def5678"
            write_lily(second, random_rates(sweep.CONTEXTS))
            mlx = random_rates(sweep.CONTEXTS[:2])
            write_peer(second, "mlx", "mlx-lm", mlx, sweep.CONTEXTS[2:])
            state2 = {"date": "2026-12-02", "commit": "def5678", "gpu": "NVIDIA H200, driver 580", "build": {},
                      "calls": [{"started": "t3", "found": [".peers/mlx-cuda-2"], "ran": ["mlx: done"]}],
                      "jobs": {"lily": {"status": "done", "dirs": ["lily"]},
                               "mlx": {"status": "done", "dirs": ["mlx"]}},
                      "not_run": {"transformers": "skipped (--skip)"}}
            (second / "state.json").write_text(json.dumps(state2))
            state, engines = collect.read_runs([first, second])
            self.assertEqual([e.label for e in engines],
                             ["lily", "transformers", "llama.cpp", "mlx-lm", "transformers-nofla"])
            md = collect.markdown([first.name, second.name], state, engines, "peers.png")
        tables = context_tables(md)
        for c in sweep.CONTEXTS:
            t = tables[collect.ctx_label(c)]
            if c in lily:
                self.assertEqual(t["lily"][:2], [collect.fmt(lily[c][0]), collect.fmt(lily[c][1], 1)])
            if c in mlx and c in lily:
                self.assertEqual(t["mlx-lm"][2:], [f"{lily[c][0] / mlx[c][0]:.2f}×", f"{lily[c][1] / mlx[c][1]:.2f}×"])
            elif c not in mlx:
                self.assertEqual(t["mlx-lm"][0], sweep.NOT_RUN)
            self.assertEqual(t["llama.cpp"][:2], [collect.fmt(llama[c][0]), collect.fmt(llama[c][1], 1)])
        self.assertIn("2026-12-01, commit abc1234", md, "the header is the first series'")
        # The engines that cannot run here, with why and their published numbers (tools/peers/README.md).
        not_run = md.split(f"### {collect.NOT_RUN_HEADING}", 1)[1]
        self.assertIn("| vLLM |", not_run)
        self.assertIn("| SGLang |", not_run)
        self.assertIn("`bench/runs/2026-12-01-abc1234/`, `bench/runs/2026-12-02-def5678/`", md)
        self.assertIn("3. t3 (series 2026-12-02-def5678), found `.peers/mlx-cuda-2`: mlx: done", md)

    def test_section_is_replaced_not_duplicated(self):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            results = d / "RESULTS.md"
            intro = f"# Benchmark results\n\nintro {random.random()}\n\n"
            older = f"## 2026-11-30, by hand\n\n| a | b |\n|---|---|\n| {random.random()} | x |\n"
            results.write_text(intro + older)
            first = collect.BEGIN + f"\n## first {random.random()}\n" + collect.END + "\n"
            collect.write_section(results, first)
            self.assertEqual(results.read_text(), intro + first + "\n" + older)
            second = collect.BEGIN + f"\n## second {random.random()}\n" + collect.END + "\n"
            for _ in range(2):
                collect.write_section(results, second)
                self.assertEqual(results.read_text(), intro + second + "\n" + older)
            results.write_text(intro + collect.BEGIN + "\n" + older)
            with self.assertRaises(SystemExit):
                collect.write_section(results, second)

    def test_run_without_state_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(SystemExit):
                collect.read_run(Path(d))


FAKE_LILY = """#!{python}
import os, random, sys
args = sys.argv[1:]
out, contexts = args[args.index("--out") + 1], args[args.index("--contexts") + 1].split(",")
open(os.environ["FAKE_LOG"], "a").write("lily " + " ".join(args) + "\\n")
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "bench.csv"), "w") as f:
    f.write("context,prefill_s,prefill_tok_s,decode_tok_s,peak_memory_bytes\\n")
    for c in contexts:
        p = random.uniform(1e3, 4e4)
        f.write(f"{{c}},{{int(c) / p:.6f}},{{p:.1f}},{{random.uniform(100, 500):.1f}},1\\n")
"""

# The peers' driver: `setup`, `ready PEER` (exit code from READY_DIR/PEER, 1 when absent) and
# `PEER OUTDIR CAP`, which measures the contexts up to 4K and skips the rest on its first pass.
FAKE_PEER = """import os, random, sys
sys.path.insert(0, {here!r})
import sweep
log = open(os.environ["FAKE_LOG"], "a")
if sys.argv[1] == "setup":
    log.write("setup\\n")
    sys.exit(0)
if sys.argv[1] == "ready":
    path = os.path.join(os.environ["READY_DIR"], sys.argv[2])
    sys.exit(int(open(path).read()) if os.path.exists(path) else 1)
peer, out, cap = sys.argv[1:4]
if os.environ.get("FAKE_FAIL") == peer:
    print(f"{{peer}} broke at {{os.environ['FAKE_FAIL_WHY']}}")
    sys.exit(1)
given = os.environ.get("PEERS_CONTEXTS")
contexts = [int(c) for c in given.split(",")] if given else sweep.CONTEXTS
log.write(f"{{peer}} cap={{cap}} contexts={{given or 'all'}}\\n")
rows = [(c, c / 1e4, 64 / 50.0, "ok") if given or c <= 4096 else (c, None, None, sweep.NOT_RUN) for c in contexts]
from pathlib import Path
sweep.write_results(Path(out), rows, 64, {{"engine": peer, "weights": "w", "versions": {{}}}})
"""


class BenchAllTest(unittest.TestCase):
    """bench_all.py over a fake lily and fake peers: which jobs run in which call, in which order."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = Path(self.tmp.name)
        (self.d / "carry-bench").mkdir()
        self.lily = self.d / "carry-bench" / "lily"
        self.lily.write_text(FAKE_LILY.format(python=sys.executable))
        self.lily.chmod(0o755)
        self.commit = f"{random.getrandbits(28):07x}"
        (self.d / "carry-bench" / "build.json").write_text(json.dumps({"commit": self.commit, "profile": "release"}))
        (self.d / "fake_peer.py").write_text(FAKE_PEER.format(here=str(HERE)))
        (self.d / "ready").mkdir()
        self.log = self.d / "calls.log"

    def tearDown(self):
        self.tmp.cleanup()

    def ready(self, **codes):
        for peer, code in codes.items():
            path = self.d / "ready" / peer.replace("_", "-")
            path.unlink(missing_ok=True) if code is None else path.write_text(str(code))

    def call(self, n, *extra, budget=3000, env=None):
        """One device call; returns (the lines the fakes logged in it, its archive's folder, its state)."""
        self.log.write_text("")
        out = self.d / f"out{n}"
        env = dict(os.environ, FAKE_LOG=str(self.log), READY_DIR=str(self.d / "ready"), **(env or {}))
        # Through the wrapper, as on the GPU machine (it runs from the repo root: absolute paths here).
        subprocess.run(["bash", str(ROOT / "scripts" / "bench-all.sh"), "run", "--lily", str(self.lily),
                        "--peer-cmd", f"{sys.executable} {self.d / 'fake_peer.py'}", "--state", str(self.d / "state"),
                        "--out", str(out), "--budget", str(budget), *extra],
                       env=env, check=True, capture_output=True, text=True)
        with tarfile.open(out / "bench-all.tar") as tar:
            tar.extractall(self.d / f"unpacked{n}", filter="data")
        (run_dir,) = (self.d / f"unpacked{n}").iterdir()
        self.assertIn(self.commit, run_dir.name)
        self.assertTrue((out / "summary.txt").read_text().strip())
        return self.log.read_text().splitlines(), run_dir, json.loads((run_dir / "state.json").read_text())

    def test_calls_run_what_is_ready_and_resume(self):
        # Call 1: lily, then set-up, then the ready peers, then llama which waits for its build; mlx's
        # inputs are missing; transformers' second pass takes the contexts its cap skipped.
        self.ready(transformers=0, transformers_nofla=0, llama=3)
        ran, _, state = self.call(1)
        self.assertTrue(ran[0].startswith("lily bench --synthetic qwen3.6-35b-a3b --quant q4 --device cuda"))
        self.assertEqual([r.split(" contexts")[0].split(" cap")[0] for r in ran[1:]],
                         ["setup", "transformers", "transformers-nofla", "llama", "transformers", "transformers-nofla"])
        self.assertTrue(ran[5].endswith("contexts=8192,16384,32768,65536,131072"))
        self.assertEqual(state["not_run"], {"mlx": "its inputs were not carried"})
        self.assertEqual(state["jobs"]["transformers"]["dirs"], ["transformers", "transformers-2"])
        self.assertEqual(state["jobs"]["llama"]["skipped"], [8192, 16384, 32768, 65536, 131072])
        # Call 2: lily is not carried again and not rerun; mlx has arrived, llama's build is done.
        self.lily.unlink()
        self.ready(mlx=0, llama=0)
        ran, run_dir, state = self.call(2)
        self.assertEqual([r.split(" ")[0] for r in ran], ["setup", "mlx", "llama", "mlx"])
        self.assertEqual(len(state["calls"]), 2)
        self.assertEqual(state["not_run"], {})
        self.assertTrue(all(not job.get("retry") for job in state["jobs"].values()))
        # The last archive holds everything: every engine has every context.
        _, engines = collect.read_run(run_dir)
        for e in engines:
            self.assertIsNone(e.missing, e.label)
            self.assertEqual(sorted(c for c, r in e.rows.items() if r["status"] == "ok"), sweep.CONTEXTS, e.label)
        # Call 3: nothing left to do.
        ran, _, _ = self.call(3)
        self.assertEqual(ran, ["setup"])

    def test_budget_and_skip(self):
        self.ready(transformers=0, transformers_nofla=0, llama=0, mlx=0)
        budget = random.randint(125, 145)  # below lily's and llama's minimum, above the transformers'
        ran, _, state = self.call(1, "--skip", "mlx", budget=budget)
        self.assertEqual(ran[0], "setup")
        runs = [r.split(" contexts")[0].split(" cap=") for r in ran[1:]]
        self.assertEqual([peer for peer, _ in runs], ["transformers", "transformers-nofla"] * 2)
        for _, cap in runs:
            self.assertTrue(120 <= int(cap) <= budget, cap)
        self.assertEqual(state["not_run"], {"lily": "too little time left in the call", "mlx": "skipped (--skip)",
                                            "llama": "too little time left in the call"})

    def test_next_job(self):
        skipped = random.sample(sweep.CONTEXTS, 3)
        state = {"jobs": {"lily": {"status": "done"}, "transformers": {"retry": True, "skipped": skipped}}}
        readiness = {"llama": bench_all.WAITS, "transformers-nofla": bench_all.READY, "mlx": bench_all.MISSING,
                     "transformers": bench_all.READY}.get
        jobs = bench_all.JOBS
        self.assertEqual(bench_all.next_job(jobs, state, readiness, 200), ("transformers-nofla", None, 170))
        self.assertEqual(bench_all.next_job(jobs, state, readiness, 130), ("transformers-nofla", None, 130))
        state["jobs"]["transformers-nofla"] = {"status": "done"}
        self.assertEqual(bench_all.next_job(jobs, state, readiness, 200), ("llama", None, 200))
        self.assertEqual(bench_all.next_job(jobs, state, readiness, 140), ("transformers", skipped, 140))
        self.assertIsNone(bench_all.next_job(jobs, state, readiness, 100))

    def test_a_failed_peer_is_reported_and_not_retried(self):
        self.ready(transformers=0, llama=0)
        why = f"context {random.choice(sweep.CONTEXTS)}"
        ran, run_dir, state = self.call(1, "--skip", "lily", env={"FAKE_FAIL": "llama", "FAKE_FAIL_WHY": why})
        self.assertEqual(state["jobs"]["llama"]["status"], "failed (exit 1)")
        self.assertIn(f"llama broke at {why}", (self.d / "out1" / "summary.txt").read_text())
        ran, _, _ = self.call(2, "--skip", "lily")
        self.assertEqual(ran, ["setup"], "neither pass of a failed job runs again")
        _, engines = collect.read_run(run_dir)
        self.assertEqual({e.label: e.missing for e in engines if e.label in ("llama", "lily")},
                         {"llama": "no results: failed (exit 1)", "lily": "not run: skipped (--skip)"})

    def test_a_new_lily_build_starts_a_new_series(self):
        self.ready()
        _, first, _ = self.call(1)
        (self.d / "carry-bench" / "build.json").write_text(json.dumps({"commit": self.commit, "built": "later"}))
        ran, second, state = self.call(2)
        self.assertNotEqual(first.name, second.name)
        self.assertTrue(ran[0].startswith("lily "))
        self.assertEqual(len(state["calls"]), 1)


class RunShTest(unittest.TestCase):
    """run.sh's `ready` verb on a state folder as its set-up leaves it."""

    def ready(self, state, peer):
        return subprocess.run(["bash", str(HERE / "run.sh"), "ready", peer], env=dict(os.environ, PEERS_STATE=str(state)),
                              capture_output=True, text=True).returncode

    def test_ready(self):
        with tempfile.TemporaryDirectory() as state:
            state = Path(state)
            self.assertEqual([self.ready(state, p) for p in ("transformers", "transformers-nofla", "mlx", "llama")],
                             [1, 0, 1, 1])
            for d in ("site-fla", "site-mlx", "llama.cpp"):
                (state / d).mkdir()
            self.assertEqual([self.ready(state, p) for p in ("transformers", "mlx", "llama")], [0, 0, 3])
            (state / "model.gguf").write_text("")
            self.assertEqual(self.ready(state, "llama"), 0)
            (state / "llama-build.log").write_text("BUILD FAILED\n")
            self.assertEqual(self.ready(state, "llama"), 1)
            self.assertEqual(self.ready(state, "vllm"), 2)

    def test_shell_scripts_parse(self):
        for script in [*HERE.glob("*.sh"), ROOT / "scripts" / "bench-all.sh"]:
            rc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            self.assertEqual(rc.returncode, 0, f"{script}: {rc.stderr}")


if __name__ == "__main__":
    unittest.main()
