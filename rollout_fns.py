"""rollout_fns.py: rollout functions (rollout.function) and what they may use, RolloutContext.

A rollout function is `async def fn(ctx: RolloutContext, trajs: list[Trajectory]) -> None`. The producer
(rollout.Rollout) awaits it once per prompt group, with the group's unfinished trajectories: all N of a new group,
those a pause aborted of a restored one (each with the tokens it has; the finished ones are put as they are). It
extends each trajectory and sets its status:
- `await ctx.generate_batch(trajs)`: one model turn of each of trajs in one /generate list request (one item per
  trajectory), from prompt + response so far within the remaining budget; `await ctx.generate(traj)`: the same for
  one trajectory. Each sets the status from the finish reason and returns it (stop | length | abort).
- `await ctx.each(trajs, episode)`: `await episode(ctx, traj)` for each trajectory on its own, concurrently: its own
  requests, its own context, put to the buffer as soon as it ends; an exception fails that trajectory only. Within an
  episode: `ctx.append_env(traj, text)` (environment tokens, loss mask 0), `ctx.make_env()` (the trajectory's tool
  environment, tasks.make_env) stepped with `await ctx.env_step(env, traj, text)`: at most rollout.env_max_concurrent
  steps at once (a sync step on as many threads, off the event loop), each within rollout.env_step_timeout_s; a
  step that raises or times out is run again up to rollout.env_retries times (default 0), then fails its trajectory
  (counted, the first of each kind logged; the buffer trains its group on the survivors, rollout.min_group_size), and
  rollout.env_fail_stop_steps failures in a row stop the run (a trajectory's metadata["stop"], which the buffer hands
  to the trainer); an observation is capped at rollout.env_max_obs_tokens before it is recorded or tokenized in full
  (env_steps.py). `await ctx.restore_env(env, traj)` brings a fresh environment to a restored trajectory's turns.
- ctx also has cfg, task, group (label, metadata), tokenizer, max_new_tokens and decode(ids).
The function's call (and each episode) is bounded by rollout.trajectory_timeout_s, counted from the group's start:
then its requests are aborted and its unfinished trajectories fail. A trajectory it leaves aborted fails, unless a
pause stopped it (it goes to buffer.step_boundary).

Built in (ROLLOUT_FUNCTIONS): `single_turn`, one generate_batch for the group, and `multi_turn_tool`, a tool episode
per trajectory (ctx.each). Or rollout.function=module:function (examples/rollout_fn.py). docs/agents.md.
"""
from __future__ import annotations

import asyncio
import inspect
from typing import Callable, Optional

import numpy
import torch

import plugins
from buffer import TRUNCATED, PromptGroup, Trajectory

def extend(traj: Trajectory, ids: list[int], log_probs: list[float], versions: list[int], mask: int) -> None:
    """Append tokens. Each field is rebuilt from one list through numpy: the producer's hot path, where
    torch.tensor(list) costs ~3x as much (5.3 against 1.5 us for 6 ids)."""
    def grow(old: torch.Tensor, new: list, dtype) -> torch.Tensor:
        return torch.from_numpy(numpy.array(old.tolist() + new if old.numel() else new, dtype=dtype))

    traj.loss_mask = grow(traj.loss_mask, [mask] * len(ids), numpy.int64)
    traj.response_ids = grow(traj.response_ids, ids, numpy.int64)
    traj.rollout_log_probs = grow(traj.rollout_log_probs, log_probs, numpy.float32)
    traj.versions = grow(traj.versions, versions, numpy.int64)


