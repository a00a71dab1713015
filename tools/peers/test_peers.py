#!/usr/bin/env python3
"""Tests of the peers' shared pieces that need no GPU and no ML library: the sweep's time cap, its
output files and collect.py's table. Run: python3 tools/peers/test_peers.py (stdlib only)."""
import json
import random
import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
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

    def test_results_round_trip_through_collect(self):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            rate = random.uniform(100, 1000)
            rows = [(256, 256 / rate, 64 / 20.0, "ok"), (512, None, None, sweep.NOT_RUN)]
            sweep.write_results(d / "peer", rows, 64, {"engine": "fake", "weights": "bf16", "versions": {"x": "1"}})
            meta, got = collect.read_peer(d / "peer")
            self.assertEqual(meta["engine"], "fake")
            self.assertAlmostEqual(got[256]["prefill"], rate, delta=0.1)
            self.assertEqual(got[512]["status"], sweep.NOT_RUN)
            lily_rate = random.uniform(2000, 9000)
            (d / "lily.csv").write_text("context,prefill_s,prefill_tok_s,decode_tok_s,peak_memory_bytes\n"
                                        f"256,0.1,{lily_rate:.1f},300.0,\n512,0.1,{lily_rate:.1f},300.0,\n")
            md = collect.markdown(collect.read_lily(d / "lily.csv"), "lily", [(meta, got)])
            self.assertIn(f"{lily_rate / got[256]['prefill']:.2f}×", md)
            self.assertIn("| 512 | fake | not run (time cap) |", md)
            self.assertIn(json.dumps(meta["command"])[1:-1][:20], md)

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


if __name__ == "__main__":
    unittest.main()
