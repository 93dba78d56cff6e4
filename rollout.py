"""rollout.py: the asynchronous producer that drives SGLang-compatible inference servers over HTTP.

- The HTTP client of the servers (`Fleet`, its blocking `SyncFleet`, FleetError, response parsing) is
  sglang_client.py; its names are also importable from here.
- `Rollout`: the producer of docs/design.md. On the SyncFleet's event-loop thread it
  asks the buffer for prompt groups (`buffer.dispatch`), generates N trajectories per group, scores them
  (scoring.py: inline, on threads, or in worker processes killed at rollout.reward_timeout_s; a reward that raises,
  times out or is not a finite number fails its trajectory, counted) and puts every finished trajectory to the
  buffer. With the built-in `single_turn` a group
  is one /generate list request (one item per trajectory; the reply lists them in order when all have finished; an
  abort by rid ends one item): one task, one HTTP call and one scoring pass per group.
  Other rollout functions (`rollout.function`) run one request per trajectory.
  `pause()` stops dispatch and then, with rollout.partial=true, pauses every worker with `/pause_generation` in
  `rollout.pause_mode`, which also blocks new requests: abort stops everything in flight (the partial trajectories go
  to `buffer.step_boundary`), retract and in_place keep it on the paused servers (the groups stay in flight, except
  those `buffer.update_aborts()` names, which the strategy drops by staleness: aborted first, handed to
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
- `generate_dataset`: generate and score a dataset against running servers, without training (workers.py generate).

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

A rollout function is `async def fn(ctx: RolloutContext, traj: Trajectory) -> None`: it extends `traj` with
`await ctx.generate(traj)` (one model turn; sets traj.status from the finish reason) and `ctx.append_env(traj, text)`
(environment tokens, loss mask 0); a tool environment is `ctx.make_env()` (tasks.make_env), stepped with
`await ctx.env_step(env, traj, text)`: at most rollout.env_max_concurrent steps at once (a sync step on as many
threads, off the event loop), each within rollout.env_step_timeout_s; a step that raises or times out is run again up
to rollout.env_retries times (default 0), then fails its trajectory (counted, the first of each kind logged; the
buffer trains its group on the survivors, rollout.min_group_size), and rollout.env_fail_stop_steps failures in a row
stop the run (a trajectory's metadata["stop"], which the buffer hands to the trainer); an observation is capped at
rollout.env_max_obs_tokens before it is recorded or tokenized in full (env_steps.py). Built in: `single_turn`,
`multi_turn_tool`. Or rollout.function=module:function. docs/agents.md.

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
import inspect
import json
import logging
import os
import threading
import time
import uuid
import warnings
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy
import torch

import checkpoint
import losses
import moe
import scoring
from buffer import ABORTED, COMPLETED, FAILED, TRUNCATED, Exchange, PromptGroup, Trajectory, validate_concurrency
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
# Rollout functions

@dataclass
class _Active:
    """A live request: one turn of one trajectory, or the unfinished trajectories of a group in one list request.
    It holds the event that stops it (pause or timeout), the one that gives up its HTTP call (`drop`: the servers
    are paused and it is not among their requests), whether it timed out, and the rids of its items. Aborts name
    those exact rids: real SGLang drops an /abort_request whose rid is not a live request (its prefix matching
    happens only behind that check), so a prefix alone would abort nothing there."""
    prefix: str  # the rid prefix of its trajectories: the group's (list request) or the trajectory's
    size: int  # trajectories it generates
    stop: asyncio.Event
    drop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    timed_out: bool = False
    rids: dict = dataclasses.field(default_factory=dict)  # first trajectory index -> item rids of its request
    timer: Optional[asyncio.TimerHandle] = None  # the trajectory timeout, then the grace before cancelling

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


def _extend(traj: Trajectory, ids: list[int], log_probs: list[float], versions: list[int], mask: int) -> None:
    """Append tokens. Each field is rebuilt from one list through numpy: the producer's hot path, where
    torch.tensor(list) costs ~3x as much (5.3 against 1.5 us for 6 ids)."""
    def grow(old: torch.Tensor, new: list, dtype) -> torch.Tensor:
        return torch.from_numpy(numpy.array(old.tolist() + new if old.numel() else new, dtype=dtype))

    traj.loss_mask = grow(traj.loss_mask, [mask] * len(ids), numpy.int64)
    traj.response_ids = grow(traj.response_ids, ids, numpy.int64)
    traj.rollout_log_probs = grow(traj.rollout_log_probs, log_probs, numpy.float32)
    traj.versions = grow(traj.versions, versions, numpy.int64)


class RolloutContext:
    """What a rollout function may use for one trajectory: generate a turn, append environment tokens, decode."""

    def __init__(self, rollout: "Rollout", group: PromptGroup, active: _Active, index: int = 0):
        self.rollout, self.group, self._active = rollout, group, active
        self.index = index  # the trajectory's position in its group: a rollout function runs one trajectory
        self.cfg, self.tokenizer = rollout.cfg, rollout.tokenizer
        self.task = rollout.cfg.data_sources[group.source].task
        self.max_new_tokens = rollout.max_new_tokens
        self._obs: Optional[tuple] = None  # (text, ids) of env_step's last observation, tokenized off the loop

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    async def generate(self, traj: Trajectory) -> str:
        """One model turn from prompt + response so far, within the remaining budget. Appends the new tokens (loss
        mask 1) with their log-probs and versions, sets traj.status from the finish reason and returns its type
        (stop | length | abort). A server-side abort we did not ask for is continued, up to max_retries times."""
        return (await self.rollout._generate(self._active, [traj]))[0]

    def append_env(self, traj: Trajectory, text: str) -> bool:
        """Environment tokens (loss mask 0, log-prob 0, the version of the turn before them), at most
        rollout.env_max_obs_tokens of them (a longer text is cut, counted in rollout/env_obs_truncated_count; the
        observation env_step returned was cut and tokenized there). False, and status truncated, when they do not
        fit in the remaining budget (nothing is appended then)."""
        obs, self._obs = self._obs, None
        ids = obs[1] if obs is not None and obs[0] is text else self.rollout.envs.cap(text)[1]
        start = len(traj.response_ids)
        if start + len(ids) > self.max_new_tokens:
            traj.status = TRUNCATED
            return False
        version = int(traj.versions[-1]) if start else -1
        _extend(traj, ids, [0.0] * len(ids), [version] * len(ids), 0)
        traj.metadata.setdefault("env_spans", []).append([start, start + len(ids)])
        return True

    def make_env(self):
        """A fresh tool environment for this trajectory: tasks.make_env(task, label, metadata, rollout.env), the
        metadata the prompt's plus "trajectory_id": (epoch, seq, index), the same across pauses and resumes."""
        import tasks

        g = self.group
        metadata = {**g.metadata, "trajectory_id": (g.epoch, g.seq, self.index)}
        return tasks.make_env(self.task, g.label, metadata, self.cfg.rollout.env)

    async def env_step(self, env, traj: Trajectory, turn_text: str) -> Optional[str]:
        """env.step(turn_text), sync (in a thread) or async, once one of rollout.env_max_concurrent slots is free,
        within rollout.env_step_timeout_s. Returns the observation (None: the episode ends) and records
        [turn_text, observation] in traj.metadata["env_turns"]; an observation over rollout.env_max_obs_tokens is
        cut to it (counted) before it is recorded. A step that raises or times out is run again up to
        rollout.env_retries times; one that still does, or returns neither a str nor None, marks traj failed (the
        reason in metadata["error"] and ["env_error"]) and raises EnvStepFailed, which ends the rollout function; the
        run goes on."""
        observation = await self.rollout.envs.step(self, env, traj, turn_text)
        if observation is not None:
            self._obs = await self.rollout.envs.observation(observation)
            traj.metadata.setdefault("env_turns", []).append([turn_text, self._obs[0]])
        return observation if observation is None else self._obs[0]

    async def restore_env(self, env, traj: Trajectory) -> int:
        """Bring a fresh environment to where a restored trajectory's finished turns left it, without running their
        steps again: env.restore([[turn_text, observation], ...]) (sync or async) when the environment has it.
        Returns the number of finished turns (0 for a new trajectory)."""
        spans = traj.metadata.get("env_spans", [])
        if not spans:
            return 0
        turns = traj.metadata.get("env_turns") or []
        if len(turns) < len(spans):  # not recorded (e.g. a checkpoint from before env_turns): rebuilt from tokens
            turns, start = [], 0
            for a, b in spans:
                turns.append([self.decode(traj.response_ids[start:a]), self.decode(traj.response_ids[a:b])])
                start = b
        restore = getattr(env, "restore", None)
        if restore is not None:
            out = restore([list(t) for t in turns[:len(spans)]])
            if inspect.isawaitable(out):
                await out
        return len(spans)


