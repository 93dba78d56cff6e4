"""No bad value swallowed: a reward that is not a finite number fails its trajectory (counted), and one that reaches the
trainer anyway is refused; non-finite config floats are refused in one sentence; a reward that hangs (the math
reward on 9^{9^{9^{9}}}) is killed at rollout.reward_timeout_s while the event loop goes on; a tool environment's
observation is capped at rollout.env_max_obs_tokens before it is tokenized in full or kept.

Run: python -m pytest -q -n 0 tests/test_bad_values.py
"""
import asyncio
import threading
import time

import numpy
import pytest
import torch

import batching
import buffer
import config
import env_steps
import rollout
import sglang_client
import tasks
from buffer import COMPLETED, FAILED, Trajectory
from standins import tiny_model
from test_rollout import _run_calc, site_of

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf"), "str": " 2 ", "list": [1.0],
          "tensor1": torch.tensor([1.0]), "none": None,
          "int": 3, "bool": True, "np32": numpy.float32(0.5), "npbool": numpy.bool_(True), "t0": torch.tensor(0.25),
          "nan_tensor": torch.tensor(float("nan"))}
ACCEPTED = {"int": 3.0, "bool": 1.0, "np32": 0.5, "npbool": 1.0, "t0": 0.25}


def value_reward(text, label, stopped):
    """The reward is VALUES[label]: what a buggy or an ordinary reward function returns."""
    return VALUES[label]


def _rollout(*overrides):
    """A Rollout that is never started (its _score and counters are what these tests use); the server URL is not
    contacted."""
    tok = tiny_model.build_tokenizer()
    cfg = config.load_config(None, ["data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
                                    "trainer.mini_batch_size=2", "rollout.servers=[http://127.0.0.1:9]", *overrides])
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    return rollout.Rollout(cfg, None, sync, tok), sync, tok


def _score(ro, sync, tok, answers, label, timeout=60):
    """Score one group of COMPLETED trajectories whose responses are `answers` under `label`; returns them."""
    g = buffer.PromptGroup(0, 0, 0, torch.tensor([5, 6]), label=label)
    trajs = [Trajectory(0, 0, i, g.prompt_ids, torch.tensor(tok.encode(a, add_special_tokens=False)), status=COMPLETED)
             for i, a in enumerate(answers)]
    sync.run(ro._score(g, trajs), timeout)
    return trajs


@pytest.mark.parametrize("pool", ["inline", "process"])
def test_a_reward_that_is_not_a_finite_number_fails_its_trajectory_counted_and_named(pool):
    """NaN, inf, " 2 ", a list, a 1-element tensor, None: each fails its trajectory, the reason naming the reward
    function and the value, counted in rollout/reward_error_count; ints, bools, numpy and 0-d torch scalars are
    rewards. In the process pool the value is checked in the worker the same way."""
    ro, sync, tok = _rollout(f"rollout.reward_pool={pool}", "rollout.reward_workers=1",
                             "data_source.reward=test_bad_values:value_reward")
    try:
        got = {label: _score(ro, sync, tok, ["1"], label)[0] for label in VALUES}
        metrics = sync.run(ro._step_metrics(), 10)
    finally:
        ro.stop()
        sync.close()
    for label, traj in got.items():
        if label in ACCEPTED:
            assert traj.status == COMPLETED and traj.reward == ACCEPTED[label] and type(traj.reward) is float, label
        else:
            assert traj.status == FAILED, label
            assert traj.metadata["error"].startswith("the reward function test_bad_values:value_reward returned ")
    assert got["nan"].metadata["error"].endswith("returned nan, not a finite number")
    assert got["nan_tensor"].metadata["error"].endswith("returned nan, not a finite number")
    assert got["str"].metadata["error"].endswith("returned ' 2 ' (str), not a real number; accepted: an int, float "
                                                 "or bool, or a numpy or 0-d torch scalar holding one")
    assert metrics["rollout/reward_error_count"] == len(VALUES) - len(ACCEPTED)
    assert metrics["rollout/reward_timeout_count"] == 0


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_a_reward_that_raises_is_named_with_its_exception_and_line_and_its_first_traceback_logged(pool, caplog):
    """The reason names the exception and the file and line that raised (in the process pool too, where the
    traceback crosses from the worker); the traceback is logged once, however often the same line raises."""
    ro, sync, tok = _rollout(f"rollout.reward_pool={pool}", "rollout.reward_workers=1",
                             "data_source.reward=test_bad_values:value_reward")
    try:
        with caplog.at_level("WARNING", logger="rollout"):
            traj = _score(ro, sync, tok, ["1", "2"], "no such label")[0]
            _score(ro, sync, tok, ["3"], "no such label")
    finally:
        ro.stop()
        sync.close()
    site = site_of(value_reward, "return VALUES[label]")
    assert traj.status == FAILED and traj.metadata["error"] == (
        f"the reward function test_bad_values:value_reward raised KeyError('no such label') at {site}")
    tracebacks = [r.getMessage() for r in caplog.records if "Traceback (most recent call last)" in r.getMessage()]
    assert len(tracebacks) == 1, tracebacks
    assert tracebacks[0].startswith(f"the first failure of the reward function test_bad_values:value_reward, raised "
                                    f"at {site} (its traceback; not logged again):\nTraceback")
    assert "    return VALUES[label]\n" in tracebacks[0] and tracebacks[0].endswith("\nKeyError: 'no such label'")


