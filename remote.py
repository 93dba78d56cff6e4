"""remote.py: the torch.distributed.rpc side of the processes. `init_rpc` (every process joins with it: trainer rank
0, the buffer process, the rollout process), the buffer process's server (`serve`: a buffer.PipelineServer reachable
as RPC worker "buffer") and its client proxy `RemoteBuffer`. buffer.py itself knows nothing of RPC, so it copies into
another project alone; this file needs buffer.py (+ strategies.py) and torch.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed.rpc as rpc

from buffer import PipelineServer

# ---------------------------------------------------------------------------------------------------------
# Serving over torch.distributed.rpc: the buffer process ("buffer") and the client proxy
# ---------------------------------------------------------------------------------------------------------

_SERVER: Optional[PipelineServer] = None  # the buffer process's singleton, reached by _invoke
_METHODS = ("dispatch", "put", "exchange", "get", "wait", "step_boundary", "update_aborts", "set_weight_version",
            "set_max_concurrent_samples", "step_metrics", "stats", "state_dict", "load_state_dict")


def _invoke(method: str, *args):
    """Runs in the buffer process for every RemoteBuffer call."""
    if _SERVER is None:
        raise RuntimeError("no PipelineServer is running in this process; start it with remote.serve(...)")
    if method not in _METHODS:
        raise ValueError(f"buffer method '{method}' is not served; served: {', '.join(_METHODS)}")
    return getattr(_SERVER, method)(*args)


def init_rpc(name: str, rank: int, world_size: int, init_method: str, timeout: float,
             num_worker_threads: int = 32, startup_timeout: Optional[float] = None,
             while_waiting: Optional[Callable[[], None]] = None, hint: str = "") -> None:
    """rpc.init_rpc with a start-up timeout (a worker that never shows up fails the run instead of hanging it).

    `timeout` is every later RPC's timeout and, unless `startup_timeout` is given, the start-up's too.
    `while_waiting` is called about every 0.2 s during start-up (the trainer checks there that its children are
    still alive); `hint` is appended to the timeout message. Under torchrun, TORCHELASTIC_USE_AGENT_STORE makes the
    tcp:// rendezvous look for torchrun's store; it is removed from the environment around this call only.
    """
    # TCP (libuv) only, and tensors over that same connection. TensorPipe's shared-memory transport busy-polls one
    # core per process even when idle (measured: 1.00 core with shm, 0.00 with uv, +0.5 ms per call), and its
    # default channels listen on 16 more ephemeral TCP ports per process; a stray connection to any TensorPipe port
    # (an HTTP health probe of a port that was free a moment ago) aborts the process with std::bad_alloc, so the
    # fewer the better: one per process. Our messages are small CPU tensors; neither buys anything here.
    opts = rpc.TensorPipeRpcBackendOptions(init_method=init_method, rpc_timeout=timeout,
                                           num_worker_threads=num_worker_threads, _transports=["uv"],
                                           _channels=["basic"])
    startup_timeout = timeout if startup_timeout is None else startup_timeout
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    errors: list = []

    def run() -> None:
        try:
            rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=opts)
        except BaseException as e:  # re-raised in the calling thread below
            errors.append(e)

    try:
        th = threading.Thread(target=run, name=f"init_rpc-{name}", daemon=True)
        th.start()
        deadline = time.monotonic() + startup_timeout
        while th.is_alive() and time.monotonic() < deadline:
            if while_waiting is not None:
                while_waiting()
            th.join(min(0.2, max(0.0, deadline - time.monotonic())))
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved
    if th.is_alive():
        raise TimeoutError(f"RPC start-up: worker '{name}' (rank {rank}) waited {startup_timeout:.0f}s at "
                           f"{init_method} and not all {world_size} workers (trainer, buffer, rollout) joined; check "
                           f"that each process started with the same --rpc-init and --world-size{hint}")
    if errors:
        raise RuntimeError(f"RPC start-up of worker '{name}' (rank {rank} of {world_size}) at {init_method} "
                           f"failed: {errors[0]}") from errors[0]


def _exit_when_orphaned(poll_s: float = 2.0) -> None:
    """The buffer process lives as long as its parent: if the trainer dies, nobody will ever call shutdown."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                print(f"buffer: parent process {parent} is gone; exiting", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="buffer-parent-watch", daemon=True).start()


