"""scoring.py: a trajectory's reward, for the rollout producer: the reward function called where rollout.reward_pool
says, and what it returned checked.

- `reward_value(value) -> float`: a reward is a finite real number: an int, float or bool, or a numpy or 0-d torch
  scalar holding one. Anything else (a string such as " 2 ", NaN, inf, a 1-element list, a complex) is refused:
  ValueError naming the value, so that its trajectory fails with the reason instead of turning its group's
  advantages into NaN.
- `Scorer(pool, workers, timeout_s)`: `await score(fn, name, args)` calls the reward function of each (text, label,
  stopped) of args. Pools (`resolve_pool` turns `auto` into one of them):
    inline   on the event loop (cheap rewards: no thread hop);
    thread   on `workers` threads (the event loop goes on while one runs, unless it holds the GIL);
    process  on `workers` worker processes, one for each of as many threads. A call that has not returned within
             `timeout_s` (rollout.reward_timeout_s) has its worker killed (SIGKILL to its session) and replaced at
             the next call: a verifier that holds the GIL for minutes (sympy on the answer 9^{9^{9^{9}}}) costs one
             failed trajectory, not a frozen rollout. The worker is `python -c` importing this file (not the rollout
             process's main module), given the parent's sys.path; the function travels pickled (a module-level
             function: by name). A worker imports the modules of a function's `preload` attribute (a tuple of
             names) before it says it is ready, so that a call's timeout does not count them.
  A function whose attribute `may_hang` is true (tasks.math_reward) runs in the process pool under `auto`, and
  config.validate refuses it with thread or inline. Each result is (reward, None) or (None, (kind, why, site, tb)):
  kind "error" (it raised, or returned a value reward_value refuses) or "timeout"; why is a phrase that follows the
  function's name ("raised KeyError('x') at tasks.py:12"); site and tb are the file and line that raised and the
  traceback, both "" when it did not raise.
- `raised(e) -> (why, site, tb)`: an exception as a failure's reason, the file and line that raised it and its
  traceback (rollout.py and env_steps.py describe what raised in rollout functions and environments with it too).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import numbers
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

POOLS = ("auto", "thread", "process", "inline")
ACCEPTED = "an int, float or bool, or a numpy or 0-d torch scalar holding one"
WORKER_START_S = 120.0  # a reward worker process that has not imported its functions by then is an error


def reward_value(value: Any) -> float:
    """value as a float when it is a finite real number (ACCEPTED), else ValueError: what it is and why not."""
    try:  # a numpy or torch scalar: its Python number
        x = value.item() if getattr(value, "shape", None) == () and hasattr(value, "item") else value
    except Exception:
        x = value
    if not isinstance(x, numbers.Real):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ValueError(f"returned {shown} ({type(value).__name__}), not a real number; accepted: {ACCEPTED}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"returned {x!r}, not a finite number")
    return x


def raised(e: BaseException) -> tuple[str, str, str]:
    """(why, site, tb) of exception e: why = "raised KeyError('x') at tasks.py:12", site = that file and line (its
    innermost frame; the path relative to the working directory when it lies under it, "" without a frame), tb =
    the formatted traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    if not frames:
        return f"raised {e!r}", "", tb
    path = frames[-1].filename
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    site = f"{path if rel.startswith('..') else rel}:{frames[-1].lineno}"
    return f"raised {e!r} at {site}", site, tb


def may_hang(fn: Callable) -> bool:
    """Whether a reward function says it can run unboundedly (its `may_hang` attribute): it needs the process pool."""
    return bool(getattr(fn, "may_hang", False))


def resolve_pool(pool: str, fns: list) -> str:
    """rollout.reward_pool auto: process when any of the run's reward functions may hang, else thread."""
    if pool != "auto":
        return pool
    return "process" if any(may_hang(fn) for fn in fns) else "thread"


class RewardTimeout(Exception):
    """A reward call in a worker process outlived rollout.reward_timeout_s; the worker was killed."""


class _Failed(Exception):
    """A reward call failed in its worker process (raised, or returned what reward_value refuses): args (the
    reason, and the site and traceback of a call that raised, else "" and "")."""