async def single_turn(ctx: RolloutContext, traj: Trajectory) -> None:
    """One model turn from the prompt (or from a restored partial response) to stop, length or abort. As
    rollout.function, the producer does not call it per trajectory: it sends each group's unfinished trajectories
    as one list request (Rollout._generate), which is this turn for all of them."""
    await ctx.generate(traj)


async def multi_turn_tool(ctx: RolloutContext, traj: Trajectory) -> None:
    """Model turns alternating with environment observations (tasks.make_env: rollout.env or the task's own; loss
    mask 0) until the environment ends the episode, env.max_turns model turns, or the budget runs out. Each step goes
    through ctx.env_step (bounded, timed; one that raises or times out fails the trajectory). A restored trajectory
    gets a fresh environment and its finished turns through env.restore (when it has one) instead of running their
    steps again, then continues its last, partial turn."""
    env = ctx.make_env()
    turns = await ctx.restore_env(env, traj)
    spans = traj.metadata.get("env_spans", [])
    turn_start = spans[-1][1] if spans else 0
    while True:
        if await ctx.generate(traj) != "stop":
            return
        turns += 1
        if turns >= env.max_turns:
            return
        observation = await ctx.env_step(env, traj, ctx.decode(traj.response_ids[turn_start:]))
        if observation is None or not ctx.append_env(traj, observation):
            return
        turn_start = len(traj.response_ids)


