"""sandbox.py: run a model's Python in a pool of worker subprocesses, each with a CPU-time limit, a memory limit, no
network and a scratch directory; a worker that times out or crashes is killed and replaced.

- `SandboxPool(workers, cpu_s, wall_s, memory_mb, output_chars, network)`: `run(code) -> Result` (blocking,
  thread-safe) and `await arun(code)` (in a thread, off the event loop). A call takes an idle worker (a pool holds
  at most `workers`, started on first need; a call beyond that waits for one), sends it the code, and waits at most
  `wall_s` for the reply. `Result.output` is what the code printed (an expression's value is printed, as a REPL
  does), cut to `output_chars`; `Result.error` is None or one line ("ZeroDivisionError: division by zero",
  "MemoryError", "the call exceeded its CPU time limit of 1 s; the worker was killed and replaced", ...).
- A worker is `python -I sandbox.py worker ...`: stdlib only, no PYTHONPATH, no user site. Before it reads a call it
  (1) leaves the network (below), (2) moves to its own scratch directory (a tempdir, emptied after every call,
  removed with the worker), (3) sets RLIMIT_AS (memory_mb: an allocation beyond it raises MemoryError inside the
  code, and the worker goes on), RLIMIT_FSIZE (files it writes) and RLIMIT_CORE 0, (4) points fds 0 and 1 at
  /dev/null (its protocol runs over private duplicates, so code that writes to fd 1 cannot forge a reply).
  Before each call the pool sets the worker's soft RLIMIT_CPU (resource.prlimit from outside: the worker itself may
  not) to the CPU it has used + cpu_s, rounded up to whole seconds: past it the kernel sends SIGXCPU, which kills
  the worker; a call still running at wall_s (sleeping, or a SIGXCPU handler) is killed by the pool.

Network denial, two layers:
  1. A network namespace: unshare(CLONE_NEWNET) (root) or unshare(CLONE_NEWUSER | CLONE_NEWNET) (unprivileged,
     where user namespaces are enabled), through os.unshare (Python >= 3.12) or libc's unshare via ctypes. The
     worker then has no interface but a loopback that is down: connect() fails with ENETUNREACH in the kernel,
     whatever the code does (ctypes, a subprocess, raw syscalls). This holds against deliberate escape.
  2. Always, on top: an audit hook (sys.addaudithook, which Python code cannot remove) that refuses the events
     socket.*, ctypes.*, subprocess.Popen, os.system, os.exec, os.posix_spawn, os.spawn, os.fork,
     resource.setrlimit and more (_DENIED): plain Python code gets a PermissionError naming the event.
     This alone does NOT hold against deliberate escape: audit hooks are not a security boundary (Python's docs
     say so), e.g. code that reaches a C function through an object the interpreter already holds is not audited.
  Where the namespace is not available (unshare refused: no CAP_SYS_ADMIN and user namespaces disabled, as in
  many containers; or not Linux), the worker runs with the audit hook alone: `Result.network` says
  "audit-hook only (...why...)" instead of "netns", and the pool logs a warning once. network="audit" forces that
  mode (for tests), network="netns" refuses to start a worker without a namespace.

Limits of this sandbox: the scratch directory is the cwd, not a chroot (the code can read any file the rollout
process can; writes are capped by RLIMIT_FSIZE); no seccomp filter; one call runs at a time per worker, and module
state persists between the calls a worker serves (each call gets fresh globals).

Run (a quick check of this machine's mechanism):
    python sandbox.py check
"""
from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("sandbox")

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
STARTUP_TIMEOUT_S = 30.0  # a worker that has not said it is ready by then is an error
FILE_LIMIT_BYTES = 16 << 20  # RLIMIT_FSIZE of a worker: the largest file its code may write
_DENIED = ("socket.", "ctypes.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "os.kill", "os.killpg", "pty.spawn", "resource.setrlimit", "resource.prlimit",
           "sys.addaudithook", "sys.setprofile", "sys.settrace", "webbrowser.open", "urllib.Request", "http.client.")


@dataclass
class Result:
    """One call's outcome: `output` (stdout, cut), `error` (None or one line), whether the output was cut, how the
    network was denied in the worker that ran it, its wall time, and whether the pool killed the worker."""
    output: str
    error: Optional[str]
    truncated: bool = False
    network: str = ""
    seconds: float = 0.0
    killed: bool = False


