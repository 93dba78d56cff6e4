"""examples/echo_env.py: a tool environment of your own (rollout.env), for the multi-turn rollout functions.

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        rollout.function=multi_turn_tool rollout.env=echo_env:EchoEnv rollout.sampling.max_new_tokens=16

A tool environment is built fresh for each trajectory (the class, or any factory, is called with the prompt's label
and metadata) and has `max_turns` (model turns per episode, at most) and `step(turn_text)`, sync or async: the text of
the model's last turn in, the observation appended to the response out (loss mask 0: the model does not learn to
produce it), or None to end the episode. The full interface (restore, failures, the bound on steps at once) is in
tasks.make_env's docstring and docs/agents.md. Its tokens count against rollout.sampling.max_new_tokens, hence the
larger budget above. The rollout process builds it (rollout_fns.multi_turn_tool, or your own rollout function:
examples/rollout_fn.py); the first one prints a line with the process id.
"""
import os

_said = False


class EchoEnv:
    """Echoes the model's first turn back as "=<text>\\n", then lets the model answer once more."""

    max_turns = 2

    def __init__(self, label=None, metadata=None):
        global _said
        if not _said:
            _said = True
            print(f"echo_env: EchoEnv built in pid {os.getpid()}", flush=True)
        self.turns = 0

    def step(self, turn_text):
        self.turns += 1
        return f"={turn_text.strip()}\n" if self.turns < self.max_turns else None
