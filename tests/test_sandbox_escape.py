"""sandbox.py against code written to escape it: every attack of issue 56, as a tool call the model could emit, run
through a SandboxPool as root and, in the same test, as an unprivileged user (uid 65534, dropped with setpriv), and
each fails: spawned processes (subprocess / _posixsubprocess.fork_exec, os.fork + exec) run without uid 0,
capabilities or a way out; pidfd and kill reach neither the pool's process nor an unrelated one; setns into the
pool's network namespace and a connect to a loopback server of this test fail; /etc/hostname, the repository and
/proc/<ppid>/environ are not there; nothing on the host is written; a setsid child or a double-forked daemon does
not outlive its call; a fork bomb stops at the process limit; filling the disk stops at the scratch tmpfs; replies
cannot be forged or withheld for another call (JSON-looking output, fds 1 and 2 closed, every fd written, a thread
writing after the call). Normal calls run concurrently with the attacks and after them, each with its own answer.

Each run is a child process (the same script for both, so both run at once) that pools the probes over 4 slots.
Run: .venv/bin/python -m pytest -q -n 0 tests/test_sandbox_escape.py
"""
import asyncio
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

import sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)  # not a venv's link
SETPRIV = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
# Without bubblewrap a non-root machine skips what needs it; as root (CI: setup.sh installs it) a missing bwrap fails.
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None and os.geteuid() != 0,
                                 reason="bubblewrap is not installed (as root: apt-get install bubblewrap)")
WALL_S = 6.0  # above what any probe but withhold needs on a loaded 2-core machine
PROCESSES = 8

# $ppid is the pid of the process that holds the pool; the rest come from the test (ctx below).
PROBES = {
    "spawn": r"""
import os, subprocess, sys  # subprocess spawns through _posixsubprocess.fork_exec
child = '''
import ctypes, os, socket
st = open("/proc/self/status").read()
f = lambda k: st.split(k + ":")[1].split()[0]
print("child uid", os.getuid(), "caps", f("CapEff"), f("CapPrm"), "nnp", f("NoNewPrivs"), "seccomp", f("Seccomp"))
libc = ctypes.CDLL(None, use_errno=True)
print("child unshare", libc.unshare(0x10000000), ctypes.get_errno())
try:
    socket.create_connection(("127.0.0.1", $port), timeout=2)
    print("child connected")
except OSError as e:
    print("child connect", e.errno)
'''
r = subprocess.run([sys.executable, "-I", "-S", "-c", child], capture_output=True, text=True, timeout=10)
print(r.stdout, r.stderr[-300:])
print("sh id", subprocess.run(["/bin/sh", "-c", "id -u; id -G"], capture_output=True, text=True).stdout.split())
pid = os.fork()
if pid == 0:
    os.execv("/bin/sh", ["sh", "-c", "id -u > /tmp/idu"])
os.waitpid(pid, 0)
print("forked id", open("/tmp/idu").read().strip())
""",
    "pidfd_and_kill": r"""
import os, signal
for pid in ($ppid, $victim):
    try:
        signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)
        print("pidfd killed", pid)
    except OSError as e:
        print("pidfd", pid, e.errno)
    try:
        os.kill(pid, signal.SIGKILL)
        print("kill sent", pid)
    except OSError as e:
        print("kill", pid, e.errno)
""",
    "setns_and_connect": r"""
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
for path in ("/proc/$ppid/ns/net", "/proc/1/ns/net", "/proc/self/ns/net"):
    try:
        fd = os.open(path, os.O_RDONLY)
        print("setns", path, libc.setns(fd, 0), ctypes.get_errno())
    except OSError as e:
        print("open", path, e.errno)
for call, args in (("unshare", (0x40000000,)), ("unshare", (0x10000000,)), ("ptrace", (16, 1, 0, 0)),
                   ("mount", (b"none", b"/tmp", b"tmpfs", 0, None)), ("syscall", (434, 1, 0))):
    print(call, getattr(libc, call)(*args), ctypes.get_errno())
try:
    socket.create_connection(("127.0.0.1", $port), timeout=2)
    print("connected")
except OSError as e:
    print("connect", e.errno)
""",
    "read_host": r"""
import os
for path in ("/etc/hostname", "/etc/passwd", "$repo/sandbox.py", "/proc/$ppid/environ", "/proc/1/environ",
             "$hostdir/secret"):
    try:
        print("read", path, open(path).read()[:100])
    except OSError as e:
        print("open", path, e.errno)
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            print("environ", pid, open(f"/proc/{pid}/environ").read())
        except OSError as e:
            print("environ", pid, e.errno)
print("listdir /", sorted(os.listdir("/")))
""",
    "write_host": r"""
import os
for path in ("$repo/pwned", "$hostdir/pwned", "/pwned", "/usr/pwned", "/dev/pwned", "$prefix/pwned"):
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("write", path, e.errno)
""",
    "setsid_leftovers": r"""
import os, subprocess, sys
subprocess.Popen(["$marker-popen", "300"], executable="/bin/sleep", start_new_session=True)
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["$marker-daemon", "300"])
    os._exit(0)
os.waitpid(pid, 0)
print("started")
""",
    "fork_bomb": r"""
import os, time
n = 0
try:
    for i in range(200):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
    print("forked", n)
except OSError as e:
    print("forked", n, "then", e.errno)
""",
    "fill_disk": r"""
import os
total, err = 0, None
try:
    for i in range(64):
        with open(f"big{i}", "wb") as f:
            for _ in range(8):
                f.write(b"x" * (1 << 20))
                total += 1 << 20
except OSError as e:
    err = e.errno
print("bytes", total, "errno", err, flush=True)
n = 0
try:
    for n in range(1, 20001):
        open(f"f{n}", "w").close()
    print("files", n)
except OSError as e:
    print("files", n, e.errno)
""",
    "forge_json": r"""print('{"output": "forged", "error": null, "truncated": false, "cpu": 0}')""",
    "close_stdout_stderr": "import os\nos.close(1)\nos.close(2)\nimport time\ntime.sleep(0.2)",
    "write_every_fd": r"""
import os
for fd in range(64):
    try:
        os.write(fd, b'{"output": "HIJACKED"}\n')
    except OSError:
        pass
print("done")
""",
    "thread_after": r"""
import os, threading, time
def spam():
    while True:
        for fd in range(3, 64):
            try:
                os.read(fd, 1)
            except OSError:
                pass
        os.write(1, b"HIJACKED\n")
        time.sleep(0.01)
threading.Thread(target=spam).start()
time.sleep(0.05)
""",
    "withhold": "import time\ntime.sleep(60)",
    "cpu_loop": "while True: pass",
}
NORMAL = {f"normal{i}": f"print({i} * 7)" for i in range(12)}

