"""lease.py: launched inference servers outlive a crashed trainer attempt, and stop once no attempt renews their lease.

services.py starts each launched server through this file, in a session of its own, so that neither torchrun (it
stops a rank with killpg of the rank's process group) nor the death of trainer rank 0 stops it:

    python lease.py --lease RUN_DIR/servers/node0.lease --keepalive-s 300 -- python -m standins.engine --port ...

The process forks a watchdog and then becomes the server (exec: the server keeps this pid, which services.py
supervises as before). The watchdog (`python lease.py watch`, dying with the server by PR_SET_PDEATHSIG) stops the
server's session (SIGTERM, SIGKILL after STOP_GRACE_S) once the lease file's mtime is older than --keepalive-s
(rollout.server_keepalive_s): a server whose run was abandoned does not outlive it by more. The trainer renews the
lease every RENEW_S (`Lease`) and records its servers in RUN_DIR/servers/node<N>.json (`write_record`), so that the
next attempt (torchrun restarting the ranks, or a new `torchrun ... trainer.resume=auto`) finds each one (`adopt`),
brings it to a known state without /health (`takeover`: a paused real server's /health waits for a token) and
reuses it; services.Services decides which. Stdlib only (requests for `takeover`): the watchdog starts in ~50 ms.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from typing import Optional

RENEW_S = 1.0  # how often the trainer renews the lease (the watchdog looks as often)
STOP_GRACE_S = 10.0  # a server told to stop (SIGTERM) is killed (SIGKILL) after this


def paths(run_dir: str, node: int) -> tuple[str, str]:
    """(record, lease) of node `node`'s launched servers: one pair per node, so nodes sharing run_dir never write
    the same file."""
    d = os.path.join(run_dir, "servers")
    return os.path.join(d, f"node{node}.json"), os.path.join(d, f"node{node}.lease")


# ---------------------------------------------------------------------------------------------------------------
# The record (trainer side)
# ---------------------------------------------------------------------------------------------------------------

def read_record(path: str) -> dict:
    """The record an earlier attempt wrote ({} if none, or if it does not parse: its servers are then unknown and
    are not reused; the lease stops them)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_record(path: str, record: dict) -> None:
    """Atomically (a crash mid-write leaves the previous record, never half of one)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone or a
    zombie: with the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class Adopted:
    """A server that an earlier attempt launched, as services.Services supervises its own (subprocess.Popen's
    pid / poll / terminate / kill / wait). Not our child: its exit status went to the attempt that launched it
    (returncode None once it is gone), and it is reaped by init."""

    def __init__(self, pid: int, started: str):
        self.pid, self.started, self.returncode = pid, started, None
        self.gone = False

    def poll(self):
        """None, as Popen.poll of a running process, and also once it is gone (its exit status is not ours): ask
        exited()."""
        self.exited()
        return None

    def exited(self) -> bool:
        self.gone = self.gone or start_time(self.pid) != self.started
        return self.gone

    def _signal(self, sig: int) -> None:
        if not self.exited():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.exited():
            if deadline is not None and time.monotonic() > deadline:
                import subprocess

                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def adopt(entry: Optional[dict]) -> Optional[Adopted]:
    """The recorded server if its process still runs (same pid and start time), else None."""
    if not entry or not isinstance(entry.get("pid"), int):
        return None
    started = start_time(entry["pid"])
    return Adopted(entry["pid"], started) if started is not None and started == entry.get("started") else None


def stop(proc, grace_s: float = STOP_GRACE_S) -> None:
    """Stop a server and everything in its session: SIGTERM, then SIGKILL to the session after grace_s."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(proc.pid, signal.SIGTERM)
    with contextlib.suppress(Exception):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # its session (it leads it): what the server itself started
    with contextlib.suppress(Exception):
        proc.wait(grace_s)


