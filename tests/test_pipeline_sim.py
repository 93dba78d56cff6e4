"""bench/pipeline_sim.py --quick runs the real orchestration against the simulated fleet and emits every column.

No timing is asserted (the figures depend on the machine's load); the latency model of the simulated server is
checked against hand-computed values instead.
"""
import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import requests

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


def test_workload_yaml_overrides_and_rejects_unknown_keys(tmp_path):
    path = tmp_path / "wl.yaml"
    path.write_text("v0: 120.0\nmax_running: 128\n")
    wl = sim_server.load_workload(str(path))
    assert (wl.v0, wl.max_running, wl.c_half) == (120.0, 128, 96.0)
    path.write_text("v_zero: 1\n")
    with pytest.raises(ValueError, match="v_zero"):
        sim_server.load_workload(str(path))


def test_rid_parsing():
    assert sim_server.parse_rid("ab12cd34-0-17-5-2.") == (0, 5)
    assert sim_server.parse_rid("ab12cd34-3-17-5-0.") == (3, 5)


@pytest.fixture
def sim_fleet():
    """One simulated TP=4 replica at 1000x (a 20K-token response alone takes 0.2 s of wall time)."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "sim_server.py"), "--replica-gpus", "4",
                             "--compression", "1000", "--token-scale", "32"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    yield json.loads(line.split(" ", 1)[1])["urls"][0]
    proc.kill()
    proc.wait(10)


def _generate(url, rid, max_new=640, prompt=(10, 11, 12, 13, 14, 15), extra=()):
    body = {"input_ids": list(prompt) + list(extra), "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0}}
    return requests.post(url + "/generate", json=body, timeout=60).json()


def test_sim_server_lengths_abort_and_versions(sim_fleet):
    wl = sim_server.Workload()
    key = ",".join(map(str, (10, 11, 12, 13, 14, 15)))  # 200 prompt tokens / 32 = 6 served tokens of prompt
    length, clamped = wl.response_length(key, 0, 2)
    out = _generate(sim_fleet, "t-0-5-2-0.")
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == round(length / 32)
    assert meta["finish_reason"]["type"] == ("length" if clamped else "stop")
    assert [lp[1] for lp in meta["output_token_logprobs"]] == out["output_ids"]
    # alone, a request decodes at v0 = 95 tokens/s of simulated time (wall jitter only adds)
    assert meta["e2e_latency"] >= 0.95 * round(length / 32) * 32 / 95
    # a continuation (prompt + partial response) finishes the same target: only the rest is generated
    rest = _generate(sim_fleet, "t-0-5-2-1.", extra=out["output_ids"][:3])["meta_info"]["completion_tokens"]
    assert rest == round(length / 32) - 3
    # a batch (0.5.23's list form: unique rids, per-item sampling_params) is one list in input order, each item
    # as it would be alone
    batch = requests.post(sim_fleet + "/generate", json={
        "input_ids": [[10, 11, 12, 13, 14, 15]] * 2, "rid": ["t-0-5-2-2.", "t-0-5-3-0."], "return_logprob": True,
        "sampling_params": [{"max_new_tokens": 640}, {"max_new_tokens": 2}]}, timeout=60).json()
    assert [o["meta_info"]["id"] for o in batch] == ["t-0-5-2-2.", "t-0-5-3-0."]
    assert batch[0]["meta_info"]["completion_tokens"] == round(length / 32)
    assert batch[1]["meta_info"]["completion_tokens"] == min(2, max(1, round(wl.response_length(key, 0, 3)[0] / 32)))

    # abort by rid prefix returns the partial output with finish_reason abort (20480 tokens: 0.2 s alone)
    long = next(p for p in ((20, 21, 22, 23, i, j) for i in range(10, 100) for j in range(10, 100))
                if wl.response_length(",".join(map(str, p)), 0, 7)[1])
    res = {}
    th = threading.Thread(target=lambda: res.update(_generate(sim_fleet, "t-0-9-7-0.", max_new=640, prompt=long)))
    th.start()
    time.sleep(0.05)
    requests.post(sim_fleet + "/abort_request", json={"rid": "t-0-9-"}, timeout=10)
    th.join(10)
    assert res["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < res["meta_info"]["completion_tokens"] < 640

    # in-place pause, new weights, continue: the response carries both versions as spans
    th = threading.Thread(target=lambda: res.update(_generate(sim_fleet, "t-0-9-7-1.", max_new=640, prompt=long)))
    th.start()
    time.sleep(0.03)
    requests.post(sim_fleet + "/pause_generation", json={"mode": "in_place"}, timeout=10)
    update = {"model_path": "x", "weight_version": "4"}
    r = requests.post(sim_fleet + "/update_weights_from_disk", json=update, timeout=10)
    assert r.status_code == 400 and r.json()["success"] is False  # the default flush is refused: requests kept
    r = requests.post(sim_fleet + "/update_weights_from_disk", json={**update, "flush_cache": False}, timeout=10)
    assert r.json()["success"] is True
    requests.post(sim_fleet + "/continue_generation", json={}, timeout=10)
    th.join(10)
    spans = res["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "4"] and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[-1]["end"] == res["meta_info"]["completion_tokens"] and res["meta_info"]["weight_version"] == "4"
    assert res["meta_info"]["num_retractions"] == 0

    # retract: the request waits (a flush is allowed then), continues after /continue_generation to its target
    th = threading.Thread(target=lambda: res.update(_generate(sim_fleet, "t-0-9-7-2.", max_new=640, prompt=long)))
    th.start()
    time.sleep(0.03)
    requests.post(sim_fleet + "/pause_generation", json={"mode": "retract"}, timeout=10)
    load = requests.get(sim_fleet + "/v1/loads", timeout=10).json()["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
    assert requests.post(sim_fleet + "/flush_cache", timeout=10).status_code == 200
    requests.post(sim_fleet + "/continue_generation", json={}, timeout=10)
    th.join(10)
    assert res["meta_info"]["num_retractions"] == 1 and res["meta_info"]["completion_tokens"] == 640
    assert requests.get(sim_fleet + "/server_info", timeout=10).json()["max_running_requests"] == 256


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
    kept = next(r for r in records if r["name"] == "fifo-s2-10:6-inplace")  # nothing aborted, restored, re-sent
    assert kept["partial_kept"] > 0 and kept["partial_restored"] is None
    assert (tmp_path / "sim.png").stat().st_size > 10_000


def test_policies_run_each_preset_through_the_step_loop_and_account_for_every_prompt(tmp_path):
    """--policies --quick: each preset of strategies.py drives the real buffer, rollout and train.run_steps for 3
    steps; every dispatched prompt is trained exactly once, counted as dropped, or pending at the end."""
    out = tmp_path / "policies.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pipeline_sim.py"), "--policies", "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=170, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| policy (parameter for one step of staleness) |" in proc.stdout
    records = {r["name"].split("-8:8")[0]: r for r in json.loads(out.read_text())}
    assert set(records) == {"areal", "verl", "pipelinerl", "prime-rl", "roll", "slime-async"}
    for name, r in records.items():
        a = r["accounting"]
        assert a["trained"] == 3 * 16 and a["trained_twice"] == 0 and a["pending_and_trained"] == 0, (name, a)
        assert a["trained"] + a["dropped"] + a["pending"] == a["dispatched"], (name, a)
    for name in ("prime-rl", "roll"):  # their consumption filter is a hard bound: nothing older than one step
        assert records[name]["staleness_max"] <= 1, records[name]["staleness"]
    assert records["pipelinerl"]["discarded_tokens_per_step"] == 0  # in place: nothing aborted or re-sent
    assert records["slime-async"]["discarded_tokens_per_step"] == 0  # aborted groups resume from their partial tokens


def test_policies_bench_plans_a_valid_run_per_preset_and_staleness_level():
    """bench/policies.py: every planned run's overrides pass config.validate on configs/tiny.yaml, with the
    capacity its staleness level asks for (runs take minutes each, so the bench itself is not run here)."""
    import config
    import policies
    import strategies

    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    plan = dict(policies.preset_plan([1, 2, 4], None, 32, 16))
    assert set(plan) == {"windowed-fifo-s1", "prime-rl-s1"} | {f"{n}-s{k}" for n in
                                                               ("areal", "verl", "pipelinerl", "roll", "slime-async")
                                                               for k in (1, 2, 4)}
    for name, overrides in plan.items():
        cfg = config.load_config(tiny, overrides)
        k = int(name.rsplit("-s", 1)[1])
        if name.startswith(("areal", "verl", "pipelinerl")):
            assert cfg.capacity == 32 * (1 + k), name  # k steps of staleness: (1 + k) B groups
        if name.startswith("slime-async"):
            assert cfg.capacity == 2 * 32 * k, name  # C = k B generating + k B queued
        if name != "windowed-fifo-s1":  # each preset with its peer's loss and mask, not tiny.yaml's
            preset = name.rsplit("-s", 1)[0]
            assert strategies.pairing_note(preset, cfg.algorithm.policy_loss,
                                           cfg.rollout.mask_offpolicy_in_partial_rollout) is None, name


def test_table3_plan_runs_areal_with_decoupled_ppo_and_naive_ppo_with_generation_forced_ahead():
    """bench/policies.py --table3: eta 0 / 1 / 4 with AReaL's loss (no pairing note), eta 4 with naive PPO (the ratio
    against the rollout's log-probs, no IS: the start-up pairing note says so), the filter off, per seed."""
    import config
    import policies
    import strategies

    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    plan = dict(policies.table3_plan([0, 1, 4], 2, None))
    assert set(plan) == {f"areal-eta{e}-s{s}" for e in (0, 1, 4) for s in (0, 1)} | {"areal-eta4-naive-s0",
                                                                                     "areal-eta4-naive-s1"}
    for name, overrides in plan.items():
        cfg = config.load_config(tiny, overrides)
        eta = int(name.split("-eta")[1].split("-")[0])
        assert cfg.fully_async.sliding_window == "areal" and cfg.capacity == 32 * (1 + eta), name
        assert cfg.rollout.filter == ["failed"] and cfg.seed == int(name[-1]) == cfg.data_source[0].seed, name
        note = strategies.pairing_note("areal", cfg.algorithm.policy_loss, cfg.rollout.mask_offpolicy_in_partial_rollout)
        if "naive" in name:
            assert cfg.trainer.use_rollout_log_probs and not cfg.algorithm.is_correction.enable, name
            assert cfg.algorithm.policy_loss == "ppo" and "decoupled_ppo" in note, name
        else:
            assert cfg.algorithm.policy_loss == "decoupled_ppo" and note is None, name


