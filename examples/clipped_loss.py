"""examples/clipped_loss.py: a policy loss of your own (algorithm.policy_loss), a variant of PPO.

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        algorithm.policy_loss=clipped_loss:symmetric_ppo

symmetric_ppo is the default `ppo` loss with the ratio clipped symmetrically, to [1 - clip_low, 1 + clip_low]: PPO
without DAPO's clip-higher (algorithm.clip_high is ignored). A policy loss has the signature of every loss in
losses.POLICY_LOSSES, fn(batch: losses.TokenBatch, settings, denominator) -> (loss, metrics): the loss is this
micro-batch's share of the mini-batch loss (divide by the denominator), and every metric, a scalar tensor named
train/<name>, is averaged over the tokens of the step and logged. `@losses.register` (without a name: the loss is
selected as module:function) declares what config.validate checks at start-up in every process, here that the clip
range is not empty. The trainer ranks call it; the first call prints one line with the process id.
"""
import copy
import os

import losses

_said = False


def clip_range_not_empty(settings, use_rollout_log_probs):
    """With clip_low = 0 the symmetric range is [1, 1]: every token would be clipped and none would train."""
    if settings.clip_low <= 0:
        return (f"algorithm.policy_loss=clipped_loss:symmetric_ppo clips the ratio to [1 - algorithm.clip_low, "
                f"1 + algorithm.clip_low], which needs algorithm.clip_low > 0, got {settings.clip_low}")
    return None


@losses.register(check=clip_range_not_empty)
def symmetric_ppo(batch, settings, denominator):
    """losses.ppo with algorithm.clip_high replaced by algorithm.clip_low."""
    global _said
    if not _said:
        _said = True
        print(f"clipped_loss: symmetric_ppo called in pid {os.getpid()}", flush=True)
    settings = copy.copy(settings)  # the run's config section: change a copy, not the run's settings
    settings.clip_high = settings.clip_low
    return losses.ppo(batch, settings, denominator)
