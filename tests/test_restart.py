"""Unattended restarts (docs/faults.md, "Restarts"): each torchrun attempt's own keys in torchrun's store, launched
servers that outlive a crashed attempt under a lease (lease.py) and are reused by the next one, and a run that
torchrun --max-restarts finishes through a kill -9 of trainer rank 0 with every prompt trained once.

Run: .venv/bin/python -m pytest -q tests/test_restart.py
"""
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import config  # noqa: E402
import lease  # noqa: E402
import services  # noqa: E402
from test_resume_in_flight import _rank0  # noqa: E402
from test_train import _pids, _read_rows, tiny_model  # noqa: E402,F401 (tiny_model: a fixture)

PY = sys.executable
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def _wait(pred, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(poll)


def _gone(pid: int) -> bool:
    return lease.start_time(pid) is None


def _kill_all(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)


def test_every_torchrun_attempt_agrees_on_a_key_prefix_of_its_own():
    """services.agree_prefix: torchrun hands every attempt the same store, whose keys of the attempt before are
    still there (a stale hello, a stale welcome): each attempt's ranks end on one new prefix, whichever rank
    comes first. ~0.2 s."""
    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(__import__("datetime").timedelta(seconds=10))
    store.set(f"{services.ATTEMPT_KEY}hello/1", "old")  # what a killed attempt left
    store.set(f"{services.ATTEMPT_KEY}welcome/old", "asyncrl/stale/")
    seen = set()
    for first in (1, 0, 1):
        out = {}

        def rank(r):
            out[r] = services.agree_prefix(store, r, 3, 10.0)
        hello = f"{services.ATTEMPT_KEY}hello/1"
        before = store.get(hello)
        welcome = f"{services.ATTEMPT_KEY}welcome/{before.decode()}"
        stale = store.get(welcome) if store.check([welcome]) else None
        threads = [threading.Thread(target=rank, args=(r,)) for r in (first, *(r for r in (0, 1, 2) if r != first))]
        threads[0].start()  # `first` acts on the store before the others start: rank 1 says hello, rank 0 answers
        _wait(lambda: store.get(hello) != before if first == 1 else store.get(welcome) != stale, 10,  # the old one
              f"rank {first} acting first")
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(15)
        assert len(out) == 3 and len(set(out.values())) == 1, out
        assert out[0] not in seen | {"asyncrl/stale/"}
        seen.add(out[0])


def test_a_server_whose_lease_lapses_stops_by_itself_with_its_session(tmp_path):
    """lease.py: while the lease is renewed the server runs past --keepalive-s; once it is not, the watchdog (the
    server's parent, the pid services.py supervises) stops the server and what it started in its session, and exits
    as the server did. ~6 s."""
    path = str(tmp_path / "node0.lease")
    renewer = lease.Lease(path)
    renewer.start()
    # the "server": a shell that starts a child of its own in its session, as SGLang starts its schedulers
    p = subprocess.Popen([PY, os.path.join(ROOT, "lease.py"), "--lease", path, "--keepalive-s", "1.5", "--", "sh",
                          "-c", "echo $$ > server; sleep 120 & echo $! > child; wait"], cwd=tmp_path,
                         start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: all((tmp_path / f).exists() and (tmp_path / f).read_text().strip() for f in ("server", "child")),
              10, "the server and its child")
        server, child = int((tmp_path / "server").read_text()), int((tmp_path / "child").read_text())
        time.sleep(3.0)  # twice the keepalive: renewed, so still up
        assert p.poll() is None and not _gone(server) and not _gone(child)
        renewer.stop()
        t0 = time.monotonic()
        p.wait(15)
        assert time.monotonic() - t0 < 1.5 + lease.RENEW_S + 7.5  # the keepalive, a look, margin for a loaded CI
        _wait(lambda: _gone(server) and _gone(child), 5, "the server and its child gone")
        assert p.returncode == -signal.SIGTERM
        assert "was not renewed for 1.5 s (rollout.server_keepalive_s)" in p.stderr.read()
    finally:
        _kill_all([p.pid])


BASE = services.free_port(span=3)


def _cfg(tmp_path, *overrides):
    return config.load_config(None, [f"run_dir={tmp_path}", "colocate=false", f"rollout.base_port={BASE}",
                                     "rollout.server_layout=[{node: 0}, {node: 0}, {node: 0}]", *overrides])


@pytest.mark.parametrize("reuse", [True, False])
def test_recorded_servers_are_kept_only_alive_with_this_runs_arguments(tmp_path, reuse, capsys):
    """Services._spawn_servers with a record of three servers an earlier attempt launched: server_0 still runs
    with this run's arguments (kept: no new process, its pid and weight version taken over), server_1 runs with
    other arguments (stopped, launched anew), server_2's process is gone (launched anew), server_3 is not in this
    run's layout (stopped: our lease would keep it alive); rollout.reuse_servers=false stops and relaunches every
    one. Sleeping processes under lease.py stand for the servers. ~2 s."""
    cfg = _cfg(tmp_path, f"rollout.reuse_servers={str(reuse).lower()}")
    svc = services.Services(cfg)
    record_path, lease_path = lease.paths(str(tmp_path), 0)
    lease.Lease(lease_path).renew()
    fake = tmp_path / "fake" / "sglang"  # `python -m sglang.launch_server` that sleeps: a server's command line
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text("import time\ntime.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    procs = [subprocess.Popen([PY, os.path.join(ROOT, "lease.py"), "--lease", lease_path, "--keepalive-s", "60",
                               "--", PY, "-m", "sglang.launch_server"], env=env, start_new_session=True)
             for _ in range(4)]
    try:
        procs[2].kill()
        procs[2].wait()
        layout = cfg.rollout.server_layout[0]
        cmds = [services._launch_args(svc._server_command(layout, BASE + i, 7)[0]) for i in range(4)]
        cmds[1][cmds[1].index("--port") + 1] = "25999"  # launched with another port
        lease.write_record(record_path, {"node": 0, "weight_group": "weight_update_group", "servers": {
            f"server_{i}": {"pid": p.pid, "started": lease.start_time(p.pid) or "0", "cmd": cmds[i], "gpus": None,
                            "weight_version": 12} for i, p in enumerate(procs)}})
        spawned = []
        svc.spawn = lambda name, cmd, env: spawned.append(name)
        urls = svc._spawn_servers(5, 0)
        assert urls == {i: f"http://127.0.0.1:{BASE + i}" for i in range(3)}
        assert svc.stale_group == "weight_update_group"
        out = capsys.readouterr().out
        if reuse:
            assert spawned == ["server_1", "server_2"] and svc.adopted == {"server_0"}
            assert svc.procs["server_0"][0].pid == procs[0].pid
            kept = lease.read_record(record_path)["servers"]["server_0"]
            assert (kept["pid"], kept["weight_version"]) == (procs[0].pid, 12)
            assert (f"stopping server_1 (pid {procs[1].pid}), which an earlier attempt launched: this run launches "
                    "it with other arguments") in out
            assert procs[0].poll() is None
        else:
            assert spawned == ["server_0", "server_1"] + ["server_2"] and not svc.adopted
            assert "rollout.reuse_servers is false" in out
            assert procs[0].wait(15) is not None
        assert procs[1].wait(15) is not None  # stopped, not left beside the new one
        assert procs[3].wait(15) is not None and (f"stopping server_3 (pid {procs[3].pid}), which an earlier attempt "
                                                  "launched: this run's rollout.server_layout has no server_3") in out
        assert "server_2" not in out  # a dead one is simply launched
    finally:
        svc.lease.stop()
        _kill_all([p.pid for p in procs])


