"""remote.py: the torch.distributed.rpc side of the processes, one shape for every served object.

- `init_rpc`: every process joins with it (trainer rank 0, the buffer process, the rollout process).
- `serve_object`: a process serves one object as an RPC worker; `Proxy` is its client in the other processes. Which
  methods cross is one table per served object, here: BUFFER_METHODS (buffer.PipelineServer, RPC worker "buffer",
  served by `serve_buffer`) and ROLLOUT_METHODS (rollout.Rollout, RPC worker "rollout", served by
  workers.serve_rollout). The proxy offers those methods and no others, the serving side calls no others.
  (remote.RemoteBuffer and rollout.RemoteRollout, the proxies written out per method, are refused naming Proxy.)
buffer.py itself knows nothing of RPC, so it copies into another project alone; this file needs buffer.py
(+ strategies.py) and torch.
"""
from __future__ import annotations

import ast
import contextlib
import datetime
import functools
import ipaddress
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, ContextManager, NamedTuple, Optional
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.constants import default_pg_timeout

from buffer import PipelineServer


class Served(NamedTuple):
    """How a proxy calls one served method. timeout_arg: the position (self not counted) of the `timeout` argument
    of a method that waits up to that long, whose RPC then times out after the proxy's timeout plus that wait; None:
    the method answers at once, within the proxy's timeout."""
    timeout_arg: Optional[int] = None


AT_ONCE = Served()
# What each served object answers over RPC: {method: Served}.
BUFFER_METHODS = {"dispatch": Served(timeout_arg=1), "put": AT_ONCE, "exchange": AT_ONCE,
                  "get": Served(timeout_arg=1), "wait": Served(timeout_arg=1), "step_boundary": AT_ONCE,
                  "boundary_aborts": AT_ONCE, "set_weight_version": AT_ONCE, "set_max_concurrent_samples": AT_ONCE,
                  "step_metrics": AT_ONCE, "stats": AT_ONCE, "state_dict": AT_ONCE, "load_state_dict": AT_ONCE}
ROLLOUT_METHODS = {"start": AT_ONCE, "pause": AT_ONCE, "resume": AT_ONCE, "step_metrics": AT_ONCE, "stop": AT_ONCE}


LOOPBACK_IFNAME = "lo"  # Linux's loopback interface: where TensorPipe listens (TP_SOCKET_IFNAME, read by torch's
# tensorpipe_agent.cpp guessAddress; without it TensorPipe listens on the address the hostname resolves to)
_SCHEME = "asyncrl-loopback"  # the rendezvous init_rpc uses for a tcp:// init method (_loopback_rendezvous)


def loopback_init(init_method: str) -> tuple[str, int]:
    """(host, port) of an RPC init method tcp://HOST:PORT whose HOST is a loopback address; anything else is refused:
    torch RPC runs any pickled callable a peer sends (rpc_sync(worker, os.system, ...)) without authentication, so its
    ports listen on loopback only, and the three processes that use it (trainer rank 0, buffer, rollout) share
    node 0."""
    url = urlparse(init_method)
    try:
        loopback = url.scheme == "tcp" and url.port is not None and ipaddress.ip_address(url.hostname).is_loopback
    except (TypeError, ValueError):  # no host, a host name, or a port out of range
        loopback = False
    if not loopback:
        raise ValueError(f"RPC init method {init_method!r}: expected tcp://<loopback address>:<port>, e.g. "
                         "tcp://127.0.0.1:29500 (RPC listens on loopback only: any peer that reaches it can run code "
                         "in every process)")
    return url.hostname, url.port


def _loopback_rendezvous(url: str, timeout: datetime.timedelta = default_pg_timeout, **kwargs):
    """torch.distributed.rendezvous handler of _SCHEME: the RPC's TCPStore, its server (rank 0) listening on the
    loopback address of the URL only. torch's own tcp:// handler starts a TCPStore server listening on every
    interface (its host is where clients connect, not where it binds); a socket bound here and handed over as
    master_listen_fd is the store's only listener."""
    parsed = urlparse(url)
    query = dict(parse_qsl(parsed.query))
    rank, world_size = int(query["rank"]), int(query["world_size"])
    host, port = parsed.hostname, parsed.port
    listen_fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listen_fd = socket.create_server((host, port), family=family).detach()  # the store owns and closes it
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, master_listen_fd=listen_fd)
    yield store, rank, world_size
    raise RuntimeError(f"{_SCHEME}:// rendezvous: a second rendezvous on the same store is not supported")


with contextlib.suppress(RuntimeError):  # (already registered: this module imported twice under two names)
    dist.register_rendezvous_handler(_SCHEME, _loopback_rendezvous)


