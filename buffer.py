"""buffer.py: the data between rollout and training (remote.py serves it over torch.distributed.rpc).

Data types (Trajectory, PromptGroup, Group), the DataSource (seeded epoch order, monotonic sequence numbers, the
restored lane), TrajQueue (trajectories -> complete groups), the collector thread, the bounded PipelineBuffer (oldest
(epoch, seq) first) and the PipelineServer facade that the rollout and the trainer call. What happens to a group is
decided by one function, PipelineServer._verdict (rollout.filter, the strategy's rollout.max_weight_staleness rule and
its keep, the update action), and carried out and counted by one, PipelineServer._apply, at collection, at the weight
update and at the step boundary. Semantics: docs/design.md, counted in prompt groups (R in flight, Q buffered, C
capacity; strategies.py holds the dispatch/collection/keep rules and the update actions). One lock guards all state
(every operation is O(groups in flight), a few hundred at most). Settings: `BufferSettings` (defaults included), so a
PipelineServer runs with one's own producer and consumer without the run's config (docs/copy_a_piece.md). workers.py
starts the buffer process: python workers.py buffer --config RESOLVED.yaml --rpc-init tcp://host:port --rank R
--world-size W. Tests: tests/test_buffer.py, tests/test_strategies.py. Imports the standard library, torch and
strategies.py (itself stdlib-only) only.
"""
from __future__ import annotations

import dataclasses
import heapq
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

import strategies

# Trajectory status values. A trajectory is terminal in every one of them; "aborted" ones may be restored.
COMPLETED, TRUNCATED, ABORTED, FAILED = "completed", "truncated", "aborted", "failed"
STATUSES = (COMPLETED, TRUNCATED, ABORTED, FAILED)


class NothingToTrain(RuntimeError):
    """The run cannot go on, and waiting longer would not change that: rollout.filter dropped every group of the
    last cfg.filter_stop_groups, or the saved rollouts ran out. The message says what was seen and what to change."""


_EMPTY_INT64, _EMPTY_FLOAT32 = torch.zeros(0, dtype=torch.long), torch.zeros(0)
_EMPTY_INT32 = torch.zeros(0, dtype=torch.int32)
WIRE_BYTES_MAX = 256  # tensor fields of at most this many elements are pickled as bytes (_WireState)


class _WireState:
    """Pickling of a dataclass with short 1-D tensor fields (token data): each such tensor travels as (dtype, raw
    bytes). torch RPC sends every tensor of a pickle as a buffer of its own, a fixed cost on each side that for a
    short trajectory (5 tensors) outweighs the rest of its pickle (docs/results/step_bench.md, profiling notes).
    Longer tensors stay tensors, which RPC moves without a copy."""

    def __getstate__(self) -> tuple:
        state = dict(self.__dict__)
        wired = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1
                 and v.numel() <= WIRE_BYTES_MAX]
        for k in wired:
            state[k] = (str(state[k].dtype).removeprefix("torch."), state[k].numpy().tobytes())
        return state, wired

    def __setstate__(self, st: tuple) -> None:
        state, wired = st
        for k in wired:
            dtype, raw = getattr(torch, state[k][0]), state[k][1]
            state[k] = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.zeros(0, dtype=dtype)
        self.__dict__.update(state)


@dataclass
class Trajectory(_WireState):
    """One sampled response to one prompt. Token data are tensors (1-D; pickled as bytes when short, _WireState).

    `versions[t]` is the weight version that generated response token t (environment tokens in multi-turn
    rollouts carry the version of the turn that preceded them). `loss_mask[t]` is 1 for tokens the policy
    generated and 0 for environment tokens or masked off-policy tokens.
    """
    epoch: int  # data-source epoch of the prompt
    seq: int  # dispatch sequence number of the group (monotonic over the whole run)
    index: int  # position of this trajectory in its group, 0..N-1
    prompt_ids: torch.Tensor  # int64 [P]
    # (the defaults are shared empty tensors: four new ones per trajectory cost the producer's hot path measurably,
    # docs/results/step_bench.md; tensor fields are replaced, never changed in place)
    response_ids: torch.Tensor = field(default_factory=lambda: _EMPTY_INT64)  # int64 [T]
    rollout_log_probs: torch.Tensor = field(default_factory=lambda: _EMPTY_FLOAT32)  # float32 [T]
    versions: torch.Tensor = field(default_factory=lambda: _EMPTY_INT64)  # int64 [T]
    loss_mask: torch.Tensor = field(default_factory=lambda: _EMPTY_INT64)  # int64 [T], 0/1
    reward: float = 0.0
    status: str = COMPLETED  # completed | truncated | aborted | failed
    start_version: int = -1  # weight version of the first generated token (-1: nothing generated yet)
    end_version: int = -1  # weight version of the last generated token
    metadata: dict = field(default_factory=dict)  # free-form (turns, finish reason, errors, timings, ...)
    # algorithm.routing_replay: the experts the server routed positions 0 .. R-1 of prompt + response to, [R, layers,
    # top-k] as sglang's meta_info.routed_experts (in uint8, or int16 over 256 experts), R = P + T - 1 once generated
    # (the last token never went through a forward); empty otherwise
    routed_experts: torch.Tensor = field(default_factory=lambda: _EMPTY_INT32)

    @property
    def prompt_id(self) -> tuple[int, int]:
        """(epoch, seq): the group key; PipelineBuffer consumes oldest epoch, then oldest seq, first."""
        return (self.epoch, self.seq)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.numel() + self.response_ids.numel())


@dataclass
class PromptGroup(_WireState):
    """A prompt handed out for dispatch: N trajectories are to be generated for it.

    `partial` holds the N trajectories of a group restored at a step boundary (dispatched first, continuing from
    their partial responses); it is empty for a fresh prompt.
    """
    epoch: int
    seq: int
    data_index: int  # index of the prompt in its data source's epoch
    prompt_ids: torch.Tensor  # int64 [P]
    label: Any = None  # ground truth handed to the reward function
    source: int = 0  # index into cfg.data_source
    metadata: dict = field(default_factory=dict)
    partial: list = field(default_factory=list)  # list[Trajectory], restored groups only

    @property
    def prompt_id(self) -> tuple[int, int]:
        return (self.epoch, self.seq)


@dataclass
class Group:
    """The trajectories of one prompt, as the collector writes them into PipelineBuffer; also what a strategy's keep,
    keep_buffered and consumed are asked about (strategies.Strategy.keep lists what they read). All N of them, or
    fewer: with rollout.filter `failed`, a failed trajectory leaves its group, which is trained on the at least
    rollout.min_group_size that survive (PipelineServer._trained)."""
    prompt: PromptGroup
    trajectories: list  # list[Trajectory], N of them or the survivors, sorted by index

    @property
    def prompt_id(self) -> tuple[int, int]:
        return self.prompt.prompt_id

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def start_version(self) -> int:
        return start_version(self.prompt, self.trajectories)


def start_version(prompt: PromptGroup, trajs: list) -> int:
    """A group's start version: the oldest start version of its trajectories that generated a token (None slots of a
    group in flight skipped), else the weight version it was dispatched under."""
    started = [t.start_version for t in trajs if t is not None and t.start_version >= 0]
    return min(started) if started else prompt.metadata["dispatch_version"]


Key = tuple  # (epoch, seq): the prompt id of a group


