"""services.py: servers placed per node (rollout.server_layout), launched by each node's local rank 0, their URLs
published through the torchrun store; GPU overlap with the trainer refused; the weight-update group's size.

The two-node run starts two torchrun agents on this machine (`--nnodes 2 --nproc_per_node 1`, c10d rendezvous on
127.0.0.1), one standins/engine.py per node, and trains the tiny config end to end.
Run: .venv/bin/python -m pytest -q tests/test_services.py
"""
import ast
import os
import random
import re
import socket
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import config  # noqa: E402
import services  # noqa: E402

PY = sys.executable
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def _ports(n: int) -> int:
    """The first of n consecutive free ports in 20000-30000 (below the ephemeral range: a stray connection to a
    port the kernel hands out to another process's TensorPipe listener would abort it)."""
    for _ in range(200):
        first = random.randrange(20000, 30000 - n)
        try:
            for p in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
    raise RuntimeError("no free ports in 20000-30000")


def _cfg(*overrides):
    return config.load_config(None, list(overrides))


def test_gpu_overlap_with_the_trainer_is_refused_in_one_sentence():
    base = ["colocate=false", "rollout.launch=sglang", "trainer.num_nodes=2", "trainer.num_gpus_per_node=4",
            "rollout.server_layout=[{gpus: [4, 5], tp: 2}, {node: 1, gpus: [2, 3, 4, 5], tp: 4}]"]
    cfg = _cfg(*base)
    services.check_gpu_overlap(cfg, 0, True, None)  # node 0: trainer on 0-3, server on 4-5
    with pytest.raises(ValueError, match=r"^rollout.server_layout\[1\] uses GPU 2, 3 of node 1, which the node's "
                                         r"4 trainer ranks use \(CUDA_VISIBLE_DEVICES=unset, GPUs 0-3\);"):
        services.check_gpu_overlap(cfg, 1, True, None)
    # the trainer's GPUs are the first num_gpus_per_node of CUDA_VISIBLE_DEVICES (physical ids)
    services.check_gpu_overlap(cfg, 1, True, "6,7,0,1")
    with pytest.raises(ValueError, match=r"uses GPU 4, 5 of node 0.*CUDA_VISIBLE_DEVICES=4,5,6,7\)"):
        services.check_gpu_overlap(cfg, 0, True, "4,5,6,7")
    services.check_gpu_overlap(_cfg(*base, "colocate=true"), 1, True, None)  # colocate shares them on purpose
    services.check_gpu_overlap(cfg, 1, False, None)  # a CPU trainer uses no GPU


def test_master_address_and_server_urls_come_from_the_rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    one_node = _cfg()
    assert services.master_address(one_node, launched=True) == "127.0.0.1"
    two = _cfg("trainer.num_nodes=2", "rollout.server_layout=[{node: 0}, {node: 1}]")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.2")  # the rendezvous host, as torchrun sets it on every node
    assert services.master_address(two, launched=True) == "127.0.0.2"
    assert services.master_address(_cfg("weight_sync.master_address=10.0.0.9"), launched=True) == "10.0.0.9"
    connect = _cfg("rollout.servers=[http://127.0.0.3:31000]")
    assert services.master_address(connect, launched=False) == "127.0.0.1"  # the route to that server
    assert services.server_address("0.0.0.0", 0) == "127.0.0.1"
    assert services.server_address("0.0.0.0", 1) == services.node_address() == "127.0.0.1"


