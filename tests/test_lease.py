"""lease.py against what breaks it: server records validated when read, a recorded pid signalled only when it is one
of our watchdogs, servers that die with their watchdog, a lease whose renewal stops when the step loop stalls, and a
clean close that leaves another owner's lease alone. Unit-level: `sleep` and `sh` stand for the servers.

Run: .venv/bin/python -m pytest -q tests/test_lease.py
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import config  # noqa: E402
import lease  # noqa: E402
import services  # noqa: E402

PY = sys.executable
LEASE_PY = os.path.join(ROOT, "lease.py")


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    return lease.start_time(pid) is None


def _kill(*procs) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            p.wait(5)


def _fake_sglang(tmp_path) -> dict:
    """An environment whose `python -m sglang.launch_server` sleeps: a process with a server's command line."""
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text("import time\ntime.sleep(120)\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}


def _svc(tmp_path, *overrides):
    cfg = config.load_config(None, [f"run_dir={tmp_path}", "colocate=false",
                                    f"rollout.base_port={services.free_port()}", *overrides])
    svc = services.Services(cfg)
    svc.spawn = lambda name, cmd, env: svc.spawned.append(name)
    svc.spawned = []
    return svc


# ---------------------------------------------------------------------------------------------------------------
# Records

GOOD = {"pid": 4242, "started": "123", "cmd": ["python", "-m", "standins.engine"], "url": "http://127.0.0.1:1",
        "gpus": None, "weight_version": 3}
BAD = [  # (record, the words naming the field)
    ({"node": 0, "weight_group": None, "servers": []}, "servers must be a mapping"),
    ({"node": 0, "servers": {"server_0": {**GOOD, "pid": 1}}}, "servers.server_0.pid must be an integer > 1, got 1"),
    ({"node": 0, "servers": {"server_0": {**GOOD, "pid": "77"}}}, "servers.server_0.pid must be an integer > 1"),
    ({"node": 0, "servers": {"server_0": {**GOOD, "pid": True}}}, "servers.server_0.pid must be an integer > 1"),
    ({"node": 0, "servers": {"server_0": {k: v for k, v in GOOD.items() if k != "started"}}},
     "servers.server_0.started is missing"),
    ({"node": 0, "servers": {"server_0": {**GOOD, "cmd": "python -m standins.engine"}}},
     "servers.server_0.cmd must be a non-empty list of strings"),
    ({"node": 0, "servers": {"server_0": {**GOOD, "weight_version": -1}}}, "servers.server_0.weight_version"),
    ({"node": 0, "weight_group": 7, "servers": {}}, "weight_group must be a string or null"),
    ({"servers": {}}, "node must be an integer >= 0"),
    ([GOOD], "the record must be a mapping, got list"),
    ('{"node": 0, "servers": {', "could not be read as JSON"),
]


@pytest.mark.parametrize("record,field", BAD, ids=[b[1][:30] for b in BAD])
def test_a_bad_server_record_is_refused_naming_the_file_and_field_and_kept_aside(tmp_path, capsys, record, field):
    path = str(tmp_path / "node0.json")
    with open(path, "w") as f:
        f.write(record if isinstance(record, str) else json.dumps(record))
    assert lease.read_record(path) == {}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the server record {path} is refused: " in err[0] and field in err[0], err
    assert not os.path.exists(path) and os.path.exists(path + ".bad")  # set aside, not deleted
    good = {"node": 0, "weight_group": "g", "servers": {"server_0": GOOD}}
    lease.write_record(path, good)
    assert lease.read_record(path) == good and capsys.readouterr().err == ""


def test_a_start_with_servers_as_a_list_in_the_record_launches_fresh_servers(tmp_path, capsys):
    """`"servers": []` crashed every start (AttributeError: 'list' object has no attribute 'items')."""
    svc = _svc(tmp_path)
    record_path, _ = lease.paths(str(tmp_path), 0)
    lease.write_record(record_path, {"node": 0, "weight_group": None, "servers": []})
    try:
        urls = svc._spawn_servers(0, 0)
    finally:
        svc.lease.stop()
    assert list(urls) == [0] and svc.spawned == ["server_0"]
    assert "servers must be a mapping" in capsys.readouterr().err and os.path.exists(record_path + ".bad")


# ---------------------------------------------------------------------------------------------------------------
# A recorded pid is signalled only when it is one of our watchdogs running a server

def test_pid_1_and_a_process_that_is_not_our_server_are_never_adopted_or_signalled(tmp_path, capsys):
    """pid 1 with its real start time is not adopted (a record naming it is refused: pids are > 1); a `sleep` in a
    session of its own, named in the record with its real start time, is neither adopted nor signalled by a start;
    a watchdog running a server's command line is adopted."""
    assert lease.adopt({"pid": 1, "started": lease.start_time(1), "cmd": ["x"]}) is None
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ours = subprocess.Popen([PY, LEASE_PY, "--lease", str(tmp_path / "l"), "--keepalive-s", "60", "--", PY, "-m",
                             "sglang.launch_server"], env=_fake_sglang(tmp_path), start_new_session=True)
    try:
        _wait(lambda: lease.start_time(ours.pid) and "sglang.launch_server" in open(
            f"/proc/{ours.pid}/cmdline").read(), 10, "the watchdog")
        assert lease.not_our_server(ours.pid) is None
        assert lease.adopt({"pid": ours.pid, "started": lease.start_time(ours.pid)}).pid == ours.pid
        assert "is not" in lease.not_our_server(other.pid) and "is not" in lease.not_our_server(1)
        svc = _svc(tmp_path, "rollout.server_layout=[{node: 0}]")
        record_path, lease_path = lease.paths(str(tmp_path), 0)
        lease.write_record(record_path, {"node": 0, "weight_group": None, "servers": {
            "server_0": {"pid": other.pid, "started": lease.start_time(other.pid), "cmd": ["sleep", "60"]}}})
        try:
            svc._spawn_servers(0, 0)
        finally:
            svc.lease.stop()
        assert svc.spawned == ["server_0"]
        time.sleep(0.3)
        assert other.poll() is None  # not signalled
        err = capsys.readouterr().err
        assert f"server_0's recorded pid {other.pid} runs but is not a server this run launched" in err
    finally:
        _kill(other, ours)


def _watchdog(tmp_path, lease_path: str):
    p = subprocess.Popen([PY, LEASE_PY, "--lease", lease_path, "--keepalive-s", "60", "--", PY, "-m",
                          "sglang.launch_server"], env=_fake_sglang(tmp_path), start_new_session=True)
    _wait(lambda: lease.not_our_server(p.pid) is None, 10, "the watchdog")
    return p


def test_a_record_copied_from_another_run_dir_never_touches_that_runs_servers(tmp_path, capsys):
    """`cp -r runs/a runs/b` while run a runs: run b's start reads a record naming run a's live servers (pid, start
    time and command line all match) and must neither adopt nor stop them: they watch another lease file."""
    other = _watchdog(tmp_path, str(tmp_path / "a" / "servers" / "node0.lease"))
    try:
        svc = _svc(tmp_path / "b", "rollout.server_layout=[{node: 0}]")
        record_path, lease_path = lease.paths(str(tmp_path / "b"), 0)
        entry = {"pid": other.pid, "started": lease.start_time(other.pid), "cmd": ["python", "-m", "standins.engine"]}
        lease.write_record(record_path, {"node": 0, "weight_group": None, "servers": {"server_0": entry,
                                                                                      "server_7": entry}})
        try:
            svc._spawn_servers(0, 0)
        finally:
            svc.lease.stop()
        assert svc.spawned == ["server_0"] and not svc.adopted
        time.sleep(0.3)
        assert other.poll() is None  # neither stopped as server_0 nor as server_7 (not in this run's layout)
        assert f"watches the lease {tmp_path / 'a' / 'servers' / 'node0.lease'}" in capsys.readouterr().err
    finally:
        _kill(other)


def test_a_server_under_this_nodes_lease_that_no_record_names_is_stopped_at_start(tmp_path, capsys):
    """A refused record's servers are unknown by pid, but our renewal of the same lease file would keep them alive
    for the whole run: the start stops every watchdog of this node's lease that the record does not name (found by
    its command line), and no other one."""
    record_path, lease_path = lease.paths(str(tmp_path), 0)
    stray = _watchdog(tmp_path, lease_path)
    elsewhere = _watchdog(tmp_path, str(tmp_path / "other.lease"))
    try:
        lease.write_record(record_path, {"node": 0, "weight_group": None, "servers": {"server_0": {"pid": 1}}})
        svc = _svc(tmp_path, "rollout.server_layout=[{node: 0}]")
        try:
            svc._spawn_servers(0, 0)
        finally:
            svc.lease.stop()
        assert stray.wait(15) is not None and elsewhere.poll() is None
        assert svc.spawned == ["server_0"] and lease.watchdogs(lease_path) == []
        assert f"stopping pid {stray.pid}, a server under this node's lease" in capsys.readouterr().out
    finally:
        _kill(stray, elsewhere)


def test_the_watcher_does_not_relaunch_a_server_while_the_lease_is_lapsed(tmp_path):
    """A wedged trainer's servers stop when its lease lapses; its watcher thread (alive) must not launch them again
    (each relaunch would live rollout.server_keepalive_s more, for ever). Once the loop beats again, it does."""
    svc = _svc(tmp_path)
    svc.lease = lease.Lease(str(tmp_path / "node0.lease"), stall_s=60)
    dead = subprocess.Popen(["true"])
    dead.wait()
    svc.servers["server_0"] = (["x"], {}, "http://127.0.0.1:1")
    svc.procs["server_0"] = (dead, str(tmp_path / "server_0.log"))
    relaunched = []
    svc.relaunch = lambda name: (relaunched.append(name), svc.procs.update(server_0=(subprocess.Popen(
        ["sleep", "30"]), "log")))
    svc.lease.lapsed = True
    svc.watch()
    try:
        time.sleep(4 * services.WATCH_S)
        assert relaunched == []
        svc.lease.lapsed = False  # the loop beat again and the renewal thread renewed
        _wait(lambda: relaunched == ["server_0"], 5, "the relaunch")
    finally:
        svc.closing.set()
        svc.procs["server_0"][0].kill()


def test_a_watchdog_that_does_not_lead_its_group_is_not_ours(tmp_path, monkeypatch):
    """stop() kills the process group of the pid: a pid that does not lead its own group and session is refused."""
    ours = subprocess.Popen([PY, LEASE_PY, "--lease", str(tmp_path / "l"), "--keepalive-s", "60", "--", PY, "-m",
                             "sglang.launch_server"], env=_fake_sglang(tmp_path), start_new_session=True)
    try:
        _wait(lambda: lease.not_our_server(ours.pid) is None, 10, "the watchdog")
        monkeypatch.setattr(os, "getpgid", lambda pid: 1)
        assert "does not lead its own session and process group (group 1" in lease.not_our_server(ours.pid)
    finally:
        monkeypatch.undo()
        _kill(ours)


# ---------------------------------------------------------------------------------------------------------------
# The watchdog is the server's parent: the server dies with it

def _launch(tmp_path, keepalive_s: str, lease_path: str):
    """A watchdog running `sh` (which writes its pid and starts a child in its session, as SGLang its schedulers)."""
    p = subprocess.Popen([PY, LEASE_PY, "--lease", lease_path, "--keepalive-s", keepalive_s, "--", "sh", "-c",
                          "echo $$ > server; sleep 120 & echo $! > child; wait"], cwd=tmp_path,
                         start_new_session=True, stderr=subprocess.PIPE, text=True)
    _wait(lambda: all((tmp_path / f).exists() and (tmp_path / f).read_text().strip() for f in ("server", "child")),
          10, "the server and its child")
    return p, int((tmp_path / "server").read_text()), int((tmp_path / "child").read_text())


def test_a_watchdog_killed_with_sigkill_takes_its_server_along(tmp_path):
    renewer = lease.Lease(str(tmp_path / "node0.lease"))
    renewer.start()
    p, server, child = _launch(tmp_path, "60", renewer.path)
    try:
        assert server != p.pid and p.poll() is None
        os.kill(p.pid, signal.SIGKILL)
        _wait(lambda: _gone(server), 5, "the server gone with its watchdog")
    finally:
        renewer.stop()
        _kill(p)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_sigterm_to_the_watchdog_stops_the_server_and_its_session_and_exits_as_the_server_did(tmp_path):
    renewer = lease.Lease(str(tmp_path / "node0.lease"))
    renewer.start()
    p, server, child = _launch(tmp_path, "60", renewer.path)
    try:
        p.terminate()
        assert p.wait(10) == -signal.SIGTERM
        _wait(lambda: _gone(server) and _gone(child), 5, "the server and its child gone")
    finally:
        renewer.stop()
        _kill(p)


def test_the_watchdog_exits_as_its_server_did(tmp_path):
    """services.Services reports the watchdog's exit status as the server's ("killed by SIGKILL", "exited with code
    3"): what a relaunch message names."""
    renewer = lease.Lease(str(tmp_path / "node0.lease"))
    renewer.start()
    try:
        p, server, child = _launch(tmp_path, "60", renewer.path)
        os.kill(server, signal.SIGKILL)
        assert p.wait(10) == -signal.SIGKILL
        _wait(lambda: _gone(child), 5, "the server's child gone")
        p = subprocess.Popen([PY, LEASE_PY, "--lease", renewer.path, "--keepalive-s", "60", "--", "sh", "-c",
                              "exit 3"], start_new_session=True)
        assert p.wait(10) == 3
    finally:
        renewer.stop()
        _kill(p)


def test_a_stalled_step_loop_stops_the_servers_within_stall_plus_keepalive(tmp_path):
    """The renewal thread runs, but the step loop beats no more: renewal stops after stall_s, the watchdog stops
    the server keepalive_s later. ~4 s."""
    renewer = lease.Lease(str(tmp_path / "node0.lease"), stall_s=0.5)
    t0 = time.monotonic()
    renewer.start()  # beats once
    p, server, child = _launch(tmp_path, "1.5", renewer.path)
    try:
        p.wait(15)
        took = time.monotonic() - t0
        assert 1.5 <= took and took < 0.5 + lease.RENEW_S + 1.5 + lease.RENEW_S + 5  # stall, keepalive, looks, margin
        assert renewer.thread.is_alive()  # the thread went on: it was the loop's stall that stopped renewal
        assert "was not renewed for 1.5 s" in p.stderr.read()
        _wait(lambda: _gone(server) and _gone(child), 5, "the server and its child gone")
    finally:
        renewer.stop()
        _kill(p)


def test_renewal_follows_the_beats_and_a_declared_duration(tmp_path, capsys):
    path = str(tmp_path / "node0.lease")
    renewer = lease.Lease(path, stall_s=0.3)
    renewer.renew()
    lease.beat()
    os.utime(path, (0, 0))
    assert renewer.tick() and os.stat(path).st_mtime > 0
    time.sleep(0.4)
    os.utime(path, (0, 0))
    assert not renewer.tick() and os.stat(path).st_mtime == 0
    assert not renewer.tick()
    err = capsys.readouterr().err
    assert err.count("no progress for") == 1 and "rollout.server_stall_s=0.3" in err  # said once per stall
    lease.beat(expect_s=5.0)  # a phase that declares it may take 5 s more
    time.sleep(0.4)
    assert renewer.tick() and os.stat(path).st_mtime > 0
    assert lease.Lease(path).tick()  # no bound: renewed regardless


def test_the_stall_bound_is_validated_and_defaults_to_the_control_timeout():
    cfg = config.load_config(None, [])
    waits = cfg.buffer.get_timeout_s + cfg.rollout.pause_timeout_s + cfg.rollout.startup_timeout_s
    assert config.server_stall_s(cfg) == config.control_timeout_s(cfg) == waits + cfg.weight_sync.timeout_s + 600
    assert config.server_stall_s(config.load_config(None, ["rollout.server_stall_s=1900"])) == 1900
    with pytest.raises(ValueError, match=r"^rollout.server_stall_s must be 0 \(the control group's timeout, 3900 s\) "
                                         r"or at least the longest wait's own timeout \(buffer.get_timeout_s=1800\)"):
        config.load_config(None, ["rollout.server_stall_s=60"])
    for bad in (".nan", ".inf"):
        with pytest.raises(ValueError, match="server_stall_s"):
            config.load_config(None, [f"rollout.server_stall_s={bad}"])
        with pytest.raises(ValueError, match="server_keepalive_s"):
            config.load_config(None, [f"rollout.server_keepalive_s={bad}"])


# ---------------------------------------------------------------------------------------------------------------
# A clean close removes only its own lease

def test_a_clean_close_never_deletes_a_lease_that_is_not_its_own(tmp_path):
    svc = _svc(tmp_path)
    record_path, lease_path = lease.paths(str(tmp_path), 0)
    svc._spawn_servers(0, 0)
    lease.write_record(record_path, {"node": 0, "weight_group": None, "servers": {}})
    assert os.path.exists(lease_path)
    with open(lease_path, "w") as f:  # another run (or a later attempt) took the lease meanwhile
        json.dump({"pid": 99999999, "started": "1", "attempt": "0"}, f)
    svc.stop_children()
    assert os.path.exists(lease_path) and os.path.exists(record_path)
    svc2 = _svc(tmp_path)
    svc2._spawn_servers(0, 0)
    lease.write_record(record_path, {"node": 0, "weight_group": None, "servers": {}})
    assert svc2.lease.owned() and json.load(open(lease_path))["pid"] == os.getpid()
    svc2.stop_children()  # its own: removed
    assert not os.path.exists(lease_path) and not os.path.exists(record_path)