class _Worker:
    """One reward worker process and the two pipes of its protocol (pickled messages)."""

    def __init__(self, fns: list):
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()
        here = os.path.dirname(os.path.abspath(__file__))
        code = "import sys; sys.path.insert(0, sys.argv[1]); import scoring; scoring._serve(*map(int, sys.argv[2:]))"
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code, here, str(to_child), str(from_child),
                                          str(os.getpid())],
                                         pass_fds=(to_child, from_child), start_new_session=True,
                                         stdin=subprocess.DEVNULL)
        finally:
            os.close(to_child)
            os.close(from_child)
        self.conn_out, self.conn_in = Connection(self._w, readable=False), Connection(self._r, writable=False)
        try:
            self.conn_out.send(list(sys.path))  # first: the functions' modules are found on the parent's path
            self.conn_out.send_bytes(pickle.dumps(fns))
            if not self.conn_in.poll(WORKER_START_S):
                raise RuntimeError(f"a reward worker process did not load the reward functions within "
                                   f"{WORKER_START_S:g} s")
            ok, what = self.conn_in.recv()
        except EOFError:
            ok, what = False, f"it exited with code {self.proc.wait()}"
        except BaseException:
            self.kill()
            raise
        if not ok:
            self.kill()
            raise RuntimeError(f"a reward worker process could not load the reward functions: {what}")

    def call(self, fn, args: tuple, timeout_s: float) -> float:
        """The checked reward of fn(*args); _Failed, RewardTimeout, or RuntimeError when the worker died."""
        self.conn_out.send((fn, args))
        if not self.conn_in.poll(timeout_s):
            raise RewardTimeout
        try:
            ok, value = self.conn_in.recv()
        except EOFError:
            raise RuntimeError(f"its worker process died (exit code {self.proc.wait()}) and was replaced") from None
        if not ok:
            raise _Failed(*value)
        return value

    def kill(self) -> None:
        """SIGKILL to its session (whatever the function started too); the pipes closed."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.conn_out.close()
        self.conn_in.close()


def _serve(read_fd: int, write_fd: int, parent: int) -> None:
    """A reward worker process: load the functions (and their preload modules), then answer calls until EOF, each
    with (True, the checked reward) or (False, (why, site, tb)): raised's, or a refused value's reason, "" and "".
    On Linux it dies with the thread that started it (the rollout process's reward thread), even in the middle of a
    hung call."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the rollout process was gone before that took effect
        return
    conn_in, conn_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        sys.path[:] = conn_in.recv()
        fns = pickle.loads(conn_in.recv_bytes())
        for module in sorted({m for fn in fns for m in getattr(fn, "preload", ())}):
            __import__(module)
    except Exception as e:
        conn_out.send((False, repr(e)))
        return
    conn_out.send((True, None))
    while True:
        try:
            fn, args = conn_in.recv()
        except EOFError:
            return
        try:
            value = fn(*args)
        except Exception as e:
            conn_out.send((False, raised(e)))
            continue
        try:
            conn_out.send((True, reward_value(value)))
        except ValueError as e:
            conn_out.send((False, (str(e), "", "")))


class Scorer:
    """Reward calls in rollout.reward_pool (resolved: inline, thread or process) on rollout.reward_workers threads
    or processes; in the process pool each call within timeout_s. `fns`: every reward function of the run (the
    worker processes load them at start)."""

    def __init__(self, pool: str, workers: int, timeout_s: float, fns: list):
        self.pool, self.timeout_s, self.fns = resolve_pool(pool, fns), timeout_s, list(fns)
        self._threads = (None if self.pool == "inline" else
                         concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reward"))
        self._local = threading.local()  # a process pool thread's own worker
        self._workers: set = set()
        self._lock = threading.Lock()
        self._closed = False
        if self.pool == "process":
            try:
                pickle.dumps(self.fns)
            except Exception as e:
                raise ValueError(f"rollout.reward_pool=process sends the reward functions to worker processes, and "
                                 f"one of {self.fns} does not pickle ({e}); make it a module-level function, or set "
                                 "rollout.reward_pool=thread") from None

    async def score(self, fn: Callable, args: list) -> list:
        """[(reward, None) or (None, (kind, why, site, tb))] for fn(*a) of each a in args."""
        call = self._in_process if self.pool == "process" else self._here
        if self._threads is None:
            return [call(fn, a) for a in args]
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*[loop.run_in_executor(self._threads, call, fn, a) for a in args])

    @staticmethod
    def _here(fn, a: tuple) -> tuple:
        try:
            value = fn(*a)
        except Exception as e:
            return None, ("error", *raised(e))
        try:
            return reward_value(value), None
        except ValueError as e:
            return None, ("error", str(e), "", "")

    def _in_process(self, fn, a: tuple) -> tuple:
        w = getattr(self._local, "worker", None)
        try:
            if w is None:
                with self._lock:
                    if self._closed:
                        raise RuntimeError("the reward pool is closed")
                w = self._local.worker = _Worker(self.fns)
                with self._lock:
                    self._workers.add(w)
            return w.call(fn, a, self.timeout_s), None
        except _Failed as e:
            return None, ("error", *e.args)
        except Exception as e:  # timed out, died, or could not start: killed here, a new one at the next call
            if w is not None:
                self._local.worker = None
                with self._lock:
                    self._workers.discard(w)
                w.kill()
            if isinstance(e, RewardTimeout):
                return None, ("timeout", f"did not return within rollout.reward_timeout_s={self.timeout_s:g} s; "
                                         "its worker process was killed and replaced", "", "")
            return None, ("error", str(e) if isinstance(e, RuntimeError) else f"failed in its worker: {e!r}", "", "")

    def close(self) -> None:
        """Stop the threads (calls not yet started are cancelled) and kill every worker process."""
        with self._lock:
            self._closed = True
            workers, self._workers = list(self._workers), set()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            w.kill()
