"""staleness.py: what happens to a prompt group between its dispatch and the trainer, decided and carried out here.

`decide` is the one function that decides, and `carry_out` the one that carries its verdict out (moves the group and
counts it), for a group of a buffer.PipelineServer in each of its places:
  COLLECTED       complete, leaving TrajQueue (PipelineServer._collect_locked)
  BUFFERED        in PipelineBuffer when the weights change (PipelineServer.set_weight_version)
  BEFORE_PAUSE    in flight before the pause of pause_mode retract / in_place (Boundary.KEEP, and
                  Boundary.CHECKPOINT, whose pause then aborts every request): the abort list, decided once and
                  recorded (PipelineServer.boundary_aborts); carried out at the boundary
  IN_FLIGHT       in flight at a step boundary whose pause aborted every request or waited for it (Boundary.ABORT,
                  Boundary.DRAIN: PipelineServer.step_boundary)
  KEPT_IN_FLIGHT  in flight at a Boundary.KEEP step boundary: dropped if on the recorded abort list, else kept
  CHECKPOINTED    in flight at a Boundary.CHECKPOINT step boundary: dropped if on the recorded abort list, else restored
                  with all N trajectories, or as dispatched when none has started (the pause aborted every request,
                  so the checkpoint holds every trajectory)
The inputs are rollout.filter, the strategy's rollout.max_weight_staleness rule (within_max_weight_staleness), its
consumption filter (keep at collection, keep_buffered at a weight update) and its update-time action
(strategies.UpdateAction: abort by staleness `stale_after`, restart from the prompt). A dropped group is not trained
and its prompt is not dispatched again this epoch; a restored or requeued one goes to the restored lane, dispatched
first. Every drop is counted once, under DROP_METRICS[reason].

The step boundary's kind is one value, `Boundary` (boundary_kind: from rollout.partial, rollout.pause_mode and
whether a checkpoint follows). rollout.Rollout.pause asks PipelineServer.boundary_aborts(kind) once, aborts the
requests that kind aborts (keep: those of the abort list, Rollout._abort_groups; abort, checkpoint: every one; drain:
none), and hands what came back to PipelineServer.step_boundary(returned, kind), which carries out the recorded
decision.

The functions take the PipelineServer `srv` (its lock held by the caller) and read the buffer's objects by attribute:
this file imports the standard library and strategies.py only, and copies with buffer.py (docs/copy_a_piece.md).
Tests: tests/test_buffer.py, tests/test_strategies.py.
"""
from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import strategies

# the actions of a verdict
KEEP, RESTORE, RESTART, REQUEUE, DROP = "keep", "restore", "restart", "requeue", "drop"
# the places of the group asked about (the module docstring)
COLLECTED, BUFFERED, BEFORE_PAUSE = "collected", "buffered", "before_pause"
IN_FLIGHT, KEPT_IN_FLIGHT, CHECKPOINTED = "in_flight", "kept_in_flight", "checkpointed"
# why a group is dropped -> the one metric that counts it (groups). The reasons of COMPLETE_DROPS are decided at
# collection and at the weight update (counted per step); the other two at the step boundary (its metrics).
DROP_METRICS = {"filter": "rollout/filter_drop", "max_weight_staleness": "rollout/staleness_drop",
                "strategy": "rollout/policy_drop", "stale_after": "rollout/update_dropped_groups",
                "incomplete": "rollout/partial_dropped_incomplete_groups"}
COMPLETE_DROPS = ("filter", "max_weight_staleness", "strategy")  # why a complete group is dropped (view.dropped)
# the counters of one step (PipelineServer.counts, popped by step_metrics): the drops of COMPLETE_DROPS; trajectories
# that arrived for a group no longer in flight (dropped or restored at a step boundary, or duplicates: not a verdict);
# the group flow; response tokens thrown away by every drop, restart and failed trajectory taken out of its group;
# the `failed` filter's work: failed trajectories taken out of their groups at collection, the groups it dropped
# with fewer than rollout.min_group_size survivors (of rollout/filter_drop), groups handed to the trainer short
COUNTERS = (*(DROP_METRICS[r] for r in COMPLETE_DROPS), "rollout/late_drop", "rollout/dispatched_groups",
            "rollout/collected_groups", "rollout/consumed_groups", "rollout/discarded_tokens",
            "rollout/failed_removed_count", "rollout/min_group_size_drop", "rollout/trained_short_groups")


class Boundary(str, enum.Enum):
    """The kind of a step boundary: what the pause does with the requests in flight."""
    DRAIN = "drain"  # rollout.partial=false: the pause waits for everything in flight
    ABORT = "abort"  # rollout.pause_mode abort: every request aborted, its partial trajectories handed back
    KEEP = "keep"  # retract / in_place: the servers keep their requests, but those of the abort list are aborted
    CHECKPOINT = "checkpoint"  # retract / in_place before a checkpoint: every request aborted


