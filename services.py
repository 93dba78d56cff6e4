"""services.py: what rank 0 of train.py starts and supervises, kept apart from the training step.

The inference servers (standins/engine.py on CPU, SGLang on GPUs: launched on rollout.base_port + i, health-checked,
relaunched when one dies), the buffer process (`python workers.py buffer`) and the rollout process (`python workers.py
rollout`), RPC between them and the trainer, a watcher thread that stops the run with the root cause when a child dies,
and the orderly stop of all of it. train.py makes one `Services(cfg)` on rank 0: `launch_servers(wait=False)` before the
model loads, then `start_fleet(wait=False)` (the other nodes' URLs and the fleet client), `spawn_rpc_workers`,
`wait_fleet` (the servers' /health), `join_rpc`, `watch` and `close`, so that the servers', the workers' and the
model's start-ups overlap (colocate: `start_fleet` before the model loads, which waits). Servers are placed per node
(rollout.server_layout): the local rank 0 of every other trainer node launches and supervises its own (`for_node`,
`serve_node`) and publishes their URLs in the torchrun store, where rank 0 collects them; every other rank starts
nothing. Restarts (docs/faults.md): the servers run under lease.py and outlive a crashed attempt, recorded in
run_dir/servers, for the next attempt to take over (`_spawn_servers`, `_take_over`); `attempt_store` gives every
torchrun attempt its own keys in torchrun's store.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import config as config_lib
import lease
import remote

ROOT = os.path.dirname(os.path.abspath(__file__))


_LIBC = ctypes.CDLL(None)  # loaded here, not in the forked child (no loader lock taken between fork and exec)


def _die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the trainer dies, even by SIGKILL (Linux PR_SET_PDEATHSIG)."""
    _LIBC.prctl(1, signal.SIGTERM)


# torchrun's per-worker variables: a child process is not a trainer rank.
TRAINER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


def exit_process(code: int = 0) -> None:
    """End this process (a trainer rank, a worker, a server) once its work is done and its files are closed: the
    exit handlers run (atexit: wandb, a sandbox pool), then the process leaves without the interpreter's teardown of
    torch and transformers. That teardown took ~1.4 s of every trainer rank's exit (torchrun waits for the slowest)
    and ~1 s of each child's (services.close waits for them), and a gloo group a peer has already closed can abort
    in its destructor there (SIGABRT, "terminate called without an active exception")."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_PORT_RNG = random.SystemRandom()  # not the `random` module's: train.py seeds that with the config's `seed`, and two
# runs started together then drew the same port (EADDRINUSE at the RPC rendezvous, seen with two tests at once)


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port p with p .. p + span - 1 free on `host`, drawn at random from 10000-28999: below the kernel's
    ephemeral range (Linux: 32768+ by default), from which bind(0) and every outgoing connection take theirs, so a
    port found free there can be a connection's by the time the service binds it (EADDRINUSE), and a stray
    connection to an RPC port aborts TensorPipe; and below the fixed defaults (torchrun's 29500,
    weight_sync.master_port 29700, rollout.base_port 31000 + server index), which a server may not have bound yet."""
    high = 29000
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        high = min(high, int(f.read().split()[0]))
    for _ in range(1000):
        port = _PORT_RNG.randrange(10000, max(10001, high - span + 1))
        try:
            for q in range(port, port + span):
                with socket.socket() as sock:
                    sock.bind((host, q))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {span} free consecutive port(s) on {host} in 10000-{high - 1} after 1000 tries")


URL_KEY = "asyncrl/server_url/"  # + server index: its URL (or "error: ..."), in the torchrun store
ATTEMPT_KEY = "asyncrl/attempt/"  # the handshake of attempt_store, in torchrun's own store


def attempt_store(timeout_s: float):
    """Under torchrun: a client of torchrun's store, under a key prefix that this attempt of the workers alone uses.

    torchrun hands every attempt the same store. Torch 2.13's DynamicRendezvousHandler.next_rendezvous
    (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py; the c10d rendezvous of --standalone and
    --rdzv_backend c10d) creates its shared TCPStore server at the first round and returns the same MASTER_PORT on
    every later one, and StaticTCPRendezvous keeps its store too; with TORCHELASTIC_USE_AGENT_STORE=True,
    rendezvous._create_c10d_store (torch/distributed/rendezvous.py) gives each rank a plain client of it, with no
    per-attempt prefix ("We create a new TCPStore for every retry", its comment says; no longer so). So after a
    torchrun restart the keys of the attempt that died are still there, and a rank reads them as this attempt's:
    init_process_group's gloo connectFullMesh on rank 1 read rank 0's address of the killed attempt and dialled a
    port nobody listens on ("Connection refused"), and URL_KEY would be read stale the same way.
    TORCHELASTIC_RESTART_COUNT cannot name the attempt: each node's agent counts its own restarts
    (pytorch/pytorch#135712). So rank 0 draws a new prefix and hands it to every other rank under a key named by a
    nonce of that rank's own, which no earlier attempt can have written; each rank acknowledges under the new
    prefix, and rank 0 goes on once all have. None outside torchrun's agent store (init_process_group makes its
    own store then: a new one per attempt)."""
    import datetime

    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(agree_prefix(store, rank, world, timeout_s), store)


