"""bench/soak.py: the CPU default (configs/tiny.yaml, torchrun 2 ranks) for 1,000+ steps; does anything grow without
bound?

Every `--every` steps (by metrics.jsonl) it samples, for every process of the run (the torchrun agent, both trainer
ranks, the engine, the buffer and rollout processes, and any other descendant: reward or sandbox workers), found by
walking torchrun's process tree in /proc: resident memory (VmRSS), open file descriptors and threads; the run
directory's size and its parts (checkpoints/, metrics.jsonl, samples/, logs/, the rest); and the buffer's queue
lengths from that step's metrics (rollout/pipeline_buf_size, in_flight / generating / held groups, TrajQueue groups
and trajectories, the restored lane). It prints a row per sample as it goes, then, per series, the least-squares
slope over the run's second half (per 1,000 steps) and a verdict: a process's RSS, fds or threads, or a queue, that
still grows over the second half by more than max(5 % of its level, a floor) is flagged; the run directory's parts
are append-only logs or checkpoints, so each is reported in bytes a step and flagged when it grows faster than
1 KiB a step, with the checkpoints' share and what `trainer.keep_checkpoints` K would leave.

Settings on top of the config (each printed): trainer.total_steps=--steps, trainer.eval_freq=100 (40 greedy evals
of 128 prompts would be a third of the time), rollout.filter=[failed] (the default also drops groups whose 16
rewards are equal: once the model solves the task, from step ~300, nearly every group is, the trainer starves and
the run stops by design with "nothing can be trained"), trainer.save_freq as the config has it (50), free ports.
Extra `key=value` arguments are passed on (e.g. trainer.keep_checkpoints=3).

Run (from the repository root; 16.5 min on the shared 2-core CPU at load 12-14, docs/results/soak.md):
    nice -n 5 .venv/bin/python bench/soak.py [--steps 1000] [--every 50] [--run-dir /tmp/soak] [--json out.json]
        [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import checkpoint  # noqa: E402
from services import free_port  # noqa: E402  (below the kernel's ephemeral ports, as train.py's own)

QUEUES = {"buf": "rollout/pipeline_buf_size", "R": "rollout/in_flight_groups", "gen": "rollout/generating_groups",
          "held": "rollout/held_groups", "tq_g": "rollout/trajqueue_groups", "tq_t": "rollout/trajqueue_trajectories",
          "lane": "rollout/restored_lane_size"}
PARTS = ("checkpoints", "metrics.jsonl", "samples", "logs", "waiting.jsonl", "other")
APPEND_ONLY = ("metrics.jsonl", "samples", "logs", "waiting.jsonl")  # a line or a file per step or eval, by design
# A series is flagged when its second-half fit grows by more than max(REL x its level, its floor) over that half.
REL = 0.05
FLOORS = {"rss_mb": 8.0, "fds": 2.0, "threads": 2.0, "queue": 2.0}
DISK_FLAG_BYTES_PER_STEP = 1024.0
KNOWN = ["rank0", "rank1", "engine", "buffer", "rollout", "torchrun"]  # the printed table's processes


# ---- the run's processes, from /proc ----
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _label(pid: int) -> str:
    """torchrun, rank0/rank1, engine, buffer, rollout, or the command's last word with the pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return f"gone-{pid}"
    line = " ".join(argv)
    if "torchrun" in line:
        return "torchrun"
    if "standins.engine" in line:
        return "engine"
    if "workers.py" in line:
        return "buffer" if "buffer" in argv else "rollout" if "rollout" in argv else f"worker-{pid}"
    if "train.py" in line:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            return f"rank{env.get(b'RANK', b'?').decode()}"
        except OSError:
            return f"train-{pid}"
    return f"{os.path.basename(argv[0]) if argv else '?'}-{pid}"


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "VmRSS":
                out["rss_mb"] = int(value.split()[0]) / 1024
            elif key == "Threads":
                out["threads"] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def processes(root: int) -> dict[str, dict]:
    """label -> {pid, rss_mb, fds, threads} for root and every descendant."""
    kids, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            status = _status(pid)
        except (OSError, ValueError):  # exited meanwhile
            continue
        if "rss_mb" in status:  # (a zombie has none)
            out[_label(pid)] = {"pid": pid, **status}
    return out


# ---- the run directory ----
def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:  # a checkpoint being replaced
                pass
    return total


def disk(run_dir: str) -> dict:
    """Bytes of the run directory's parts (PARTS) and in all; the checkpoints' count and the newest one's size."""
    out = dict.fromkeys(PARTS, 0)
    for name in os.listdir(run_dir):
        part = name if name in PARTS else "other"
        out[part] += _size(os.path.join(run_dir, name))
    done = checkpoint.steps_of(os.path.join(run_dir, "checkpoints"))  # complete ones, oldest first
    out["total"] = sum(out[p] for p in PARTS)
    out["checkpoint_count"] = len(done)
    out["checkpoint_bytes"] = _size(done[-1][1]) if done else 0
    return out


