"""examples/clipped_loss.py: a policy loss of your own (algorithm.policy_loss), a variant of PPO.

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        algorithm.policy_loss=clipped_loss:symmetric_ppo

symmetric_ppo is the default `ppo` loss with the ratio clipped symmetrically, to [1 - clip_low, 1 + clip_low]: PPO
without DAPO's clip-higher (algorithm.clip_high is ignored). A policy loss has the signature of the values of
losses.POLICY_LOSSES and returns (loss, metrics): the loss is this micro-batch's share of the mini-batch loss
(divide by loss_denominator), and every metric, a scalar tensor named train/<name>, is averaged over the tokens of
the step and logged. The trainer ranks call it; the first call prints one line with the process id.
"""
import copy
import os

import losses

_said = False


def symmetric_ppo(log_probs, old_log_probs, rollout_log_probs, advantages, loss_mask, versions, current_version,
                  algo, loss_denominator, entropy=None):
    """losses.ppo_choice with algorithm.clip_high replaced by algorithm.clip_low."""
    global _said
    if not _said:
        _said = True
        print(f"clipped_loss: symmetric_ppo called in pid {os.getpid()}", flush=True)
    algo = copy.copy(algo)  # the run's config section: change a copy, not the run's settings
    algo.clip_high = algo.clip_low
    return losses.ppo_choice(log_probs, old_log_probs, rollout_log_probs, advantages, loss_mask, versions,
                             current_version, algo, loss_denominator, entropy)
