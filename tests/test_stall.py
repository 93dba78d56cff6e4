"""When nothing can be trained, the run says so: the buffer's wait report and its stop sentence once
rollout.filter has dropped rollout.filter_stop_groups groups in a row, the trainer's waiting line (run_steps, both
modes), and train.py stopping such a run with one error line and exit code 2.

Run: .venv/bin/python -m pytest -q tests/test_stall.py
"""
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import logger as logger_lib  # noqa: E402
import run_modes  # noqa: E402
import services as services_lib  # noqa: E402
import train  # noqa: E402
from buffer import FAILED, PipelineServer  # noqa: E402
from test_buffer import finish, make_cfg, make_prompts  # noqa: E402
from test_train import TORCHRUN, _root_cause_exit_code  # noqa: E402


def _decode(ids):
    return "".join(f"<{i}>" for i in ids)


def _cfg(stop_groups, fully_async=True, extra=()):
    return make_cfg(B=2, N=4, fully_async=fully_async, overrides=[
        "rollout.filter=[failed, all_equal_reward]", f"rollout.filter_stop_groups={stop_groups}", *extra])


def _server(stop_groups, fully_async=True, extra=()):
    return PipelineServer(_cfg(stop_groups, fully_async, extra), make_prompts(40), collector_thread=False,
                          decode=_decode)


def _drop(srv, n, rewards=(0.0, 0.0, 0.0, 0.0)):
    """Dispatch and finish n groups whose rewards make the filter drop them (unless they vary)."""
    for _ in range(n):
        [g] = srv.dispatch(max_groups=1)
        srv.put(finish(g, srv.N, rewards=list(rewards)))


def test_filter_stop_span_defaults_to_four_batches_at_least_64():
    assert make_cfg(B=4, N=2).filter_stop_groups == 64
    assert make_cfg(B=32, N=2).filter_stop_groups == 128
    assert make_cfg(B=32, N=2, overrides=["rollout.filter_stop_groups=0"]).filter_stop_groups == 0


def test_wait_reports_drops_and_stops_after_a_span_dropped_in_a_row():
    srv = _server(stop_groups=6)
    _drop(srv, 5)
    w = srv.wait(1, timeout=0.0)
    assert w["stop"] is None and w["ready"] == 0 and w["needed"] == 1
    assert w["generated"] == 20 and w["filter_drop"] == 5 and w["drop_reasons"] == {"all 4 rewards 0.0": 5}
    assert srv.wait(1, timeout=0.0)["filter_drop"] == 0  # counted since the last report
    _drop(srv, 1, rewards=(0.0, 1.0, 0.0, 0.0))  # trainable: the run of drops starts again
    _drop(srv, 5, rewards=(0.5,) * 4)
    [g] = srv.dispatch(max_groups=1)
    trajs = finish(g, srv.N, rewards=[0.5] * 4)
    for t in trajs[1:]:  # one survivor, fewer than rollout.min_group_size (2 of N = 4)
        t.status, t.metadata = FAILED, {"error": "reward function failed: KeyError('answer')"}
    srv.put(trajs)  # 6 in a row now, the last one for failed trajectories
    w = srv.wait(1, timeout=0.0)
    assert w["stop"] is None and w["ready"] == 1  # a group to train is still there: not stopped yet
    assert len(srv.get(1)) == 1
    t0 = time.monotonic()
    w = srv.wait(1, timeout=30.0)
    assert time.monotonic() - t0 < 1.0  # the stop does not wait for the timeout
    msg = w["stop"]
    assert msg.startswith("nothing can be trained: rollout.filter=['failed', 'all_equal_reward'] dropped each of "
                          "the last 6 groups (all 4 rewards 0.5: 5, 3 of 4 failed: 1; trajectory rewards seen: "
                          "0.5 (21)); the last one, of data_source[0] (task reverse_digits, reward the "
                          "task's default): prompt "), msg
    p = g.prompt_ids.tolist()
    assert f"prompt {_decode(p)!r}, response {_decode(trajs[1].response_ids.tolist())!r} (failed, error " \
           "\"reward function failed: KeyError('answer')\"), label '0-" in msg
    for hint in ("fix what that error names (a raised exception's first traceback is in the rollout process's "
                 "log, run_dir/logs/rollout.log), check that data_source.reward", "base model that solves some prompts",
                 "change rollout.filter", "rollout.filter_stop_groups=6; 0 turns this stop off"):
        assert hint in msg
    assert "\n" not in msg