class _Worker:
    def __init__(self, pool: "SandboxPool"):
        self.scratch = tempfile.mkdtemp(prefix="sandbox-")
        args = json.dumps({"memory_mb": pool.memory_mb, "network": pool.network, "scratch": self.scratch})
        self.proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(__file__), "worker", args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self._buf = b""
        try:
            ready = self.read(time.monotonic() + STARTUP_TIMEOUT_S)
        except Exception:
            self.kill()
            raise
        if ready is None or "network" not in ready:
            self.kill()
            raise RuntimeError(f"a sandbox worker did not start: {ready.get('error') if ready else 'no reply'}")
        self.network, self.cpu = ready["network"], ready["cpu"]

    def send(self, msg: dict, cpu_s: float) -> None:
        import resource

        hard = resource.prlimit(self.proc.pid, resource.RLIMIT_CPU)[1]
        soft = int(self.cpu + cpu_s) + 1
        resource.prlimit(self.proc.pid, resource.RLIMIT_CPU, (soft if hard < 0 else min(soft, hard), hard))
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        self.proc.stdin.flush()

    def read(self, deadline: float) -> Optional[dict]:
        """The next reply line, None at EOF (the worker died); TimeoutError at the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> Optional[int]:
        """Kill it (its whole session: anything it started too) and remove its scratch directory; its exit code."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        shutil.rmtree(self.scratch, ignore_errors=True)
        return code


class SandboxPool:
    """Up to `workers` sandboxed Python processes, started on first need, each serving one call at a time.

    workers       calls running at once (more wait for a free worker)
    cpu_s         CPU seconds one call may use (RLIMIT_CPU; SIGXCPU kills the worker)
    wall_s        wall seconds one call may take, then the pool kills the worker (default: 2 x cpu_s + 1)
    memory_mb     RLIMIT_AS of a worker, interpreter included (an allocation beyond it is a MemoryError)
    output_chars  stdout kept per call; the rest is dropped (Result.truncated)
    network       "auto" (a namespace if possible, else the audit hook alone), "netns" (namespace or no worker),
                  "audit" (the audit hook alone)
    """

    def __init__(self, workers: int = 4, cpu_s: float = 1.0, wall_s: Optional[float] = None, memory_mb: int = 256,
                 output_chars: int = 256, network: str = "auto"):
        if workers < 1:
            raise ValueError(f"SandboxPool workers must be >= 1, got {workers}")
        if cpu_s <= 0 or (wall_s is not None and wall_s <= 0):
            raise ValueError(f"SandboxPool cpu_s and wall_s must be > 0, got cpu_s={cpu_s}, wall_s={wall_s}")
        if memory_mb < 64:
            raise ValueError(f"SandboxPool memory_mb must be >= 64 (the interpreter itself needs ~30), got {memory_mb}")
        if network not in ("auto", "netns", "audit"):
            raise ValueError(f"SandboxPool network must be auto, netns or audit, got {network!r}")
        self.workers, self.cpu_s, self.memory_mb, self.output_chars = workers, cpu_s, memory_mb, output_chars
        self.wall_s = wall_s if wall_s is not None else 2 * cpu_s + 1
        self.network = network
        self._idle: list[_Worker] = []
        self._started = 0  # workers alive (idle or busy)
        self._cond = threading.Condition()
        self._closed = False
        self._warned = False
        self.stats = {"calls": 0, "errors": 0, "killed": 0, "started": 0}
        atexit.register(self.close)

    def _take(self) -> _Worker:
        with self._cond:
            while not self._idle and self._started >= self.workers and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("the SandboxPool is closed")
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            w = _Worker(self)
        except BaseException:
            self._drop()
            raise
        with self._cond:
            self.stats["started"] += 1
        if w.network != "netns" and not self._warned:
            self._warned = True
            log.warning("sandbox: no network namespace on this machine (%s); the network is denied by an audit hook "
                        "only, which plain Python code cannot pass but deliberate escape can", w.network)
        return w

    def _give(self, w: _Worker) -> None:
        with self._cond:
            if self._closed:
                w.kill()
                self._started -= 1
            else:
                self._idle.append(w)
            self._cond.notify()

    def _drop(self) -> None:
        with self._cond:
            self._started -= 1
            self._cond.notify()

    def run(self, code: str) -> Result:
        """Run `code` in a worker; never raises for what the code does (that is in Result.error)."""
        w = self._take()
        t0 = time.monotonic()
        with self._cond:
            self.stats["calls"] += 1
        try:
            w.send({"code": code, "output_chars": self.output_chars}, self.cpu_s)
            reply = w.read(t0 + self.wall_s)
        except TimeoutError:
            reply, why = None, f"the call ran longer than {self.wall_s:g} s (wall); the worker was killed and replaced"
        except (BrokenPipeError, OSError, ValueError) as e:
            reply, why = None, f"the worker failed ({type(e).__name__}: {e}); it was killed and replaced"
        else:
            why = None
        if reply is not None:
            w.cpu = reply["cpu"]
            self._give(w)
            with self._cond:
                self.stats["errors"] += reply["error"] is not None
            return Result(reply["output"], reply["error"], reply["truncated"], w.network, time.monotonic() - t0)
        code_ = w.kill()
        self._drop()
        if why is None:
            why = _death(code_, self.cpu_s, self.memory_mb)
        with self._cond:
            self.stats["errors"] += 1
            self.stats["killed"] += 1
        return Result("", why, False, w.network, time.monotonic() - t0, killed=True)

    async def arun(self, code: str) -> Result:
        """run() in a thread: the event loop goes on while the code runs."""
        return await asyncio.to_thread(self.run, code)

    def close(self) -> None:
        """Kill every idle worker; busy ones are killed as their calls return."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._started -= len(idle)
            self._cond.notify_all()
        for w in idle:
            w.kill()


def _death(code: Optional[int], cpu_s: float, memory_mb: int) -> str:
    if code == -signal.SIGXCPU:
        return f"the call exceeded its CPU time limit of {cpu_s:g} s; the worker was killed and replaced"
    if code is not None and code < 0:
        return (f"the worker died of {signal.Signals(-code).name} (memory limit {memory_mb} MiB?); it was "
                "replaced")
    return f"the worker exited with code {code} during the call; it was replaced"


# ---------------------------------------------------------------------------------------------------------------
# The worker process (python -I sandbox.py worker ARGS): stdlib only

def _leave_network(mode: str) -> str:
    """Enter a new network namespace; "netns", or "audit-hook only (why)" where that is not possible."""
    if mode == "audit":
        return "audit-hook only (network=audit)"
    errors = []
    for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
        try:
            if hasattr(os, "unshare"):  # Python >= 3.12
                os.unshare(flags)
            else:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                if libc.unshare(flags) != 0:
                    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            return "netns"
        except (OSError, AttributeError) as e:
            errors.append(f"unshare: {e}")
    return f"audit-hook only ({errors[-1]})"


def _audit(event: str, args) -> None:
    if event.startswith(_DENIED):
        raise PermissionError(f"{event} is not allowed in the sandbox (no network, no processes)")


class _Capped:
    """sys.stdout for a call: keeps the first `limit` characters, counts the rest."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.size, self.dropped = limit, [], 0, 0

    def write(self, s: str) -> int:
        keep = s[:max(0, self.limit - self.size)]
        if keep:
            self.parts.append(keep)
            self.size += len(keep)
        self.dropped += len(s) - len(keep)
        return len(s)

    def flush(self) -> None:
        pass


