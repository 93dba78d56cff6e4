"""Delta weight sync (issue 50, weight_sync.delta, weight_delta.py): after a full sync, each sync sends only the
elements whose value in the servers' dtype changed, and the servers end with exactly the weights a full sync gives.

Against standins/engine.py --dtype bfloat16 --custom-weight-loader weight_delta.load_delta (sglang 0.5.23
model_executor/model_runner_components/weight_updater.py update_weights_from_tensor: `custom_loader(self.get_model(),
named_tensors)` for a load_format listed by --custom-weight-loader; arg_groups/fields/model.py custom_weight_loader),
read back through /get_weights_by_name (0.5.23 http_server.py get_weights_by_name, models/llama.py
get_weights_by_name: float32 nested lists) and compared as bf16 bit patterns, after real AdamW steps at RL learning
rates. A delta the loader refuses (weight_delta.DeltaRefused) is answered success false by the stand-in; any other
loader exception ends it, as in 0.5.23 (managers/scheduler.py run_scheduler_process: nothing on the scheduler's path
catches it, a refusal included: weight_delta.py's docstring; the server's main process kills its process tree,
utils/common.py kill_process_tree).
Run: .venv/bin/python -m pytest -q tests/test_weight_delta.py
"""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import config
import weight_delta
from standins import engine, tiny_model
from test_engine import post
from test_train import ROOT

PY = sys.executable


# ---- the encoder alone ----
def test_bit_patterns_count_signed_zero_and_nan_payloads_and_only_changes_are_sent():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16)
    new = old.clone()
    new[0] = -0.0  # equal as numbers, another bit pattern
    new.view(torch.int16)[2] += 1  # another NaN payload
    assert weight_delta.changed(old, new).tolist() == [0, 2]
    s = weight_delta.DeltaSender()
    s.begin(1, True)
    full = s.encode([("w", old), ("u", torch.ones(4, dtype=torch.bfloat16))])
    assert [e["pos"] for e in full] == [None, None] and s.stats["bytes"] == 24
    s.commit()
    s.begin(2, False)
    (e,) = s.encode([("w", new), ("u", torch.ones(4, dtype=torch.bfloat16))])  # u unchanged: not sent
    assert e["name"] == "w" and e["pos"].tolist() == [0, 2] and s.stats == {"changed": 2, "numel": 12, "bytes": 12}
    layout, flat = weight_delta.pack([e])
    (back,) = weight_delta.unpack(json.loads(json.dumps(layout)), flat)
    assert torch.equal(back["pos"], e["pos"])
    assert torch.equal(weight_delta.bits(back["val"]), weight_delta.bits(e["val"]))
    s.reset()  # a failed sync: no base, the next one is full
    assert s.needs_full(3, [1], 100) is not None
    s.begin(2, False)
    s.encode([("w", new)])
    s.commit()
    assert torch.equal(weight_delta.bits(s.copy["w"]), weight_delta.bits(new))
    assert s.needs_full(3, [2], 100) is None and "delta_full_every" in s.needs_full(102, [2], 100)
    assert "holds version 1" in s.needs_full(3, [2, 1], 100)
    # more than a third changed: the whole tensor is fewer bytes than int32 positions + bf16 values
    s.begin(3, False)
    (e,) = s.encode([("w", new + 1)])
    assert e["pos"] is None