def last_metrics(path: str) -> dict:
    """The last complete line of metrics.jsonl (a step's metrics), {} before the first."""
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 65536))
        lines = [ln for ln in f.read().split(b"\n") if ln.strip()]
    for ln in reversed(lines):
        try:
            return json.loads(ln)
        except json.JSONDecodeError:  # a line being written
            continue
    return {}


# ---- the judgement ----
def slope(xs: list, ys: list) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def judge(samples: list, steps: int) -> list[dict]:
    """One row per series: its level at the first and last sample, the second half's slope per 1,000 steps, the
    growth that slope makes over the second half, and whether that is flagged."""
    half = [s for s in samples if s["step"] >= steps / 2]
    if len(half) < 3:
        return []
    xs = [s["step"] for s in half]
    span = xs[-1] - xs[0]
    rows = []

    def add(name: str, kind: str, get) -> None:
        ys = [get(s) for s in half]
        if any(y is None for y in ys):
            return
        k = slope(xs, ys)
        grow = k * span
        level = sum(ys) / len(ys)
        first = next((y for y in map(get, samples) if y is not None), None)  # a process may start later
        if kind == "disk":  # append-only logs grow by design: reported, not flagged
            flag = k > DISK_FLAG_BYTES_PER_STEP and not name.endswith(APPEND_ONLY)
        else:
            flag = grow > max(REL * abs(level), FLOORS[kind])
        verdict = "GROWS" if flag else "log (linear by design)" if kind == "disk" and name.endswith(APPEND_ONLY) \
            else "ok"
        rows.append({"series": name, "kind": kind, "first": first, "last": ys[-1], "per_1000_steps": k * 1000,
                     "second_half_growth": grow, "flag": flag, "verdict": verdict})

    labels = sorted({lab for s in samples for lab in s["procs"]}, key=_order)
    for lab in labels:
        for key in ("rss_mb", "fds", "threads"):
            add(f"{lab} {key}", key, lambda s, lab=lab, key=key: s["procs"].get(lab, {}).get(key))
    for short, name in QUEUES.items():
        add(name, "queue", lambda s, name=name: s["queues"].get(name))
    for part in (*PARTS, "total"):
        add(f"run_dir {part}", "disk", lambda s, part=part: s["disk"][part])
    return rows


def _order(label: str) -> tuple:
    return (KNOWN.index(label) if label in KNOWN else len(KNOWN), label)


def _row(s: dict, labels: list) -> str:
    d = s["disk"]
    procs = " ".join(f"{s['procs'][lab]['rss_mb']:6.0f}/{s['procs'][lab]['fds']:3d}" if lab in s["procs"]
                     else f"{'-':>10}" for lab in labels)
    queues = " ".join(f"{s['queues'][n]:4.0f}" if s["queues"].get(n) is not None else f"{'-':>4}"
                      for n in QUEUES.values())
    return (f"{s['step']:5d} {s['elapsed_s'] / 60:6.1f} | {procs} | {d['total'] / 2**20:7.2f} "
            f"{d['checkpoints'] / 2**20:7.2f} {d['metrics.jsonl'] / 2**20:6.2f} {d['samples'] / 2**20:6.2f} "
            f"{d['logs'] / 2**20:6.2f} {d['checkpoint_count']:3d} | {queues}")


def _header(labels: list) -> str:
    procs = " ".join(f"{lab[:10]:>10}" for lab in labels)
    queues = " ".join(f"{k:>4}" for k in QUEUES)
    return (f" step    min | {procs} | run_dir  ckpts  metrics samples  logs   n | {queues}\n"
            f"{'':12} | {'(RSS MiB / open fds)':^{len(procs)}} | {'(MiB)':^39} | (groups; tq_t: trajectories)")