def init_rpc(name: str, rank: int, world_size: int, init_method: str, timeout: float,
             num_worker_threads: int = 32, startup_timeout: Optional[float] = None,
             while_waiting: Optional[Callable[[], None]] = None, hint: str = "") -> None:
    """rpc.init_rpc on loopback, with a start-up timeout (a worker that never shows up fails the run instead of
    hanging it).

    `init_method` is tcp://<loopback address>:<port> (loopback_init); rank 0 serves the rendezvous store there,
    bound to that address only (_loopback_rendezvous), and every worker's TensorPipe listens on the loopback
    interface (TP_SOCKET_IFNAME, set around this call). `timeout` is every later RPC's timeout and, unless
    `startup_timeout` is given, the start-up's too. `while_waiting` is called about every 0.2 s during start-up (the
    trainer checks there that its children are still alive); `hint` is appended to the timeout message.
    """
    host, port = loopback_init(init_method)
    # TCP (libuv) only, and tensors over that same connection. TensorPipe's shared-memory transport busy-polls one
    # core per process even when idle, and its default channels listen on 16 more ephemeral TCP ports per process; a
    # stray connection to any TensorPipe port (an HTTP health probe of a port that was free a moment ago) aborts the
    # process with std::bad_alloc, so the fewer the better: one per process. Our messages are small CPU tensors;
    # neither buys anything here.
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"{_SCHEME}://{netloc}", rpc_timeout=timeout,
                                           num_worker_threads=num_worker_threads, _transports=["uv"],
                                           _channels=["basic"])
    startup_timeout = timeout if startup_timeout is None else startup_timeout
    saved = os.environ.get("TP_SOCKET_IFNAME")
    os.environ["TP_SOCKET_IFNAME"] = LOOPBACK_IFNAME
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
        if saved is None:
            os.environ.pop("TP_SOCKET_IFNAME", None)
        else:
            os.environ["TP_SOCKET_IFNAME"] = saved
    if th.is_alive():
        raise TimeoutError(f"RPC start-up: worker '{name}' (rank {rank}) waited {startup_timeout:.0f}s at "
                           f"{init_method} and not all {world_size} workers (trainer, buffer, rollout) joined; check "
                           f"that each process started with the same --rpc-init and --world-size{hint}")
    if errors:
        raise RuntimeError(f"RPC start-up of worker '{name}' (rank {rank} of {world_size}) at {init_method} "
                           f"failed: {errors[0]}") from errors[0]


# ---------------------------------------------------------------------------------------------------------
# The serving side: one object per process, reached by _invoke
# ---------------------------------------------------------------------------------------------------------

_NAME, _OBJECT, _METHODS = "", None, {}  # this process's served object and its table (serve_object sets them)
_READY = threading.Event()  # set once serve_object has built _OBJECT, or failed to
_READY_TIMEOUT_S = 0.0  # how long a call that arrives during the build waits for it


def _invoke(method: str, *args, **kwargs):
    """Runs in the serving process for every Proxy call: one method of the served object that its table lists."""
    if not _READY.wait(_READY_TIMEOUT_S) or _OBJECT is None:
        raise RuntimeError(f"RPC worker '{_NAME}' built nothing to serve within {_READY_TIMEOUT_S:.0f} s; see its "
                           "log for the start-up error")
    if method not in _METHODS:
        raise ValueError(f"{_NAME} method '{method}' is not served; served: {', '.join(_METHODS)}")
    return getattr(_OBJECT, method)(*args, **kwargs)