def test_when_every_trajectory_failed_the_stop_names_the_line_that_raised_and_the_log_not_the_model():
    """A reward that raises on every response: nothing was scored, so the stop sentence is the error (which names the
    file and line that raised), where its traceback is, and the filter; no advice about rewards or base models."""
    srv = _server(stop_groups=3)
    error = "the reward function my_rewards:score raised ZeroDivisionError('division by zero') at my_rewards.py:7"
    for _ in range(3):
        [g] = srv.dispatch(max_groups=1)
        trajs = finish(g, srv.N, rewards=[0.0] * srv.N)
        for t in trajs:
            t.status, t.metadata = FAILED, {"error": error}
        srv.put(trajs)
    msg = srv.wait(1, timeout=0.0)["stop"]
    assert "(4 of 4 failed: 3; trajectory rewards seen: none (all failed))" in msg, msg
    assert f"(failed, error {error!r}), label " in msg
    assert msg.split("; ", 1)[0].startswith("nothing can be trained: rollout.filter=['failed', 'all_equal_reward']")
    assert msg.endswith("; fix what that error names (a raised exception's first traceback is in the rollout "
                        "process's log, run_dir/logs/rollout.log), or change rollout.filter "
                        "(rollout.filter_stop_groups=3; 0 turns this stop off)"), msg
    assert "base model" not in msg and "data_source.reward scores" not in msg


def test_no_stop_when_switched_off_and_in_synchronous_mode_the_same_rule():
    off = _server(stop_groups=0)
    _drop(off, 30)
    assert off.wait(1, timeout=0.0)["stop"] is None
    sync = _server(stop_groups=3, fully_async=False, extra=["rollout.sampler.num_oversample=2"])
    _drop(sync, 3, rewards=(1.0,) * 4)
    assert "dropped each of the last 3 groups (all 4 rewards 1.0: 3" in sync.wait(2, timeout=0.0)["stop"]


class _Actor:
    """run_steps' actor without a model: trains nothing, counts what it was given."""

    def __init__(self):
        self.groups = []

    def train_minibatch(self, groups, step):
        self.groups += groups
        return {}

    def sync_weights(self, version):
        return {}

    def save_checkpoint(self, steps_done, run_state):
        pass

    def memory_to_trainer(self):
        return {}

    def memory_to_servers(self):
        return {}


class _Producer(run_modes.NoRollout):
    """A rollout without servers: generates every group the buffer lets out, all rewards 0.0 until `vary` is set
    (pause, resume and step_metrics do nothing, as run_modes.NoRollout's)."""

    def __init__(self, srv):
        self.srv, self.vary, self.stopped = srv, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stopped.is_set():
            for g in self.srv.dispatch(timeout=0.05):
                self.srv.put(finish(g, self.srv.N, rewards=[0.0, 1.0, 0.0, 0.0] if self.vary.is_set() else [0.0] * 4))
            time.sleep(0.01)

    def start(self):
        if not self.thread.is_alive():
            self.thread.start()