ROLLOUT_FUNCTIONS = {"single_turn": single_turn, "multi_turn_tool": multi_turn_tool}


def resolve_rollout_function(name: str) -> Callable:
    """rollout.function: a built-in name or "module:function" naming an async function (ctx, traj) -> None (which
    config.validate loads with plugins.load and registers in ROLLOUT_FUNCTIONS under that name)."""
    fn = ROLLOUT_FUNCTIONS.get(name)
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.function '{name}' must be one of {', '.join(ROLLOUT_FUNCTIONS)} or "
                         "module:function naming an async function (ctx, traj) -> None")
    return fn


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
        self.fn = resolve_rollout_function(r.function)
        import tasks

        self.reward_names = [ds.reward or tasks.default_reward(ds.task) for ds in cfg.data_sources]
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
        self._aborting: set = set()  # groups the buffer drops at this update (buffer.update_aborts): they stop too
        self._servers_paused = False  # our /pause_generation holds the servers until resume() or stop()
        self._error: Optional[BaseException] = None
        self._tasks: set = set()
        self._started = False
        self._in_flight, self._in_flight_t = 0, time.monotonic()  # trajectories in live requests (self._active)
        self._retries_seen = self._down_seen = 0
        self.scorer = scoring.Scorer(r.reward_pool, r.reward_workers, r.reward_timeout_s, self.reward_fns)
        self._failure_logged: set = set()  # the kinds of reward failure (and "metadata") already logged, once each
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
        tool_slots = 0 if self.fn is single_turn else self.cfg.rollout.env_max_concurrent
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
        if self.fn is single_turn:  # the group is one list request
            if todo:
                self._spawn(self._run(g, todo))
        else:
            for traj in todo:
                self._spawn(self._run(g, [traj]))

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
                    _extend(t, gen.ids, gen.log_probs, gen.versions, 1)
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

    async def _run(self, g: PromptGroup, trajs: list) -> None:
        """Generate trajs of group g: the group's unfinished trajectories in one list request (rollout.function
        single_turn), or one trajectory through the rollout function. Then each is finished, scored and emitted."""
        t0 = trajs[0]
        prefix = (f"{self.run_tag}-{g.epoch}-{g.seq}-" if self.fn is single_turn
                  else trajectory_rid_prefix(self.run_tag, t0.epoch, t0.seq, t0.index))
        active = _Active(prefix, len(trajs), asyncio.Event())
        if self._stopping:
            active.stop.set()
        self._count_in_flight(len(trajs))
        self._active[prefix] = active
        restored = [t.response_ids.numel() > 0 for t in trajs]  # (numel: len(tensor) costs ~3 us)
        task = self._spawn(self._generate(active, trajs) if self.fn is single_turn
                           else self.fn(RolloutContext(self, g, active, t0.index), t0))
        timeout = self.cfg.rollout.trajectory_timeout_s
        active.timer = asyncio.get_running_loop().call_later(timeout, self._on_timeout, active, task)
        try:
            await asyncio.wait({task})
        finally:
            active.timer.cancel()
            self._count_in_flight(-len(trajs))
            del self._active[prefix]
        error = None if task.cancelled() else task.exception()
        if error is not None and not isinstance(error, EnvStepFailed):  # (those are logged once per kind)
            log.warning("trajectories %s failed: %r", prefix, error)
        scored = []
        for traj, was_restored in zip(trajs, restored):
            if active.timed_out and (task.cancelled() or traj.status == ABORTED):
                traj.status = FAILED
                traj.metadata["error"] = f"rollout.trajectory_timeout_s={timeout} s exceeded; the request was aborted"
                self.stats["timeouts"] += 1
            elif isinstance(error, EnvStepFailed):
                traj.status = FAILED  # env_step wrote the reason
            elif error is not None:
                traj.status = FAILED
                traj.metadata["error"] = repr(error)
            elif traj.status == ABORTED and not (self._stopping or g.prompt_id in self._aborting):
                traj.status = FAILED
                traj.metadata["error"] = "the rollout function returned an unfinished trajectory"
            problem = checkpoint.unloadable(traj.metadata, "metadata")
            if problem is not None:  # every checkpoint holding it would fail: refused here, named and counted
                self._unloadable_metadata(traj, problem)
            if traj.response_ids.numel():
                traj.start_version, traj.end_version = traj.versions[[0, -1]].tolist()
            if was_restored:
                traj.metadata["restored"] = traj.metadata.get("restored", 0) + 1
            if traj.status == ABORTED:  # pausing with rollout.partial=true: to buffer.step_boundary
                self._partials.append(traj)
                self._done(g.prompt_id)
                continue
            if (self.cfg.rollout.mask_offpolicy_in_partial_rollout
                    and traj.start_version != traj.end_version):  # versions never decrease: equal ends, nothing to mask
                # The spec masks restored tokens of older versions when the trajectory is restored; the rule is the
                # trainer's (losses.offpolicy_token_mask), so applying it here too changes nothing there.
                traj.loss_mask = losses.offpolicy_token_mask(traj.versions[None], traj.loss_mask[None])[0]
            if traj.status in (COMPLETED, TRUNCATED):
                scored.append(traj)
        await self._score(g, scored)
        for traj in trajs:
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
        the function and the value, in metadata["error"], counted, the first of each kind logged."""
        name = self.reward_names[g.source]
        texts = self.tokenizer.batch_decode([t.response_ids.tolist() for t in trajs], skip_special_tokens=True)
        args = [(text, g.label, t.status == COMPLETED) for text, t in zip(texts, trajs)]
        for traj, (reward, failure) in zip(trajs, await self.scorer.score(self.reward_fns[g.source], args)):
            if failure is None:
                traj.reward = reward
                continue
            kind, why = failure
            traj.status, traj.metadata["error"] = FAILED, f"the reward function {name} {why}"
            self.stats["reward_timeouts" if kind == "timeout" else "reward_errors"] += 1
            if kind not in self._failure_logged:
                self._failure_logged.add(kind)
                log.warning("first reward %s (counted in rollout/reward_%s_count, not logged again): trajectory %s: "
                            "%s; it failed, the run goes on", kind, kind, traj.prompt_id + (traj.index,),
                            traj.metadata["error"])

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
        keeps, stale = r.partial and r.pause_mode != "abort", None
        if keeps and checkpoint:  # every request comes back (below); the strategy drops what keeping would drop
            stale = await asyncio.to_thread(self.buffer.update_aborts)
        elif keeps:
            # The servers keep every request (in_place: with its KV cache; retract: recomputed after continue); the
            # weight update runs on the paused servers and resume() continues them. Nothing is aborted, restored or
            # re-sent: the groups stay in flight (requests not yet at a server wait at its pause gate).
            self._servers_paused = True
            partials = await self._abort_groups(await asyncio.to_thread(self.buffer.update_aborts), deadline)
            await self._pause_servers(r.pause_mode, deadline)
            metrics = dict(await asyncio.to_thread(self.buffer.step_boundary, partials, True) or {})
            metrics["rollout/partial_kept_count"] = self._in_flight
            metrics["timing/pause_delay"] = time.monotonic() - t0
            return metrics
        if r.partial:
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
        kept = () if stale is None else (True, stale)  # retract / in_place before a checkpoint: the keeping verdicts
        metrics = dict(await asyncio.to_thread(self.buffer.step_boundary, partials, *kept) or {})
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
        `keys` (buffer.update_aborts), wait for their trajectories and return the aborted ones (the buffer drops
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
        if self.fn is not single_turn:  # tool environments: steps, the wait for a slot, failures
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
        # notices the disconnect (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s), which no client call can shorten.
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
_MOVED = {"RemoteRollout": "rollout.RemoteRollout(worker, timeout) is now remote.Proxy(worker, timeout, "
                           "remote.ROLLOUT_METHODS)",
          "serve": "rollout.serve (the rollout process) is now workers.serve_rollout, with the same arguments"}


def __getattr__(name: str):  # a name that moved is refused naming where it went
    raise AttributeError(_MOVED.get(name, f"module 'rollout' has no attribute '{name}'"))


# ---------------------------------------------------------------------------------------------------------------
# Standalone generation: a dataset through the same producer, against running servers

class DatasetBuffer(Exchange):
    """The buffer interface over a fixed list of prompts: each dispatched once, trajectories collected by group."""

    def __init__(self, prompts: list[dict], n: int):
        self.n = n
        self.pending = deque(PromptGroup(0, i, i, torch.tensor(p["prompt_ids"], dtype=torch.long), p["label"],
                                         0, p.get("metadata", {})) for i, p in enumerate(prompts))
        self.prompts = {g.seq: g for g in self.pending}
        self.results: dict[int, list[Trajectory]] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        if not self.pending:
            self.done.set()

    def dispatch(self, max_groups: Optional[int] = None, timeout: float = 0.0) -> list[PromptGroup]:
        if not self.pending:
            time.sleep(timeout)  # as PipelineServer.dispatch: nothing to hand out, wait instead of spinning
        with self.lock:
            k = len(self.pending) if max_groups is None else min(max_groups, len(self.pending))
            return [self.pending.popleft() for _ in range(k)]

    def put(self, trajs: list[Trajectory]) -> None:
        with self.lock:
            for t in trajs:
                self.results.setdefault(t.seq, []).append(t)
            if sum(len(v) for v in self.results.values()) == self.n * len(self.prompts):
                self.done.set()

    def step_boundary(self, returned: list[Trajectory], keep_in_flight: bool = False, stale=None) -> dict:
        return {}

    def set_max_concurrent_samples(self, value: int) -> None:
        """Nothing to do: the producer's own free-slot count already bounds what is dispatched from here."""


