"""bench/staleness_experiment.py --quick: staleness is imposed exactly, the diagnostics see it, and a rerun resumes."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import staleness_experiment as se  # noqa: E402


def test_quick_sweep_imposes_staleness_and_resumes(tmp_path, capsys):
    out, bases = tmp_path / "r.jsonl", tmp_path / "bases"
    argv = ["--quick", "--out", str(out), "--base-dir", str(bases), "--losses", "naive,decoupled_ppo", "--etas",
            "0,2", "--seeds", "0"]
    se.main(argv)  # in this process: the quick base (a 1-layer model at a ~20% pass rate) and three 4-step runs
    printed = capsys.readouterr().out
    runs = {(r["setup"]["loss"], r["setup"]["eta"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(runs) == [("decoupled_ppo", 2), ("naive", 0), ("naive", 2)]  # eta 0 once, shared
    moved_runs = 0
    for (loss, eta), r in runs.items():
        rows = r["rows"]
        assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
        # step s starts from version s - 1 and samples with s - 1 - eta (half switching to s - 1 - eta + eta / 2)
        for row in rows:
            v = row["step"] - 1
            oldest, newest = max(0, v - eta), max(0, min(v, v - eta + (eta + 1) // 2))
            assert v - newest - 1e-9 <= row["staleness"] <= v - oldest + 1e-9, (loss, eta, row)
            assert 0.0 < row["is_ess"] <= 1.0 + 1e-9 and row["is_log_ratio_m2"] >= 0.0
            # what an analysis needs, every step: KL from the base on the probe set, the pre-clip grad norm of
            # each mini-batch, the loss's own clip / mask fractions, the share of tokens from the newer snapshot
            assert row["kl_to_base"] >= 0.0 and len(row["grad_norms"]) == 2 and row["loss_metrics"]
            assert 0.0 <= row["new_snapshot_token_frac"] <= 1.0
        moved = [row for row in rows if row["grad_norm"] > 0]  # a step whose groups all tie has no gradient
        moved_runs += bool(moved)
        assert not moved or moved[0]["kl_to_base"] > 0.0  # an update moves the policy off the base (exact KL)
        assert [st for st, _ in r["evals_t1"]] == [st for st, _ in r["evals"]]  # greedy and t=1 pass@1, each eval
        if eta == 0:  # on-policy: the trainer's forward reproduces the sampler's log-probs
            assert all(abs(row["is_ess"] - 1) < 1e-5 and row["is_log_ratio_m2"] < 1e-8 for row in rows), rows
            assert all(row["new_snapshot_token_frac"] == 0.0 for row in rows)
        else:
            assert rows[-1]["staleness"] >= 1.0
        assert 0.0 <= r["final_eval"] <= 1.0 and len(r["evals"]) >= 2
    assert moved_runs >= 1, "no run took a step with a gradient: the KL check above never ran"
    assert "| naive | 2 |" in printed  # the summary table
    naive0 = next(ln for ln in printed.splitlines() if ln.startswith("| 0.0001 | naive | 0 |"))
    decoupled0 = next(ln for ln in printed.splitlines() if ln.startswith("| 0.0001 | decoupled_ppo | 0 |"))
    assert naive0.split("|")[4:] == decoupled0.split("|")[4:]  # decoupled_ppo's eta 0 is the shared on-policy run
    assert "| outcome |" in printed  # the pre-registered outcomes table follows
    se.main(argv)
    assert "3 of 3 runs already" in capsys.readouterr().out
    assert len(out.read_text().splitlines()) == 3  # every run was already there: none ran twice


def test_cached_sampler_log_probs_are_the_sampling_snapshots(tmp_path):
    """The KV-cached sampler: every token's log mu equals a full forward of the snapshot that sampled it, also for
    rows that switch snapshot mid-sequence (the second snapshot's cache must read the whole prefix first); a wrong
    cache offset, position or mask moves these by far more than float noise."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from standins import tiny_model

    s = se.Setup(hidden=32, layers=1, max_new=12, min_digits=1, max_digits=5)
    tiny_model.make_tiny_model(str(tmp_path / "m"), s.hidden, s.layers, 0)
    tok = tiny_model.build_tokenizer()
    m0 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).float().eval()
    m1 = copy.deepcopy(m0)
    with torch.no_grad():
        for p in m1.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p, _ in se.prompts(s, "train", 16, 0)]
    row_model = torch.zeros(16, 2, dtype=torch.long)
    row_model[::2, 1] = 1  # half the rows switch to the second snapshot, each at its own cut
    cut = torch.arange(16) % 7 + 2  # 2..8
    out = se.sample([m0, m1], row_model, cut, p_ids, s, tok, gen=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = [se._seq_logprobs(m, out["ids"], out["attn"], out["pos"], out["start"]) for m in (m0, m1)]
    who = out["who"]
    assert bool((who[1::2] <= 0).all())
    for r in range(0, 16, 2):  # a switching row: the first snapshot before its cut, the second from it on
        assert bool((who[r, :cut[r]][who[r, :cut[r]] >= 0] == 0).all()), (r, who[r])
        assert bool((who[r, cut[r]:][who[r, cut[r]:] >= 0] == 1).all()), (r, who[r])
    assert int((who == 1).sum()) > 10  # the switch happened on sampled tokens
    ref = torch.where(who == 1, full[1], full[0])
    sampled = who >= 0
    assert float((out["mu"] - ref)[sampled].abs().max()) < 1e-4
    other = torch.where(who == 1, full[0], full[1])  # the other snapshot's log-probs differ: the check can fail
    assert float((out["mu"] - other)[sampled].abs().max()) > 1e-2


def test_statistics():
    assert se.wilson(0, 8)[0] == 0.0 and 0.3 < se.wilson(0, 8)[1] < 0.4  # 0 of 8: up to ~0.32
    m, lo, hi = se.mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and abs((hi - m) - 4.30 * 1.0 / 3 ** 0.5) < 1e-9
    assert se.equivalent([0.01, -0.01, 0.0, 0.005, -0.005, 0.002, -0.002, 0.0], 0.05)
    assert not se.equivalent([0.1, -0.1, 0.08, -0.09], 0.05)  # too noisy to show equivalence at 0.05
    assert se.reward("12>321", "321", True) == 1.0
    assert se.reward("12>321", "321", False) == 0.0 and se.reward("321", "321", True) == 0.0
    assert se.reward(">3210", "321", True) == 0.0
