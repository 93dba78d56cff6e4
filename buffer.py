"""buffer.py: the data between rollout and training (remote.py serves it over torch.distributed.rpc).

Data types (Trajectory, PromptGroup, Group), the DataSource (seeded epoch order, monotonic sequence numbers, the
restored lane), TrajQueue (trajectories -> complete groups), the collector thread, the bounded PipelineBuffer (oldest
(epoch, seq) first) and the PipelineServer facade that the rollout and the trainer call. What happens to a group at
collection, at the weight update, before a pause and at the step boundary is decided by staleness.decide and carried
out and counted by staleness.carry_out (staleness.py). Semantics: docs/design.md, counted in prompt groups (R in
flight, Q buffered, C capacity; strategies.py holds the dispatch/collection/keep rules and the update actions). One
lock guards all state
(every operation is O(groups in flight), a few hundred at most). Settings: `BufferSettings` (defaults included), so a
PipelineServer runs with one's own producer and consumer without the run's config (docs/copy_a_piece.md). workers.py
starts the buffer process: python workers.py buffer --config RESOLVED.yaml --rpc-init tcp://host:port --rank R
--world-size W. Tests: tests/test_buffer.py, tests/test_strategies.py. Imports the standard library, torch,
strategies.py and staleness.py (both stdlib-only) only.
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

import staleness
import strategies
from staleness import (BEFORE_PAUSE, BUFFERED, CHECKPOINTED, COLLECTED, COMPLETE_DROPS, COUNTERS, DROP, DROP_METRICS,
                       KEEPING, KEPT_IN_FLIGHT, Boundary)

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
    rollout.min_group_size that survive (staleness.trained). staleness.decide also gets a group in flight as a Group
    of its TrajQueue slots (None where no trajectory arrived yet)."""
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
                raise ValueError(f"data_source[{i}] has no prompts; each data source needs at least one")
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
                             f"{sizes}; resume needs the same data_source (task, path, num_prompts, seed)")
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
    """The buffer process's object: the rollout calls dispatch/put/boundary_aborts/step_boundary, the trainer
    get/step_metrics. What happens to each group (its verdict) is staleness.py's: decide and carry_out.
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
                             f"{len(s.sources)} data sources; pass one list per data source")
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
        self.action = self.strategy.action(s.partial, s.pause_mode)  # the update-time action (staleness.decide)
        ds = s.sources
        self.data = DataSource(prompts_per_source, [d.weight for d in ds], [d.seed for d in ds],
                               [d.shuffle for d in ds])
        self.queue = TrajQueue(self.N, max_groups=self.C)
        self.pbuf = PipelineBuffer(max_groups=self.C)
        self.version = 0  # current weight version (set_weight_version)
        self._in_flight: dict = {}  # key -> PromptGroup: dispatched, not yet collected (R)
        self._complete: set = set()  # in-flight keys with all N trajectories in TrajQueue: not generating
        self._consumed_step = 0  # groups handed out since the last step boundary
        self.counts: Counter = Counter()  # this step's counters, by metric name (COUNTERS), popped by step_metrics()
        self._totals: Counter = Counter()  # the popped counts, summed over the run (PipelineView.dropped)
        self._consumed_trajs: list = []  # (start_version, end_version, version at consumption) since last metrics
        self.boundary_counts: Counter = Counter()  # what the last step boundary did, by metric name, reported once
        self._boundary_decision: Optional[tuple] = None  # (kind, abort list) of the last boundary_aborts call
        self.waited: dict = self._new_wait_counts()  # for the trainer's waiting line, popped by wait()
        self.drop_run = staleness.new_drop_run()  # groups the filter dropped since the last one it let through
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
            self.counts["rollout/dispatched_groups"] += len(out)
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
            self.waited["generated"] += len(trajs)
            if self._thread is None:
                self._collect_locked()
            else:
                self._pending = True
                self._cond.notify_all()

    def boundary_aborts(self, kind: str) -> list:
        """The groups in flight that the coming step boundary of `kind` (a staleness.Boundary) drops as too old under
        the next weights (staleness.decide, BEFORE_PAUSE: the update action's abort by staleness), oldest first; the
        decision is recorded for step_boundary. The rollout asks once, before it pauses: with keep it aborts the
        requests of exactly these groups; with checkpoint its pause aborts every request, these groups are dropped
        and the others restored. abort and drain decide at step_boundary from what comes back: [] here."""
        kind = Boundary(kind)
        with self._cond:
            keys = sorted(key for key, pg in self._in_flight.items() if kind in KEEPING and staleness.decide(
                self, BEFORE_PAUSE, Group(pg, self.queue.slots(key))).action == DROP)
            self._boundary_decision = (kind, frozenset(keys))
            return keys

    def step_boundary(self, returned: list, kind: str = Boundary.ABORT) -> dict:
        """After the rollout paused: settle every group in flight for the boundary `kind` (a staleness.Boundary),
        clear TrajQueue, reset the strategy; the dict counts what happened. PipelineBuffer keeps its groups.

        `returned`: the trajectories the pause handed back (aborted partial ones). abort / drain: a group with all N
        trajectories goes to the restored lane with them as `partial` (restart: without them), one with none goes
        back as dispatched, one with some but not all is dropped, one too old for the update action is dropped.
        keep (pause_mode retract / in_place: the servers kept their requests): the groups of boundary_aborts(keep)
        are dropped, `returned` holds their trajectories; every other group stays in flight. checkpoint (the same
        pause before a checkpoint: every request aborted): the groups of boundary_aborts(checkpoint) are dropped,
        every other one goes to the lane with all N trajectories (put, handed back or not started; a group none of
        whose trajectories has started goes back as dispatched): nothing stays in flight. staleness.decide decides
        for each group (keep, checkpoint: from the recorded abort list), and staleness.carry_out carries it out."""
        kind = Boundary(kind)
        for t in returned:
            _check_trajectory(t, self.N)
        with self._cond:
            aborts = self._recorded_aborts(kind, self._boundary_decision, {t.prompt_id for t in returned})
            self._boundary_decision = None
            self._collect_locked()  # whatever the strategy allows now goes to PipelineBuffer first
            for t in returned:
                self._add_locked(t)  # (may mark a group complete; everything in flight is settled below)
            place = staleness.BOUNDARY_PLACE[kind]
            self.boundary_counts = Counter(dict.fromkeys(staleness.BOUNDARY_METRICS[place], 0))
            for key in sorted(self._in_flight):
                pg = self._in_flight[key]
                group = Group(pg, self._partial_now(key, pg) if place == CHECKPOINTED else self.queue.slots(key))
                staleness.carry_out(self, place, group, staleness.decide(self, place, group, aborted=aborts))
            if place != KEPT_IN_FLIGHT and len(self.queue):  # only groups in flight have trajectories queued
                raise RuntimeError(f"TrajQueue still holds {len(self.queue)} groups after the step boundary")
            self._end_step_locked()
            self.boundary_counts["rollout/pipeline_buf_size"] = len(self.pbuf)
            self._cond.notify_all()
            return dict(self.boundary_counts)

    def _recorded_aborts(self, kind: Boundary, decision: Optional[tuple], returned: set) -> frozenset:
        """The abort list boundary_aborts recorded for a keep / checkpoint boundary (empty for abort / drain), after
        checking that it was asked for this kind and that `returned` holds only what this kind hands back."""
        if kind not in KEEPING:
            return frozenset()
        if decision is None or decision[0] != kind:
            raise ValueError(f"step_boundary(kind={kind.value}) needs the abort list of boundary_aborts("
                             f"{kind.value}), asked before the pause; got "
                             f"{'none' if decision is None else 'one for ' + decision[0].value}")
        stray = returned - (decision[1] if kind == Boundary.KEEP else set(self._in_flight))
        if stray:
            where = "on the abort list of boundary_aborts(keep)" if kind == Boundary.KEEP else "in flight"
            raise ValueError(f"step_boundary(kind={kind.value}) got trajectories of groups {sorted(stray)} that are "
                             f"not {where}; this boundary takes back only those")
        return decision[1]

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
            self.counts["rollout/consumed_groups"] += k
            self.counts["rollout/trained_short_groups"] += sum(len(g.trajectories) < self.N for g in groups)
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
            w, self.waited = self.waited, self._new_wait_counts()
            return {"ready": len(self.pbuf), "needed": k, "generated": w["generated"],
                    "in_flight": len(self._in_flight) * self.N - self.queue.num_trajectories,
                    "filter_drop": sum(w["reasons"].values()), "drop_reasons": dict(w["reasons"]),
                    "seconds": time.monotonic() - w["t0"],
                    "stop": self._stop_message() if len(self.pbuf) < k and self._cannot_train() else None}

    def set_weight_version(self, v: int) -> None:
        """The rollout now generates with weights `v`; buffered groups beyond the strategy's
        rollout.max_weight_staleness rule, or that its keep_buffered no longer keeps, go (staleness.decide,
        staleness.carry_out)."""
        with self._cond:
            if v < self.version:
                raise ValueError(f"set_weight_version({v}): weight versions only grow; the current one is "
                                 f"{self.version}")
            self.version = int(v)
            view = self._view()
            for g in self.pbuf.groups():
                staleness.carry_out(self, BUFFERED, g, staleness.decide(self, BUFFERED, g, view), view)
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
            m.update(self.boundary_counts)
            m.update({k: self.counts[k] for k in COUNTERS})
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
            self._totals.update(self.counts)
            self.counts.clear()
            self._consumed_trajs = []
            self.boundary_counts = Counter()
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
            dropped=sum(self._totals[DROP_METRICS[r]] + self.counts[DROP_METRICS[r]] for r in COMPLETE_DROPS))

    def _end_step_locked(self) -> None:
        self.strategy.reset()
        self._consumed_step = 0
        self.strategy.at_boundary(self._view())

    def take_from_flight(self, key: Key) -> tuple:
        """Take an in-flight group out of flight (the collector, staleness.carry_out): (its PromptGroup, its TrajQueue
        slots)."""
        self._complete.discard(key)
        return self._in_flight.pop(key), self.queue.pop(key)

    def _may_dispatch(self, view: strategies.PipelineView) -> bool:
        if self.max_generating is not None and view.generating >= self.max_generating:
            return False
        return self.strategy.may_dispatch(self.data.peek_seq(), view)

    def _add_locked(self, t: Trajectory) -> None:
        key = t.prompt_id
        if key not in self._in_flight or not self.queue.add(t):
            self.counts["rollout/late_drop"] += 1
            return
        if self.queue.is_assembled(key):
            self._complete.add(key)

    def _partial_now(self, key: Key, pg: PromptGroup) -> list:
        """An in-flight group as a restorable partial: the trajectories already put (or handed back by a pause,
        step_boundary), else what it was dispatched with, else an empty aborted one (which the rollout generates from
        scratch); [] when nothing exists yet."""
        slots = self.queue.slots(key)
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
                pg, trajs = self.take_from_flight(key)
                view.R -= 1
                if key[1] == view.oldest_uncollected:
                    view.oldest_uncollected = min((k[1] for k in self._in_flight), default=None)
                group = Group(pg, trajs)
                staleness.carry_out(self, COLLECTED, group, staleness.decide(self, COLLECTED, group, view), view)
                view.Q = len(self.pbuf)
        self._cond.notify_all()

    @staticmethod
    def _new_wait_counts() -> dict:
        return {"t0": time.monotonic(), "generated": 0, "reasons": Counter()}

    def _cannot_train(self) -> bool:
        return self._producer_stop is not None or (self.stop_groups > 0 and self.drop_run["groups"] >= self.stop_groups)

    def _stop_message(self) -> str:
        """One sentence: the filter, what it saw, a dropped group (prompt, response, label; a failed trajectory's
        error, which names the file and line that raised, and where its traceback is) and what to change; or
        the producer's own (a trajectory's metadata["stop"], e.g. rollout.env_fail_stop_steps)."""
        if self._producer_stop is not None:
            return self._producer_stop
        d, g = self.drop_run, self.drop_run["last"]
        rewards = ", ".join(f"{v} ({c})" for v, c in d["rewards"].most_common(5)) or "none (all failed)"
        t = next((t for t in g.trajectories if t.status == FAILED), g.trajectories[0])
        task, reward = self.sources[g.prompt.source]
        reward = reward or "the task's default"
        error = f", error {_clip(str(t.metadata['error']))!r}" if t.metadata.get("error") else ""
        fix = ("fix what that error names (a raised exception's first traceback is in the rollout process's log, "
               "run_dir/logs/rollout.log), " if error else "")
        if error and not d["rewards"]:  # nothing was scored: what raised is all there is to fix
            fix += "or change "
        else:
            fix += ("check that data_source.reward scores such a response against that label above 0 for a right "
                    "answer, use a base model that solves some prompts, or change ")
        return (f"nothing can be trained: rollout.filter={list(self.filters)} dropped each of the last "
                f"{d['groups']} groups ({', '.join(f'{r}: {c}' for r, c in d['reasons'].most_common(3))}; "
                f"trajectory rewards seen: {rewards}); the last one, of data_source[{g.prompt.source}] (task {task}, "
                f"reward {reward}): prompt {_clip(self.decode(g.prompt.prompt_ids.tolist()))!r}"
                f", response {_clip(self.decode(t.response_ids.tolist()))!r} ({t.status}{error}), label "
                f"{_clip(str(g.prompt.label))!r}; {fix}rollout.filter (rollout.filter_stop_groups="
                f"{self.stop_groups}; 0 turns this stop off)")

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
