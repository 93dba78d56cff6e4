"""env_steps.py: the rollout's tool environment steps (RolloutContext.env_step of rollout_fns.py): bounded, timed,
retried, their failures counted, and the observations capped.

`EnvSteps(rollout_cfg, tokenizer)`: `await step(ctx, env, traj, text)` runs env.step(text) once one of
rollout.env_max_concurrent slots is free (a sync step on as many threads, off the event loop), within
rollout.env_step_timeout_s, again up to rollout.env_retries times when it raises or times out; a step that still
does, or returns neither a str nor None, fails its trajectory (the reason in metadata["error"] and ["env_error"],
naming the file and line that raised; the first of each kind logged, and the first traceback of each such line,
Rollout.log_traceback) and raises EnvStepFailed; rollout.env_fail_stop_steps failures in a row stop the run (a
trajectory's metadata["stop"], which the buffer hands to the trainer). `await observation(text)` caps an
observation at rollout.env_max_obs_tokens tokens: the text is cut at OBS_CHARS_PER_TOKEN characters a token before
it is tokenized (so the work is bounded whatever the environment returns), then the ids at the cap; a long one is
tokenized on a thread of its own. `metrics()`: the rollout/env_* metrics since the last call.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from typing import Optional

import scoring
from buffer import FAILED, Trajectory

log = logging.getLogger("rollout")

OBS_CHARS_PER_TOKEN = 16  # an observation is cut at rollout.env_max_obs_tokens x this many characters, then tokenized
OBS_INLINE_CHARS = 2048  # a shorter observation is tokenized on the event loop (< 1 ms), a longer one on a thread


class EnvStepFailed(Exception):
    """An environment step raised, timed out or returned something other than str or None: its trajectory is
    marked failed (RolloutContext.env_step) and this ends the rollout function."""


def _new_stats() -> dict:
    return {"steps": 0, "wait_s": 0.0, "step_s": 0.0, "in_use_max": 0, "errors": 0, "timeouts": 0, "retries": 0,
            "obs_truncated": 0}


class EnvSteps:
    """The environment steps of one Rollout (its event loop's): slots, threads, counters (module doc)."""

    def __init__(self, rollout_cfg, tokenizer):
        self.cfg, self.tokenizer = rollout_cfg, tokenizer
        self.stats = _new_stats()
        # At most env_max_concurrent steps at once; a sync step runs on one of as many threads, so one that outlives
        # its timeout still holds a thread, and the environment never sees more steps at once than that.
        self._slots = asyncio.Semaphore(rollout_cfg.env_max_concurrent)
        self._threads: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._obs_thread: Optional[concurrent.futures.ThreadPoolExecutor] = None  # long observations tokenized here
        self._in_use = 0
        self._fail_run, self._fail_first = 0, ""  # steps failed in a row since the last good one; the first of them
        self._logged: set = set()  # the kinds of failure already logged (the first of each is)
        self._stopped = False

    def metrics(self) -> dict:
        """rollout/env_* of the steps since the last call: steps, their wait for a slot and duration, the most in
        progress at once, failures by kind, retries, observations cut at rollout.env_max_obs_tokens."""
        s, self.stats = self.stats, _new_stats()
        steps = max(1, s["steps"])
        return {"rollout/env_steps": s["steps"], "rollout/env_wait_s_mean": s["wait_s"] / steps,
                "rollout/env_step_s_mean": s["step_s"] / steps, "rollout/env_in_use_max": s["in_use_max"],
                "rollout/env_error_count": s["errors"], "rollout/env_timeout_count": s["timeouts"],
                "rollout/env_retry_count": s["retries"], "rollout/env_obs_truncated_count": s["obs_truncated"]}

    def close(self) -> None:
        for threads in (self._threads, self._obs_thread):
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)

    async def step(self, ctx, env, traj: Trajectory, text: str) -> Optional[str]:
        """RolloutContext.env_step: one step within a slot and the timeout, run again up to rollout.env_retries times
        (in the same slot) when it raises or times out; failures counted, the first of each kind logged, and after
        rollout.env_fail_stop_steps failures in a row the run is stopped through the buffer."""
        r, s = self.cfg, self.stats
        turn = len(traj.metadata.get("env_spans", [])) + 1
        t0 = time.monotonic()
        async with self._slots:
            t1 = time.monotonic()
            s["steps"] += 1
            s["wait_s"] += t1 - t0
            self._in_use += 1
            s["in_use_max"] = max(s["in_use_max"], self._in_use)
            try:
                for attempt in range(r.env_retries + 1):
                    kind, site, tb = None, "", ""
                    try:
                        observation = await asyncio.wait_for(self._call_step(env, text), r.env_step_timeout_s)
                        if observation is not None and not isinstance(observation, str):  # not retried: a bug
                            kind, why = "error", f"returned {type(observation).__name__}, not a str or None"
                        break
                    except asyncio.TimeoutError:
                        kind, why = "timeout", (f"did not return within rollout.env_step_timeout_s="
                                                f"{r.env_step_timeout_s:g} s")
                    except Exception as e:
                        kind, (why, site, tb) = "error", scoring.raised(e)
                    if attempt < r.env_retries:
                        s["retries"] += 1
                if kind is not None and attempt:
                    why += f" (the last of {attempt + 1} attempts, rollout.env_retries={r.env_retries})"
            finally:
                self._in_use -= 1
                s["step_s"] += time.monotonic() - t1
        if kind is None:
            self._fail_run = 0
            return observation
        name = f"rollout.env={r.env}" if r.env else f"{type(env).__name__} (data_source.task {ctx.task}'s own)"
        message = f"the tool environment {name}: its step of turn {turn} {why}"
        traj.status = FAILED
        traj.metadata["error"] = message
        traj.metadata["env_error"] = {"kind": kind, "turn": turn, "message": message}
        s["timeouts" if kind == "timeout" else "errors"] += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("first environment %s (counted in rollout/env_%s_count, not logged again): %s; prompt %r, "
                        "turn %d text %r; the trajectory failed, the run goes on", kind,
                        "timeout" if kind == "timeout" else "error", message,
                        ctx.decode(traj.prompt_ids)[-200:], turn, text[-200:])
        ctx.rollout.log_traceback(f"the tool environment {name}", site, tb)
        self._fail_run += 1
        if self._fail_run == 1:
            self._fail_first = f"its step of turn {turn} {why}"
        stop = r.env_fail_stop_steps
        if stop and self._fail_run >= stop and not self._stopped:
            self._stopped = True
            traj.metadata["stop"] = (f"nothing can be trained: the tool environment {name} failed each of its last "
                                     f"{self._fail_run} steps; the first of them: {self._fail_first}; "
                                     "fix the environment (or raise rollout.env_fail_stop_steps; 0 turns this "
                                     "stop off)")
            log.error("%s", traj.metadata["stop"])
        raise EnvStepFailed(message)

    async def observation(self, text: str) -> tuple[str, list]:
        """cap(text): on the event loop when the text is short, else on the observation thread (its own: not the
        environment's threads, which a hung step may hold, nor the default executor, which carries the buffer
        calls)."""
        if len(text) <= OBS_INLINE_CHARS:
            return self.cap(text)
        if self._obs_thread is None:
            self._obs_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="env-obs")
        text, ids, cut = await asyncio.get_running_loop().run_in_executor(self._obs_thread, self._cut, text)
        self.stats["obs_truncated"] += cut
        return text, ids

    def cap(self, text: str) -> tuple[str, list]:
        """(text, ids) of an observation at most rollout.env_max_obs_tokens tokens long (_cut), a cut counted."""
        text, ids, cut = self._cut(text)
        self.stats["obs_truncated"] += cut
        return text, ids

    def _cut(self, text: str) -> tuple[str, list, bool]:
        """The text cut at OBS_CHARS_PER_TOKEN characters a token before it is tokenized (bounded work whatever the
        environment returned), the ids at rollout.env_max_obs_tokens (the text then decoded from them), and whether
        anything was cut."""
        cap = self.cfg.env_max_obs_tokens
        cut = len(text) > cap * OBS_CHARS_PER_TOKEN
        text = text[:cap * OBS_CHARS_PER_TOKEN]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > cap:
            cut, ids = True, ids[:cap]
            text = self.tokenizer.decode(ids)
        return text, ids, cut

    async def _call_step(self, env, text: str):
        """env.step(text): awaited when it is async, else run on the environment threads (and awaited if what it
        returns is awaitable)."""
        if inspect.iscoroutinefunction(env.step):
            return await env.step(text)
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(self.cfg.env_max_concurrent, thread_name_prefix="env")
        out = await asyncio.get_running_loop().run_in_executor(self._threads, env.step, text)
        return await out if inspect.isawaitable(out) else out
