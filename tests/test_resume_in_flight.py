"""In-flight work survives a trainer restart token-exactly (issue 48, item 2): trainer rank 0 is SIGKILLed at a random
moment after a checkpoint that holds partial trajectories, the run resumes with trainer.resume=auto, and then

  (a) every trajectory the checkpoint holds is trained once, continued from its saved tokens: its first tokens and
      their versions are the saved ones, and the tokens after them, the total minus what was saved, are all of the
      resumed weights (a trajectory regenerated from its prompt would have none of the saved versions);
  (b) multi-turn: no tool call the checkpoint holds ran again (tests/ledger_env.py writes down every call), and a
      call ran twice only when the kill lost it (its first run came after the checkpoint was written);
  (c) the prompt ledger of metrics.jsonl holds no prompt twice, and every prompt of the epoch once, but for those the
      last checkpoint still holds (a window strategy may train a newer group before an older one completes).

Two torchrun runs of the tiny config (2 gloo ranks, a random-init model): single-turn with rollout.pause_mode=retract
(responses run long: its end token is 1 of 101), multi-turn (multi_turn_tool, ledger_env) with in_place (a turn ends
at a digit too: short turns, tool calls of 0.2-0.5 s), so that the boundaries without a checkpoint keep requests on
the paused servers and the ones with a checkpoint bring them all back (Rollout.pause(checkpoint=True)). Generation is
the bottleneck (8 or 12 trajectories generating at once), so groups are in flight, past their first turn, at every
boundary. Run: python -m pytest -q tests/test_resume_in_flight.py
"""
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import checkpoint  # noqa: E402
import services as services_lib  # noqa: E402
from test_train import held_prompts, tiny_model  # noqa: E402,F401 (tiny_model: a fixture)

PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
PROMPTS, STEPS, SAVE_FREQ = 24, 6, 2  # one epoch of 24 prompts, B=4 a step; checkpoints after steps 2, 4 and 6