def _exit_when_orphaned(name: str, poll_s: float = 2.0) -> None:
    """A served process lives as long as its parent: if the trainer dies, nobody will ever call shutdown."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                print(f"{name}: parent process {parent} is gone; exiting", file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name=f"{name}-parent-watch", daemon=True).start()


def serve_object(name: str, methods: dict, make: Callable[[], ContextManager], rpc_init_method: str, rank: int,
                 world_size: int, timeout: float, startup_timeout: Optional[float] = None) -> None:
    """Serve one object of this process as RPC worker `name` until every worker has shut down. Joins RPC first
    (waiting up to startup_timeout for the others, default `timeout`, the later calls' RPC timeout), then builds
    the object by entering `make()`, a context manager whose exit closes it: building may call the other workers
    (the rollout asks the buffer), and a call that arrives meanwhile waits for it, up to startup_timeout. Only the
    methods in `methods` are served."""
    global _NAME, _OBJECT, _METHODS, _READY_TIMEOUT_S
    _NAME, _METHODS = name, methods
    _READY.clear()
    _READY_TIMEOUT_S = timeout if startup_timeout is None else startup_timeout
    init_rpc(name, rank, world_size, rpc_init_method, timeout, startup_timeout=startup_timeout)
    _exit_when_orphaned(name)
    try:
        with contextlib.ExitStack() as stack:
            try:
                _OBJECT = stack.enter_context(make())
            finally:
                _READY.set()  # calls waiting in _invoke get the object, or the error that it is missing
            rpc.shutdown(graceful=True)  # returns once every other worker has shut down too
    finally:
        _OBJECT = None


def serve_buffer(settings, rpc_init_method: str, rank: int, world_size: int, prompts_per_source: list,
                 decode: Optional[Callable[[list], str]] = None, startup_timeout: Optional[float] = None) -> None:
    """The buffer process (workers.py starts it, with the prompts of each data source): a PipelineServer of
    `settings` (a BufferSettings, or a validated config.Config) served as RPC worker "buffer" (BUFFER_METHODS).
    startup_timeout: how long init_rpc waits for the others (default buffer.rpc_timeout_s)."""
    torch.set_num_threads(1)  # the buffer only copies; intra-op threads would just contend for the trainer's cores
    # built before joining RPC: its settings give the RPC timeout, and bad ones fail before the others wait
    with contextlib.closing(PipelineServer(settings, prompts_per_source, decode=decode)) as server:
        serve_object("buffer", BUFFER_METHODS, lambda: contextlib.nullcontext(server), rpc_init_method, rank,
                     world_size, server.settings.rpc_timeout_s, startup_timeout)


# ---------------------------------------------------------------------------------------------------------
# The client side
# ---------------------------------------------------------------------------------------------------------

class RemoteError(RuntimeError):
    """A served object's method failed in its process, or its RPC did not answer in time. The first line of the
    message names the call, the process and the cause (services.failure_exit_code prints it as the run's error
    line); the served process's traceback follows."""


class RemoteTimeoutError(RemoteError, TimeoutError):
    pass


class RemoteValueError(RemoteError, ValueError):
    pass


_REMOTE_ERRORS = {"TimeoutError": RemoteTimeoutError, "ValueError": RemoteValueError}  # still their type here


def _remote_error(text: str) -> tuple[str, str]:
    """(type name: message, traceback) of an error raised in a served process, from the text torch RPC gives the
    caller ("Type: On WorkerInfo(id=.., name=..):\nType('message')\nTraceback ..."); any other text is the message."""
    head, _, rest = text.partition("\n")
    kind, on, _ = head.partition(": On WorkerInfo(")
    if not on:
        return text, ""
    rep, _, trace = rest.partition("\n")
    try:
        message = ast.literal_eval(rep[rep.index("("):])  # Type('message') -> 'message'
    except (ValueError, SyntaxError):
        message = None
    return f"{kind}: {message if isinstance(message, str) else rep}", trace


class Proxy:
    """An object that another process serves (serve_object), called as if it were here: each method of `methods`
    (its table: BUFFER_METHODS, ROLLOUT_METHODS) is one rpc_sync of _invoke there, any other name is refused.

        buf = remote.Proxy("buffer", cfg.buffer.rpc_timeout_s, remote.BUFFER_METHODS)
        groups = buf.get(4, 30.0)

    Every call times out after `timeout` s (`timeout_name`: buffer.rpc_timeout_s), one that waits (its table's
    Served.timeout_arg names its `timeout` argument) after that plus its own wait, and a method in `waits` ({method:
    (s, what bounds it)}: rollout.rpc_waits) after that plus its own bound, so that its own error arrives first. An
    error raised there is raised here as RemoteError (RemoteTimeoutError, RemoteValueError: still TimeoutError and
    ValueError), an RPC that does not answer in time as RemoteTimeoutError; each message's first line names the
    call (`buffer.get()`), the process (`where`, default the RPC worker) and the cause.
    """

    def __init__(self, worker: str, timeout: float, methods: dict, waits: Optional[dict] = None,
                 where: Optional[str] = None, timeout_name: str = "buffer.rpc_timeout_s"):
        self.worker, self.timeout, self.methods, self.waits = worker, float(timeout), methods, waits or {}
        self.where, self.timeout_name = where or f"RPC worker '{worker}'", timeout_name

    def __getattr__(self, method: str):
        methods = self.__dict__.get("methods", {})
        if method not in methods:
            raise AttributeError(f"RPC worker '{self.__dict__.get('worker')}' serves no method '{method}'; served: "
                                 f"{', '.join(methods)}")
        return functools.partial(self._call, method)

    def __dir__(self):
        return sorted({*super().__dir__(), *self.methods})

    def _call(self, method: str, *args, **kwargs) -> Any:
        wait, at = 0.0, self.methods[method].timeout_arg
        if at is not None:
            wait = kwargs.get("timeout", args[at] if len(args) > at else None)
            if wait is None:
                raise ValueError(f"{method} over RPC needs its timeout (argument {at + 1}): the call waits "
                                 f"{self.timeout} s ({self.timeout_name}) plus that")
        own, bound = self.waits.get(method, (0.0, ""))
        timeout = self.timeout + wait + own
        call = f"{self.worker}.{method}()"
        try:
            return rpc.rpc_sync(self.worker, _invoke, args=(method, *args), kwargs=kwargs, timeout=timeout)
        except RuntimeError as e:  # torch RPC re-raises remote errors as RuntimeError("<Type>: On WorkerInfo...")
            if "ran for more than set timeout" in str(e):  # torch RPC's own timeout: no answer came back
                parts = [f"{self.timeout_name}={self.timeout:g} s"]
                parts += [f"its timeout argument {wait:g} s"] if at is not None else []
                parts += [bound] if own else []
                raise RemoteTimeoutError(f"{call} in {self.where} did not answer within {timeout:g} s "
                                         f"({' + '.join(parts)}); it may still be running there") from e
            message, trace = _remote_error(str(e))
            kind = _REMOTE_ERRORS.get(message.split(":", 1)[0], RemoteError)
            raise kind(f"{call} in {self.where} failed: {message}" + (f"\n{trace}" if trace else "")) from e
