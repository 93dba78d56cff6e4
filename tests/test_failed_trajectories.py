"""A failed trajectory leaves its group, not the group (issue 48, item 1): with rollout.filter `failed` the collector
takes failed trajectories out and trains the group on its survivors when at least rollout.min_group_size remain
(staleness.trained, staleness.filter_reason), else drops it, counted; the trainer's GRPO advantages and every
loss aggregation's denominator then run over the survivors (batching.make_sequences, actor.Actor.plan).
rollout.env_retries is tested in tests/test_rollout.py (test_env_retries_*).

Run: .venv/bin/python -m pytest -q tests/test_failed_trajectories.py
"""
import math
import random
from types import SimpleNamespace

import pytest
import torch

import actor
import batching
import buffer
import losses
from buffer import COMPLETED, FAILED, PipelineServer
from test_buffer import make_cfg, make_prompts, traj

MAX_NEW_TOKENS = 16  # rollout.sampling.max_new_tokens: seq-mean-token-sum-norm's constant length


def _server(N, overrides=(), B=1, stale=0.0):
    cfg = make_cfg(B=B, N=N, stale=stale, overrides=[f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
                                                     *overrides])
    return cfg, PipelineServer(cfg, make_prompts(400), collector_thread=False)


# ---------------------------------------------------------------------------------------------------------
# The advantages and the loss of a group of N - k
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(losses.LOSS_AGG))
def test_a_group_of_8_with_3_failed_trains_on_its_5_survivors_advantages_and_loss(mode):
    """N = 8, trajectories 1, 4 and 6 failed. The 5 survivors (0, 2, 3, 5, 7) have rewards 1, 0, 0, 1, 1 and 3, 4, 5,
    3, 4 response tokens; the failed ones 7 tokens each and reward 0 (a failed trajectory is not scored), so any of
    them in the mean, the std or a denominator would change every number below.

    GRPO by hand over the 5 (losses.compute_advantages: the std is the unbiased one, eps 1e-6 added to it):
      mean = (1 + 0 + 0 + 1 + 1) / 5 = 0.6;  deviations 0.4, -0.6, -0.6, 0.4, 0.4;
      sum of squares = 3 x 0.16 + 2 x 0.36 = 1.2;  var = 1.2 / (5 - 1) = 0.3;  std = sqrt(0.3) = 0.5477;
      A = 0.4 / (0.5477 + 1e-6) = 0.7303 (rewards 1), -0.6 / (0.5477 + 1e-6) = -1.0954 (rewards 0).
    Dr. GRPO (algorithm.adv.std_normalize=false): A = 0.4, -0.6, -0.6, 0.4, 0.4.
    The loss at ratio 1 (log pi = log pi_old) is -A on each token, so the mini-batch loss of each
    algorithm.loss_agg_mode, its denominator D over the survivors only, is
      token-mean:               -(sum_i A_i T_i) / (3 + 4 + 5 + 3 + 4 = 19 tokens)
      seq-mean-token-mean:      -(sum_i A_i) / 5 sequences
      seq-mean-token-sum-norm:  -(sum_i A_i T_i) / (5 sequences x 16, rollout.sampling.max_new_tokens)."""
    cfg, srv = _server(8, ["rollout.filter=[failed]", "rollout.min_group_size=4", f"algorithm.loss_agg_mode={mode}"])
    (g,) = srv.dispatch(max_groups=1)
    failed, lengths, rewards = {1, 4, 6}, [3, 7, 4, 5, 7, 3, 7, 4], [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    srv.put([traj(g, i, reward=rewards[i], status=FAILED if i in failed else COMPLETED, T=lengths[i])
             for i in range(8)])
    (group,) = srv.get(1, timeout=0)
    assert [t.index for t in group.trajectories] == [0, 2, 3, 5, 7]

    std = math.sqrt(0.3)
    want = [0.4 / (std + 1e-6), -0.6 / (std + 1e-6), -0.6 / (std + 1e-6), 0.4 / (std + 1e-6), 0.4 / (std + 1e-6)]
    seqs = batching.make_sequences([group], cfg)
    assert [s["adv"] for s in seqs] == pytest.approx(want, abs=1e-6)
    assert [len(s["response"]) for s in seqs] == [3, 4, 5, 3, 4]
    cfg.algorithm.adv.std_normalize = False
    assert [s["adv"] for s in batching.make_sequences([group], cfg)] == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4])
    cfg.algorithm.adv.std_normalize = True

    # the trainer's own plan of the mini-batch (two ranks, DUMMY rows padding one), and its loss
    plans, denom = actor.Actor.plan(SimpleNamespace(cfg=cfg, world=2), [group])
    lengths = [3, 4, 5, 3, 4]
    weighted = sum(a * n for a, n in zip(want, lengths))
    want_denom, want_loss = {"token-mean": (19, -weighted / 19), "seq-mean-token-mean": (5, -sum(want) / 5),
                             "seq-mean-token-sum-norm": (5 * 16, -weighted / 80),
                             "seq-mean-token-sum": (5, -weighted / 5)}[mode]  # PipelineRL's: token sum / sequences
    assert denom == want_denom
    loss = 0.0
    for plan in plans:
        for b in plan:
            logp = torch.zeros_like(b["mask"], requires_grad=True)
            loss += float(actor.micro_batch_loss(cfg, logp, logp.detach(), b, denom, None, 0)[0].detach())
    assert loss == pytest.approx(want_loss, abs=1e-5)