def test_takeover_brings_a_paused_engine_in_a_weight_update_to_a_known_state(tiny_model):
    """lease.takeover on what a trainer killed at a step boundary leaves: the engine paused in place with a request
    in it, requests parked at its pause gate (sent after the pause) and a weight-update session open, the clients
    of all of them gone with the trainer (its /health would wait for a token: SGLang 0.5.23 http_server.py
    health_generate). No pause aborts the parked ones (tokenizer_manager.py generate_request waits at the gate
    before dispatch; pause_generation mode abort aborts what the scheduler holds): after a continue they would run
    until the server noticed their client gone (_wait_one_response; here SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s,
    with SGLANG_FORCE_STREAM_INTERVAL raised past their length), beside the new run's first sync. After the takeover
    nothing runs or waits, then or in the next 2 s, no session is open, the server is not paused (/health 200), its
    cache flushes, and /model_info reported the version it held. ~10 s."""
    import concurrent.futures as cf

    from standins import engine

    url, handle = engine.launch(tiny_model, weight_version="9", num_threads=1,
                                env={"SGLANG_FORCE_STREAM_INTERVAL": "100000"})

    def load():
        ld = requests.get(url + "/v1/loads", timeout=5).json()["loads"][0]
        return ld["num_running_reqs"], ld["num_waiting_reqs"]

    def given_up(body, after_s):  # a request of the trainer, whose connection closes after_s later (it died)
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(url + "/generate", json=body, timeout=(5, after_s))
    try:
        with cf.ThreadPoolExecutor(3) as ex:
            kept = ex.submit(given_up, {"input_ids": [1, 2, 3], "sampling_params": {
                "max_new_tokens": 4000, "ignore_eos": True}}, 3.0)
            _wait(lambda: load() == (1, 0), 30, "the request running")
            assert requests.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=30).status_code == 200
            assert requests.post(url + "/begin_weight_update", json={}, timeout=30).status_code == 200
            parked = [ex.submit(given_up, {"input_ids": [[4, 5], [6, 7 + i]], "sampling_params": {
                "max_new_tokens": 3000, "ignore_eos": True}}, 0.5) for i in range(2)]
            for f in [kept, *parked]:
                f.result(30)
        info = lease.takeover(url, None, 30.0, 30.0)
        assert info["weight_version"] == "9"
        until = time.monotonic() + 2.0
        while time.monotonic() < until:
            assert load() == (0, 0)
            time.sleep(0.05)
        assert requests.get(url + "/health", timeout=30).status_code == 200
        assert requests.post(url + "/flush_cache", json={}, timeout=30).status_code == 200
        assert requests.post(url + "/begin_weight_update", json={}, timeout=30).status_code == 200  # none was open
    finally:
        handle.stop()


