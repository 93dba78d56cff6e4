"""strategies.py: which prompt group may be dispatched, collected and trained (spec windows, peers' staleness rules).

Semantics of docs/design.md (window strategies), all counted in prompt groups:
  R = groups dispatched but not yet collected (still generating, or complete and waiting in TrajQueue),
  Q = complete groups in PipelineBuffer not yet consumed by the trainer,
  C = int(B * (1 + fully_async.stale_steps)) (config.Config.capacity).

  no-window      dispatch while R + Q <= C                       collect any complete group
  window-gated   also seq - oldest_uncollected_seq < C           collect any complete group
  windowed-fifo  dispatch as no-window                           collect only seq - oldest_uncompleted_seq < B

`Synchronous` is the rule of fully_async.enable=false: at most C = B + rollout.sampler.num_oversample groups per
step (consumed + R + Q <= C), topped up as the filter drops groups. It is not registered, because it is chosen by
fully_async.enable, not by fully_async.sliding_window.

The strategy only answers questions about one group at a time; buffer.PipelineServer owns the counters, applies
rollout.async_max_concurrent_samples on top, and asks again after every change. A custom strategy is one class in
a module of your own (examples/strict_fifo.py), selected with `fully_async.sliding_window=module:Class`; the module
must be importable in every process of the run (e.g. on PYTHONPATH): config.load_plugins loads it there with
plugins.load and registers it in REGISTRY under that name, so the buffer process, which asks it, has it too.

    import strategies

    class StrictFifo(strategies.Strategy):
        '''Capacity rule for dispatch; collect a group only once every older dispatched group is complete.'''
        def may_collect(self, seq, view):
            return view.oldest_uncompleted is None or seq < view.oldest_uncompleted

A strategy is three parts (the split of docs/staleness.md), each a method with a default:
  admission           may_dispatch(seq, view): may a group start generating now?
  consumption filter  keep(group, view): may a complete group be trained? Asked when it is collected and again for
                      every buffered group at each weight update (keep_buffered); False drops it
                      (rollout/policy_drop). `group` carries its trajectories with their per-token weight versions,
                      so a rule on tokens is a strategy of your own (examples/token_staleness.py). Before keep, the
                      buffer asks within_max_weight_staleness(group, view), the rule of rollout.max_weight_staleness
                      (rollout/staleness_drop), which every strategy has. keep asks only; a strategy that counts
                      its answers does it in judged(group, view, kept), called once per answer as the buffer carries
                      it out (staleness.carry_out).
  update-time action  `actions`: the UpdateActions the strategy accepts at a weight update (abort and resume
                      partial, abort and restart from the prompt, drain, in_place, retract, each optionally with
                      abort by staleness). Empty = any that rollout.partial / rollout.pause_mode select (the spec's
                      three); config.validate refuses a pairing a strategy does not accept (check_action).
The presets' docstrings describe their peer's rule in the same three parts: admission, filter, at the update.
Presets of the peers' rules (areal, verl, pipelinerl, prime-rl, roll, slime-async) are registered beside the spec's
three; each takes one knob, fully_async.policy_param, in its own unit, and derives the capacity C from it. Each also
declares the loss its peer trains with (`policy_loss`, `offpolicy_mask`: `peer_overrides` gives them as config
overrides, `pairing_note` the start-up line of a run that uses another), and its docstring lists its deviations.

Simplification: strategies are stateless by default (everything they need is in `PipelineView` and the group);
`reset()` and `at_boundary(view)` are called at every step boundary, `dispatched` and `consumed` for every group
handed out, for strategies that keep their own state (not checkpointed). Imports only the standard library: the
group and its trajectories are the buffer's objects (buffer.Group, buffer.Trajectory), read by attribute.
"""
from __future__ import annotations

import bisect
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class PipelineView:
    """The counters a strategy decides on, as PipelineServer sees them at the moment of the question."""
    B: int  # groups consumed per training step (data_source.num_prompts_per_step)
    C: int  # capacity in groups: int(B * (1 + stale_steps)), or B + num_oversample in synchronous mode
    R: int  # dispatched, not yet collected (generating + complete groups still in TrajQueue)
    Q: int  # complete groups in PipelineBuffer, not yet consumed
    generating: int  # dispatched groups whose N trajectories have not all arrived (subset of R)
    consumed: int  # groups handed to the trainer since the last step boundary
    next_seq: int  # sequence number the next fresh prompt group will get
    oldest_uncollected: Optional[int]  # smallest seq among the R dispatched-not-collected groups (None: R == 0)
    oldest_uncompleted: Optional[int]  # smallest seq among dispatched groups not yet complete (None: none)
    version: int = 0  # the current weight version v (the number of weight updates so far)
    lane: int = 0  # restored groups waiting to be dispatched again (dispatched before any fresh prompt)
    dropped: int = 0  # complete groups dropped since the start (rollout.filter, max_weight_staleness, keep)


