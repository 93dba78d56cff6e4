"""lease.py: launched inference servers outlive a crashed trainer attempt, and stop once no attempt renews their lease.

services.py starts each launched server through this file, in a session of its own, so that neither torchrun (it
stops a rank with killpg of the rank's process group) nor the death of trainer rank 0 stops it:

    python lease.py --lease RUN_DIR/servers/node0.lease --keepalive-s 300 -- python -m standins.engine --port ...

This process is the watchdog and the server's parent (services.py supervises its pid; it exits as the server did):
it forks the server, which dies with it (PR_SET_PDEATHSIG SIGKILL, so a watchdog killed outright takes its server
along), forwards a SIGTERM to it, and stops the session (SIGTERM to the server, SIGKILL to the session after
STOP_GRACE_S) once the lease file's mtime is older than --keepalive-s (rollout.server_keepalive_s): a server whose run
was abandoned does not outlive it by more. The trainer renews the lease every RENEW_S (`Lease`) while its step loop
makes progress (`beat`: a wedged trainer stops renewing after rollout.server_stall_s), and records its servers in
RUN_DIR/servers/node<N>.json (`write_record`; `read_record` validates it), so that the next attempt (torchrun
restarting the ranks, or a new `torchrun ... trainer.resume=auto`) finds each one (`adopt`: same pid and start time,
and a command line that is this file running a server under this lease: `not_our_server`; one no record names is
found by that command line: `watchdogs`), brings it to a known state without /health (`takeover`: a paused real
server's /health waits for a token) and reuses it; services.Services decides which.
Stdlib only (requests for `takeover`): the watchdog starts in ~50 ms.
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
TICK_S = 0.1  # how often the watchdog looks whether its server exited or was told to stop
HERE = os.path.realpath(__file__)
# what services.Services launches under this file: a recorded pid is signalled only when it runs one of these
SERVER_MODULES = ("standins.engine", "sglang.launch_server")


def paths(run_dir: str, node: int) -> tuple[str, str]:
    """(record, lease) of node `node`'s launched servers: one pair per node, so nodes sharing run_dir never write
    the same file."""
    d = os.path.join(run_dir, "servers")
    return os.path.join(d, f"node{node}.json"), os.path.join(d, f"node{node}.lease")


# ---------------------------------------------------------------------------------------------------------------
# The record (trainer side)
# ---------------------------------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# field -> (check, what is accepted); the first three are required in every server's entry
_ENTRY = {
    "pid": (lambda v: _is_int(v) and v > 1, "an integer > 1"),
    "started": (lambda v: isinstance(v, str) and v.isdigit(), "a string of digits (/proc/PID/stat field 22)"),
    "cmd": (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v),
            "a non-empty list of strings"),
    "url": (lambda v: isinstance(v, str), "a string"),
    "gpus": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "model": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "weight_version": (lambda v: v is None or _is_int(v) and v >= 0, "an integer >= 0 or null"),
    "launched_by": (lambda v: v is None or isinstance(v, dict), "a mapping or null"),
}
_REQUIRED = ("pid", "started", "cmd")


def record_error(data) -> Optional[str]:
    """What is wrong with a record (`field: what is accepted, got what`), None if it is valid."""
    if not isinstance(data, dict):
        return f"the record must be a mapping, got {type(data).__name__}"
    if not _is_int(data.get("node")) or data["node"] < 0:
        return f"node must be an integer >= 0, got {data.get('node')!r}"
    if data.get("weight_group") is not None and not isinstance(data["weight_group"], str):
        return f"weight_group must be a string or null, got {data['weight_group']!r}"
    servers = data.get("servers")
    if not isinstance(servers, dict):
        return f"servers must be a mapping of server name to entry, got {servers!r}"
    for name, entry in servers.items():
        if not isinstance(entry, dict):
            return f"servers.{name} must be a mapping, got {entry!r}"
        for field, (ok, accepted) in _ENTRY.items():
            if field not in entry and field in _REQUIRED:
                return f"servers.{name}.{field} is missing (must be {accepted})"
            if field in entry and not ok(entry[field]):
                return f"servers.{name}.{field} must be {accepted}, got {entry[field]!r}"
    return None


def read_record(path: str) -> dict:
    """The record an earlier attempt wrote, validated ({} if there is none). One that does not parse or is not
    valid (record_error) is refused in one line naming the file and the field, and set aside as PATH.bad (kept for
    a look, never deleted); the start then goes on as if there were none: its pids are not trusted, the node's
    servers are launched anew, and its servers that still run are found by their command line (watchdogs) and
    stopped (services.Services._spawn_servers)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        why = f"it could not be read as JSON ({e})"
    else:
        why = record_error(data)
        if why is None:
            return data
    aside = path + ".bad"
    with contextlib.suppress(OSError):
        os.replace(path, aside)
    print(f"[train] warning: the server record {path} is refused: {why}; kept as {aside}, its servers are not reused "
          "and the node's servers are launched anew", file=sys.stderr, flush=True)
    return {}


