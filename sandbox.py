"""sandbox.py: run a model's Python, one call per sandbox, with bubblewrap (bwrap), a seccomp filter and limits.

- `SandboxPool(workers, cpu_s, wall_s, memory_mb, output_chars, processes, scratch_mb, isolation)`:
  `await arun(code) -> Result` (an asyncio subprocess: no thread is held while the code runs) and `run(code)` (the
  same, blocking, for sync callers; not from inside an event loop). At most `workers` calls run at once; the others
  wait for a slot. `Result.output` is what the code printed (an expression's value is printed, as a REPL does), cut
  to `output_chars`; `Result.error` is None or one line ("ZeroDivisionError: division by zero", "MemoryError",
  "the call exceeded its CPU time limit of 1 s", ...).
- Each call is a fresh `bwrap` process: new user (as a non-root caller), PID, mount, network, IPC, UTS and cgroup
  namespaces; a root of its own holding read-only binds of /usr, the merged-usr links and the interpreter's prefix
  only (not /etc, not the repository, not the run directory, not the host's /proc); its own /proc and a minimal
  /dev; a size-capped tmpfs /tmp as cwd and HOME; no network but its own loopback; no capabilities;
  `no_new_privs`; an environment of PATH, HOME and LANG only; a new session; a seccomp filter compiled here with
  libseccomp (ctypes) that refuses ptrace, process_vm_*, pidfd_*, setns, unshare and namespace flags of clone, the
  mount family, bpf, perf_event_open, keyctl, userfaultfd, io_uring, kexec, modules, ... (DENIED_SYSCALLS).
  Run as root, bwrap keeps only CAP_SETUID/CAP_SETGID for the runner, which drops to uid/gid 65533 - slot (every
  capability gone) before it reads the code: the code's processes never have uid 0 on the host.
- Inside, a trusted runner (`python -I -S`, stdlib only, _RUNNER) sets hard rlimits (RLIMIT_AS = memory_mb,
  RLIMIT_CPU = cpu_s rounded up (SIGKILL at the limit), RLIMIT_NPROC = processes (threads count), RLIMIT_FSIZE,
  RLIMIT_NOFILE, RLIMIT_CORE 0), reads the code from stdin, runs it and exits: 0, or RAISED with the error's one
  line as the last line of stderr. When the runner exits, the PID 1 of the call's namespace exits (bwrap's init as
  root, the runner itself as a user: `--as-pid-1`) and the kernel kills everything left there (a setsid child, a
  daemon).
- The reply is the child's stdout (capped as the pool reads it), its exit status and stderr's last line, read by the
  pool for that call alone: whatever the code writes reaches no other call, and a malformed or missing reply is only
  its own call's error. At `wall_s` the pool SIGKILLs bwrap (`--die-with-parent`: the namespace dies with it).
- `isolation="unsafe"` runs the same runner as a plain subprocess with the same rlimits and a scratch tempdir as cwd,
  and isolates nothing (the code can read and write what the pool's process can, reach the network, signal the
  rollout); the pool logs an error saying so. For a machine without bubblewrap, a test, a trusted model.
  Where bwrap is missing or the kernel refuses it, `SandboxPool(isolation="bwrap")` raises SandboxUnavailable in
  one sentence saying how to install it.

What it does not promise: docs/agents.md ("What the sandbox does not promise").

Run (a quick check of this machine's mechanism):
    python sandbox.py check
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import ctypes
import errno
import functools
import logging
import math
import os
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

ISOLATIONS = ("bwrap", "unsafe")
# A root caller's slot i runs as uid/gid SANDBOX_UID - i: a uid of its own (RLIMIT_NPROC counts per uid), not
# nobody's (65534: daemons run as nobody, and their processes would count), within Debian's reserved 65000-65533.
# A non-root caller's calls run as its own uid, each in a user namespace of its own (where RLIMIT_NPROC counts).
SANDBOX_UID = 65533
MAX_WORKERS = 512
MAX_CODE_BYTES = 1 << 20  # a call's code, UTF-8
FILE_LIMIT_MB = 16  # RLIMIT_FSIZE: the largest file the code may write
OPEN_FILES = 64  # RLIMIT_NOFILE
RAISED = 3  # the runner's exit status when the code raised (the error's line is stderr's last line)
STDERR_KEEP = 4096  # bytes of a call's stderr kept (the tail: the error line is the last)
START_CHECK_TIMEOUT_S = 30.0  # the pool's first call (a check that bwrap works here) must be done by then
KILL_WAIT_S = 10.0  # after SIGKILL, how long the pool waits for the sandbox to be reaped
INSTALL = "apt-get install bubblewrap (as root; setup.sh does it)"

# Refused with EPERM in the sandbox; a name this machine's libseccomp does not know is skipped.
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "kcmp",
    "setns", "unshare", "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "syslog", "uselib", "modify_ldt", "lookup_dcookie", "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "iopl", "ioperm", "vhangup", "mbind", "set_mempolicy", "migrate_pages", "move_pages", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "nfsservctl")
# clone with any of these flags (a new namespace) is refused; clone3 (its flags are behind a pointer) answers ENOSYS,
# so libc falls back to clone.
CLONE_NEW_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
TIOCSTI, TIOCLINUX = 0x5412, 0x541C  # ioctls that push input to a terminal: refused
PR_SET_PDEATHSIG = 1  # prctl: refused (clearing it would let a call outlive the bwrap the pool kills)

# The runner: argv[1:] = uid (-1: keep), then (resource name, soft, hard) triples. Stdlib only, no site.
_RUNNER = r"""
import os, resource, sys
a = sys.argv[1:]
uid = int(a[0])
if uid >= 0:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
for i in range(1, len(a), 3):
    resource.setrlimit(getattr(resource, a[i]), (int(a[i + 1]), int(a[i + 2])))