def generate_dataset(cfg, prompts: list[dict], sync: SyncFleet, tokenizer, progress_timeout_s: float
                     ) -> tuple[DatasetBuffer, dict]:
    """Generate and score N trajectories for every prompt; returns the filled DatasetBuffer and a summary dict.
    Unset rollout.async_max_concurrent_samples means the fleet's concurrency here (there is no capacity C)."""
    import lease

    if cfg.rollout.async_max_concurrent_samples is None:
        cfg.rollout.async_max_concurrent_samples = sync.concurrency()
    buf = DatasetBuffer(prompts, cfg.N)
    rollout = Rollout(cfg, buf, sync, tokenizer)
    t0 = time.monotonic()
    rollout.start()
    finished = -1
    try:
        lease.beat(progress_timeout_s)  # the servers' lease (the evaluator): progress is a trajectory finishing
        while not buf.done.wait(progress_timeout_s):
            now = sum(len(v) for v in buf.results.values())
            if now == finished:
                raise TimeoutError(f"no trajectory finished in {progress_timeout_s} s ({now} of "
                                   f"{cfg.N * len(prompts)} done); are the servers in rollout.servers alive?")
            finished = now
            lease.beat(progress_timeout_s)
        metrics = rollout.step_metrics()
    finally:
        rollout.stop()
    trajs = [t for v in buf.results.values() for t in v]
    wall = time.monotonic() - t0
    summary = {"prompts": len(prompts), "trajectories": len(trajs), "wall_s": round(wall, 3),
               "reward_mean": metrics["rollout/reward_mean"],
               "pass_rate": sum(t.reward >= 1.0 for t in trajs) / max(1, len(trajs)),
               "truncation_ratio": metrics["rollout/truncation_ratio"],
               "failed": metrics["rollout/failed_count"],
               "response_length_mean": metrics["rollout/response_length_mean"],
               "generated_tokens_per_s": sum(len(t.response_ids) for t in trajs) / max(wall, 1e-9),
               "max_concurrent_samples": rollout.max_samples}
    return buf, summary
