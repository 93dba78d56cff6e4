"""sandbox.py: the Python tool's pool. A call that loops forever, one that allocates 4 GiB, one that sleeps past its
wall time, one that prints too much and one that raises are each stopped or reported in one line, and the pool
keeps serving; each call starts in an empty scratch directory; at most `workers` calls run at once and a cancelled
wait gives its slot back; where bwrap is missing or cannot run, the pool refuses in one sentence saying how to
install it, and isolation="unsafe" runs the code with the rlimits alone. The attacks: tests/test_sandbox_escape.py.

Run: .venv/bin/python -m pytest -q -n 0 tests/test_sandbox.py
"""
import asyncio
import logging
import math
import os
import shutil
import time

import pytest

import sandbox

# Without bubblewrap a non-root machine skips what needs it; as root (CI: setup.sh installs it) a missing bwrap fails.
NEEDS_BWRAP = pytest.mark.skipif(shutil.which("bwrap") is None and os.geteuid() != 0,
                                 reason="bubblewrap is not installed (as root: apt-get install bubblewrap)")


@pytest.fixture(scope="module")
def pool():
    p = sandbox.SandboxPool(workers=2, cpu_s=0.5, wall_s=30, memory_mb=256, output_chars=16)
    yield p
    p.close()


@NEEDS_BWRAP
def test_limits_are_reported_in_one_line_and_the_pool_keeps_serving(pool):
    before = dict(pool.stats)
    assert pool.run("6 * 7").output == "42\n"
    loop = pool.run("while True: pass")  # RLIMIT_CPU (0.5 s rounded up to 1 s): the kernel kills it
    assert loop.error == "the call exceeded its CPU time limit of 1 s" and not loop.killed, loop
    big = pool.run("x = bytearray(4 << 30)\nprint(len(x))")  # RLIMIT_AS: refused inside the code
    assert big.error == "MemoryError" and big.output == "", big
    out = pool.run("print('a' * 100)")
    assert out.output == "a" * 16 and out.truncated and out.error is None
    assert pool.run("1/0").error == "ZeroDivisionError: division by zero"
    assert pool.run("import os\nos._exit(7)").error == "the call exited with code 7"
    assert pool.run("print('x')\nraise SystemExit(3)").output == "x\n"
    assert pool.run("6 * 7").output == "42\n" and pool.run("6 * 7").isolation == "bwrap"
    done = {k: pool.stats[k] - before[k] for k in before}
    assert done == {"calls": 9, "errors": 5, "killed": 0}, done


@NEEDS_BWRAP
def test_wall_time_scratch_and_files(pool):
    pool.wall_s = 1.0
    try:
        slow = pool.run("import time\nprint('before', flush=True)\ntime.sleep(60)")  # no CPU: the wall clock
    finally:
        pool.wall_s = 30
    assert slow.killed and slow.error == "the call ran longer than 1 s (wall); it was killed" and slow.seconds < 10
    assert slow.output == "before\n"  # what it printed before it was killed
    assert pool.run("open('f', 'w').write('x')\nimport os\nprint(os.listdir('.'))").output == "['f']\n"
    assert pool.run("import os\nprint(os.listdir('.'), os.getcwd())").output == "[] /tmp\n"  # a fresh tmpfs
    big = pool.run("open('f', 'wb').write(b'x' * (32 << 20))")  # RLIMIT_FSIZE 16 MiB (Python ignores SIGXFSZ)
    assert big.error == "OSError: [Errno 27] File too large", big


@NEEDS_BWRAP
def test_at_most_workers_calls_at_once_and_a_cancelled_wait_gives_its_slot_back():
    p = sandbox.SandboxPool(workers=1, cpu_s=1, wall_s=10)

    async def main():
        t0 = time.monotonic()
        first = asyncio.ensure_future(p.arun("import time\ntime.sleep(0.5)\nprint(1)"))
        waiting = asyncio.ensure_future(p.arun("print(2)"))
        await asyncio.sleep(0.1)
        waiting.cancel()
        third = await p.arun("print(3)")  # after the first: the cancelled wait did not keep the slot
        return (await first).output, third.output, time.monotonic() - t0, waiting.cancelled()

    first, third, seconds, cancelled = asyncio.run(main())
    assert (first, third, cancelled) == ("1\n", "3\n", True) and seconds >= 0.5
    p.close()
    with pytest.raises(RuntimeError, match="the SandboxPool is closed"):
        p.run("1")


def test_without_bwrap_the_pool_refuses_in_one_sentence(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(sandbox.SandboxUnavailable, match=r"needs bubblewrap \(bwrap\), not found on PATH: install "
                                                         r"it \(apt-get install bubblewrap .*isolation='unsafe'"):
        sandbox.SandboxPool()
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: "/bin/false")  # a bwrap that the kernel refuses
    with pytest.raises(sandbox.SandboxUnavailable, match=r"cannot run here \(bwrap: exit status 1\).*"
                                                         r"user.max_user_namespaces"):
        sandbox.SandboxPool()


def test_the_agent_config_stops_at_start_up_without_the_sandbox(monkeypatch):
    """configs/tiny_agent.yaml's start-up checks (train.py -> checks.check_inputs -> tasks.check_env ->
    PyToolEnv.check) refuse it in the sandbox's one sentence, before any server or process starts."""
    import checks
    import config as config_lib

    cfg = config_lib.load_config("configs/tiny_agent.yaml", [])
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"^the PyToolEnv environment cannot run: the Python tool's sandbox needs "
                                         r"bubblewrap \(bwrap\), not found on PATH: install it"):
        checks.check_inputs(cfg)
    cfg = config_lib.load_config("configs/tiny.yaml", [])  # a single-turn task asks nothing of the sandbox
    checks.check_inputs(cfg)


def test_unsafe_runs_the_same_runner_with_its_limits_and_says_it_isolates_nothing(caplog):
    with caplog.at_level(logging.ERROR, logger="sandbox"):
        p = sandbox.SandboxPool(workers=1, cpu_s=1, wall_s=5, isolation="unsafe")
    assert any("isolates nothing" in r.getMessage() or "with rlimits only" in r.getMessage() for r in caplog.records)
    r = p.run("import os\nprint(os.getcwd().startswith(os.path.realpath(__import__('tempfile').gettempdir())))")
    assert r.output == "True\n" and r.isolation == "unsafe"
    assert p.run("while True: pass").error == "the call exceeded its CPU time limit of 1 s"
    assert p.run("x = bytearray(4 << 30)").error == "MemoryError"
    p.close()


def test_bad_settings_are_one_sentence():
    for kwargs, message in (({"workers": 0}, "workers must be an integer in 1-512, got 0"),
                            ({"cpu_s": math.nan}, "cpu_s must be a finite number > 0, got nan"),
                            ({"wall_s": math.inf}, "wall_s must be a finite number > 0"),
                            ({"processes": 0}, "processes must be an integer in 1-4096"),
                            ({"isolation": "off"}, "isolation must be one of bwrap, unsafe, got 'off'")):
        with pytest.raises(ValueError, match=f"SandboxPool {message}"):
            sandbox.SandboxPool(**kwargs)


@NEEDS_BWRAP
def test_the_seccomp_filter_compiles():
    bpf = sandbox.seccomp_filter()
    assert len(bpf) > 8 * len(sandbox.DENIED_SYSCALLS) and len(bpf) % 8 == 0  # struct sock_filter: 8 bytes