src = sys.stdin.buffer.read().decode("utf-8", "replace")
del a, uid, i
err = None
try:
    g = {"__name__": "__tool__", "__builtins__": __builtins__}
    try:
        c, expr = compile(src, "<tool>", "eval"), True
    except SyntaxError:
        c, expr = compile(src, "<tool>", "exec"), False
    v = eval(c, g)
    if expr and v is not None:
        print(repr(v))
    sys.stdout.flush()
except MemoryError:
    err = "MemoryError"
except BaseException as e:
    lines = str(e).strip().splitlines()
    err = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
if err is not None:
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    try:
        os.write(2, ("\n" + err + "\n").encode("utf-8", "replace"))
    except OSError:
        pass
os._exit(RAISED if err is not None else 0)
""".replace("RAISED", str(RAISED))


class _Capture:
    """A stream read by the pool: its first (or, tail=True, last) `keep` bytes, and how many came in all."""

    def __init__(self, keep: int, tail: bool):
        self.keep, self.tail, self.kept, self.total = keep, tail, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.tail:
            self.kept += chunk
            del self.kept[:-self.keep]
        elif len(self.kept) < self.keep:
            self.kept += chunk[:self.keep - len(self.kept)]


class SandboxUnavailable(RuntimeError):
    """bwrap is missing, or this kernel or container refuses what it needs."""


@dataclass
class Result:
    """One call's outcome: `output` (stdout, cut; what it printed before it was stopped, too), `error` (None or one
    line), whether the output was cut, the pool's isolation, its wall time, and whether the pool killed it (wall)."""
    output: str
    error: Optional[str]
    truncated: bool = False
    isolation: str = ""
    seconds: float = 0.0
    killed: bool = False


# ---------------------------------------------------------------------------------------------------------------
# The seccomp filter (libseccomp through ctypes) and the bwrap command line

class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


