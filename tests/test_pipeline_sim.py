"""bench/pipeline_sim.py --quick runs the real orchestration against the simulated fleet and emits every column.

No timing is asserted (the figures depend on the machine's load); the latency model of the simulated server is
checked against hand-computed values instead.
"""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import sim_server  # noqa: E402

COLUMNS = ["config", "resource", "avg step (all)", "speedup", "avg step (excl. step 0)", "speedup (excl. step 0)",
           "ideal", "efficiency", "pipeline_buf_size", "partial_ratio", "partial_restored"]
RECORD_KEYS = ["name", "avg_step_s", "avg_step_excl0_s", "speedup", "efficiency", "pipeline_buf_size",
               "partial_ratio", "partial_restored"]


def test_workload_model_matches_the_spec_numbers():
    wl = sim_server.Workload()
    # a TP=4 replica at its 256-request limit: 256 * 95 / (1 + 256 / 96) = 6632.7 tok/s; a TP=2 one half of it
    assert wl.replica_peak_tokens_per_s(4) == pytest.approx(256 * 95 / (1 + 256 / 96))
    assert wl.replica_peak_tokens_per_s(2) == pytest.approx(wl.replica_peak_tokens_per_s(4) / 2)
    assert wl.replica_capacity(2) == (48.0, 128)
    # lengths are deterministic per (prompt, epoch, index), and their mean is ~3500 * exp(0.75^2 / 2) = 4637
    assert wl.response_length("p1", 0, 3) == wl.response_length("p1", 0, 3)
    lengths = [wl.response_length(f"p{g}", 0, i)[0] for g in range(400) for i in range(8)]
    assert 4000 < sum(lengths) / len(lengths) < 5300
    assert min(lengths) >= 16 and max(lengths) <= 20480
    assert math.isclose(sum(wl.response_length(f"p{g}", 0, 0)[1] for g in range(2000)) / 2000, 0.009, abs_tol=0.008)


def test_rid_parsing():
    assert sim_server.parse_rid("ab12cd34-0-17-5-2.") == (0, 5)
    assert sim_server.parse_rid("ab12cd34-3-17-5-0.") == (3, 5)


def test_quick_run_emits_every_column(tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pipeline_sim.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=170, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| config | resource"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    for col in COLUMNS:
        assert col in cells, f"missing column {col!r} in {cells}"
    assert "the orchestration" in proc.stdout and "simulated" in proc.stdout.lower()
    records = json.loads(out.read_text())
    assert {r["name"] for r in records} >= {"colocate", "colocate+partial", "fifo-s1"}
    for r in records:
        assert "error" not in r, r
        for key in RECORD_KEYS:
            assert key in r, f"record {r['name']} lacks {key}"
        assert r["avg_step_s"] > 0 and r["efficiency"] > 0
    fa = next(r for r in records if r["name"] == "fifo-s1")
    assert fa["pipeline_buf_size"] is not None and fa["partial_restored"] is not None
    assert (tmp_path / "sim.png").stat().st_size > 10_000
