"""train.py: the step loop's helpers, every start-up validation, the old-policy snapshot, weight sync fidelity
(engine log-probs == trainer log-probs after a sync, every method), SIGKILL + resume, and the spec's metrics.

CPU only. The multi-process checks run this file as a script under torchrun (2 gloo ranks):
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/test_train.py snapshot '{...}'
Run: .venv/bin/python -m pytest -q tests/test_train.py
"""
import concurrent.futures
import contextlib
import importlib
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import requests  # noqa: E402
import torch  # noqa: E402

import config  # noqa: E402
import batching  # noqa: E402
import checkpoint  # noqa: E402
import logger  # noqa: E402
import model as model_lib  # noqa: E402
import plot  # noqa: E402
import run_modes  # noqa: E402
import services as services_lib  # noqa: E402
import actor as actor_lib  # noqa: E402
import train  # noqa: E402

PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TINY = os.path.join(ROOT, "configs", "tiny.yaml")




@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from standins import tiny_model

    return tiny_model.make_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny"))


def _run_overrides(run_dir, model) -> list:
    """tiny.yaml shrunk to one epoch of 32 prompts in 8 steps (B=4, N=4, M=8: 2 training calls per step)."""
    return [f"run_dir={run_dir}", f"model.path={model}", f"rollout.base_port={services_lib.free_port()}",
            f"weight_sync.master_port={services_lib.free_port()}", "data_source.num_prompts=32",
            "data_source.num_eval_prompts=8",
            "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=4",
            "trainer.mini_batch_size=8", "trainer.total_steps=8", "trainer.save_freq=1", "trainer.eval_freq=4",
            "rollout.filter=[failed]",  # every group is trained: the epoch of 32 prompts, each exactly once
            "buffer.get_timeout_s=120", "rollout.startup_timeout_s=120"]


def _session_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_session_gone(pgid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _session_gone(pgid):
            return True
        time.sleep(0.2)
    return False


def _wait_gone(fragment: str, timeout: float = 20.0) -> bool:
    """No process whose command line holds `fragment` (a run's run_dir) within `timeout` s."""
    deadline = time.monotonic() + timeout
    while _pids(fragment):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _read_rows(run_dir) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def held_prompts(buffer_state: dict) -> set:
    """The (epoch, data_index) of every prompt a checkpoint's buffer state still holds: its restored lane (in
    flight at the checkpoint) and its buffered groups, none of them trained yet."""
    return {(g["epoch"], g["data_index"]) for g in buffer_state["data"]["lane"] + buffer_state["buffered"]}


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers

def test_aggregate_follows_the_spec_naming_rule():
    calls = [{"timing/train": 1.0, "train/is_max": 3.0, "train/is_min": 0.5, "train/pg_loss": 0.2},
             {"timing/train": 2.0, "train/is_max": 5.0, "train/is_min": 0.1, "train/pg_loss": 0.4,
              "perf/train_memory_allocated_max": 7.0}]
    out = logger.aggregate(calls)
    assert out["timing/train"] == 3.0  # summed
    assert out["train/is_max"] == 5.0 and out["perf/train_memory_allocated_max"] == 7.0  # max
    assert out["train/is_min"] == 0.1  # min
    assert out["train/pg_loss"] == pytest.approx(0.3)  # averaged


def _seq(p, r, adv=1.0, versions=None):
    return {"prompt": list(range(p)), "response": [100 + i for i in range(r)], "mask": [1] * r,
            "rollout_lp": [-1.0 - i for i in range(r)], "versions": versions or [0] * r, "adv": adv}


def test_split_balanced_by_tokens_and_micro_batches_fit():
    seqs = [_seq(4, n) for n in (30, 2, 2, 2, 10, 9, 8, 7)]
    shares = batching.split_balanced(seqs, 2)
    loads = [sum(batching._length(s) for s in sh) for sh in shares]
    assert sum(loads) == sum(batching._length(s) for s in seqs) and abs(loads[0] - loads[1]) <= 8
    for sh in shares:
        plan = batching.plan_micro_batches(sh, max_tokens=40)
        assert sum(len(mb) for mb in plan) == len(sh)
        for mb in plan:  # rows x longest row within the budget, unless a single row is longer
            assert len(mb) == 1 or len(mb) * max(batching._length(s) for s in mb) <= 40


def test_collate_puts_response_tokens_on_their_predicting_positions():
    b = batching.collate([_seq(3, 2), _seq(2, 4, adv=-1.0)])
    assert b["ids"].shape == (2, 6) and b["mask"].shape == (2, 5)
    # sequence 0: prompt 0,1,2 then response 100,101: position 2 predicts 100, position 3 predicts 101
    assert b["mask"][0].tolist() == [0, 0, 1, 1, 0]
    assert b["ids"][0, 1:][b["mask"][0] > 0].tolist() == [100, 101]
    assert b["rollout_lp"][0, 2:4].tolist() == [-1.0, -2.0]
    assert b["ids"][1, 1:][b["mask"][1] > 0].tolist() == [100, 101, 102, 103]
    assert b["attn"][0].tolist() == [1, 1, 1, 1, 1, 0] and b["adv"].tolist() == [1.0, -1.0]
    # a restored partial trajectory: tokens of version 3 before the newest version 4 leave the loss
    m = batching.collate([_seq(2, 4, versions=[3, 3, 4, 4])], mask_offpolicy=True)["mask"]
    assert m[0].tolist() == [0, 0, 0, 1, 1]


# ---------------------------------------------------------------------------------------------------------------
# Start-up validation through train.py: exit code 2 and the one-sentence message, before anything starts

def _config_rules():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_config

    return test_config.RULES


TRAIN_RULES = [  # train.py's own checks (check_launch): (overrides, strings of the message)
    (["trainer.num_gpus_per_node=2"], ["trainer.num_nodes x trainer.num_gpus_per_node", "(1)"]),
    (["model.path=/nonexistent/model", "model.make_tiny=false"], ["model.path", "model.make_tiny"]),
    (["rollout.launch=none"], ["rollout.launch=none", "rollout.servers"]),
    (["rollout.servers=[http://127.0.0.1:1]", "rollout.router_url=http://127.0.0.1:2"],
     ["rollout.servers", "rollout.router_url"]),
    (["run_mode=train-only", "fully_async.enable=false"], ["run_mode=train-only", "trainer.rollout_dir"]),
    (["data_source.reward=no_such_module:fn"], ["data_source.reward 'no_such_module:fn': no module named "
                                                "'no_such_module'", "PYTHONPATH"]),
    (["model.path=/nonexistent/model", "data_source.task=jsonl", "data_source.path=/nonexistent.jsonl"],
     ["model.tiny_pretrain_steps=300", "data_source.task 'jsonl'", "model.tiny_pretrain_steps=0"]),
]


def _expect_exit(argv, fragments, capsys):
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert time.monotonic() - t0 < 5
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    for frag in fragments:
        assert frag in lines[0], (frag, lines[0])


def test_every_config_validation_exits_through_train_py(tmp_path, capsys):
    rules = _config_rules()
    assert len(rules) >= 40
    for i, (overrides, base, fragments) in enumerate(rules):
        cfg_path = tmp_path / f"rule{i}.yaml"
        cfg_path.write_text(json.dumps(base or {}))  # JSON is YAML
        _expect_exit(["--config", str(cfg_path), f"run_dir={tmp_path}/run{i}", *overrides], fragments, capsys)


@pytest.mark.parametrize("overrides,fragments", TRAIN_RULES)
def test_train_launch_checks_exit_with_one_sentence(tmp_path, capsys, overrides, fragments):
    base = ["trainer.num_gpus_per_node=1", f"run_dir={tmp_path}/run", f"model.path={tmp_path}/model"]
    _expect_exit(["--config", TINY, *base, *overrides], fragments, capsys)


def _root_cause_exit_code(err: str) -> int:
    """The trainer rank's exit code in torchrun's "Root Cause (first observed failure)" summary (torchrun itself
    exits 1 whenever a rank fails)."""
    section = err[err.index("Root Cause (first observed failure)"):]
    return int(section.split("exitcode  :", 1)[1].split()[0])


def test_prompts_over_max_prompt_tokens_stop_the_run_before_any_server(tmp_path, capsys, tiny_model):
    _expect_exit(["--config", TINY, "trainer.num_gpus_per_node=1", f"run_dir={tmp_path}/run",
                  f"model.path={tiny_model}", "data_source.num_prompts=64", "rollout.max_prompt_tokens=4"],
                 ["of the 64 train prompts of data_source.task 'reverse_digits' are longer than "
                  "rollout.max_prompt_tokens=4 tokens (the longest: 6)"], capsys)
    assert not os.path.exists(tmp_path / "run" / "logs")  # nothing was launched


def test_validation_under_torchrun_exits_fast_and_leaves_no_process(tmp_path):
    """Every rank reads the config and exits 2; only rank 0 prints the error line, and its sentence is the root
    cause's message in torchrun's summary, the last lines on the screen (its error file, TORCHELASTIC_ERROR_FILE)."""
    t0 = time.monotonic()
    p = subprocess.Popen([*TORCHRUN, "train.py", "--config", TINY, f"run_dir={tmp_path}/run",
                          "fully_async.stale_steps=-1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode != 0 and _root_cause_exit_code(err) == 2, err[-3000:]
    assert (out + err).count("error: ") == 1, err[-3000:]
    assert "error: fully_async.stale_steps must be >= 0, got -1.0" in err
    last = err.rstrip().splitlines()[-2:]
    assert last[0].strip() == "traceback : fully_async.stale_steps must be >= 0, got -1.0" and \
        set(last[1]) == {"="}, err[-3000:]
    assert time.monotonic() - t0 < 60
    assert _wait_session_gone(p.pid)  # start_new_session=True: the run's processes share its process group


def _bad_jsonl(tmp_path) -> str:
    row = '{"prompt": "What is 1+1?", "answer": "2"}'
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{row}\n{row[:-1]}\n{row}\n")  # line 2 lacks its closing brace
    return str(path)


def test_a_gsm8k_dataset_on_the_tiny_config_must_choose_max_new_tokens(tmp_path, capsys):
    """A fresh clone's first run on its own data: tiny.yaml's max_new_tokens 6 (sized for reversing 5 digits)
    cannot hold 'Answer:74' (9 tokens), so the run stops before anything starts, naming the key."""
    importlib.import_module("transformers")  # its first import, seconds under load, is not the check's time

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 70?", "answer": f"{i} + 70 = {i + 70}\n#### "
                                        f"{i + 70}"}) + "\n" for i in range(4, 10)))
    argv = ["--config", TINY, "trainer.num_gpus_per_node=1", f"run_dir={tmp_path}/run", f"model.path={tmp_path}/m",
            "model.tiny_pretrain_steps=0", "data_source.task=jsonl", f"data_source.path={data}",
            "data_source.num_eval_prompts=2"]
    _expect_exit(argv, ["rollout.sampling.max_new_tokens=6 cannot hold an answer the math reward of "
                        "data_source.task 'jsonl'", "its shortest, 'Answer:74', is 9 tokens, so every reward would "
                        "be 0; set rollout.sampling.max_new_tokens to what a response of this dataset needs"], capsys)
    assert not os.path.exists(tmp_path / "run" / "logs") and not os.path.exists(tmp_path / "m")  # nothing started