def test_a_non_finite_reward_that_reaches_the_trainer_is_refused_not_dropped():
    """Rewards reach the trainer only as finite numbers; a NaN that got there another way (a saved rollout) would
    turn its group's advantages to NaN, whose tokens the loss leaves out without a word: refused, naming the group."""
    cfg = config.load_config(None, [])
    g = buffer.PromptGroup(0, 7, 7, torch.tensor([5, 6]))
    trajs = [Trajectory(0, 7, i, g.prompt_ids, torch.tensor([1, 2]), torch.tensor([1, 1]), torch.zeros(2),
                        torch.zeros(2, dtype=torch.long), reward=r) for i, r in enumerate([1.0, float("nan")])]
    with pytest.raises(ValueError, match=r"group \(0, 7\) reached the trainer with rewards \[1.0, nan\]"):
        batching.make_sequences([buffer.Group(g, trajs)], cfg)
    trajs[1].reward = 0.0
    assert [s["adv"] for s in batching.make_sequences([buffer.Group(g, trajs)], cfg)] == pytest.approx([0.707, -0.707],
                                                                                                    abs=1e-3)


@pytest.mark.parametrize("override", ["trainer.lr=.nan", "weight_sync.timeout_s=.nan", "trainer.lr=nan",
                                      "rollout.trajectory_timeout_s=.inf", "rollout.server_keepalive_s=.inf",
                                      "buffer.get_timeout_s=.inf", "data_source.weight=.inf",
                                      "algorithm.clip_low=-.inf", "trainer.betas=[0.9, .nan]",
                                      "algorithm.clip_high=.nan"])
def test_non_finite_config_floats_are_refused_in_one_sentence(override):
    key, value = override.split("=")
    key = "trainer.betas[1]" if key == "trainer.betas" else key
    with pytest.raises(ValueError) as err:
        config.load_config(None, [override])
    message = str(err.value)
    assert message.startswith(f"config key '{key}' must be a finite number, got ")
    if "inf" in value:
        assert message.endswith("(.inf is accepted only by algorithm.decoupled_ppo.behav_imp_weight_cap, "
                                "algorithm.clip_high)")


def test_inf_is_accepted_where_it_means_no_limit():
    cfg = config.load_config(None, ["algorithm.clip_high=.inf", "algorithm.decoupled_ppo.behav_imp_weight_cap=.inf"])
    assert cfg.algorithm.clip_high == float("inf")


def test_the_math_reward_runs_where_it_can_be_killed():
    assert config.load_config(None, ["data_source.reward=math"]).rollout.reward_pool == "auto"
    with pytest.raises(ValueError, match=r"^data_source.reward math may run for minutes .* must run where it can be "
                                         r"killed: rollout.reward_pool=process or auto, not thread$"):
        config.load_config(None, ["data_source.reward=math", "rollout.reward_pool=thread"])