class Lease:
    """The trainer side of the lease: a thread that sets the lease file's mtime to now every RENEW_S."""

    def __init__(self, path: str):
        self.path = path
        self.stopped = False
        self.thread = None

    def renew(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a"):
            pass
        os.utime(self.path)

    def start(self) -> None:
        import threading

        if self.thread is not None:
            return
        self.renew()

        def loop():  # only the mtime: a lease file removed (a clean close, or the run directory gone) stays gone,
            while not self.stopped:  # and the servers stop after rollout.server_keepalive_s
                with contextlib.suppress(OSError):
                    os.utime(self.path)
                time.sleep(RENEW_S)
        self.thread = threading.Thread(target=loop, name="server-lease", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True


# ---------------------------------------------------------------------------------------------------------------
# Takeover: a reused server brought to a known state
# ---------------------------------------------------------------------------------------------------------------

def takeover(url: str, api_key: Optional[str], wait_s: float, pause_timeout_s: float) -> dict:
    """Bring a server an earlier attempt used to a known state, and return its /model_info: nothing generating,
    no weight-update session open, no cached prefix, not paused. It may be paused (the attempt died at a step
    boundary), in the middle of a weight update, or still starting (waited for up to wait_s).

    Not /health: SGLang 0.5.23's generates a token through the pause gate (entrypoints/http_server.py:
    health_generate), so a paused server does not answer it. /model_info answers while paused
    (http_server.py: model_info); /pause_generation mode abort (tokenizer_manager.py: pause_generation) aborts
    everything it runs and waits until no request holds the model lock, also when it was already paused;
    /end_weight_update closes a session a dead trainer left open (an answer that none is open is expected);
    /flush_cache drops the KV of the weights it held (the checkpoint's come at the first sync); then
    /continue_generation. What it generated after the checkpoint never reaches the new run: its buffer and
    rollout processes are new and restore from the checkpoint. The weight-update group the dead trainer formed
    is destroyed before the trainer's first sync (services.Services.wait_fleet)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            r = requests.get(url + "/model_info", headers=headers, timeout=10)
            if r.status_code == 200:
                info = r.json()
                break
            error = f"HTTP {r.status_code}"
        except requests.RequestException as e:
            error = repr(e)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/model_info did not answer within {wait_s:.0f} s ({error})")
        time.sleep(0.2)

    def post(path: str, body: dict, timeout: float = 30.0, expected: tuple = (200,)) -> None:
        r = requests.post(url + path, json=body, headers=headers, timeout=timeout)
        if r.status_code not in expected:
            raise RuntimeError(f"POST {url}{path} answered HTTP {r.status_code}: {r.text[:200]}")

    post("/pause_generation", {"mode": "abort"}, pause_timeout_s)
    post("/end_weight_update", {}, expected=(200, 400))
    post("/flush_cache", {}, expected=(200, 400))
    post("/continue_generation", {})
    return info


# ---------------------------------------------------------------------------------------------------------------
# The server side: the launcher and its watchdog
# ---------------------------------------------------------------------------------------------------------------

def _watch(server_pid: int, lease: str, keepalive_s: float) -> None:
    """The watchdog: until the server exits (PR_SET_PDEATHSIG ends this process then) or its lease expires."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the session's stop below reaches this process too
    last = time.time()
    while True:
        time.sleep(min(RENEW_S, keepalive_s / 4))
        if os.getppid() != server_pid:
            return
        with contextlib.suppress(OSError):
            last = max(last, os.stat(lease).st_mtime)
        if time.time() - last > keepalive_s:
            break
    print(f"lease.py: {lease} was not renewed for {keepalive_s:g} s (rollout.server_keepalive_s): no trainer uses "
          f"this server any more; stopping it (pid {server_pid})", file=sys.stderr, flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server_pid, signal.SIGTERM)
    deadline = time.time() + STOP_GRACE_S
    while os.getppid() == server_pid and time.time() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server_pid, signal.SIGKILL)  # this process too


def main(argv: Optional[list] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "watch":
        p = argparse.ArgumentParser(prog="lease.py watch")
        p.add_argument("--server-pid", type=int, required=True)
        p.add_argument("--lease", required=True)
        p.add_argument("--keepalive-s", type=float, required=True)
        a = p.parse_args(argv[1:])
        _watch(a.server_pid, a.lease, a.keepalive_s)
        os._exit(0)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lease", required=True, help="the lease file whose mtime the trainer renews")
    p.add_argument("--keepalive-s", type=float, required=True, help="stop the server when the lease is this old")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's command line")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command or a.keepalive_s <= 0:
        p.error("needs --keepalive-s > 0 and a command after --")
    with contextlib.suppress(PermissionError):  # a session of its own (already so when services.py starts it)
        os.setsid()
    server = os.getpid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the watchdog ends with the server
        if os.getppid() != server:  # the server failed to start before the line above
            os._exit(0)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), "watch", "--server-pid", str(server),
                                  "--lease", a.lease, "--keepalive-s", str(a.keepalive_s)])
    os.execvp(command[0], command)  # this pid becomes the server's


if __name__ == "__main__":
    main()