@dataclass(frozen=True)
class UpdateAction:
    """The update-time action: what happens to the groups in flight when the weights change (the step boundary).

    pause: abort (the servers abort every request; partial trajectories go back to the buffer), in_place (the
    requests stay on the paused servers with their KV cache and continue with the new weights), retract (they stay,
    their KV cache is recomputed), drain (no pause: the boundary waits for everything in flight).
    restart: aborted groups restart from the prompt; their partial tokens are thrown away (rollout/discarded_tokens).
    stale_after: abort by staleness: groups that started more than this many versions before the new weights are
    aborted and dropped (rollout/update_dropped_groups); None = none.
    """
    pause: str
    restart: bool = False
    stale_after: Optional[int] = None

    @property
    def rollout_settings(self) -> tuple[bool, str]:
        """The (rollout.partial, rollout.pause_mode) this action runs with."""
        return (False, "abort") if self.pause == "drain" else (True, self.pause)

    def describe(self) -> str:
        name = {"abort": "abort + restart from the prompt" if self.restart else "abort + resume partial",
                "in_place": "keep in place", "retract": "retract", "drain": "drain (wait)"}[self.pause]
        return name + (f", abort groups older than {self.stale_after}" if self.stale_after is not None else "")


def action_for(partial: bool, pause_mode: str) -> UpdateAction:
    """The plain UpdateAction that rollout.partial / rollout.pause_mode select."""
    return UpdateAction(pause_mode if partial else "drain")


