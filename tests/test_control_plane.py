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

    remote.serve_object("served", {"ping": None}, lambda: contextlib.nullcontext(_Pong()), init, 1, 2, 30.0)


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
        answer = remote.Proxy("served", 30.0, {"ping": None}).ping()
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


if __name__ == "__main__":  # the namespace's processes (the test above starts them)
    sys.path.insert(0, ROOT)
    if sys.argv[1] == "probe":
        _probe(sys.argv[2])
    else:
        _serve(sys.argv[2])
