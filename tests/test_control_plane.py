"""The control planes listen on loopback only: the RPC between trainer rank 0, the buffer and the rollout process
(remote.py: TensorPipe and its rendezvous TCPStore), checked from a network namespace the test makes.

Run as root (CI) or where unprivileged user namespaces are allowed; elsewhere the test reports itself skipped.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFF_LOOPBACK = "192.0.2.1"  # TEST-NET-1 (RFC 5737), given to an interface that exists only in the test's namespace
SKIP = 77  # the child's exit code when the namespace cannot be set up: the reason is its last line of output


def _namespace_command() -> list:
    """unshare -n -m (root) or -r -n -m (an unprivileged user namespace): a network namespace of its own, and a mount
    namespace where /etc/hosts can name the off-loopback address as the hostname's."""
    return ["unshare", "-n", "-m"] if os.geteuid() == 0 else ["unshare", "-r", "-n", "-m"]


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install -y {package})"
    probe = subprocess.run([*_namespace_command(), "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"`{' '.join(_namespace_command())}` is refused here: {probe.stderr.strip()}"
    return None


def _listening() -> list:
    """(address, port) of every listening TCP socket of this network namespace (/proc/net/tcp, tcp6)."""
    out = []
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(FileNotFoundError), open(path) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                addr, port = fields[1].split(":")
                raw = bytes.fromhex(addr)  # host byte order per 32-bit word
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if width == 8 else socket.AF_INET6
                out.append((socket.inet_ntop(family, raw), int(port, 16)))
    return out


def _set_up_namespace(hosts: str) -> None:
    """In the fresh namespaces: lo up, a second interface holding OFF_LOOPBACK (dummy, else a veth pair), and an
    /etc/hosts where the hostname resolves to it (as on a cluster node, where it resolves to the node's address)."""
    def ip(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)

    ip("link", "set", "lo", "up")
    made = ip("link", "add", "ctl0", "type", "dummy")
    if made.returncode != 0:  # no dummy driver in this kernel
        made = ip("link", "add", "ctl0", "type", "veth", "peer", "name", "ctl1")
        ip("link", "set", "ctl1", "up")
    for step in (made, ip("addr", "add", f"{OFF_LOOPBACK}/24", "dev", "ctl0"), ip("link", "set", "ctl0", "up")):
        if step.returncode != 0:
            print(f"cannot give the namespace a second interface: {' '.join(step.args)}: {step.stderr.strip()}")
            sys.exit(SKIP)
    with open(hosts, "w") as f:
        f.write(f"127.0.0.1 localhost\n::1 localhost\n{OFF_LOOPBACK} {socket.gethostname()}\n")
    bind = subprocess.run(["mount", "--bind", hosts, "/etc/hosts"], capture_output=True, text=True, timeout=30)
    if bind.returncode != 0:
        print(f"cannot give the namespace its own /etc/hosts: {bind.stderr.strip()}")
        sys.exit(SKIP)


class _Pong:
    def ping(self) -> str:
        return "pong"


def _serve(init: str) -> None:
    """The serving process, as workers.py's: one object served over RPC (remote.serve_object), rank 1 of 2."""
    import remote

    remote.serve_object("served", {"ping": remote.AT_ONCE}, lambda: contextlib.nullcontext(_Pong()), init, 1, 2, 30.0)


def _probe(hosts: str) -> None:
    """In the namespace: the project's RPC up between two processes (rank 0 holds the store, as the trainer does),
    a call through remote.Proxy, then a connect to OFF_LOOPBACK on every listening port; prints the findings."""
    _set_up_namespace(hosts)
    import remote
    from services import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    server = subprocess.Popen([sys.executable, __file__, "serve", init], cwd=ROOT)
    try:
        remote.init_rpc("trainer", 0, 2, init, 30.0, startup_timeout=30.0)
        answer = remote.Proxy("served", 30.0, {"ping": remote.AT_ONCE}).ping()
        found = {"answer": answer, "listening": _listening(), "hostname_resolves_to":
                 socket.gethostbyname(socket.gethostname()), "pids": [os.getpid(), server.pid], "reached": []}
        for addr, port in found["listening"]:
            with socket.socket() as s:
                s.settimeout(5)
                if s.connect_ex((OFF_LOOPBACK, port)) == 0:
                    found["reached"].append([addr, port])
        print("FOUND " + json.dumps(found), flush=True)
        import torch.distributed.rpc as rpc

        rpc.shutdown()
        server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()


def test_rpc_and_store_ports_are_not_reachable_off_loopback(tmp_path):
    """The RPC's listening ports (the rendezvous TCPStore of rank 0, each process's TensorPipe listener) refuse a
    connection to a non-loopback address of the machine: a network namespace with lo and a second interface holding
    192.0.2.1, the hostname resolving to it; two processes in it joined by remote.init_rpc / remote.serve_object
    with a remote.Proxy call answered; every listening TCP port of the namespace (/proc/net/tcp{,6}) is then dialled
    on 192.0.2.1 and must be refused. (torch's tcp:// rendezvous serves its store on every interface, and TensorPipe
    listens on the address the hostname resolves to: both reached before remote.py bound them to loopback.)"""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    proc = subprocess.run([*_namespace_command(), sys.executable, __file__, "probe", str(tmp_path / "hosts")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == SKIP:
        pytest.skip(lines[-1] if lines else "the namespace could not be set up")
    found = [json.loads(line[len("FOUND "):]) for line in lines if line.startswith("FOUND ")]
    assert proc.returncode == 0 and found, f"the probe failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    found = found[0]
    assert found["answer"] == "pong" and found["hostname_resolves_to"] == OFF_LOOPBACK, found
    # the store and one TensorPipe listener per process at least: the dialling below tried each of them
    assert len(found["listening"]) >= 3, f"expected the store and 2 TensorPipe listeners, found {found['listening']}"
    assert found["reached"] == [], (f"RPC ports reachable on {OFF_LOOPBACK}, a non-loopback address: "
                                    f"{found['reached']} (all listening: {found['listening']})")
    assert all(addr.startswith("127.") or addr == "::1" for addr, _ in found["listening"]), found["listening"]
    assert time.monotonic() - t0 < 60


def test_rpc_init_method_off_loopback_is_refused():
    """An RPC init method that is not tcp://<loopback address>:<port> is refused in one sentence naming it."""
    import remote

    for bad in ("tcp://0.0.0.0:29500", "tcp://192.0.2.1:29500", "tcp://localhost:29500", "env://", "tcp://127.0.0.1"):
        with pytest.raises(ValueError, match="loopback"):
            remote.loopback_init(bad)
    assert remote.loopback_init("tcp://127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert remote.loopback_init("tcp://[::1]:29500") == ("::1", 29500)


# ---- the launched servers' api key ----
def test_launched_servers_are_keyed_by_a_0600_file_that_no_command_line_record_config_or_log_shows(tmp_path):
    """Services launches the stand-in as train.py does (through lease.py, on loopback, no key configured): it gets
    the run's key, made in run_dir/servers/api_key.yaml with mode 0600 and passed as SGLang's --config file (0.5.23
    server_args.py prepare_server_args -> utils/server_args_config_parser.py ConfigArgumentMerger: the YAML becomes
    --api-key inside the server). Without the key the server answers 401 (not on /health); the run's clients
    (sglang_client.Fleet from the config, lease.takeover) send it. The key is in no process's command line (`ps`),
    and in no file of run_dir but its key file: not servers/node0.json, config.yaml or the logs."""
    import requests

    import config
    import lease
    import services
    import sglang_client
    from standins import tiny_model

    model = tiny_model.make_tiny_model(str(tmp_path / "model"))
    run_dir = tmp_path / "run"
    cfg = config.load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        f"run_dir={run_dir}", f"model.path={model}", f"rollout.base_port={services.free_port(span=1)}",
        "rollout.startup_timeout_s=120"])
    svc = services.Services(cfg)
    try:
        fleet = svc.start_fleet(0, launched=True)  # as train.py: launched, then rank 0's client, waited healthy
        assert len(fleet.server_infos()) == 1  # the client sends the key
        (url,) = cfg.rollout.servers
        assert requests.get(url + "/health", timeout=30).status_code == 200
        for path in ("/model_info", "/server_info"):
            assert requests.get(url + path, timeout=30).status_code == 401, path
        assert requests.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path)},
                             timeout=30).status_code == 401
        key_file = run_dir / "servers" / "api_key.yaml"
        assert cfg.rollout.sglang_args.api_key_file == str(key_file)
        assert os.stat(key_file).st_mode & 0o777 == 0o600
        key = sglang_client.read_key_file(str(key_file))
        assert len(key) >= 32
        assert "model_path" in lease.takeover(url, key, 30, 30)
        svc.write_config()
        ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True, timeout=30).stdout
        assert "--config" in ps and str(key_file) in ps  # the server's command line names the file ...
        assert key not in ps  # ... never the key
        shown = [str(p) for p in run_dir.rglob("*") if p.is_file() and p != key_file
                 and key in p.read_text(errors="replace")]
        assert shown == [], f"the servers' key is written in {shown}"
        assert {"config.yaml", "servers/node0.json", "logs/server_0.log"} <= {
            str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}
    finally:
        if svc.fleet is not None:
            svc.fleet.close()
        svc.stop_children()


