"""One run per run directory (rundir.py, docs/faults.md "One run per run directory"): run_dir's lock refuses a second
run naming the holder; a fresh run refuses another run's results unless trainer.overwrite=true, which moves them
aside whole; checkpoints carry the run id and a resume refuses another run's; resume=auto stops, naming each, when
checkpoints exist and none loads; a step directory without shards is not complete; run_state round-trips a
weights_only load before commit, and a rollout function's metadata that cannot is refused where it enters; the
logger never truncates another run's files. The end-to-end check (a second run beside a live one, refused, the first
one's files byte-identical) is in test_train.py's resumed_run fixture.

Run: python -m pytest -q -n 0 tests/test_rundir.py
"""
import asyncio
import datetime
import enum
import fractions
import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import time

import numpy
import pytest
import torch

import buffer
import checkpoint
import config
import lease
import logger as logger_lib
import rundir
from buffer import COMPLETED, FAILED, Trajectory
from run_modes import RolloutRecorder
from test_bad_values import _rollout
from test_train import ROOT, TINY, _expect_exit, _write_checkpoint


def _cfg(run_dir, *overrides):
    return config.load_config(None, [f"run_dir={run_dir}", f"model.path={run_dir}/base", *overrides])


def _digest(root) -> dict:
    """{relative path: sha256} of every file under root."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _a_finished_run(run_dir, run_id="20240101-000000-aaaaaa") -> None:
    """What a run leaves: run.json, checkpoints of steps 2 and 4, metrics to step 4, samples, logs, a config."""
    os.makedirs(os.path.join(run_dir, "samples"))
    os.makedirs(os.path.join(run_dir, "logs"))
    lease.write_record(os.path.join(run_dir, rundir.RECORD), {"run_id": run_id})
    for step in (2, 4):
        _write_checkpoint(run_dir, step, state={"step": step, "run_id": run_id, "rng": [checkpoint.rng_state()]})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "eval/reward_mean": s / 10}) + "\n" for s in range(5))
    with open(os.path.join(run_dir, "samples", "train.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "response": "12"}) + "\n")
    for name in ("logs/buffer.log", "config.yaml"):
        with open(os.path.join(run_dir, name), "w") as f:
            f.write("x\n")


# ---------------------------------------------------------------------------------------------------------------
# The lock

def test_a_second_run_in_a_run_dir_whose_lock_is_held_is_refused_naming_the_holder(tmp_path):
    """Two claims on one run_dir (two open file descriptions: flock refuses the second as it would another
    process): the second stops at once naming the directory, the holder's run id, pid and host, writes nothing;
    once the first lets go, the run_dir is free again, and resume=auto continues the same run id."""
    run_dir = str(tmp_path / "run")
    first = rundir.claim(_cfg(run_dir))
    try:
        record = open(os.path.join(run_dir, rundir.RECORD)).read()
        with pytest.raises(rundir.RunDirError) as e:
            rundir.claim(_cfg(run_dir, "trainer.overwrite=true"))
        msg = str(e.value)
        assert f"run_dir {run_dir} is in use by run {first.run_id} (pid {os.getpid()} on {socket.gethostname()}" in msg
        assert "give this run another run_dir" in msg and "\n" not in msg
        assert open(os.path.join(run_dir, rundir.RECORD)).read() == record
    finally:
        first.release()
    again = rundir.claim(_cfg(run_dir, "trainer.resume=auto"))
    try:
        assert again.run_id == first.run_id and not again.fresh and again.resume is None
        holder = json.load(open(os.path.join(run_dir, rundir.LOCK)))
        assert holder["pid"] == os.getpid() and holder["run_id"] == first.run_id
    finally:
        again.release()


_HOLD = """
import sys, time
import config, rundir
cfg = config.load_config(None, [f"run_dir={sys.argv[1]}", f"model.path={sys.argv[1]}/base"])
claim = rundir.claim(cfg)
print(claim.run_id, flush=True)
time.sleep(120)
"""


def test_another_process_holding_run_dir_refuses_this_one_until_it_is_killed(tmp_path):
    """Two processes: while one holds run_dir (as rank 0 of a live run does), a claim from this one, fresh or with
    resume=auto or overwrite, is refused at once naming the holder's pid and host, and changes no file; once the
    holder is SIGKILLed the kernel has let go, and resume=auto continues its run id at once."""
    run_dir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, run_dir], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 60)
        run_id = holder.stdout.readline().strip() if ready else ""
        assert run_id, "the holding process printed no run id within 60 s"
        before = _digest(run_dir)
        for extra in ([], ["trainer.resume=auto"], ["trainer.overwrite=true"]):
            t0 = time.monotonic()
            with pytest.raises(rundir.RunDirError) as e:
                rundir.claim(_cfg(run_dir, *extra))
            assert time.monotonic() - t0 < 2
            assert f"run_dir {run_dir} is in use by run {run_id} (pid {holder.pid} on {socket.gethostname()}" \
                in str(e.value)
        assert _digest(run_dir) == before
    finally:
        holder.kill()
        holder.wait(30)
    t0 = time.monotonic()
    claim = rundir.claim(_cfg(run_dir, "trainer.resume=auto"))
    claim.release()
    assert claim.run_id == run_id and time.monotonic() - t0 < 2


def test_a_lock_file_whose_recorded_holder_is_gone_is_taken(tmp_path):
    """A run.lock left by a process that died (its flock went with it) holds nothing."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / rundir.LOCK).write_text(json.dumps({"pid": 2 ** 22 + 7, "host": socket.gethostname()}))
    claim = rundir.claim(_cfg(str(run_dir)))
    claim.release()
    assert claim.fresh and claim.resume is None