@functools.lru_cache(maxsize=None)
def seccomp_filter() -> bytes:
    """The BPF program bwrap loads (--seccomp FD): allow all but DENIED_SYSCALLS, namespace flags of clone, clone3
    and the terminal ioctls; another architecture's syscalls (int 0x80, x32) kill the process (libseccomp's
    default). SandboxUnavailable where libseccomp cannot be loaded."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as e:
        raise SandboxUnavailable(f"libseccomp (libseccomp.so.2) cannot be loaded ({e}); install it with apt-get "
                                 "install libseccomp2") from None
    lib.seccomp_init.restype, lib.seccomp_init.argtypes = ctypes.c_void_p, [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    allow, masked_eq, eq = 0x7FFF0000, 7, 4

    def deny(errno_):
        return 0x00050000 | errno_

    ctx = lib.seccomp_init(allow)
    if not ctx:
        raise SandboxUnavailable("libseccomp's seccomp_init failed")
    try:
        def add(name, action, *cmps):
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                return  # not a syscall of this architecture or this libseccomp
            arr = (_ArgCmp * len(cmps))(*cmps) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
            if rc < 0:
                raise SandboxUnavailable(f"libseccomp refused a rule for {name} ({os.strerror(-rc)})")

        for name in DENIED_SYSCALLS:
            add(name, deny(errno.EPERM))
        add("clone3", deny(errno.ENOSYS))
        for flag in CLONE_NEW_FLAGS:
            add("clone", deny(errno.EPERM), _ArgCmp(0, masked_eq, flag, flag))
        for request in (TIOCSTI, TIOCLINUX):
            add("ioctl", deny(errno.EPERM), _ArgCmp(1, eq, request, 0))
        add("prctl", deny(errno.EPERM), _ArgCmp(0, eq, PR_SET_PDEATHSIG, 0))  # a runner that is PID 1 keeps it
        r, w = os.pipe()
        try:
            rc = lib.seccomp_export_bpf(ctx, w)
            os.close(w)
            w = -1
            if rc < 0:
                raise SandboxUnavailable(f"libseccomp could not export the filter ({os.strerror(-rc)})")
            chunks = []
            while chunk := os.read(r, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        return b"".join(chunks)
    finally:
        lib.seccomp_release(ctx)


def _filter_fd(data: bytes) -> int:
    """A pipe's read end holding data (the filter, a few KiB: within the pipe's buffer), for bwrap --seccomp."""
    r, w = os.pipe()
    try:
        os.write(w, data)
    finally:
        os.close(w)
    return r


@functools.lru_cache(maxsize=None)
def _mounts() -> tuple:
    """Read-only binds of what the interpreter needs: /usr, the merged-usr links (or directories), and the base
    interpreter's prefix(es) where they are outside /usr."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    exe = _interpreter()
    prefixes = []
    for p in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(exe))):
        p = os.path.realpath(p)
        if p != "/" and not any(p == q or p.startswith(q + "/") for q in ["/usr"] + prefixes):
            prefixes.append(p)
    for p in prefixes:
        parents = []
        d = os.path.dirname(p)
        while d != "/":
            parents.insert(0, d)
            d = os.path.dirname(d)
        for d in parents:  # made searchable here (bwrap would copy the host's mode: /root is 0700)
            args += ["--perms", "0755", "--dir", d]
        args += ["--ro-bind", p, p]
    return tuple(args)