# ---- the server's refusals: checked before anything is applied, answered as success false ----
def test_refused_deltas_change_nothing_and_the_server_keeps_serving(tmp_path):
    """The store seeded by a full bucket (a file in the server's sync directory, WEIGHT_DELTA_SYNC_DIR) before each
    delta the loader must refuse: positions negative, at numel, of a float dtype; a base the store does not hold; a
    file outside the sync directory (named directly, through a path that climbs out, through a symlink in it). Each
    is answered success false naming why, the server stays up and the tensor keeps its values; a refusal leaves the
    store without a base, so a well-formed delta right after one is refused too (the next sync must be full)."""
    model = tiny_model.make_tiny_model(str(tmp_path / "m"))
    sync, outside = tmp_path / "sync_weights", tmp_path / "outside"
    sync.mkdir()
    outside.mkdir()
    url, handle = engine.launch(model, dtype="bfloat16", custom_weight_loader=weight_delta.LOADER, wait_timeout=60,
                                env={weight_delta.SYNC_DIR_ENV: str(sync)})
    name = "model.embed_tokens.weight"

    def held() -> torch.Tensor:
        r = post(url, "/get_weights_by_name", {"name": name, "truncate_size": 10 ** 6})
        return torch.tensor(r.json(), dtype=torch.float32).to(torch.bfloat16)

    def send(base, version: int, entry: dict, where=None) -> dict:
        desc = {"base": base, "version": version, "last": True, "transport": "disk",
                "path": str(where or sync / f"v{version}.safetensors")}
        written = os.path.realpath(desc["path"])
        weight_delta.write_file(written if os.path.isdir(os.path.dirname(written)) else desc["path"], [entry], desc)
        assert post(url, "/begin_weight_update", {}).json()["success"] is True
        body = {"serialized_named_tensors": [weight_delta.control_payload(desc)], "load_format": weight_delta.LOADER,
                "weight_version": str(version)}
        r = post(url, "/update_weights_from_tensor", body)
        assert post(url, "/end_weight_update", {}).json()["success"] is True
        assert handle.proc.poll() is None, handle.log_tail()
        return r.json()

    try:
        before = held()
        whole = {"name": name, "shape": list(before.shape), "dtype": torch.bfloat16, "pos": None,
                 "val": before.reshape(-1)}
        one = torch.ones(1, dtype=torch.bfloat16)
        (sync / "link.safetensors").symlink_to(outside / "target.safetensors")
        cases = [(torch.tensor([-1], dtype=torch.int32), None, "outside [0,"),
                 (torch.tensor([before.numel()], dtype=torch.int64), None, "outside [0,"),
                 (torch.tensor([0.0]), None, "malformed"),
                 (torch.tensor([0], dtype=torch.int32), "base", "refused the delta"),
                 (torch.tensor([0], dtype=torch.int32), outside / "v.safetensors", "outside"),
                 (torch.tensor([0], dtype=torch.int32), sync / ".." / "outside" / "up.safetensors", "outside"),
                 (torch.tensor([0], dtype=torch.int32), sync / "link.safetensors", "outside")]
        version = 0
        for pos, how, words in cases:
            version += 2
            assert send(None, version - 1, whole)["success"] is True  # a full bucket: the store's base
            delta = {**whole, "pos": pos, "val": one}
            base = version - 1 if how != "base" else version + 100
            r = send(base, version, delta, None if how == "base" else how)
            assert r["success"] is False and words in r["message"], (pos, how, r)
            assert torch.equal(weight_delta.bits(held()), weight_delta.bits(before)), (pos, how)
        # after a refusal the store has no base: a well-formed delta on the last full version is refused as well
        r = send(version - 1, version + 1, {**whole, "pos": torch.tensor([0], dtype=torch.int32), "val": one})
        assert r["success"] is False and "refused the delta" in r["message"], r
        # and a full sync then a delta go through
        assert send(None, version + 2, whole)["success"] is True
        r = send(version + 2, version + 3, {**whole, "pos": torch.tensor([0], dtype=torch.int32), "val": one})
        assert r["success"] is True, r
        assert held().reshape(-1)[0] == 1 and torch.equal(held().reshape(-1)[1:], before.reshape(-1)[1:])
    finally:
        handle.stop()


def test_a_loader_exception_kills_the_server_as_0_5_23_does(tmp_path):
    """Any exception of a custom loader but a refusal (here: a broadcast bucket naming a weight-update group the
    server never joined) reaches 0.5.23's managers/scheduler.py run_scheduler_process, which sends SIGQUIT to the
    server's main process; its handler (managers/tokenizer_manager.py SignalHandler.running_phase_sigquit_handler)
    calls utils/common.py kill_process_tree(os.getpid()): SIGKILL to the process tree, not the process group
    (os.killpg only with SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION, environ.py, default false). The caller's connection
    drops, the server dies by SIGKILL (services.py relaunches such a server and syncs it in full:
    tests/test_train.py test_a_killed_server_is_relaunched_and_no_prompt_is_lost_or_trained_twice), and the rest of
    its process group (this test's) lives on."""
    import requests

    model = tiny_model.make_tiny_model(str(tmp_path / "m"))
    sibling = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"])  # in the engine's process group (ours)
    try:
        url, handle = engine.launch(model, custom_weight_loader=weight_delta.LOADER, wait_timeout=60,
                                    env={weight_delta.SYNC_DIR_ENV: str(tmp_path)})
        desc = {"base": None, "version": 1, "last": True, "transport": "broadcast", "group": "no-such-group",
                "nbytes": 8, "layout": []}
        assert post(url, "/begin_weight_update", {}).json()["success"] is True
        with pytest.raises(requests.exceptions.ConnectionError):
            post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [weight_delta.control_payload(desc)],
                                                       "load_format": weight_delta.LOADER, "weight_version": "1"})
        assert handle.proc.wait(30) == -signal.SIGKILL
        log = handle.log_tail(200)
        assert "Scheduler hit an exception" in log and "no process group named 'no-such-group'" in log, log
        assert sibling.poll() is None
    finally:
        sibling.kill()
        sibling.wait()