@pytest.mark.parametrize("mode", ["fully-async", "synchronous, colocate"])
def test_the_waiting_line_says_what_the_filter_drops_and_why(tmp_path, capsys, mode):
    fully_async = mode == "fully-async"
    cfg = _cfg(0, fully_async, ["trainer.mini_batch_size=8", "trainer.total_steps=1", "logging.wait_line_s=0.3",
                                f"run_dir={tmp_path}", "buffer.get_timeout_s=60"])
    srv = PipelineServer(cfg, make_prompts(40), decode=_decode)
    producer = _Producer(srv)
    logger = logger_lib.Logger(cfg)
    lines = []
    waiting = logger.waiting

    def spy(step, rec):  # after two lines, drops among them, the rewards start to vary so the step can finish
        waiting(step, rec)
        lines.append(rec)
        if len(lines) >= 2 and sum(r["filter_drop"] for r in lines) > 0:
            producer.vary.set()
    logger.waiting = spy
    actor = _Actor()
    try:
        train.run_steps(cfg, actor, srv, producer, logger, 0,
                        servers=lambda: {"http://127.0.0.1:1": True, "http://127.0.0.1:2": False})
    finally:
        producer.stopped.set()
        srv.close()
    out = capsys.readouterr().out
    assert len(actor.groups) == 2 and all(len(set(g.rewards)) > 1 for g in actor.groups)
    shown = [ln for ln in out.splitlines() if ln.startswith("[train] step 1: waiting ")]
    assert len(shown) >= 2, out
    assert " 0/2 ready | " in shown[0] and "servers answering 1/2" in shown[0]
    assert any("rollout.filter dropped" in ln and "(all 4 rewards 0.0: " in ln for ln in shown), shown
    dropped = sum(r["filter_drop"] for r in lines)
    assert dropped > 0 and all(set(r["drop_reasons"]) <= {"all 4 rewards 0.0"} for r in lines)
    assert sum(r["generated"] for r in lines) >= 4 * dropped  # each dropped group was generated in full
    with open(tmp_path / "waiting.jsonl") as f:
        saved = [json.loads(line) for line in f]
    assert [r["filter_drop"] for r in saved] == [r["filter_drop"] for r in lines] and saved[0]["step"] == 1
    assert saved[0]["servers_up"] == 1 and saved[0]["servers_total"] == 2 and saved[0]["needed"] == 2


def test_most_responses_cut_by_length_warn_once_naming_the_key(tmp_path, capsys):
    """A budget that holds the answer but not the work before it: the first step where most responses end at
    max_new_tokens without stopping says so once, naming the key; later steps do not repeat it."""
    cfg = _cfg(0, True, ["trainer.mini_batch_size=8", "trainer.total_steps=3", f"run_dir={tmp_path}",
                         "buffer.get_timeout_s=60", "rollout.sampling.max_new_tokens=12"])
    srv = PipelineServer(cfg, make_prompts(40), decode=_decode)
    producer = _Producer(srv)
    producer.vary.set()
    ratios = iter([0.5, 0.75, 0.9])  # half is not most
    producer.step_metrics = lambda: {"rollout/truncation_ratio": next(ratios)}
    try:
        train.run_steps(cfg, _Actor(), srv, producer, logger_lib.Logger(cfg), 0)
    finally:
        producer.stopped.set()
        srv.close()
    err = capsys.readouterr().err
    warned = [ln for ln in err.splitlines() if "rollout/truncation_ratio" in ln]
    assert warned == ["[train] warning: 75% of the responses finished in step 2 ended at "
                      "rollout.sampling.max_new_tokens=12 tokens without stopping (rollout/truncation_ratio); "
                      "raise it if this task's answers need more"], err


# ---------------------------------------------------------------------------------------------------------------
# train.py end to end: a new user's GSM8K-layout dataset that the tiny base never solves

