"""examples/slow_flaky_env.py: a tool environment that is slow and fails, as real tools are (rollout.env).

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        data_source.task=calc_tool rollout.function=multi_turn_tool rollout.env=slow_flaky_env:SlowFlakyEnv \\
        rollout.env_max_concurrent=4 rollout.sampling.max_new_tokens=24

The calculator of the calc_tool task (tasks.CalcToolEnv) behind an `async def step` that sleeps 0.05-0.3 s (a
tool's latency: the rollout's event loop goes on meanwhile) and raises on a random FAIL_RATE of its calls (a
random.Random(SEED) draw per call, in call order). The rollout runs at most rollout.env_max_concurrent steps at once
(rollout/env_in_use_max, rollout/env_wait_s_mean); a step that raises fails its trajectory, counted in
rollout/env_error_count, its group is trained on the others (rollout.min_group_size), and the run goes on. Each new
most-steps-at-once this environment itself sees is printed with the process id, so a test can check the bound from
the environment's side.
"""
import asyncio
import os
import random

import tasks

FAIL_RATE, SEED = 0.05, 0  # each call raises with probability FAIL_RATE, drawn from random.Random(SEED)

_fail_rng = random.Random(SEED)
_in_step = 0
_most = 0


class SlowFlakyEnv(tasks.CalcToolEnv):
    """tasks.CalcToolEnv whose steps take 0.05-0.3 s and fail at random, FAIL_RATE of them."""

    async def step(self, turn_text):
        global _in_step, _most
        fails = _fail_rng.random() < FAIL_RATE  # drawn when the call starts: the draws follow the calls' order
        _in_step += 1
        try:
            if _in_step > _most:
                _most = _in_step
                print(f"slow_flaky_env: {_most} steps at once in pid {os.getpid()}", flush=True)
            await asyncio.sleep(random.uniform(0.05, 0.3))
            if fails:
                raise ConnectionError("slow_flaky_env: the tool's backend dropped the call")
            return super().step(turn_text)
        finally:
            _in_step -= 1