def agree_prefix(store, rank: int, world: int, timeout_s: float) -> str:
    """attempt_store's handshake: the key prefix rank 0 draws, known to every rank once each has acknowledged it."""
    import uuid

    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{ATTEMPT_KEY}hello/{rank}", nonce)
        prefix = store.get(f"{ATTEMPT_KEY}welcome/{nonce}").decode()  # waits up to the store's timeout
        store.set(f"{prefix}ack/{rank}", "1")
        return prefix
    prefix, seen, pending = f"asyncrl/{uuid.uuid4().hex}/", {}, set(range(1, world))
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in sorted(pending):
            if store.check([f"{prefix}ack/{r}"]):
                pending.discard(r)
            elif store.check([f"{ATTEMPT_KEY}hello/{r}"]):
                nonce = store.get(f"{ATTEMPT_KEY}hello/{r}").decode()  # an earlier attempt's, or this one's
                if seen.get(r) != nonce:
                    store.set(f"{ATTEMPT_KEY}welcome/{nonce}", prefix)
                    seen[r] = nonce
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"trainer ranks {sorted(pending)} did not join this torchrun attempt's store within "
                               f"{timeout_s:.0f} s (weight_sync.timeout_s)")
        time.sleep(0.02 if pending else 0)
    return prefix


def _store():
    """torchrun's store (the default process group's), which every trainer rank reaches."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def node_address() -> str:
    """The address this node reaches the rendezvous (torchrun's MASTER_ADDR) from: how the other nodes reach it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # connect() on UDP sends nothing: a route lookup
        s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))))
        return s.getsockname()[0]


def _loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def server_address(host: str, node: int) -> str:
    """The host of a launched server's URL (rollout.sglang_args.host): node 0's wildcard binds are reached on
    127.0.0.1 (the rollout process runs there too), other nodes' on the node's rendezvous address."""
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1" if node == 0 else node_address()
    if node != 0 and _loopback(host) and not _loopback(node_address()):
        raise ValueError(f"rollout.sglang_args.host={host} binds the servers of node {node} to loopback, where "
                         "trainer rank 0 on another machine cannot reach them; set rollout.sglang_args.host=0.0.0.0 "
                         "or this node's address")
    return host