def test_two_torchrun_nodes_each_launch_their_engine_and_both_end_at_the_final_version(tmp_path):
    from standins import tiny_model

    model = tiny_model.make_tiny_model(str(tmp_path / "model"))
    run_dir, base_port, rdzv = tmp_path / "run", _ports(2), _ports(1)
    steps = 3
    overrides = [f"run_dir={run_dir}", f"model.path={model}", f"rollout.base_port={base_port}",
                 f"weight_sync.master_port={_ports(1)}", "data_source.num_prompts=32",
                 "data_source.num_prompts_per_step=4", "data_source.num_trajectories_per_prompt=4",
                 "trainer.mini_batch_size=8", f"trainer.total_steps={steps}", "trainer.eval_freq=0",
                 "trainer.save_freq=0", "trainer.export_hf=false", "rollout.filter=[failed]",
                 "buffer.get_timeout_s=120", "rollout.startup_timeout_s=120",
                 "trainer.num_nodes=2", "trainer.num_gpus_per_node=1",
                 "rollout.server_layout=[{node: 0}, {node: 1}]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen([PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                                "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint",
                                f"127.0.0.1:{rdzv}", "--local-addr", "127.0.0.1", "train.py", "--config", TINY,
                                *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True) for node in (0, 1)]
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=300)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
    assert [a.returncode for a in agents] == [0, 0], "\n=====\n".join(o[-4000:] for o in outs)
    line = next(m for o in outs for m in re.findall(r"weight versions on the servers at the end: (\{.*\})", o))
    urls = [f"http://127.0.0.1:{base_port}", f"http://127.0.0.1:{base_port + 1}"]
    assert ast.literal_eval(line) == {u: steps for u in urls}  # /model_info's live versions
    # each agent's rank launched its own node's engine: server_0 by rank 0's, server_1 by the other one's
    rank0 = [i for i, o in enumerate(outs) if "weight versions on the servers" in o]
    assert len(rank0) == 1
    assert f"[train] node 0 launched server_0 on {urls[0]}" in outs[rank0[0]]
    assert f"[train] node 1 launched server_1 on {urls[1]}" in outs[1 - rank0[0]]
    logs = sorted(os.listdir(run_dir / "logs"))
    assert {"server_0.log", "server_1.log", "buffer.log", "rollout.log"} <= set(logs)
    for port in (base_port, base_port + 1):  # every server was stopped with the run
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_rank_0_reports_what_another_node_published_or_that_nothing_came(tmp_path, monkeypatch):
    """launch_fleet reads the other nodes' URLs from the torchrun store: a node's launch error is raised as its
    own message; a node that publishes nothing is a timeout naming the server, its node and where its log is."""
    import torch.distributed as dist

    store = dist.HashStore()
    monkeypatch.setattr(services, "_store", lambda: store)
    cfg = _cfg(f"run_dir={tmp_path}", "trainer.num_nodes=3", "rollout.startup_timeout_s=0.5",
               "rollout.server_layout=[{node: 1}, {node: 2}]")
    svc = services.Services(cfg)
    store.set(f"{services.URL_KEY}0", "http://10.0.0.1:31000")
    with pytest.raises(TimeoutError, match=r"server_1 of rollout.server_layout \(node 2\) was not up within "
                                           r"rollout.startup_timeout_s=0.5 s .*server_1.log on that node"):
        svc.launch_fleet(0)
    store.set(f"{services.URL_KEY}1", "error: node 2, server_1: port 31001 (rollout.base_port + 1) is already in use")
    with pytest.raises(RuntimeError, match=r"^node 2, server_1: port 31001 \(rollout.base_port \+ 1\) is already"):
        svc.launch_fleet(0)
    store.set(f"{services.URL_KEY}1", "http://10.0.0.2:31001")
    assert svc.launch_fleet(0) == ["http://10.0.0.1:31000", "http://10.0.0.2:31001"]


