"""tests/ledger_env.py: a tool environment whose every call is a side effect written down, for the kill-and-resume
test (tests/test_resume_in_flight.py: rollout.env=ledger_env:LedgerEnv with tests/ on PYTHONPATH).

Each step appends one JSON line to the file named by $LEDGER_ENV_PATH, before its latency (a call that was started
has happened): the trajectory (metadata["trajectory_id"]: [epoch, seq, index]), the turn, the process and the time.
restore(turns) takes a restored trajectory's finished turns without calling anything, so a call that appears twice
in the ledger ran twice. The latency (0.2-0.5 s) keeps episodes in flight at the step boundaries.
"""
import asyncio
import json
import os
import random
import time


class LedgerEnv:
    max_turns = 3

    def __init__(self, label=None, metadata=None):
        self.id = list(metadata["trajectory_id"])
        self.turn = 0

    def restore(self, turns: list) -> None:
        self.turn = len(turns)

    async def step(self, turn_text: str) -> str:
        self.turn += 1
        with open(os.environ["LEDGER_ENV_PATH"], "a") as f:
            f.write(json.dumps({"id": self.id, "turn": self.turn, "pid": os.getpid(), "time": time.time()}) + "\n")
        await asyncio.sleep(random.uniform(0.2, 0.5))
        return f"={len(turn_text)}\n"