def test_a_dataset_whose_rewards_never_vary_stops_with_the_reason(tmp_path):
    from standins import tiny_model

    model = tiny_model.make_tiny_model(str(tmp_path / "tiny"))
    data = tmp_path / "gsm8k.jsonl"
    with open(data, "w") as f:  # the base (random init) never writes "Answer: N": math scores every response 0.0
        for i in range(16):
            f.write(json.dumps({"question": f"Tom has {i} apples and buys {i + 3} more. How many has he?",
                                "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}"}) + "\n")
    run_dir = tmp_path / "run"
    port = services_lib.free_port(span=2)  # the server on port, the weight-update group on port + 1
    p = subprocess.Popen([*TORCHRUN, "train.py", "--config", os.path.join(ROOT, "configs", "tiny.yaml"),
                          f"run_dir={run_dir}", f"model.path={model}", "data_source.task=jsonl",
                          f"data_source.path={data}", "data_source.num_eval_prompts=4",
                          "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=4",
                          "trainer.mini_batch_size=8", "trainer.total_steps=4", "trainer.eval_freq=0",
                          "rollout.sampling.max_new_tokens=16",  # room for "Answer:N" (tiny.yaml's 6 is refused)
                          f"rollout.base_port={port}", f"weight_sync.master_port={port + 1}",
                          "buffer.get_timeout_s=600", "rollout.startup_timeout_s=120", "rollout.filter_stop_groups=null"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out = []
        for line in p.stdout:  # the producer starts after this line: no group was dropped before it
            out.append(line)
            if line.startswith("[train] weights version 0 on the servers"):
                break
        t0 = time.monotonic()
        rest, err = p.communicate(timeout=120)
        stopped_after = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
    assert out and out[-1].startswith("[train] weights version 0"), "".join(out)[-3000:] + err[-3000:]
    assert stopped_after < 60, stopped_after
    errors = [ln for ln in (rest + err).splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, err[-3000:]
    # rank 1 leaves after rank 0 (train.main waits for torchrun to stop it): torchrun's root cause is rank 0's exit
    assert _root_cause_exit_code(err) == 2, "\n".join(ln for ln in err.splitlines() if "[train]" in ln) + err[-3000:]
    msg = errors[0]
    head = "error: nothing can be trained: rollout.filter=['failed', 'all_equal_reward'] dropped each of the last "
    assert msg.startswith(head), msg
    n = int(msg[len(head):].split()[0])  # the collector may drop a few more before the trainer wakes to stop
    assert n >= 64, msg
    assert msg[len(head):].startswith(f"{n} groups (all 4 rewards 0.0: {n}; trajectory rewards seen: 0.0 ({4 * n}))")
    assert "(task jsonl, reward the task's default): prompt '<|im_start|>user\\nTom has " in msg, msg
    # the response is the repr of a random sample: quoted with " when it holds a ' (a clean-clone CI run's did)
    assert re.search(r"How many has he\?<\|im_end\|>\\n<\|im_start\|>assistant\\n', response ['\"]", msg), msg
    label = msg.split(", label '", 1)[1].split("'", 1)[0]
    assert label in {str(2 * i + 3) for i in range(16)}  # the "#### N" of the row, as the reward sees it
    assert "rollout.filter_stop_groups=64" in msg
    assert not (run_dir / "checkpoints").exists() or not os.listdir(run_dir / "checkpoints")  # nothing trained
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the engine, buffer and rollout processes were stopped too
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail("processes of the stopped run are still running")


def test_saved_rollouts_that_run_out_say_so(tmp_path):
    import types

    from buffer import Group, NothingToTrain, PromptGroup, Trajectory

    rec = run_modes.RolloutRecorder(types.SimpleNamespace(run_dir=str(tmp_path)), fleet=None)
    for step in range(2):
        g = PromptGroup(0, step, step, torch.tensor([1, 2]), label="3")
        rec.train_minibatch([Group(g, [Trajectory(0, step, 0, g.prompt_ids, reward=1.0)])], step)
    replay = run_modes.ReplayBuffer(str(tmp_path / "rollouts"))
    assert len(replay.get(1, timeout=1)) == 1
    with pytest.raises(NothingToTrain) as e:
        replay.get(2, timeout=1)
    assert str(e.value) == (
        f"the data ran out before trainer.total_steps: the groups saved in {tmp_path / 'rollouts'} (2 files from 2 "
        "steps of a rollout-only run) are trained but 1 and 2 are wanted; train at most that many steps "
        "(trainer.total_steps, with the recording's batch size) or record more with run_mode=rollout-only")
