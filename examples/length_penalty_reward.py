"""examples/length_penalty_reward.py: a reward of your own (data_source.reward), for the reverse_digits task.

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        data_source.reward=length_penalty_reward:reward

A reward is fn(response_text, label, stopped) -> float: the decoded response (environment text included), the
prompt's label, and whether the response ended on its own (False: cut at rollout.sampling.max_new_tokens). It runs
in the rollout process (on rollout.reward_pool's threads or processes, or on its event loop), so it must be a
module-level function (picklable). The first call prints one line with the process id.
"""
import os

import tasks

PENALTY = 0.1  # subtracted per character beyond the label's length

_said = False


def reward(response_text, label, stopped):
    """tasks.reverse_digits_reward, less PENALTY per character the response has beyond the label's length."""
    global _said
    if not _said:
        _said = True
        print(f"length_penalty_reward: reward called in pid {os.getpid()}", flush=True)
    extra = max(0, len(response_text.strip()) - len(str(label)))
    return tasks.reverse_digits_reward(response_text, label, stopped) - PENALTY * extra