def write_record(path: str, record: dict) -> None:
    """Atomically and durably (a crash mid-write leaves the previous record, never half of one)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
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


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace").split("\0")[:-1]


def _lease_of(argv: list[str]) -> Optional[str]:
    """The --lease of a watchdog's command line (before its `--`), resolved; None if it has none."""
    opts = argv[:argv.index("--")] if "--" in argv else argv
    at = opts.index("--lease") + 1 if "--lease" in opts else len(opts)
    return os.path.realpath(opts[at]) if at < len(opts) else None


def not_our_server(pid: int, lease: Optional[str] = None) -> Optional[str]:
    """Why process `pid` is not a watchdog of this file running a server services.py launches (None if it is): its
    command line (/proc/PID/cmdline) must be `PYTHON <this lease.py> --lease LEASE ... -- PYTHON -m <SERVER_MODULES>
    ...`, LEASE the given lease file (this node's of this run_dir: a record copied with its run directory names
    another run's servers), and it must lead its own session and process group (what `stop` kills with killpg)."""
    try:
        argv = _cmdline(pid)
        group, session = os.getpgid(pid), os.getsid(pid)
    except (OSError, ProcessLookupError):
        return "it is gone"
    shown = " ".join(argv)[:200] or "empty"
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    if len(argv) < 2 or os.path.realpath(argv[1]) != HERE or cmd[1:2] != ["-m"] or cmd[2:3] not in (
            [m] for m in SERVER_MODULES):
        return f"its command line ({shown}) is not {HERE} running one of {', '.join(SERVER_MODULES)}"
    if lease is not None and _lease_of(argv) != os.path.realpath(lease):
        return f"it watches the lease {_lease_of(argv)}, not {lease}: another run's"
    if group != pid or session != pid:
        return f"it does not lead its own session and process group (group {group}, session {session})"
    return None