def test_bad_dataset_is_refused_before_any_server_starts(tmp_path, capsys):
    path = _bad_jsonl(tmp_path)
    run_dir = tmp_path / "run"
    _expect_exit(["--config", TINY, "trainer.num_gpus_per_node=1", f"run_dir={run_dir}",
                  f"model.path={tmp_path}/model", "model.tiny_pretrain_steps=0", "data_source.task=jsonl",
                  f"data_source.path={path}"],
                 [f"{path} line 2: not valid JSON", "column 41: the line ends before the row does"], capsys)
    assert not os.path.exists(run_dir / "logs")  # no child was started
    _expect_exit(["--config", TINY, "trainer.num_gpus_per_node=1", f"run_dir={run_dir}",
                  f"model.path={tmp_path}/model", "model.tiny_pretrain_steps=0", "data_source.task=jsonl",
                  f"data_source.path={tmp_path}/no.jsonl"],
                 [f"data_source.path '{tmp_path}/no.jsonl' is not a file"], capsys)


class _RunsCode:
    """Unpickling this would run a shell command: weights_only=True must refuse it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _write_checkpoint(run_dir, step: int, shards: bool = True, state=None) -> str:
    import torch.distributed.checkpoint as dcp

    path = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    os.makedirs(path + ".tmp")
    if shards:
        dcp.save({"model": {"w": torch.arange(4096.0)}}, checkpoint_id=path + ".tmp", no_dist=True)
    checkpoint.commit(path + ".tmp", path, state or {"step": step, "rng": [checkpoint.rng_state()]})
    return path


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_latest_checkpoint_skips_those_that_do_not_load(tmp_path, capsys):
    run_dir = str(tmp_path)
    good = _write_checkpoint(run_dir, 1)
    assert checkpoint.latest_checkpoint(run_dir) == good and checkpoint.load_run_state(good)["step"] == 1
    cut_shard = _write_checkpoint(run_dir, 2)
    shard = [f for f in os.listdir(cut_shard) if f.endswith(".distcp")][0]
    _truncate(os.path.join(cut_shard, shard))
    cut_state = _write_checkpoint(run_dir, 3)
    _truncate(os.path.join(cut_state, "run_state.pt"))
    code = _write_checkpoint(run_dir, 4)  # its run_state.pt replaced by one that would run code (commit refuses it)
    torch.save({"step": 4, "x": _RunsCode(tmp_path / "ran")}, os.path.join(code, "run_state.pt"))
    os.makedirs(os.path.join(run_dir, "checkpoints", "step_000005.tmp"))  # a save in progress
    capsys.readouterr()
    assert checkpoint.latest_checkpoint(run_dir) == good
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "skipping checkpoint" in ln]
    assert len(warnings) == 3, warnings
    assert code in warnings[0] and "run_state.pt does not load: UnpicklingError" in warnings[0]
    assert cut_state in warnings[1] and "run_state.pt does not load" in warnings[1]
    assert cut_shard in warnings[2] and f"shard {shard} has" in warnings[2] and "its metadata expects" in warnings[2]
    assert not (tmp_path / "ran").exists()  # loading it ran nothing
    _write_checkpoint(run_dir, 6, shards=False)  # a rollout-only checkpoint: run state only, no shards
    assert checkpoint.latest_checkpoint(run_dir, shards=False).endswith("step_000006")


def test_resume_from_a_checkpoint_that_does_not_load_names_it(tmp_path, capsys):
    bad = _write_checkpoint(str(tmp_path / "run"), 3)
    _truncate(os.path.join(bad, "run_state.pt"))
    _expect_exit(["--config", TINY, "trainer.num_gpus_per_node=1", f"run_dir={tmp_path}/run",
                  f"model.path={tmp_path}/model", f"trainer.resume={bad}"],
                 [f"trainer.resume checkpoint '{bad}' does not load: run_state.pt does not load"], capsys)


def test_saved_rollouts_are_plain_data_and_replay_in_order(tmp_path):
    import types

    from buffer import Group, PromptGroup, Trajectory

    def group(seq):
        trajs = [Trajectory(0, seq, i, torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([-0.5]),
                            torch.tensor([seq]), torch.tensor([1]), reward=0.25 * i, metadata={"turns": [1, 2]})
                 for i in range(2)]
        return Group(PromptGroup(0, seq, 10 + seq, torch.tensor([1, 2]), label="21", metadata={"row": seq}), trajs)

    rec = run_modes.RolloutRecorder(types.SimpleNamespace(run_dir=str(tmp_path)), fleet=None)
    rec.train_minibatch([group(0), group(1)], 0)
    rec.train_minibatch([group(2)], 0)
    for f in os.listdir(tmp_path / "rollouts"):
        torch.load(tmp_path / "rollouts" / f, weights_only=True)
    replay = run_modes.ReplayBuffer(str(tmp_path / "rollouts"))
    first = replay.get(1, timeout=1)
    assert first[0].prompt.data_index == 10 and first[0].trajectories[1].reward == 0.25
    sd_path = tmp_path / "sd.pt"
    torch.save(replay.state_dict(), sd_path)
    again = run_modes.ReplayBuffer(str(tmp_path / "rollouts"))
    again.load_state_dict(torch.load(sd_path, weights_only=True))
    rest = again.get(2, timeout=1)
    assert [g.prompt.seq for g in rest] == [1, 2]
    assert torch.equal(rest[1].trajectories[0].versions, torch.tensor([2]))
    assert rest[0].trajectories[0].metadata == {"turns": [1, 2]} and rest[0].prompt.label == "21"


def test_bad_dataset_under_torchrun_stops_every_rank_before_servers(tmp_path, tiny_model):
    """Rank 0 alone reads the dataset; its exit 2 stops the other rank too, and no child was started."""
    path = _bad_jsonl(tmp_path)
    t0 = time.monotonic()
    p = subprocess.Popen([*TORCHRUN, "train.py", "--config", TINY, *_run_overrides(tmp_path / "run", tiny_model),
                          "data_source.task=jsonl", f"data_source.path={path}"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode != 0 and _root_cause_exit_code(err) == 2, err[-3000:]
    assert (out + err).count("error: ") == 1, err[-3000:]
    assert f"error: {path} line 2: not valid JSON" in err, err[-3000:]
    assert err.rstrip().splitlines()[-2].strip().startswith(f"traceback : {path} line 2: not valid JSON"), err[-3000:]
    assert time.monotonic() - t0 < 60
    assert not os.path.exists(tmp_path / "run" / "logs")
    assert _wait_session_gone(p.pid), "processes of the failed run are still running"


def _pids(*fragments) -> list:
    """Processes whose command line contains every fragment (a run's children: its run_dir is in their args)."""
    out = []
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if all(frag in cmd for frag in fragments):
                out.append(int(pid))
    return sorted(out)


def _wait_steps(run_dir, steps: int, p, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and
               len([r for r in _read_rows(run_dir) if r["step"] > 0]) >= steps):
        assert p.poll() is None and time.monotonic() < deadline, \
            ((p.stdout.read()[-3000:] + p.stderr.read()[-5000:]) if p.stdout else "exited") if p.poll() else "timeout"
        time.sleep(0.1)


def _wait_log(path, text: str, p, timeout: float = 60.0, *others: tuple) -> None:
    """Until the file at `path` says `text` (or one of the (path, text) pairs in `others` does)."""
    deadline = time.monotonic() + timeout
    pairs = [(path, text), *others]
    while not any(os.path.exists(f) and s in open(f, errors="replace").read() for f, s in pairs):
        assert p.poll() is None, (p.stdout.read()[-3000:] + p.stderr.read()[-5000:]) if p.stdout else "exited"
        assert time.monotonic() < deadline, f"none of {pairs} said within {timeout} s"
        time.sleep(0.1)


def test_a_dead_child_is_the_error_first_line_then_its_log(tmp_path, tiny_model):
    """The buffer process is SIGKILLed mid-run: within 10 s the run stops, and its error names the process, the
    signal and the log, before any RPC / tensorpipe message or traceback."""
    run_dir, overrides = tmp_path / "run", _run_overrides(tmp_path / "run", tiny_model)
    p = subprocess.Popen([*TORCHRUN, "train.py", "--config", TINY, *overrides, "trainer.eval_freq=0"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_steps(str(run_dir), 2, p)
    port = next(a for a in overrides if a.startswith("rollout.base_port=")).split("=")[1]
    server = _pids("standins.engine", f"--port {port} ")  # the watchdog (lease.py) and its child, the engine
    assert len(server) == 2, server
    [pid] = _pids("workers.py buffer", str(run_dir))
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 10
    assert p.returncode == 1
    head = f"error: the buffer process (pid {pid}) was killed by SIGKILL; its log {run_dir}/logs/buffer.log ends with:"
    assert head in err, err[-3000:]
    first = err.index(head)
    for noise in ("tensorpipe", "Traceback", "eof"):
        assert noise not in err[:first], err[:first][-2000:]
    assert err[first:].splitlines()[1].startswith("  | ")  # the log's last lines follow
    assert _wait_session_gone(p.pid)
    assert not set(server) & set(_pids("standins.engine"))  # no torchrun restart to come: both stopped with the run


def test_a_killed_server_is_relaunched_and_no_prompt_is_lost_or_trained_twice(tmp_path, tiny_model):
    """The launched engine is SIGKILLed mid-run: rank 0 relaunches it on its port, re-creates the weight-update
    group, pushes the weights, and the run finishes its epoch with every prompt trained exactly once. SIGKILL is
    also how sglang 0.5.23 ends a server whose scheduler raised, a custom weight loader's exception included
    (managers/scheduler.py run_scheduler_process -> SIGQUIT -> utils/common.py kill_process_tree; the stand-in:
    tests/test_weight_delta.py test_a_loader_exception_kills_the_server_as_0_5_23_does)."""
    run_dir = tmp_path / "run"
    p = subprocess.Popen([*TORCHRUN, "train.py", "--config", TINY, *_run_overrides(run_dir, tiny_model),
                          "trainer.eval_freq=0", "trainer.save_freq=0", "trainer.export_hf=false",
                          "data_source.num_prompts=20", "trainer.total_steps=5"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_steps(str(run_dir), 1, p)
    [pid] = _pids("lease.py", "standins.engine", tiny_model)  # the watchdog, which services.py supervises
    [server] = [q for q in _pids("standins.engine", tiny_model) if q != pid]  # its child, the engine
    os.kill(server, signal.SIGKILL)
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    assert f"the server_0 process (pid {pid}) was killed by SIGKILL; relaunching it" in err, err[-3000:]
    rows = [row for row in _read_rows(run_dir) if row["step"] > 0]
    assert [row["step"] for row in rows] == list(range(1, 6))
    trained = sorted(tuple(pid) for row in rows for pid in row["data/prompt_ids"])
    assert trained == [(0, i) for i in range(20)], trained
    assert rows[-1]["rollout/server_restarts"] == 1 and rows[0]["rollout/server_restarts"] == 0
    assert sum(row["rollout/failed_count"] for row in rows) == 0
    assert _wait_session_gone(p.pid)


def test_a_connected_server_that_dies_and_returns_gets_the_weights_again(tmp_path, tiny_model):
    """A server the run connected to (rollout.servers) dies and is restarted by someone else on the same port: its
    requests wait or go elsewhere, the next sync re-forms the group with it, and no prompt is lost or repeated."""
    from standins import engine

    port = services_lib.free_port()
    url, handle = engine.launch(tiny_model, port=port)
    run_dir = tmp_path / "run"
    trainer_err = tmp_path / "trainer.err"
    with open(trainer_err, "w") as err_file:
        p = subprocess.Popen([*TORCHRUN, "train.py", "--config", TINY, *_run_overrides(run_dir, tiny_model),
                              "trainer.eval_freq=0", "trainer.save_freq=0", "trainer.export_hf=false",
                              "data_source.num_prompts=20", "trainer.total_steps=5", "rollout.launch=none",
                              f"rollout.servers=[{url}]"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err_file,
                             text=True, start_new_session=True)
    try:
        _wait_steps(str(run_dir), 1, p)
        handle.proc.kill()
        handle.proc.wait(10)
        # Its absence seen: by the rollout if a request was in flight, else by the trainer's next sync, which
        # waits for a server to answer /model_info (which of the two comes first is a race, both are fine).
        _wait_log(run_dir / "logs" / "rollout.log", f"inference server {url} does not answer", p, 60.0,
                  (trainer_err, "no inference server answers /model_info"))
        url, handle = engine.launch(tiny_model, port=port, weight_version=0)
        p.wait(timeout=180)
        err = open(trainer_err, errors="replace").read()
        version = requests.get(url + "/model_info", timeout=10).json()["weight_version"]
    finally:
        handle.stop()
    assert p.returncode == 0, err[-3000:]
    assert version == "5", version  # the restarted server got the weights of every sync after its return
    rows = [row for row in _read_rows(run_dir) if row["step"] > 0]
    trained = sorted(tuple(pid) for row in rows for pid in row["data/prompt_ids"])
    assert trained == [(0, i) for i in range(20)], trained
    assert sum(row["rollout/failed_count"] for row in rows) == 0
    assert rows[-1]["rollout/server_restarts"] == 0  # nothing was launched here


# ---------------------------------------------------------------------------------------------------------------
# Multi-process checks: this file runs as a script under torchrun

def _torchrun_self(mode: str, args: dict, timeout: float = 240) -> dict:
    p = subprocess.run([*TORCHRUN, os.path.abspath(__file__), mode, json.dumps(args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, start_new_session=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def actor_checks(tmp_path_factory, tiny_model) -> dict:
    """One torchrun (one start-up) for the snapshot and weight-sync checks, each on a fresh model from model.path."""
    return _torchrun_self("actor", {"model": tiny_model, "run_dir": str(tmp_path_factory.mktemp("actor")),
                                    "port": services_lib.free_port(), "master_port": services_lib.free_port(),
                                    "variants": [[], ["trainer.cpu_offload=true", "trainer.snapshot=cpu"],
                                                 ["rollout.sampling.top_p=0.8", "rollout.sampling.top_k=30"]]})


def test_old_policy_snapshot_gives_step_start_log_probs(actor_checks):
    """First call of a step: the training forward's log-probs are the old ones. Second call: old log-probs equal the
    step-start weights' (not the updated ones); after it the live weights are back. The same with the snapshot in host memory and FSDP2's CPU offload (CPUOffloadPolicy
    without pinning, which needs an accelerator), whose update is the same as the plain one's."""
    plain, offload, _ = actor_checks["snapshot"]
    for r in (plain, offload):
        # the first call's old log-probs are its training forward's, detached (no dropout): the ratio is exactly 1
        assert r["reused"] and r["first_call_kl"] == 0.0
        assert r["old_vs_step_start"] < 1e-6
        assert r["live_vs_step_start"] > 1e-3  # the first call's update changed the policy
        assert r["live_after_vs_before"] < 1e-6
    assert offload["offloaded"] and not plain["offloaded"]
    assert offload["live"] == pytest.approx(plain["live"], abs=1e-5)  # the same training step


def test_top_p_snapshot_and_mu_are_renormalised_over_the_same_support(actor_checks):
    """rollout.sampling.top_p=0.8, top_k=30: the snapshot's log-probs are the step-start weights' over the support
    (logprobs.Support), and the whole vocabulary's log-probs of the step-start weights (what an engine on them
    reports as mu), renormalised by pi_old's support mass, equal pi_old: train/rollout_logprob_diff_max ~0 at the
    first call, where without the renormalisation it would be the largest |log mass| (> 0.01 here)."""
    r = actor_checks["snapshot"][2]
    assert r["reused"] and r["first_call_kl"] == 0.0
    assert r["old_vs_step_start"] < 1e-6 and r["live_vs_step_start"] > 1e-3
    assert r["first_call_diff"] < 1e-5 and r["mass_outside"] > 1e-2


def test_weight_sync_engine_log_probs_equal_trainer_log_probs(actor_checks):
    r = actor_checks["sync"]
    for method in ("distributed", "tensor", "disk"):
        m = r[method]
        assert m["before_sync"] > 1e-3, m  # the trainer's weights had moved away from the engine's
        assert m["after_sync"] < 1e-4, m  # float32, same weights, same convention
        assert m["tokens"] >= 4 and m["weight_version"] == m["version"]
    from standins import engine  # the trainer fails fast with the server's message, not after weight_sync.timeout_s (600 s)
    assert engine.SESSION_REQUIRED in r["no_session"]["error"] and r["no_session"]["seconds"] < 5, r["no_session"]


def test_a_checkpoint_write_that_fails_on_one_rank_stops_every_rank_and_the_previous_one_loads(actor_checks):
    """checkpoint.save: rank 1's shard cut short by the kernel (EFBIG under RLIMIT_FSIZE), then rank 0's commit
    failing: both ranks raise the same one-line CheckpointWriteError (naming the directory, the error and the free
    space), the .tmp is removed, resume=auto's pick stays step 1, which loads; keep_checkpoints=2 keeps 3 and 4."""
    r = actor_checks["ckpt"]
    efbig, commit = r["errors"]
    first = os.path.join(r["ckpt_root"], "step_000001")
    assert efbig["errors"][0] == efbig["errors"][1] is not None, efbig
    line = efbig["errors"][0]
    assert "\n" not in line and line.startswith(f"writing checkpoint {efbig['tmp']} failed on rank 1: "), line
    assert "(rank 1 runs under a file size limit, ulimit -f, of " in line, line
    free = line.split(" free of ")[0].rsplit("(", 1)[1]  # e.g. "55.61 GiB"
    assert float(free.split()[0]) > 0 and free.split()[1] in ("B", "KiB", "MiB", "GiB", "TiB"), line
    assert "trainer.keep_checkpoints (now 2)" in line
    assert f"trainer.resume=auto continues from the newest complete checkpoint, {first};" in line
    assert commit["errors"][0] == commit["errors"][1] is not None and "failed on rank 0: " in commit["errors"][0]
    for e in (efbig, commit):
        assert not e["tmp_left"] and e["latest"] == first, e
    assert r["loaded_step"] == 1 and r["shard_bytes"] > 100_000
    assert r["kept"] == ["step_000003", "step_000004"], r["kept"]


def test_kl_to_start_is_0_at_the_start_grows_with_updates_and_a_resumed_run_logs_the_same(actor_checks):
    """train/kl_to_start (actor.KLProbe, logprobs.kl_rows) on 2 FSDP ranks: trainer.kl_probe_tokens=20 positions
    from the first call's groups, one trajectory per group in turn (the first two from the two groups' prompts),
    skipping the masked-out tool token; its pi_0 logits on rank 0 alone, equal to the whole forward's at those
    positions (and so are the packed layout's); KL exactly 0 at pi_0 and > 0 after each step's updates, logged by the
    step's last call only, on rank 0 only; a run resumed from the checkpoint after step 2 restores the set and pi_0
    (rank 0) and logs at step 4 what the uninterrupted run logs there; trainer.kl_probe_every=2 skips step 3."""
    r0, r1 = actor_checks["kl"]["rank0"], actor_checks["kl"]["rank1"]
    assert r0["positions"] == 20 and r0["prompts"][0] != r0["prompts"][1] and r0["prompts"] == r1["prompts"], r0
    assert r0["ref_shape"][0] == 20 and r1["ref_shape"] is None and r0["taken_s"] > 0 and r1["taken_s"] > 0
    assert r0["ref_vs_full"] < 1e-5 and r0["packed_vs_full"] < 1e-4, r0
    assert r0["at_start"] == 0.0 and r1["at_start"] is None
    assert all(first is None and kl > 1e-6 for first, kl in r0["kl"]), r0["kl"]
    assert all(row == [None, None] for row in r1["kl"]) and r0["probe_s"] > 0 and r0["same_probe"]
    assert r0["resumed_seqs_equal"] and r1["resumed_seqs_equal"] and r0["resumed_ref"]
    assert r1["resumed_ref_other_rank"] is None
    assert r0["resumed_kl"][0] == [None, None] and r0["resumed_kl"][1][0] is None, r0["resumed_kl"]
    assert r0["resumed_kl"][1][1] == pytest.approx(r0["uninterrupted_4"], rel=1e-5, abs=1e-7), r0
    assert r0["uninterrupted_4"] > r0["kl"][0][1]  # lr 0.01 on the same batch: the policy moves on


def test_a_push_that_fails_on_rank_0_only_is_agreed_on_and_retried(actor_checks):
    """weight_sync.WeightSync.push's status collective and WeightSync._push_agreed: rank 0's injected error is
    returned on both ranks, and the retry brings the engine to the trainer's weights (both ranks ran it bucket for bucket)."""
    for method, r in actor_checks["sync"]["fault"].items():
        assert r["faults"] >= 1 and r["error"] is not None and "injected fault on rank 0" in r["error"], (method, r)
        assert r["agreed"] == [True, True], (method, r)
        assert r["after_retry"] < 1e-4 and r["weight_version"] == r["version"], (method, r)


_CTRL = None


def _script_setup(args, overrides=()):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    global _CTRL
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        _CTRL = dist.new_group(backend="gloo")  # train.py's control group
    rank = dist.get_rank()
    cfg = config.load_config(TINY, [f"model.path={args['model']}", f"run_dir={args['run_dir']}", "trainer.lr=0.01",
                                    "trainer.mini_batch_size=128",  # several training calls per step: a snapshot
                                    f"rollout.base_port={args.get('port', 31000)}",
                                    f"weight_sync.master_port={args.get('master_port', 29700)}",
                                    "weight_sync.master_address=127.0.0.1", *overrides])
    model, _ = model_lib.load_model(cfg, init_device_mesh("cpu", (2,)), torch.device("cpu"), rank, _CTRL)
    opt, sched = model_lib.build_optimizer(model, cfg.trainer)
    return cfg, rank, actor_lib.Actor(cfg, model, opt, sched, torch.device("cpu"), _CTRL)


@torch.no_grad()
def _log_probs(actor, batch, temperature=1.0, support=None):
    import logprobs

    logits = actor.model(input_ids=batch["ids"], attention_mask=batch["attn"]).logits[:, :-1]
    model_lib.reshard(actor.model)
    return logprobs.token_logprobs(logits, batch["ids"][:, 1:], temperature, support=support)[0] * batch["mask"]


def _actor_script(args):
    """The multi-process checks of the actor: _snapshot_checks, then _sync_checks (rank 0 prints their results)."""
    import torch.distributed as dist

    results = {"snapshot": _snapshot_checks(args), "sync": _sync_checks(args), "ckpt": _checkpoint_fault_checks(args),
               "kl": _kl_probe_checks(args)}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.barrier()  # both ranks tear their groups down together (see train.main), after rank 0 stopped the engine
    dist.destroy_process_group()


def _snapshot_checks(args) -> list:
    results = []
    import logprobs

    for overrides in args["variants"]:  # each from model.path's weights, with a new optimizer
        cfg, rank, actor = _script_setup(args, overrides)
        support = logprobs.Support(cfg.rollout.sampling.top_k, cfg.rollout.sampling.top_p)
        g = torch.Generator().manual_seed(0)  # the same data on both ranks and in every variant
        seqs = [{"prompt": torch.randint(3, 90, (5,), generator=g).tolist(),
                 "response": torch.randint(3, 90, (6,), generator=g).tolist(), "mask": [1] * 6,
                 "rollout_lp": [-2.0] * 6, "versions": [0] * 6, "adv": 1.0 if i % 2 else -1.0} for i in range(8)]
        first, second = batching.collate(seqs[4:]), batching.collate(seqs[:4])
        if support.truncates():  # what an engine on the step-start weights reports: the whole vocabulary's
            second["rollout_lp"] = _log_probs(actor, second)
        step_start = _log_probs(actor, first, support=support)
        first_call = actor.train_plan([second], step=0, denom=24.0)  # first call of step 0: snapshot, then an update
        live = _log_probs(actor, first, support=support)
        old = actor._old_log_probs([first], step=0)[0][0]  # a later call of step 0: its log-probs
        after = _log_probs(actor, first, support=support)
        results.append({"old_vs_step_start": float((old * first["mask"] - step_start).abs().max()),
                        "live_vs_step_start": float((live - step_start).abs().max()),
                        "live_after_vs_before": float((after - live).abs().max()),
                        "first_call_kl": first_call["train/approx_kl"], "reused": actor.old.train_forward_is_old,
                        "first_call_diff": first_call["train/rollout_logprob_diff_max"],
                        "mass_outside": first_call.get("train/sampling_mass_outside"),
                        "live": live.flatten().tolist(), "offloaded": actor.model.model.layers[0]
                        ._get_fsdp_state()._fsdp_param_group.fsdp_params[0].offload_to_cpu})
    return results


def _sync_checks(args) -> dict:
    import requests
    import torch.distributed as dist


    import sglang_client

    cfg, rank, actor = _script_setup(args)
    services = services_lib.Services(cfg) if rank == 0 else None
    results = {}
    try:
        if rank == 0:
            urls = services.launch_fleet(0)
            actor.fleet = services.fleet = sglang_client.SyncFleet(  # the launched servers' key (services.key_file)
                sglang_client.Fleet(urls, api_key_file=cfg.rollout.sglang_args.api_key_file))
        for version, method in ((1, "distributed"), (2, "tensor"), (3, "disk")):
            cfg.weight_sync.method = method
            with torch.no_grad():  # move the trainer's weights away from the engine's
                model_lib.reshard(actor.model)
                gen = torch.Generator().manual_seed(version * 10 + rank)
                for p in actor.model.parameters():
                    local = p.to_local()
                    local.add_(torch.randn(local.shape, generator=gen) * 0.05)

            def engine_vs_trainer():
                msg = [None]
                if rank == 0:
                    out = requests.post(urls[0] + "/generate", timeout=60, headers=actor.fleet.fleet.headers, json={
                        "input_ids": [5, 6, 7, 8, 9], "return_logprob": True,
                        "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}}).json()
                    msg = [{"ids": out["output_ids"], "lp": [x[0] for x in out["meta_info"]["output_token_logprobs"]],
                            "version": out["meta_info"]["weight_version"]}]
                dist.broadcast_object_list(msg, src=0, group=_CTRL)
                s = {"prompt": [5, 6, 7, 8, 9], "response": msg[0]["ids"], "mask": [1] * len(msg[0]["ids"]),
                     "rollout_lp": msg[0]["lp"], "versions": [0] * len(msg[0]["ids"]), "adv": 0.0}
                b = batching.collate([s])
                ours = _log_probs(actor, b)
                return float(((ours - b["rollout_lp"]) * b["mask"]).abs().max()), msg[0]

            before, _ = engine_vs_trainer()
            assert actor.weights._push_agreed(version) is None  # lockstep on both ranks, as in train.py's loop
            after, msg = engine_vs_trainer()
            results[method] = {"before_sync": before, "after_sync": after, "tokens": len(msg["ids"]),
                               "weight_version": msg["version"], "version": str(version)}
        results["fault"] = _push_fault_checks(cfg, rank, actor, engine_vs_trainer)
        if rank == 0:  # a bucket pushed outside a session: the server refuses it without joining the broadcast
            import weight_sync

            t0 = time.monotonic()
            cfg.weight_sync.method = "distributed"
            name, param = next(iter(actor.model.named_parameters()))  # (full_tensor would be a collective)
            bucket = weight_sync.Bucket([(None, [(name, tuple(param.shape))])], torch.float32, torch.device("cpu"))
            transport = actor.weights.distributed
            err = transport.finish(transport.start(bucket, 4, None), None)
            results["no_session"] = {"error": str(err), "seconds": time.monotonic() - t0}
    finally:
        if services is not None:
            services.close(ok=False)
    return results


def _checkpoint_fault_checks(args) -> dict:
    """checkpoint.save with a write that fails on one rank only: rank 1 under a file-size limit (RLIMIT_FSIZE, half
    its shard: the kernel fails the write partway, EFBIG), then rank 0's commit (a run state that does not pickle).
    Each time both ranks raise CheckpointWriteError with the same line and neither waits in a collective; the failed
    .tmp is gone and step 1 still loads on both ranks. With trainer.keep_checkpoints=2 the fourth save leaves two."""
    import resource

    import torch.distributed as dist

    cfg, rank, actor = _script_setup(args, ["trainer.keep_checkpoints=2"])
    cfg.run_dir = args["run_dir"] + "/ckpt"
    actor.ckpt_root = os.path.join(cfg.run_dir, "checkpoints")
    state = {"step": 1, "weight_version": 1, "buffer": {"data": [1, 2]}}
    actor.save_checkpoint(1, state if rank == 0 else None)
    first = os.path.join(actor.ckpt_root, "step_000001")
    shard = os.path.getsize(os.path.join(first, f"__{rank}_0.distcp"))
    out = {"shard_bytes": shard, "errors": []}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    for steps, run_state in ((2, state), (3, {**state, "unpicklable": lambda: None})):
        limited = steps == 2 and rank == 1
        if limited:
            resource.setrlimit(resource.RLIMIT_FSIZE, (shard // 2, hard))
        try:
            actor.save_checkpoint(steps, run_state if rank == 0 else None)
            error = None
        except checkpoint.CheckpointWriteError as e:
            error = str(e)
        finally:
            if limited:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        errors = [None, None]
        dist.all_gather_object(errors, error, group=_CTRL)
        tmp = os.path.join(actor.ckpt_root, f"step_{steps:06d}.tmp")
        out["errors"].append({"errors": errors, "tmp_left": os.path.exists(tmp), "tmp": tmp,
                              "latest": checkpoint.latest_checkpoint(cfg.run_dir)})
    out["loaded_step"] = actor.load_checkpoint(first)["step"]  # the previous checkpoint, on both ranks
    for steps in (2, 3, 4):
        actor.save_checkpoint(steps, state if rank == 0 else None)
    dist.barrier(group=_CTRL)
    out["kept"] = sorted(os.listdir(actor.ckpt_root))
    out["ckpt_root"] = actor.ckpt_root
    return out


def _kl_groups(seed: int) -> list:
    """Two training calls' groups (2 groups of 4 trajectories each), the same on both ranks: responses of 6 tokens
    with a loss mask that leaves out a tool-output token, rewards that give every group an advantage."""
    import buffer as buffer_lib

    g = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(4):
        prompt = torch.randint(3, 90, (5,), generator=g)
        trajs = [buffer_lib.Trajectory(epoch=0, seq=k, index=i, prompt_ids=prompt,
                                       response_ids=torch.randint(3, 90, (6,), generator=g),
                                       rollout_log_probs=torch.full((6,), -2.0),
                                       versions=torch.zeros(6, dtype=torch.long),
                                       loss_mask=torch.tensor([1, 1, 0, 1, 1, 1]), reward=float(i % 2))
                 for i in range(4)]
        groups.append(buffer_lib.Group(buffer_lib.PromptGroup(0, k, k, prompt), trajs))
    return groups


def _kl_probe_checks(args) -> dict:
    """actor.KLProbe on 2 ranks (2 training calls a step): the probe set and pi_0 taken at the run's first call, 0
    at pi_0, > 0 after updates; its logits are the full forward's at the probe positions, packed or padded; a run
    resumed from the checkpoint after step 2 logs at step 4 what the uninterrupted run logs there; every=2 skips odd
    steps."""
    import dataclasses

    import torch.distributed as dist

    overrides = ["data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=4",
                 "trainer.mini_batch_size=8", "trainer.kl_probe_tokens=20", "rollout.sampling.temperature=0.8"]
    cfg, rank, actor = _script_setup(args, overrides)
    assert cfg.calls_per_step == 2
    actor.ckpt_root = os.path.join(args["run_dir"], "kl", "checkpoints")
    groups = _kl_groups(0)
    calls = (groups[:2] if rank == 0 else None, groups[2:] if rank == 0 else None)
    out = {"taken_s": actor.take_probe(calls[0]), "at_start": actor.kl_to_start().get("train/kl_to_start")}
    probe = actor.probe
    out["positions"] = sum(sum(s["mask"]) for s in probe.seqs)
    out["prompts"] = [s["prompt"] for s in probe.seqs]
    out["ref_shape"] = None if probe.ref is None else list(probe.ref.shape)  # pi_0: on rank 0 only
    with torch.no_grad():  # the whole forward's logits at the probe positions
        b = batching.collate(probe.seqs)
        full = actor.model(input_ids=b["ids"], attention_mask=b["attn"]).logits[:, :-1][b["mask"] > 0]
        model_lib.reshard(actor.model)
    packed = probe.logits(actor.model, dataclasses.replace(cfg.trainer, packing=True), torch.device("cpu"))
    if rank == 0:
        out["ref_vs_full"] = float((probe.ref - full).abs().max())
        out["packed_vs_full"] = float((packed - full).abs().max())
    kl = []
    for step in range(3):
        rows = [actor.train_minibatch(c, step) for c in calls]
        kl.append([r.get("train/kl_to_start") for r in rows])
        if step == 1:
            actor.save_checkpoint(2, {"step": 2, "weight_version": 2, "buffer": {}} if rank == 0 else None)
    out["kl"], out["probe_s"] = kl, rows[-1].get("timing/kl_probe")
    out["same_probe"] = probe is actor.probe  # step 0's first call keeps the set taken above
    _, _, resumed = _script_setup(args, overrides)
    resumed.cfg.trainer.kl_probe_every = 2
    resumed.load_checkpoint(os.path.join(actor.ckpt_root, "step_000002"))
    out["resumed_seqs_equal"] = resumed.probe.seqs == probe.seqs
    out["resumed_ref"] = rank != 0 or torch.equal(resumed.probe.ref, probe.ref)
    out["resumed_ref_other_rank"] = None if rank == 0 else resumed.probe.ref
    # step 2 (logged as 3): not a multiple of 2; step 3 (logged as 4), measured, then the same under actor: 3 steps
    out["resumed_kl"] = [[r.get("train/kl_to_start") for r in (resumed.train_minibatch(c, step) for c in calls)]
                         for step in (2, 3)]
    actor.train_minibatch(calls[0], 3)
    out["uninterrupted_4"] = actor.train_minibatch(calls[1], 3).get("train/kl_to_start")
    gathered = [None, None]
    dist.all_gather_object(gathered, out, group=_CTRL)
    return {"rank0": gathered[0], "rank1": gathered[1]}


def _push_fault_checks(cfg, rank, actor, engine_vs_trainer) -> dict:
    """A push that fails on rank 0 only, in its second bucket: waiting for a broadcast raises, as on a group a
    dead server left (distributed), a payload that does not serialize (tensor). Both ranks must leave the push together and agree
    that it failed (the status collective), so that the retry (rank 0 drops the group, both push again) pairs
    bucket for bucket; without that the ranks are a bucket apart and the retry hangs."""
    import torch.distributed as dist

    import sync_tensor

    cfg.weight_sync.bucket_mb = 0  # one FSDP unit per bucket: the fault lands mid-push
    out = {}
    for version, method in ((5, "distributed"), (6, "tensor")):
        cfg.weight_sync.method = method
        with torch.no_grad():
            model_lib.reshard(actor.model)
            gen = torch.Generator().manual_seed(version * 10 + rank)
            for p in actor.model.parameters():
                p.to_local().add_(torch.randn(p.to_local().shape, generator=gen) * 0.05)
        calls = [0]
        owner, name = (dist, "broadcast") if method == "distributed" else (sync_tensor, "serialize_named_tensors")
        real = getattr(owner, name)

        class FailingWait:  # the broadcast reached the server; waiting for it raises, as on a broken group
            def __init__(self, work):
                self.work = work

            def is_completed(self):
                return self.work.is_completed()

            def wait(self):
                self.work.wait()
                raise RuntimeError("injected fault on rank 0")

        def faulty(*a, **k):
            if method == "tensor":
                calls[0] += 1
                if calls[0] == 2:  # the second bucket's payload
                    raise RuntimeError("injected fault on rank 0")
            elif k.get("group") is actor.weights.distributed.group:
                calls[0] += 1
                if calls[0] == 2:  # the second bucket's broadcast (one per bucket: load_format flattened_bucket)
                    return FailingWait(real(*a, **k))
            return real(*a, **k)

        if rank == 0:
            setattr(owner, name, faulty)
        try:
            error = actor.weights._push_agreed(version)  # every rank learns that it failed (rank 0's error)
        finally:
            setattr(owner, name, real)
        agreed = [None, None]
        dist.all_gather_object(agreed, error is not None, group=_CTRL)
        error = None if error is None else str(error)
        if rank == 0 and method == "distributed":
            actor.weights.distributed.drop()  # what WeightSync.sync's retry does (the tensor path has no group)
        assert actor.weights._push_agreed(version) is None
        after, msg = engine_vs_trainer()
        out[method] = {"error": error, "agreed": agreed, "faults": calls[0], "after_retry": after,
                       "weight_version": msg["version"], "version": str(version)}
    cfg.weight_sync.bucket_mb = 512
    return out


# ---------------------------------------------------------------------------------------------------------------
# The real sglang-router (requirements-dev.txt) in front of two standins/engine.py servers

def test_fully_async_run_through_sglang_router_updates_every_worker(tmp_path, tiny_model):
    """The router forwards /generate and lists its workers (GET /workers); pauses, weight-update sessions and
    broadcasts go to each worker. After 3 steps both report weight version 3."""
    import requests

    from standins import engine

    pytest.importorskip("sglang_router")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both start at once: each start is one core's work
        servers = list(pool.map(lambda _: engine.launch(tiny_model, num_threads=1), range(2)))
    port = services_lib.free_port()
    router = subprocess.Popen([PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                               "--worker-urls", *[u for u, _ in servers], "--policy", "round_robin",
                               "--log-level", "warn"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        router_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, router.stdout.read()[-3000:]
            try:
                if len(requests.get(router_url + "/workers", timeout=2).json()["workers"]) == 2:
                    break
            except (requests.RequestException, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, "the router did not list both workers within 60 s"
            time.sleep(0.2)
        run_dir = tmp_path / "run"
        p = subprocess.run([PY, "train.py", "--config", TINY, *_run_overrides(run_dir, tiny_model),
                            "trainer.num_gpus_per_node=1", "trainer.total_steps=3", "trainer.eval_freq=0",
                            "trainer.save_freq=0", "trainer.export_hf=false", f"rollout.router_url={router_url}",
                            "weight_sync.master_address=127.0.0.1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=180, start_new_session=True)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
        assert [row["step"] for row in _read_rows(run_dir)] == [1, 2, 3]
        assert [requests.get(u + "/model_info", timeout=5).json()["weight_version"] for u, _ in servers] == ["3", "3"]
    finally:
        router.terminate()
        router.wait(15)
        for _, handle in servers:
            handle.stop()


# ---------------------------------------------------------------------------------------------------------------
# End to end: SIGKILL at a random point, the newest checkpoint truncated, resume=auto, then the whole epoch was
# trained exactly once

@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, tiny_model):
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    args = [*TORCHRUN, "train.py", "--config", TINY, *_run_overrides(run_dir, tiny_model), "trainer.keep_checkpoints=2"]
    seed = random.randrange(10 ** 6)
    rng = random.Random(seed)
    kill_after = rng.randint(2, 4)  # complete checkpoints to wait for, then a random extra delay (< 4 steps)
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    deadline = time.monotonic() + 240
    while True:
        ck = checkpoint.latest_checkpoint(str(run_dir))
        if ck and int(ck.rsplit("_", 1)[1]) >= kill_after:
            break
        assert p.poll() is None and time.monotonic() < deadline, (seed, p.stdout.read()[-3000:] if p.poll() else "")
        time.sleep(0.1)
    time.sleep(rng.uniform(0.0, 0.5))
    # A second run started in the same run_dir while this one is live (held still, so that its files can be compared):
    # refused at once naming rank 0, which holds run_dir's lock, and this run's metrics and checkpoints byte-identical
    run = _pids(str(run_dir))
    for pid in run:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    before = _files(run_dir)
    holder = json.load(open(os.path.join(run_dir, "run.lock")))
    t0 = time.monotonic()
    second = subprocess.run([PY, "train.py", "--config", TINY, *_run_overrides(run_dir, tiny_model),
                             "trainer.num_gpus_per_node=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    second = {"code": second.returncode, "err": second.stderr, "s": time.monotonic() - t0, "holder": holder,
              "run": run, "same": _files(run_dir) == before, "files": sorted(before)}
    # The whole run at once, as a lost node: torchrun, and the ranks and rank 0's children, which run in sessions of
    # their own (a killpg of torchrun's group alone would leave the ranks training on, orphaned, beside the resume).
    # The launched server survives by design (lease.py) and is taken over by the resumed run.
    run = _pids(str(run_dir))
    os.killpg(p.pid, signal.SIGKILL)
    for pid in run:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL, (seed, "the run ended before it was killed")
    assert _wait_session_gone(p.pid), "SIGKILL left processes of the run behind"
    assert _wait_gone(str(run_dir)), (seed, "processes of the run outlived its SIGKILL", _pids(str(run_dir)))
    ckpts_at_kill = _ckpts(run_dir)
    newest = checkpoint.latest_checkpoint(str(run_dir))
    _truncate(os.path.join(newest, "run_state.pt"))  # as if the disk filled: resume falls back to the one before
    killed_at = int(newest.rsplit("_", 1)[1]) - 1
    p2 = subprocess.run([*args, "trainer.resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                        start_new_session=True)
    assert p2.returncode == 0, (seed, p2.stdout[-3000:] + p2.stderr[-5000:])
    assert f"skipping checkpoint {newest}: run_state.pt does not load" in p2.stderr, (seed, p2.stderr[-3000:])
    return {"run_dir": str(run_dir), "killed_at": killed_at, "seed": seed, "out": p2.stdout,
            "rows": _read_rows(run_dir), "ckpts_at_kill": ckpts_at_kill, "ckpts": _ckpts(run_dir), "second": second}


def _files(run_dir) -> dict:
    """{path: bytes} of metrics.jsonl and every file under checkpoints/."""
    paths = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(run_dir, "checkpoints")) for n in names]
    return {p: open(p, "rb").read() for p in [os.path.join(run_dir, "metrics.jsonl"), *paths]}


def test_a_second_run_beside_a_live_one_is_refused_and_its_files_stay_byte_identical(resumed_run):
    """rundir.py: a fresh run started in the run_dir of a live run (the fixture's first run, held still) exits 2 in one
    sentence naming the directory and the holder (trainer rank 0 of the live run, by pid and host), within a few
    seconds; metrics.jsonl and every checkpoint file of the live run are byte-identical afterwards. Every checkpoint
    carries the run id of run_dir/run.json, which the resume kept."""
    r, s = resumed_run, resumed_run["second"]
    assert s["code"] == 2, s["err"][-3000:]
    lines = [ln for ln in s["err"].splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and f"run_dir {r['run_dir']} is in use by run {s['holder']['run_id']} (pid " \
        f"{s['holder']['pid']} on {socket.gethostname()}" in lines[0], s["err"][-3000:]
    assert s["holder"]["pid"] in s["run"] and s["s"] < 60, s
    assert s["same"] and any("step_" in f for f in s["files"]), s["files"]
    run_id = json.load(open(os.path.join(r["run_dir"], "run.json")))["run_id"]
    assert s["holder"]["run_id"] == run_id
    for ck in checkpoint.steps_of(os.path.join(r["run_dir"], "checkpoints")):
        assert checkpoint.load_run_state(ck[1])["run_id"] == run_id, ck


def test_keep_checkpoints_2_leaves_the_newest_two_and_the_one_before_the_newest_resumes(resumed_run):
    """trainer.keep_checkpoints=2, a checkpoint every step: killed at a random moment, the run had at most three
    complete checkpoints (two, plus a new one not yet pruned) and at most one .tmp; with the newest made unusable,
    resume=auto ran from the other (the fixture); at the end two remain, steps 7 and 8, and no .tmp."""
    r = resumed_run
    complete = [c for c in r["ckpts_at_kill"] if not c.endswith(".tmp")]
    assert 2 <= len(complete) <= 3 and len(r["ckpts_at_kill"]) - len(complete) <= 1, (r["seed"], r["ckpts_at_kill"])
    assert r["ckpts"] == ["step_000007", "step_000008"], (r["seed"], r["ckpts"])


def test_prune_keeps_the_newest_and_never_a_later_one(tmp_path):
    """checkpoint.prune after step 5 is committed, keep=2: steps 1-3 go (oldest first), 4 and 5 stay, as does step
    12 (a later run's, resume=auto's pick: never removed), numbers compared as numbers (step 1000000 > 999999); every
    .tmp goes; keep=0 removes only the .tmp."""
    root = str(tmp_path)
    for name in ("step_000001", "step_000002", "step_000003", "step_000004", "step_000005", "step_000006.tmp",
                 "step_000012", "step_000009.tmp"):
        os.makedirs(os.path.join(root, name))
    removed = checkpoint.prune(root, 0, os.path.join(root, "step_000005"))
    assert sorted(os.path.basename(p) for p in removed) == ["step_000006.tmp", "step_000009.tmp"]
    removed = checkpoint.prune(root, 2, os.path.join(root, "step_000005"))
    assert [os.path.basename(p) for p in removed] == ["step_000001", "step_000002", "step_000003"]
    assert sorted(os.listdir(root)) == ["step_000004", "step_000005", "step_000012"]
    for name in ("step_999999", "step_1000000"):
        os.makedirs(os.path.join(root, name))
    assert checkpoint.newest_complete(root).endswith("step_1000000")
    checkpoint.prune(root, 1, os.path.join(root, "step_1000000"))
    assert os.listdir(root) == ["step_1000000"]


def test_preemption_reads_torchruns_grace_and_warns_once_when_a_step_and_a_checkpoint_exceed_it(monkeypatch, capsys):
    """preemption.grace_s: torchrun's --shutdown-timeout from the parent's command line (up to the training script),
    else PET_SHUTDOWN_TIMEOUT, else 30; None outside torchrun. stop_here (alone: no group) reads the local flag, and
    rank 0 warns once when the longest step period plus the last checkpoint exceed the grace."""
    import preemption

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert preemption.grace_s() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "40")
    code = "import time; time.sleep(60)"
    for args, grace in ((["--shutdown-timeout", "75", "train.py"], 75.0), (["--shutdown_timeout=90", "train.py"], 90.0),
                        (["train.py", "--shutdown-timeout", "5"], 40.0)):  # the last: the script's own argument
        parent = subprocess.Popen([PY, "-c", code, *args])
        try:
            monkeypatch.setattr(os, "getppid", lambda: parent.pid)
            deadline = time.monotonic() + 10  # until the child's command line is its own (after exec)
            while "train.py" not in open(f"/proc/{parent.pid}/cmdline").read():
                assert time.monotonic() < deadline, "the stand-in parent did not start"
                time.sleep(0.01)
            assert preemption.grace_s() == grace, args
        finally:
            parent.kill()
            parent.wait()
    monkeypatch.setattr(os, "getppid", lambda: os.getpid())  # pytest's own command line: no such flag
    assert preemption.grace_s() == 40.0
    monkeypatch.delenv("PET_SHUTDOWN_TIMEOUT")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert preemption.grace_s() == 30.0
    monkeypatch.setattr(preemption, "_state", _fresh_preemption_state(in_steps=True))
    monkeypatch.setattr(checkpoint, "last_save_s", 12.0)
    assert preemption.stop_here(None, 1, 5) is False
    preemption._state["last_call"] -= 25.0  # a step period of 25 s: 25 + 12 > 30
    assert preemption.stop_here(None, 2, 5) is False
    preemption._state.update(at=time.monotonic(), signal=signal.SIGTERM)  # a SIGTERM arrived
    assert preemption.stop_here(None, 3, 5) is True and preemption.stopped()
    assert preemption.stop_here(None, 5, 5) is False  # the last step ends the run anyway (its eval and export too)
    captured = capsys.readouterr()
    assert captured.err.count("[train] warning: after a SIGTERM or Ctrl-C this run needs up to 37 s") == 1, \
        captured.err
    assert "more than torchrun's grace of 30 s" in captured.err and "--shutdown-timeout 80" in captured.err
    assert "[train] SIGTERM 0.0 s ago: checkpointing step 3, then the run stops (exit 0)" in captured.out


def _fresh_preemption_state(in_steps: bool) -> dict:
    return {"at": None, "signal": None, "in_steps": in_steps, "stopped": False, "step": None, "last_call": None,
            "period": 0.0, "warned": False}


def test_a_second_ctrl_c_stops_at_once_and_a_second_sigterm_does_not(monkeypatch, capfd):
    """preemption's handler (called as the signal would call it): in the step loop the first SIGINT only sets the
    flag stop_here reads; a second SIGINT, or the SIGTERM torchrun sends for a second Ctrl-C, raises Interrupted
    (exit 130) with rank 0's line naming the command that continues; a SIGTERM after a SIGTERM leaves the stop under
    way; outside the loop the first SIGINT raises Preempted (exit 0)."""
    import preemption

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANK", "0")
    for second in (signal.SIGINT, signal.SIGTERM):
        monkeypatch.setattr(preemption, "_state", _fresh_preemption_state(in_steps=True))
        preemption._on_signal(signal.SIGINT, None)
        assert preemption.requested() and not preemption.stopped() and capfd.readouterr().err == ""
        with pytest.raises(preemption.Interrupted) as e:
            preemption._on_signal(second, None)
        assert e.value.code == 130
        err = capfd.readouterr().err
        assert err.startswith(f"[train] {preemption.NAMES[second]} after SIGINT (Ctrl-C): stopping now, without a "
                              "checkpoint; to continue from the newest checkpoint: ") and \
            err.endswith(" trainer.resume=auto\n"), err
    monkeypatch.setattr(preemption, "_state", _fresh_preemption_state(in_steps=True))
    preemption._on_signal(signal.SIGTERM, None)
    preemption._on_signal(signal.SIGTERM, None)  # a scheduler's second notice: the stop under way goes on
    assert preemption.stop_here(None, 3, 5) is True and capfd.readouterr().err == ""
    monkeypatch.setattr(preemption, "_state", _fresh_preemption_state(in_steps=False))
    with pytest.raises(preemption.Preempted) as e:
        preemption._on_signal(signal.SIGINT, None)
    assert e.value.code == 0
    assert capfd.readouterr().err.startswith("[train] SIGINT (Ctrl-C) outside the step loop (start-up or shut-down): "
                                             "stopping now; to continue from the newest checkpoint: ")


def test_the_command_to_continue_is_torchruns_with_resume_auto_in_place_of_resume_and_overwrite(monkeypatch,
                                                                                                tmp_path):
    """preemption.resume_command under torchrun: the parent's command line as typed (`torchrun ...`, not the
    interpreter its script names), its trainer.resume / trainer.overwrite replaced by trainer.resume=auto."""
    import preemption

    script = tmp_path / "torchrun"
    script.write_text("import time; time.sleep(60)\n")
    args = ["--standalone", "--nproc_per_node", "2", "train.py", "--config", "configs/tiny.yaml", "seed=1",
            "trainer.overwrite=true", "trainer.resume=none", "rollout.filter=[failed]"]
    parent = subprocess.Popen([PY, str(script), *args])
    try:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
        monkeypatch.setattr(os, "getppid", lambda: parent.pid)
        deadline = time.monotonic() + 10  # until the child's command line is its own (after exec)
        while "train.py" not in open(f"/proc/{parent.pid}/cmdline").read():
            assert time.monotonic() < deadline, "the stand-in parent did not start"
            time.sleep(0.01)
        assert preemption.resume_command() == (f"{script} --standalone --nproc_per_node 2 train.py --config "
                                               "configs/tiny.yaml seed=1 'rollout.filter=[failed]' trainer.resume=auto")
    finally:
        parent.kill()
        parent.wait()


def test_a_failed_checkpoint_write_is_rank_0s_one_line_and_exit_1(capsys, monkeypatch):
    """services.failure_exit_code with CheckpointWriteError (raised on every rank): rank 0 prints it as the run's
    `error:` line and exits 1; another rank prints nothing and, after a SIGTERM (torchrun stopping the run), does not
    wait RANK0_EXIT_WAIT_S for one."""
    import preemption

    e = checkpoint.CheckpointWriteError("writing checkpoint X.tmp failed on rank 1: OSError: [Errno 28] ...")
    assert services_lib.failure_exit_code(e, None, 0) == 1
    assert capsys.readouterr().err == f"error: {e}\n"
    monkeypatch.setattr(preemption, "requested", lambda: True)
    t0 = time.monotonic()
    assert services_lib.failure_exit_code(e, None, 1) == 1
    assert capsys.readouterr().err == "" and time.monotonic() - t0 < 1


def test_resume_after_sigkill_trains_every_prompt_of_the_epoch_once(resumed_run):
    r = resumed_run
    assert f"at step {r['killed_at']}" in r["out"], r["seed"]
    rows = [row for row in r["rows"] if row["step"] > 0]
    assert [row["step"] for row in rows] == list(range(1, 9)), r["seed"]  # the step counter continues
    trained = [tuple(pid) for row in rows for pid in row["data/prompt_ids"]]
    # the buffer's weight version during step i is i (each step's sync adds one), across both parts
    assert [row["rollout/weight_version"] for row in rows] == list(range(8)), r["seed"]
    state = checkpoint.load_run_state(checkpoint.latest_checkpoint(r["run_dir"]))
    assert state["step"] == 8 and state["weight_version"] == 8
    # Each prompt once; every prompt of epoch 0 trained, or still held by the last checkpoint (a window strategy
    # may train a group of epoch 1 before the last one of epoch 0 is complete): none lost, none repeated.
    held = held_prompts(state["buffer"])
    assert len(trained) == len(set(trained)) == 32 and not set(trained) & held, (r["seed"], r["killed_at"], trained)
    assert {(0, i) for i in range(32)} <= set(trained) | held, (r["seed"], r["killed_at"], trained, held)
    assert os.path.exists(os.path.join(r["run_dir"], "hf", "model.safetensors"))


SPEC_METRICS = [  # docs/design.md, the metrics (plus the training metrics it names)
    "rollout/pipeline_buf_size", "rollout/filter_drop", "rollout/partial_ratio", "rollout/partial_span_max",
    "rollout/partial_restored_count", "rollout/partial_dropped_incomplete_count", "timing/pause_delay",
    "perf/wait_ratio", "timing/rollout", "timing/process_traj", "timing/train", "timing/step", "timing/save_ckpt",
    "timing/update_weights", "train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/approx_kl",
    "train/clip_ratio", "train/dual_clip_ratio", "train/nan_ratio", "train/is_mean", "train/is_max", "train/is_min",
    "train/is_ess", "train/is_log_ratio_m2", "train/neg_adv_high_ratio_frac",
    "perf/train_memory_allocated_max", "perf/train_memory_reserved_max", "rollout/reward_mean"]


def test_fully_async_run_reports_every_spec_metric_with_sane_values(resumed_run):
    rows = [row for row in resumed_run["rows"] if row["step"] > 0]
    missing = [k for k in SPEC_METRICS if not any(k in row for row in rows)]
    assert not missing, missing
    cap = int(4 * (1 + 1))
    for row in rows:
        assert 0.0 <= row["rollout/partial_ratio"] <= 1.0 and 0.0 <= row["perf/wait_ratio"] <= 1.0
        assert 0 <= row["rollout/pipeline_buf_size"] <= cap and row["rollout/partial_span_max"] >= 0
        assert row["timing/step"] >= row["timing/train"] > 0 and row["timing/rollout"] >= 0
        assert math.isfinite(row["train/grad_norm"]) and row["train/nan_ratio"] == 0.0
        assert 0.0 <= row["rollout/reward_mean"] <= 1.0 and row["train/entropy"] > 0
        assert row["train/is_min"] <= row["train/is_mean"] <= row["train/is_max"]
        # the staleness diagnostics (losses.offpolicy_diagnostics), every step
        assert 0.0 < row["train/is_ess"] <= 1.0 and 0.0 <= row["train/neg_adv_high_ratio_frac"] <= 1.0
        assert math.isfinite(row["train/is_log_ratio_m2"]) and row["train/is_log_ratio_m2"] >= 0.0
        assert row["perf/train_memory_allocated_max"] > 0
    # KL(pi_t || pi_0) on the probe set (trainer.kl_probe_tokens=128, every step), the resumed part's rows too (from
    # the probe set and pi_0 the checkpoint kept; without them the resumed run logs none): exactly 0 until a step
    # has a gradient (groups of equal rewards have none, and rollout.filter=[failed] trains them: in some runs no
    # step has one), > 0 from then on (the 2-rank actor check has updates at every step)
    moved = [any(r["train/grad_norm"] > 0 for r in rows[:i + 1]) for i in range(len(rows))]
    kl = [row["train/kl_to_start"] for row in rows]
    assert all(math.isfinite(k) and (k > 0) == m for k, m in zip(kl, moved)), (kl, moved)
    evals = [row["eval/reward_mean"] for row in resumed_run["rows"] if "eval/reward_mean" in row]
    assert evals and all(0.0 <= e <= 1.0 for e in evals)


def test_plot_writes_a_png(resumed_run, tmp_path):
    out = plot.plot(os.path.join(resumed_run["run_dir"], "metrics.jsonl"), str(tmp_path / "m.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------------
# End to end: SIGTERM (a preemption) at a random moment, a SIGTERM during a plain `python train.py`'s start-up, a
# checkpoint write that the kernel cuts short, and resume=auto across all of them: the epoch trained exactly once

def _ckpts(run_dir) -> list:
    return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


@pytest.fixture(scope="module")
def preempted_run(tmp_path_factory, tiny_model):
    """A: torchrun, SIGTERM to torchrun at a random moment after step 1, by step 2's row at the latest (save_freq=0:
    the stop's checkpoint is the only one). D: a single-process `python train.py` resumed from it, SIGTERM at a random
    moment of its start-up (after its server is launched; on a fast machine it may be its first step), by its first
    step's row at the latest. (Each moment is bounded by the run's progress, not by time alone: an idle machine
    trains a step in 0.2 s, and A then trained to the end before its SIGTERM, leaving D and B nothing to train.)
    B: a single-process resume under RLIMIT_FSIZE of half a shard, so the kernel cuts its first checkpoint
    (save_freq=1) short (EFBIG) partway through the shard file. C: torchrun resumed to the end of the epoch.
    keep_checkpoints=2 throughout. (B and D are single processes: a torchrun start-up less each; the two-rank write
    failure is actor_checks'.)"""
    import resource

    run_dir = tmp_path_factory.mktemp("preempt") / "run"
    base = [*_run_overrides(run_dir, tiny_model), "trainer.save_freq=0", "trainer.keep_checkpoints=2",
            "trainer.eval_freq=0", "trainer.export_hf=false"]
    seed = random.randrange(10 ** 6)
    rng = random.Random(seed)
    port = next(a for a in base if a.startswith("rollout.base_port=")).split("=")[1]
    out = {"seed": seed, "run_dir": str(run_dir), "port": port}

    def logged() -> int:
        """The last step in metrics.jsonl (0 while a line is half written)."""
        with contextlib.suppress(OSError, ValueError):
            return max((row["step"] for row in _read_rows(run_dir)), default=0)
        return 0

    def signal_at_random(p, after: float, part: str, by_step: int) -> dict:
        """SIGTERM at a random moment up to `after` s from now, or once step `by_step` is logged if that is sooner,
        so that the run stops before the epoch's end whatever the machine's speed."""
        deadline = time.monotonic() + rng.uniform(0.0, after)  # a random moment of the run (not a synchronisation)
        while time.monotonic() < deadline and logged() < by_step:
            time.sleep(0.02)
        assert p.poll() is None, (seed, part, "ended before its SIGTERM", p.stderr.read()[-3000:])
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGTERM)
        o, e = p.communicate(timeout=120)
        return {"seconds": time.monotonic() - t0, "rc": p.returncode, "out": o, "err": e, "ckpts": _ckpts(run_dir)}

    p = subprocess.Popen([*TORCHRUN, "train.py", "--config", TINY, *base], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_steps(str(run_dir), 1, p)
    out["a"] = signal_at_random(p, 1.5, "A", 2)  # so D and B have steps left to train
    out["a"]["rows"] = _read_rows(run_dir)
    out["a"]["problem"] = [checkpoint.checkpoint_problem(os.path.join(run_dir, "checkpoints", c))
                           for c in out["a"]["ckpts"]]  # now: once D has checkpointed too, C's pruning removes it

    resumed = int(os.path.basename(checkpoint.latest_checkpoint(str(run_dir))).split("_")[1])
    d_out = tmp_path_factory.mktemp("preempt_d") / "out.txt"
    with open(d_out, "w") as f:
        p = subprocess.Popen([PY, "train.py", "--config", TINY, *base, "trainer.num_gpus_per_node=1",
                              "trainer.resume=auto"], cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    _wait_log(d_out, "[train] node 0 launched server_0", p, 120.0)
    out["d"] = signal_at_random(p, 1.0, "D", resumed + 1)
    out["d"]["out"] = d_out.read_text()
    out["d"]["children"] = _pids("workers.py", str(run_dir)) + _pids("standins.engine", f"--port {out['port']}")

    latest = checkpoint.latest_checkpoint(str(run_dir))
    shard = min(os.path.getsize(os.path.join(latest, f)) for f in os.listdir(latest) if f.endswith(".distcp"))
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    p = subprocess.run([PY, "train.py", "--config", TINY, *base, "trainer.num_gpus_per_node=1", "trainer.save_freq=1",
                        "trainer.resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       start_new_session=True,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (shard // 2, hard)))
    out["b"] = {"rc": p.returncode, "out": p.stdout, "err": p.stderr, "before": latest, "shard": shard,
                "latest": checkpoint.latest_checkpoint(str(run_dir)), "ckpts": _ckpts(run_dir)}

    p = subprocess.run([*TORCHRUN, "train.py", "--config", TINY, *base, "trainer.resume=auto"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, start_new_session=True)
    out["c"] = {"rc": p.returncode, "out": p.stdout, "err": p.stderr, "ckpts": _ckpts(run_dir),
                "rows": _read_rows(run_dir)}
    return out


def test_sigterm_to_torchrun_checkpoints_the_step_it_stopped_at_and_exits_in_time(preempted_run):
    """torchrun forwards SIGTERM to every rank; they agree at the next step boundary, checkpoint that step and exit 0
    within torchrun's 30 s grace (no SIGKILL; seconds on this config: docs/results/preemption.md). torchrun itself
    exits 1 after a SIGTERM whatever its workers do (its SignalException)."""
    r, a = preempted_run, preempted_run["a"]
    lines = [ln for ln in a["out"].splitlines() if ln.startswith("[train] SIGTERM ")]
    assert len(lines) == 1 and "then the run stops (exit 0)" in lines[0], (r["seed"], a["out"][-3000:],
                                                                            a["err"][-3000:])
    stopped = int(lines[0].split("checkpointing step ")[1].split(",")[0])
    assert 1 <= stopped < 8 and [row["step"] for row in a["rows"] if row["step"] > 0] == list(range(1, stopped + 1))
    assert a["ckpts"] == [f"step_{stopped:06d}"], a["ckpts"]  # save_freq=0: only the stop wrote one
    assert a["problem"] == [None], a["problem"]  # (checked before D and C ran)
    assert a["seconds"] < 30, a["seconds"]  # torchrun's grace (beyond it: its "forcefully exiting" via SIGKILL)
    assert a["rc"] == 1 and "SignalException" in a["err"] and "error: " not in a["err"], a["err"][-3000:]
    assert "forcefully exiting" not in a["err"] and a["err"].count("Traceback") == 1, a["err"][-3000:]  # torchrun's


def test_sigterm_to_a_single_process_run_exits_0_and_leaves_no_child(preempted_run):
    """`python train.py`: SIGTERM during its start-up stops it at once with nothing new to save; one that lands in
    its first step checkpoints that step. Exit 0 either way, no server or worker left."""
    d = preempted_run["d"]
    assert d["rc"] == 0 and d["seconds"] < 30, (preempted_run["seed"], d["rc"], d["seconds"], d["err"][-3000:])
    assert "error: " not in d["err"] and not d["children"], (d["err"][-3000:], d["children"])
    start_up = "[train] SIGTERM outside the step loop (start-up or shut-down): stopping now" in d["err"]
    assert start_up != ("checkpointing step" in d["out"]), (d["out"][-2000:], d["err"][-2000:])


def test_a_checkpoint_cut_short_by_the_kernel_stops_the_run_in_one_line_and_the_previous_one_loads(preempted_run):
    """B's first checkpoint write fails partway through its shard file (EFBIG, RLIMIT_FSIZE of half a shard): the
    run exits 1 with one error line naming the directory, the error, the free space and what resume=auto loads; the
    .tmp is gone and the checkpoint before it is still resume=auto's pick, complete."""
    b = preempted_run["b"]
    assert b["rc"] == 1, (b["out"][-3000:], b["err"][-3000:])
    errors = [ln for ln in (b["out"] + b["err"]).splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, b["err"][-3000:]
    step = int(os.path.basename(b["before"]).split("_")[1]) + 1
    tmp = os.path.join(preempted_run["run_dir"], "checkpoints", f"step_{step:06d}.tmp")
    assert errors[0].startswith(f"error: writing checkpoint {tmp} failed on rank 0: "), errors[0]
    assert f"runs under a file size limit, ulimit -f, of {b['shard'] // 2} bytes)" in errors[0], errors[0]
    assert " free of " in errors[0] and "lower trainer.keep_checkpoints (now 2)" in errors[0], errors[0]
    assert f"trainer.resume=auto continues from the newest complete checkpoint, {b['before']};" in errors[0]
    assert b["latest"] == b["before"] and checkpoint.checkpoint_problem(b["before"]) is None
    assert not [c for c in b["ckpts"] if c.endswith(".tmp")], b["ckpts"]


def test_resume_after_the_preemption_and_the_failed_write_trains_every_prompt_once(preempted_run):
    """C continues from the newest checkpoint (the SIGTERM's, or D's) to the end of the epoch: every prompt trained
    exactly once over A, D and C, the step counter unbroken; keep_checkpoints=2 leaves two, no .tmp."""
    r, c = preempted_run, preempted_run["c"]
    assert c["rc"] == 0, (r["seed"], c["err"][-3000:])
    rows = [row for row in c["rows"] if row["step"] > 0]
    assert [row["step"] for row in rows] == list(range(1, 9)), r["seed"]
    trained = sorted(tuple(pid) for row in rows for pid in row["data/prompt_ids"])
    assert trained == [(0, i) for i in range(32)], (r["seed"], trained)
    assert len(c["ckpts"]) == 2 and c["ckpts"][-1] == "step_000008", c["ckpts"]


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory, tiny_model):
    """Ctrl-C: SIGINT to torchrun's process group (what a terminal sends; torchrun forwards it to each rank) at a
    random moment after step 1, by step 2's row at the latest (save_freq=0: the stop's checkpoint is the only one);
    then the command the run's last line gives, which resumes it (trainer.resume=auto), to the end of the epoch."""
    run_dir = tmp_path_factory.mktemp("ctrlc") / "run"
    base = [*_run_overrides(run_dir, tiny_model), "trainer.save_freq=0", "trainer.eval_freq=0",
            "trainer.export_hf=false"]
    seed = random.randrange(10 ** 6)
    rng = random.Random(seed)

    def logged() -> int:
        with contextlib.suppress(OSError, ValueError):
            return max((row["step"] for row in _read_rows(run_dir)), default=0)
        return 0

    p = subprocess.Popen([*TORCHRUN, "train.py", "--config", TINY, *base], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_steps(str(run_dir), 1, p)
    deadline = time.monotonic() + rng.uniform(0.0, 1.5)  # a random moment, before the epoch's end
    while time.monotonic() < deadline and logged() < 2:
        time.sleep(0.02)
    assert p.poll() is None, (seed, "ended before its SIGINT", p.stderr.read()[-3000:])
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGINT)  # start_new_session=True: torchrun leads the group, as in a terminal
    o, e = p.communicate(timeout=120)
    out = {"seed": seed, "seconds": time.monotonic() - t0, "rc": p.returncode, "out": o, "err": e,
           "ckpts": _ckpts(run_dir), "rows": _read_rows(run_dir)}
    out["problem"] = [checkpoint.checkpoint_problem(os.path.join(run_dir, "checkpoints", c)) for c in out["ckpts"]]
    last = o.rstrip().splitlines()[-1] if o.strip() else ""
    out["last"] = last
    if "; to continue: " in last:
        out["command"] = shlex.split(last.split("; to continue: ", 1)[1])
        p = subprocess.run(out["command"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           start_new_session=True)
        out["c"] = {"rc": p.returncode, "out": p.stdout, "err": p.stderr, "rows": _read_rows(run_dir)}
    return out


def test_ctrl_c_under_torchrun_checkpoints_the_step_it_stopped_at_and_says_how_to_continue(interrupted_run):
    """torchrun forwards the SIGINT to every rank; they agree at the next step boundary, checkpoint that step
    (save_freq=0 too) and exit 0 without a traceback within torchrun's default grace of 30 s (no SIGKILL); rank 0's
    last line is the command that continues, torchrun's own with trainer.resume=auto. torchrun then exits 1 with its
    SignalException whatever its workers do."""
    r = interrupted_run
    lines = [ln for ln in r["out"].splitlines() if ln.startswith("[train] SIGINT (Ctrl-C) ")]
    assert len(lines) == 1 and "then the run stops (exit 0)" in lines[0], (r["seed"], r["out"][-3000:],
                                                                            r["err"][-3000:])
    stopped = int(lines[0].split("checkpointing step ")[1].split(",")[0])
    assert 1 <= stopped < 8 and [row["step"] for row in r["rows"] if row["step"] > 0] == list(range(1, stopped + 1))
    assert r["ckpts"] == [f"step_{stopped:06d}"] and r["problem"] == [None], (r["ckpts"], r["problem"])
    assert r["seconds"] < 30, r["seconds"]
    assert r["rc"] == 1 and "SignalException: Process" in r["err"] and "error: " not in r["err"], r["err"][-3000:]
    assert "forcefully exiting" not in r["err"] and r["err"].count("Traceback") == 1, r["err"][-3000:]  # torchrun's
    assert r["last"].startswith(f"[train] stopped at step {stopped}, checkpointed; to continue: "), r["last"]
    assert r["command"][:len(TORCHRUN)] == TORCHRUN and r["command"][-1] == "trainer.resume=auto", r["command"]


def test_the_command_after_ctrl_c_resumes_and_trains_every_prompt_once(interrupted_run):
    """The printed command continues from the stop's checkpoint to the end of the epoch: the step counter unbroken,
    every prompt trained exactly once across the two parts."""
    r, c = interrupted_run, interrupted_run["c"]
    assert c["rc"] == 0 and "[train] resumed from " in c["out"], (r["seed"], c["err"][-3000:])
    rows = [row for row in c["rows"] if row["step"] > 0]
    assert [row["step"] for row in rows] == list(range(1, 9)), r["seed"]
    trained = sorted(tuple(pid) for row in rows for pid in row["data/prompt_ids"])
    assert trained == [(0, i) for i in range(32)], (r["seed"], trained)


if __name__ == "__main__":
    {"actor": _actor_script}[sys.argv[1]](json.loads(sys.argv[2]))


@pytest.mark.parametrize("decay, warmup, ratio", [("constant", 3, 0.0), ("linear", 0, 0.1), ("cosine", 3, 0.1),
                                                  ("cosine", 0, 0.0)])
def test_the_learning_rate_warms_up_then_decays_to_its_floor_at_the_last_update(decay, warmup, ratio):
    """model.build_optimizer's schedule, read from AdamW's param group after each scheduler step as train.py steps
    it (once an optimizer update): warmup (u + 1) / W x lr, then lr at the first update after it, lr x min_lr_ratio at
    the run's last update (cosine: half way between at the middle), held after; a resumed scheduler (its state_dict,
    as checkpoint.py saves it) continues where it was."""
    lr, updates = 0.5, 23
    t = config.TrainerConfig(lr=lr, warmup_steps=warmup, lr_decay=decay, min_lr_ratio=ratio)
    opt, sched = model_lib.build_optimizer(torch.nn.Linear(2, 2), t, "for_loop", updates)
    seen = []
    for _ in range(updates + 2):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:warmup] == pytest.approx([lr * (u + 1) / warmup for u in range(warmup)])
    assert seen[warmup] == pytest.approx(lr)
    floor = lr if decay == "constant" else lr * ratio
    assert seen[updates - 1] == pytest.approx(floor) and seen[updates:] == pytest.approx([floor] * 2)
    if decay != "constant":
        assert all(a > b for a, b in zip(seen[warmup:updates - 1], seen[warmup + 1:updates]))  # strictly down
    if (updates - 1 - warmup) % 2 == 0 and decay == "cosine":
        assert seen[warmup + (updates - 1 - warmup) // 2] == pytest.approx(lr * (1 + ratio) / 2)
    if decay == "linear":
        assert seen[warmup + 11] == pytest.approx(lr * (ratio + (1 - ratio) * (1 - 11 / 22)))
    opt, sched = model_lib.build_optimizer(torch.nn.Linear(2, 2), t, "for_loop", updates)
    for _ in range(warmup + 5):
        opt.step()
        sched.step()
    opt2, sched2 = model_lib.build_optimizer(torch.nn.Linear(2, 2), t, "for_loop", updates)
    sched2.load_state_dict(sched.state_dict())
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(seen[warmup + 6])


def test_a_decay_without_the_runs_length_is_refused():
    t = config.TrainerConfig(lr_decay="cosine")
    with pytest.raises(ValueError, match="trainer.lr_decay=cosine needs the run's number of optimizer updates"):
        model_lib.build_optimizer(torch.nn.Linear(2, 2), t)
