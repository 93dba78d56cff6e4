"""bench/staleness_experiment.py --quick: staleness is imposed exactly, the diagnostics see it, and a rerun resumes."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import staleness_experiment as se  # noqa: E402


def test_quick_sweep_imposes_staleness_and_resumes(tmp_path, capsys):
    out, bases = tmp_path / "r.jsonl", tmp_path / "bases"
    argv = ["--quick", "--out", str(out), "--base-dir", str(bases), "--losses", "naive,recompute", "--etas", "0,2",
            "--seeds", "0"]
    se.main(argv)  # in this process: the quick base (a 1-layer model at a ~20% pass rate) and four 4-step runs
    printed = capsys.readouterr().out
    runs = {(r["setup"]["loss"], r["setup"]["eta"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(runs) == [("naive", 0), ("naive", 2), ("recompute", 0), ("recompute", 2)]
    for (loss, eta), r in runs.items():
        rows = r["rows"]
        assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
        # step s starts from version s - 1 and samples with s - 1 - eta (half switching to s - 1 - eta + eta / 2)
        for row in rows:
            v = row["step"] - 1
            oldest, newest = max(0, v - eta), max(0, min(v, v - eta + (eta + 1) // 2))
            assert v - newest - 1e-9 <= row["staleness"] <= v - oldest + 1e-9, (loss, eta, row)
            assert 0.0 < row["is_ess"] <= 1.0 + 1e-9 and row["is_log_ratio_m2"] >= 0.0
        if eta == 0:  # on-policy: the trainer's forward reproduces the sampler's log-probs
            assert all(abs(row["is_ess"] - 1) < 1e-5 and row["is_log_ratio_m2"] < 1e-8 for row in rows), rows
        else:
            assert rows[-1]["staleness"] >= 1.0
        assert 0.0 <= r["final_eval"] <= 1.0 and len(r["evals"]) >= 2
    assert "| naive | 2 |" in printed  # the summary table
    se.main(argv)
    assert "4 of 4 runs already" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 4  # every run was already there: none ran twice


def test_statistics():
    assert se.wilson(0, 8)[0] == 0.0 and 0.3 < se.wilson(0, 8)[1] < 0.4  # 0 of 8: up to ~0.32
    m, lo, hi = se.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and abs((hi - m) - 4.30 * 1.0 / 3 ** 0.5) < 1e-9
    assert se.equivalent([0.01, -0.01, 0.0, 0.005, -0.005, 0.002, -0.002, 0.0], 0.05)
    assert not se.equivalent([0.1, -0.1, 0.08, -0.09], 0.05)  # too noisy to show equivalence at 0.05
    assert se.reward("12>321", "321", True) == 1.0
    assert se.reward("12>321", "321", False) == 0.0 and se.reward("321", "321", True) == 0.0
    assert se.reward(">3210", "321", True) == 0.0