def test_sglang_command_per_server_has_its_layout_gpus_and_the_extra_flags(tmp_path, monkeypatch):
    cfg = _cfg(f"run_dir={tmp_path}", "colocate=false", "rollout.launch=sglang", "rollout.base_port=25000",
               "trainer.num_nodes=2", "weight_sync.method=disk",  # dp / pp > 1: disk only (config.validate)
               "rollout.server_layout=[{gpus: [4, 5, 6, 7], tp: 2, dp: 2}, {node: 1, gpus: [0, 1], pp: 2}]",
               'rollout.sglang_args.extra=["--ep-size", "2", "--context-length", 32768]')
    svc = services.Services(cfg)
    spawned = []
    monkeypatch.setattr(svc, "spawn", lambda name, cmd, env: spawned.append((name, cmd, env)) or
                        types.SimpleNamespace(pid=1))
    monkeypatch.setattr(svc, "wait_healthy", lambda urls: None)
    monkeypatch.setattr(svc, "procs", {"server_0": (types.SimpleNamespace(pid=1), "")})
    assert svc.launch_servers(7, node=0) == {0: "http://127.0.0.1:25000"}  # node 1's server is not ours
    (name, cmd, env), = spawned
    assert name == "server_0" and env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    flags = " ".join(cmd[cmd.index("--port"):])
    assert flags == ("--port 25000 --host 127.0.0.1 --tp-size 2 --dp-size 2 --pp-size 1 --weight-version 7 "
                     f"--dtype bfloat16 --config {tmp_path}/servers/api_key.yaml --ep-size 2 --context-length 32768")


def test_free_ports_are_drawn_below_the_ephemeral_range_and_the_fixed_defaults():
    """services.free_port: a port the kernel could hand to an outgoing connection meanwhile (its ephemeral range,
    bind(0)'s answer) was taken between the check and a server's bind under load (EADDRINUSE on
    weight_sync.master_port); the defaults rollout.base_port and weight_sync.master_port are not drawn either."""
    cfg = config.Config()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    ports = [services.free_port(span=3) for _ in range(200)]
    assert all(10000 <= p and p + 2 < min(ephemeral, cfg.weight_sync.master_port, cfg.rollout.base_port)
               for p in ports), (min(ports), max(ports))
    assert len(set(ports)) > 150  # drawn at random: two runs started together do not race for one port
    draws = []
    for _ in range(2):  # ... also when both seeded `random` alike (train.py seeds it with the config's seed)
        random.seed(0)
        draws.append([services.free_port() for _ in range(3)])
    assert draws[0] != draws[1], draws
    for p in ports[:20]:
        for q in (p, p + 1, p + 2):  # free, all three
            with socket.socket() as s:
                s.bind(("127.0.0.1", q))


def test_a_remote_error_ends_the_run_with_one_error_line_naming_the_call_and_its_cause(capsys, monkeypatch):
    """Rank 0's error line for a call the rollout (or buffer) process failed: the call, the process and the cause
    on the line (here the pause's own: the server, the endpoint, the setting), that process's traceback above it."""
    import remote

    def failed_there(*args, **kwargs):  # the text torch RPC raises for an error in the served process
        raise RuntimeError(
            "FleetError: On WorkerInfo(id=2, name=rollout):\nFleetError('POST http://127.0.0.1:31000/pause_generation"
            " did not answer within 599.8 s (the rest of rollout.pause_timeout_s=600 s)')\nTraceback (most recent "
            "call last):\n  File \"rollout.py\", line 1, in pause\nsglang_client.FleetError: POST ...")

    monkeypatch.setattr(remote.rpc, "rpc_sync", failed_there)
    printed = []
    svc = types.SimpleNamespace(root_cause=lambda wait_s: None, print_error_once=printed.append)
    try:
        remote.Proxy("rollout", 600, remote.ROLLOUT_METHODS, where="the rollout process (pid 7)").pause()
    except remote.RemoteError as e:
        assert services.failure_exit_code(e, svc, 0) == 1
    assert printed == ["rollout.pause() in the rollout process (pid 7) failed: FleetError: POST "
                       "http://127.0.0.1:31000/pause_generation did not answer within 599.8 s (the rest of "
                       "rollout.pause_timeout_s=600 s)"]
    assert "Traceback (most recent call last):\n  File \"rollout.py\"" in capsys.readouterr().err
