"""buffer.py: the data between rollout and training.

Data types (Trajectory, Group, PromptGroup), the data source, TrajQueue, the collector and PipelineBuffer,
with the semantics of ../shared/spec/fully_async_mode.md sections 1-3. Imports only the standard library and torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

# Trajectory status values. A trajectory is terminal in every one of them; "aborted" ones may be restored.
COMPLETED, TRUNCATED, ABORTED, FAILED = "completed", "truncated", "aborted", "failed"
STATUSES = (COMPLETED, TRUNCATED, ABORTED, FAILED)


@dataclass
class Trajectory:
    """One sampled response to one prompt. Token data are tensors so that moving them between processes is cheap.

    `versions[t]` is the weight version that generated response token t (environment tokens in multi-turn
    rollouts carry the version of the turn that preceded them). `loss_mask[t]` is 1 for tokens the policy
    generated and 0 for environment tokens or masked off-policy tokens.
    """
    epoch: int  # data-source epoch of the prompt
    seq: int  # dispatch sequence number of the group (monotonic over the whole run)
    index: int  # position of this trajectory in its group, 0..N-1
    prompt_ids: torch.Tensor  # int64 [P]
    response_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # int64 [T]
    rollout_log_probs: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # float32 [T]
    versions: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # int64 [T]
    loss_mask: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # int64 [T], 0/1
    reward: float = 0.0
    status: str = COMPLETED  # completed | truncated | aborted | failed
    start_version: int = -1  # weight version of the first generated token (-1: nothing generated yet)
    end_version: int = -1  # weight version of the last generated token
    metadata: dict = field(default_factory=dict)  # free-form (turns, finish reason, errors, timings, ...)

    @property
    def prompt_id(self) -> tuple[int, int]:
        """(epoch, seq): the group key; PipelineBuffer consumes oldest epoch, then oldest seq, first."""
        return (self.epoch, self.seq)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.numel() + self.response_ids.numel())


@dataclass
class PromptGroup:
    """A prompt handed out for dispatch: N trajectories are to be generated for it.

    `partial` holds the N trajectories of a group restored at a step boundary (dispatched first, continuing from
    their partial responses); it is empty for a fresh prompt.
    """
    epoch: int
    seq: int
    data_index: int  # index of the prompt in its data source's epoch
    prompt_ids: torch.Tensor  # int64 [P]
    label: Any = None  # ground truth handed to the reward function
    source: int = 0  # index into cfg.data_sources
    metadata: dict = field(default_factory=dict)
    partial: list = field(default_factory=list)  # list[Trajectory], restored groups only

    @property
    def prompt_id(self) -> tuple[int, int]:
        return (self.epoch, self.seq)


@dataclass
class Group:
    """N trajectories of one prompt, as the collector writes them into PipelineBuffer."""
    prompt: PromptGroup
    trajectories: list  # list[Trajectory], len N, sorted by index

    @property
    def prompt_id(self) -> tuple[int, int]:
        return self.prompt.prompt_id

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]