KEEPING = (Boundary.KEEP, Boundary.CHECKPOINT)  # retract / in_place: the abort list is decided before the pause
# the place of the groups in flight at a boundary of each kind, and the metrics that boundary reports (zeros included)
BOUNDARY_PLACE = {Boundary.DRAIN: IN_FLIGHT, Boundary.ABORT: IN_FLIGHT, Boundary.KEEP: KEPT_IN_FLIGHT,
                  Boundary.CHECKPOINT: CHECKPOINTED}
BOUNDARY_METRICS = {
    IN_FLIGHT: ("rollout/partial_restored_count", "rollout/update_dropped_groups", "rollout/restarted_groups",
                "rollout/partial_dropped_incomplete_count", "rollout/partial_dropped_incomplete_groups",
                "rollout/restored_groups", "rollout/requeued_unstarted_groups"),
    KEPT_IN_FLIGHT: ("rollout/kept_in_flight_groups", "rollout/update_dropped_groups"),
    CHECKPOINTED: ("rollout/kept_in_flight_groups", "rollout/update_dropped_groups")}


def boundary_kind(partial: bool, pause_mode: str, checkpoint: bool = False) -> Boundary:
    """The Boundary of rollout.partial / rollout.pause_mode; `checkpoint`: a checkpoint follows the pause."""
    if not partial:
        return Boundary.DRAIN
    if pause_mode == "abort":
        return Boundary.ABORT
    return Boundary.CHECKPOINT if checkpoint else Boundary.KEEP


@dataclass(frozen=True)
class Verdict:
    """keep | restore (abort, continue from the partial trajectories) | restart (abort, generate from the prompt
    again) | requeue (nothing generated: dispatched again as it was) | drop, and why (a DROP_METRICS key for a
    drop; `detail` says more, e.g. the filter's sentence)."""
    action: str
    reason: str
    detail: str = ""


def decide(srv, place: str, group, view: Optional[strategies.PipelineView] = None,
           aborted: frozenset = frozenset()) -> Verdict:
    """What happens to one group (a buffer.Group) in `place`, and why, in this order of precedence:
      COLLECTED       filter -> within_max_weight_staleness -> strategy.keep(view) -> keep (of the group's
                      survivors, `trained`: the failed filter takes failed trajectories out)
      BUFFERED        within_max_weight_staleness -> strategy.keep_buffered(view) -> keep
      BEFORE_PAUSE    stale_after -> keep
      KEPT_IN_FLIGHT  on the abort list `aborted` (BEFORE_PAUSE's drops, recorded) -> keep
      CHECKPOINTED    on the abort list `aborted` -> restore (all N, or none started: as dispatched)
      IN_FLIGHT       stale_after -> restart (all N present, some aborted, the action restarts) -> restore (all
                      N present) -> requeue (none present) -> drop as incomplete
    The strategy's rules see the group with its per-token versions and start_version. In flight, group.trajectories
    are TrajQueue's slots (None where none arrived). stale_after (abort by staleness) counts against the next
    weights (srv.version + 1)."""
    trajs = group.trajectories
    if place in (COLLECTED, BUFFERED):
        if place == COLLECTED:
            reason = filter_reason(srv, trajs)
            if reason is not None:
                return Verdict(DROP, "filter", reason)
            group = dataclasses.replace(group, trajectories=trained(srv, trajs))
        if not srv.strategy.within_max_weight_staleness(group, view):
            return Verdict(DROP, "max_weight_staleness")
        keep = srv.strategy.keep if place == COLLECTED else srv.strategy.keep_buffered
        if not keep(group, view):  # the strategy's consumption filter
            return Verdict(DROP, "strategy")
        return Verdict(KEEP, "trainable")
    if place in (KEPT_IN_FLIGHT, CHECKPOINTED):
        if group.prompt_id in aborted:
            return Verdict(DROP, "stale_after")  # its requests were aborted before the pause
        return Verdict(KEEP, "kept in flight") if place == KEPT_IN_FLIGHT else Verdict(RESTORE, "partial")
    after = srv.action.stale_after
    if after is not None and srv.version + 1 - group.start_version > after:
        return Verdict(DROP, "stale_after")  # abort by staleness: too old under the next weights
    if place == BEFORE_PAUSE:
        return Verdict(KEEP, "kept in flight")
    present = [t for t in trajs if t is not None]
    if len(present) == srv.N and srv.action.restart and any(t.status == "aborted" for t in present):  # buffer.ABORTED
        return Verdict(RESTART, "the update action restarts from the prompt")
    if len(present) == srv.N:
        return Verdict(RESTORE, "partial")
    if not present:
        return Verdict(REQUEUE, "nothing generated")
    return Verdict(DROP, "incomplete", f"{len(present)} of {srv.N} trajectories")