# ---------------------------------------------------------------------------------------------------------
# Plain-data conversion for checkpoints: state_dict() holds only dicts, lists, numbers, strings and tensors,
# so torch.save / torch.load(weights_only=True) can store it.
# ---------------------------------------------------------------------------------------------------------

def _traj_to_dict(t: Trajectory) -> dict:
    return {f.name: getattr(t, f.name) for f in dataclasses.fields(Trajectory)}


def _traj_from_dict(d: dict) -> Trajectory:
    return Trajectory(**d)


def group_to_dict(g: Group) -> dict:
    """A Group as plain data (saved rollouts of run_mode=rollout-only); group_from_dict inverts it."""
    prompt = {f.name: getattr(g.prompt, f.name) for f in dataclasses.fields(PromptGroup)}
    prompt["partial"] = [_traj_to_dict(t) for t in g.prompt.partial]
    return {"prompt": prompt, "trajectories": [_traj_to_dict(t) for t in g.trajectories]}


def group_from_dict(d: dict) -> Group:
    prompt = {**d["prompt"], "partial": [_traj_from_dict(t) for t in d["prompt"]["partial"]]}
    return Group(PromptGroup(**prompt), [_traj_from_dict(t) for t in d["trajectories"]])


# ---------------------------------------------------------------------------------------------------------
# Settings: what a PipelineServer reads, with defaults (config.py builds them from a run's config)
# ---------------------------------------------------------------------------------------------------------

@dataclass
class SourceSettings:
    """One data source as the buffer sees it: how its prompts are mixed and shuffled, and what the stop message
    names (its task and reward)."""
    task: str = "custom"  # named in the stop message
    reward: Optional[str] = None  # named in the stop message (None: the task's default)
    weight: float = 1.0  # mixing weight when several sources are given (synchronous mode only)
    seed: int = 0  # seed of the epoch shuffles
    shuffle: bool = True  # reshuffle the prompt order every epoch (deterministic from seed + epoch)