# ---------------------------------------------------------------------------------------------------------------
# A fresh run, and trainer.overwrite

def test_a_fresh_run_refuses_another_runs_results_and_overwrite_moves_them_aside_whole(tmp_path, capsys):
    """README command 1 run a second time: resume=none in a run_dir of a finished run stops in one sentence naming
    what is there and both ways on (trainer.resume=auto, trainer.overwrite=true), every file untouched. With
    overwrite the run's files move into run_dir/old-<time>/ byte for byte; the inputs kept there (a dataset, a model
    under run_dir) stay; the new run gets a new id and its logger starts on empty files."""
    run_dir = str(tmp_path / "run")
    _a_finished_run(run_dir)
    os.makedirs(os.path.join(run_dir, "base"))  # model.path inside run_dir: an input, never moved
    with open(os.path.join(run_dir, "data.jsonl"), "w") as f:
        f.write("{}\n")
    before = _digest(run_dir)
    with pytest.raises(rundir.RunDirError) as e:
        rundir.claim(_cfg(run_dir))
    assert str(e.value) == (
        f"run_dir {run_dir} holds another run's results (run 20240101-000000-aaaaaa: checkpoints of steps 2-4, "
        "metrics.jsonl to step 4, samples/); add trainer.resume=auto to continue it, or trainer.overwrite=true to "
        f"start over (its files are moved into {run_dir}/old-<time>/, nothing is deleted), or give another run_dir")
    with pytest.raises(rundir.RunDirError, match="add trainer.resume=auto with a trainer.total_steps above 4 to "
                       "continue it, or trainer.overwrite=true"):
        rundir.claim(_cfg(run_dir, "trainer.total_steps=4"))  # a finished run: resume=auto alone has nothing left
    assert {k: v for k, v in _digest(run_dir).items() if k != rundir.LOCK} == before
    claim = rundir.claim(_cfg(run_dir, "trainer.overwrite=true"))
    try:
        assert claim.fresh and claim.resume is None and claim.run_id != "20240101-000000-aaaaaa"
        old = [n for n in os.listdir(run_dir) if n.startswith("old-")]
        assert len(old) == 1
        moved = _digest(os.path.join(run_dir, old[0]))
        assert moved == {k: v for k, v in before.items() if k not in ("data.jsonl",)}
        assert sorted(os.listdir(run_dir)) == sorted(["base", "data.jsonl", old[0], rundir.LOCK, rundir.RECORD])
        assert json.load(open(os.path.join(run_dir, rundir.RECORD)))["run_id"] == claim.run_id
        assert f"moved into {run_dir}/{old[0]}/: checkpoints, metrics.jsonl, samples" in capsys.readouterr().out
        logger_lib.Logger(_cfg(run_dir)).log(1, {"x": 1.0})
        assert [json.loads(ln)["step"] for ln in open(os.path.join(run_dir, "metrics.jsonl"))] == [1]
    finally:
        claim.release()