def _interpreter() -> str:
    """The base interpreter (a virtual environment's python is a link to it; the runner needs the stdlib only)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


# ---------------------------------------------------------------------------------------------------------------
# Slots: at most `workers` calls at once, shared by run() (threads, each with its own event loop) and arun()

class _Slots:
    def __init__(self, n: int):
        self._free = list(range(n - 1, -1, -1))
        self._lock = threading.Lock()
        self._waiters: collections.deque = collections.deque()  # callables that take a slot

    def _grant(self, take) -> Optional[int]:
        with self._lock:
            if self._free and not self._waiters:
                return self._free.pop()
            self._waiters.append(take)
            return None

    async def acquire(self) -> int:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def deliver(slot):
            if fut.cancelled():
                self.release(slot)
            else:
                fut.set_result(slot)

        def take(slot):
            try:
                loop.call_soon_threadsafe(deliver, slot)
            except RuntimeError:  # the waiter's loop is closed
                self.release(slot)

        slot = self._grant(take)
        if slot is not None:
            return slot
        try:
            return await fut
        except asyncio.CancelledError:
            with self._lock:
                try:
                    self._waiters.remove(take)
                except ValueError:
                    pass  # already granted: deliver() releases it
            raise

    def release(self, slot: int) -> None:
        with self._lock:
            if not self._waiters:
                self._free.append(slot)
                return
            take = self._waiters.popleft()
        take(slot)


# ---------------------------------------------------------------------------------------------------------------
# The pool

class SandboxPool:
    """Calls of model-written Python, each in its own sandbox (module docstring), at most `workers` at once.

    workers       calls running at once (more wait for a slot), 1-MAX_WORKERS
    cpu_s         CPU seconds a process of a call may use (RLIMIT_CPU, rounded up to whole seconds)
    wall_s        wall seconds a call may take, then the pool kills it (default: 2 x cpu_s + 1)
    memory_mb     RLIMIT_AS of each process of a call, interpreter included (an allocation beyond it: MemoryError)
    output_chars  stdout kept per call; the rest is dropped (Result.truncated)
    processes     RLIMIT_NPROC: processes and threads of a call, the runner included
    scratch_mb    size of the call's tmpfs /tmp (its cwd, gone with the call)
    isolation     "bwrap" (the sandbox; SandboxUnavailable where it cannot run) or "unsafe" (no isolation at all)
    """

    def __init__(self, workers: int = 4, cpu_s: float = 1.0, wall_s: Optional[float] = None, memory_mb: int = 256,
                 output_chars: int = 256, processes: int = 16, scratch_mb: int = 16, isolation: str = "bwrap"):
        def bad(what: str, value) -> ValueError:
            return ValueError(f"SandboxPool {what}, got {value!r}")

        if not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
            raise bad(f"workers must be an integer in 1-{MAX_WORKERS}", workers)
        if not (isinstance(cpu_s, (int, float)) and math.isfinite(cpu_s) and cpu_s > 0):
            raise bad("cpu_s must be a finite number > 0", cpu_s)
        if wall_s is not None and not (isinstance(wall_s, (int, float)) and math.isfinite(wall_s) and wall_s > 0):
            raise bad("wall_s must be a finite number > 0 (or None: 2 x cpu_s + 1)", wall_s)
        if not isinstance(memory_mb, int) or memory_mb < 64:
            raise bad("memory_mb must be an integer >= 64 (the interpreter itself needs ~30)", memory_mb)
        if not isinstance(output_chars, int) or output_chars < 1:
            raise bad("output_chars must be an integer >= 1", output_chars)
        if not isinstance(processes, int) or not 1 <= processes <= 4096:
            raise bad("processes must be an integer in 1-4096 (threads count)", processes)
        if not isinstance(scratch_mb, int) or not 1 <= scratch_mb <= 1 << 16:
            raise bad("scratch_mb must be an integer in 1-65536", scratch_mb)
        if isolation not in ISOLATIONS:
            raise bad(f"isolation must be one of {', '.join(ISOLATIONS)}", isolation)
        self.workers, self.cpu_s, self.memory_mb, self.output_chars = workers, cpu_s, memory_mb, output_chars
        self.wall_s = wall_s if wall_s is not None else 2 * cpu_s + 1
        self.processes, self.scratch_mb, self.isolation = processes, scratch_mb, isolation
        self.stats = {"calls": 0, "errors": 0, "killed": 0}
        self._slots = _Slots(workers)
        self._lock = threading.Lock()
        self._running: dict = {}  # pid -> (loop, process) of calls in flight
        self._closed = False
        self._root = os.geteuid() == 0
        if isolation == "bwrap":
            self._bwrap = shutil.which("bwrap")
            if self._bwrap is None:
                raise SandboxUnavailable(f"the Python tool's sandbox needs bubblewrap (bwrap), not found on PATH: "
                                         f"install it ({INSTALL}), or set isolation='unsafe' to run the code with "
                                         "no isolation at all")
            self._filter = seccomp_filter()
            self._check()
        else:
            log.error("sandbox: isolation='unsafe': the model's code runs as a plain subprocess of this process, "
                      "with rlimits only; it can read and write this user's files, reach the network and signal "
                      "this process; isolation='bwrap' is the sandbox")
        atexit.register(self.close)

    # -- one call ------------------------------------------------------------------------------------------------

    def _limits(self) -> list:
        cpu = max(1, math.ceil(self.cpu_s))
        mem, fsize = self.memory_mb << 20, FILE_LIMIT_MB << 20
        out = []
        for name, soft, hard in (("RLIMIT_AS", mem, mem), ("RLIMIT_CPU", cpu, cpu),
                                 ("RLIMIT_NPROC", self.processes, self.processes), ("RLIMIT_FSIZE", fsize, fsize),
                                 ("RLIMIT_NOFILE", OPEN_FILES, OPEN_FILES), ("RLIMIT_CORE", 0, 0)):
            out += [name, str(soft), str(hard)]
        return out

    def _command(self, slot: int, filter_fd: int, scratch: Optional[str]) -> list:
        runner = [_interpreter(), "-I", "-S", "-c", _RUNNER]
        if self.isolation == "unsafe":
            return runner + ["-1"] + self._limits()
        uid = SANDBOX_UID - slot if self._root else -1
        if self._root:  # no user namespace: the runner drops to uid, which needs these two until it does
            ns = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                  "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            # --as-pid-1: no bwrap init in the call's namespace (it would run unfiltered, with the code's uid, its
            # memory writable through /proc/1/mem); the runner is PID 1 and keeps bwrap's parent-death signal
            ns = ["--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                  "--unshare-uts", "--unshare-cgroup-try", "--cap-drop", "ALL", "--as-pid-1"]
        return ([self._bwrap] + ns + ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
                                      "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                                      "--setenv", "LANG", "C.UTF-8"]
                + list(_mounts()) + ["--proc", "/proc", "--dev", "/dev",
                                     "--perms", "1777", "--size", str(self.scratch_mb << 20), "--tmpfs", "/tmp",
                                     "--perms", "1777", "--size", str(1 << 20), "--tmpfs", "/dev/shm",
                                     "--remount-ro", "/dev", "--remount-ro", "/",
                                     "--chdir", "/tmp", "--seccomp", str(filter_fd), "--"]
                + runner + [str(uid)] + self._limits())

    async def arun(self, code: str) -> Result:
        """Run `code` in its own sandbox; never raises for what the code does (that is in Result.error)."""
        if self._closed:
            raise RuntimeError("the SandboxPool is closed")
        data = code.encode("utf-8", "replace")
        if len(data) > MAX_CODE_BYTES:
            return self._count(Result("", f"the code is {len(data)} bytes, over the sandbox's limit of "
                                          f"{MAX_CODE_BYTES}", isolation=self.isolation))
        slot = await self._slots.acquire()
        try:
            return self._count(await self._call(slot, data))
        finally:
            self._slots.release(slot)

    def run(self, code: str) -> Result:
        """arun() for sync callers (a thread of its own, or the main thread): its own event loop for the call."""
        return asyncio.run(self.arun(code))

    def _count(self, r: Result) -> Result:
        with self._lock:
            self.stats["calls"] += 1
            self.stats["errors"] += r.error is not None
            self.stats["killed"] += r.killed
        return r

    async def _call(self, slot: int, data: bytes) -> Result:
        t0 = time.monotonic()
        unsafe = self.isolation == "unsafe"
        scratch = tempfile.mkdtemp(prefix="sandbox-unsafe-") if unsafe else None
        fd = -1 if unsafe else _filter_fd(self._filter)
        try:
            env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"} if unsafe else {}
            proc = await asyncio.create_subprocess_exec(
                *self._command(slot, fd, scratch), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=() if unsafe else (fd,), env=env, cwd=scratch,
                start_new_session=unsafe)
        except BaseException:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        with self._lock:
            self._running[proc.pid] = (asyncio.get_running_loop(), proc)
        out, err = _Capture(4 * self.output_chars + 4, tail=False), _Capture(STDERR_KEEP, tail=True)  # UTF-8: 4 B
        killed = False
        try:
            try:
                await asyncio.wait_for(self._exchange(proc, data, out, err), self.wall_s)
            except asyncio.TimeoutError:
                killed = True
        finally:  # also when the caller is cancelled (rollout.env_step_timeout_s): the sandbox never outlives it
            if proc.returncode is None:
                self._kill(proc)
                try:
                    await asyncio.wait_for(proc.wait(), KILL_WAIT_S)
                except asyncio.TimeoutError:
                    log.error("sandbox: pid %d not reaped %g s after SIGKILL", proc.pid, KILL_WAIT_S)
            with self._lock:
                self._running.pop(proc.pid, None)
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
        text = bytes(out.kept).decode("utf-8", "replace")  # what it printed, also before a kill
        output, truncated = text[:self.output_chars], out.total > len(out.kept) or len(text) > self.output_chars
        error = (f"the call ran longer than {self.wall_s:g} s (wall); it was killed" if killed else
                 self._error(proc.returncode, bytes(err.kept)))
        return Result(output, error, truncated, self.isolation, time.monotonic() - t0, killed)

    @staticmethod
    async def _exchange(proc, data: bytes, out: "_Capture", err: "_Capture") -> None:
        """Write the code, close stdin, read stdout and stderr to EOF into their captures, wait for the exit."""
        async def write():
            try:
                proc.stdin.write(data)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the code's process is gone or closed fd 0: its exit status says what happened
            finally:
                proc.stdin.close()

        async def read(stream, capture: _Capture):
            while chunk := await stream.read(1 << 16):
                capture.add(chunk)

        await asyncio.gather(write(), read(proc.stdout, out), read(proc.stderr, err))
        await proc.wait()

    def _kill(self, proc) -> None:
        try:
            if self.isolation == "unsafe":
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except (ProcessLookupError, PermissionError):
            pass

    def _error(self, code: int, err: bytes) -> Optional[str]:
        lines = [line.strip() for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
        last = lines[-1][:300] if lines else ""
        if code == 0:
            return None
        if code == RAISED:
            return last or "the code raised (its error line is missing)"
        sig = -code if code < 0 else code - 128 if code > 128 else 0  # bwrap reports a signal as 128 + its number
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and not last):
            return f"the call exceeded its CPU time limit of {max(1, math.ceil(self.cpu_s))} s"
        if sig:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            return f"the call died of {name}" + (f": {last}" if last else "")
        return f"the call exited with code {code}" + (f": {last}" if last else "")

    def _check(self) -> None:
        """One call of `6*7` here, now: SandboxUnavailable in one sentence where bwrap cannot run on this machine."""
        fd = _filter_fd(self._filter)
        try:
            p = subprocess.run(self._command(0, fd, None), input=b"6*7", capture_output=True, env={},
                               pass_fds=(fd,), timeout=START_CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p = None
        finally:
            os.close(fd)
        if p is not None and p.returncode == 0 and p.stdout == b"42\n":
            return
        why = (f"no answer within {START_CHECK_TIMEOUT_S:g} s" if p is None else
               (p.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {p.returncode}"])[-1])
        raise SandboxUnavailable(
            f"the Python tool's sandbox cannot run here (bwrap: {why}): it needs bubblewrap and, as a non-root user, "
            f"user namespaces (sysctl user.max_user_namespaces > 0); install it ({INSTALL}), or set "
            "isolation='unsafe' to run the code with no isolation at all")

    def close(self) -> None:
        """Refuse new calls and kill the calls in flight (they return a killed Result)."""
        with self._lock:
            self._closed = True
            running = list(self._running.values())
        for loop, proc in running:
            try:
                loop.call_soon_threadsafe(self._kill, proc)
            except RuntimeError:  # that loop is closed (interpreter exit): kill it from here
                self._kill(proc)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        logging.basicConfig(level=logging.INFO)
        pool = SandboxPool(workers=1)
        for code in ("6*7", "__import__('os').getuid()", "open('/etc/hostname').read()",
                     "import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)"):
            r = pool.run(code)
            print(f"{code!r}: output={r.output!r} error={r.error!r} seconds={r.seconds:.3f}")
    else:
        print(__doc__)


if __name__ == "__main__":
    main()