def markdown(samples: list, rows: list, cmd: str, labels: list, keep: list) -> str:
    out = [f"Command: `{cmd}`", "", "| step | min | " + " | ".join(f"{lab} RSS MiB / fds / threads" for lab in labels)
           + " | run_dir MiB (ckpts, metrics, samples, logs; n ckpts) | " + " | ".join(QUEUES) + " |",
           "|" + "---|" * (2 + len(labels) + 1 + len(QUEUES))]
    for s in samples:
        d = s["disk"]
        cells = [f"{s['procs'][lab]['rss_mb']:.0f} / {s['procs'][lab]['fds']} / {s['procs'][lab]['threads']}"
                 if lab in s["procs"] else "-" for lab in labels]
        out.append(f"| {s['step']} | {s['elapsed_s'] / 60:.1f} | " + " | ".join(cells)
                   + f" | {d['total'] / 2**20:.2f} ({d['checkpoints'] / 2**20:.2f}, {d['metrics.jsonl'] / 2**20:.2f}, "
                   f"{d['samples'] / 2**20:.2f}, {d['logs'] / 2**20:.2f}; {d['checkpoint_count']}) | "
                   + " | ".join(f"{s['queues'].get(n, '-')}" for n in QUEUES.values()) + " |")
    out += ["", "| series | first | last | slope over the second half, per 1,000 steps | growth over the second half "
            "| verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        unit = (lambda v: f"{v / 2**20:.3f} MiB") if r["kind"] == "disk" else (lambda v: f"{v:.2f}")
        out.append(f"| {r['series']} | {unit(r['first'])} | {unit(r['last'])} | {unit(r['per_1000_steps'])} | "
                   f"{unit(r['second_half_growth'])} | {'**GROWS**' if r['flag'] else r['verdict']} |")
    if keep:
        out += ["", "Run directory at the end with `trainer.keep_checkpoints` K (the newest K checkpoints kept, each "
                "of the newest one's size): " + ", ".join(f"K={k}: {v / 2**20:.2f} MiB" for k, v in keep)]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--run-dir", default="/tmp/soak")
    p.add_argument("--model", default=os.path.join(ROOT, "runs", "tiny-base"), help="made on first use")
    p.add_argument("--json", default=None, help="write the samples and the verdict here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("overrides", nargs="*", help="key=value on top of configs/tiny.yaml and the soak's own")
    a = p.parse_args(argv)
    if os.path.exists(a.run_dir) and os.listdir(a.run_dir):
        p.error(f"--run-dir {a.run_dir} is not empty (a resumed run would not start from step 0)")
    overrides = [f"run_dir={a.run_dir}", f"model.path={a.model}", f"trainer.total_steps={a.steps}",
                 "trainer.eval_freq=100", "rollout.filter=[failed]", f"rollout.base_port={free_port()}",
                 f"weight_sync.master_port={free_port()}", *a.overrides]
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2",
           "train.py", "--config", "configs/tiny.yaml", *overrides]
    shown = "nice -n 5 .venv/bin/python bench/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"[soak] {shown}\n[soak] runs: {' '.join(cmd[3:])}", flush=True)
    os.makedirs(a.run_dir, exist_ok=True)
    log_path = a.run_dir.rstrip("/") + "_train.log"  # outside the run directory it measures
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    t0, mark, samples, labels = time.monotonic(), 1, [], KNOWN
    metrics_path = os.path.join(a.run_dir, "metrics.jsonl")
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            m = last_metrics(metrics_path)
            step = m.get("step", 0)
            if step < mark:
                continue
            s = {"step": step, "elapsed_s": time.monotonic() - t0, "procs": processes(proc.pid),
                 "disk": disk(a.run_dir), "queues": {n: m.get(n) for n in QUEUES.values()}}
            if not all(lab in s["procs"] for lab in KNOWN):  # starting, or the run's end: not a steady sample
                continue
            samples.append(s)
            if len(samples) == 1:
                print(_header(labels), flush=True)
            print(_row(s, labels), flush=True)
            mark = (step // a.every + 1) * a.every
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        log.close()
    print(f"[soak] train.py exited with code {proc.returncode} after {(time.monotonic() - t0) / 60:.1f} min "
          f"(its output: {log_path})", flush=True)
    rows = judge(samples, a.steps)
    print(f"\n{'series':34} {'first':>12} {'last':>12} {'/1000 steps':>12} {'2nd half':>12}  flag")
    for r in rows:
        f = (lambda v: f"{v / 2**20:10.3f}Mi") if r["kind"] == "disk" else (lambda v: f"{v:12.2f}")
        print(f"{r['series']:34} {f(r['first'])} {f(r['last'])} {f(r['per_1000_steps'])} "
              f"{f(r['second_half_growth'])}  {r['verdict']}")
    keep = []
    if samples:
        d = samples[-1]["disk"]
        keep = [(k, d["total"] - d["checkpoints"] + min(k, d["checkpoint_count"]) * d["checkpoint_bytes"])
                for k in (1, 3)]
        print(f"[soak] run_dir at the end: {d['total'] / 2**20:.2f} MiB, of which {d['checkpoint_count']} checkpoints "
              f"{d['checkpoints'] / 2**20:.2f} MiB ({d['checkpoints'] / max(1, d['total']):.0%}); with "
              + ", ".join(f"trainer.keep_checkpoints={k}: {v / 2**20:.2f} MiB" for k, v in keep))
    flagged = [r["series"] for r in rows if r["flag"]]
    print(f"[soak] verdict: {'grows: ' + ', '.join(flagged) if flagged else 'nothing grows over the second half'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": shown, "train_command": cmd[3:], "exit_code": proc.returncode, "samples": samples,
                       "slopes": rows, "keep_checkpoints": keep}, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(samples, rows, shown, sorted({k for s in samples for k in s["procs"]}, key=_order), keep))
    return proc.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
