"""bench/step_bench.py: the system's step time against a plain single-process GRPO loop on the same config.

The plain loop is the least a step can cost on this machine: one process, the HF model, `model.generate` for the
B x N samples of a step (left-padded, KV cache, temperature and max_new_tokens of the config), the config's reward,
`losses.compute_advantages` and `losses.ppo` with the config's algorithm, (B x N) // M AdamW updates, and
a greedy eval every trainer.eval_freq steps on the same held-out prompts. No HTTP, no RPC, no FSDP, no pause, no
weight sync, no overlap of generation with training.

The system is `torchrun train.py --config CONFIG` itself (the config's processes, servers and mode), run for the
same steps; its step time and breakdown come from its metrics.jsonl (`timing/*`, wait). Both start from the same
base model, so the learning curves printed beside the times compare too.

Printed: per side the mean step time over the steps after --warmup (wall clock between logged steps, so evaluation
and checkpoints count), the eval curve, then the ratio system / plain loop and the system's breakdown per step
(train, waiting for data, pause, weight sync, processing, checkpoint, eval, the rest).

Run:
    python bench/step_bench.py [--config configs/tiny.yaml] [--steps 60] [--warmup 5] [--only plain|system]
                               [--runs K] [--compare GIT_REV]
                               [KEY=VALUE ...]   # config overrides for both sides, e.g. fully_async.enable=false

Whether the system's step changed (`--compare REV --runs K`, K >= 5 for an interval worth reading): REV is checked
out into a temporary git worktree and `train.py` of that tree (B) and of this one (A) run alternately, A, B, A, B ...,
K times each, from the same base model (this tree's, at an absolute model.path) and the same overrides; the plain
loop is not run. Alternation is what makes the comparison fair on a shared machine: a load that comes and goes hits
both sides alike, and the paired ratio B / A of each round cancels what a round shares. Printed per side, as the mean
and its 95% t-interval over the runs, and per round as the ratio:
- step s: wall clock between logged steps after --warmup; train s and wait s: the trainer's timing/train and
  timing/rollout (waiting for data) per step;
- trajectories per trained group: trajectories generated in those steps (`rollout/trajectories_finished`) over the
  groups trained (B a step): what the filter and the step boundary cost, apart from how fast a trajectory is made;
- cut by length share: of those trajectories, the share that ended at max_new_tokens (rollout/truncation_ratio);
- trajectories/s generated, and CPU us per generated trajectory of each process (engine, rollout, buffer, trainer:
  both ranks, other: torchrun), from /proc/<pid>/stat of the run's process tree sampled every 0.25 s, counted
  between the times of those steps' metrics rows.
So step s = (trajectories per group x B) / (trajectories/s) + what is not overlapped, and a slower step shows which
term moved and, through CPU per trajectory, in which process. `--engine-only` (with --compare) bisects the engine's
share: standins/engine.py of each tree alone under the config's rollout load (engine_run), its CPU us per trajectory.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import config as config_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_base(cfg) -> None:
    from standins import tiny_model

    if not os.path.isdir(cfg.model.path):
        tiny_model.make_tiny_for(cfg)
    tiny_model.check_tiny_base(cfg)  # as train.py's check_launch: a cached base of another recipe is refused


def greedy_eval(model, tokenizer, prompts, max_new_tokens, reward_fn) -> tuple[float, float]:
    import torch

    rewards = []
    with torch.no_grad():
        for i in range(0, len(prompts), 64):
            chunk = prompts[i:i + 64]
            out, _ = sample(model, tokenizer, [p["prompt_ids"] for p in chunk], max_new_tokens, 0.0)
            for p, resp in zip(chunk, out):
                rewards.append(score(tokenizer, resp, p["label"], reward_fn))
    return sum(rewards) / len(rewards), sum(r >= 1.0 for r in rewards) / len(rewards)


def sample(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float):
    """Left-padded batched generation; returns (responses as token lists, cut after eos; width of the prompt)."""
    import torch

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attn = (ids != pad).long()
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, pad_token_id=pad,
                         eos_token_id=eos, **kw)[:, width:].tolist()
    responses = []
    for row in out:
        resp = []
        for t in row:
            resp.append(t)
            if t == eos:
                break
        responses.append(resp)
    return responses, width


def score(tokenizer, resp: list[int], label, reward_fn) -> float:
    stopped = bool(resp) and resp[-1] == tokenizer.eos_token_id
    return reward_fn(tokenizer.decode(resp[:-1] if stopped else resp), label, stopped)


def plain_loop(cfg, steps: int) -> dict:
    """The reference GRPO loop; returns {"step_s": [...], "eval": [(step, reward, exact)]}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import batching
    import logprobs
    import losses
    import tasks

    torch.manual_seed(cfg.seed)
    ds = cfg.data_source[0]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    t = cfg.trainer
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    prompts = tasks.load_prompts(ds, tokenizer, "train")
    random.Random(ds.seed).shuffle(prompts)
    evals = tasks.load_prompts(ds, tokenizer, "eval")
    reward_fn = tasks.get_reward_fn(ds.reward or tasks.default_reward(ds.task))
    s = cfg.rollout.sampling
    temp, N, B, M = s.temperature, cfg.N, cfg.B, cfg.M
    out = {"step_s": [], "eval": [(0, *greedy_eval(model, tokenizer, evals, s.max_new_tokens, reward_fn))],
           "generated_at": []}
    cursor = generated = 0
    kept: list = []  # groups that passed the filter, (prompt, responses, rewards); the surplus goes to the next step
    for step in range(steps):
        t0 = time.perf_counter()
        model.eval()
        while len(kept) < B:  # rollout.filter all_equal_reward drops groups; the step still trains B of them
            # Whole batches of B prompts (B x N samples in one generate call), as the system keeps its fleet busy;
            # groups beyond this step's B are trained next step (one step stale at most, like stale_steps 1).
            draw = [prompts[(cursor + i) % len(prompts)] for i in range(B)]
            cursor += len(draw)
            generated += len(draw) * N
            with torch.no_grad():
                drawn, _ = sample(model, tokenizer, [p["prompt_ids"] for p in draw for _ in range(N)],
                                  s.max_new_tokens, temp)
            for g, p in enumerate(draw):
                r = [score(tokenizer, x, p["label"], reward_fn) for x in drawn[g * N:(g + 1) * N]]
                if "all_equal_reward" in cfg.rollout.filter and len(set(r)) == 1:
                    continue
                kept.append((p, drawn[g * N:(g + 1) * N], r))
        groups, kept = kept[:B], kept[B:]
        batch = [p for p, _, _ in groups]
        resps = [x for _, rs, _ in groups for x in rs]
        rewards = torch.tensor([x for _, _, r in groups for x in r])
        adv = losses.compute_advantages(rewards.view(B, N), cfg.algorithm.adv.std_normalize,
                                        cfg.algorithm.adv.eps).flatten()
        seqs = [{"prompt": batch[i // N]["prompt_ids"], "response": r, "mask": [1] * len(r),
                 "rollout_lp": [0.0] * len(r), "versions": [0] * len(r), "adv": float(adv[i])}
                for i, r in enumerate(resps)]
        batches = [batching.collate(seqs[c * M:(c + 1) * M]) for c in range(B * N // M)]
        with torch.no_grad():  # the old policy: the weights at the step's start, for every update of the step
            olds = [logprobs.token_logprobs(model(input_ids=b["ids"], attention_mask=b["attn"]).logits[:, :-1],
                                          b["ids"][:, 1:], temp, t.logprob_chunk_tokens)[0] for b in batches]
        model.train()
        for b, old in zip(batches, olds):
            logits = model(input_ids=b["ids"], attention_mask=b["attn"]).logits[:, :-1]
            logp, _ = logprobs.token_logprobs(logits, b["ids"][:, 1:], temp, t.logprob_chunk_tokens)
            denom = losses.loss_denominator(b["mask"], cfg.algorithm.loss_agg_mode, s.max_new_tokens)
            # the sampling policy is the old policy here (rollout log-probs = old: IS weights of 1)
            loss, _ = losses.ppo(losses.TokenBatch(logp, old, old, b["adv"], b["mask"]), cfg.algorithm, denom)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            opt.step()
        if t.eval_freq and (step + 1) % t.eval_freq == 0:
            out["eval"].append((step + 1, *greedy_eval(model, tokenizer, evals, s.max_new_tokens, reward_fn)))
            out["generated_at"].append((step + 1, generated))
        out["step_s"].append(time.perf_counter() - t0)
        print(f"[plain] step {step + 1}/{steps} {out['step_s'][-1]:.2f} s"
              + (f" eval {out['eval'][-1][1]:.3f}" if out["eval"][-1][0] == step + 1 else ""), flush=True)
    return out


BREAKDOWN = [("train", "timing/train"), ("wait for data", "timing/rollout"), ("pause", "timing/pause_delay"),
             ("weight sync", "timing/update_weights"), ("process", "timing/process_traj"),
             ("checkpoint", "timing/save_ckpt"), ("eval", "timing/eval")]
ROLES = ("engine", "rollout", "buffer", "trainer", "other")
TICK = os.sysconf("SC_CLK_TCK")
# two-sided 95% t quantiles by degrees of freedom (no scipy in requirements.txt)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086}


def interval(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / len(xs) ** 0.5


def role_of(cmdline: str) -> str:
    """The process a command line is, in this tree's layout or the older one (buffer.py / rollout.py --serve)."""
    if "standins.engine" in cmdline or "engine.py" in cmdline:
        return "engine"
    if "workers.py\0buffer" in cmdline or "/buffer.py" in cmdline:
        return "buffer"
    if "workers.py\0rollout" in cmdline or "/rollout.py" in cmdline:
        return "rollout"
    if "train.py" in cmdline and "torchrun" not in cmdline and "torch.distributed.run" not in cmdline:
        return "trainer"
    return "other"


class CpuSampler(threading.Thread):
    """CPU seconds (user + system) of a process tree by role, every `every` s: samples [(time.time(), {role: s})].

    A process's last reading is kept after it exits, so the totals only grow; a process that lives less than one
    period is missed (the run's processes live for the whole run)."""

    def __init__(self, root_pid: int, every: float = 0.25):
        super().__init__(daemon=True)
        self.root, self.every, self.samples, self.stop = root_pid, every, [], threading.Event()
        self.last: dict[int, tuple[str, float]] = {}

    def _tree(self) -> dict[int, int]:
        parent = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        out, todo = {}, [self.root]
        children: dict[int, list[int]] = {}
        for pid, pp in parent.items():
            children.setdefault(pp, []).append(pid)
        while todo:
            pid = todo.pop()
            out[pid] = 1
            todo.extend(children.get(pid, []))
        return out

    def run(self) -> None:
        while not self.stop.wait(self.every):
            for pid in self._tree():
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    with open(f"/proc/{pid}/cmdline") as f:  # read each time: a pid's exec changes it
                        cmdline = f.read()
                    if not cmdline:  # between fork and exec, or exiting: its time counts at the next reading
                        continue
                    self.last[pid] = (role_of(cmdline), (int(fields[11]) + int(fields[12])) / TICK)
                except (OSError, IndexError, ValueError):
                    pass
            tot = dict.fromkeys(ROLES, 0.0)
            for role, cpu in self.last.values():
                tot[role] += cpu
            self.samples.append((time.time(), tot))

    def at(self, t: float) -> dict[str, float]:
        """The totals of the last sample at or before time t (the first sample if none)."""
        best = self.samples[0][1]
        for ts, tot in self.samples:
            if ts > t:
                break
            best = tot
        return best


def system_run(config_path: str, overrides: list[str], steps: int, run_dir: str, root: str = ROOT):
    """torchrun train.py of the tree at `root` for `steps` steps; returns (metrics.jsonl rows, CpuSampler)."""
    port = random.randint(32000, 39999)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc_per_node", "2",
           os.path.join(root, "train.py"), "--config", config_path, *overrides, f"run_dir={run_dir}",
           f"trainer.total_steps={steps}", "trainer.save_freq=0", "trainer.export_hf=false",
           f"rollout.base_port={port}", f"weight_sync.master_port={port + 10000}"]
    print("[system] " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=root)
    sampler = CpuSampler(proc.pid)
    sampler.start()
    try:
        rc = proc.wait()
    finally:
        sampler.stop.set()
        sampler.join()
    if rc:
        raise SystemExit(f"[system] {root}/train.py exited with {rc}; see {run_dir}/logs")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()], sampler


def run_figures(rows: list[dict], sampler: CpuSampler, warmup: int, B: int) -> dict:
    """The figures of one system run over the steps after `warmup` (see the module docstring)."""
    rows = [r for r in rows if "step" in r and "time" in r]
    steps_rows = [r for r in rows if r["step"] > warmup]
    start = max((r for r in rows if r["step"] <= warmup), key=lambda r: r["time"])
    end = max(steps_rows, key=lambda r: r["time"])
    n_steps = len({r["step"] for r in steps_rows})
    wall = end["time"] - start["time"]
    trajs = sum(r.get("rollout/trajectories_finished", 0) for r in steps_rows)
    c0, c1 = sampler.at(start["time"]), sampler.at(end["time"])
    cut = sum(r.get("rollout/truncation_ratio", 0) * r.get("rollout/trajectories_finished", 0) for r in steps_rows)
    out = {"step s": wall / n_steps, "train s / step": sum(r.get("timing/train", 0) for r in steps_rows) / n_steps,
           "wait s / step": sum(r.get("timing/rollout", 0) for r in steps_rows) / n_steps,
           "trajectories / trained group": trajs / (n_steps * B), "trajectories / s": trajs / wall,
           "cut by length share": cut / max(trajs, 1)}
    for role in ROLES:
        out[f"{role} CPU us / trajectory"] = 1e6 * (c1[role] - c0[role]) / max(trajs, 1)
    out["all CPU us / trajectory"] = sum(out[f"{r} CPU us / trajectory"] for r in ROLES)
    return out


def breakdown(rows: list[dict], warmup: int, steps: int, wall_mean: float) -> None:
    steps_rows = [r for r in rows if r["step"] > warmup]
    print(f"\nsystem step breakdown (mean s per step over steps {warmup + 1}-{steps}):")
    accounted = 0.0
    for label, key in BREAKDOWN:
        v = sum(r.get(key, 0.0) for r in steps_rows) / len(steps_rows)
        accounted += v
        print(f"  {label:<14}{v:7.3f}")
    print(f"  {'other':<14}{wall_mean - accounted:7.3f}  (metrics, logging, the step's RPC calls)")
    print(f"  {'wall':<14}{wall_mean:7.3f}")


def engine_run(root: str, base: str, cfg, rounds: int = 4, groups: int = 100) -> float:
    """The engine of the tree at `root` (standins/engine.py, or engine.py in older trees) alone under the config's
    rollout load: groups of N identical prompts of the first data source, async_max_concurrent_samples // N of them
    in flight, temperature and max_new_tokens of the config, return_logprob, and a /flush_cache after every `groups`
    groups (a step's weight sync flushes). Returns the engine process's CPU us per trajectory over the rounds after the first (a warm-up)."""
    import asyncio

    import aiohttp
    import requests
    from transformers import AutoTokenizer

    import tasks

    prompts = tasks.load_prompts(cfg.data_source[0], AutoTokenizer.from_pretrained(base), "train")
    port, N, s = random.randint(20000, 29999), cfg.N, cfg.rollout.sampling
    engine = ["-m", "standins.engine"] if os.path.isdir(os.path.join(root, "standins")) else ["engine.py"]
    proc = subprocess.Popen([sys.executable, *engine, "--model-path", base, "--port", str(port),
                             "--max-running-requests", str(cfg.rollout.async_max_concurrent_samples), "--device",
                             "cpu", "--log-level", "warning"], cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    try:
        while True:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"[engine] the engine of {root} did not answer /health within 300 s")
            time.sleep(0.2)

        def cpu() -> float:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / TICK

        async def drive() -> list[float]:
            sem, marks, cursor = asyncio.Semaphore(max(1, cfg.rollout.async_max_concurrent_samples // N)), [], 0
            sp = {"temperature": s.temperature, "top_p": s.top_p, "max_new_tokens": s.max_new_tokens}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
                async def group(ids):
                    async with sem, session.post(url + "/generate", json={
                            "input_ids": [ids] * N, "return_logprob": True, "sampling_params": sp}) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                for _ in range(rounds):
                    marks.append(cpu())
                    todo = [prompts[(cursor + i) % len(prompts)]["prompt_ids"] for i in range(groups)]
                    cursor += groups
                    await asyncio.gather(*map(group, todo))
                    async with session.post(url + "/flush_cache") as r:
                        await r.read()
                marks.append(cpu())
            return marks

        marks = asyncio.run(drive())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return 1e6 * (marks[-1] - marks[1]) / ((rounds - 1) * groups * N)


def compare(args, overrides: list[str], cfg) -> None:
    """A (this tree) and B (args.compare in a temporary worktree) alternately, args.runs times each."""
    rev = subprocess.run(["git", "rev-parse", "--short", args.compare], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    other = tempfile.mkdtemp(prefix=f"step-bench-{rev}-")
    subprocess.run(["git", "worktree", "add", "--detach", other, rev], cwd=ROOT, check=True)
    # the same base for both sides: this tree's, by absolute path (the other tree's model.path would be its own)
    base = os.path.abspath(os.path.join(ROOT, cfg.model.path))
    both = [*overrides, f"model.path={base}"]
    sides = {"A": (ROOT, f"{head} + this tree's changes"), "B": (other, rev)}
    figs: dict[str, list[dict]] = {"A": [], "B": []}
    try:
        for i in range(args.runs):
            for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
                root = sides[side][0]
                config = os.path.join(root, os.path.relpath(os.path.abspath(args.config), ROOT))
                run_dir = tempfile.mkdtemp(prefix=f"step-bench-{side}-")
                if args.engine_only:
                    figs[side].append({"engine CPU us / trajectory": engine_run(root, base, cfg)})
                else:
                    rows, sampler = system_run(config, both, args.steps, run_dir, root)
                    figs[side].append(run_figures(rows, sampler, args.warmup, cfg.B))
                shutil.rmtree(run_dir, ignore_errors=True)
                print(f"[compare] round {i + 1} {side}: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                                      figs[side][-1].items()), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", other], cwd=ROOT)
    print(f"\nA = {sides['A'][1]}, B = {sides['B'][1]}; {args.runs} alternating runs each of {args.steps} steps "
          f"(steps {args.warmup + 1}-{args.steps}); mean +- 95% t-interval half-width; B / A per round paired")
    print(f"{'':<30}{'A':>18}{'B':>18}{'B / A':>18}")
    for key in figs["A"][0]:
        a, b = interval([f[key] for f in figs["A"]]), interval([f[key] for f in figs["B"]])
        r = interval([fb[key] / fa[key] for fa, fb in zip(figs["A"], figs["B"]) if fa[key]])
        print(f"{key:<30}{a[0]:>11.3f} +-{a[1]:<5.3f}{b[0]:>11.3f} +-{b[1]:<5.3f}{r[0]:>11.3f} +-{r[1]:<5.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "tiny.yaml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the mean step time")
    p.add_argument("--only", choices=["plain", "system"])
    p.add_argument("--runs", type=int, default=1, help="system runs (per side with --compare), figures as mean and "
                                                       "95%% t-interval")
    p.add_argument("--compare", metavar="GIT_REV", help="alternate the system runs with those of this revision")
    p.add_argument("--engine-only", action="store_true", help="with --compare: the engine of each tree alone under "
                                                              "the config's rollout load (engine_run), not train.py")
    args, overrides = p.parse_known_args()
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    if args.warmup < 1 or args.warmup >= args.steps:
        p.error(f"--warmup must be in 1..--steps-1 (a logged step before the window starts it), got {args.warmup}")
    cfg = config_lib.load_config(args.config, overrides)
    cfg.trainer.total_steps = args.steps
    ensure_base(cfg)
    if args.engine_only and not args.compare:
        p.error("--engine-only compares two trees: give --compare GIT_REV")
    if args.compare:
        compare(args, overrides, cfg)
        return
    res = {}
    if args.only != "system":
        import torch

        torch.set_num_threads(2)  # the machine's two cores, as the system's processes share them
        plain = plain_loop(cfg, args.steps)
        res["plain"] = statistics.mean(plain["step_s"][args.warmup:])
        print("plain eval (reward/exact): " + ", ".join(f"{s}: {r:.3f}/{e:.3f}" for s, r, e in plain["eval"]))
        print("plain loop trajectories generated by step: "
              + ", ".join(f"{s}: {n}" for s, n in plain["generated_at"]))
    if args.only != "plain":
        figs = []
        for _ in range(args.runs):
            rows, sampler = system_run(args.config, overrides, args.steps, tempfile.mkdtemp(prefix="step-bench-"))
            figs.append(run_figures(rows, sampler, args.warmup, cfg.B))
            print("system eval: " + ", ".join(f"{r['step']}: {r['eval/reward_mean']:.3f}/{r['eval/exact_ratio']:.3f}"
                                              for r in rows if "eval/reward_mean" in r))
        res["system"] = statistics.mean(f["step s"] for f in figs)
        breakdown(rows, args.warmup, args.steps, figs[-1]["step s"])
        print(f"\nsystem figures over {args.runs} run(s) (mean +- 95% t-interval half-width):")
        for key in figs[0]:
            m, h = interval([f[key] for f in figs])
            print(f"  {key:<30}{m:10.3f} +-{h:.3f}")
    for side in ("plain", "system"):
        if side in res:
            print(f"{side} loop: {res[side]:.3f} s/step")
    if len(res) == 2:
        print(f"ratio system / plain loop: {res['system'] / res['plain']:.2f}")


if __name__ == "__main__":
    main()