class Strategy:
    """Base strategy = the capacity rule alone (which is exactly no-window), with the rollout.max_weight_staleness
    rule. Override any method; an __init__ of your own takes max_weight_staleness and passes it on."""

    actions: tuple = ()  # the update-time actions accepted; () = whatever rollout.partial / pause_mode select

    def __init__(self, B: int, C: int, max_weight_staleness: Optional[int] = None):
        if B <= 0 or C < B:
            raise ValueError(f"a strategy needs B > 0 and capacity C >= B, got B={B}, C={C}")
        self.B, self.C = B, C
        self.max_weight_staleness = max_weight_staleness  # rollout.max_weight_staleness; None: no bound
        self.counts: dict = {}  # rollout/<name> counters of the strategy's own, popped by the buffer's step_metrics

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        """May the group with sequence number `seq` be dispatched now? (Checked before it is counted in R.)"""
        return view.R + view.Q < self.C  # after this dispatch R + Q <= C

    def may_collect(self, seq: int, view: PipelineView) -> bool:
        """May the complete group `seq` move from TrajQueue into PipelineBuffer now?"""
        return True

    def within_max_weight_staleness(self, group, view: PipelineView) -> bool:
        """The consumption filter's default rule, rollout.max_weight_staleness: False when a trajectory of the group
        started more than that many versions before the current one (a trajectory with no generated token,
        start_version -1, has no age). The buffer asks it before keep / keep_buffered, and counts its drops in
        rollout/staleness_drop."""
        m = self.max_weight_staleness
        return m is None or all(t.start_version < 0 or view.version - t.start_version <= m
                                for t in group.trajectories)

    def keep(self, group, view: PipelineView) -> bool:
        """The consumption filter: may this complete group be trained? Asked at collection and (keep_buffered) for
        buffered groups at every weight update; False drops it (rollout/policy_drop). It only asks: the buffer may
        ask again, and hears each answer it acts on in judged(). `group` (a buffer.Group) may be read for
          group.start_version   its first generated token's oldest weight version, else the version at dispatch
          group.prompt_id       (epoch, seq)
          group.trajectories    its N trajectories (fewer: the survivors of failures, rollout.min_group_size),
                                each with start_version and end_version (-1: nothing generated),
                                status, reward, and the 1-D tensors of the response: versions (the weight version
                                of each token; environment tokens carry the one of the turn before them, -1 before
                                any), loss_mask, response_ids
        view.version is the current weight version."""
        return True

    def keep_buffered(self, group, view: PipelineView) -> bool:
        """The consumption filter for a group already in PipelineBuffer, asked at every weight update (default: as
        at collection)."""
        return self.keep(group, view)

    def judged(self, group, view: PipelineView, kept: bool) -> None:
        """keep / keep_buffered answered `kept` about this group, and the buffer now acts on that answer
        (staleness.carry_out): called once per answer, so a strategy that counts what it keeps or drops counts
        here."""

    def dispatched(self, fresh: bool, view: PipelineView) -> None:
        """A group was dispatched; fresh=False for a restored (or replayed) one. `view` is as before this dispatch,
        so a fresh group's seq is view.next_seq."""

    def consumed(self, group, view: PipelineView) -> None:
        """The group (as keep sees it) was handed to the trainer."""

    def reset(self) -> None:
        """Called at every step boundary, after TrajQueue was cleared."""

    def at_boundary(self, view: PipelineView) -> None:
        """Called at every step boundary after reset(), with the counters as the new step starts."""

    def action(self, partial: bool, pause_mode: str) -> UpdateAction:
        """The update-time action for these rollout settings (config.validate checks they are accepted)."""
        for a in self.actions:
            if a.rollout_settings == (partial, pause_mode):
                return a
        if self.actions:
            raise ValueError(f"{type(self).__name__} accepts {self.accepted_settings()}; got rollout.partial="
                             f"{str(partial).lower()}, rollout.pause_mode={pause_mode}")
        return action_for(partial, pause_mode)

    @classmethod
    def accepted_settings(cls) -> str:
        return " or ".join(f"rollout.partial={str(p).lower()}" + (f" with rollout.pause_mode={m}" if p else "")
                           for p, m in (a.rollout_settings for a in cls.actions))

    @classmethod
    def update_actions(cls, param: Optional[float], B: int, N: int) -> tuple:
        """The update-time actions (UpdateActions) accepted with the knob `param` (fully_async.policy_param; None:
        the default): `actions`, or what a preset derives from its knob (its __init__ sets the same)."""
        return cls.actions

    @classmethod
    def check_action(cls, name: str, param: Optional[float], B: int, N: int, partial: bool, pause_mode: str) -> None:
        """config.validate's check, without an instance: the update action rollout.partial / rollout.pause_mode
        select is one the strategy registered as `name` accepts (update_actions); else one sentence."""
        actions = cls.update_actions(param, B, N)
        if actions and (partial, pause_mode) not in [a.rollout_settings for a in actions]:
            raise ValueError(f"fully_async.sliding_window={name} ({actions[0].describe()} at the weight update) needs "
                             f"{cls.accepted_settings()}; got rollout.partial={str(partial).lower()}, "
                             f"rollout.pause_mode={pause_mode}")


REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a Strategy subclass selectable as fully_async.sliding_window=<name> (the built-ins; a
    strategy of your own is selected as module:Class, which config.load_plugins registers in every process)."""
    def deco(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"@register('{name}') must decorate a subclass of strategies.Strategy, got {cls!r}")
        if name in REGISTRY and REGISTRY[name] is not cls:
            raise ValueError(f"sliding_window strategy '{name}' is already registered by {REGISTRY[name].__name__}")
        REGISTRY[name] = cls
        return cls
    return deco


@register("no-window")
class NoWindow(Strategy):
    """Only total capacity, dispatch_count = max(0, C - R - Q); any complete group is collected (docs/design.md)."""


@register("window-gated")
class WindowGated(Strategy):
    """Also next_seq - oldest_uncollected_seq < C, so one slow group stops the window from sliding (docs/design.md).

    A restored group keeps its old seq; it counts as uncollected from the moment it is dispatched again, which is
    why the oldest uncollected seq is taken over the group being dispatched too.
    """

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        oldest = seq if view.oldest_uncollected is None else min(seq, view.oldest_uncollected)
        return view.R + view.Q < self.C and seq - oldest < self.C


@register("windowed-fifo")
class WindowedFifo(Strategy):
    """Dispatch as no-window; collect only seq - oldest_uncompleted_seq < B (the window is B, not C; docs/design.md).

    Complete groups outside the window stay in TrajQueue and keep counting in R until the front slides.
    """

    def may_collect(self, seq: int, view: PipelineView) -> bool:
        return view.oldest_uncompleted is None or seq - view.oldest_uncompleted < self.B


class Synchronous(Strategy):
    """fully_async.enable=false: at most C = B + num_oversample groups per step (consumed + R + Q <= C).

    Consuming a group does not free a slot (the step's batch is fixed); a group dropped by the filter does, which
    is the top-up of dynamic sampling.
    """

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        return view.consumed + view.R + view.Q < self.C


# ---------------------------------------------------------------------------------------------------------
# The peers' rules as presets (docs/staleness.md; each class names the file its rule is read from).
# Versions here count weight updates, one per training step of B groups; a group's start version is the
# version of its first generated token (the version at dispatch when it has none yet).
# ---------------------------------------------------------------------------------------------------------

ABORT_RESUME, ABORT_RESTART = UpdateAction("abort"), UpdateAction("abort", restart=True)
IN_PLACE, DRAIN = UpdateAction("in_place"), UpdateAction("drain")


class Preset(Strategy):
    """A peer's rule: one knob `param` (fully_async.policy_param) in the peer's own unit; None = `default(B, N)`,
    chosen so that the preset allows one step of staleness. `capacity` is the C the admission can reach."""

    param_name = ""  # what fully_async.policy_param means for this preset, for errors and the README
    staleness_knob = True  # param scales the staleness allowed (bench/policies.py sweeps it)
    policy_loss = "ppo"  # the loss the peer trains with, as algorithm.policy_loss (see pairing_note)
    other_losses: tuple = ()  # other algorithm.policy_loss values the peer offers (no start-up line for them)
    loss_settings: tuple = ()  # more `algorithm.*=value` overrides that give the peer's defaults (peer_overrides)
    offpolicy_mask: Optional[bool] = False  # the peer's rollout.mask_offpolicy_in_partial_rollout; None = optional

    def __init__(self, B: int, C: int, param: Optional[float] = None, N: int = 1,
                 max_weight_staleness: Optional[int] = None):
        super().__init__(B, C, max_weight_staleness)
        self.N = N
        self.param = self.default(B, N) if param is None else float(param)

    @classmethod
    def default(cls, B: int, N: int) -> float:
        return 1.0

    @classmethod
    def check(cls, param: Optional[float], B: int, N: int) -> None:
        """Refuse a knob the rule cannot use, in one sentence."""
        if param is not None and param < 0:
            raise ValueError(f"fully_async.policy_param ({cls.param_name}) must be >= 0, got {param}")

    @classmethod
    def capacity(cls, param: Optional[float], B: int, N: int) -> int:
        raise NotImplementedError

    @classmethod
    def max_concurrent_samples(cls, B: int, N: int) -> Optional[int]:
        """The peer's own cap on generating samples, the preset's companion knob: config.resolve puts it in
        rollout.async_max_concurrent_samples when that is unset (set it to change it); None = no cap."""
        return None


class CumulativeBudget(Preset):
    """Admission: accepted + running < budget + v B, with `accepted` cumulative (AReaL's form; ROLL's and PipelineRL's
    are the same with other units). Each step trains B accepted groups, so accepted = v B + consumed + Q and the rule
    reads consumed + R + Q < budget: consuming a group does not free a slot before the weight update; a group dropped by
    a filter does ("rejected rollouts do not count")."""

    def budget(self) -> float:
        return self.B * (1.0 + self.param)

    @classmethod
    def capacity(cls, param, B, N):
        return max(B, math.ceil(cls(B, B, param, N).budget()))

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        return view.consumed + view.R + view.Q < self.budget() and view.R + view.Q < self.C


@register("areal")
class AReaL(CumulativeBudget):
    """AReaL (areal/infra/staleness_manager.py, workflow_executor.py): admission: accepted + running < (eta + v + 1) B,
    eta = max_head_offpolicyness, and (get_capacity's minimum) running < max_concurrent_rollouts, default the consumer
    batch size B: rollout.async_max_concurrent_samples, B N when unset (max_concurrent_samples); filter: none; at the
    update: /pause_generation abort, the partial output resubmitted under the new weights (per-token versions kept). Its
    loss: decoupled PPO as AReaL's paper has it, the proximal policy recomputed (algorithm.policy_loss=decoupled_ppo;
    loglinear is AReaL's other option), no off-policy mask, the behaviour weight pi_prox / mu masked above 5
    (algorithm.decoupled_ppo: AReaL 1.0.4's rejection_sampling with its defaults, areal/api/cli_args.py
    RejectionSamplingConfig; its top-level default rejection_sampling=None, no weight, is behav_imp_weight_cap=null),
    algorithm.is_correction.enable=false (decoupled_ppo refuses a second weight).
    Deviations: groups (not samples) are the unit; `accepted` is derived from the counters (v B + consumed + Q), not
    persisted."""
    param_name = "eta (max_head_offpolicyness, in steps)"
    actions = (ABORT_RESUME,)
    policy_loss = "decoupled_ppo"
    other_losses = ("loglinear",)
    loss_settings = ("algorithm.is_correction.enable=false",)

    @classmethod
    def max_concurrent_samples(cls, B, N):
        return B * N  # max_concurrent_rollouts or consumer_batch_size (rollout_controller.py): B groups of N


@register("verl")
class Verl(Preset):
    """verl fully-async (fully_async_rollouter.py, param_sync.py): admission: started < (1 + s) B new prompts per weight
    version, s = staleness_threshold, the count re-anchored at each sync to the work carried over (in flight + cancelled
    + queued); each new prompt adds 1, resumed partials do not; filter: none; at the update: partial_rollout: cancel and
    resume first (abort), or without it drain. Its loss: PPO around the recomputed old log-probs (ppo), no off-policy
    mask. Deviations: a group dropped by rollout.filter gives its slot back (verl's rollouter has no such filter; with
    all_equal_reward dropping most groups the budget would run out before a batch is complete, and the run would stall);
    N = B prompts per version (verl: trigger_parameter_sync_step x require_batches x ppo_mini_batch_size); a full queue
    never evicts (the budget keeps it below C)."""
    param_name = "staleness_threshold s (in steps)"
    actions = (ABORT_RESUME, DRAIN)

    def __init__(self, B, C, param=None, N=1, max_weight_staleness=None):
        super().__init__(B, C, param, N, max_weight_staleness)
        self.started = 0  # new prompts counted against this version's budget
        self.dropped_at_sync = 0  # view.dropped at the last sync

    @classmethod
    def capacity(cls, param, B, N):
        return max(B, math.ceil(B * (1.0 + (1.0 if param is None else param))))

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        fresh_ok = view.lane > 0 or self.started - (view.dropped - self.dropped_at_sync) < self.B * (1.0 + self.param)
        return fresh_ok and view.R + view.Q < self.C

    def dispatched(self, fresh: bool, view: PipelineView) -> None:
        self.started += fresh

    def at_boundary(self, view: PipelineView) -> None:
        self.started, self.dropped_at_sync = view.R + view.Q + view.lane, view.dropped


@register("pipelinerl")
class PipelineRL(CumulativeBudget):
    """PipelineRL (pipelinerl/actor.py, finetune_loop.py, vllm1.py): admission: submitted groups < ceil(L / G) + (u + 1)
    ceil(U / G), L = max_lag in samples, G = N, U = B N samples per update; filter: counted, not dropped: at training
    (finetune_loop.py: last_broadcasted_version - batch.model_version > max_lag, model_version = the version at the
    rollout's start), a group older than L samples adds its trajectories (N) to rollout/samples_too_old; at the update:
    nothing aborted: pause mode keep, the running sequences continue on the old KV cache with the new weights
    (in_place). Its loss: truncated IS against the behaviour log-probs (algorithm.policy_loss=truncated_is, epsilon 0.02
    and the sum over tokens divided by the sequences of a step: loss_agg_mode=seq-mean-token-sum; no correction:
    algorithm.is_correction.enable=false), no off-policy mask: the pre-update tokens of an in-place trajectory are
    trained.
    Deviations: a group dropped by rollout.filter gives its admission slot back (PipelineRL's submitted_groups only
    grows); PipelineRL's default mode sets no max_lag, so nothing bounds admission and the preprocessor's bounded queues
    pop the oldest data (preprocess.py, pop_old_data), where here param=None means L = B N (one step) and nothing is
    evicted; samples_too_old is counted per group of N, not per micro-batch of train_batch_size (which takes the batch's
    oldest model_version)."""
    param_name = "max_lag L (in samples)"
    actions = (IN_PLACE,)
    policy_loss = "truncated_is"
    loss_settings = ("algorithm.loss_agg_mode=seq-mean-token-sum", "algorithm.is_correction.enable=false")

    @classmethod
    def default(cls, B, N):
        return float(B * N)

    def budget(self) -> float:
        return math.ceil(self.param / self.N) + self.B

    def consumed(self, group, view: PipelineView) -> None:
        if (view.version - group.start_version) * self.B * self.N > self.param:
            self.counts["rollout/samples_too_old"] = (self.counts.get("rollout/samples_too_old", 0)
                                                      + len(group.trajectories))  # N, or a short group's survivors


PRIME_MAX_INFLIGHT = 1024  # prime-rl's default max_inflight, in rollouts (orchestrator config); at its spec scale
# (B = 64 groups of N = 8) that is 2 B in flight: a benchmark that scales B down scales this with it


@register("prime-rl")
class PrimeRL(Preset):
    """prime-rl (orchestrator/orchestrator.py, dispatcher.py, scheduler.py, train_sink.py): admission: the gate counts
    batches shipped to the trainer, not work in flight: new episodes are dispatched while (step - 1) - policy.version <=
    1, i.e. at most one batch shipped ahead of the trainer's weights. Each step trains B groups, so the groups accepted
    so far are v B + consumed + Q and the gate reads consumed + Q < 2 B; in flight are up to max_inflight rollouts
    (PRIME_MAX_INFLIGHT, in C as ceil(1024 / N) groups on top of 2 B, so requests beyond the fleet's concurrency queue
    in the servers as in prime-rl; rollout.async_max_concurrent_samples lowers it); filter: drop queued groups whose
    start version < v - M, M = max_off_policy_steps (param None: 1; prime-rl's default 8): what bounds the staleness; at
    the update: keep in flight (pause mode keep), but first abort whole groups that would be older than M under the new
    weights. Its loss (trainer/rl/loss.py default_loss_fn: the ratio to the inference log-probs, tokens masked by
    probability difference, a squared log-ratio term) is not among algorithm.policy_loss: ppo is the closest.
    Deviations: max_inflight is fixed (prime-rl adapts it to the KV-cache use between min_inflight and max_inflight,
    concurrency.py) and counted in whole groups; C also bounds R + Q, the buffered groups included; the trainer does not
    hold a batch until policy.version >= step - 2 (it takes what is buffered)."""
    param_name = "max_off_policy_steps M"
    staleness_knob = False  # the lead is fixed at 1; M only bounds what is dropped

    def __init__(self, B, C, param=None, N=1, max_weight_staleness=None):
        super().__init__(B, C, param, N, max_weight_staleness)
        self.actions = self.update_actions(self.param, B, N)

    @classmethod
    def update_actions(cls, param, B, N):
        return (UpdateAction("in_place", stale_after=int(cls.default(B, N) if param is None else param)),)

    @classmethod
    def check(cls, param, B, N):
        if param is not None and (param < 0 or param != int(param)):
            raise ValueError(f"fully_async.policy_param ({cls.param_name}) must be a whole number >= 0, got {param}")

    @classmethod
    def capacity(cls, param, B, N):
        return 2 * B + math.ceil(PRIME_MAX_INFLIGHT / N)

    @classmethod
    def accepted_settings(cls) -> str:
        return "rollout.partial=true with rollout.pause_mode=in_place"

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        return view.consumed + view.Q < 2 * self.B and view.R + view.Q < self.C

    def keep(self, group, view: PipelineView) -> bool:
        return view.version - group.start_version <= self.param


@register("roll")
class Roll(CumulativeBudget):
    """ROLL (roll/distributed/scheduler/generate_scheduler.py, ReplayBuffer): admission: running + completed <
    ceil(alpha B) + t B, `completed` cumulative, so a completed group dropped as stale never gives its slot back (gc),
    while a group dropped by rollout.filter or aborted does; filter: skip groups with start step < t - ceil(alpha); with
    a fractional alpha the oldest allowed step fills only ceil(frac(alpha) B) groups per step; consumption
    (ReplayBuffer.get_batch, ItemsGroup.get_batch) takes the oldest step first and waits for that step's running prompts
    before it takes a younger step's: a complete group is collected only when no group of an older step (its weight
    version at first dispatch) is still generating; at the update: drop the running groups that are too old for its
    filter under the new weights, abort the rest and resume their partial output. Its loss: PPO (ppo), no off-policy
    mask.
    Deviations: groups (ROLL: prompts) are the unit; ROLL's get_batch may take a step's finished groups while others of
    it still run, once they fill the batch, where here the pipeline buffer hands out oldest seq first whatever the step;
    the lost slots are not checkpointed. As in ROLL, a run whose stale drops use up the budget stops dispatching
    (rollout/roll_slots_lost counts them)."""
    param_name = "alpha (in steps)"

    def __init__(self, B, C, param=None, N=1, max_weight_staleness=None):
        super().__init__(B, C, param, N, max_weight_staleness)
        self.lag = math.ceil(self.param)
        self.quota = math.ceil((self.param - math.floor(self.param)) * B) if self.param != self.lag else None
        self.oldest_taken = 0  # groups of the oldest allowed step accepted since the boundary (fractional alpha)
        self.slots_lost = 0  # complete groups dropped as stale: they stay counted in ROLL's `completed`
        self.step_seqs: list = []  # the first fresh seq dispatched at each weight version, ascending
        self.actions = self.update_actions(self.param, B, N)

    @classmethod
    def accepted_settings(cls) -> str:
        return "rollout.partial=true with rollout.pause_mode=abort"

    @classmethod
    def update_actions(cls, param, B, N):
        return (UpdateAction("abort", stale_after=math.ceil(cls.default(B, N) if param is None else param)),)

    def budget(self) -> float:
        return math.ceil(self.param * self.B) + self.B

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        return view.consumed + view.R + view.Q + self.slots_lost < self.budget() and view.R + view.Q < self.C

    def dispatched(self, fresh: bool, view: PipelineView) -> None:
        if fresh and (not self.step_seqs or view.version > self.step_seqs[-1][1]):
            self.step_seqs.append((view.next_seq, view.version))

    def _step(self, seq: int) -> int:
        """The weight version at which the group `seq` was first dispatched (-1: before any this strategy saw)."""
        i = bisect.bisect_right(self.step_seqs, (seq, math.inf)) - 1
        return self.step_seqs[i][1] if i >= 0 else -1

    def may_collect(self, seq: int, view: PipelineView) -> bool:
        return view.oldest_uncompleted is None or self._step(view.oldest_uncompleted) >= self._step(seq)

    def keep(self, group, view: PipelineView) -> bool:
        lag = view.version - group.start_version
        return lag < self.lag or lag == self.lag and (self.quota is None or self.oldest_taken < self.quota)

    def judged(self, group, view: PipelineView, kept: bool) -> None:
        if not kept:
            self.slots_lost += 1
            self.counts["rollout/roll_slots_lost"] = self.slots_lost
        elif self.quota is not None and view.version - group.start_version == self.lag:
            self.oldest_taken += 1  # one more group of the oldest allowed step

    def reset(self) -> None:
        self.oldest_taken = 0


@register("slime-async")
class SlimeAsync(Preset):
    """slime's fully-async example (slime/rollout/fully_async_rollout.py): no versions; admission: top up while
    generating < C and queued < C, C = concurrency (here in groups); filter: none; at the update: /pause_generation
    abort and flush_cache, the aborted group is put back in the data buffer unchanged (_make_done_cb) and continues from
    its partial tokens when dispatched again (sglang_rollout.py: _prepare_prompt_ids reuses sample.tokens,
    generate_and_rm skips the completed samples): abort + resume partial. Its loss: PPO (ppo), with
    --mask-offpolicy-in-partial-rollout optional (rollout.mask_offpolicy_in_partial_rollout, either value). C counts
    groups as slime does (its worker's tasks are whole groups, generate_and_rm_group); slime's default C is
    sglang_server_concurrency x engines = 512 x engines, here B (one step).
    Deviations: slime's train_async.py collects step t + 1's batch while step t trains and waits for it before the
    weight update (one step ahead), so every trained group is at least one version old and the trainer never waits for
    generation; here the trainer collects its batch during its own step (staleness can be 0, a generation-bound step
    waits): not modelled. A group some of whose trajectories did not come back from the abort is dropped (slime
    re-queues whatever the abort returned)."""
    param_name = "concurrency C (in groups)"
    actions = (ABORT_RESUME,)
    offpolicy_mask = None

    @classmethod
    def default(cls, B, N):
        return float(B)

    @classmethod
    def check(cls, param, B, N):
        if param is not None and (param < 1 or param != int(param)):
            raise ValueError(f"fully_async.policy_param ({cls.param_name}) must be a whole number >= 1, got {param}")

    @classmethod
    def capacity(cls, param, B, N):
        return max(B, 2 * int(cls.default(B, N) if param is None else param))

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        return view.generating < self.param and view.Q < self.param and view.R + view.Q < self.C


PRESETS = ("areal", "verl", "pipelinerl", "prime-rl", "roll", "slime-async")  # the peers' rules, registered above

def pairing_note(name: str, policy_loss: str, offpolicy_mask: bool) -> Optional[str]:
    """The start-up line for a run that pairs the preset `name` with another peer's loss or off-policy mask, or
    None (a spec strategy, or the preset's own pairing)."""
    cls = REGISTRY.get(name)
    if not (isinstance(cls, type) and issubclass(cls, Preset)):
        return None
    mixed = []
    if policy_loss not in (cls.policy_loss, *cls.other_losses):
        mixed.append(f"algorithm.policy_loss={policy_loss} (its peer trains with "
                     f"{' or '.join((cls.policy_loss, *cls.other_losses))})")
    if cls.offpolicy_mask is not None and offpolicy_mask != cls.offpolicy_mask:
        mixed.append(f"rollout.mask_offpolicy_in_partial_rollout={str(offpolicy_mask).lower()} (its peer: "
                     f"{str(cls.offpolicy_mask).lower()})")
    if not mixed:
        return None
    return (f"fully_async.sliding_window={name} runs with {' and '.join(mixed)}: the peer's staleness rule with "
            "another loss than the peer's")


def peer_overrides(name: str) -> list:
    """The `a.b=c` overrides that give the preset `name` its peer's loss (with its default settings where they differ
    from this project's: `loss_settings`) and off-policy mask (for bench scripts)."""
    cls = REGISTRY[name]
    out = [f"algorithm.policy_loss={cls.policy_loss}", *cls.loss_settings]
    if cls.offpolicy_mask is not None:
        out.append(f"rollout.mask_offpolicy_in_partial_rollout={str(cls.offpolicy_mask).lower()}")
    return out


def build(name: str, B: int, C: int, fully_async: bool, param: Optional[float] = None, N: int = 1,
          max_weight_staleness: Optional[int] = None) -> Strategy:
    """The strategy for a run: REGISTRY[name] in fully-async mode, Synchronous otherwise, with the bound of
    rollout.max_weight_staleness (None: none). Presets also get their knob `param` (fully_async.policy_param, None =
    one step of staleness) and N."""
    if not fully_async:
        return Synchronous(B, C, max_weight_staleness)
    cls = lookup(name)
    if issubclass(cls, Preset):
        return cls(B, C, param, N, max_weight_staleness)
    return cls(B, C, max_weight_staleness=max_weight_staleness)


def lookup(name: str) -> type:
    """The strategy class fully_async.sliding_window=`name` selects, its interface checked (_check_interface); an
    unregistered name is refused in one sentence naming the built-in ones."""
    if name not in REGISTRY:
        builtin = ", ".join(n for n in REGISTRY if ":" not in n)  # without the module:Class entries of plugins
        raise ValueError(f"fully_async.sliding_window '{name}' is not registered; choose one of: {builtin} or "
                         "module:Class (registered by config.load_plugins)")
    cls = REGISTRY[name]
    _check_interface(name, cls)
    return cls


def _check_interface(name: str, cls: type) -> None:
    """Refuse, in one sentence, a strategy of your own written for the per-group methods' earlier form
    `(self, start_version, view)`, rather than call it with a group it would take for a number; or one whose
    __init__ cannot take max_weight_staleness."""
    for method in ("keep", "keep_buffered", "consumed"):
        if list(inspect.signature(getattr(cls, method)).parameters)[1:2] == ["start_version"]:
            raise ValueError(f"fully_async.sliding_window '{name}': {cls.__name__}.{method}(self, start_version, view) "
                             f"has the earlier signature; write {method}(self, group, view) and read "
                             "group.start_version (or group.trajectories: strategies.Strategy.keep lists them)")
    init = inspect.signature(cls).parameters
    if "max_weight_staleness" not in init and not any(p.kind == p.VAR_KEYWORD for p in init.values()):
        raise ValueError(f"fully_async.sliding_window '{name}': {cls.__name__}.__init__ must take "
                         "max_weight_staleness=None and pass it to strategies.Strategy.__init__ (the rule of "
                         "rollout.max_weight_staleness)")