# ---------------------------------------------------------------------------------------------------------
# The collector: trained short, dropped, counted
# ---------------------------------------------------------------------------------------------------------

def test_failed_trajectories_leave_their_groups_at_a_random_rate_and_every_count_matches():
    """200 groups of N = 8, each trajectory failing with probability 0.35 (a seeded RNG): a group with k failed
    is trained on its 8 - k survivors when 8 - k >= rollout.min_group_size = 4, else dropped; the survivors are
    exactly the trajectories that did not fail, and every counter agrees with what the RNG drew."""
    cfg, srv = _server(8, ["rollout.filter=[failed]", "rollout.min_group_size=4"], B=4, stale=1.0)
    rng = random.Random(48)
    want = {"kept": 0, "short": 0, "dropped": 0, "failed": 0, "discarded": 0}
    survivors = {}
    for _ in range(200):
        (g,) = srv.dispatch(max_groups=1)
        trajs = [traj(g, i, reward=rng.random(), status=FAILED if rng.random() < 0.35 else COMPLETED,
                      T=rng.randint(2, 6)) for i in range(8)]
        k = sum(t.status == FAILED for t in trajs)
        want["failed"] += k
        if 8 - k >= 4:
            want["kept"] += 1
            want["short"] += k > 0
            survivors[g.prompt_id] = [t.index for t in trajs if t.status != FAILED]
            want["discarded"] += sum(len(t.response_ids) for t in trajs if t.status == FAILED)
        else:
            want["dropped"] += 1
            want["discarded"] += sum(len(t.response_ids) for t in trajs)
        srv.put(trajs)
        for got in srv.get(srv.stats()["Q"], timeout=0) if srv.stats()["Q"] else []:
            assert [t.index for t in got.trajectories] == survivors.pop(got.prompt_id)
            assert all(t.status == COMPLETED for t in got.trajectories)
    assert not survivors and 0 < want["dropped"] < want["short"] < want["kept"]  # both paths taken, many times
    m = srv.step_metrics()
    assert m["rollout/collected_groups"] == m["rollout/consumed_groups"] == want["kept"]
    assert m["rollout/trained_short_groups"] == want["short"]
    assert m["rollout/filter_drop"] == m["rollout/min_group_size_drop"] == want["dropped"]
    assert m["rollout/failed_removed_count"] == want["failed"]
    assert m["rollout/discarded_tokens"] == want["discarded"]