def test_an_unlisted_load_format_is_refused(tmp_path):
    model = tiny_model.make_tiny_model(str(tmp_path / "m"))
    url, handle = engine.launch(model, wait_timeout=60)  # no --custom-weight-loader
    try:
        assert post(url, "/begin_weight_update", {}).json()["success"] is True
        r = post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [weight_delta.control_payload({})],
                                                       "load_format": weight_delta.LOADER})
        assert r.status_code == 400 and "Unknown load_format" in r.text, r.text
        assert handle.proc.poll() is None
    finally:
        handle.stop()


# ---- through WeightSync, each transport, real optimizer steps ----
@pytest.mark.parametrize("method,moe", [("distributed", False), ("disk", True)])
def test_delta_syncs_leave_the_servers_bit_exact(method, moe, tmp_path):
    """One trainer rank (torchrun, gloo, FSDP2) and one bf16 engine with the loader (the worker below): a full
    sync, three AdamW steps at lr 1e-5 each followed by a delta sync (strictly more than none and fewer than all
    elements, fewer bytes than a full sync), a step at lr 1e-8 (float32 moves, bf16 only at weights near 0: only
    those are sent), a resume (an empty host copy: full), then the engine restarted on its URL (version 0: full, then delta again).
    After every sync every parameter read back from the engine equals the trainer's in bf16, bit for bit. moe: the
    tiny Qwen3-MoE (per-expert checkpoint names into the engine's fused experts)."""
    if moe:
        from test_moe import make_moe
        model = make_moe(str(tmp_path / "m"), 0)
    else:
        model = tiny_model.make_tiny_model(str(tmp_path / "m"))
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                        os.path.abspath(__file__), model, method, str(tmp_path / "run")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, start_new_session=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    syncs = json.loads(lines[-1][len("RESULT "):])
    full_bytes = syncs[0]["bytes"]
    kinds = [(s["what"], s["delta"]) for s in syncs]
    assert kinds == [("first", 0), ("tiny", 1), ("step", 1), ("step", 1), ("step", 1), ("resume", 0),
                     ("step", 1), ("restart", 0), ("step", 1)], kinds
    for s in syncs:
        assert s["mismatched"] == 0 and s["compared"] > 0, s
        if s["delta"] and s["what"] == "step":
            assert 0 < s["changed_frac"] < 1 and 0 < s["bytes"] < full_bytes, s
        if s["delta"]:  # exactly the elements whose bf16 value changed were detected
            assert s["changed"] == s["bf16_flips"], s
        if s["what"] == "tiny":  # float32 moved widely, bf16 only where a weight was ~0 (e.g. the
            # pad token's embedding row): only those went, as int32 positions + bf16 values (+ at most 14 bytes of
            # pad, each segment 8-byte aligned)
            assert s["fp32_moved"] > 100 * s["changed"] and s["changed_frac"] < 1e-3, s
            assert 6 * s["changed"] <= s["bytes"] <= 6 * s["changed"] + 16 * s["tensors"], s
        if not s["delta"]:
            assert s["bytes"] == full_bytes, s


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_delta_syncs_stay_deltas_on_a_server_with_a_speculative_draft(method, tmp_path):
    """sglang 0.5.23 managers/scheduler_components/weight_updater.py _select_runners: with a speculative draft model
    (--speculative-algorithm EAGLE) the default selector "all" (managers/io_struct.py) calls the custom loader once
    per runner (update_weights_from_tensor), so weight_delta.load_delta ran twice per bucket: over the broadcast the
    draft's call waited for a broadcast the trainer never sends (the loader's exception ended the server), over disk
    the draft's call of the last bucket was refused and every sync fell back to a full one. The trainer sends
    selector "target" (sglang_client.WEIGHT_SELECTOR; begin_weight_update too): one trainer rank and one stand-in
    launched with a draft, a full sync then four AdamW steps at lr 1e-6, each synced as a delta of far fewer bytes
    than the full sync; the weight-update group formed once (distributed; disk forms none), the server alive and
    bit-exact, and its draft given nothing (no DRAFT_LOG line: standins/engine.py _DraftModel)."""
    model = tiny_model.make_tiny_model(str(tmp_path / "m"))
    p = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                        os.path.abspath(__file__), model, method, str(tmp_path / "run"), "draft"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, start_new_session=True,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    syncs = res["syncs"]
    assert [s["delta"] for s in syncs] == [0, 1, 1, 1, 1], syncs
    assert all(0 < s["bytes"] < syncs[0]["bytes"] / 4 for s in syncs[1:]), syncs
    assert res["forms"] == (1 if method == "distributed" else 0), res
    assert res["alive"] and res["mismatched"] == 0 and res["draft"] == [], res