# ---------------------------------------------------------------------------------------------------------------
# End to end: torchrun --max-restarts through a kill -9 of trainer rank 0 at a random step

def test_torchrun_restarts_after_kill_9_of_rank_0_reusing_the_server_and_trains_every_prompt_once(tmp_path,
                                                                                                   tiny_model):
    """`torchrun --max-restarts 1 ... trainer.resume=auto`, trainer rank 0 killed with kill -9 at a random step
    after the first checkpoint: torchrun restarts both ranks, the new rank 0 reuses the server (same pid), which
    held the killed attempt's weight version and is set back to the checkpoint's, steps after the checkpoint are
    trained again and replace their first rows, every prompt of the epoch is trained exactly once, and the end of
    the run stops the server and removes its record. ~60-90 s."""
    seed = random.randrange(10 ** 6)
    rng = random.Random(seed)
    steps, save = 10, 3
    kill_at = rng.randint(save + 1, steps - 2)
    run_dir = str(tmp_path / "run")
    args = [PY, "-m", "torch.distributed.run", "--max-restarts", "1", "--standalone", "--nproc_per_node", "2",
            "train.py", "--config", TINY, f"run_dir={run_dir}", f"model.path={tiny_model}",
            f"rollout.base_port={services.free_port()}", f"weight_sync.master_port={services.free_port()}",
            f"data_source.num_prompts={4 * steps}", "data_source.num_prompts_per_step=4",
            "data_source.num_trajectories_per_prompt=4", "trainer.mini_batch_size=8", f"trainer.total_steps={steps}",
            f"trainer.save_freq={save}", "trainer.eval_freq=0", "trainer.export_hf=false", "rollout.filter=[failed]",
            "buffer.get_timeout_s=120", "rollout.startup_timeout_s=120", "trainer.resume=auto"]
    p = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    lines, server = [], None
    try:
        for line in p.stdout:
            lines.append(line)
            if re.match(rf"step {kill_at}/", line):
                os.kill(_rank0(run_dir), signal.SIGKILL)
                break
        lines += p.stdout.readlines()
        p.wait(60)
        out = "".join(lines)
        assert p.returncode == 0, (seed, kill_at, out[-5000:])
        launched = re.findall(r"node 0 launched server_0 on \S+ \(pid (\d+)\)", out)
        reused = re.findall(r"node 0 reused server_0 on \S+ \(pid (\d+), an earlier attempt's: it held weight "
                            r"version (\d+)", out)
        assert len(launched) == 1 and len(reused) == 1, (seed, out[-5000:])
        server = int(launched[0])
        ckpt = kill_at // save * save
        assert int(reused[0][0]) == server and int(reused[0][1]) >= kill_at, (seed, kill_at, reused)
        assert f"resumed from {run_dir}/checkpoints/step_{ckpt:06d} at step {ckpt}" in out, (seed, out[-3000:])
        assert f"weights version {ckpt} on the servers" in out
        rows = _read_rows(run_dir)
        assert [r["step"] for r in rows if r["step"] > 0] == list(range(1, steps + 1)), seed
        trained = sorted(tuple(i) for r in rows for i in r.get("data/prompt_ids", []))
        assert trained == [(0, i) for i in range(4 * steps)], (seed, kill_at, trained)
        _wait(lambda: _gone(server), 20, "the server stopped at the end of the run")
        assert not os.path.exists(os.path.join(run_dir, "servers", "node0.json"))
        assert not _pids(run_dir), "a process of the run is left"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        _kill_all(_pids(f"run_dir={run_dir}") + _pids(f"{run_dir}/") + ([server] if server else []))