def test_all_equal_reward_is_asked_of_the_survivors_and_the_waiting_line_says_why():
    cfg, srv = _server(8, ["rollout.filter=[failed, all_equal_reward]"], B=4, stale=1.0)
    assert srv.min_group_size == 4  # the default: N // 2
    gs = srv.dispatch(max_groups=3)
    # the failed trajectory (reward 0) is all that differs: the 7 survivors carry no GRPO signal
    srv.put([traj(gs[0], i, reward=1.0, status=FAILED if i == 3 else COMPLETED) for i in range(8)])
    # 5 failed: 3 survive, below the 4 of rollout.min_group_size
    srv.put([traj(gs[1], i, status=FAILED if i < 5 else COMPLETED) for i in range(8)])
    srv.put([traj(gs[2], i, status=FAILED if i in (0, 7) else COMPLETED) for i in range(8)])  # rewards 1..6 differ
    w = srv.wait(1, timeout=0.0)
    assert w["drop_reasons"] == {"all 7 rewards 1.0": 1, "5 of 8 failed": 1} and w["ready"] == 1
    m = srv.step_metrics()
    assert m["rollout/filter_drop"] == 2 and m["rollout/min_group_size_drop"] == 1
    assert m["rollout/failed_removed_count"] == 1 + 5 + 2
    assert [t.index for t in srv.get(1, timeout=0)[0].trajectories] == [1, 2, 3, 4, 5, 6]


def test_without_the_failed_filter_a_group_keeps_its_failed_trajectories():
    cfg, srv = _server(4, ["rollout.filter=[]"])
    (g,) = srv.dispatch(max_groups=1)
    srv.put([traj(g, i, status=FAILED if i else COMPLETED) for i in range(4)])
    assert [t.status for t in srv.get(1, timeout=0)[0].trajectories] == [COMPLETED] + [FAILED] * 3
    m = srv.step_metrics()
    assert m["rollout/failed_removed_count"] == m["rollout/trained_short_groups"] == m["rollout/filter_drop"] == 0


def test_min_group_size_defaults_to_half_of_n_at_least_2_and_is_validated_in_one_sentence():
    floors = {n: buffer.BufferSettings(num_trajectories_per_prompt=n).group_floor for n in (1, 2, 3, 4, 8, 16, 17)}
    assert floors == {1: 1, 2: 2, 3: 2, 4: 2, 8: 4, 16: 8, 17: 8}
    assert buffer.BufferSettings(num_trajectories_per_prompt=8, min_group_size=8).group_floor == 8
    for n, value, accepted in [(8, 1, "from 2 to data_source.num_trajectories_per_prompt (8)"),
                               (8, 9, "from 2 to data_source.num_trajectories_per_prompt (8)"),
                               (2, 3, "from 2 to data_source.num_trajectories_per_prompt (2)"), (1, 2, "1")]:
        with pytest.raises(ValueError) as e:
            make_cfg(N=n, overrides=[f"rollout.min_group_size={value}"])
        assert str(e.value) == f"rollout.min_group_size must be {accepted} or null (N // 2, at least 2), got {value}"
    with pytest.raises(ValueError, match=r"^rollout.min_group_size must be from 2 to .* got 0$"):
        buffer.BufferSettings(num_trajectories_per_prompt=4, min_group_size=0).group_floor


def test_a_shortened_buffered_group_that_a_smaller_resumed_capacity_sends_to_the_lane_has_all_n_slots():
    """A checkpoint's buffered groups beyond a resumed run's capacity go to the restored lane; one the failed filter
    shortened (6 of 8 trained) comes out of it with all 8 slots, its survivors as saved and the 2 failed ones as
    empty aborted trajectories, generated anew (the rollout refuses a restored group of fewer than N)."""
    _, srv = _server(8, ["rollout.filter=[failed]"], B=2, stale=1.0)
    gs = srv.dispatch()
    for k, g in enumerate(gs[:3]):
        srv.put([traj(g, i, status=FAILED if k == 2 and i in (1, 5) else COMPLETED) for i in range(8)])
    state = srv.state_dict()
    assert [len(d["partial"]) for d in state["buffered"]] == [8, 8, 6]
    _, small = _server(8, ["rollout.filter=[failed]"], B=1, stale=1.0)  # capacity 2 groups, not 4
    small.load_state_dict(state)
    assert small.stats(keys=True)["buffered_keys"] == [gs[0].prompt_id, gs[1].prompt_id]
    small.get(1, timeout=0)  # a slot of the capacity free again
    back, = small.dispatch(1)
    assert back.prompt_id == gs[2].prompt_id and [t.index for t in back.partial] == list(range(8))
    assert [t.status for t in back.partial] == [COMPLETED, "aborted"] + [COMPLETED] * 3 + ["aborted"] + [COMPLETED] * 2
    assert all(len(back.partial[i].response_ids) == 0 for i in (1, 5))