def worker(model_path: str, method: str, run_dir: str, draft: bool = False) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import actor as actor_lib
    import model as model_lib
    import sglang_client
    from services import free_port

    dist.init_process_group("gloo")
    ctrl = dist.new_group(backend="gloo")
    cfg = config.load_config(None, [f"model.path={model_path}", f"run_dir={run_dir}", "device=cpu", "colocate=false",
                                    f"weight_sync.method={method}", "weight_sync.delta=true",
                                    "weight_sync.delta_full_every=100", "weight_sync.bucket_mb=1",
                                    "weight_sync.dtype=bfloat16",
                                    f"weight_sync.master_port={free_port()}", "weight_sync.master_address=127.0.0.1",
                                    "trainer.num_gpus_per_node=1", "trainer.weight_decay=0.0"]
                             + (["weight_sync.timeout_s=60", "rollout.startup_timeout_s=30"] if draft else []))
    model, _ = model_lib.load_model(cfg, init_device_mesh("cpu", (1,)), torch.device("cpu"), 0, ctrl)
    opt, sched = model_lib.build_optimizer(model, cfg.trainer)
    act = actor_lib.Actor(cfg, model, opt, sched, torch.device("cpu"), ctrl)
    port = free_port()
    kw = dict(port=port, dtype="bfloat16", custom_weight_loader=weight_delta.LOADER, weight_version=0,
              dist_timeout=60, wait_timeout=120,
              env={weight_delta.SYNC_DIR_ENV: os.path.join(run_dir, "sync_weights")})  # as services.py launches it
    if draft:  # a speculative draft model beside the target: see the draft test
        kw.update(speculative_algorithm="EAGLE", speculative_draft_model_path=model_path)
    url, handle = engine.launch(model_path, **kw)
    act.fleet = sglang_client.SyncFleet(sglang_client.Fleet([url]))
    assert act.weights.dtype == torch.bfloat16  # weight_sync.dtype: the engine's, pushed and compared in it
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (4, 24), generator=g)
    out, version = [], 0

    def step(lr: float) -> None:
        for grp in opt.param_groups:
            grp["lr"] = lr
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def mine(dtype=torch.bfloat16) -> dict:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(dtype, copy=True)
                for n, p in model.named_parameters()}
    last, last32 = {}, {}

    def sync(what: str) -> None:
        nonlocal version, last, last32
        version += 1
        m = act.sync_weights(version)
        import requests
        bad = n = 0
        now, now32 = mine(), mine(torch.float32)
        flips = sum(int((weight_delta.bits(t) != weight_delta.bits(last[k])).sum()) for k, t in now.items()) \
            if last else None
        moved = sum(int((weight_delta.bits(t) != weight_delta.bits(last32[k])).sum()) for k, t in now32.items()) \
            if last else None
        last, last32 = now, now32
        for name, mine_t in now.items():
            r = requests.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 10 ** 9}, timeout=60)
            theirs = torch.tensor(r.json(), dtype=torch.float32).to(torch.bfloat16)
            bad += int((weight_delta.bits(mine_t) != weight_delta.bits(theirs)).sum())
            n += mine_t.numel()
        out.append({"what": what, "delta": m["perf/weight_sync_delta"], "bytes": m["perf/weight_sync_bytes"],
                    "changed_frac": m["perf/weight_sync_changed_frac"], "mismatched": bad, "compared": n,
                    "changed": act.weights.delta.sender.stats["changed"], "bf16_flips": flips, "fp32_moved": moved,
                    "tensors": len(now)})

    with torch.no_grad():  # the weights as a bf16 checkpoint ships them (real models' are): the engine's
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    if draft:
        forms, form = [], act.weights.distributed.form
        act.weights.distributed.form = lambda: forms.append(1) or form()
        try:
            sync("first")
            for _ in range(4):
                step(1e-6)
                sync("step")
            alive = handle.proc.poll() is None
        finally:
            handle.stop()
        with open(handle.log_path) as f:
            drafted = [ln.strip() for ln in f if engine.DRAFT_LOG in ln]
        print("RESULT " + json.dumps({"syncs": out, "forms": len(forms), "alive": alive, "draft": drafted,
                                      "mismatched": sum(s["mismatched"] for s in out)}), flush=True)
        return dist.destroy_process_group()
    try:
        sync("first")
        step(1e-8)  # a float32 update of ~1e-8 moves a bf16-representable weight off its value only near 0
        sync("tiny")
        for _ in range(3):
            step(1e-5)
            sync("step")
        act.weights.delta.sender = weight_delta.DeltaSender()  # a resume: the host copy starts empty
        step(1e-5)
        sync("resume")
        step(1e-5)
        sync("step")
        handle.stop()  # the server restarts on its URL with the base weights, version 0
        url, handle = engine.launch(model_path, **kw)
        step(1e-5)
        sync("restart")
        step(1e-5)
        sync("step")
    finally:
        handle.stop()
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    worker(*sys.argv[1:4], draft=sys.argv[4:5] == ["draft"])
