"""bench/learning_sim.py: the simulated clock and learner behave as the figures assume (a few seconds in all).

Each check would fail if the simulator were wrong in a way that moves its figures: staleness that is not the
rule's, a clock that does not overlap generation with training, a learner whose drift is not the tuned one, or a
loss that does not see the behaviour policy.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import learning_sim as ls  # noqa: E402

TB, GB = "training-bound 8:8", "generation-bound 12:4"


def run(rule, k, split=TB, steps=8, loss=ls.DEFAULT_LOSS, seed=0, overrides=()):
    out = ls.simulate(ls.Run(rule, k, split, seed, loss=loss, steps=steps, overrides=overrides))
    assert "error" not in out, out.get("error")
    return out


def test_synchronous_trains_fresh_tokens_only_and_waits_for_the_longest_response():
    r = run("sync", 0)
    assert r["staleness_mean"] == 0 and r["staleness_max"] == 0
    assert r["generated_per_trained"] == pytest.approx(1.0)
    assert r["ess"] == pytest.approx(1.0)  # mu is the step-start snapshot itself
    # the long tail: a step waits for the slowest of B x N responses, well above the overlap bound
    assert r["step_s"] > 1.5 * r["ideal_step_s"]


def test_a_looser_bound_trains_staler_tokens_when_training_is_the_bottleneck():
    # AReaL's max_concurrent_rollouts raised above the eta = 4 budget ((4 + 1) B groups), so eta alone binds
    free = ("rollout.async_max_concurrent_samples=640",)
    tight, loose = run("areal", 1, overrides=free), run("areal", 4, overrides=free)
    assert 0 < tight["staleness_mean"] < 1.5 <= tight["staleness_mean"] + 1
    assert tight["staleness_max"] <= 2
    assert loose["staleness_mean"] > tight["staleness_mean"] + 1.5
    assert loose["staleness_max"] <= 5
    # fully-async overlaps generation with training: a training-bound step is near the ideal
    assert loose["step_s"] < 1.1 * loose["ideal_step_s"]
    # staler behaviour weights spread out: a lower effective sample size
    assert loose["ess"] < tight["ess"] <= 1.0
    # AReaL's default max_concurrent_rollouts (B groups running) binds before eta = 4 does
    assert run("areal", 4)["staleness_mean"] < loose["staleness_mean"] - 0.2


def test_per_step_kl_is_in_the_tuned_range():
    r = run("windowed-fifo", 1, steps=10)
    assert 3e-4 < r["kl_step"] < 5e-3
    assert r["curve"][-1]["eval"] > r["curve"][0]["eval"] + 0.05  # it learns


def test_naive_ppo_against_stale_mu_learns_slower_than_the_snapshot_ratio():
    default, naive = run("areal", 4, steps=20), run("areal", 4, steps=20, loss="naive")
    assert naive["curve"][-1]["eval"] < default["curve"][-1]["eval"] - 0.03


def test_the_grid_table_has_intervals_over_seeds():
    rows = ls.cells([run("sync", 0, steps=4, seed=s) for s in range(2)], target=0.26)
    assert len(rows) == 1 and rows[0]["seeds"] == 2
    mean, half = rows[0]["final"]
    assert half > 0 and 0.25 < mean < 1
    assert "+-" in ls.table(rows, 0.26)


def test_each_rule_trains_with_its_peers_loss_and_mask_through_the_trainers_config():
    """The simulator's losses are algorithm.policy_loss's (losses.POLICY_LOSSES) chosen by the run's config: a preset
    with its peer's loss and mask (strategies.peer_overrides), the spec's rules with tiny.yaml's."""
    import losses
    import strategies
    assert set(losses.POLICY_LOSSES) <= set(ls.LOSSES)
    for rule in strategies.PRESETS:
        cfg = ls.make_cfg(ls.Run(rule, 2, TB, 0))
        peer = strategies.REGISTRY[rule]
        assert cfg.algorithm.policy_loss == peer.policy_loss
        assert cfg.rollout.mask_offpolicy_in_partial_rollout == (True if peer.offpolicy_mask is None
                                                                 else peer.offpolicy_mask)
    spec = ls.make_cfg(ls.Run("windowed-fifo", 2, TB, 0))
    assert spec.algorithm.policy_loss == "ppo" and spec.rollout.mask_offpolicy_in_partial_rollout
    naive = ls.make_cfg(ls.Run("areal", 4, TB, 0, loss="naive"))
    assert naive.algorithm.policy_loss == "ppo" and naive.trainer.use_rollout_log_probs
    assert not naive.algorithm.is_correction.enable and not naive.rollout.mask_offpolicy_in_partial_rollout