def test_sweep_grid_is_valid_and_scores_every_rule_against_one_ideal_per_split():
    """--sweep: every rule at every knob level plus the peers' defaults, each a valid config whose capacity grows
    with the level; one ideal per split (not per row); --batch-scale keeps the step time and the split's ratio."""
    import pipeline_sim
    import strategies

    wl = pipeline_sim.scaled_workload(sim_server.Workload(), 4)
    B, N = wl.num_prompts_per_step, wl.num_trajectories_per_prompt
    setups = pipeline_sim.sweep_grid(B, N, [1, 2, 4])
    rules = (*pipeline_sim.SPEC_RULES, *strategies.PRESETS)
    assert {(s.rule, s.level, s.resource) for s in setups if s.level is not None} == {
        (r, k, split) for r in rules for k in (1, 2, 4) for split in ("8:8", "10:6")}
    assert {(s.rule, s.param) for s in setups if s.level is None} == {("areal", 0.0), ("prime-rl", 8.0)}
    caps: dict = {}
    for s in setups:
        cfg = pipeline_sim.make_cfg(s, wl, ["http://127.0.0.1:1"], 3, 32, "/tmp/unused", 64)
        if s.level is not None and s.resource == "8:8":
            caps.setdefault(s.rule, []).append(cfg.capacity)
    for rule, c in caps.items():
        if rule != "prime-rl":  # prime-rl's lead is fixed; M only drops
            assert c == sorted(c) and c[0] < c[-1], (rule, c)
    ideal = {s.resource: pipeline_sim.split_ideal(wl, s)["ideal_step_s"] for s in setups}
    full = {s.resource: pipeline_sim.split_ideal(sim_server.Workload(), s)["ideal_step_s"] for s in setups}
    for split in ideal:
        assert ideal[split] == pytest.approx(full[split], rel=1e-6)  # the scaled workload keeps the step time
    rows = pipeline_sim.sweep_rows([
        {"name": "a", "label": "a", "rule": "areal", "level": 1, "resource": "8:8", "ideal_step_s": 1.0,
         "ideal_trained_tokens_per_s": 10.0, "trained_tokens_per_s": x, "efficiency_split": x / 10,
         "avg_step_excl0_s": 1.0, "staleness_mean": 1.0, "offpolicy_token_share": 0.5,
         "discarded_tokens_per_step": 0.0, "generated_tokens_per_step": 5.0, "staleness_max": 1} for x in (8, 9, 7)])
    assert rows[0]["trained_tokens_per_s"] == (8.0, 7, 9) and rows[0]["repeats"] == 3
    assert "8 [7-9]" in pipeline_sim.sweep_table(rows)