def test_key_settings_are_refused_where_a_key_would_show():
    """A key in the config (rollout.sglang_args.api_key, or --api-key / --config in extra) is refused in one sentence
    naming rollout.sglang_args.api_key_file; a key file open to group or others is refused naming chmod 600."""
    import config

    with pytest.raises(ValueError, match="is now rollout.sglang_args.api_key_file"):
        config.load_config(None, ["rollout.sglang_args.api_key=SECRET"])
    for flag in ("--api-key", "--config", "--api-key=SECRET"):
        with pytest.raises(ValueError, match="api_key_file.*never on a command line"):
            config.load_config(None, [f'rollout.sglang_args.extra=["{flag}", "x"]'])


def test_a_key_file_open_to_others_or_of_another_form_is_refused(tmp_path):
    import sglang_client

    path = str(tmp_path / "api_key.yaml")
    assert sglang_client.make_key_file(path) == sglang_client.make_key_file(path)  # made once, then kept
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sglang_client.make_key_file(path, "other") == "other" == sglang_client.read_key_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="mode 0644, open to group or others; chmod 600"):
        sglang_client.read_key_file(path)
    os.chmod(path, 0o600)
    with open(path, "w") as f:
        f.write("api_key: x\n")
    with pytest.raises(ValueError, match="one line `api-key: KEY`"):
        sglang_client.read_key_file(path)
    txt = str(tmp_path / "key.txt")
    with open(os.open(txt, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("api-key: x\n")
    with pytest.raises(ValueError, match="must end in .yaml or .yml"):
        sglang_client.read_key_file(txt)


if __name__ == "__main__":  # the namespace's processes (the test above starts them)
    sys.path.insert(0, ROOT)
    if sys.argv[1] == "probe":
        _probe(sys.argv[2])
    else:
        _serve(sys.argv[2])