@pytest.fixture(scope="module")
def short_turns_model(tiny_model, tmp_path_factory) -> str:
    """The same model whose turns also end at a digit (generation_config.json's eos ids, which the rollout sends as
    stop_token_ids): ~9 tokens a turn instead of ~80, so an episode reaches its tool calls at once."""
    out = str(tmp_path_factory.mktemp("model") / "short_turns")
    shutil.copytree(tiny_model, out)
    from standins import tiny_model as tm

    tok = tm.build_tokenizer()
    path = os.path.join(out, "generation_config.json")
    with open(path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [tok.eos_token_id] + [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    with open(path, "w") as f:
        json.dump(gen, f)
    return out


def _args(run_dir, model, *extra) -> list:
    return [*TORCHRUN, "train.py", "--config", TINY, f"run_dir={run_dir}", f"model.path={model}",
            f"rollout.base_port={services_lib.free_port()}", f"weight_sync.master_port={services_lib.free_port()}",
            f"data_source.num_prompts={PROMPTS}", "data_source.num_eval_prompts=8",
            "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=4",
            "trainer.mini_batch_size=8", f"trainer.total_steps={STEPS}", f"trainer.save_freq={SAVE_FREQ}",
            "trainer.eval_freq=0", "trainer.export_hf=false", "rollout.filter=[failed]",
            "rollout.async_max_concurrent_samples=8",
            "logging.train_samples=-1", "buffer.get_timeout_s=120", "rollout.startup_timeout_s=120", *extra]


def _jsonl(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _steps_logged(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    return max((r["step"] for r in _jsonl(path)), default=0) if os.path.exists(path) else 0


def _rank0(run_dir) -> int:
    """The pid of trainer rank 0 of the run in run_dir (a torchrun worker: RANK=0 in its environment)."""
    for pid in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if b"train.py" in cmd and f"run_dir={run_dir}".encode() in cmd and b"torch.distributed.run" not in cmd:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if b"RANK=0" in f.read().split(b"\0"):
                        return int(pid)
    raise AssertionError(f"no trainer rank 0 of {run_dir} among the processes")


def _session_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def killed_and_resumed(run_dir, model, *extra, env=None) -> dict:
    """Run, SIGKILL rank 0 at a random moment after the first checkpoint (within the two steps after it, or the
    first one after the next: a step takes 0.5-3 s), resume=auto; what the test reads."""
    seed = random.randrange(10 ** 6)
    rng = random.Random(seed)
    kill_after = rng.randint(SAVE_FREQ, SAVE_FREQ + 1)  # steps logged, then a random delay
    args = _args(run_dir, model, *extra)
    env = {**os.environ, **(env or {})}
    with open(os.path.join(os.path.dirname(run_dir), "killed.log"), "w") as log:
        p = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while _steps_logged(run_dir) < kill_after:
            assert p.poll() is None, (seed, open(log.name).read()[-3000:])
            assert time.monotonic() < deadline, (seed, f"step {kill_after} was not logged within 240 s")
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        os.kill(_rank0(run_dir), signal.SIGKILL)
        p.wait(timeout=60)  # torchrun stops rank 1 and exits; rank 0's children die with it
        assert p.returncode != 0, (seed, "the run ended before it was killed")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    assert _session_gone(p.pid, 30), (seed, "processes of the killed run stayed behind")
    ckpt = checkpoint.latest_checkpoint(run_dir)
    state = checkpoint.load_run_state(ckpt)
    assert state["step"] < STEPS, (seed, "the kill came after the last checkpoint: nothing is left to resume")
    p2 = subprocess.run([*args, "trainer.resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env=env, start_new_session=True)
    assert p2.returncode == 0, (seed, p2.stdout[-3000:] + p2.stderr[-5000:])
    assert f"resumed from {ckpt} at step {state['step']}" in p2.stdout, (seed, p2.stdout[-3000:])
    return {"seed": seed, "state": state, "step": state["step"],
            "last": checkpoint.load_run_state(checkpoint.latest_checkpoint(run_dir))["buffer"],
            "saved_at": os.path.getmtime(os.path.join(ckpt, "run_state.pt")),
            "rows": [r for r in _jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["step"] > 0],
            "samples": _jsonl(os.path.join(run_dir, "samples", "train.jsonl"))}


def check_continued_and_trained_once(r: dict) -> dict:
    """(a) and (c); returns the saved trajectories by id (epoch, seq, index)."""
    seed, step = r["seed"], r["step"]
    state = r["state"]["buffer"]  # in flight (the restored lane) and complete but not trained yet (buffered)
    saved = {(g["epoch"], g["seq"], t["index"]): t for g in state["data"]["lane"] + state["buffered"]
             for t in g["partial"]}
    cut = [k for k, t in saved.items() if t["status"] == "aborted" and len(t["response_ids"]) > 0]
    assert cut, (seed, f"the checkpoint after step {step} holds no trajectory cut mid-response")
    assert [row["step"] for row in r["rows"]] == list(range(1, STEPS + 1)), seed
    trained = [tuple(pid) for row in r["rows"] for pid in row["data/prompt_ids"]]  # (c)
    held = held_prompts(r["last"])
    assert len(set(trained)) == len(trained) == STEPS * 4 and not held & set(trained), (seed, step, trained, held)
    assert {(0, i) for i in range(PROMPTS)} <= set(trained) | held, (seed, step, trained, held)
    final: dict = {}
    for s in r["samples"]:
        final.setdefault(tuple(s["id"]), []).append(s)
    assert len(r["samples"]) == STEPS * 4 * 4 and all(len(v) == 1 for v in final.values()), seed
    for key, t in saved.items():  # (a)
        assert len(final.get(key, [])) == 1, (seed, key, "a saved trajectory was not trained once")
        s, k = final[key][0], len(t["response_ids"])
        assert s["step"] > step and s["response_ids"][:k] == t["response_ids"].tolist(), (seed, key)
        assert s["versions"][:k] == t["versions"].tolist() and all(v < step for v in s["versions"][:k]), (seed, key)
        new = sum(v >= step for v in s["versions"])  # tokens of the resumed weights (version step and later)
        assert new == len(s["response_ids"]) - k, (seed, key, k, s["versions"])
        assert new > 0 if t["status"] == "aborted" else new == 0, (seed, key, t["status"], new)
    return saved


def test_single_turn_trajectories_in_flight_continue_from_their_saved_tokens_after_a_kill(tmp_path, tiny_model):
    r = killed_and_resumed(str(tmp_path / "run"), tiny_model, "rollout.partial=true", "rollout.pause_mode=retract",
                           "rollout.sampling.max_new_tokens=256")
    check_continued_and_trained_once(r)
    kept = [row.get("rollout/kept_in_flight_groups", 0) for row in r["rows"] if row["step"] % SAVE_FREQ]
    assert sum(kept) > 0, (r["seed"], "no boundary without a checkpoint kept a group in flight")


def test_multi_turn_episodes_in_flight_continue_and_run_no_tool_call_twice_after_a_kill(tmp_path, short_turns_model):
    ledger = tmp_path / "tool_calls.jsonl"
    r = killed_and_resumed(str(tmp_path / "run"), short_turns_model, "rollout.partial=true",
                           "rollout.pause_mode=in_place", "rollout.function=multi_turn_tool",
                           "rollout.env=ledger_env:LedgerEnv", "rollout.sampling.max_new_tokens=128",
                           "rollout.async_max_concurrent_samples=12",
                           env={"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(
                               __file__)), os.environ.get("PYTHONPATH")])), "LEDGER_ENV_PATH": str(ledger)})
    seed = r["seed"]
    saved = check_continued_and_trained_once(r)
    calls: dict = {}
    for c in _jsonl(ledger):
        calls.setdefault((*c["id"], c["turn"]), []).append(c)
    held = [(key, len(t["metadata"].get("env_turns", []))) for key, t in saved.items()]
    assert any(turns and t["status"] == "aborted" for (key, turns), t in zip(held, saved.values())), \
        (seed, "no episode in flight at the checkpoint had finished a tool call")
    for key, turns in held:  # (b): the calls the checkpoint holds ran once, before it was written
        for turn in range(1, turns + 1):
            (c,) = calls[(*key, turn)]
            assert c["time"] < r["saved_at"], (seed, key, turn)
    for key, runs in calls.items():  # a call ran twice only when the kill lost it, and never in one process twice
        assert len({c["pid"] for c in runs}) == len(runs), (seed, key, runs)
        assert all(c["time"] > r["saved_at"] for c in runs[:-1]), (seed, key, runs)
