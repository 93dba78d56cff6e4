"""strategies.py: the sliding-window strategies that decide which prompt group may be dispatched or collected.

Semantics of ../shared/spec/fully_async_mode.md section 3, all counted in prompt groups:
  R = groups dispatched but not yet collected (still generating, or complete and waiting in TrajQueue),
  Q = complete groups in PipelineBuffer not yet consumed by the trainer,
  C = int(B * (1 + fully_async.stale_steps)) (config.Config.capacity).

  no-window      dispatch while R + Q <= C                       collect any complete group
  window-gated   also seq - oldest_uncollected_seq < C           collect any complete group
  windowed-fifo  dispatch as no-window                           collect only seq - oldest_uncompleted_seq < B

`Synchronous` is the rule of fully_async.enable=false: at most C = B + rollout.sampler.num_oversample groups per
step (consumed + R + Q <= C), topped up as the filter drops groups. It is not registered, because it is chosen by
fully_async.enable, not by fully_async.sliding_window.

The strategy only answers two questions for one group at a time; buffer.PipelineServer owns the counters, applies
rollout.async_max_concurrent_samples on top, and asks again after every change. A custom strategy is one class
and one decorator line, selected with `fully_async.sliding_window=<name>`:

    import strategies

    @strategies.register("strict-fifo")
    class StrictFifo(strategies.Strategy):
        '''Capacity rule for dispatch; collect a group only once every older dispatched group is complete.'''
        def may_collect(self, seq, view):
            return view.oldest_uncompleted is None or seq < view.oldest_uncompleted

Simplification: strategies are stateless by default (everything they need is in `PipelineView`); `reset()` is
called at every step boundary for strategies that keep their own state. Imports only the standard library.
"""
from __future__ import annotations

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


class Strategy:
    """Base strategy = the capacity rule alone (which is exactly no-window). Override either method."""

    def __init__(self, B: int, C: int):
        if B <= 0 or C < B:
            raise ValueError(f"a strategy needs B > 0 and capacity C >= B, got B={B}, C={C}")
        self.B, self.C = B, C

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        """May the group with sequence number `seq` be dispatched now? (Checked before it is counted in R.)"""
        return view.R + view.Q < self.C  # after this dispatch R + Q <= C

    def may_collect(self, seq: int, view: PipelineView) -> bool:
        """May the complete group `seq` move from TrajQueue into PipelineBuffer now?"""
        return True

    def reset(self) -> None:
        """Called at every step boundary, after TrajQueue was cleared."""


REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a Strategy subclass selectable as fully_async.sliding_window=<name>."""
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
    """Spec 3.1: only total capacity, dispatch_count = max(0, C - R - Q); any complete group is collected."""


@register("window-gated")
class WindowGated(Strategy):
    """Spec 3.2: also next_seq - oldest_uncollected_seq < C, so one slow group stops the window from sliding.

    A restored group keeps its old seq; it counts as uncollected from the moment it is dispatched again, which is
    why the oldest uncollected seq is taken over the group being dispatched too.
    """

    def may_dispatch(self, seq: int, view: PipelineView) -> bool:
        oldest = seq if view.oldest_uncollected is None else min(seq, view.oldest_uncollected)
        return view.R + view.Q < self.C and seq - oldest < self.C


@register("windowed-fifo")
class WindowedFifo(Strategy):
    """Spec 3.3: dispatch as no-window; collect only seq - oldest_uncompleted_seq < B (the window is B, not C).

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


def build(name: str, B: int, C: int, fully_async: bool) -> Strategy:
    """The strategy for a run: REGISTRY[name] in fully-async mode, Synchronous otherwise."""
    if not fully_async:
        return Synchronous(B, C)
    if name not in REGISTRY:
        raise ValueError(f"fully_async.sliding_window '{name}' is not registered; choose one of: "
                         f"{', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](B, C)