@dataclass
class BufferSettings:
    """Everything a PipelineServer reads; the defaults make a small fully-async pipeline of one source. KEYS are the
    run config's `buffer` section, each other field the key its comment names (config.Config.buffer_settings copies
    them in). B = num_prompts_per_step, N = num_trajectories_per_prompt; C = capacity (a preset's from policy_param)."""
    KEYS = ("get_timeout_s", "rpc_timeout_s")  # the config's buffer section (a class attribute, not a field)
    num_prompts_per_step: int = 4  # B: prompt groups consumed per training step
    num_trajectories_per_prompt: int = 2  # N: trajectories per prompt group
    fully_async: bool = True  # fully_async.enable: false = synchronous mode, C = B + num_oversample
    sliding_window: str = "no-window"  # fully_async.sliding_window: a strategies.REGISTRY name
    stale_steps: float = 0.0  # fully_async.stale_steps: C = int(B * (1 + stale_steps)) (not presets)
    policy_param: Optional[float] = None  # fully_async.policy_param: a preset's knob
    num_oversample: int = 0  # rollout.sampler.num_oversample (synchronous mode)
    async_max_concurrent_samples: Optional[int] = None  # rollout.async_max_concurrent_samples: groups = value // N
    filter: tuple = ("failed",)  # rollout.filter: failed | all_equal_reward
    filter_stop_groups: Optional[int] = None  # rollout.filter_stop_groups (None: 4 x B, >= 64; 0: off)
    min_group_size: Optional[int] = None  # rollout.min_group_size (None: N // 2, at least 2; 1 when N = 1)
    max_weight_staleness: Optional[int] = None  # rollout.max_weight_staleness
    partial: bool = False  # rollout.partial: the update action's
    pause_mode: str = "abort"  # rollout.pause_mode: the update action's
    get_timeout_s: float = 1800.0  # trainer waits this long for groups from PipelineBuffer before failing
    rpc_timeout_s: float = 600.0  # timeout of each RPC between trainer, buffer and rollout
    sources: list = field(default_factory=lambda: [SourceSettings()])  # list[SourceSettings], one per data source

    @property
    def capacity(self) -> int:
        """C: in-flight plus buffered prompt groups. Fully-async: int(B * (1 + stale_steps)), or the preset's from
        policy_param; synchronous: B + num_oversample (docs/design.md)."""
        B = self.num_prompts_per_step
        if not self.fully_async:
            return B + self.num_oversample
        preset = strategies.REGISTRY.get(self.sliding_window)
        if isinstance(preset, type) and issubclass(preset, strategies.Preset):
            return preset.capacity(self.policy_param, B, self.num_trajectories_per_prompt)
        return int(B * (1 + self.stale_steps))

    @property
    def stop_groups(self) -> int:
        """Groups dropped by the filter in a row after which the run stops as untrainable (0: never). The default
        4 x B, at least 64: a filter that drops 70% of the groups makes 64 in a row once in ~10^10."""
        n = self.filter_stop_groups
        return max(4 * self.num_prompts_per_step, 64) if n is None else n

    @property
    def group_floor(self) -> int:
        """rollout.min_group_size as it applies (rollout.filter failed): by default N // 2, >= 2 (1 when N = 1)."""
        n, value = self.num_trajectories_per_prompt, self.min_group_size
        validate_min_group_size(value, n)
        return value if value is not None else 1 if n == 1 else max(2, n // 2)

    def check(self) -> None:
        """The buffer section's keys (KEYS; the other fields are checked with their sections): each timeout > 0."""
        for key in self.KEYS:
            if not getattr(self, key) > 0:
                raise ValueError(f"buffer.{key} must be > 0, got {getattr(self, key)!r}")


def validate_min_group_size(value: Optional[int], n: int) -> None:
    """rollout.min_group_size: unset, or 2 <= value <= N (1 when N = 1): a group is never trained on one trajectory
    whose GRPO advantage is 0 by construction, nor asked for more trajectories than it has."""
    if value is None or (value == 1 if n == 1 else 2 <= value <= n):
        return
    accepted = "1" if n == 1 else f"from 2 to data_source.num_trajectories_per_prompt ({n})"
    raise ValueError(f"rollout.min_group_size must be {accepted} or null (N // 2, at least 2), got {value}")


def validate_concurrency(value: Optional[int], n: int) -> None:
    """rollout.async_max_concurrent_samples: unset is fine; otherwise > 0 and >= N (else zero groups in flight).

    The clamp to the fleet's concurrency happens in rollout.py, where the fleet is known (a warning, not an error).
    """
    if value is None:
        return
    if value <= 0:
        raise ValueError(f"rollout.async_max_concurrent_samples must be > 0 (or null for no cap), got {value}")
    if value < n:
        raise ValueError(f"rollout.async_max_concurrent_samples ({value}) must be >= "
                         f"data_source.num_trajectories_per_prompt ({n}), otherwise no group can be in flight")


# ---------------------------------------------------------------------------------------------------------
# DataSource: what gets dispatched next
# ---------------------------------------------------------------------------------------------------------

class DataSource:
    """Prompts in a deterministic, seeded order per epoch; a monotonic seq per dispatched group; the restored lane.

    Several sources are mixed by smooth weighted round-robin (exact proportions, deterministic, tiny state), each
    with its own epoch counter; `data_index` is the prompt's row in its source. The lane (groups restored at a step
    boundary, or replayed after a resume) is dispatched before any fresh prompt, oldest (epoch, seq) first, and
    its groups keep their prompt id, so PipelineBuffer still consumes them by their original age.
    """

    def __init__(self, prompts_per_source: list, weights: list, seeds: list, shuffle: list):
        for i, prompts in enumerate(prompts_per_source):
            if len(prompts) == 0:
                raise ValueError(f"data_sources[{i}] has no prompts; each data source needs at least one")
        self.prompts = prompts_per_source
        self.weights = [float(w) for w in weights]
        self.seeds = list(seeds)
        self.shuffle = list(shuffle)
        S = len(prompts_per_source)
        self.epoch = [0] * S  # current epoch of each source
        self.pos = [0] * S  # next position in that epoch's order
        self.credit = [0.0] * S  # smooth weighted round-robin state
        self.next_seq = 0  # sequence number of the next fresh group
        self.lane: list[PromptGroup] = []  # restored / replayed groups, dispatched first
        self._orders: dict = {}  # (source, epoch) -> permutation, cached for the current epochs

    def order(self, source: int, epoch: int) -> list[int]:
        """Row indices of `source` in the order of `epoch` (a seeded shuffle, or the file order)."""
        key = (source, epoch)
        if key not in self._orders:
            order = list(range(len(self.prompts[source])))
            if self.shuffle[source]:
                random.Random(self.seeds[source] * 1_000_003 + epoch).shuffle(order)
            self._orders = {k: v for k, v in self._orders.items() if k[0] != source}  # keep one epoch per source
            self._orders[key] = order
        return self._orders[key]

    def peek_seq(self) -> int:
        """Sequence number of the group `pop()` would return."""
        return self.lane[0].seq if self.lane else self.next_seq

    def pop(self) -> PromptGroup:
        if self.lane:
            return self.lane.pop(0)
        s = self._pick_source()
        row = self.order(s, self.epoch[s])[self.pos[s]]
        group = self.make_group(s, self.epoch[s], self.next_seq, row)
        self.next_seq += 1
        self.pos[s] += 1
        if self.pos[s] == len(self.prompts[s]):
            self.epoch[s], self.pos[s] = self.epoch[s] + 1, 0
        return group

    def _pick_source(self) -> int:
        if len(self.prompts) == 1:
            return 0
        for i, w in enumerate(self.weights):
            self.credit[i] += w
        s = max(range(len(self.credit)), key=lambda i: self.credit[i])
        self.credit[s] -= sum(self.weights)
        return s

    def make_group(self, source: int, epoch: int, seq: int, row: int, partial: Optional[list] = None) -> PromptGroup:
        p = self.prompts[source][row]
        return PromptGroup(epoch=epoch, seq=seq, data_index=row, prompt_ids=torch.as_tensor(p["prompt_ids"],
                           dtype=torch.long), label=p.get("label"), source=source,
                           metadata=dict(p.get("metadata") or {}), partial=list(partial or []))

    def restore(self, groups: list) -> None:
        self.lane = sorted(self.lane + list(groups), key=lambda g: g.prompt_id)

    def state_dict(self, replay: list) -> dict:
        """Cursor, mixing state and the lane; `replay` (groups in flight) joins the lane on resume."""
        lane = sorted(self.lane + list(replay), key=lambda g: g.prompt_id)
        return {"epoch": list(self.epoch), "pos": list(self.pos), "credit": list(self.credit),
                "sizes": [len(p) for p in self.prompts], "next_seq": self.next_seq,
                "lane": [self.group_state(g, g.partial) for g in lane]}

    def load_state_dict(self, sd: dict) -> None:
        sizes = [len(p) for p in self.prompts]
        if list(sd["sizes"]) != sizes:
            raise ValueError(f"checkpointed data source sizes {list(sd['sizes'])} differ from the loaded prompts "
                             f"{sizes}; resume needs the same data_sources (task, path, num_prompts, seed)")
        self.epoch, self.pos, self.credit = list(sd["epoch"]), list(sd["pos"]), list(sd["credit"])
        self.next_seq = int(sd["next_seq"])
        self.lane = [self.group_from_state(g)[0] for g in sd["lane"]]

    @staticmethod
    def group_state(g: PromptGroup, trajs: list) -> dict:
        """A group and its trajectories as plain data: its prompt by its row (the rest of its PromptGroup is rebuilt
        from the prompts), its dispatch version (its start version while none of its trajectories has a token,
        which the staleness rules read), every field of every trajectory."""
        return {"source": g.source, "epoch": g.epoch, "seq": g.seq, "data_index": g.data_index,
                "dispatch_version": g.metadata.get("dispatch_version"), "partial": [_traj_to_dict(t) for t in trajs]}

    def group_from_state(self, d: dict) -> tuple:
        """group_state's inverse: (the PromptGroup, with the trajectories as its partial, and the trajectories)."""
        trajs = [_traj_from_dict(t) for t in d["partial"]]
        g = self.make_group(d["source"], d["epoch"], d["seq"], d["data_index"], trajs)
        if d.get("dispatch_version") is not None:
            g.metadata["dispatch_version"] = int(d["dispatch_version"])
        return g, trajs


# ---------------------------------------------------------------------------------------------------------
# TrajQueue and PipelineBuffer: the two queues (docs/design.md, "Three parts and two queues")
# ---------------------------------------------------------------------------------------------------------

class TrajQueue:
    """Rollout -> collector: trajectories by prompt id until all N of a group are there.

    Bounded by `max_groups` open groups (C: only groups in flight may have trajectories here). The caller holds
    PipelineServer's lock.
    """

    def __init__(self, n: int, max_groups: int):
        self.n, self.max_groups = n, max_groups
        self._slots: dict = {}  # key -> [Trajectory | None] * N
        self._count: dict = {}  # key -> trajectories present
        self.num_trajectories = 0

    def add(self, t: Trajectory) -> bool:
        """Add one trajectory; False if its slot is already taken (a duplicate, ignored)."""
        key = t.prompt_id
        slots = self._slots.get(key)
        if slots is None:
            if len(self._slots) >= self.max_groups:
                raise RuntimeError(f"TrajQueue is full ({self.max_groups} open groups = capacity C); a trajectory "
                                   f"for group {key} cannot be queued")
            slots = self._slots[key] = [None] * self.n
            self._count[key] = 0
        if slots[t.index] is not None:
            return False
        slots[t.index] = t
        self._count[key] += 1
        self.num_trajectories += 1
        return True

    def is_assembled(self, key: Key) -> bool:
        return self._count.get(key, 0) == self.n

    def slots(self, key: Key) -> list:
        return self._slots.get(key, [None] * self.n)

    def pop(self, key: Key) -> list:
        """Remove and return the group's slots (None where a trajectory never arrived)."""
        slots = self._slots.pop(key, None)
        if slots is None:
            return [None] * self.n
        self.num_trajectories -= self._count.pop(key)
        return slots

    def __len__(self) -> int:
        return len(self._slots)


class PipelineBuffer:
    """Collector -> trainer: complete, filtered groups, handed out oldest (epoch, seq) first. Bounded by C."""

    def __init__(self, max_groups: int):
        self.max_groups = max_groups
        self._heap: list = []  # (prompt_id, Group)

    def put(self, group: Group) -> None:
        if len(self._heap) >= self.max_groups:
            raise RuntimeError(f"PipelineBuffer is full ({self.max_groups} groups = capacity C); "
                               f"group {group.prompt_id} cannot be buffered")
        heapq.heappush(self._heap, (group.prompt_id, group))

    def pop(self, k: int) -> list:
        return [heapq.heappop(self._heap)[1] for _ in range(min(k, len(self._heap)))]

    def remove(self, key: Key) -> None:
        """Remove the group `key` (O(C): a weight update's drops only)."""
        self._heap = [kg for kg in self._heap if kg[0] != key]
        heapq.heapify(self._heap)

    def groups(self) -> list:
        return [g for _, g in sorted(self._heap, key=lambda kg: kg[0])]

    def __len__(self) -> int:
        return len(self._heap)


# ---------------------------------------------------------------------------------------------------------
# PipelineServer: dispatch -> TrajQueue -> collector -> PipelineBuffer -> trainer, with the step boundary
# ---------------------------------------------------------------------------------------------------------

# What happens to a group, decided by one function (PipelineServer._verdict) and carried out by one
# (PipelineServer._apply), at collection, at every weight update and at every step boundary, with the reason. A group
# dropped is not trained, and its prompt is not dispatched again this epoch (the data source moves on); a restored or
# requeued one is dispatched again first (the restored lane).
KEEP, RESTORE, RESTART, REQUEUE, DROP = "keep", "restore", "restart", "requeue", "drop"
# place of the group asked about
COLLECTED = "collected"  # complete, leaving TrajQueue for PipelineBuffer
BUFFERED = "buffered"  # in PipelineBuffer at a weight update
IN_FLIGHT = "in_flight"  # dispatched and not collected, at a step boundary whose pause aborted the requests
KEPT_IN_FLIGHT = "kept_in_flight"  # the same, at a boundary whose servers kept their requests (retract, in_place)
# why a group is dropped -> the one metric that counts it (groups). The reasons of COMPLETE_DROPS are decided at
# collection and at the weight update (counted per step); the other two at the step boundary (its metrics).
DROP_METRICS = {"filter": "rollout/filter_drop", "max_weight_staleness": "rollout/staleness_drop",
                "strategy": "rollout/policy_drop", "stale_after": "rollout/update_dropped_groups",
                "incomplete": "rollout/partial_dropped_incomplete_groups"}
COMPLETE_DROPS = ("filter", "max_weight_staleness", "strategy")  # why a complete group is dropped (view.dropped)
# the counters of one step (PipelineServer._counts, popped by step_metrics): the drops of COMPLETE_DROPS; trajectories
# that arrived for a group no longer in flight (dropped or restored at a step boundary, or duplicates: not a verdict);
# the group flow; response tokens thrown away by every drop, restart and failed trajectory taken out of its group;
# the `failed` filter's work: failed trajectories taken out of their groups at collection, the groups it dropped
# with fewer than rollout.min_group_size survivors (of rollout/filter_drop), groups handed to the trainer short
COUNTERS = (*(DROP_METRICS[r] for r in COMPLETE_DROPS), "rollout/late_drop", "rollout/dispatched_groups",
            "rollout/collected_groups", "rollout/consumed_groups", "rollout/discarded_tokens",
            "rollout/failed_removed_count", "rollout/min_group_size_drop", "rollout/trained_short_groups")


@dataclass(frozen=True)
class Verdict:
    """keep | restore (abort, continue from the partial trajectories) | restart (abort, generate from the prompt
    again) | requeue (nothing generated: dispatched again as it was) | drop, and why (a DROP_METRICS key for a
    drop; `detail` says more, e.g. the filter's sentence)."""
    action: str
    reason: str
    detail: str = ""


def _check_trajectory(t: Trajectory, n: int) -> None:
    if not 0 <= t.index < n:
        raise ValueError(f"trajectory {t.prompt_id} has index {t.index}; data_source.num_trajectories_per_prompt "
                         f"is {n}, so 0..{n - 1} are accepted")
    if t.status not in STATUSES:
        raise ValueError(f"trajectory {t.prompt_id}#{t.index} has status '{t.status}'; accepted: {', '.join(STATUSES)}")
    T = t.response_ids.numel()
    for name in ("rollout_log_probs", "versions", "loss_mask"):
        if getattr(t, name).numel() != T:
            raise ValueError(f"trajectory {t.prompt_id}#{t.index}: {name} has {getattr(t, name).numel()} entries "
                             f"but response_ids has {T}; every per-token field needs one entry per response token")


def consumed_metrics(versions: list) -> dict:
    """The consumption metrics of docs/metrics.md over the trajectories the trainer consumed in a step, from their
    (start_version, end_version, trainer_version_when_consumed) triples: `rollout/partial_ratio` is the share whose
    first and last generated tokens came from different weight versions, `rollout/partial_span_max` the largest
    end - start span; staleness is trainer version - start version. Trajectories with no generated token (start -1)
    count as not partial and carry no staleness."""
    started = [(s, e, cur) for s, e, cur in versions if s >= 0]
    spans = [e - s for s, e, _ in started]
    stale = [cur - s for s, _, cur in started]
    return {"rollout/partial_ratio": sum(x != 0 for x in spans) / max(1, len(versions)),
            "rollout/partial_span_max": max(spans, default=0),
            "rollout/staleness_mean": sum(stale) / len(stale) if stale else 0.0,
            "rollout/staleness_max": max(stale, default=0)}


class Exchange:
    """The producer's one call per batch of finished trajectories, for any buffer with put and dispatch: put them,
    then dispatch up to max_groups (None: as many as allowed, 0: none) without waiting, so the slots the batch frees
    are taken again in one round trip instead of two."""

    def exchange(self, trajs: list, max_groups: Optional[int]) -> list:
        self.put(trajs)
        return self.dispatch(max_groups) if max_groups != 0 else []


class PipelineServer(Exchange):
    """The buffer process's object: the rollout calls dispatch/put/step_boundary, the trainer get/step_metrics.
    Bounds (in prompt groups unless said otherwise, all in step_metrics()): C = int(B * (1 + stale_steps)) in
    fully-async mode, B + num_oversample in synchronous mode; R + Q <= C (synchronous: consumed this step + R + Q
    <= C), so TrajQueue holds <= C groups (<= C * N trajectories), PipelineBuffer and the restored lane <= C groups
    each; generating groups <= rollout.async_max_concurrent_samples // N when that is set. `collector_thread=False`:
    the collection runs inside put() (deterministic, for the property tests; the same rules). `settings`: a
    BufferSettings, or a validated config.Config (its buffer_settings()). `decode` (token ids -> text) writes the
    prompt and response of wait()'s stop message; default: the ids."""

    def __init__(self, settings, prompts_per_source: list, collector_thread: bool = True,
                 decode: Optional[Callable[[list], str]] = None):
        s = settings if isinstance(settings, BufferSettings) else settings.buffer_settings()
        if len(prompts_per_source) != len(s.sources):
            raise ValueError(f"PipelineServer got {len(prompts_per_source)} prompt lists for "
                             f"{len(s.sources)} data_sources; pass one list per data source")
        self.settings = s
        self.B, self.N = s.num_prompts_per_step, s.num_trajectories_per_prompt
        self.fully_async = s.fully_async
        self.C = s.capacity
        cap = s.async_max_concurrent_samples
        self.max_generating = None if cap is None else cap // self.N  # groups still generating (spec: value // N)
        self.filters = tuple(s.filter)
        self.min_group_size = s.group_floor  # with the failed filter: the fewest survivors a group is trained on
        self.stop_groups = s.stop_groups  # dropped by the filter in a row: the run cannot train (0: off)
        self.sources = [(d.task, d.reward) for d in s.sources]
        self.decode = decode or (lambda ids: " ".join(map(str, ids)))
        self.get_timeout = float(s.get_timeout_s)
        self.strategy = strategies.build(s.sliding_window, self.B, self.C, self.fully_async, s.policy_param, self.N,
                                         max_weight_staleness=s.max_weight_staleness)
        self.action = self.strategy.action(s.partial, s.pause_mode)  # (c), at step_boundary
        ds = s.sources
        self.data = DataSource(prompts_per_source, [d.weight for d in ds], [d.seed for d in ds],
                               [d.shuffle for d in ds])
        self.queue = TrajQueue(self.N, max_groups=self.C)
        self.pbuf = PipelineBuffer(max_groups=self.C)
        self.version = 0  # current weight version (set_weight_version)
        self._in_flight: dict = {}  # key -> PromptGroup: dispatched, not yet collected (R)
        self._complete: set = set()  # in-flight keys with all N trajectories in TrajQueue: not generating
        self._consumed_step = 0  # groups handed out since the last step boundary
        self._counts: Counter = Counter()  # this step's counters, by metric name (COUNTERS), popped by step_metrics()
        self._totals: Counter = Counter()  # the popped counts, summed over the run (PipelineView.dropped)
        self._consumed_trajs: list = []  # (start_version, end_version, version at consumption) since last metrics
        self._boundary: Counter = Counter()  # what the last step boundary did, by metric name, reported once
        self._waited: dict = self._new_wait_counts()  # for the trainer's waiting line, popped by wait()
        self._dropped = self._new_drop_run()  # groups the filter dropped since the last one it let through
        self._producer_stop: Optional[str] = None  # a trajectory's metadata["stop"]: the producer says the run ends
        self._cond = threading.Condition()
        self._pending = False  # put() added trajectories the collector has not looked at yet
        self._closed = False
        self._thread = None
        if collector_thread:
            self._thread = threading.Thread(target=self._collector_loop, name="buffer-collector", daemon=True)
            self._thread.start()

    # ---- rollout side ----
    def dispatch(self, max_groups: Optional[int] = None, timeout: float = 0.0) -> list:
        """Prompt groups that may start now (restored lane first); waits up to `timeout` s for at least one.

        An empty list means the capacity, window or concurrency rule says "not now"; it is not an error.
        """
        if max_groups is not None and max_groups < 0:
            raise ValueError(f"dispatch(max_groups={max_groups}): max_groups must be >= 0 or None")
        with self._cond:
            if timeout > 0 and max_groups != 0:
                self._cond.wait_for(lambda: self._closed or self._may_dispatch(self._view()), timeout)
            out: list = []
            view = self._view()
            while (max_groups is None or len(out) < max_groups) and self._may_dispatch(view):
                fresh = not self.data.lane
                pg = self.data.pop()
                pg.metadata.setdefault("dispatch_version", self.version)  # the group's start version, until a token
                self.strategy.dispatched(fresh, view)
                view.lane = len(self.data.lane)
                self._in_flight[pg.prompt_id] = pg
                view.R += 1
                view.generating += 1
                view.next_seq = self.data.next_seq
                view.oldest_uncollected = min(pg.seq, pg.seq if view.oldest_uncollected is None
                                              else view.oldest_uncollected)
                view.oldest_uncompleted = min(pg.seq, pg.seq if view.oldest_uncompleted is None
                                              else view.oldest_uncompleted)
                out.append(pg)
            self._counts["rollout/dispatched_groups"] += len(out)
            return out

    def put(self, trajs: list) -> None:
        """Finished (completed / truncated / failed) trajectories into TrajQueue; the collector takes it from there.

        Trajectories of groups no longer in flight (dropped or restored at a step boundary) and duplicates are
        ignored and counted in rollout/late_drop. Aborted ones belong to step_boundary().
        """
        for t in trajs:
            _check_trajectory(t, self.N)
            if t.status == ABORTED:
                raise ValueError(f"trajectory {t.prompt_id}#{t.index} is aborted; put() takes finished trajectories "
                                 "(completed, truncated, failed), aborted ones go to step_boundary()")
        with self._cond:
            for t in trajs:
                self._add_locked(t)
                self._producer_stop = self._producer_stop or t.metadata.get("stop")  # e.g. a tool env that fails
            self._waited["generated"] += len(trajs)
            if self._thread is None:
                self._collect_locked()
            else:
                self._pending = True
                self._cond.notify_all()

    def step_boundary(self, returned: list, keep_in_flight: bool = False, stale: Optional[list] = None) -> dict:
        """After the rollout paused: restore complete groups, drop incomplete ones, clear TrajQueue, reset strategy.

        `returned`: the trajectories the pause handed back (aborted partial ones, possibly finished ones). A group with
        all N trajectories goes to the restored lane with them as `partial`, one with none goes back as dispatched, one
        with some but not all is dropped; PipelineBuffer keeps its groups. keep_in_flight=True (pause_mode retract /
        in_place: the servers kept every request) leaves in-flight groups as they are but those of update_aborts(),
        whose trajectories `returned` holds and which are dropped. `stale` given (a checkpoint follows: the pause
        aborted every request, rollout.Rollout.pause): the groups of `stale` are dropped as keeping drops them, every
        other one goes to the lane with all N trajectories (put, handed back or not started): nothing stays in flight.
        The update action (self.action) applies to what is restored (restart: partial tokens thrown away; abort by
        staleness). Every group in flight gets a verdict (_verdict) that _apply carries out; the dict counts them."""
        for t in returned:
            _check_trajectory(t, self.N)
        with self._cond:
            if keep_in_flight:
                stray = {t.prompt_id for t in returned} - set(self._in_flight)
                if stray:
                    raise ValueError(f"step_boundary(keep_in_flight=True) got trajectories of groups {sorted(stray)} "
                                     "that are not in flight; a boundary that keeps in-flight groups takes back only "
                                     "those of update_aborts()")
            self._collect_locked()  # whatever the strategy allows now goes to PipelineBuffer first
            if keep_in_flight:
                # The groups the rollout aborted (those of an earlier update_aborts() call) are dropped whatever
                # update_aborts() says now: a trajectory that finished in between, having waited in a server's
                # queue, can carry a later start version and take its group out of the list.
                back: dict = {}  # key -> the trajectories the rollout handed back
                for t in returned:
                    back.setdefault(t.prompt_id, []).append(t)
                aborts = frozenset(back) if stale is None else frozenset(tuple(k) for k in stale)
                self._boundary = Counter(dict.fromkeys(("rollout/kept_in_flight_groups",
                                                        "rollout/update_dropped_groups"), 0))
                for key in sorted(self._in_flight):
                    # the verdict sees what the keeping boundary would: the trajectories put (and those handed back
                    # of a group aborted by staleness); the requests on the servers are unknown to it
                    pg, trajs = self._in_flight[key], self.queue.slots(key) + (back.get(key, []) if key in aborts
                                                                               else [])
                    verdict = self._verdict(KEPT_IN_FLIGHT, pg, trajs, returned=aborts)
                    if verdict.action == KEEP and stale is not None:  # its requests were aborted: restored whole
                        trajs, verdict = self._partial_now(key, pg, back.get(key, ())), Verdict(RESTORE, "partial")
                        self._take(key)
                    self._apply(KEPT_IN_FLIGHT, key, pg, trajs, verdict)
            else:
                for t in returned:
                    self._add_locked(t)  # (may mark a group complete; everything in flight is settled below)
                self._boundary = Counter(dict.fromkeys((
                    "rollout/partial_restored_count", "rollout/update_dropped_groups", "rollout/restarted_groups",
                    "rollout/partial_dropped_incomplete_count", "rollout/partial_dropped_incomplete_groups",
                    "rollout/restored_groups", "rollout/requeued_unstarted_groups"), 0))
                for key in sorted(self._in_flight):
                    pg, trajs = self._take(key)
                    self._apply(IN_FLIGHT, key, pg, trajs, self._verdict(IN_FLIGHT, pg, trajs))
                if len(self.queue):  # only in-flight groups can have trajectories queued (put() checks)
                    raise RuntimeError(f"TrajQueue still holds {len(self.queue)} groups after the step boundary")
            self._end_step_locked()
            self._boundary["rollout/pipeline_buf_size"] = len(self.pbuf)
            self._cond.notify_all()
            return dict(self._boundary)

    # ---- trainer side ----
    def get(self, k: int, timeout: Optional[float] = None) -> list:
        """k complete groups, oldest (epoch, seq) first; waits up to `timeout` s (default buffer.get_timeout_s)."""
        if not 1 <= k <= self.C:
            raise ValueError(f"get(k={k}): k must be in 1..{self.C} (the capacity C); more groups can never be "
                             "buffered at once")
        timeout = self.get_timeout if timeout is None else float(timeout)
        with self._cond:
            ready = self._cond.wait_for(lambda: self._closed or len(self.pbuf) >= k, timeout)
            if self._closed:
                raise RuntimeError("PipelineServer was closed while get() was waiting for groups")
            if not ready:
                v = self._view()
                raise TimeoutError(
                    f"PipelineBuffer.get: wanted {k} groups, {v.Q} buffered after {timeout:.1f}s (R={v.R} dispatched "
                    f"and not collected: {v.generating} still generating, {len(self._complete)} complete but held "
                    f"in TrajQueue; C={self.C}); is the rollout running? (buffer.get_timeout_s sets this limit)")
            groups = self.pbuf.pop(k)
            view = self._view()
            self._consumed_step += k
            self._counts["rollout/consumed_groups"] += k
            self._counts["rollout/trained_short_groups"] += sum(len(g.trajectories) < self.N for g in groups)
            for g in groups:
                self.strategy.consumed(g, view)
                for t in g.trajectories:
                    self._consumed_trajs.append((t.start_version, t.end_version, self.version))
            self._cond.notify_all()  # a freed slot may allow dispatch
            return groups

    def wait(self, k: int, timeout: float) -> dict:
        """Wait up to `timeout` s for k buffered groups, then say what happened since the last call (the trainer's
        waiting line): {"ready", "needed", "generated" and "in_flight" trajectories, "filter_drop" groups and
        "drop_reasons" {reason: groups}, "seconds" covered, "stop"}. "stop" is None, or the sentence naming why
        nothing can be trained once rollout.filter has dropped cfg.filter_stop_groups groups in a row: the trainer
        raises it as NothingToTrain (wait() never raises it, so the sentence crosses RPC as plain data)."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or len(self.pbuf) >= k or self._cannot_train(), timeout)
            w, self._waited = self._waited, self._new_wait_counts()
            return {"ready": len(self.pbuf), "needed": k, "generated": w["generated"],
                    "in_flight": len(self._in_flight) * self.N - self.queue.num_trajectories,
                    "filter_drop": sum(w["reasons"].values()), "drop_reasons": dict(w["reasons"]),
                    "seconds": time.monotonic() - w["t0"],
                    "stop": self._stop_message() if len(self.pbuf) < k and self._cannot_train() else None}

    def update_aborts(self) -> list:
        """The in-flight groups the strategy's update-time action aborts and drops at the coming weight update
        (abort by staleness: started more than stale_after versions before version + 1), oldest first. The rollout
        asks before pausing with rollout.pause_mode in_place / retract and hands their trajectories back to
        step_boundary; with abort every group comes back and step_boundary drops these itself."""
        with self._cond:
            return self._update_aborts_locked()

    def set_weight_version(self, v: int) -> None:
        """The rollout now generates with weights `v`; buffered groups beyond the strategy's
        rollout.max_weight_staleness rule, or that its keep_buffered no longer keeps, go (_verdict, _apply)."""
        with self._cond:
            if v < self.version:
                raise ValueError(f"set_weight_version({v}): weight versions only grow; the current one is "
                                 f"{self.version}")
            self.version = int(v)
            view = self._view()
            for g in self.pbuf.groups():
                self._apply(BUFFERED, g.prompt_id, g.prompt, g.trajectories,
                            self._verdict(BUFFERED, g.prompt, g.trajectories, view))
            self._cond.notify_all()

    # ---- metrics, checkpoints ----
    def set_max_concurrent_samples(self, value: int) -> None:
        """The rollout's effective rollout.async_max_concurrent_samples after its clamp to the fleet's concurrency
        (rollout.py knows the fleet); generating groups are then capped at value // N."""
        with self._cond:
            self.max_generating = int(value) // self.N
            self._cond.notify_all()

    def step_metrics(self) -> dict:
        """This step's counters (popped) and the current sizes and bounds, as `rollout/...` metrics."""
        with self._cond:
            v = self._view()
            m = {"rollout/pipeline_buf_size": len(self.pbuf)}
            m.update(self._boundary)
            m.update({k: self._counts[k] for k in COUNTERS})
            m.update({"rollout/in_flight_groups": v.R, "rollout/generating_groups": v.generating,
                      "rollout/held_groups": len(self._complete), "rollout/trajqueue_groups": len(self.queue),
                      "rollout/trajqueue_trajectories": self.queue.num_trajectories,
                      "rollout/restored_lane_size": len(self.data.lane), "rollout/weight_version": self.version,
                      "rollout/data_epoch": self.data.epoch[0], "rollout/capacity": self.C,
                      "rollout/pipeline_buf_max": self.pbuf.max_groups,
                      "rollout/trajqueue_max_groups": self.queue.max_groups,
                      "rollout/max_generating_groups": self.C if self.max_generating is None else self.max_generating})
            if self._consumed_trajs:
                m.update(consumed_metrics(self._consumed_trajs))
            m.update(self.strategy.counts)
            self.strategy.counts = {}
            self._totals.update(self._counts)
            self._counts.clear()
            self._consumed_trajs = []
            self._boundary = Counter()
            return m

    def stats(self, keys: bool = False) -> dict:
        """Current sizes and bounds without popping anything; with keys=True also the prompt ids per place."""
        with self._cond:
            v = self._view()
            out = {"B": self.B, "N": self.N, "C": self.C, "R": v.R, "Q": v.Q, "generating": v.generating,
                   "held": len(self._complete), "consumed_step": v.consumed, "next_seq": v.next_seq,
                   "oldest_uncollected": v.oldest_uncollected, "oldest_uncompleted": v.oldest_uncompleted,
                   "lane": len(self.data.lane), "trajqueue_trajectories": self.queue.num_trajectories,
                   "weight_version": self.version, "max_generating": self.max_generating,
                   "get_timeout_s": self.get_timeout}
            if keys:
                out.update(in_flight_keys=sorted(self._in_flight), held_keys=sorted(self._complete),
                           buffered_keys=[g.prompt_id for g in self.pbuf.groups()],
                           lane_keys=[g.prompt_id for g in self.data.lane])
            return out

    def state_dict(self) -> dict:
        """Data-source cursor, weight version and every prompt not consumed yet with every trajectory generated for it:
        the restored lane, groups in flight (_partial_now) and PipelineBuffer's groups. After a pause told that a
        checkpoint follows nothing is in flight: each cut trajectory is in the lane whole (tokens, versions, log-probs,
        loss mask, routes, env_turns / env_spans) and continues from there after a resume, so every prompt of an epoch
        is trained once and nothing is generated twice. Plain data + tensors (torch.load(weights_only=True)-able)."""
        with self._cond:
            replay = [dataclasses.replace(pg, partial=self._partial_now(key, pg))
                      for key, pg in self._in_flight.items()]
            return {"format": 1, "weight_version": self.version, "data": self.data.state_dict(replay),
                    "buffered": [self.data.group_state(g.prompt, g.trajectories) for g in self.pbuf.groups()]}

    def load_state_dict(self, sd: dict) -> None:
        with self._cond:
            if self._in_flight or len(self.pbuf) or len(self.queue):
                raise RuntimeError("load_state_dict needs an idle PipelineServer (nothing dispatched or buffered); "
                                   "load the checkpoint before the rollout starts")
            if sd.get("format") != 1:
                raise ValueError(f"buffer state_dict format {sd.get('format')!r} is not supported (expected 1)")
            self.data.load_state_dict(sd["data"])
            for d in sd.get("buffered", []):  # (a checkpoint from before they were kept has them in the lane)
                pg, trajs = self.data.group_from_state(d)
                if len(self.pbuf) < self.pbuf.max_groups:
                    pg.partial = []
                    self.pbuf.put(Group(pg, trajs))
                else:  # beyond a smaller capacity: to the lane, all N slots (a shortened group's failed ones anew)
                    have = {t.index: t for t in trajs}
                    pg.partial = [have[i] if i in have else Trajectory(pg.epoch, pg.seq, i, pg.prompt_ids,
                                                                       status=ABORTED) for i in range(self.N)]
                    self.data.restore([pg])
            self.version = int(sd["weight_version"])
            self._end_step_locked()  # the strategy stands where the saving run's did after its step boundary
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the collector thread; waiting get()/dispatch() calls return with an error / empty."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            if self._thread.is_alive():
                print("buffer: the collector thread did not stop within 10 s", file=sys.stderr)

    def __enter__(self) -> "PipelineServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals (the caller holds self._cond) ----
    def _view(self) -> strategies.PipelineView:
        seqs = [k[1] for k in self._in_flight]
        return strategies.PipelineView(
            B=self.B, C=self.C, R=len(self._in_flight), Q=len(self.pbuf),
            generating=len(self._in_flight) - len(self._complete), consumed=self._consumed_step,
            next_seq=self.data.next_seq, oldest_uncollected=min(seqs, default=None),
            oldest_uncompleted=min((k[1] for k in self._in_flight if k not in self._complete), default=None),
            version=self.version, lane=len(self.data.lane),
            dropped=sum(self._totals[DROP_METRICS[r]] + self._counts[DROP_METRICS[r]] for r in COMPLETE_DROPS))

    def _end_step_locked(self) -> None:
        self.strategy.reset()
        self._consumed_step = 0
        self.strategy.at_boundary(self._view())

    def _verdict(self, place: str, pg: PromptGroup, trajs: list, view: Optional[strategies.PipelineView] = None,
                 returned: frozenset = frozenset()) -> Verdict:
        """What happens to one group, and why: the one place that decides, from rollout.filter and the strategy's
        rules ((b) rollout.max_weight_staleness, within_max_weight_staleness, and keep / keep_buffered; (c) the update
        action: abort by staleness `stale_after`, restart or resume partial), in this order of precedence:
          COLLECTED       filter -> within_max_weight_staleness -> strategy.keep(view) -> keep (of the group's
                          survivors, _trained: the failed filter takes failed trajectories out)
          BUFFERED        within_max_weight_staleness -> strategy.keep_buffered(view) -> keep
          IN_FLIGHT       stale_after -> restart (all N present, some aborted, the action restarts) -> restore (all
                          N present) -> requeue (none present) -> drop as incomplete
          KEPT_IN_FLIGHT  stale_after (or handed back in `returned`: the rollout aborted it as stale) -> keep
        The strategy's rules see the group as a Group (per-token versions, start_version). `trajs`: in flight,
        TrajQueue's slots (None where none arrived yet). stale_after counts against the next weights (version + 1)."""
        if place in (COLLECTED, BUFFERED):
            if place == COLLECTED:
                reason = self._filter_reason(trajs)
                if reason is not None:
                    return Verdict(DROP, "filter", reason)
            group = Group(pg, self._trained(trajs) if place == COLLECTED else trajs)
            if not self.strategy.within_max_weight_staleness(group, view):
                return Verdict(DROP, "max_weight_staleness")
            keep = self.strategy.keep if place == COLLECTED else self.strategy.keep_buffered
            if not keep(group, view):  # (b) the consumption filter
                return Verdict(DROP, "strategy")
            return Verdict(KEEP, "trainable")
        after = self.action.stale_after
        if pg.prompt_id in returned or (after is not None and self.version + 1 - start_version(pg, trajs) > after):
            return Verdict(DROP, "stale_after")  # (c) abort by staleness: too old under the next weights
        if place == KEPT_IN_FLIGHT:
            return Verdict(KEEP, "kept in flight")
        present = [t for t in trajs if t is not None]
        if len(present) == self.N and self.action.restart and any(t.status == ABORTED for t in present):
            return Verdict(RESTART, "the update action restarts from the prompt")
        if len(present) == self.N:
            return Verdict(RESTORE, "partial")
        if not present:
            return Verdict(REQUEUE, "nothing generated")
        return Verdict(DROP, "incomplete", f"{len(present)} of {self.N} trajectories")

    def _apply(self, place: str, key: Key, pg: PromptGroup, trajs: list, verdict: Verdict) -> None:
        """Carry out one verdict of _verdict and count it: the one place that acts on a verdict. keep: a collected
        group goes into PipelineBuffer (its survivors, _trained), a buffered or kept-in-flight one stays; restore /
        restart / requeue: into the restored lane (restart: without its partial trajectories); drop: out of where it
        is. Counted: every drop once under DROP_METRICS[reason], its response tokens (and a restart's, and failed
        trajectories taken out) in rollout/discarded_tokens; a filter drop also in the waiting line's reasons and the
        run of drops that stops an untrainable run. Collection and an aborting boundary took the group out (_take)."""
        present = [t for t in trajs if t is not None]
        tokens = sum(int(t.response_ids.numel()) for t in present)
        boundary = self._boundary
        if place == COLLECTED:
            pg.partial = []  # the trajectories now live in the Group
            kept = self._trained(trajs)
            self._counts["rollout/failed_removed_count"] += len(trajs) - len(kept)
            if verdict.reason == "filter":
                self._counts["rollout/min_group_size_drop"] += len(kept) < self.min_group_size
                self._waited["reasons"][verdict.detail] += 1
                d = self._dropped
                d["groups"] += 1
                d["reasons"][verdict.detail] += 1
                d["rewards"].update(round(t.reward, 4) for t in trajs if t.status != FAILED)
                d["last"] = Group(pg, trajs)
            else:
                self._dropped = self._new_drop_run()
        if verdict.action == DROP:
            if place == BUFFERED:
                self.pbuf.remove(key)
            elif place == KEPT_IN_FLIGHT:
                self._take(key)
            counter = boundary if place in (IN_FLIGHT, KEPT_IN_FLIGHT) else self._counts
            counter[DROP_METRICS[verdict.reason]] += 1
            self._counts["rollout/discarded_tokens"] += tokens
            if verdict.reason == "incomplete":
                boundary["rollout/partial_dropped_incomplete_count"] += len(present)
        elif verdict.action == KEEP:
            if place == COLLECTED:
                self.pbuf.put(Group(pg, kept))
                self._counts["rollout/collected_groups"] += 1
                self._counts["rollout/discarded_tokens"] += tokens - sum(int(t.response_ids.numel()) for t in kept)
            elif place == KEPT_IN_FLIGHT:
                boundary["rollout/kept_in_flight_groups"] += 1
        else:
            if verdict.action == RESTART:  # (c) restart from the prompt: the partial tokens are thrown away
                self._counts["rollout/discarded_tokens"] += tokens
                pg.partial = []
                pg.metadata.pop("dispatch_version", None)
                boundary["rollout/restarted_groups"] += 1
            elif verdict.action == RESTORE:
                pg.partial = trajs
                boundary["rollout/restored_groups"] += 1
                boundary["rollout/partial_restored_count"] += len(present)
            else:  # requeue: keeps the partial it was dispatched with, if any
                boundary["rollout/requeued_unstarted_groups"] += 1
            self.data.restore([pg])

    def _take(self, key: Key) -> tuple:
        """Take an in-flight group out of flight: (its PromptGroup, its TrajQueue slots)."""
        self._complete.discard(key)
        return self._in_flight.pop(key), self.queue.pop(key)

    def _update_aborts_locked(self) -> list:
        return sorted(key for key, pg in self._in_flight.items()
                      if self._verdict(KEPT_IN_FLIGHT, pg, self.queue.slots(key)).action == DROP)

    def _may_dispatch(self, view: strategies.PipelineView) -> bool:
        if self.max_generating is not None and view.generating >= self.max_generating:
            return False
        return self.strategy.may_dispatch(self.data.peek_seq(), view)

    def _add_locked(self, t: Trajectory) -> None:
        key = t.prompt_id
        if key not in self._in_flight or not self.queue.add(t):
            self._counts["rollout/late_drop"] += 1
            return
        if self.queue.is_assembled(key):
            self._complete.add(key)

    def _partial_now(self, key: Key, pg: PromptGroup, back: list = ()) -> list:
        """An in-flight group as a restorable partial: the trajectories already put or handed `back` by a pause,
        else what it was dispatched with, else an empty aborted one (which the rollout generates from scratch); []
        when nothing exists yet."""
        slots = list(self.queue.slots(key))
        for t in back:
            if slots[t.index] is None:
                slots[t.index] = t
        if all(s is None for s in slots):
            return list(pg.partial)
        return [s if s is not None else pg.partial[i] if pg.partial else
                Trajectory(pg.epoch, pg.seq, i, pg.prompt_ids, status=ABORTED) for i, s in enumerate(slots)]

    def _collect_locked(self) -> None:
        """The collector: complete groups the strategy lets through leave TrajQueue, each with its verdict."""
        view = self._view()  # updated in place below: O(R) once per pass, not once per group
        moved = True
        while moved:  # a custom strategy may let a group through only after another one moved
            moved = False
            for key in sorted(self._complete):
                if not self.strategy.may_collect(key[1], view):
                    continue
                moved = True
                pg, trajs = self._take(key)
                view.R -= 1
                if key[1] == view.oldest_uncollected:
                    view.oldest_uncollected = min((k[1] for k in self._in_flight), default=None)
                self._apply(COLLECTED, key, pg, trajs, self._verdict(COLLECTED, pg, trajs, view))
                view.Q = len(self.pbuf)
        self._cond.notify_all()

    def _trained(self, trajs: list) -> list:
        """The trajectories of a collected group that it is trained on: with rollout.filter `failed`, those that did
        not fail (a tool error or timeout, a server error, a reward function that raised); otherwise all of them."""
        return [t for t in trajs if t.status != FAILED] if "failed" in self.filters else trajs

    def _filter_reason(self, trajs: list) -> Optional[str]:
        """Why rollout.filter drops this group, None if it lets it through: `failed` when fewer than
        rollout.min_group_size trajectories survive ("5 of 8 failed"), `all_equal_reward` when the survivors'
        rewards are all equal ("all 6 rewards 0.0": a failure does not make a group of equal rewards trainable)."""
        kept = self._trained(trajs)
        if len(kept) < self.min_group_size:
            return f"{len(trajs) - len(kept)} of {self.N} failed"
        rewards = [t.reward for t in kept]
        if "all_equal_reward" in self.filters and max(rewards) == min(rewards):
            return f"all {len(kept)} rewards {round(rewards[0], 4)}"
        return None

    @staticmethod
    def _new_wait_counts() -> dict:
        return {"t0": time.monotonic(), "generated": 0, "reasons": Counter()}

    @staticmethod
    def _new_drop_run() -> dict:
        """Counts (groups, reasons, trajectory rewards) and the last group of a run of filter drops: bounded."""
        return {"groups": 0, "reasons": Counter(), "rewards": Counter(), "last": None}

    def _cannot_train(self) -> bool:
        return self._producer_stop is not None or (self.stop_groups > 0 and self._dropped["groups"] >= self.stop_groups)

    def _stop_message(self) -> str:
        """One sentence: the filter, what it saw, a dropped group (prompt, response, label) and what to change; or
        the producer's own (a trajectory's metadata["stop"], e.g. rollout.env_fail_stop_steps)."""
        if self._producer_stop is not None:
            return self._producer_stop
        d, g = self._dropped, self._dropped["last"]
        rewards = ", ".join(f"{v} ({c})" for v, c in d["rewards"].most_common(5)) or "none (all failed)"
        t = next((t for t in g.trajectories if t.status == FAILED), g.trajectories[0])
        task, reward = self.sources[g.prompt.source]
        reward = reward or "the task's default"
        error = f", error {_clip(str(t.metadata['error']))!r}" if t.metadata.get("error") else ""
        return (f"nothing can be trained: rollout.filter={list(self.filters)} dropped each of the last "
                f"{d['groups']} groups ({', '.join(f'{r}: {c}' for r, c in d['reasons'].most_common(3))}; "
                f"trajectory rewards seen: {rewards}); the last one, of data_sources[{g.prompt.source}] (task {task}, "
                f"reward {reward}): prompt {_clip(self.decode(g.prompt.prompt_ids.tolist()))!r}"
                f", response {_clip(self.decode(t.response_ids.tolist()))!r} ({t.status}{error}), label "
                f"{_clip(str(g.prompt.label))!r}; check that data_source.reward scores such a response against "
                f"that label above 0 for a right answer, use a base model that solves some prompts, or change "
                f"rollout.filter (rollout.filter_stop_groups={self.stop_groups}; 0 turns this stop off)")

    def _collector_loop(self) -> None:
        with self._cond:
            while not self._closed:
                self._cond.wait_for(lambda: self._pending or self._closed, timeout=1.0)
                if self._pending:
                    self._pending = False
                    self._collect_locked()


def _clip(text: str, limit: int = 160) -> str:
    """At most `limit` characters: the start and the end (a prompt's question and a response's answer are there)."""
    return text if len(text) <= limit else f"{text[:limit // 2]} ... {text[-limit // 2:]}"
