"""bench/faults.py: the tiny config once per fault; does the run survive or stop with its root cause, and is every
prompt of the epoch trained exactly once after a resume?

Each case starts `torchrun --nproc_per_node 2 train.py --config configs/tiny.yaml` shrunk to one epoch of
B x total_steps prompts (B=4, N=4, M=8: 2 training calls a step, a checkpoint every 5 steps), injects one fault,
and then, if the run stopped, resumes it with trainer.resume=auto. Faults:
- kill -9 of each process at a random step: the launched engine (server_0), the buffer, the rollout process,
  trainer rank 1, trainer rank 0;
- the engine stalled with SIGSTOP for --stall-s seconds, then SIGCONT;
- bad files: a JSONL dataset with a row cut short, a dataset path that does not exist, the newest checkpoint's
  run_state.pt truncated (after a kill -9 of the whole run);
- an oversized request to the running engine (a 40 MiB body, and a 10 MB `text`);
- unattended (`torchrun --max-restarts 1 ... trainer.resume=auto`): kill -9 of trainer rank 0, rank 1, the buffer or
  the rollout process at a random step, which torchrun's restart must finish with nothing lost or repeated.

--timing REPS measures instead the time from a kill -9 of trainer rank 0 (under --max-restarts 1) to the first
resumed step, with and without rollout.reuse_servers, REPS runs each, alternating, with where that time goes; and
the stand-in server's start-up alone (what reuse saves: minutes for SGLang at scale).

Printed table, one row per fault: outcome (survived: exit 0 without a restart; stopped: exit code), seconds to react
(stopped: from the fault to the run's exit; survived: to the first step finished after it), the first line of the
run's message (its `error:` line, else its first warning), whether a resume finished the run, and the prompts lost /
duplicated over the epoch (metrics.jsonl `data/prompt_ids` of the finished run against the epoch's prompts).

Run:
    python bench/faults.py [--steps 20] [--seed N] [--only server_0,buffer] [--stall-s 10]
    python bench/faults.py --only restart_rank0,restart_rank1,restart_buffer,restart_rollout
    python bench/faults.py --timing 3
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import sglang_client  # noqa: E402
from services import free_port  # noqa: E402  (below the kernel's ephemeral ports, as train.py's own)

B, N, M = 4, 4, 8


class Run:
    """One torchrun of train.py; stdout and stderr lines are kept with the time they arrived."""

    def __init__(self, run_dir: str, model: str, steps: int, *extra: str, restarts: int = 0):
        self.run_dir = run_dir
        self.port = free_port()
        args = [f"run_dir={run_dir}", f"model.path={model}", f"rollout.base_port={self.port}",
                f"weight_sync.master_port={free_port()}", f"data_source.num_prompts={B * steps}",
                "data_source.num_eval_prompts=8", f"data_source.num_prompts_per_step={B}",
                f"data_source.num_trajectories_per_prompt={N}", f"trainer.mini_batch_size={M}",
                f"trainer.total_steps={steps}", "trainer.save_freq=5", "trainer.eval_freq=0",
                "trainer.export_hf=false", "rollout.startup_timeout_s=120", "buffer.get_timeout_s=300",
                "rollout.filter=[failed]",  # every group trained, so lost / duplicated count against the epoch
                *extra]
        self.t0 = time.monotonic()
        self.lines: list = []  # (seconds since start, "out" | "err", line)
        self.p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--max-restarts", str(restarts),
                                   "--standalone", "--nproc_per_node", "2", "train.py", "--config",
                                   os.path.join(ROOT, "configs", "tiny.yaml"), *args],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        self.readers = [threading.Thread(target=self._read, args=(s, name), daemon=True)
                        for s, name in ((self.p.stdout, "out"), (self.p.stderr, "err"))]
        for t in self.readers:
            t.start()

    def _read(self, stream, name: str) -> None:
        for line in stream:
            self.lines.append((time.monotonic() - self.t0, name, line.rstrip("\n")))

    def steps(self) -> list:
        """(time, step) of each step line printed so far."""
        return [(t, int(line.split()[1].split("/")[0])) for t, s, line in list(self.lines)
                if s == "out" and line.startswith("step ")]

    def wait_step(self, step: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(s >= step for _, s in self.steps()):
            if self.p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"run {self.run_dir} ended or stalled before step {step}:\n" + self.tail())
            time.sleep(0.05)

    def wait(self, timeout: float = 600.0) -> int:
        rc = self.p.wait(timeout)
        self.t_exit = self.now()
        for t in self.readers:
            t.join(10)
        return rc

    def now(self) -> float:
        return time.monotonic() - self.t0

    def message(self, since: float = 0.0) -> str:
        """The first `error:` line on stderr after `since`, else the first warning, else torchrun's root cause."""
        err = [line for t, s, line in list(self.lines) if s == "err" and t >= since]
        for pick in (lambda ln: ln.startswith("error: "), lambda ln: "warning:" in ln):
            hit = next((ln for ln in err if pick(ln)), None)
            if hit is not None:
                return hit
        at = next((i for i, ln in enumerate(err) if ln.startswith("Root Cause")), None)
        if at is None:
            return "-"
        fields = dict(ln.split(":", 1) for ln in err[at + 1:at + 9] if ":" in ln)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        return f"torchrun's root cause: rank {fields.get('rank', '?')}, exitcode {fields.get('exitcode', '?')}"

    def tail(self, n: int = 30) -> str:
        return "\n".join(line for _, _, line in self.lines[-n:])

    def processes(self) -> dict:
        """pid -> (command line, environment) of every descendant of this run's torchrun."""
        info, parent = {}, {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
                info[int(pid)] = (cmd, env)
            except (OSError, IndexError, ValueError):
                continue

        def ours(pid):
            while pid > 1:
                if pid == self.p.pid:
                    return True
                pid = parent.get(pid, 0)
            return False
        return {pid: v for pid, v in info.items() if pid != self.p.pid and ours(pid)}

    def first(self, pattern: str, since: float = 0.0) -> Optional[tuple]:
        """(time, line) of the first stdout line after `since` that matches the regular expression."""
        return next(((t, line) for t, s, line in list(self.lines) if s == "out" and t >= since
                     and re.search(pattern, line)), None)

    def pid_of(self, fragment: str) -> int:
        """The process of this run whose command line has `fragment`."""
        pids = [pid for pid, (cmd, _) in self.processes().items() if fragment in cmd]
        if not pids:
            raise RuntimeError(f"no process of {self.run_dir} matches {fragment!r}")
        return min(pids)

    def trainer_pid(self, rank: int) -> int:
        pids = [pid for pid, (_, env) in self.processes().items()
                if env.get(b"RANK") == str(rank).encode() and b"LOCAL_RANK" in env]
        if not pids:
            raise RuntimeError(f"trainer rank {rank} of {self.run_dir} not found")
        return min(pids)


def epoch_check(run_dir: str, steps: int) -> str:
    """'lost / duplicated' over the epoch, from metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    trained = collections.Counter(tuple(p) for r in rows for p in r.get("data/prompt_ids", []))
    expected = {(0, i) for i in range(B * steps)}
    return f"{len(expected - set(trained))} / {sum(c - 1 for c in trained.values() if c > 1)}"


def case_kill(args, model: str, work: str, target: str, rng: random.Random) -> dict:
    run_dir = os.path.join(work, target)
    run = Run(run_dir, model, args.steps)
    at = rng.randint(2, args.steps - 6)
    run.wait_step(at)
    t_kill = run.now()
    os.kill(kill_target(run, target), signal.SIGKILL)
    return finish(args, model, run, t_kill, f"kill -9 {target} at step {at}")


def finish(args, model: str, run: Run, t_fault: float, fault: str, resume_extra: tuple = ()) -> dict:
    rc = run.wait()
    after = [t for t, s in run.steps() if t > t_fault]
    row = {"fault": fault, "outcome": "survived" if rc == 0 else f"stopped (exit {rc})",
           "react_s": (after[0] if rc == 0 and after else run.t_exit) - t_fault,
           "message": run.message(t_fault)}
    if rc == 0:
        row["resumed"] = "not needed"
    else:
        resumed = Run(run.run_dir, model, args.steps, "trainer.resume=auto", *resume_extra)
        ok = resumed.wait() == 0
        row["resumed"] = "yes" if ok else "FAILED: " + resumed.message()
        if not ok:
            print(f"  the resume of {run.run_dir} failed; its last lines:\n{resumed.tail()}", flush=True)
    row["lost_dup"] = epoch_check(run.run_dir, args.steps) if rc == 0 or row["resumed"] == "yes" else "-"
    return row


def case_stall(args, model: str, work: str, rng: random.Random) -> dict:
    run = Run(os.path.join(work, "stall"), model, args.steps)
    at = rng.randint(2, args.steps - 6)
    run.wait_step(at)
    pid = run.pid_of(f"--port {run.port}")
    t_fault = run.now()
    os.kill(pid, signal.SIGSTOP)
    time.sleep(args.stall_s)
    os.kill(pid, signal.SIGCONT)
    row = finish(args, model, run, t_fault, f"engine SIGSTOP {args.stall_s:g} s at step {at}")
    with open(os.path.join(run.run_dir, "logs", "rollout.log")) as f:
        warnings = [line for line in f if " WARNING " in line]
    row["message"] = ("no message" if row["message"] == "-" else row["message"]) + \
        f"; rollout.log: {len(warnings)} warnings"
    return row


def case_bad_file(args, model: str, work: str, kind: str) -> dict:
    run_dir = os.path.join(work, kind)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "data.jsonl")
    if kind == "bad_jsonl":
        row = '{"prompt": "What is 1+1?", "answer": "2"}'
        with open(path, "w") as f:
            f.write("\n".join([row] * 20 + [row[:-1]] + [row] * 20) + "\n")
    t0 = time.monotonic()
    run = Run(run_dir, model, args.steps, "data_source.task=jsonl", f"data_source.path={path}")
    rc = run.wait()
    servers = os.path.exists(os.path.join(run_dir, "logs"))
    fault = "JSONL row 21 cut short" if kind == "bad_jsonl" else "dataset path missing"
    return {"fault": fault, "outcome": f"stopped (exit {rc})" + (", servers had started" if servers else
                                                                  ", before any server"),
            "react_s": time.monotonic() - t0, "message": run.message(), "resumed": "n/a", "lost_dup": "n/a"}


def case_truncated_checkpoint(args, model: str, work: str, rng: random.Random) -> dict:
    run = Run(os.path.join(work, "truncated_ckpt"), model, args.steps)
    run.wait_step(rng.randint(11, args.steps - 2))
    for pid in [run.p.pid, *run.processes()]:  # the whole run (torchrun starts each rank in its own session)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.wait()
    ckpts = sorted(d for d in os.listdir(os.path.join(run.run_dir, "checkpoints")) if not d.endswith(".tmp"))
    state = os.path.join(run.run_dir, "checkpoints", ckpts[-1], "run_state.pt")
    with open(state, "r+b") as f:
        f.truncate(os.path.getsize(state) // 2)
    t0 = time.monotonic()
    resumed = Run(run.run_dir, model, args.steps, "trainer.resume=auto")
    ok = resumed.wait() == 0
    if not ok:
        print(f"  the resume of {run.run_dir} failed; its last lines:\n{resumed.tail()}", flush=True)
    first = next((t for t, s, line in resumed.lines if "resumed from" in line), None)
    return {"fault": f"newest checkpoint ({ckpts[-1]}) run_state.pt truncated", "outcome":
            "survived (fell back)" if ok else "stopped", "react_s": (first or 0.0) + resumed.t0 - t0,
            "message": resumed.message(), "resumed": "yes" if ok else "FAILED",
            "lost_dup": epoch_check(run.run_dir, args.steps) if ok else "-"}


def case_oversized(args, model: str, work: str, rng: random.Random) -> dict:
    import requests

    run = Run(os.path.join(work, "oversized"), model, args.steps)
    run.wait_step(rng.randint(2, args.steps - 6))
    url = f"http://127.0.0.1:{run.port}/generate"
    auth = sglang_client.key_headers(os.path.join(run.run_dir, "servers", "api_key.yaml"))  # the run's servers' key
    t_fault = run.now()
    with socket.create_connection(("127.0.0.1", run.port), timeout=30) as s:  # 40 MiB announced, never sent
        t0 = time.perf_counter()
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Authorization: {auth['Authorization']}\r\nContent-Length: {40 << 20}\r\n\r\n".encode())
        head = s.recv(65536).decode(errors="replace")
        body_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    text = requests.post(url, data=json.dumps({"text": "1" * (10 << 20)}), headers=auth, timeout=60)
    text_s = time.perf_counter() - t0
    row = finish(args, model, run, t_fault, "40 MiB body, then a 10 MB text, to the engine")
    message = json.loads(head.split("\r\n\r\n", 1)[1])["error"]["message"] if "\r\n\r\n" in head else head[:80]
    row.update(react_s=body_s, message=f"{head.split(chr(13))[0]} in {1000 * body_s:.1f} ms: {message}; the text: "
                                        f"HTTP {text.status_code} in {1000 * text_s:.0f} ms")
    return row


def kill_target(run: Run, target: str) -> int:
    """The pid of a run's process: server_0, rank0 / rank1, buffer or rollout."""
    if target == "server_0":
        return run.pid_of(f"--port {run.port}")
    if target.startswith("rank"):
        return run.trainer_pid(int(target[4:]))
    return run.pid_of(f"workers.py {target}")


def case_restart(args, model: str, work: str, target: str, rng: random.Random, reuse: bool = True) -> dict:
    """Unattended: torchrun --max-restarts 1 with trainer.resume=auto, `target` killed with kill -9 at a random step;
    the row's react is the time from the kill to the first step of the restarted attempt."""
    run = Run(os.path.join(work, f"restart_{target}"), model, args.steps, "trainer.resume=auto",
              f"rollout.reuse_servers={str(reuse).lower()}", restarts=1)
    at = rng.randint(6, args.steps - 6)  # after the first checkpoint (every 5 steps)
    run.wait_step(at)
    t_kill = run.now()
    os.kill(kill_target(run, target), signal.SIGKILL)
    rc = run.wait()
    resumed = run.first(r"\[train\] resumed from ", t_kill)
    step = run.first(r"^step \d+/", resumed[0]) if resumed else None
    server = run.first(r"node 0 (launched|reused) server_0", t_kill)
    row = {"fault": f"kill -9 {target} at step {at}, torchrun --max-restarts 1",
           "outcome": "finished (exit 0, restarted by torchrun)" if rc == 0 else f"stopped (exit {rc})",
           "react_s": (step[0] - t_kill) if step else float("nan"),
           "message": (server[1].split("[train] ", 1)[1] if server else run.message(t_kill)),
           "resumed": "yes, by torchrun" if rc == 0 and resumed else "no",
           "lost_dup": epoch_check(run.run_dir, args.steps) if rc == 0 else "-"}
    if rc != 0:
        print(f"  {run.run_dir} failed; its last lines:\n{run.tail()}", flush=True)
    row["marks"] = {name: (hit[0] - t_kill if hit else float("nan")) for name, hit in (
        ("resumed", resumed), ("server", server), ("workers", run.first(r"buffer and rollout processes joined RPC",
                                                                       t_kill)),
        ("synced", run.first(r"weights version \d+ on the servers", t_kill)), ("step", step))}
    return row


def server_startup(model: str, reps: int) -> list:
    """Seconds from starting the stand-in engine to its first /health 200, `reps` times."""
    from standins import engine

    out = []
    for _ in range(reps):
        t0 = time.monotonic()
        _, handle = engine.launch(model)
        out.append(time.monotonic() - t0)
        handle.stop()
    return out


def timing(args, model: str, work: str, rng: random.Random) -> None:
    """--timing: kill -9 of rank 0 -> first resumed step, with and without rollout.reuse_servers, alternating."""
    rows = []
    for rep in range(args.timing):
        for reuse in ((True, False) if rep % 2 == 0 else (False, True)):
            row = case_restart(args, model, os.path.join(work, f"timing_{rep}_{reuse}"), "rank0", rng, reuse)
            rows.append((reuse, row))
            print(f"  rep {rep} reuse={reuse}: {row['outcome']}, first resumed step {row['react_s']:.1f} s after the "
                  f"kill; {row['message'][:100]}", flush=True)
    starts = server_startup(model, args.timing)
    print("\n| rollout.reuse_servers | kill -9 rank 0 -> first resumed step (s) | -> resumed from the checkpoint "
          "| -> servers up | -> buffer + rollout in RPC | -> weights synced | lost / duplicated |")
    print("|---|---|---|---|---|---|---|")
    for reuse in (True, False):
        mine = [r for u, r in rows if u == reuse]
        cols = [[r["marks"][k] for r in mine] for k in ("step", "resumed", "server", "workers", "synced")]
        print(f"| {str(reuse).lower()} | " + " | ".join(
            f"{sum(c) / len(c):.1f} ({', '.join(f'{x:.1f}' for x in c)})" for c in cols) +
            f" | {', '.join(r['lost_dup'] for r in mine)} |")
    print(f"\nthe stand-in engine's start-up alone (start -> /health 200): {sum(starts) / len(starts):.1f} s "
          f"({', '.join(f'{x:.1f}' for x in starts)})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="trainer.total_steps of each run (B x steps prompts)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random fault steps (printed)")
    p.add_argument("--stall-s", type=float, default=10.0, help="how long the engine is stopped (SIGSTOP)")
    p.add_argument("--only", default=None, help="comma-separated case names (server_0,buffer,rollout,rank1,rank0,"
                                                "stall,bad_jsonl,missing_file,truncated_ckpt,oversized,restart_rank0,"
                                                "restart_rank1,restart_buffer,restart_rollout)")
    p.add_argument("--work", default=None, help="directory for the runs (default: a new temporary one)")
    p.add_argument("--timing", type=int, default=0, help="REPS: time kill -9 rank 0 -> first resumed step with and "
                                                          "without rollout.reuse_servers, REPS runs each")
    args = p.parse_args(argv)
    if args.steps < 14:
        p.error("--steps must be >= 14 (faults land between step 2 and steps - 6, checkpoints every 5 steps)")
    seed = args.seed if args.seed is not None else random.randrange(10 ** 6)
    rng = random.Random(seed)
    work = args.work or tempfile.mkdtemp(prefix="faults-")
    model = os.path.join(work, "tiny-model")  # made by the first run (model.make_tiny in tiny.yaml)
    cases = {
        **{t: (lambda t=t: case_kill(args, model, work, t, rng)) for t in ("server_0", "buffer", "rollout", "rank1",
                                                                          "rank0")},
        "stall": lambda: case_stall(args, model, work, rng),
        "bad_jsonl": lambda: case_bad_file(args, model, work, "bad_jsonl"),
        "missing_file": lambda: case_bad_file(args, model, work, "missing_file"),
        "truncated_ckpt": lambda: case_truncated_checkpoint(args, model, work, rng),
        "oversized": lambda: case_oversized(args, model, work, rng),
        **{f"restart_{t}": (lambda t=t: case_restart(args, model, work, t, rng)) for t in ("rank0", "rank1", "buffer",
                                                                                         "rollout")},
    }
    if args.timing:
        print(f"bench/faults.py --timing {args.timing}: seed {seed}, {args.steps} steps, runs in {work}", flush=True)
        return timing(args, model, work, rng)
    names = args.only.split(",") if args.only else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        p.error(f"--only: unknown cases {unknown}; known: {', '.join(cases)}")
    print(f"bench/faults.py: seed {seed}, {args.steps} steps of B={B} N={N} M={M} per run, runs in {work}",
          flush=True)
    rows, t0 = [], time.monotonic()
    for name in names:
        t = time.monotonic()
        try:
            rows.append(cases[name]())
        except Exception as e:  # a case that could not even be set up is a row, not the end of the bench
            rows.append({"fault": name, "outcome": "BENCH ERROR", "react_s": float("nan"),
                         "message": str(e).splitlines()[0], "resumed": "-", "lost_dup": "-"})
        print(f"  {name}: {time.monotonic() - t:.0f} s", flush=True)
    print(f"\n{len(rows)} faults in {time.monotonic() - t0:.0f} s\n")
    print("| fault | outcome | react (s) | first line of the message | resumed | prompts lost / duplicated |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        msg = r["message"].replace("|", "\\|")
        print(f"| {r['fault']} | {r['outcome']} | {r['react_s']:.1f} | `{msg[:200]}` | {r['resumed']} | "
              f"{r['lost_dup']} |")


if __name__ == "__main__":
    main()