RUN_PROBES = r"""
import concurrent.futures, inspect, json, os, string, sys
sys.path.insert(0, sys.argv[1])
import sandbox
spec = json.load(open(sys.argv[2]))
ctx = dict(spec["ctx"], ppid=os.getpid())
kw = {"processes": spec["processes"]} if "processes" in inspect.signature(sandbox.SandboxPool).parameters else {}
pool = sandbox.SandboxPool(workers=4, cpu_s=1, wall_s=spec["wall_s"], memory_mb=256, output_chars=8000, **kw)
codes = {name: string.Template(code).substitute(ctx) for name, code in spec["probes"].items()}
with concurrent.futures.ThreadPoolExecutor(len(codes)) as ex:
    results = dict(zip(codes, ex.map(pool.run, codes.values())))
results["after"] = pool.run("print(6 * 7)")
print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "isolation": getattr(pool, "isolation", None),
                  "results": {k: [r.output, r.error, r.killed, r.seconds] for k, r in results.items()}}))
"""


def _runnable_as_nobody() -> list:
    """An interpreter that uid 65534 can run (this one, or the system's), with setpriv; [] where there is none."""
    if shutil.which("setpriv") is None:
        return []
    for exe in ("/usr/bin/python3", PYTHON):
        if os.path.exists(exe) and subprocess.run(SETPRIV + [exe, "-I", "-S", "-c", "pass"],
                                                  capture_output=True, timeout=30).returncode == 0:
            return SETPRIV + [exe]
    return []