def test_train_only_keeps_its_input_and_is_sent_to_a_run_dir_of_its_own(tmp_path):
    """run_mode=train-only: run_dir/rollouts is its input (trainer.rollout_dir unset), not a result; in a rollout-only
    run's run_dir it is refused naming the settings that work, even with overwrite (which would move its input away);
    a run_dir holding only the saved groups starts, and overwrite keeps them."""
    run_dir = str(tmp_path / "run")
    _a_finished_run(run_dir)
    os.makedirs(os.path.join(run_dir, "rollouts"))
    with open(os.path.join(run_dir, "rollouts", "step_000000.pt"), "wb") as f:
        f.write(b"x")
    for extra in ([], ["trainer.overwrite=true"]):
        with pytest.raises(rundir.RunDirError) as e:
            rundir.claim(_cfg(run_dir, "run_mode=train-only", "fully_async.enable=false", *extra))
        assert f"give run_dir=<new directory> trainer.rollout_dir={run_dir}/rollouts" in str(e.value)
    assert os.path.exists(os.path.join(run_dir, "rollouts", "step_000000.pt"))
    alone = str(tmp_path / "alone")
    os.makedirs(alone)
    os.rename(os.path.join(run_dir, "rollouts"), os.path.join(alone, "rollouts"))
    claim = rundir.claim(_cfg(alone, "run_mode=train-only", "fully_async.enable=false"))
    claim.release()
    assert claim.fresh and os.path.exists(os.path.join(alone, "rollouts", "step_000000.pt"))


def test_train_py_refuses_a_second_fresh_run_in_one_sentence(tmp_path, capsys):
    """The same through train.py: exit code 2 and one error line before anything starts, naming both ways."""
    run_dir = str(tmp_path / "run")
    _a_finished_run(run_dir)
    _expect_exit(["--config", TINY, "trainer.num_gpus_per_node=1", f"run_dir={run_dir}",
                  f"model.path={tmp_path}/model"],
                 [f"run_dir {run_dir} holds another run's results", "trainer.resume=auto",
                  "trainer.overwrite=true"], capsys)