def test_a_math_answer_that_hangs_the_verifier_is_killed_at_the_timeout_while_the_loop_serves():
    """9^{9^{9^{9}}} holds the GIL inside sympy for minutes (in a thread, math-verify's own timeouts are off): in the
    process pool its call is killed at rollout.reward_timeout_s, the trajectory fails counted, the worker is replaced
    for the next answer, and the rollout's event loop keeps its heartbeat throughout."""
    ro, sync, tok = _rollout("data_source.reward=math", "rollout.reward_timeout_s=2", "rollout.reward_workers=1")
    beats = []

    async def heartbeat():
        while True:
            beats.append(time.monotonic())
            await asyncio.sleep(0.02)

    try:
        assert ro.scorer.pool == "process"
        assert _score(ro, sync, tok, ["Answer: 3"], "3")[0].reward == 1.0  # the worker started (math-verify loaded)
        beating = asyncio.run_coroutine_threadsafe(heartbeat(), sync.loop)
        t0 = time.monotonic()
        hung, after = _score(ro, sync, tok, ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{2\\sqrt{2}}"], "\\sqrt{8}")
        elapsed = time.monotonic() - t0
        beating.cancel()
        metrics = sync.run(ro._step_metrics(), 10)
    finally:
        ro.stop()
        sync.close()
    assert hung.status == FAILED and hung.metadata["error"] == (
        "the reward function math did not return within rollout.reward_timeout_s=2 s; its worker process was killed "
        "and replaced")
    assert after.status == COMPLETED and after.reward == 1.0  # scored by the replacement worker
    assert metrics["rollout/reward_timeout_count"] == 1 and metrics["rollout/reward_error_count"] == 0
    assert 2 <= elapsed < 30  # the timeout, the kill and a fresh worker's start (math-verify's import)
    gaps = [b - a for a, b in zip(beats, beats[1:]) if a >= t0]
    assert len(gaps) > 50 and max(gaps) < 1.0, f"the event loop stalled {max(gaps):.2f} s"


# ---------------------------------------------------------------------------------------------------------------
# The observation cap

class _FloodEnv:
    """A tool whose one step answers with a megabyte of text; the episode ends at its next step."""
    max_turns = 3
    SIZE = 1_000_000

    def __init__(self, label, metadata):
        self.steps = 0

    def step(self, turn_text):
        self.steps += 1
        return "=" + "7" * self.SIZE + "\n" if self.steps == 1 else None


def test_an_observation_is_cut_to_env_max_obs_tokens_before_it_is_tokenized_off_the_loop(monkeypatch):
    """A 1 MB observation is cut at rollout.env_max_obs_tokens x 16 characters before any tokenizing, tokenized on
    the observation thread (not the event loop), cut to the cap in tokens, recorded cut in env_turns, and counted in
    rollout/env_obs_truncated_count; a short observation is left as it is."""
    tok = tiny_model.build_tokenizer()
    encoded = []
    encode = type(tok).encode

    def recording_encode(self, text, *args, **kwargs):
        encoded.append((len(text), threading.current_thread().name))
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tok), "encode", recording_encode)  # the rollout's tokenizer is one of this class
    results, metrics = _run_calc(monkeypatch, _FloodEnv, [(2, 3)], "rollout.env_max_obs_tokens=200",
                                 "rollout.sampling.max_new_tokens=240")
    short = env_steps.EnvSteps(config.load_config(None, ["rollout.env_max_obs_tokens=200"]).rollout, tok).cap("=5\n")
    assert max(n for n, _ in encoded) <= 200 * 16  # never the megabyte
    assert all(name.startswith("env-obs") for n, name in encoded if n > 2048)
    assert any(n > 2048 for n, _ in encoded)
    for t in results[0]:
        assert t.status == COMPLETED
        (turn, observation), = t.metadata["env_turns"]
        assert observation == "=" + "7" * 199  # the tiny tokenizer: a token a character
        (a, b), = t.metadata["env_spans"]
        assert b - a == 200 and t.loss_mask[a:b].sum() == 0
    assert metrics["rollout/env_obs_truncated_count"] == 2
    assert short == ("=5\n", tok.encode("=5\n", add_special_tokens=False))