class RolloutContext:
    """What a rollout function may use: generate turns, run each trajectory on its own, append environment tokens,
    build and step tool environments, decode. The producer makes one per group (index None) and one per trajectory
    that `each` runs (index: its position in the group): `rollout` is the producer (rollout.Rollout), `active` the
    unit it runs in (rollout._Active: the requests that a pause or a timeout stops)."""

    def __init__(self, rollout, group: PromptGroup, active, index: Optional[int] = None):
        self.rollout, self.group, self._active = rollout, group, active
        self.index = index  # the trajectory's position in its group (a context of `each`), else None
        self.cfg, self.tokenizer = rollout.cfg, rollout.tokenizer
        self.task = rollout.cfg.data_source[group.source].task
        self.max_new_tokens = rollout.max_new_tokens
        self._obs: Optional[tuple] = None  # (text, ids) of env_step's last observation, tokenized off the loop

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    async def generate(self, traj: Trajectory) -> str:
        """One model turn from prompt + response so far, within the remaining budget. Appends the new tokens (loss
        mask 1) with their log-probs and versions, sets traj.status from the finish reason and returns its type
        (stop | length | abort). A server-side abort we did not ask for is continued, up to max_retries times."""
        return (await self.rollout._generate(self._active, [traj]))[0]

    async def generate_batch(self, trajs: list[Trajectory]) -> list[str]:
        """One model turn of each of trajs, as `generate`, in one /generate list request (one per remaining budget
        when those differ, Rollout._generate); the finish types in the order of trajs."""
        return await self.rollout._generate(self._active, list(trajs))

    async def each(self, trajs: list[Trajectory], episode: Callable) -> None:
        """`await episode(ctx, traj)` for each of trajs on its own, concurrently: each leaves this call for a unit of
        its own (its own context and requests; an exception fails it alone; scored and put to the buffer when its
        episode ends), within the same rollout.trajectory_timeout_s. Returns once every episode has ended."""
        if self.index is not None:
            raise ValueError("RolloutContext.each runs the trajectories of a rollout function's call; call it with "
                             "the context the rollout function was given, not an episode's")
        tasks = [self.rollout._hand_off(self._active, self.group, traj, episode) for traj in trajs]
        if tasks:
            await asyncio.wait(tasks)  # (not cancelled with this call: each episode has its own timeout)

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
        extend(traj, ids, [0.0] * len(ids), [version] * len(ids), 0)
        traj.metadata.setdefault("env_spans", []).append([start, start + len(ids)])
        return True

    def make_env(self):
        """A fresh tool environment for this trajectory: tasks.make_env(task, label, metadata, rollout.env), the
        metadata the prompt's plus "trajectory_id": (epoch, seq, index), the same across pauses and resumes. Only in
        an episode of `each`, whose context is one trajectory's."""
        import tasks

        if self.index is None:
            raise ValueError("RolloutContext.make_env builds one trajectory's environment: call it in an episode "
                             "that ctx.each runs, with the context it is given")
        g = self.group
        metadata = {**g.metadata, "trajectory_id": (g.epoch, g.seq, self.index)}
        return tasks.make_env(self.task, g.label, metadata, self.cfg.rollout.env)

    async def env_step(self, env, traj: Trajectory, turn_text: str) -> Optional[str]:
        """env.step(turn_text), sync (in a thread) or async, once one of rollout.env_max_concurrent slots is free,
        within rollout.env_step_timeout_s. Returns the observation (None: the episode ends) and records
        [turn_text, observation] in traj.metadata["env_turns"]; an observation over rollout.env_max_obs_tokens is
        cut to it (counted) before it is recorded. A step that raises or times out is run again up to
        rollout.env_retries times; one that still does, or returns neither a str nor None, marks traj failed (the
        reason in metadata["error"] and ["env_error"]) and raises EnvStepFailed, which ends the episode (or the
        call, failing its trajectories); the run goes on."""
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


async def single_turn(ctx: RolloutContext, trajs: list[Trajectory]) -> None:
    """One model turn of each trajectory from its prompt (or its restored partial response) to stop, length or
    abort: the group's trajectories in one /generate list request, one HTTP call and one scoring pass per group."""
    await ctx.generate_batch(trajs)


async def multi_turn_tool(ctx: RolloutContext, trajs: list[Trajectory]) -> None:
    """A tool episode (tool_episode) for each trajectory, each on its own (ctx.each)."""
    await ctx.each(trajs, tool_episode)


async def tool_episode(ctx: RolloutContext, traj: Trajectory) -> None:
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
    """rollout.function: a built-in name or "module:function" naming an async function (ctx, trajs) -> None (which
    config.load_plugins loads with plugins.load, checks and registers in ROLLOUT_FUNCTIONS under that name)."""
    return plugins.lookup(ROLLOUT_FUNCTIONS, name, "rollout.function", "module:function")