def carry_out(srv, place: str, group, verdict: Verdict, view: Optional[strategies.PipelineView] = None) -> None:
    """Carry out one verdict of `decide` and count it. keep: a collected group goes into PipelineBuffer (its
    survivors, `trained`), a buffered or kept-in-flight one stays; restore / restart / requeue: out of flight into
    the restored lane (restart: without its partial trajectories; restore: with group.trajectories as its partial);
    drop: out of where it is. A collected group was taken out of flight by the collector. Counted: every drop once
    under DROP_METRICS[reason], its response tokens (and a restart's, and failed trajectories taken out) in
    rollout/discarded_tokens; a filter drop also in the waiting line's reasons and the run of drops that stops an
    untrainable run; the strategy hears each keep / keep_buffered answer once (strategies.Strategy.judged)."""
    pg, trajs, key = group.prompt, group.trajectories, group.prompt_id
    present = [t for t in trajs if t is not None]
    tokens = sum(int(t.response_ids.numel()) for t in present)
    boundary = srv.boundary_counts
    if place == COLLECTED:
        pg.partial = []  # the trajectories now live in the Group
        kept = trained(srv, trajs)
        srv.counts["rollout/failed_removed_count"] += len(trajs) - len(kept)
        if verdict.reason == "filter":
            srv.counts["rollout/min_group_size_drop"] += len(kept) < srv.min_group_size
            srv.waited["reasons"][verdict.detail] += 1
            d = srv.drop_run
            d["groups"] += 1
            d["reasons"][verdict.detail] += 1
            d["rewards"].update(round(t.reward, 4) for t in trajs if t.status != "failed")
            d["last"] = group
        else:
            srv.drop_run = new_drop_run()
        group = dataclasses.replace(group, trajectories=kept)
    if verdict.reason in ("strategy", "trainable"):
        srv.strategy.judged(group, view, verdict.action == KEEP)
    if place in (IN_FLIGHT, KEPT_IN_FLIGHT, CHECKPOINTED) and verdict.action != KEEP:
        srv.take_from_flight(key)
    if verdict.action == DROP:
        if place == BUFFERED:
            srv.pbuf.remove(key)
        counter = srv.counts if place in (COLLECTED, BUFFERED) else boundary
        counter[DROP_METRICS[verdict.reason]] += 1
        srv.counts["rollout/discarded_tokens"] += tokens
        if verdict.reason == "incomplete":
            boundary["rollout/partial_dropped_incomplete_count"] += len(present)
    elif verdict.action == KEEP:
        if place == COLLECTED:
            srv.pbuf.put(group)
            srv.counts["rollout/collected_groups"] += 1
            srv.counts["rollout/discarded_tokens"] += tokens - sum(int(t.response_ids.numel()) for t in kept)
        elif place == KEPT_IN_FLIGHT:
            boundary["rollout/kept_in_flight_groups"] += 1
    else:
        if verdict.action == RESTART:  # restart from the prompt: the partial tokens are thrown away
            srv.counts["rollout/discarded_tokens"] += tokens
            pg.partial = []
            pg.metadata.pop("dispatch_version", None)
            boundary["rollout/restarted_groups"] += 1
        elif verdict.action == RESTORE:
            pg.partial = trajs
            boundary["rollout/restored_groups"] += 1
            boundary["rollout/partial_restored_count"] += len(present)
        else:  # requeue: keeps the partial it was dispatched with, if any
            boundary["rollout/requeued_unstarted_groups"] += 1
        srv.data.restore([pg])


def trained(srv, trajs: list) -> list:
    """The trajectories of a collected group that it is trained on: with rollout.filter `failed`, those that did
    not fail (a tool error or timeout, a server error, a reward function that raised); otherwise all of them."""
    return [t for t in trajs if t.status != "failed"] if "failed" in srv.filters else trajs  # buffer.FAILED


def filter_reason(srv, trajs: list) -> Optional[str]:
    """Why rollout.filter drops this group, None if it lets it through: `failed` when fewer than
    rollout.min_group_size trajectories survive ("5 of 8 failed"), `all_equal_reward` when the survivors'
    rewards are all equal ("all 6 rewards 0.0": a failure does not make a group of equal rewards trainable)."""
    kept = trained(srv, trajs)
    if len(kept) < srv.min_group_size:
        return f"{len(trajs) - len(kept)} of {srv.N} failed"
    rewards = [t.reward for t in kept]
    if "all_equal_reward" in srv.filters and max(rewards) == min(rewards):
        return f"all {len(kept)} rewards {round(rewards[0], 4)}"
    return None


def new_drop_run() -> dict:
    """Counts (groups, reasons, trajectory rewards) and the last group of a run of filter drops: bounded."""
    return {"groups": 0, "reasons": Counter(), "rewards": Counter(), "last": None}