def test_agentic_model_keeps_its_bounds_and_drains_or_keeps_episodes_at_the_boundary():
    """--agentic (a discrete-event model, B / 16): the knob and the sandbox pool are never exceeded and are reached
    when they bind; partial=false drains (no trajectory has tokens of two weight versions), partial=true keeps the
    episodes across the update; a pool too small to keep up sets the step (utilisation ~1, the sandbox bound)."""
    import pipeline_sim

    wl = pipeline_sim.scaled_workload(sim_server.Workload(), 16)  # B=4, N=8, M=8: the same step time
    B, N = wl.num_prompts_per_step, wl.num_trajectories_per_prompt
    aw = pipeline_sim.AgenticWorkload(env_max_concurrent=24)
    runs = {}
    for S, partial in ((B * N, False), (B * N, True), (2 * B * N, True)):
        s = pipeline_sim.AgenticSetup(f"S={S} {partial}", S, partial)
        r = runs[S, partial] = pipeline_sim.AgenticSim(wl, aw, s, seed=1).run(6, 2)
        assert r["max_in_flight_trajectories"] == S, r  # reached, never exceeded
        assert r["max_sandboxes_in_use"] <= 24 and 0 < r["sandbox_utilization"] <= 1, r
        assert 0 < r["fleet_utilization"] <= 1 and r["of_ideal"] <= 1.02, r
        assert r["staleness_p99"] <= r["staleness_max"], r
    assert runs[B * N, False]["partial_ratio"] == 0  # drained: every trajectory generated by one version
    assert runs[B * N, True]["partial_ratio"] > 0.05  # kept: episodes cross the update
    # the drain waits for the slowest episode in flight every step: it costs throughput the kept boundary does not
    assert runs[B * N, False]["trained_tokens_per_s"] < 0.8 * runs[B * N, True]["trained_tokens_per_s"]
    assert runs[2 * B * N, True]["staleness_mean"] > runs[B * N, True]["staleness_mean"]

    small = pipeline_sim.AgenticWorkload(env_max_concurrent=2)
    r = pipeline_sim.AgenticSim(wl, small, pipeline_sim.AgenticSetup("pool 2", 2 * B * N, True), seed=1).run(4, 2)
    assert r["ideal_bound"] == "sandboxes" and r["max_sandboxes_in_use"] == 2, r
    assert r["sandbox_utilization"] > 0.97, r
    assert r["step_s"] > 2 * runs[B * N, True]["step_s"], r  # the pool sets the pace, not the trainer