def test_a_fresh_logger_never_truncates_and_a_resumed_one_trims_to_its_step(tmp_path):
    """logger.Logger: a fresh run's (keep_until None) finds another run's lines and refuses, leaving them; a
    resumed run's keeps its lines up to the checkpoint's step."""
    run_dir = str(tmp_path / "run")
    _a_finished_run(run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    before = open(metrics).read()
    with pytest.raises(RuntimeError, match="holds another run's lines"):
        logger_lib.Logger(_cfg(run_dir))
    assert open(metrics).read() == before
    logger_lib.Logger(_cfg(run_dir), keep_until=2)
    assert [json.loads(ln)["step"] for ln in open(metrics)] == [0, 1, 2]


# ---------------------------------------------------------------------------------------------------------------
# Run ids and resume

def test_checkpoints_carry_the_run_id_and_a_resume_refuses_another_runs(tmp_path, capsys):
    """A checkpoint's run_state carries the run id (RolloutRecorder's as Actor's); resume=auto and an explicit
    trainer.resume refuse a checkpoint of another run than run_dir's; a checkpoint without one (written before run
    ids) resumes as the directory's run."""
    run_dir = str(tmp_path / "run")
    cfg = _cfg(run_dir, "run_mode=rollout-only", "fully_async.enable=false")
    recorder = RolloutRecorder(cfg, None)
    recorder.run_id = "run-a"
    recorder.save_checkpoint(3, {"step": 3, "weight_version": 3, "buffer": {}})
    path = os.path.join(run_dir, "checkpoints", "step_000003")
    assert checkpoint.load_run_state(path)["run_id"] == "run-a"
    lease.write_record(os.path.join(run_dir, rundir.RECORD), {"run_id": "run-b"})
    for resume in ("auto", path):
        with pytest.raises(rundir.RunDirError) as e:
            rundir.claim(_cfg(run_dir, "run_mode=rollout-only", "fully_async.enable=false",
                              f"trainer.resume={resume}"))
        assert f"checkpoint {path} is of run run-a but run_dir {run_dir} holds run run-b" in str(e.value)
    os.remove(os.path.join(run_dir, rundir.RECORD))
    claim = rundir.claim(_cfg(run_dir, "run_mode=rollout-only", "fully_async.enable=false", "trainer.resume=auto"))
    claim.release()
    assert (claim.run_id, claim.resume, claim.fresh) == ("run-a", path, False)  # its own id, in a run_dir of none
    old = str(tmp_path / "old")
    _write_checkpoint(old, 5)  # no run id
    claim = rundir.claim(_cfg(old, "trainer.resume=auto"))
    claim.release()
    assert claim.resume.endswith("step_000005") and json.load(open(os.path.join(old, rundir.RECORD)))["run_id"] == \
        claim.run_id
    assert "carries no run id (written before run ids): resumed as run" in capsys.readouterr().out
    legacy = os.path.join(old, "checkpoints", "step_000005")  # into a run_dir of another run: nothing says whose
    with pytest.raises(rundir.RunDirError, match=f"checkpoint {legacy} carries no run id .* is not in run_dir "
                                                 f"{run_dir}, which holds run run-a"):
        rundir.claim(_cfg(run_dir, "run_mode=rollout-only", "fully_async.enable=false", f"trainer.resume={legacy}"))


def test_resume_auto_stops_naming_every_checkpoint_that_does_not_load(tmp_path, capsys):
    """Checkpoints exist and none loads: resume=auto stops (exit 2, one sentence naming each and why) instead of
    starting again from step 0 and trimming the metrics; with one that loads it resumes that one."""
    run_dir = str(tmp_path / "run")
    cut = _write_checkpoint(run_dir, 2)
    with open(os.path.join(cut, "run_state.pt"), "r+b") as f:
        f.truncate(10)
    bare = _write_checkpoint(run_dir, 3, shards=False)  # run_state.pt alone: not a training checkpoint
    with pytest.raises(rundir.RunDirError) as e:
        rundir.claim(_cfg(run_dir, "trainer.resume=auto"))
    msg = str(e.value)
    assert f"trainer.resume=auto found 2 checkpoint(s) in {run_dir}/checkpoints and none loads" in msg
    assert "step_000003: it has run_state.pt but no model and optimizer shards" in msg
    assert "step_000002: run_state.pt does not load" in msg and "does not start again from step 0" in msg
    _expect_exit(["--config", TINY, "trainer.num_gpus_per_node=1", f"run_dir={run_dir}",
                  f"model.path={tmp_path}/model", "trainer.resume=auto"],
                 ["trainer.resume=auto found 2 checkpoint(s)", "none loads"], capsys)
    good = _write_checkpoint(run_dir, 1)
    claim = rundir.claim(_cfg(run_dir, "trainer.resume=auto"))
    claim.release()
    assert claim.resume == good
    assert f"skipping checkpoint {bare}" in capsys.readouterr().err


def test_a_step_directory_without_shards_is_not_a_complete_training_checkpoint(tmp_path):
    """run_state.pt alone: complete for a rollout-only run (shards=False), not for one that trains."""
    bare = _write_checkpoint(str(tmp_path), 1, shards=False)
    assert "no model and optimizer shards" in checkpoint.checkpoint_problem(bare)
    assert checkpoint.checkpoint_problem(bare, shards=False) is None
    assert checkpoint.latest_checkpoint(str(tmp_path)) is None
    assert checkpoint.latest_checkpoint(str(tmp_path), shards=False) == bare


# ---------------------------------------------------------------------------------------------------------------
# run_state round-trips a weights_only load

class _Colour(enum.IntEnum):
    RED = 1


UNLOADABLE = {"numpy": numpy.float64(0.5), "datetime": datetime.datetime(2024, 1, 1), "frozenset": frozenset({1}),
              "fraction": fractions.Fraction(1, 3), "intenum": _Colour.RED, "numpy_array": numpy.zeros(2)}


@pytest.mark.parametrize("kind", sorted(UNLOADABLE))
def test_commit_refuses_a_run_state_that_a_weights_only_load_cannot_read(tmp_path, kind):
    """Trajectory metadata saved whole in the buffer's state: a numpy scalar, a datetime, a frozenset, a Fraction
    (and an IntEnum, a numpy array) deep inside fails the write naming where, and nothing is committed, so no
    checkpoint exists that every later load would refuse."""
    state = {"step": 1, "buffer": {"buffered": [{"trajectories": [{"metadata": {"turns": [1, 2],
                                                                                   "score": UNLOADABLE[kind]}}]}]}}
    tmp = tmp_path / "step_000001.tmp"
    tmp.mkdir()
    with pytest.raises(ValueError) as e:
        checkpoint.commit(str(tmp), str(tmp_path / "step_000001"), state)
    assert "run_state['buffer']['buffered'][0]['trajectories'][0]['metadata']['score'] holds a" in str(e.value)
    assert "torch.load(weights_only=True) refuses" in str(e.value)
    assert not (tmp_path / "step_000001").exists()


def test_plain_run_state_passes_and_commits(tmp_path):
    plain = {"s": "x", "i": 1, "f": 0.5, "b": True, "n": None, "by": b"x", "t": torch.arange(3),
             "l": list(range(10000)), "tu": (1, "a"), "set": {1, 2}, "nested": {"k": [{"v": torch.zeros(2)}]},
             3: "int key"}
    assert checkpoint.unloadable(plain, "run_state") is None
    tmp = tmp_path / "step_000001.tmp"
    tmp.mkdir()
    checkpoint.commit(str(tmp), str(tmp_path / "step_000001"), plain)
    assert checkpoint.load_run_state(str(tmp_path / "step_000001"))["nested"]["k"][0]["v"].shape == (2,)


@pytest.mark.parametrize("kind", ["numpy", "datetime", "frozenset", "fraction"])
def test_a_rollout_function_leaving_unloadable_metadata_fails_its_trajectory_counted_and_named(kind):
    """Where metadata enters: a rollout function that puts such a value in traj.metadata fails that trajectory
    (the field named in metadata["error"], the value gone from it), counted in rollout/metadata_error_count; the
    trajectory beside it, plain, is scored."""
    ro, sync, tok = _rollout()

    async def fn(ctx, trajs):
        for traj in trajs:
            traj.status = COMPLETED
            traj.metadata["turns"] = 1
            if traj.index == 0:
                traj.metadata["extra"] = {"when": UNLOADABLE[kind]}

    async def run():
        ro._outbox_ready = asyncio.Event()
        g = buffer.PromptGroup(0, 0, 0, torch.tensor([5, 6]), label="21")
        trajs = [Trajectory(0, 0, i, g.prompt_ids) for i in range(2)]
        for t in trajs:
            await ro._run(g, [t])
        return trajs

    ro.fn = fn
    try:
        bad, good = sync.run(run(), 30)
        metrics = sync.run(ro._step_metrics(), 30)
    finally:
        ro.stop()
        sync.close()
    assert bad.status == FAILED and "extra" not in bad.metadata and bad.metadata["turns"] == 1
    assert "metadata['extra']['when'] holds a" in bad.metadata["error"]
    assert checkpoint.unloadable(bad.metadata, "m") is None
    assert good.status == COMPLETED and "error" not in good.metadata
    assert metrics["rollout/metadata_error_count"] == 1 and metrics["rollout/failed_count"] == 1
