"""rollout.py: the asynchronous producer that drives SGLang-compatible inference servers over HTTP.

- The HTTP client of the servers (`Fleet`, its blocking `SyncFleet`, FleetError, response parsing) is
  sglang_client.py; its names are also importable from here.
- `Rollout`: the producer of docs/design.md. On the SyncFleet's event-loop thread it
  asks the buffer for prompt groups (`buffer.dispatch`), generates N trajectories per group, scores them
  (scoring.py: inline, on threads, or in worker processes killed at rollout.reward_timeout_s; a reward that raises,
  times out or is not a finite number fails its trajectory, counted) and puts every finished trajectory to the
  buffer. The rollout function (`rollout.function`, rollout_fns.py) runs once per group: the built-in `single_turn`
  sends the group as one /generate list request (one item per trajectory; the reply lists them in order when all
  have finished; an abort by rid ends one item): one task, one HTTP call and one scoring pass per group;
  `multi_turn_tool` runs each trajectory on its own (RolloutContext.each), one request per turn.
  `pause()` stops dispatch and then, with rollout.partial=true, pauses every worker with `/pause_generation` in
  `rollout.pause_mode`, which also blocks new requests: abort stops everything in flight (the partial trajectories go
  to `buffer.step_boundary`), retract and in_place keep it on the paused servers (the groups stay in flight, except
  those `buffer.boundary_aborts()` names, which the strategy drops by staleness: aborted first, handed to
  step_boundary; before a checkpoint, `pause(checkpoint=True)`, they abort everything too, so that the checkpoint
  holds every partial trajectory, and the groups they would keep are restored whole); with partial=false it waits
  for everything in flight. in_place updates cannot flush the servers' prefix cache (requests still run), so there
  every /generate carries `extra_key` = its weight version, the cache's namespace. `resume(version)` continues the
  paused servers (so the weight update in between ran on paused servers: idle ones, or ones holding the kept
  requests) and restarts dispatch.
  Aborts by exact rid remain for single requests (`rollout.trajectory_timeout_s`, stop); they cannot stop a
  whole fleet reliably, since SGLang drops an abort that lands before its request reached the scheduler and ignores
  a repeat. A restored group continues from its partial responses (prompt + partial tokens as input, the remaining
  max_new_tokens); its finished trajectories are put back as they are. `rollout.trajectory_timeout_s` aborts a
  request that runs too long (its clock also runs while a kept request waits on a paused server) and marks its
  unfinished trajectories failed.
- The rollout process serves a Rollout over RPC (workers.serve_rollout); the trainer calls it through remote.Proxy.
- run_modes.generate_dataset runs a Rollout over a fixed list of prompts (workers.py generate, the evaluator).

Concurrency is counted in two consistent units. The strategy layer (the buffer) counts prompt groups, the HTTP layer
counts generating trajectories. With S = rollout.async_max_concurrent_samples, at most S // N groups are in flight
(the producer asks `buffer.dispatch` / `buffer.exchange` for at most its free slots, and a group stays in flight until
all of its N trajectories are put or returned), so at most N * (S // N) <= S trajectories generate at once (a rollout
function runs one request per trajectory at a time). S above the fleet's concurrency (the sum of the servers'
limits, or rollout.router_max_concurrent_requests) is clamped to it with a warning naming both numbers. A server's limit
is the one it enforces, `internal_states[i]["effective_max_running_requests_per_dp"]` of /server_info (times the DP size
over the entries), else the `--max-running-requests` flag it reports; when neither is known a warning says that S is not
clamped. Set S above the global batch B x N; otherwise the capacity C already bounds generation and S is redundant.
Unset, only the strategy's capacity C bounds the groups in flight.

Every /generate is a list request (one item per trajectory) with one string rid, f"{run_tag}-{epoch}-{seq}-{index}-
{attempt}." of its first trajectory (`attempt` counts every request of a trajectory: turns, retries, continuations);
SGLang names its items f"{rid}_{i}". The trailing dot keeps a request's rid from being a prefix of another's, since
SGLang aborts by prefix; within a request item 1 is a prefix of item 10, so the producer aborts a request's items
together. (The sglang router takes a batch only with one string rid and one sampling_params object.) Weight versions
are ints ("default", SGLang's until the first update, is 0); a response's `weight_versions` spans (end-exclusive) give
each token's version.

A rollout function is `async def fn(ctx, trajs) -> None` (rollout_fns.py: the interface, RolloutContext, the
built-ins). The producer runs each call as a unit (_Active: its requests, one timeout, one count in flight, one
scoring pass when it returns); RolloutContext.each hands a trajectory to a unit of its own (Rollout._hand_off).

Simplifications: one request per trajectory at a time (turns are sequential; `sampling_params.n` is never used, since
SGLang gives its samples random rids, which no abort could name); the response budget
rollout.sampling.max_new_tokens counts every response token, environment tokens included; a restored multi-turn
trajectory gets a fresh environment told its finished turns by env.restore(turns), without stepping them again (their
side effects happened once); a pause lets environment steps in progress finish; rewards see the decoded response
only.

Run (workers.py reads the config; this file does not import config.py):
    python workers.py generate --config configs/tiny.yaml rollout.servers=[http://127.0.0.1:31000] [--split eval]
    python workers.py rollout --config RESOLVED.yaml --rpc-init tcp://127.0.0.1:29500 --rank 2 --world-size 3
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import os
import time
import uuid
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

import checkpoint
import moe
import rollout_fns
import scoring
import staleness
from buffer import ABORTED, COMPLETED, FAILED, TRUNCATED, PromptGroup, Trajectory, validate_concurrency
from env_steps import EnvStepFailed, EnvSteps
from sglang_client import Fleet, FleetError, SyncFleet, parse_generate_response  # noqa: F401 (Fleet: re-exported)

log = logging.getLogger("rollout")

ABORT_GRACE_S = 10.0  # after a trajectory timeout, wait this long for the server to return the aborted request
DISPATCH_WAIT_S = 0.05  # buffer.dispatch waits up to this long for the strategy to allow a group (bounds pause delay)
PAUSE_GRACE_S = 2.0  # after /pause_generation returned, the aborted responses still on their way arrive within this
PAUSE_MARGIN_S = 60.0  # pause() and resume() end within rollout.pause_timeout_s + this (the buffer's part after it)
STATUS_OF_FINISH = {"stop": COMPLETED, "length": TRUNCATED, "abort": ABORTED}


# ---------------------------------------------------------------------------------------------------------------
# Rids

def make_rid(run_tag: str, epoch: int, seq: int, index: int, attempt: int) -> str:
    """The rid of one request: never a prefix of another rid, so aborting it by prefix aborts only it."""
    return f"{trajectory_rid_prefix(run_tag, epoch, seq, index)}{attempt}."


def trajectory_rid_prefix(run_tag: str, epoch: int, seq: int, index: int) -> str:
    """The prefix shared by every request of one trajectory (and of no other trajectory)."""
    return f"{run_tag}-{epoch}-{seq}-{index}-"


# ---------------------------------------------------------------------------------------------------------------
# The concurrency knob

def clamp_max_concurrent_samples(value: Optional[int], n: int, fleet_concurrency: Optional[int],
                                 tool_slots: int = 0) -> Optional[int]:
    """rollout.async_max_concurrent_samples after validation (ValueError: not > 0, or below N) and the clamp to the
    fleet's concurrency plus `tool_slots` (a warning naming the numbers, not an error: users want this value large).
    tool_slots: rollout.env_max_concurrent for a multi-turn function, whose trajectories in a tool step hold no
    server slot (so an agentic run can keep the fleet busy while that many episodes wait on their tools), else 0."""
    validate_concurrency(value, n)
    if value is None or fleet_concurrency is None or value <= fleet_concurrency + tool_slots:
        return value
    if fleet_concurrency < n:
        raise ValueError(f"the inference fleet's concurrency ({fleet_concurrency}, sum of max_running_requests or the "
                         f"router limit) is below data_source.num_trajectories_per_prompt ({n}), so no group could be "
                         "in flight; raise rollout.sglang_args.max_running_requests or add servers")
    tools = f" + rollout.env_max_concurrent {tool_slots}" if tool_slots else ""
    warnings.warn(f"rollout.async_max_concurrent_samples ({value}) exceeds the inference fleet's concurrency "
                  f"({fleet_concurrency}, sum of max_running_requests or the router limit){tools}; clamping it to "
                  f"{fleet_concurrency + tool_slots}", stacklevel=2)
    return fleet_concurrency + tool_slots


# ---------------------------------------------------------------------------------------------------------------
# Units: a rollout function's call for a group's trajectories, or one trajectory that RolloutContext.each runs

@dataclass
class _Active:
    """A live unit: the trajectories of one rollout-function call (a group's unfinished ones), or the one trajectory
    of an episode of RolloutContext.each. It holds the event that stops its requests (pause or timeout), the one that
    gives up their HTTP calls (`drop`: the servers are paused and they are not among their requests), whether it timed
    out, and the rids of its requests' items. Aborts name those exact rids: real SGLang drops an /abort_request whose
    rid is not a live request (its prefix matching happens only behind that check), so a prefix alone would abort
    nothing there."""
    prefix: str  # the rid prefix of its trajectories: the group's (a call) or the trajectory's (an episode)
    trajs: list  # the trajectories it finishes, scores and emits (each hands some to units of their own)
    stop: asyncio.Event
    drop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    timed_out: bool = False
    rids: dict = dataclasses.field(default_factory=dict)  # first trajectory index -> item rids of its request
    timer: Optional[asyncio.TimerHandle] = None  # the trajectory timeout, then the grace before cancelling
    deadline: float = 0.0  # the event loop's time of the timeout: the group's start + rollout.trajectory_timeout_s
    restored: set = dataclasses.field(default_factory=set)  # indices of its trajectories restored with tokens

    def item_rids(self) -> list[str]:
        """The rids to abort it by, all of its items: aborting item 1 by prefix also aborts items 10-19."""
        return [rid for rids in self.rids.values() for rid in rids]


async def _unless(event: asyncio.Event, coro) -> Any:
    """coro's result, or None once `event` is set first (coro is then cancelled: its HTTP connection closes)."""
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()  # done only once the loop has run it: until then neither cancelled() nor result()
    return task.result() if task.done() and not task.cancelled() else None


def _routes_start(trajs: list) -> int:
    """routed_experts_start_len of a request of trajs: the fewest positions any of them already has routes for."""
    return min(t.routed_experts.shape[0] for t in trajs)


# ---------------------------------------------------------------------------------------------------------------
# Metrics

def _new_stats() -> dict:
    return {"t0": time.monotonic(), "finished": 0, "scored": 0, "reward_sum": 0.0, "length_sum": 0,
            "length_max": 0, "truncated": 0, "failed": 0, "timeouts": 0, "generated_tokens": 0,
            "in_flight_max": 0, "in_flight_area": 0.0, "old_version_responses": 0,
            "aborts_without_routes": 0, "reward_errors": 0, "reward_timeouts": 0, "metadata_errors": 0}


# ---------------------------------------------------------------------------------------------------------------
# The producer

@dataclass
class _GroupRun:
    group: PromptGroup
    remaining: int  # trajectories not yet put to the buffer (or returned as partial)


class Rollout:
    """The producer: dispatch groups, run and score their trajectories, put them to the buffer (see module doc).

    `buffer` is a buffer.PipelineServer or its remote.Proxy (dispatch, put, exchange, step_boundary); `fleet` a
    Fleet or a SyncFleet (whose event-loop thread the producer runs on). Public methods are synchronous and
    thread-safe.
    """

    def __init__(self, cfg, buffer, fleet, tokenizer):
        r = cfg.rollout  # validated by config.validate (config.load_config)
        self.cfg, self.buffer, self.tokenizer = cfg, buffer, tokenizer
        self.sync = fleet if isinstance(fleet, SyncFleet) else SyncFleet(fleet)
        self.fleet = self.sync.fleet
        self.fn = rollout_fns.resolve_rollout_function(r.function)
        # every rollout function but single_turn may step tool environments (config.validate refuses rollout.env
        # with single_turn): their slots raise the concurrency bound, their metrics are reported
        self.tools = r.function != "single_turn"
        import tasks

        self.reward_names = [ds.reward or tasks.default_reward(ds.task) for ds in cfg.data_source]
        self.reward_fns = [tasks.get_reward_fn(name) for name in self.reward_names]
        self.sampling_params = {"temperature": r.sampling.temperature, "top_p": r.sampling.top_p,
                                "top_k": r.sampling.top_k, "min_p": r.sampling.min_p,
                                "stop_token_ids": tasks.stop_token_ids(tokenizer, cfg.model.path)}
        self.run_tag = uuid.uuid4().hex[:8]  # no "-": the tag, then "-", is a prefix of this Rollout's rids only
        self.n = cfg.N
        self.max_samples: Optional[int] = None  # effective async_max_concurrent_samples, set by start()
        self.max_groups: Optional[int] = None  # max_samples // N
        self.version: Optional[int] = None  # the last resume(version): the weights every server should now serve
        self._version_warned = False
        self.max_new_tokens = r.sampling.max_new_tokens
        self.context_len: Optional[int] = None  # the fleet's (Fleet.context_limits), read by start()
        self.max_input_len: Optional[int] = None  # prompt + response of a request must stay below it
        self.routes_shape: Optional[tuple] = None  # (layers, top-k) of meta_info.routed_experts (routing replay)
        if cfg.algorithm.routing_replay:
            with open(os.path.join(cfg.model.path, "config.json")) as f:
                hf = json.load(f)
            hf = hf.get("text_config", hf)
            self.routes_shape = (hf["num_hidden_layers"], hf["num_experts_per_tok"])
            # stored in the smallest integer that holds an expert id: a 20K-token Qwen3-30B-A3B trajectory's routes
            # (48 layers, top-8) are 7.7 MB as uint8, 31 MB as sglang's int32
            experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 1 << 15
            self.routes_dtype = torch.uint8 if experts <= 256 else torch.int16
        self.stats = _new_stats()
        self._groups: dict[tuple[int, int], _GroupRun] = {}
        self._active: dict[str, _Active] = {}
        self._outbox: list[Trajectory] = []
        self._partials: list[Trajectory] = []
        self._dispatching = False
        self._stopping = False  # pausing with rollout.partial=true: new and running trajectories stop
        self._aborting: set = set()  # groups the buffer drops at this update (buffer.boundary_aborts): they stop too
        self._servers_paused = False  # our /pause_generation holds the servers until resume() or stop()
        self._error: Optional[BaseException] = None
        self._tasks: set = set()
        self._started = False
        self._in_flight, self._in_flight_t = 0, time.monotonic()  # trajectories in live requests (self._active)
        self._retries_seen = self._down_seen = 0
        self.scorer = scoring.Scorer(r.reward_pool, r.reward_workers, r.reward_timeout_s, self.reward_fns)
        self._failure_logged: set = set()  # the kinds of reward failure (and "metadata") already logged, once each
        self._tracebacks_logged: set = set()  # (what failed, the file and line that raised): log_traceback's
        self.envs = EnvSteps(r, tokenizer)  # tool environment steps: slots, threads, counters, the observation cap

    # ---- public, synchronous ----
    def start(self) -> None:
        """Read the fleet's concurrency, clamp the knob, start dispatching. Idempotent."""
        if not self._started:
            self.sync.run(self._start(), self.cfg.rollout.startup_timeout_s, "Rollout.start")
            self._started = True

    def pause(self, checkpoint: bool = False) -> dict:
        """Stop dispatch; abort (partial=true, pause_mode abort), keep on the paused servers (retract, in_place) or
        wait for (partial=false) everything in flight; hand the aborted trajectories to buffer.step_boundary. Returns
        its cleanup metrics and timing/pause_delay. checkpoint=True (a checkpoint follows this pause): retract and
        in_place abort every request too, since a request kept on a server is in no checkpoint; the groups the
        strategy drops are those it would drop keeping them, the others go to the restored lane whole."""
        self._raise_error()
        out = self.sync.run(self._pause(checkpoint), self.cfg.rollout.pause_timeout_s + PAUSE_MARGIN_S,
                            "Rollout.pause")
        self._raise_error()
        return out

    def resume(self, version: int) -> None:
        """Dispatch again; `version` is the weight version the servers now serve (older responses are counted)."""
        self._raise_error()
        self.sync.run(self._resume(version), self.cfg.rollout.pause_timeout_s + PAUSE_MARGIN_S, "Rollout.resume")

    def step_metrics(self) -> dict:
        """rollout/... metrics of the trajectories finished since the last call (rates over the wall time since)."""
        self._raise_error()
        return self.sync.run(self._step_metrics(), 30.0, "Rollout.step_metrics")

    def stop(self) -> None:
        """Abort everything of ours in flight, stop the producer and the reward pool (the fleet stays open)."""
        if self.sync.loop.is_running():
            self.sync.run(self._stop(), 60.0, "Rollout.stop")
        self.scorer.close()
        self.envs.close()

    def log_traceback(self, what: str, site: str, tb: str) -> None:
        """The traceback of the first failure of `what` (the reward function, the tool environment, the rollout
        function) raised at `site` (file:line, scoring.raised), to this process's log: once for each distinct one."""
        if tb and (what, site) not in self._tracebacks_logged:
            self._tracebacks_logged.add((what, site))
            log.warning("the first failure of %s, raised at %s (its traceback; not logged again):\n%s", what,
                        site or "an unknown place", tb.rstrip())

    # ---- on the loop ----
    def _raise_error(self) -> None:
        if not self._started:
            raise RuntimeError("call Rollout.start() before pause(), resume() or step_metrics()")
        if self._error is not None:
            raise RuntimeError(f"the rollout producer failed: {self._error!r}") from self._error

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _start(self) -> None:
        tool_slots = self.cfg.rollout.env_max_concurrent if self.tools else 0
        self.max_samples = clamp_max_concurrent_samples(self.cfg.rollout.async_max_concurrent_samples, self.n,
                                                        await self.fleet.concurrency(), tool_slots)
        self.max_groups = None if self.max_samples is None else self.max_samples // self.n
        self.context_len, self.max_input_len = await self.fleet.context_limits()
        if self.max_samples is not None:  # the buffer enforces (and reports) the clamped cap, not the configured one
            await asyncio.to_thread(self.buffer.set_max_concurrent_samples, self.max_samples)
        self._wake, self._idle, self._outbox_ready = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._dispatch_lock = asyncio.Lock()
        self._dispatching = True
        self._spawn(self._guard(self._produce()))
        self._spawn(self._guard(self._flush()))

    async def _guard(self, coro) -> None:
        """Run a background loop; record its failure so that every public call raises it."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.exception("rollout producer failed")
            self._error = e
            self._dispatching = False
            self._idle.set()  # a pause waiting for in-flight work returns now and raises the error

    async def _produce(self) -> None:
        while True:
            if not self._dispatching:
                await self._wake.wait()
                self._wake.clear()
                continue
            free = None if self.max_groups is None else self.max_groups - len(self._groups)
            if free == 0:  # our concurrency bound: wait for a group to be put (or for a pause)
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._dispatch_lock:  # a pause waits for a dispatch in progress to be launched
                # The buffer waits (up to DISPATCH_WAIT_S) until its strategy allows a group: it learns of the
                # trainer's consumption, we do not. (Counted again: _flush may have dispatched meanwhile.)
                free = None if self.max_groups is None else self.max_groups - len(self._groups)
                for g in await asyncio.to_thread(self.buffer.dispatch, free, DISPATCH_WAIT_S) if free != 0 else []:
                    self._launch(g)

    def _launch(self, g: PromptGroup) -> None:
        key = g.prompt_id
        if key in self._groups:
            raise RuntimeError(f"buffer.dispatch returned group (epoch, seq)={key} which is still in flight")
        if g.partial and len(g.partial) != self.n:
            raise ValueError(f"restored group {key} has {len(g.partial)} partial trajectories, expected N={self.n}")
        self._groups[key] = _GroupRun(g, self.n)
        self._idle.clear()
        # A restored trajectory is copied (tensors are only ever replaced, metadata is deep-copied), so that an
        # in-process buffer's restored lane never sees it change.
        trajs = [dataclasses.replace(t, metadata=copy.deepcopy(t.metadata)) for t in g.partial] if g.partial else \
            [Trajectory(g.epoch, g.seq, i, g.prompt_ids, status=ABORTED) for i in range(self.n)]
        for traj in trajs:
            if traj.status != ABORTED:  # finished before the pause that restored its group: returned as it is
                self._emit(traj)
        todo = [t for t in trajs if t.status == ABORTED]
        if todo:  # the rollout function's call for the group
            self._spawn(self._run(g, todo))

    def old_version_response(self, version: int) -> None:
        """A server answered with weights older than those of resume(version) before the request was sent: it missed
        a weight update (e.g. it restarted with its initial weights). The tokens keep their true version; this is
        counted and warned about once."""
        self.stats["old_version_responses"] += 1
        if not self._version_warned:
            self._version_warned = True
            log.warning("a server generated with weight version %d after resume(%d): it missed a weight update; "
                        "counted in rollout/old_version_responses", version, self.version)

    def _rid(self, active: _Active, trajs: list) -> str:
        """The rid of the next request of trajs (one more attempt each): make_rid of its first trajectory. SGLang
        names the items of a list request f"{rid}_{i}"; those are remembered for aborts."""
        for traj in trajs:
            traj.metadata["attempts"] = traj.metadata.get("attempts", 0) + 1
        t = trajs[0]
        rid = make_rid(self.run_tag, t.epoch, t.seq, t.index, t.metadata["attempts"] - 1)
        active.rids[t.index] = [f"{rid}_{i}" for i in range(len(trajs))]
        return rid

    def _count_in_flight(self, delta: int) -> None:
        now = time.monotonic()
        self.stats["in_flight_area"] += self._in_flight * (now - self._in_flight_t)
        self._in_flight_t, self._in_flight = now, self._in_flight + delta
        self.stats["in_flight_max"] = max(self.stats["in_flight_max"], self._in_flight)

    async def _generate(self, active: _Active, trajs: list) -> list[str]:
        """One model turn of each of trajs, from prompt + response so far within the remaining budget, as /generate
        list requests: one per remaining budget (one for a new group), since the sglang router takes one
        `sampling_params` and one string `rid` for a whole batch. The reply lists the items in input order once all
        have finished. Appends each item's new tokens (loss mask 1) with their log-probs and versions, sets its
        status from the finish reason and returns the finish types (stop | length | abort). An item the server
        aborted without our asking is sent again, up to rollout.max_retries times."""
        finish, retried, todo = ["abort"] * len(trajs), [0] * len(trajs), list(range(len(trajs)))
        while todo:
            by_budget: dict[int, list[int]] = {}
            for i in todo:
                budget = self.max_new_tokens - trajs[i].response_ids.numel()
                # capped at the context: prompt + max_new_tokens above it is a 400 for the whole list request
                total = trajs[i].prompt_ids.numel() + trajs[i].response_ids.numel()
                if self.context_len is not None:
                    budget = min(budget, self.context_len - total)
                if budget <= 0 or (self.max_input_len is not None and total >= self.max_input_len):
                    trajs[i].status, finish[i] = TRUNCATED, "length"
                else:
                    by_budget.setdefault(budget, []).append(i)
            sent_version = self.version  # a request kept across an in-place update may end with the older weights
            outs = await asyncio.gather(*[self._request(active, [trajs[i] for i in idx], budget)
                                          for budget, idx in by_budget.items()])
            todo = []
            for idx, out in zip(by_budget.values(), outs):
                # the routed_experts_start_len this request was sent with, taken before any item's routes grow
                start = _routes_start([trajs[j] for j in idx]) if self.routes_shape else 0
                for i, item in zip(idx, out or [None] * len(idx)):
                    t = trajs[i]
                    if item is None:  # stopped before a server took it, or dropped while the servers are paused
                        t.status = ABORTED
                        continue
                    gen = parse_generate_response(item)
                    rollout_fns.extend(t, gen.ids, gen.log_probs, gen.versions, 1)
                    if self.routes_shape and gen.ids:
                        self._extend_routes(t, item, start)
                    self.stats["generated_tokens"] += len(gen.ids)
                    if gen.versions and sent_version is not None and gen.versions[-1] < sent_version:
                        self.old_version_response(gen.versions[-1])
                    t.metadata["finish_reason"], finish[i] = gen.finish_reason, gen.finish
                    code = gen.finish_reason.get("status_code") if isinstance(gen.finish_reason, dict) else None
                    if gen.finish == "abort" and not active.stop.is_set() and not (code and code < 500):
                        if retried[i] < self.cfg.rollout.max_retries:  # not ours: continue it
                            retried[i] += 1
                            todo.append(i)
                            continue
                        t.status = FAILED
                        t.metadata["error"] = f"the server aborted the request: {gen.finish_reason}"
                    else:
                        t.status = STATUS_OF_FINISH[gen.finish]
        return finish

    async def _request(self, active: _Active, trajs: list, budget: int) -> Optional[list]:
        """One /generate list request of trajs with max_new_tokens=budget: the reply's items, or None when it was
        stopped or dropped first."""
        payload = {"input_ids": [t.prompt_ids.tolist() + t.response_ids.tolist() for t in trajs],
                   "return_logprob": True, "sampling_params": {**self.sampling_params, "max_new_tokens": budget}}
        if self.routes_shape:  # one start for the list (sglang's field is per request): the least any item has
            payload["return_routed_experts"], payload["routed_experts_start_len"] = True, _routes_start(trajs)
        if not self.cfg.flush_on_update:  # the prefix cache outlives updates (in_place): one namespace per version
            payload["extra_key"] = f"weights-{self.version if self.version is not None else 'initial'}"
        out = await _unless(active.drop, self.fleet.generate(payload, lambda: self._rid(active, trajs), active.stop))
        if out is not None and (not isinstance(out, list) or len(out) != len(trajs)):
            raise ValueError(f"/generate answered a list request of {len(trajs)} items with "
                             f"{len(out) if isinstance(out, list) else type(out).__name__}")
        return out

    def _extend_routes(self, t: Trajectory, item: dict, start: int) -> None:
        """Append the routes of the positions t had none for yet (a restored trajectory keeps its own, from the
        weights that generated its tokens) from a response's meta_info.routed_experts, which covers positions
        [start, prompt + response - 1): every token but the last went through the server's forward.
        An aborted response may carry none: sglang 0.5.23 collects routes only when a running request finishes
        (batch_result_processor._maybe_collect_routed_experts), and the abort of a queued one, a retracted one
        too, answers without them (tokenizer_manager._handle_abort_req). Its tokens are kept without routes; the
        next request of the trajectory asks from the fewest positions any has (_routes_start), which fills the gap."""
        meta = item.get("meta_info") or {}
        text = meta.get("routed_experts")
        if text is None and (meta.get("finish_reason") or {}).get("type") == "abort":
            self.stats["aborts_without_routes"] += 1
            return
        if text is None:
            raise ValueError("algorithm.routing_replay=true but the server returned no meta_info.routed_experts; "
                             "launch it with --enable-return-routed-experts (launched servers get it)")
        rows = moe.decode(text, *self.routes_shape).to(self.routes_dtype)
        have, end = t.routed_experts.shape[0], t.num_tokens - 1
        if rows.shape[0] != end - start:
            raise ValueError(f"meta_info.routed_experts has {rows.shape[0]} rows, expected {end - start} (positions "
                             f"{start} to {end} of prompt + response)")
        t.routed_experts = torch.cat([t.routed_experts, rows[have - start:]]) if have else rows

    async def _run(self, g: PromptGroup, trajs: list, parent: Optional[_Active] = None,
                   episode: Optional[Callable] = None) -> None:
        """One unit (_Active): the rollout function's call for trajs, the group's unfinished trajectories, or (parent:
        the call's unit, which handed it over in _hand_off) `episode` for the one trajectory of trajs, in the call's
        count in flight and within its timeout. Then each trajectory the unit still holds is finished (_finish)."""
        loop = asyncio.get_running_loop()
        if parent is None:
            prefix = f"{self.run_tag}-{g.epoch}-{g.seq}-"
            active = _Active(prefix, list(trajs), asyncio.Event(),
                             deadline=loop.time() + self.cfg.rollout.trajectory_timeout_s,
                             restored={t.index for t in trajs if t.response_ids.numel()})  # (len(tensor): ~3 us)
            self._count_in_flight(len(trajs))
        else:
            t0 = trajs[0]
            prefix = trajectory_rid_prefix(self.run_tag, t0.epoch, t0.seq, t0.index)
            active = _Active(prefix, [t0], asyncio.Event(), deadline=parent.deadline,
                             restored=parent.restored & {t0.index})
            if parent.drop.is_set():
                active.drop.set()
        if self._stopping or (parent is not None and parent.stop.is_set()):
            active.stop.set()
        self._active[prefix] = active
        ctx = rollout_fns.RolloutContext(self, g, active, None if parent is None else trajs[0].index)
        task = self._spawn(self.fn(ctx, trajs) if parent is None else episode(ctx, trajs[0]))
        active.timer = loop.call_at(active.deadline, self._on_timeout, active, task)
        try:
            await asyncio.wait({task})
        finally:
            active.timer.cancel()
            self._count_in_flight(-len(active.trajs))
            if self._active.get(prefix) is active:  # (a call whose episodes ended may follow its group's relaunch)
                del self._active[prefix]
        await self._finish(g, active, task)

    def _hand_off(self, parent: _Active, g: PromptGroup, traj: Trajectory, episode: Callable) -> asyncio.Task:
        """RolloutContext.each: traj leaves its call's unit `parent` for a unit of its own that runs `episode`."""
        if not any(t is traj for t in parent.trajs):
            raise ValueError(f"RolloutContext.each: trajectory {traj.prompt_id + (traj.index,)} is not one of this "
                             "call's (each trajectory runs once, in the call it was given to)")
        parent.trajs = [t for t in parent.trajs if t is not traj]
        return self._spawn(self._run(g, [traj], parent, episode))

    async def _finish(self, g: PromptGroup, active: _Active, task: asyncio.Task) -> None:
        """After a unit's task ended: each trajectory it holds gets its final status (a timeout, an error or an
        unfinished trajectory fails it; a rollout function that raised: its error names the file and line, the first
        traceback of each is logged), versions and restore count; aborted ones (a pause) go to step_boundary,
        the others are scored in one pass and emitted."""
        error = None if task.cancelled() else task.exception()
        if error is not None and not isinstance(error, EnvStepFailed):  # (those are logged once per kind)
            why, site, tb = scoring.raised(error)
            error_text = f"the rollout function {self.cfg.rollout.function} {why}"
            log.warning("trajectories %s failed: %s", active.prefix, error_text)
            self.log_traceback(f"the rollout function {self.cfg.rollout.function}", site, tb)
        if not active.trajs:  # each handed every trajectory to a unit of its own
            return
        scored = []
        for traj in active.trajs:
            if active.timed_out and (task.cancelled() or traj.status == ABORTED):
                traj.status = FAILED
                traj.metadata["error"] = (f"rollout.trajectory_timeout_s={self.cfg.rollout.trajectory_timeout_s} s "
                                          "exceeded; the request was aborted")
                self.stats["timeouts"] += 1
            elif isinstance(error, EnvStepFailed):
                traj.status = FAILED  # env_step wrote the reason (a call's other trajectories get the error)
                traj.metadata.setdefault("error", repr(error))
            elif error is not None:
                traj.status = FAILED
                traj.metadata["error"] = error_text
            elif traj.status == ABORTED and not (self._stopping or g.prompt_id in self._aborting):
                traj.status = FAILED
                traj.metadata["error"] = "the rollout function returned an unfinished trajectory"
            problem = checkpoint.unloadable(traj.metadata, "metadata")
            if problem is not None:  # every checkpoint holding it would fail: refused here, named and counted
                self._unloadable_metadata(traj, problem)
            if traj.response_ids.numel():
                traj.start_version, traj.end_version = traj.versions[[0, -1]].tolist()
            if traj.index in active.restored:
                traj.metadata["restored"] = traj.metadata.get("restored", 0) + 1
            if traj.status == ABORTED:  # pausing with rollout.partial=true: to buffer.step_boundary
                self._partials.append(traj)
                self._done(g.prompt_id)
                continue
            if traj.status in (COMPLETED, TRUNCATED):
                scored.append(traj)
        await self._score(g, scored)
        for traj in active.trajs:
            if traj.status != ABORTED:
                self._emit(traj)

    def _unloadable_metadata(self, traj: Trajectory, problem: str) -> None:
        """The rollout function left in traj.metadata what a checkpoint cannot hold (checkpoint.unloadable: a numpy
        scalar, a datetime, a frozenset...): the trajectory fails without those entries, counted in
        rollout/metadata_error_count, the first logged."""
        traj.metadata = {k: v for k, v in traj.metadata.items() if checkpoint.unloadable((k, v), "") is None}
        traj.status = FAILED
        traj.metadata["error"] = (f"rollout.function {self.cfg.rollout.function}: the trajectory's {problem}; a "
                                  "checkpoint holding it would not load")
        self.stats["metadata_errors"] += 1
        if "metadata" not in self._failure_logged:
            self._failure_logged.add("metadata")
            log.warning("first trajectory metadata a checkpoint cannot hold (counted in rollout/metadata_error_count,"
                        " not logged again): trajectory %s: %s; it failed, the run goes on",
                        traj.prompt_id + (traj.index,), traj.metadata["error"])

    def _on_timeout(self, active: _Active, task: asyncio.Task) -> None:
        active.timed_out = True
        active.stop.set()
        # If the server does not return the abort either, the rollout function is cancelled ABORT_GRACE_S later.
        active.timer = asyncio.get_running_loop().call_later(ABORT_GRACE_S, task.cancel)
        for rid in active.item_rids():
            self._spawn(self.fleet.abort(rid))

    async def _score(self, g: PromptGroup, trajs: list) -> None:
        """Rewards of trajs (one batch_decode) through the Scorer (rollout.reward_pool). A reward function that
        raises, times out, or returns anything but a finite real number fails its trajectory: the reason, naming
        the function and the value (or the file and line that raised), in metadata["error"], counted, the first of
        each kind logged, and the first traceback of each distinct failure (log_traceback)."""
        name = self.reward_names[g.source]
        texts = self.tokenizer.batch_decode([t.response_ids.tolist() for t in trajs], skip_special_tokens=True)
        args = [(text, g.label, t.status == COMPLETED) for text, t in zip(texts, trajs)]
        for traj, (reward, failure) in zip(trajs, await self.scorer.score(self.reward_fns[g.source], args)):
            if failure is None:
                traj.reward = reward
                continue
            kind, why, site, tb = failure
            traj.status, traj.metadata["error"] = FAILED, f"the reward function {name} {why}"
            self.stats["reward_timeouts" if kind == "timeout" else "reward_errors"] += 1
            if kind not in self._failure_logged:
                self._failure_logged.add(kind)
                log.warning("first reward %s (counted in rollout/reward_%s_count, not logged again): trajectory %s: "
                            "%s; it failed, the run goes on", kind, kind, traj.prompt_id + (traj.index,),
                            traj.metadata["error"])
            self.log_traceback(f"the reward function {name}", site, tb)

    def _emit(self, traj: Trajectory) -> None:
        s = self.stats
        s["finished"] += 1
        s["failed"] += traj.status == FAILED
        s["truncated"] += traj.status == TRUNCATED
        if traj.status in (COMPLETED, TRUNCATED):
            s["scored"] += 1
            s["reward_sum"] += traj.reward
            n = traj.response_ids.numel()
            s["length_sum"] += n
            s["length_max"] = max(s["length_max"], n)
        self._outbox.append(traj)
        self._outbox_ready.set()

    async def _flush(self) -> None:
        """Put finished trajectories to the buffer, batched: one call carries whatever finished meanwhile, and asks
        for as many new groups as the groups it completes free (buffer.exchange: one round trip per batch)."""
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            batch, self._outbox = self._outbox, []
            if not batch:
                continue
            free = 0  # the slots this batch frees (None: unbounded), unless a dispatch is under way
            if self._dispatching and not self._dispatch_lock.locked():
                ending = Counter(t.prompt_id for t in batch)
                free = None if self.max_groups is None else self.max_groups - len(self._groups) + sum(
                    self._groups[k].remaining == c for k, c in ending.items())
            if free == 0:  # (the producer's own dispatch, waiting in the buffer, is woken by this put)
                await asyncio.to_thread(self.buffer.put, batch)
            else:
                async with self._dispatch_lock:  # a pause waits for the groups dispatched here to be launched
                    for g in await asyncio.to_thread(self.buffer.exchange, batch, free):
                        self._launch(g)
            for traj in batch:
                self._done(traj.prompt_id)

    def _done(self, key: tuple[int, int]) -> None:
        run = self._groups[key]
        run.remaining -= 1
        if run.remaining == 0:
            del self._groups[key]
            self._wake.set()
            if not self._groups:
                self._idle.set()

    async def _pause(self, checkpoint: bool = False) -> dict:
        t0 = time.monotonic()
        self._dispatching = False
        r = self.cfg.rollout
        deadline = t0 + r.pause_timeout_s
        async with self._dispatch_lock:  # groups being dispatched right now are launched (and counted) first
            pass
        kind = staleness.boundary_kind(r.partial, r.pause_mode, checkpoint)
        aborts = await asyncio.to_thread(self.buffer.boundary_aborts, kind)  # the buffer decides them, once
        if kind == staleness.Boundary.KEEP:
            # The servers keep every request (in_place: with its KV cache; retract: recomputed after continue) but
            # those of `aborts`; the weight update runs on the paused servers and resume() continues them. Nothing
            # else is aborted, restored or re-sent: the groups stay in flight (requests not yet at a server wait at
            # its pause gate).
            self._servers_paused = True
            partials = await self._abort_groups(aborts, deadline)
            await self._pause_servers(r.pause_mode, deadline)
            metrics = dict(await asyncio.to_thread(self.buffer.step_boundary, partials, kind) or {})
            metrics["rollout/partial_kept_count"] = self._in_flight
            metrics["timing/pause_delay"] = time.monotonic() - t0
            return metrics
        # abort, checkpoint: every request aborted (the buffer drops the checkpoint's `aborts`); drain: all waited for
        if kind != staleness.Boundary.DRAIN:
            self._stopping = True
            for active in self._active.values():
                active.stop.set()
            # The servers block new requests and abort all of theirs (repeatedly, until none holds the lock), so
            # every request they registered comes back with its partial output; aborts by rid could miss some.
            self._servers_paused = True
            await self._pause_servers("abort", deadline)
            try:
                await asyncio.wait_for(self._idle.wait(), PAUSE_GRACE_S)
            except asyncio.TimeoutError:  # what is still out waits at a server's pause gate and generated nothing
                for active in self._active.values():
                    active.drop.set()
                await self._wait_idle(max(0.0, deadline - time.monotonic()), deadline)
        else:
            await self._wait_idle(max(0.0, deadline - time.monotonic()), deadline)
        for url, (n, error) in self.fleet.take_abort_failures().items():  # one line per server, not one per abort
            log.warning("%d aborts to %s failed since the last pause (retried with backoff); last error: %s",
                        n, url, error)
        partials, self._partials = self._partials, []
        self._stopping = False
        metrics = dict(await asyncio.to_thread(self.buffer.step_boundary, partials, kind) or {})
        metrics["rollout/partial_aborted_count"] = len(partials)
        metrics["timing/pause_delay"] = time.monotonic() - t0
        return metrics

    async def _pause_servers(self, mode: str, deadline: float) -> None:
        """/pause_generation on every server, within what is left of the pause (a server that does not answer fails
        the pause naming itself, the endpoint and rollout.pause_timeout_s)."""
        await self.fleet.pause(mode, max(1.0, deadline - time.monotonic()),
                               f"the rest of rollout.pause_timeout_s={self.cfg.rollout.pause_timeout_s:g} s")

    async def _abort_groups(self, keys: list, deadline: float) -> list:
        """The strategy's abort by staleness before an in-place / retract pause: abort every request of the groups
        `keys` (buffer.boundary_aborts), wait for their trajectories and return the aborted ones (the buffer drops
        these groups in step_boundary; trajectories that finished meanwhile were put and are dropped with them)."""
        self._aborting = {tuple(k) for k in keys} & set(self._groups)
        try:
            prefixes = tuple(f"{self.run_tag}-{e}-{s}-" for e, s in self._aborting)
            for active in [a for a in self._active.values() if a.prefix.startswith(prefixes)] if prefixes else []:
                active.stop.set()
                for rid in active.item_rids():
                    self._spawn(self.fleet.abort(rid))
            while self._aborting & set(self._groups):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"pause: the groups aborted by staleness {sorted(self._aborting)} did not come "
                                       f"back within rollout.pause_timeout_s={self.cfg.rollout.pause_timeout_s} s")
                await asyncio.sleep(0.01)
            partials = [t for t in self._partials if t.prompt_id in self._aborting]
            self._partials = [t for t in self._partials if t.prompt_id not in self._aborting]
            return partials
        finally:
            self._aborting = set()

    async def _wait_idle(self, wait_s: float, deadline: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), wait_s)
        except asyncio.TimeoutError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"pause did not finish within rollout.pause_timeout_s={self.cfg.rollout.pause_timeout_s} s: "
                    f"{self._in_flight} trajectories still generating ({', '.join(list(self._active)[:5])}), "
                    f"{len(self._groups)} groups not yet put to the buffer") from None

    async def _resume(self, version: int) -> None:
        if self._servers_paused:  # after the weight update, which ran on the paused (idle) servers
            t = self.cfg.rollout.pause_timeout_s
            await self.fleet.continue_(t, f"rollout.pause_timeout_s={t:g} s")
            self._servers_paused = False
        self.version, self._version_warned = version, False
        self._dispatching = self._error is None
        self._wake.set()

    async def _step_metrics(self) -> dict:
        self._count_in_flight(0)
        s, self.stats = self.stats, _new_stats()
        elapsed = max(1e-9, time.monotonic() - s["t0"])
        scored = max(1, s["scored"])
        out = {
            "rollout/reward_mean": s["reward_sum"] / scored,
            "rollout/response_length_mean": s["length_sum"] / scored,
            "rollout/response_length_max": s["length_max"],
            "rollout/truncation_ratio": s["truncated"] / scored,
            "rollout/trajectories_finished": s["finished"],
            "rollout/failed_count": s["failed"],
            "rollout/timeout_count": s["timeouts"],
            "rollout/reward_error_count": s["reward_errors"],
            "rollout/reward_timeout_count": s["reward_timeouts"],
            "rollout/metadata_error_count": s["metadata_errors"],
            "rollout/retry_count": self.fleet.retries - self._retries_seen,
            "rollout/server_down_count": self.fleet.down_events - self._down_seen,
            "rollout/in_flight_trajectories_max": s["in_flight_max"],
            "rollout/in_flight_trajectories_mean": s["in_flight_area"] / elapsed,
            "rollout/generated_tokens_per_s": s["generated_tokens"] / elapsed,
            "rollout/old_version_responses": s["old_version_responses"],
            "rollout/aborts_without_routes": s["aborts_without_routes"],
        }
        self._retries_seen, self._down_seen = self.fleet.retries, self.fleet.down_events
        if self.tools:  # tool environments: steps, the wait for a slot, failures
            out.update(self.envs.metrics())
        if self.max_samples is not None:
            out["rollout/max_concurrent_samples"] = self.max_samples
        return out

    async def _abort_active(self) -> None:
        """Abort every live request of this producer, each by its exact rid on every worker."""
        await asyncio.gather(*[self.fleet.abort(rid) for a in list(self._active.values()) for rid in a.item_rids()])

    async def _stop(self) -> None:
        self._dispatching = False
        if self._active:
            await self._abort_active()
        # Calls given up close their connections, which aborts a request kept by a pause before the servers
        # continue; one still waiting at a server's pause gate is dispatched at continue and runs until SGLang
        # notices the disconnect (at its first output, an unstreamed request's 50th token, or after
        # SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s), which no client call can shorten.
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._servers_paused:  # leave no server paused behind us
            try:
                await self.fleet.continue_(30.0, "Rollout.stop's own 30 s")
                self._servers_paused = False
            except FleetError as e:
                log.warning("continuing the paused servers at stop failed: %s", e)


def rpc_waits(cfg) -> dict:
    """remote.Proxy's `waits` for the rollout process: pause() and resume() take up to rollout.pause_timeout_s +
    PAUSE_MARGIN_S there, so the trainer's RPC waits that much past buffer.rpc_timeout_s, and their own error (the
    server, the endpoint, the setting) reaches it first."""
    bound = (cfg.rollout.pause_timeout_s + PAUSE_MARGIN_S,
             f"rollout.pause_timeout_s={cfg.rollout.pause_timeout_s:g} s + {PAUSE_MARGIN_S:g} s")
    return {"pause": bound, "resume": bound}


# The rollout process is served by workers.serve_rollout (remote.serve_object), its client is remote.Proxy.