def watchdogs(lease: str) -> list[int]:
    """The pids of the watchdogs on this machine that run a server under lease file `lease` (not_our_server),
    whatever any record says: what renewing that file keeps alive."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) > 1:
            with contextlib.suppress(OSError):
                argv = _cmdline(int(entry))
                if len(argv) > 1 and argv[1].endswith("lease.py") and not_our_server(int(entry), lease) is None:
                    out.append(int(entry))
    return out


class Adopted:
    """A server that an earlier attempt launched, as services.Services supervises its own (subprocess.Popen's
    pid / poll / terminate / kill / wait): the pid of its watchdog (main), which the server dies with. Not our
    child: its exit status went to the attempt that launched it (returncode None once it is gone), and it is reaped
    by init."""

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


def adopt(entry: Optional[dict], name: str = "a recorded server", lease: Optional[str] = None) -> Optional[Adopted]:
    """The recorded server (an entry read_record validated) if its process still runs (same pid and start time) and
    is one of ours (not_our_server; with `lease`, a watchdog of that lease file), else None. A live process with the
    recorded pid and start time that is not one of ours is left alone, with a warning: it is never signalled."""
    if not entry or not _is_int(entry.get("pid")) or entry["pid"] <= 1:
        return None
    started = start_time(entry["pid"])
    if started is None or started != entry.get("started"):
        return None
    why = not_our_server(entry["pid"], lease)
    if why is not None:
        print(f"[train] warning: {name}'s recorded pid {entry['pid']} runs but is not a server this run launched "
              f"({why}); it is left alone", file=sys.stderr, flush=True)
        return None
    return Adopted(entry["pid"], started)


def _leads_group(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return os.getpgid(pid) == pid
    return False


def stop(proc, grace_s: float = STOP_GRACE_S) -> None:
    """Stop a server and everything in its session: SIGTERM, then SIGKILL to its process group after grace_s, only
    while the process leads that group (a watchdog leads its session; an Adopted was checked by adopt, and its start
    time is checked again before each signal)."""
    if isinstance(proc, Adopted):
        proc.terminate()
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, signal.SIGTERM)
    with contextlib.suppress(Exception):
        proc.wait(grace_s)
    if not isinstance(proc, Adopted) or not proc.exited() and _leads_group(proc.pid):  # a Popen: spawned to lead it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # its session (it leads it): what the server itself started
    with contextlib.suppress(Exception):
        proc.wait(grace_s)


# ---------------------------------------------------------------------------------------------------------------
# The lease (trainer side): renewed while the step loop makes progress
# ---------------------------------------------------------------------------------------------------------------

_beat = [time.monotonic(), 0.0]  # the step loop's last sign of progress (monotonic s), and the extra time declared


def beat(expect_s: float = 0.0) -> None:
    """The step loop made progress (train.run_steps beats at each phase and while it waits for groups; the
    evaluator while trajectories finish); expect_s: the next beat may come this much later than the stall bound
    (a phase that declares its own duration)."""
    _beat[:] = [time.monotonic(), float(expect_s)]


def stalled_s() -> float:
    """Seconds since the last beat, less what the last beat declared it might take."""
    return time.monotonic() - _beat[0] - _beat[1]


def owner() -> dict:
    """This process as a lease's owner: pid, start time, and torchrun's attempt on this node."""
    return {"pid": os.getpid(), "started": start_time(os.getpid()),
            "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT")}


class Lease:
    """The trainer side of the lease: a thread that sets the lease file's mtime to now every RENEW_S while the step
    loop beats (stall_s: no beat for that long (rollout.server_stall_s) and renewal stops, so a wedged but live
    trainer's servers stop rollout.server_keepalive_s later; a beat after that renews again). The file holds its
    owner (`owner`): a clean close removes only a lease that is its own."""

    def __init__(self, path: str, stall_s: Optional[float] = None):
        self.path, self.stall_s = path, stall_s
        self.stopped = False
        self.thread = None
        self.lapsed = False  # renewal stopped for a stall (printed once per stall)

    def renew(self) -> None:
        """Take the lease: write this process as its owner (atomically) and set its mtime to now."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(owner(), f)
        os.replace(tmp, self.path)

    def owned(self) -> bool:
        """Whether the lease file names this process as its owner."""
        try:
            with open(self.path) as f:
                return json.load(f) == owner()
        except (OSError, ValueError):
            return False

    def tick(self) -> bool:
        """One look of the renewal thread: renew unless the step loop stalled; True if it renewed."""
        idle = stalled_s()
        if self.stall_s is not None and idle > self.stall_s:
            if not self.lapsed:
                self.lapsed = True
                print(f"[train] warning: the step loop made no progress for {idle:.0f} s (rollout.server_stall_s="
                      f"{self.stall_s:g}); the servers' lease {self.path} is no longer renewed and they stop after "
                      "rollout.server_keepalive_s unless the loop goes on", file=sys.stderr, flush=True)
            return False
        self.lapsed = False
        with contextlib.suppress(OSError):  # only the mtime: a lease file removed (a clean close, or the run
            os.utime(self.path)  # directory gone) stays gone, and the servers stop after rollout.server_keepalive_s
            return True
        return False

    def start(self) -> None:
        import threading

        if self.thread is not None:
            return
        beat()
        self.renew()

        def loop():
            while not self.stopped:
                self.tick()
                time.sleep(RENEW_S)
        self.thread = threading.Thread(target=loop, name="server-lease", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True


# ---------------------------------------------------------------------------------------------------------------
# Takeover: a reused server brought to a known state
# ---------------------------------------------------------------------------------------------------------------

def takeover(url: str, api_key: Optional[str], wait_s: float, pause_timeout_s: float) -> dict:
    """Bring a server an earlier attempt used to a known state, and return its /model_info: nothing generating or
    waiting to, no weight-update session open, no cached prefix, not paused. It may be paused (the attempt died at
    a step boundary), in the middle of a weight update, or still starting (waited for up to wait_s).

    Not /health: SGLang 0.5.23's generates a token through the pause gate (entrypoints/http_server.py:
    health_generate), so a paused server does not answer it. /model_info answers while paused
    (http_server.py: model_info); /pause_generation mode abort (tokenizer_manager.py: pause_generation) aborts
    what the scheduler holds and waits until no request holds the model lock, also when it was already paused (a
    request of the dead attempt lets go of it once the server notices its client left, within
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT); /end_weight_update closes a session a dead trainer left open (an answer
    that none is open is expected). Requests the dead attempt sent while the server was paused wait at its pause
    gate (tokenizer_manager.py: generate_request), which no pause aborts, and would run after /continue_generation
    until the server noticed their client gone (up to 4 s, beside the new run's first sync): so /continue_generation
    lets them through, and a second /pause_generation mode abort aborts them and returns once none holds the lock.
    Then /flush_cache drops the KV of the weights it held (the checkpoint's come at the first sync), and
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
    post("/continue_generation", {})  # the requests parked at the pause gate go to the scheduler...
    post("/pause_generation", {"mode": "abort"}, pause_timeout_s)  # ...which aborts them
    post("/flush_cache", {}, expected=(200, 400))
    post("/continue_generation", {})
    return info


# ---------------------------------------------------------------------------------------------------------------
# The server side: the launcher and its watchdog
# ---------------------------------------------------------------------------------------------------------------

def _session_others(session: int) -> list[int]:
    """The processes of process group `session` other than this one (/proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == session:
                        out.append(int(entry))
    return out


def _watch(server: int, lease: str, keepalive_s: float) -> int:
    """The watchdog, the server's parent: until the server exits, a SIGTERM comes (forwarded), or the lease is not
    renewed for keepalive_s (the session stopped). Returns the server's wait status."""
    told = []
    signal.signal(signal.SIGTERM, lambda *_: told.append(signal.SIGTERM))
    last, look = time.time(), 0.0
    while True:
        pid, status = os.waitpid(server, os.WNOHANG)
        if pid == server:
            return status
        if told:
            break
        if time.monotonic() >= look:
            look = time.monotonic() + min(RENEW_S, keepalive_s / 4)
            with contextlib.suppress(OSError):
                last = max(last, os.stat(lease).st_mtime)
            if time.time() - last > keepalive_s:
                print(f"lease.py: {lease} was not renewed for {keepalive_s:g} s (rollout.server_keepalive_s): no "
                      f"trainer uses this server any more; stopping it (pid {server})", file=sys.stderr, flush=True)
                break
        time.sleep(TICK_S)
    with contextlib.suppress(ProcessLookupError):
        os.kill(server, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        pid, status = os.waitpid(server, os.WNOHANG)
        if pid == server:
            return status
        time.sleep(TICK_S)
    with contextlib.suppress(ProcessLookupError):
        os.kill(server, signal.SIGKILL)
    return os.waitpid(server, 0)[1]


def main(argv: Optional[list] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lease", required=True, help="the lease file whose mtime the trainer renews")
    p.add_argument("--keepalive-s", type=float, required=True, help="stop the server when the lease is this old")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's command line")
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command or not 0 < a.keepalive_s < float("inf"):
        p.error("needs a finite --keepalive-s > 0 and a command after --")
    with contextlib.suppress(PermissionError):  # a session of its own (already so when services.py starts it)
        os.setsid()
    watchdog = os.getpid()
    server = os.fork()
    if server == 0:
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the server ends with its watchdog
            if os.getppid() != watchdog:  # the watchdog died before the line above
                os._exit(1)
            os.execvp(command[0], command)
        except BaseException as e:
            print(f"lease.py: could not start {command[0]}: {e}", file=sys.stderr, flush=True)
        os._exit(127)
    status = _watch(server, a.lease, a.keepalive_s)
    for pid in _session_others(watchdog):  # what the server started in its session and left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if os.WIFSIGNALED(status):  # exit as the server did: services.Services reports the watchdog's status as its own
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL has no handler to reset)
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.stdout.flush()
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    main()