def serve(settings, rpc_init_method: str, rank: int, world_size: int, prompts_per_source: list,
          decode: Optional[Callable[[list], str]] = None, startup_timeout: Optional[float] = None) -> None:
    """Run the buffer process (workers.py starts it, with the prompts of each data source): a PipelineServer of
    `settings` (a BufferSettings, or a validated config.Config) reachable as RPC worker "buffer" until every worker
    shuts down. startup_timeout: how long init_rpc waits for the others (default settings.rpc_timeout_s)."""
    global _SERVER
    torch.set_num_threads(1)  # the buffer only copies; intra-op threads would just contend for the trainer's cores
    # before init_rpc: clients may call as soon as it returns
    _SERVER = PipelineServer(settings, prompts_per_source, decode=decode)
    try:
        init_rpc("buffer", rank, world_size, rpc_init_method, _SERVER.settings.rpc_timeout_s,
                 startup_timeout=startup_timeout)
        _exit_when_orphaned()
        rpc.shutdown(graceful=True)  # returns once the trainer and the rollout have shut down too
    finally:
        _SERVER.close()
        _SERVER = None


_REMOTE_ERRORS = {"TimeoutError": TimeoutError, "ValueError": ValueError}  # kept as their type on the client


class RemoteBuffer:
    """Client proxy of the buffer process: the PipelineServer methods, each one rpc_sync of _invoke.

    Every call times out after `timeout` s (buffer.rpc_timeout_s); get() and dispatch() add their own wait.
    """

    def __init__(self, worker: str = "buffer", timeout: float = 600.0):
        self.worker, self.timeout = worker, float(timeout)
        self._get_timeout: Optional[float] = None  # the server's buffer.get_timeout_s, fetched on first use

    def _call(self, method: str, *args, wait: float = 0.0):
        try:
            return rpc.rpc_sync(self.worker, _invoke, args=(method, *args), timeout=self.timeout + wait)
        except RuntimeError as e:  # torch RPC re-raises remote errors as RuntimeError("<Type>: On WorkerInfo...")
            kind = _REMOTE_ERRORS.get(str(e).split(":", 1)[0], RuntimeError)
            raise kind(f"buffer.{method} on RPC worker '{self.worker}' failed: {e}") from e

    def dispatch(self, max_groups: Optional[int] = None, timeout: float = 0.0) -> list:
        return self._call("dispatch", max_groups, timeout, wait=timeout)

    def put(self, trajs: list) -> None:
        return self._call("put", trajs)

    def exchange(self, trajs: list, max_groups: Optional[int]) -> list:
        return self._call("exchange", trajs, max_groups)

    def get(self, k: int, timeout: Optional[float] = None) -> list:
        if timeout is None:
            if self._get_timeout is None:
                self._get_timeout = self.stats()["get_timeout_s"]
            timeout = self._get_timeout
        return self._call("get", k, timeout, wait=timeout)

    def wait(self, k: int, timeout: float) -> dict:
        return self._call("wait", k, timeout, wait=timeout)

    def step_boundary(self, returned: list, keep_in_flight: bool = False) -> dict:
        return self._call("step_boundary", returned, keep_in_flight)

    def update_aborts(self) -> list:
        return self._call("update_aborts")

    def set_weight_version(self, v: int) -> None:
        return self._call("set_weight_version", v)

    def set_max_concurrent_samples(self, value: int) -> None:
        return self._call("set_max_concurrent_samples", value)

    def step_metrics(self) -> dict:
        return self._call("step_metrics")

    def stats(self, keys: bool = False) -> dict:
        return self._call("stats", keys)

    def state_dict(self) -> dict:
        return self._call("state_dict")

    def load_state_dict(self, sd: dict) -> None:
        return self._call("load_state_dict", sd)