def _cpu() -> float:
    """CPU seconds this process has used (what RLIMIT_CPU counts)."""
    t = os.times()
    return t.user + t.system


def _call(msg: dict, scratch: str) -> dict:
    import builtins

    out = _Capped(msg["output_chars"])
    error = None
    saved = sys.stdout
    sys.stdout = out
    try:
        g = {"__name__": "__sandbox__", "__builtins__": builtins}
        try:
            code, expr = compile(msg["code"], "<tool>", "eval"), True
        except SyntaxError:
            code, expr = compile(msg["code"], "<tool>", "exec"), False
        value = eval(code, g)
        if expr and value is not None:
            print(repr(value))
    except MemoryError:
        error = "MemoryError"
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the code's, not the worker's
        lines = str(e).strip().splitlines()
        error = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
    finally:
        sys.stdout = saved
        g = None
    for name in os.listdir(scratch):  # the next call starts with an empty directory
        path = os.path.join(scratch, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
    return {"output": "".join(out.parts), "error": error, "truncated": out.dropped > 0, "cpu": _cpu()}


def _worker(args: dict) -> None:
    import resource

    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    network = _leave_network(args["network"])
    if args["network"] == "netns" and network != "netns":
        proto_out.write(json.dumps({"error": f"network=netns but {network}"}).encode() + b"\n")
        proto_out.flush()
        return
    os.chdir(args["scratch"])
    limit = args["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT_BYTES, FILE_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.addaudithook(_audit)
    proto_out.write(json.dumps({"network": network, "cpu": _cpu()}).encode() + b"\n")
    proto_out.flush()
    for line in proto_in:
        reply = _call(json.loads(line), args["scratch"])
        proto_out.write(json.dumps(reply).encode() + b"\n")
        proto_out.flush()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        _worker(json.loads(argv[1]))
    elif argv[:1] == ["check"]:
        pool = SandboxPool(workers=1)
        for code in ("6*7", "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)"):
            r = pool.run(code)
            print(f"{code!r}: output={r.output!r} error={r.error!r} network={r.network!r}")
        pool.close()
    else:
        print(__doc__)


if __name__ == "__main__":
    main()