def test_agentic_model_without_tools_reduces_to_the_single_turn_workload():
    """One turn, no tool: the spec's training-bound 8:8 (windowed-fifo, stale 1, partial) at its ideal, as the real
    orchestration's fifo-s1 row (0.98); eight turns with tool latency 0 give the same throughput (turns only
    re-queue); the generation-bound 12:4 keeps its fleet busy (the fleet's peak is its ideal)."""
    import pipeline_sim

    wl = pipeline_sim.scaled_workload(sim_server.Workload(), 16)
    out = {}
    for turns in (1, 8):
        aw = pipeline_sim.AgenticWorkload(turns=turns, tool_median_s=0.0)
        s = pipeline_sim.AgenticSetup("single", None, True, stale_steps=1.0)
        out[turns] = pipeline_sim.AgenticSim(wl, aw, s, seed=2).run(6, 2)
    assert out[1]["ideal_bound"] == "training" and out[1]["of_ideal"] > 0.95, out[1]
    assert out[1]["sandbox_utilization"] == 0 and out[1]["max_sandboxes_in_use"] == 0
    assert out[8]["trained_tokens_per_s"] == pytest.approx(out[1]["trained_tokens_per_s"], rel=0.03)
    gen = pipeline_sim.AgenticSim(wl, pipeline_sim.AgenticWorkload(turns=1, tool_median_s=0.0),
                                  pipeline_sim.AgenticSetup("12:4", None, True, stale_steps=1.0, train_gpus=12,
                                                            infer_gpus=4), seed=2).run(6, 2)
    # (a window of 4 steps can train a little more than its share: groups carry tokens generated before it)
    assert gen["ideal_bound"] == "fleet" and 0.85 < gen["of_ideal"] < 1.1 and gen["fleet_utilization"] > 0.85, gen