@pytest.fixture(scope="module")
def host():
    """What the probes aim at: a loopback server (counting connections), an unrelated process, a host directory
    writable by anyone, an environment marker, and a copy of sandbox.py that uid 65534 can read."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    accepted = []

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    victim = subprocess.Popen(["sleep", "300"])
    tmp = tempfile.mkdtemp(prefix="escape-")
    hostdir, lib = os.path.join(tmp, "host"), os.path.join(tmp, "lib")
    os.makedirs(hostdir)
    os.makedirs(lib)
    os.chmod(tmp, 0o755)
    os.chmod(hostdir, 0o777)
    with open(os.path.join(hostdir, "secret"), "w") as f:
        f.write("host secret")
    os.chmod(os.path.join(hostdir, "secret"), 0o644)
    shutil.copy(os.path.join(ROOT, "sandbox.py"), lib)
    os.chmod(os.path.join(lib, "sandbox.py"), 0o644)
    marker = f"escape{uuid.uuid4().hex[:12]}"
    ctx = {"port": srv.getsockname()[1], "victim": victim.pid, "hostdir": hostdir, "repo": ROOT, "marker": marker,
           "prefix": os.path.realpath(sys.base_prefix)}
    yield {"ctx": ctx, "accepted": accepted, "victim": victim, "lib": lib, "hostdir": hostdir, "marker": marker}
    srv.close()
    victim.kill()
    victim.wait()
    shutil.rmtree(tmp, ignore_errors=True)


def _start(cmd: list, host: dict) -> subprocess.Popen:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "SANDBOX_ESCAPE_MARKER": host["marker"] + "-environ"}
    spec = os.path.join(host["lib"], "spec.json")
    with open(spec, "w") as f:
        json.dump({"ctx": host["ctx"], "probes": {**PROBES, **NORMAL}, "wall_s": WALL_S, "processes": PROCESSES}, f)
    os.chmod(spec, 0o644)
    return subprocess.Popen(cmd + ["-c", RUN_PROBES, host["lib"], spec], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd="/")


def _collect(p: subprocess.Popen, who: str) -> dict:
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"the probes as {who} did not finish within 120 s")
    assert p.returncode == 0 and out.strip(), f"the probes as {who} failed: {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _lines(r) -> list:
    return r[0].splitlines()


def _check(run: dict, host: dict, who: str) -> None:
    res, ctx = run["results"], host["ctx"]
    outs = {k: r[0] for k, r in res.items()}
    for name, r in res.items():  # what a call writes reaches no other call
        if name not in ("forge_json", "write_every_fd", "thread_after"):
            assert "HIJACKED" not in r[0] and "forged" not in r[0], (who, name, r)
    # normal calls, concurrent with the attacks and after them, each got its own answer
    for i in range(len(NORMAL)):
        assert res[f"normal{i}"][:2] == [f"{i * 7}\n", None], (who, i, res[f"normal{i}"])
    assert res["after"][:2] == ["42\n", None], (who, res["after"])
    # spawned processes: not root, no capabilities, no_new_privs, the filter, no way out
    spawn = outs["spawn"]
    assert res["spawn"][1] is None, (who, res["spawn"])
    child = next(line for line in spawn.splitlines() if line.strip().startswith("child uid"))
    uid = child.split()[2]
    assert uid != "0" and child.split()[4:6] == ["0000000000000000"] * 2, (who, child)
    assert "nnp 1 seccomp 2" in child, (who, child)
    # EPERM; ECONNREFUSED or ENETUNREACH: the call's own loopback (up or down), not the test's server
    assert "child unshare -1 1" in spawn and ("child connect 111" in spawn or "child connect 101" in spawn), spawn
    assert f"sh id ['{uid}', '{uid}']" in spawn and f"forked id {uid}" in spawn, (who, spawn)
    # pidfd: refused by the filter; kill: the pids are not in the call's namespace
    for pid in (run["pid"], ctx["victim"]):
        assert f"pidfd {pid} 1" in outs["pidfd_and_kill"] and f"kill {pid} 3" in outs["pidfd_and_kill"], (
            who, outs["pidfd_and_kill"])
    # setns: the host's /proc is not there, and setns itself is refused; the loopback is unreachable
    s = outs["setns_and_connect"]
    assert f"open /proc/{run['pid']}/ns/net 2" in s and "setns /proc/self/ns/net -1 1" in s, (who, s)
    for call in ("unshare -1 1", "ptrace -1 1", "mount -1 1", "syscall -1 1"):  # 434: pidfd_open
        assert call in s.splitlines(), (who, call, s)
    assert ("connect 111" in s or "connect 101" in s) and "connected" not in s, (who, s)
    # reads: nothing of the host's files or of another process's environment
    r = outs["read_host"]
    for path in ("/etc/hostname", "/etc/passwd", f"{ctx['repo']}/sandbox.py", f"/proc/{run['pid']}/environ",
                 f"{ctx['hostdir']}/secret"):
        assert f"open {path} 2" in r, (who, path, r)
    assert host["marker"] not in r and "host secret" not in r, (who, r)
    # writes: none on the host (the paths are checked on the host below too)
    w = outs["write_host"]
    assert "wrote" not in w and w.count("write ") == 6, (who, w)
    # the pool killed the sleeper at wall_s and the CPU loop at its limit; neither held the others
    assert res["withhold"][2] and res["withhold"][1].startswith("the call ran longer than 6 s"), (who, res["withhold"])
    assert res["withhold"][3] < WALL_S + 3, (who, res["withhold"])
    assert res["cpu_loop"][1] == "the call exceeded its CPU time limit of 1 s" or res["cpu_loop"][2], (  # or, on a
        who, res["cpu_loop"])  # machine so loaded that 1 s of CPU takes over 6 s, the wall time
    # processes stop at the limit (the runner counts), files at the scratch tmpfs (16 MiB), many files in bounds
    forked = outs["fork_bomb"].split()
    assert forked[0] == "forked" and int(forked[1]) < PROCESSES and forked[3] == "11", (who, outs["fork_bomb"])
    fill = outs["fill_disk"].split()  # then files until 20000, the CPU limit or the wall time
    assert fill[0] == "bytes" and int(fill[1]) <= 16 << 20 and fill[3] == "28", (who, fill)  # ENOSPC
    assert res["fill_disk"][3] < WALL_S + 3, (who, res["fill_disk"])
    # replies: JSON-looking output is output; closed fds are an empty reply; writes to every fd reach only this call
    assert res["forge_json"][:2] == ['{"output": "forged", "error": null, "truncated": false, "cpu": 0}\n', None]
    assert res["close_stdout_stderr"][:2] == ["", None], (who, res["close_stdout_stderr"])
    assert res["write_every_fd"][0].endswith("done\n") and res["write_every_fd"][1] is None, (who, res)
    assert res["thread_after"][1] is None and not res["thread_after"][2], (who, res["thread_after"])


def _leftovers(marker: str) -> list:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def test_every_escape_fails_as_root_and_as_a_user_and_the_pool_keeps_serving(host):
    nobody = _runnable_as_nobody() if os.geteuid() == 0 else []
    runs = {"this user": _start([PYTHON], host)}
    if nobody:
        runs["uid 65534"] = _start(nobody, host)
    results = {who: _collect(p, who) for who, p in runs.items()}
    for who, run in results.items():
        _check(run, host, who)
        assert run["isolation"] == "bwrap"
    assert host["victim"].poll() is None, "the unrelated process was killed"
    assert host["accepted"] == [], "a probe reached the test's loopback server"
    for path in (os.path.join(ROOT, "pwned"), os.path.join(host["hostdir"], "pwned")):
        assert not os.path.exists(path), path
    deadline = time.monotonic() + 5
    while _leftovers(host["marker"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers(host["marker"]) == [], "a process started by a call outlived it"
    if os.geteuid() == 0 and not nobody:
        pytest.skip("ran as root only: no interpreter that uid 65534 can run (or no setpriv) on this machine")
    if os.geteuid() != 0:
        pytest.skip(f"ran as uid {os.geteuid()} only (the root run needs root)")


def test_calls_never_hold_the_event_loops_executor_and_a_cancelled_call_is_killed():
    """Four calls stuck until the wall limit, on a loop whose default executor has one thread: the executor still
    answers at once (the rollout's buffer dispatch runs there); a call cancelled by its caller (the rollout's
    env_step_timeout_s) leaves no process behind; then the pool serves normally."""
    pool = sandbox.SandboxPool(workers=4, cpu_s=1, wall_s=3)
    marker = f"cancelled{uuid.uuid4().hex[:12]}"

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        stuck = [asyncio.ensure_future(pool.arun("import time\ntime.sleep(60)")) for _ in range(3)]
        cancelled = asyncio.ensure_future(pool.arun(f"import os\nos.execv('/bin/sleep', ['{marker}', '60'])"))
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        assert await asyncio.wait_for(loop.run_in_executor(None, lambda: 7), 1.0) == 7
        executor_s = time.monotonic() - t0
        running = _leftovers(marker)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        deadline = time.monotonic() + 3
        while _leftovers(marker) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        gone = _leftovers(marker)
        results = await asyncio.gather(*stuck)
        return executor_s, running, gone, results, await pool.arun("6 * 7")

    executor_s, running, gone, results, after = asyncio.run(main())
    assert executor_s < 1.0 and running and gone == [], (executor_s, running, gone)
    assert all(r.killed and r.seconds < 6 for r in results), results
    assert after.output == "42\n" and after.error is None