def master_address(cfg, launched: bool) -> str:
    """Where the servers reach trainer rank 0's weight-update group (weight_sync.master_address when set):
    127.0.0.1 when every server is one rank 0 launched on its own node; the rendezvous address (torchrun's
    MASTER_ADDR, which every trainer node reached) for servers launched on other nodes; for servers to connect to,
    the address of this machine's route to the first of them."""
    r = cfg.rollout
    if cfg.weight_sync.master_address:
        return cfg.weight_sync.master_address
    if launched:
        return "127.0.0.1" if all(s.node == 0 for s in r.server_layout) else os.environ["MASTER_ADDR"]
    from urllib.parse import urlparse

    url = urlparse(r.router_url or r.servers[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((url.hostname, url.port or 80))
        return s.getsockname()[0]


def check_gpu_overlap(cfg, node: int, use_cuda: bool, visible: Optional[str]) -> None:
    """Disaggregated runs on GPUs: no server launched on this node may use a GPU of this node's trainer ranks
    (the first trainer.num_gpus_per_node of CUDA_VISIBLE_DEVICES, or GPUs 0 .. num_gpus_per_node - 1)."""
    r, n = cfg.rollout, cfg.trainer.num_gpus_per_node
    if (cfg.colocate or not use_cuda or r.servers or r.router_url or r.launch == "none"
            or cfg.run_mode == "rollout-only"):
        return
    trainer = visible.split(",")[:n] if visible else [str(g) for g in range(n)]
    for i, s in enumerate(r.server_layout):
        shared = sorted(str(g) for g in s.gpus if str(g) in trainer) if s.node == node else []
        if shared:
            raise ValueError(f"rollout.server_layout[{i}] uses GPU {', '.join(shared)} of node {node}, which the "
                             f"node's {n} trainer ranks use "
                             f"(CUDA_VISIBLE_DEVICES={visible or f'unset, GPUs 0-{n - 1}'}); "
                             "give the servers other GPUs, start torchrun with CUDA_VISIBLE_DEVICES naming the "
                             "trainer's, or set colocate=true to share them")


def _launch_args(cmd: list) -> list:
    """A server's command line without its --weight-version: what must match for a recorded server to be reused."""
    at = cmd.index("--weight-version")
    return cmd[:at] + cmd[at + 2:]


KEY_FILE = "api_key.yaml"  # under run_dir/servers: the launched servers' key, when rollout.sglang_args.api_key_file
# is not set


def key_file(cfg) -> str:
    """The launched servers' key file (sglang_client.make_key_file: one line `api-key: KEY`, mode 0600): the run's
    rollout.sglang_args.api_key_file, else run_dir/servers/api_key.yaml, made with a new key if missing and kept for
    the run's later attempts (their servers are reused). Every launched server gets a key, on loopback too: a local
    user or a process in another network namespace then cannot load weights into it, move its weight version or
    join its weight-update group. It reaches the server as SGLang's --config file and the clients (sglang_client.
    Fleet, lease.takeover) read it there; it is on no command line, in no record and not in config.yaml, which
    names the file (this sets rollout.sglang_args.api_key_file to it)."""
    import sglang_client

    a = cfg.rollout.sglang_args
    path = os.path.abspath(a.api_key_file or os.path.join(cfg.run_dir, "servers", KEY_FILE))
    if a.api_key_file:
        sglang_client.read_key_file(path)  # refused here, before a server starts, if unreadable or open to others
    else:
        sglang_client.make_key_file(path)
    a.api_key_file = path
    return path


def share_key(cfg, rank: int, local_rank: int, group) -> None:
    """Every trainer rank, before any server starts: with launched servers on other nodes than 0 and no
    rollout.sglang_args.api_key_file, rank 0's key (key_file) is handed to each other node's local rank 0 over the
    control group, which writes it to its own run_dir/servers/api_key.yaml (the nodes' run_dir may be disks of
    their own): every server of the run, and rank 0's clients, share one key."""
    import torch.distributed as dist

    import sglang_client

    r = cfg.rollout
    launched = cfg.run_mode != "train-only" and not r.servers and not r.router_url and r.launch != "none"
    if not launched or r.sglang_args.api_key_file or all(s.node == 0 for s in r.server_layout):
        return
    box = [sglang_client.read_key_file(key_file(cfg)) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    if rank != 0 and local_rank == 0:
        sglang_client.make_key_file(os.path.join(cfg.run_dir, "servers", KEY_FILE), box[0])


class ChildExited(RuntimeError):
    """A child of rank 0 exited: the message is the root-cause report (Services.report)."""


WATCH_S = 0.2  # how often rank 0's watcher looks at its children
RANK0_EXIT_WAIT_S = 30.0  # a rank other than 0 that fails with rank 0 waits this long for torchrun to stop it
GRACE_S = 3.0  # after a child died: how long the main thread has to fail on its own before the watcher stops the run


class Services:
    """Everything a trainer process starts, and their orderly stop (also on error): rank 0 the servers of its
    node, the buffer, the rollout and RPC; the local rank 0 of another node the servers of that node.

    Root cause first: when a child exits, the run's error is Services.report (the child, its exit code or signal,
    its log and the log's last lines), not the RPC or socket error that its death causes elsewhere. A watcher
    thread stops the run (exit code 1) GRACE_S after a child died if the main thread is blocked (e.g. waiting
    for groups from a producer that is gone) rather than failing on its own."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.procs: dict = {}  # name -> (Popen, log path), in start order
        self.logs = os.path.join(cfg.run_dir, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.rpc_up = False
        self.fleet = None  # rank 0's sglang_client.SyncFleet, closed last
        self.closing = threading.Event()
        self._reported = threading.Lock()
        self.servers: dict = {}  # name -> (command, env, URL) of each server launched here: relaunched if it dies
        self.relaunching: set = set()
        self.replaced: set = set()  # relaunched since the weight-update group last formed (weight_sync.WeightSync.sync)
        self.server_restarts = 0
        self.starting: dict = {}  # node -> {i: URL} of servers started by launch_servers(wait=False), not yet waited
        self.rpc_init = None  # spawn_rpc_workers' tcp:// address, which join_rpc joins
        self.node = 0  # the node whose servers this launches (launch_servers)
        self.record: dict = {}  # run_dir/servers/node<N>.json as this attempt writes it (lease.py)
        self.lease: Optional[lease.Lease] = None  # renewed while this attempt runs; servers stop when it lapses
        self.adopted: set = set()  # servers of an earlier attempt kept, not yet taken over (launch_servers)
        self.stale_group: Optional[str] = None  # the weight-update group an earlier attempt left on them

    def spawn(self, name: str, cmd: list, env: Optional[dict] = None):
        """Start a child in a session of its own, its output appended to logs/<name>.log: the SIGTERM torchrun
        forwards to the trainer rank's process group (a preemption, preemption.py) does not reach it, so the buffer
        is still there when rank 0 checkpoints its state. A launched server (in self.servers) runs under lease.py:
        it outlives this process for rollout.server_keepalive_s, for a restarted attempt to reuse; the buffer and
        rollout processes die with it (PR_SET_PDEATHSIG, _die_with_parent)."""
        log = os.path.join(self.logs, f"{name}.log")
        server = name in self.servers
        if server:
            cmd = [sys.executable, os.path.join(ROOT, "lease.py"), "--lease", self.lease.path, "--keepalive-s",
                   str(self.cfg.rollout.server_keepalive_s), "--", *cmd]
        # a server's log is its owner's alone: SGLang 0.5.23 logs its resolved arguments, the api key included
        with open(os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600 if server else 0o644), "ab") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                 start_new_session=True, preexec_fn=None if server else _die_with_parent)
        self.procs[name] = (p, log)
        if server:
            self._record(name, pid=p.pid, started=lease.start_time(p.pid),
                         weight_version=int(cmd[cmd.index("--weight-version") + 1]))
        return p

    def exited(self) -> list[str]:
        return [name for name, (p, _) in self.procs.items()
                if (p.exited() if isinstance(p, lease.Adopted) else p.poll() is not None)]

    def report(self, name: str, tail: int = 15) -> str:
        """One line naming the child, how it ended and its log, then the log's last `tail` lines."""
        p, log = self.procs[name]
        rc = p.returncode
        how = ("is gone (an earlier attempt launched it: its exit status went there)" if rc is None else
               f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}")
        with contextlib.suppress(OSError), open(log, errors="replace") as f:
            lines = f.readlines()[-tail:] if tail else []
            return f"the {name} process (pid {p.pid}) {how}; its log {log} ends with:\n" + "".join(
                f"  | {line}" for line in lines).rstrip("\n")
        return f"the {name} process (pid {p.pid}) {how}; its log {log} could not be read"

    def root_cause(self, wait_s: float) -> Optional[str]:
        """The report of a child that exited, waiting up to wait_s for one (its death and the error it causes
        elsewhere arrive in either order); None if every child is running."""
        deadline = time.monotonic() + wait_s
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self.exited()
        return self.report(dead[0]) if dead else None

    def check_alive(self, waiting_for: str) -> None:
        dead = self.exited()
        if dead:
            raise ChildExited(f"{self.report(dead[0])}\n(while {waiting_for})")

    def print_error_once(self, message: str) -> bool:
        """Print `error: message` to stderr unless the watcher or the main thread already did."""
        if not self._reported.acquire(blocking=False):
            return False
        print(f"error: {message}", file=sys.stderr, flush=True)
        return True

    def watch(self) -> None:
        """Start the watcher thread (see the class doc)."""
        def loop():
            while not self.closing.wait(WATCH_S):
                dead = self.exited()
                try:
                    for name in dead:  # not while the lease lapsed for a stalled step loop: its servers stop
                        if name in self.servers and not (self.lease and self.lease.lapsed):
                            self.relaunch(name)
                    dead = [n for n in dead if n not in self.servers]
                except Exception as e:  # the relaunched server did not come up: no replacement, stop the run
                    if not self.closing.is_set() and self.print_error_once(f"relaunching a server failed: {e}"):
                        self.stop_children(keep_servers=restarts_left())
                        os._exit(1)
                if dead and not self.closing.wait(GRACE_S) and self.print_error_once(self.report(dead[0])):
                    # the main thread is blocked in a call that will not return; the buffer and rollout follow us
                    self.stop_children(keep_servers=restarts_left())
                    os._exit(1)
        threading.Thread(target=loop, name="child-watcher", daemon=True).start()

    def launch_servers(self, version: int, node: int = 0, wait: bool = True) -> dict[int, str]:
        """rollout.launch engine | sglang: the entries of rollout.server_layout on `node`, server i on base_port + i;
        returns {i: URL} once every one answers /health. wait=False: returns once they are started, and the next
        call for the node waits for them (train.py starts the servers before the model loads). Servers an earlier
        attempt of the run left running are kept (_spawn_servers) and, when waited for, brought to a known state
        (lease.takeover), or replaced if that fails."""
        if node in self.starting:
            urls = self.starting.pop(node)
        else:
            urls = self._spawn_servers(version, node)
        if not wait:
            self.starting[node] = urls
            return urls
        reused = self._take_over(urls)
        self.wait_healthy(list(urls.values()))
        if urls:
            print(f"[train] node {node} " + ", ".join(
                f"{'reused' if i in reused else 'launched'} server_{i} on {u} (pid {self.procs[f'server_{i}'][0].pid}"
                f"{reused.get(i, '')})" for i, u in urls.items()), flush=True)
        return urls

    def _spawn_servers(self, version: int, node: int) -> dict[int, str]:
        """Start the node's servers, or keep those an earlier attempt recorded (run_dir/servers/node<N>.json) that
        still run with this run's launch arguments, when rollout.reuse_servers allows (colocate: never; whether the
        dead trainer had their memory released is unknown); any other recorded one still running is stopped."""
        r = self.cfg.rollout
        self.node = node
        path, lease_path = lease.paths(self.cfg.run_dir, node)
        earlier = lease.read_record(path)
        self.stale_group = earlier.get("weight_group")
        self.record = {"node": node, "weight_group": None, "servers": {}}
        self.lease = self.lease or lease.Lease(lease_path, config_lib.server_stall_s(self.cfg))
        self.lease.start()
        ours = {f"server_{i}" for i, layout in enumerate(r.server_layout) if layout.node == node}
        for name, old in earlier.get("servers", {}).items():  # kept alive by our lease, which no one would end
            proc = None if name in ours else lease.adopt(old, name, lease_path)
            if proc is not None:
                print(f"[train] stopping {name} (pid {proc.pid}), which an earlier attempt launched: this run's "
                      f"rollout.server_layout has no {name} on node {node}", flush=True)
                lease.stop(proc)
        named = {old["pid"] for old in earlier.get("servers", {}).values()}
        for pid in lease.watchdogs(lease_path):  # under our lease but in no record (a refused one's): kept alive by
            started = lease.start_time(pid)  # our renewal, unknown to us
            if pid not in named and started is not None:
                print(f"[train] stopping pid {pid}, a server under this node's lease {lease_path} that no record "
                      "names", flush=True)
                lease.stop(lease.Adopted(pid, started))
        urls = {}
        for i, layout in enumerate(r.server_layout):
            if layout.node != node:
                continue
            name, port = f"server_{i}", r.base_port + i
            cmd, env = self._server_command(layout, port, version)
            urls[i] = f"http://{server_address(r.sglang_args.host, node)}:{port}"
            self.servers[name] = (cmd, env, urls[i])
            old = earlier.get("servers", {}).get(name)
            proc = lease.adopt(old, name, lease_path)
            if proc is not None:
                why = ("rollout.reuse_servers is false" if not r.reuse_servers else
                       "colocated servers are not reused" if self.cfg.colocate else
                       "this run launches it with other arguments" if (old.get("cmd"), old.get("gpus")) !=
                       (_launch_args(cmd), env.get("CUDA_VISIBLE_DEVICES")) else None)
                if why is None:
                    self.procs[name] = (proc, os.path.join(self.logs, f"{name}.log"))
                    self.adopted.add(name)
                    self._record(name, pid=proc.pid, started=proc.started, weight_version=old.get("weight_version"),
                                 launched_by=old.get("launched_by"))
                    continue
                print(f"[train] stopping {name} (pid {proc.pid}), which an earlier attempt launched: {why}",
                      flush=True)
                lease.stop(proc)
            with socket.socket() as s:  # a server already there would answer /health in place of ours
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    raise RuntimeError(f"port {port} (rollout.base_port + {i}) is already in use on node {node}; "
                                       "choose another rollout.base_port or stop what listens there")
            self.spawn(name, cmd, env)
        return urls

    def _server_command(self, layout, port: int, version: int) -> tuple[list, dict]:
        """The command line and environment of a server of rollout.server_layout (`layout`) on `port`."""
        r = self.cfg.rollout
        env = {k: v for k, v in os.environ.items() if k not in TRAINER_ENV}
        if layout.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in layout.gpus)
        a = r.sglang_args
        if r.launch == "engine":
            cmd = [sys.executable, "-m", "standins.engine", "--model-path", self.cfg.model.path,
                   "--port", str(port), "--host", a.host, "--weight-version", str(version)]
        else:
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.cfg.model.path,
                   "--port", str(port), "--host", a.host, "--tp-size", str(layout.tp), "--dp-size",
                   str(layout.dp), "--pp-size", str(layout.pp), "--weight-version", str(version)]
        ws_dtype = self.cfg.weight_sync.dtype  # the servers hold what the trainer pushes and compares (delta) in
        cmd += ["--dtype", "bfloat16" if ws_dtype == "auto" and r.launch != "engine" else ws_dtype]
        if a.max_running_requests:
            cmd += ["--max-running-requests", str(a.max_running_requests)]
        cmd += ["--config", key_file(self.cfg)]  # the key: SGLang's --config YAML, read inside the server
        if self.cfg.colocate:  # a released weights region comes back undefined, buffers (rotary caches) too,
            cmd += ["--enable-weights-cpu-backup"]  # and no update restores those (sgl-project/sglang#15246)
        if self.cfg.algorithm.routing_replay:  # meta_info["routed_experts"] (sglang 0.5.23's server switch)
            cmd += ["--enable-return-routed-experts"]
        if self.cfg.weight_sync.delta:  # weight_delta.py's loader applies the deltas; the server imports it from here
            import weight_delta  # and reads disk deltas from under the run's sync directory only

            cmd += ["--custom-weight-loader", weight_delta.LOADER]
            env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
            env[weight_delta.SYNC_DIR_ENV] = os.path.abspath(os.path.join(self.cfg.run_dir, "sync_weights"))
        if r.launch == "sglang":
            if a.mem_fraction_static:
                cmd += ["--mem-fraction-static", str(a.mem_fraction_static)]
            if self.cfg.colocate:
                cmd += ["--enable-memory-saver"]  # needed by /release_memory_occupation
        return cmd + [str(x) for x in a.extra], env

    def _take_over(self, urls: dict) -> dict:
        """The kept servers of an earlier attempt brought to a known state (lease.takeover); one that does not get
        there is stopped and launched anew. Returns {index: how it is reused} of those that are."""
        import sglang_client

        r, reused = self.cfg.rollout, {}
        for name in sorted(self.adopted):
            i = int(name.split("_")[1])
            proc, t0 = self.procs[name][0], time.monotonic()
            try:
                info = lease.takeover(urls[i], sglang_client.read_key_file(r.sglang_args.api_key_file),
                                      r.startup_timeout_s, r.pause_timeout_s)
                reused[i] = (f", an earlier attempt's: it held weight version {info.get('weight_version')}, taken "
                             f"over in {time.monotonic() - t0:.1f} s")
            except Exception as e:
                print(f"[train] warning: {name} (pid {proc.pid}), which an earlier attempt launched, could not be "
                      f"taken over ({e}); launching a new one", file=sys.stderr, flush=True)
                lease.stop(proc)
                cmd, env, _ = self.servers[name]
                self.spawn(name, cmd, env)
        self.adopted.clear()
        return reused

    def _record(self, name: str, **fields) -> None:
        """Update a server's entry in run_dir/servers/node<N>.json (lease.py) and write it."""
        cmd, env, url = self.servers[name]
        entry = self.record["servers"].setdefault(name, {
            "launched_by": {"pid": os.getpid(), "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")},
            "weight_version": int(cmd[cmd.index("--weight-version") + 1])})
        entry.update(url=url, cmd=_launch_args(cmd), gpus=env.get("CUDA_VISIBLE_DEVICES"), model=self.cfg.model.path,
                     **{k: v for k, v in fields.items() if v is not None or k not in entry})
        lease.write_record(lease.paths(self.cfg.run_dir, self.node)[0], self.record)

    def synced(self, version: int, group: Optional[str]) -> None:
        """Rank 0, after a weight sync: the version its servers hold and the weight-update group they are in, in
        the record (the group, for the next attempt to destroy: Services.wait_fleet)."""
        if not self.record:
            return
        self.record["weight_group"] = group
        for entry in self.record["servers"].values():
            entry["weight_version"] = version
        lease.write_record(lease.paths(self.cfg.run_dir, self.node)[0], self.record)

    def launch_fleet(self, version: int, wait: bool = True) -> list[str]:
        """Trainer rank 0: its own node's servers (wait=False: started, not waited for; launch_servers(version)
        waits), then the URLs the other nodes' local ranks 0 published in the torchrun store (serve_node), in
        server_layout order."""
        urls = dict(self.launch_servers(version, 0, wait))  # a copy: the remote URLs are added to it
        layout = self.cfg.rollout.server_layout
        remote = [i for i in range(len(layout)) if i not in urls]
        deadline = time.monotonic() + self.cfg.rollout.startup_timeout_s
        for i in remote:
            store, key = _store(), f"{URL_KEY}{i}"
            while not store.check([key]):
                self.check_alive(f"waiting for node {layout[i].node} to publish server_{i}'s URL")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server_{i} of rollout.server_layout (node {layout[i].node}) was not up "
                                       f"within rollout.startup_timeout_s={self.cfg.rollout.startup_timeout_s} s "
                                       f"(that node's local rank 0 launches it; see {self.logs}/server_{i}.log on "
                                       "that node)")
                time.sleep(0.2)
            value = store.get(key).decode()
            if value.startswith("error: "):
                raise RuntimeError(value[len("error: "):])
            urls[i] = value
        return [urls[i] for i in range(len(layout))]

    def start_fleet(self, version: int, launched: bool, wait: bool = True):
        """Trainer rank 0: the servers of rollout.server_layout (this node's launched here, the other nodes'
        published by their local rank 0, see for_node; or rollout.servers / rollout.router_url already running),
        where they reach the broadcast group (weight_sync.master_address), and the SyncFleet, once every server
        answers /health. wait=False: the SyncFleet of the URLs, the servers maybe still starting (wait_fleet)."""
        import sglang_client

        cfg = self.cfg
        if launched:  # started (or already starting), waited for in wait_fleet
            cfg.rollout.servers = self.launch_fleet(version, wait=False)
        cfg.weight_sync.master_address = master_address(cfg, launched)
        self.fleet = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
        if wait:
            self.wait_fleet(version, launched)
        return self.fleet

    def wait_fleet(self, version: int, launched: bool) -> None:
        """Until this node's launched servers answer /health (their log and exit named if one dies), then every
        server of the fleet, and their sglang versions."""
        if launched:
            self.launch_servers(version, 0)
        self.fleet.wait_healthy(self.cfg.rollout.startup_timeout_s)
        if self.stale_group:  # the group a dead trainer formed, still in the servers it used: the first sync's
            with contextlib.suppress(Exception):  # group may have its name (the servers without it say so)
                self.fleet.destroy_weights_update_group(self.stale_group)
            self.stale_group = None

    def serve_node(self, node: int) -> None:
        """Local rank 0 of trainer node `node` > 0: launch this node's servers, publish their URLs (or why they did
        not start) in the torchrun store for rank 0, and supervise them (watch) for the rest of the run."""
        mine = [i for i, s in enumerate(self.cfg.rollout.server_layout) if s.node == node]
        try:
            urls = self.launch_servers(0, node)  # version 0: rank 0's first sync labels them with the run's version
        except Exception as e:
            for i in mine:
                _store().set(f"{URL_KEY}{i}", f"error: node {node}, server_{i}: {e}")
            raise
        for i, url in urls.items():
            _store().set(f"{URL_KEY}{i}", url)
        self.watch()

    def relaunch(self, name: str) -> None:
        """Start a dead launched server again on its port and wait for /health (the watcher thread). It serves
        model.path's weights, which are weight version 0, until the next sync gives it the current ones."""
        cmd, env, url = self.servers[name]
        at = cmd.index("--weight-version") + 1
        print(f"[train] warning: {self.report(name, tail=0).split(';')[0]}; relaunching it on {url}",
              file=sys.stderr, flush=True)
        self.relaunching.add(name)
        self.spawn(name, [*cmd[:at], "0", *cmd[at + 1:]], env)
        self.server_restarts += 1
        self.wait_healthy([url])
        self.replaced.add(name)
        self.relaunching.discard(name)
        print(f"[train] {name} is back on {url} (restart {self.server_restarts} of the run)", file=sys.stderr,
              flush=True)

    def take_replaced(self) -> bool:
        """Whether a server was relaunched since the last call: the weight-update group must be re-created. Waits
        for relaunches in progress (bounded by the watcher's wait_healthy)."""
        while self.relaunching or (set(self.exited()) & set(self.servers)):
            if self.closing.wait(0.1):
                break
        out = bool(self.replaced)
        self.replaced.clear()
        return out

    def server_died(self, wait_s: float = GRACE_S) -> bool:
        """Whether a launched server died (and is being, or was, relaunched), waiting up to wait_s to see it."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.relaunching or self.replaced or (set(self.exited()) & set(self.servers)):
                return True
            time.sleep(0.05)
        return False

    def wait_healthy(self, urls: list[str]) -> None:
        import requests

        deadline = time.monotonic() + self.cfg.rollout.startup_timeout_s
        pending = list(urls)
        while pending:
            self.check_alive(f"waiting for {', '.join(pending)} to answer /health")
            with contextlib.suppress(requests.RequestException):
                if requests.get(pending[0] + "/health", timeout=5).status_code == 200:
                    pending.pop(0)
                    continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"inference servers {', '.join(pending)} not healthy after "
                                   f"rollout.startup_timeout_s={self.cfg.rollout.startup_timeout_s} s; "
                                   f"see {self.logs}/server_*.log")
            time.sleep(0.1)  # a refused connect or a one-token /health: cheap, and each launch waits less for it

    def start_workers(self, version: int, launched: bool, wait_servers: bool) -> tuple:
        """Trainer rank 0: the buffer and rollout processes (spawn_rpc_workers), the servers' /health meanwhile
        (wait_servers: start_fleet(wait=False) came first), then RPC with both (join_rpc) and the watcher. Returns
        the trainer's handles of the buffer and the rollout."""
        t0 = time.monotonic()
        self.spawn_rpc_workers()
        if wait_servers:
            self.wait_fleet(version, launched)
        t1 = time.monotonic()
        self.join_rpc()
        print(f"[train] buffer and rollout processes joined RPC {time.monotonic() - t0:.1f} s after they started "
              f"(the servers' wait took {t1 - t0:.1f} s of it)", flush=True)
        self.watch()
        import rollout

        timeout = self.cfg.buffer.rpc_timeout_s
        where = {name: f"the {name} process (pid {p.pid}, log {log})" for name, (p, log) in self.procs.items()}
        return (remote.Proxy("buffer", timeout, remote.BUFFER_METHODS, where=where.get("buffer")),
                remote.Proxy("rollout", timeout, remote.ROLLOUT_METHODS, rollout.rpc_waits(self.cfg),
                             where.get("rollout")))

    def spawn_rpc_workers(self) -> None:
        """The buffer (RPC rank 1) and rollout (rank 2) processes, given the run's resolved config
        (run_dir/config.yaml); join_rpc joins them as "trainer" (rank 0). They wait for it in init_rpc for up to
        rollout.startup_timeout_s + buffer.rpc_timeout_s (workers.py), so whatever rank 0 does in between (the
        servers' /health) is bounded by rollout.startup_timeout_s."""
        resolved_config = self.write_config()
        self.rpc_init = f"tcp://127.0.0.1:{free_port()}"
        for rank, (name, cmd) in enumerate([("buffer", [os.path.join(ROOT, "workers.py"), "buffer"]),
                                            ("rollout", [os.path.join(ROOT, "workers.py"), "rollout"])], start=1):
            env = {k: v for k, v in os.environ.items() if k not in TRAINER_ENV}
            self.spawn(name, [sys.executable, *cmd, "--config", resolved_config, "--rpc-init", self.rpc_init,
                              "--rank", str(rank), "--world-size", "3"], env)

    def write_config(self) -> str:
        """run_dir/config.yaml: the run's resolved config, which the buffer and rollout processes load. It names the
        servers' key file (rollout.sglang_args.api_key_file), never holds a key."""
        import yaml

        path = os.path.join(self.cfg.run_dir, "config.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(config_lib.to_dict(self.cfg), f, sort_keys=False)
        return path

    def join_rpc(self) -> None:
        """RPC as "trainer" (rank 0) with the workers of spawn_rpc_workers, watching both while it waits."""
        init, startup = self.rpc_init, self.cfg.rollout.startup_timeout_s
        remote.init_rpc("trainer", 0, 3, init, self.cfg.buffer.rpc_timeout_s, num_worker_threads=16,
                            startup_timeout=startup,
                            while_waiting=lambda: self.check_alive("joining RPC as 'buffer' / 'rollout'"),
                            hint=f" (rollout.startup_timeout_s={startup} s; see {self.logs}/buffer.log and "
                                 "rollout.log)")
        self.rpc_up = True

    def close(self, ok: bool, keep_servers: bool = False) -> None:
        """Stop the producer, leave RPC, then terminate every child (SIGTERM, SIGKILL after 10 s). keep_servers (the
        run crashed) while torchrun has a restart left (restarts_left): the launched servers stay up for the next
        attempt, their record and lease with them, and stop by themselves rollout.server_keepalive_s after this
        process stops renewing the lease. (A rank 0 killed outright cannot stop them: the lease does.)"""
        from torch.distributed import rpc

        self.closing.set()
        if self.fleet is not None:
            with contextlib.suppress(Exception):
                self.fleet.close()
        if self.rpc_up:
            try:
                if ok:
                    remote.Proxy("rollout", 60.0, remote.ROLLOUT_METHODS, timeout_name="the stop at close").stop()
                rpc.shutdown(graceful=ok, timeout=60 if ok else 0)
            except Exception as e:
                print(f"[train] RPC shutdown: {e}", file=sys.stderr)
                with contextlib.suppress(Exception):
                    rpc.shutdown(graceful=False)
        self.stop_children(keep_servers and restarts_left())

    def stop_children(self, keep_servers: bool = False) -> None:
        """Terminate the children (SIGTERM, SIGKILL after 10 s), but the launched servers if keep_servers; the
        servers' record and lease go with them."""
        mine = [(n, p) for n, (p, _) in reversed(self.procs.items()) if not (keep_servers and n in self.servers)]
        for _, p in mine:
            if p.poll() is None:
                p.terminate()
        for name, p in mine:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            if name in self.servers and not isinstance(p, lease.Adopted):  # what the server started, in the
                with contextlib.suppress(ProcessLookupError, PermissionError):  # session it leads (spawn made it)
                    os.killpg(p.pid, signal.SIGKILL)
        if self.lease is not None:  # the record and lease, unless another process took the lease meanwhile
            self.lease.stop()
            for path in () if keep_servers or not self.lease.owned() else lease.paths(self.cfg.run_dir, self.node):
                with contextlib.suppress(OSError):
                    os.remove(path)


def restarts_left() -> bool:
    """Whether torchrun will start the ranks again when this attempt fails (--max-restarts not used up)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS",
                                                                                          "0"))


def for_node(cfg, local_rank: int, launched: bool) -> Optional[Services]:
    """Trainer ranks other than 0: local rank 0 of a node with servers in rollout.server_layout launches them,
    publishes their URLs for rank 0 and supervises them (Services.serve_node); None elsewhere."""
    node = int(os.environ.get("GROUP_RANK", "0"))
    if local_rank != 0 or not launched or not any(s.node == node for s in cfg.rollout.server_layout):
        return None
    services = Services(cfg)
    services.serve_node(node)
    return services


def failure_exit_code(e: Exception, services: Optional[Services], rank: int) -> int:
    """What a trainer rank's main does with the exception that ended its run: the root cause printed once, and the
    exit code (2: the run cannot train, buffer.NothingToTrain, said as a bad input would be; 1: a failed run);
    an exception it cannot explain is raised again. CheckpointWriteError is raised on every rank: rank 0 prints it.
    After a SIGTERM (preemption.py) no rank waits for torchrun, which is stopping every rank already."""
    import buffer
    import checkpoint
    import preemption

    def say(message: str) -> None:
        if services is not None:
            services.print_error_once(message)
        else:
            print(f"error: {message}", file=sys.stderr, flush=True)

    def wait_for_torchrun() -> None:  # to stop this rank; after a SIGTERM it is stopping every rank already
        if not preemption.requested():
            time.sleep(RANK0_EXIT_WAIT_S)

    first = str(e).splitlines()[0][:300] if str(e) else ""  # (an exception with no message has no first line)

    if isinstance(e, buffer.NothingToTrain):
        say(str(e))
        return 2
    if isinstance(e, checkpoint.CheckpointWriteError):  # raised on every rank: rank 0 says it
        if rank == 0:
            say(str(e))
        else:
            wait_for_torchrun()
        return 1
    # Root cause first: a dead child's report, not the RPC / socket error its death caused here.
    cause = str(e) if isinstance(e, ChildExited) else services.root_cause(GRACE_S) if services else None
    if cause is None and rank != 0 and isinstance(e, RuntimeError):
        # rank 0 failed (its own error says why: let it print first) or a collective with it broke; one line.
        # Then wait for torchrun to stop this rank once rank 0 has exited: rank 0's teardown (its children, RPC)
        # takes seconds after its sockets may already be closed, and a rank that exited first would be torchrun's
        # "first observed failure" in place of rank 0's (its exit code 2 for a run that cannot train, say).
        print(f"[train] rank {rank}: lost trainer rank 0 (it failed, exited, or did not answer within the "
              f"control group's timeout): {first or type(e).__name__}", file=sys.stderr, flush=True)
        wait_for_torchrun()
        return 1
    if cause is None and preemption.requested():  # torchrun's SIGTERM came first: it stops the run (its summary)
        print(f"[train] rank {rank}: stopped by SIGTERM, then {type(e).__name__}: {first}", file=sys.stderr,
              flush=True)
        return 1
    if cause is None and isinstance(e, remote.RemoteError):  # its first line names the call, the process, the cause
        line, _, trace = str(e).partition("\n")
        if trace:
            print(f"[train] the traceback in that process:\n{trace}", file=sys.stderr, flush=True)
        say(line)
        return 1
    if cause is None:
        raise  # (called from the except clause: the exception being handled)
    services.print_error_once(cause if isinstance(e, ChildExited) else f"{cause}\n(what it made fail here: "
                              f"{type(e).__name__}: {first})")
    return 1
