"""bench/learning_sim.py: what a staleness rule trains on and how fast: the real buffer and strategies on a simulated
clock. A throughput-and-staleness simulator; its learner says nothing about whether staleness hurts learning.

Why not (docs/results/staleness.md, "What the learner cannot show"): the learner below cannot be hurt by corrected
staleness. Its tokens are drawn independently given the prompt (nothing compounds along a sequence), its reward is
dense per token, its lengths do not depend on the policy, and its teacher is linear in its 32 weights: at mean token
staleness 11.5 or 4x the learning rate, with the behaviour weights' ESS down to 0.07-0.17, no corrected run learned
slower than sync. Its eval numbers are printed, and `test_learning_sim.py` checks the mechanics they rest on, but no
conclusion about losses or bounds is drawn from them. What it does measure: staleness per token, throughput against
an ideal, tokens thrown away, and which prompts (length, difficulty) a rule trains on against what it dispatched.

What is real: `buffer.PipelineServer` (collection run inside put(), collector_thread=False, so a run is
deterministic) with the rule of `strategies.REGISTRY`, called as rollout.py and train.run_steps call it: dispatch,
put, boundary_aborts + step_boundary at the pause (abort / in_place / drain, the rule's update-time action),
set_weight_version after the update, get by training call. The loss is algorithm.policy_loss's choice
(`losses.POLICY_LOSSES`, called as actor.micro_batch_loss calls it, with the run's config: each preset with its
peer's loss and off-policy mask from `strategies.peer_overrides`, the spec's rules and sync with tiny.yaml's), and
`losses.offpolicy_token_mask` where the config masks.
What is simulated:
  - the clock and the fleet: the latency model of docs/results/pipeline_sim.md (bench/sim_server.Workload),
    scaled: response lengths / --token-scale (100: median 35 tokens), decode speed / the same factor, so a step
    takes the spec's simulated seconds; B = 16 groups of N = 8 (the spec's 64 scaled by 1/4, the fleet's
    concurrency and the training GPUs with it). Requests on a replica share its speed v(c) = v0 / (1 + c / c_half);
    beyond max_running they wait. Nothing decodes during the 10 s weight update. Prefill is free.
  - the learner: a softmax policy over V = 4 tokens whose logits are W x_p (W shared by every prompt, x_p a fixed
    feature vector per prompt), trained by Adam. A prompt's right token is the argmax of a fixed teacher W* x_p;
    its difficulty is the teacher's margin (tercile 0 easy .. 2 hard); its responses' lengths are long-tailed and
    longer for harder prompts (the group median's log-normal draw is correlated 0.7 with difficulty). Tokens are
    drawn independently given the prompt, under the weights of the version that generated them (a resumed or
    in-place trajectory mixes versions). Reward = the fraction of right tokens; eval = the exact expected reward
    on 256 held-out prompts (no sampling noise). The learning rate is set so that the per-step KL between
    successive policies (reported) is ~1e-3 per token, the order of LLM GRPO runs; --lr-scale changes it.
    Response length does not depend on the policy (a simplification: in an LLM it does).
Measured per run: eval reward against consumed samples and against simulated time, steps/time/samples to the
target, generated tokens per trained token, per-token staleness (trainer version - the token's version), the ESS
of the behaviour weights pi_old / mu per training call, the mean length and difficulty of what was trained against
what was dispatched, the per-step KL.

Grid: every rule (the spec's three at stale_steps k, the presets at their knob for k steps: areal eta, verl s,
pipelinerl max_lag k B N, prime-rl M = k, roll alpha, slime-async C = k B; and sync, staleness 0) x k = 1, 2, 4
(and prime-rl at its default M = 8) x a training-bound (8:8) and a generation-bound (12:4) split x 3 seeds, each
rule with its own loss (areal: decoupled_ppo, pipelinerl: truncated_is, the others: ppo, i.e. tiny.yaml's PPO
against the step-start snapshot with the IS weight min(pi_old / mu, 2)); then the loss factor at k = 4 for areal and
pipelinerl: every algorithm.policy_loss (ppo, truncated_is, decoupled_ppo, loglinear, m2po, gspo, cispo, each with
the settings it needs: LOSS_SETTINGS) and two baselines of ppo, naive PPO (the ratio against mu:
trainer.use_rollout_log_probs=true, no IS) and PPO without the IS weight, at the tuned learning rate and at 4x it
(per-step KL ~4e-3: a faster-moving policy).

Run (the grid: 378 runs of 50 steps, 174 without the loss factor; its 306 runs with 6 losses took 492 CPU s, 4 min
11 s of wall time on a quiet 2-core machine, load average 1.1; --quick: 5 runs of 12 steps, seconds):
      nice -n 10 python bench/learning_sim.py --json runs/learning_sim.json --png-dir docs/results
      python bench/learning_sim.py [--quick] [--workers 2] [--steps 50] [--seeds 3] [--only areal,verl]
                                   [--no-loss-factor] [--lr-scale 1] [--replot runs/learning_sim.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import buffer  # noqa: E402
import config  # noqa: E402
import losses  # noqa: E402
import sim_server  # noqa: E402
import staleness  # noqa: E402
import strategies  # noqa: E402

SIMULATION_NOTE = ("Simulated: the clock, the fleet (the workload model of docs/results/pipeline_sim.md, lengths and "
                   "speeds scaled by 1/100, B scaled 64 -> 16 with the fleet and training) and a toy learner (a shared "
                   "softmax policy over 4 tokens, KL per step ~1e-3) that staleness cannot hurt: read throughput, "
                   "staleness and what is trained, not learning; real: buffer.PipelineServer, the strategies and the "
                   "losses.")
V, F = 4, 8  # tokens, prompt features
B, N, M = 16, 8, 32  # groups per step, trajectories per group, trajectories per training call
SPEC_RULES = ("no-window", "window-gated", "windowed-fifo")
# The losses: algorithm.policy_loss's choices (losses.POLICY_LOSSES, as actor.micro_batch_loss calls them) and two
# baselines of ppo: naive PPO (the ratio against the behaviour policy mu) and PPO without the IS weight.
LOSS_SETTINGS = {  # what each published loss needs of tiny.yaml's settings (its IS weight is ppo's correction)
    "decoupled_ppo": ["algorithm.is_correction.enable=false"],
    "loglinear": ["algorithm.is_correction.enable=false"],
    "m2po": ["algorithm.is_correction.enable=false"],
    "truncated_is": ["algorithm.is_correction.enable=false", "algorithm.loss_agg_mode=seq-mean-token-sum"],
}
LOSS_OVERRIDES = {
    "naive": ["algorithm.policy_loss=ppo", "trainer.use_rollout_log_probs=true", "algorithm.is_correction.enable=false"],
    "ppo-nois": ["algorithm.policy_loss=ppo", "algorithm.is_correction.enable=false"],
    **{name: [f"algorithm.policy_loss={name}", *LOSS_SETTINGS.get(name, ())] for name in losses.POLICY_LOSSES},
}
LOSSES = tuple(LOSS_OVERRIDES)
DEFAULT_LOSS = "ppo"  # tiny.yaml's: the spec's rules and sync train with it
SPLITS = {"training-bound 8:8": (8, [4, 4]), "generation-bound 12:4": (12, [4])}  # train GPUs, replica GPUs
PRIME_RL_DEFAULT_M = 8  # prime-rl's max_off_policy_steps default: one more row for it


def own_loss(rule: str) -> str:
    """The loss a rule is paired with: a preset's peer's (strategies.Preset.policy_loss), else tiny.yaml's."""
    cls = strategies.REGISTRY.get(rule)
    return cls.policy_loss if cls is not None and issubclass(cls, strategies.Preset) else DEFAULT_LOSS


@dataclass
class Run:
    rule: str  # a REGISTRY name or "sync"
    level: int  # staleness steps k (0 for sync)
    split: str
    seed: int
    loss: Optional[str] = None  # None: the rule's own (own_loss)
    steps: int = 50
    lr_scale: float = 1.0
    token_scale: int = 100
    overrides: tuple = ()  # more a.b=c config overrides, last (e.g. a preset's companion concurrency cap)

    def __post_init__(self):
        self.loss = self.loss or own_loss(self.rule)

    @property
    def name(self) -> str:
        return f"{self.rule}-k{self.level}-{self.split.split()[0]}-{self.loss}-s{self.seed}"


def knob(rule: str, k: int) -> tuple[float, Optional[float]]:
    """(stale_steps, policy_param) allowing k steps of staleness (bench/policies.py's mapping)."""
    if rule in SPEC_RULES:
        return float(k), None
    return 0.0, float(k * B * N if rule == "pipelinerl" else k * B if rule == "slime-async" else k)


def action_of(rule: str, param: Optional[float]) -> strategies.UpdateAction:
    cls = strategies.REGISTRY[rule]
    if not issubclass(cls, strategies.Preset):
        return strategies.ABORT_RESUME  # tiny.yaml: rollout.partial=true, pause_mode abort
    return (cls.actions or cls(B, B, param, N).actions)[0]


def make_cfg(run: Run):
    fa = run.rule != "sync"
    stale, param = knob(run.rule, run.level) if fa else (0.0, None)
    partial, pause_mode = action_of(run.rule, param).rollout_settings if fa else (True, "abort")
    d = {"name": "learning-sim", "device": "cpu", "colocate": False,
         "data_source": {"task": "reverse_digits", "num_prompts_per_step": B, "num_trajectories_per_prompt": N,
                         "num_prompts": 4096, "shuffle": True, "seed": run.seed},
         "trainer": {"mini_batch_size": M, "total_steps": run.steps},
         "fully_async": {"enable": fa, "sliding_window": run.rule if fa else "no-window", "stale_steps": stale,
                         "policy_param": param},
         "algorithm": {"is_correction": {"enable": True}},  # tiny.yaml's
         "rollout": {"partial": partial, "pause_mode": pause_mode, "filter": [],
                     "mask_offpolicy_in_partial_rollout": True}}  # tiny.yaml's
    over = []
    if run.rule in strategies.PRESETS:  # the peer's off-policy mask, where it has one; the loss and the settings it
        # needs come from LOSS_OVERRIDES (the peer's own loss settings on every loss made ppo equal ppo-nois)
        over = [o for o in strategies.peer_overrides(run.rule) if o.startswith("rollout.")]
    over += [*LOSS_OVERRIDES[run.loss], *run.overrides]
    return config.validate(config.from_dict(config._merge(d, config.parse_overrides(over))))


class Task:
    """Prompts (features, right token, difficulty, length median) and a held-out eval set, from the seed."""

    def __init__(self, seed: int, n: int = 4096, n_eval: int = 256, median: float = 35.0, group_sigma: float = 0.6):
        g = np.random.default_rng(1000 + seed)
        teacher = g.normal(size=(V, F))
        x = g.normal(size=(n + n_eval, F))
        logits = x @ teacher.T
        top2 = np.sort(logits, axis=1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        rank = margin.argsort().argsort() / len(margin)  # 0 = smallest margin = hardest
        hard = 1.0 - rank
        z = np.sqrt(2) * _erfinv(2 * np.clip(hard, 1e-3, 1 - 1e-3) - 1)  # normal quantile of the hardness
        rho = 0.7
        logmed = math.log(median) + group_sigma * (rho * z + math.sqrt(1 - rho ** 2) * g.normal(size=len(z)))
        self.x, self.label = x[:n], logits[:n].argmax(1)
        self.difficulty = np.minimum(2, (hard * 3).astype(int))[:n]
        self.median = np.exp(logmed)[:n]
        self.eval_x, self.eval_label = x[n:], logits[n:].argmax(1)

    def prompts(self) -> list[dict]:
        return [{"prompt_ids": [i], "label": int(self.label[i]), "metadata": {}} for i in range(len(self.label))]


def _erfinv(y: np.ndarray) -> np.ndarray:
    return torch.erfinv(torch.as_tensor(y)).numpy()


class Learner:
    """The shared softmax policy: logits = W x. Versions keep their W (numpy) for sampling and the loglinear prox."""

    def __init__(self, lr: float):
        self.W = torch.zeros(V, F, dtype=torch.float64, requires_grad=True)
        self.opt = torch.optim.Adam([self.W], lr=lr)
        self.versions = [self.W.detach().numpy().copy()]

    def probs(self, v: int, x: np.ndarray) -> np.ndarray:
        z = x @ self.versions[v].T
        z = z - z.max(-1, keepdims=True)
        p = np.exp(z)
        return p / p.sum(-1, keepdims=True)

    def snapshot(self) -> None:
        self.versions.append(self.W.detach().numpy().copy())


class Req:
    """One trajectory being generated: target length, tokens so far (with their versions and log mu)."""
    __slots__ = ("key", "index", "row", "epoch", "seq", "L", "done", "acts", "logp", "vers", "status", "replica")

    def __init__(self, pg, index: int, L: int, prior=None):
        self.key, self.index, self.row, self.epoch, self.seq = pg.prompt_id, index, pg.data_index, pg.epoch, pg.seq
        self.L = L
        self.acts, self.logp, self.vers = ([], [], []) if prior is None else prior
        self.done = float(len(self.acts))
        self.status = None
        self.replica = None


class Sim:
    def __init__(self, run: Run):
        self.run = run
        self.cfg = make_cfg(run)
        self.task = Task(run.seed)
        wl = sim_server.Workload()
        s, f = run.token_scale, B / wl.num_prompts_per_step
        train_gpus, replicas = SPLITS[run.split]
        self.replicas = []
        for g in replicas:
            c_half, cap = wl.replica_capacity(g)
            self.replicas.append({"c_half": c_half * f, "cap": max(1, round(cap * f)), "run": [], "wait": []})
        self.v0 = wl.v0 / s
        self.train_rate = wl.train_tokens_per_s_per_gpu * train_gpus * f / s
        self.update_s = wl.update_weights_s
        self.peak = sum(r["cap"] * self.v0 / (1 + r["cap"] / r["c_half"]) for r in self.replicas)
        self.max_tokens = wl.max_new_tokens // s
        self.traj_sigma = wl.traj_sigma
        self.rng = np.random.default_rng(run.seed)
        self.learner = Learner(lr=0.02 * run.lr_scale)
        self.buf = buffer.PipelineServer(self.cfg, [self.task.prompts()], collector_thread=False)
        self.action = self.buf.action
        self.fa = self.cfg.fully_async.enable
        self.mask = self.cfg.rollout.mask_offpolicy_in_partial_rollout
        self.loss_fn = losses.POLICY_LOSSES[self.cfg.algorithm.policy_loss]
        self.now, self.version = 0.0, 0
        self.reqs: dict = {}  # (key, index) -> Req of groups in flight that are still generating
        self.generated_tokens = 0
        self.dispatched: dict = {}  # prompt id -> (difficulty, natural lengths) of every group dispatched
        self.trained_L, self.trained_d = [], []
        self.stale_tokens: dict = {}  # token staleness -> count
        self.ess, self.kl_train, self.kl_step = [], [], []
        self.curve = [{"step": 0, "time": 0.0, "samples": 0, "eval": self.evaluate(0)}]
        self.counts: dict = {}
        self.gen_paused = False  # no decoding (the weight update)
        self.dispatching = True  # the producer may dispatch (not between the pause and the resume)

    # ---- the fleet ----
    def length(self, epoch: int, row: int, index: int) -> int:
        r = random.Random(hash((self.run.seed, epoch, row, index)))
        L = math.exp(r.gauss(math.log(self.task.median[row]), self.traj_sigma))
        return int(min(self.max_tokens, max(1, L)))

    def rate(self, rep: dict) -> float:
        return self.v0 / (1 + len(rep["run"]) / rep["c_half"])

    def submit(self, req: Req) -> None:
        rep = min(self.replicas, key=lambda r: len(r["run"]) + len(r["wait"]))
        req.replica = rep
        (rep["run"] if len(rep["run"]) < rep["cap"] else rep["wait"]).append(req)
        self.reqs[(req.key, req.index)] = req

    def dispatch(self) -> None:
        for pg in self.buf.dispatch():
            lengths = [self.length(pg.epoch, pg.data_index, i) for i in range(N)]
            self.dispatched[pg.prompt_id] = (int(self.task.difficulty[pg.data_index]), lengths)
            for i in range(N):
                prior = pg.partial[i] if pg.partial else None
                L = lengths[i]
                if prior is not None and prior.status != buffer.ABORTED:
                    self.buf.put([prior])  # finished before the pause: handed back unchanged
                    continue
                p = None if prior is None or prior.response_ids.numel() == 0 else (
                    prior.response_ids.tolist(), prior.rollout_log_probs.tolist(), prior.versions.tolist())
                self.submit(Req(pg, i, L, p))

    def materialize(self, req: Req) -> None:
        """Draw the tokens generated since the last call, all under the current weights."""
        n = min(req.L, int(req.done + 1e-9)) - len(req.acts)
        if n <= 0:
            return
        p = self.learner.probs(self.version, self.task.x[req.row])
        a = self.rng.choice(V, size=n, p=p)
        req.acts += a.tolist()
        req.logp += np.log(p[a]).tolist()
        req.vers += [self.version] * n
        self.generated_tokens += n

    def trajectory(self, req: Req, status: str) -> buffer.Trajectory:
        ids = torch.tensor(req.acts, dtype=torch.long)
        t = buffer.Trajectory(req.epoch, req.seq, req.index, torch.tensor([req.row]), response_ids=ids,
                              rollout_log_probs=torch.tensor(req.logp, dtype=torch.float32),
                              versions=torch.tensor(req.vers, dtype=torch.long),
                              loss_mask=torch.ones(len(req.acts), dtype=torch.long), status=status)
        if req.acts:
            t.start_version, t.end_version = req.vers[0], req.vers[-1]
            t.reward = float(np.mean(np.asarray(req.acts) == self.task.label[req.row]))
        if status != buffer.ABORTED and self.mask and t.start_version != t.end_version:
            t.loss_mask = losses.offpolicy_token_mask(t.versions[None], t.loss_mask[None])[0]
        return t

    def remove(self, req: Req) -> None:
        rep = req.replica
        if req in rep["run"]:
            rep["run"].remove(req)
        else:
            rep["wait"].remove(req)
        del self.reqs[(req.key, req.index)]
        while rep["wait"] and len(rep["run"]) < rep["cap"]:
            rep["run"].append(rep["wait"].pop(0))

    def next_finish(self) -> float:
        if self.gen_paused:
            return math.inf
        best = math.inf
        for rep in self.replicas:
            if rep["run"]:
                best = min(best, min(r.L - r.done for r in rep["run"]) / self.rate(rep))
        return self.now + best

    def advance(self, t: float) -> None:
        dt = t - self.now
        if dt > 0 and not self.gen_paused:
            for rep in self.replicas:
                v = self.rate(rep) * dt
                for r in rep["run"]:
                    r.done = min(r.L, r.done + v)
        self.now = t
        done = [r for rep in self.replicas for r in rep["run"] if r.done >= r.L - 1e-6]
        for r in done:
            r.done = r.L
            self.materialize(r)
            self.remove(r)
            self.buf.put([self.trajectory(r, buffer.COMPLETED)])
        if done and self.dispatching:
            self.dispatch()

    def abort(self, keys: Optional[set] = None) -> list:
        out = []
        for req in list(self.reqs.values()):
            if keys is None or req.key in keys:
                self.materialize(req)
                self.remove(req)
                out.append(self.trajectory(req, buffer.ABORTED))
        return out

    # ---- the trainer ----
    def wait_for(self, pred) -> None:
        while not pred():
            t = self.next_finish()
            if t == math.inf:
                raise RuntimeError(f"{self.run.name}: nothing generating and the trainer waits (stall at step "
                                   f"{self.version}: {self.buf.stats()})")
            self.advance(t)

    def spend(self, seconds: float) -> None:
        end = self.now + seconds
        while True:
            t = self.next_finish()
            if t > end:
                break
            self.advance(t)
        self.advance(end)

    def train_call(self, groups: list) -> None:
        trajs = [t for g in groups for t in g.trajectories]
        T = max(1, max(t.response_ids.numel() for t in trajs))
        n = len(trajs)
        acts = torch.zeros(n, T, dtype=torch.long)
        mu = torch.zeros(n, T, dtype=torch.float64)
        vers = torch.full((n, T), -1, dtype=torch.long)
        mask = torch.zeros(n, T)
        for i, t in enumerate(trajs):
            k = t.response_ids.numel()
            acts[i, :k], mu[i, :k], vers[i, :k], mask[i, :k] = (t.response_ids, t.rollout_log_probs.double(),
                                                                t.versions, t.loss_mask.float())
            lag = self.version - t.versions
            for s, c in zip(*np.unique(lag.numpy(), return_counts=True)):
                self.stale_tokens[int(s)] = self.stale_tokens.get(int(s), 0) + int(c)
            self.trained_L.append(k)
        self.trained_d += [int(self.task.difficulty[g.prompt.data_index]) for g in groups]
        x = torch.as_tensor(self.task.x[[g.prompt.data_index for g in groups for _ in g.trajectories]])
        rewards = torch.tensor([[t.reward for t in g.trajectories] for g in groups])
        adv = losses.compute_advantages(rewards).reshape(-1)
        W_old = torch.as_tensor(self.learner.versions[self.version])
        old = torch.log_softmax(x @ W_old.T, -1).gather(1, acts)
        lp = torch.log_softmax(x @ self.learner.W.T, -1).gather(1, acts)
        live = mask > 0
        w = torch.where(live, (old - mu).exp(), 0.0)
        self.ess.append(float(w.sum() ** 2 / (live.sum().clamp(min=1) * (w ** 2).sum()).clamp(min=1e-12)))
        algo = self.cfg.algorithm
        denom = losses.loss_denominator(mask, algo.loss_agg_mode)
        # as actor.micro_batch_loss calls it: old_log_probs are the step-start snapshot's (mu under
        # trainer.use_rollout_log_probs), current_version the version this step's update produces
        pi_old = mu if self.cfg.trainer.use_rollout_log_probs else old
        loss, m = self.loss_fn(losses.TokenBatch(lp, pi_old, mu, adv, mask, vers, self.version + 1), algo, denom)
        if "train/approx_kl" in m:
            self.kl_train.append(float(m["train/approx_kl"]))
        self.learner.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([self.learner.W], 1.0)
        self.learner.opt.step()
        self.spend(sum(t.response_ids.numel() for t in trajs) / self.train_rate)

    def evaluate(self, v: int) -> float:
        p = self.learner.probs(v, self.task.eval_x)
        return float(p[np.arange(len(p)), self.task.eval_label].mean())

    def step_kl(self, v: int) -> float:
        p, q = self.learner.probs(v - 1, self.task.eval_x), self.learner.probs(v, self.task.eval_x)
        return float((p * (np.log(p) - np.log(q))).sum(-1).mean())

    def boundary(self) -> None:
        """rollout.pause + buffer.step_boundary with the rule's update-time action, then the weight update."""
        a = self.action
        self.dispatching = False
        if not self.fa:
            self.buf.step_boundary(self.abort())
        elif a.pause == "drain":
            self.gen_paused = False
            self.wait_for(lambda: not self.reqs)
            self.buf.step_boundary([])
        elif a.pause in ("in_place", "retract"):
            keys = {tuple(k) for k in self.buf.boundary_aborts(staleness.Boundary.KEEP)}
            self.buf.step_boundary(self.abort(keys) if keys else [], staleness.Boundary.KEEP)
        else:
            self.buf.step_boundary(self.abort())
        for k, v in self.buf.step_metrics().items():
            if isinstance(v, (int, float)) and k.endswith(("drop", "discarded_tokens", "restarted_groups",
                                                           "update_dropped_groups", "samples_too_old")):
                self.counts[k] = self.counts.get(k, 0) + v
        for req in self.reqs.values():  # tokens so far are the old weights' (kept in place: the rest the new ones')
            self.materialize(req)
        self.gen_paused = True
        self.spend(self.update_s)
        self.learner.snapshot()
        self.version += 1
        self.buf.set_weight_version(self.version)
        self.gen_paused, self.dispatching = False, True
        self.dispatch()

    def train(self) -> dict:
        self.dispatch()
        samples, k = 0, M // N
        for step in range(self.run.steps):
            if not self.fa:
                self.wait_for(lambda: len(self.buf.pbuf) >= B)
            for _ in range(B // k):
                self.wait_for(lambda: len(self.buf.pbuf) >= k)
                groups = self.buf.get(k, timeout=0)
                self.dispatch()  # a consumed group frees a slot under the spec's capacity rule
                self.train_call(groups)
                samples += M
            self.boundary()
            self.kl_step.append(self.step_kl(self.version))
            self.curve.append({"step": step + 1, "time": self.now, "samples": samples,
                               "eval": self.evaluate(self.version)})
        return self.summary()

    def pending_tokens(self) -> int:
        n = sum(len(r.acts) for r in self.reqs.values())
        n += sum(t.response_ids.numel() for g in self.buf.pbuf.groups() for t in g.trajectories)
        n += sum(t.response_ids.numel() for pg in self.buf.data.lane for t in pg.partial)
        for key in list(self.buf._in_flight):
            n += sum(s.response_ids.numel() for s in self.buf.queue.slots(key) if s is not None)
        return n

    def summary(self) -> dict:
        trained = sum(self.trained_L)
        st = self.stale_tokens
        tot = sum(st.values()) or 1
        lengths = [L for _, ls in self.dispatched.values() for L in ls]
        ideal = max(B * N * np.mean(lengths) / self.peak, B * N * np.mean(lengths) / self.train_rate + self.update_s)
        return {**dataclasses.asdict(self.run), "name": self.run.name, "curve": self.curve,
                "generated_per_trained": (self.generated_tokens - self.pending_tokens()) / max(1, trained),
                "staleness_mean": sum(k * v for k, v in st.items()) / tot, "staleness_max": max(st, default=0),
                "staleness_hist": {str(k): v / tot for k, v in sorted(st.items())},
                "ess": float(np.mean(self.ess)), "ess_min": float(np.min(self.ess)),
                "kl_step": float(np.median(self.kl_step)), "kl_step_mean": float(np.mean(self.kl_step)),
                "approx_kl": float(np.mean(self.kl_train)) if self.kl_train else None,
                "trained_len": float(np.mean(self.trained_L)), "dispatched_len": float(np.mean(lengths)),
                "trained_difficulty": float(np.mean(self.trained_d)),
                "dispatched_difficulty": float(np.mean([d for d, _ in self.dispatched.values()])),
                "step_s": self.now / self.run.steps, "ideal_step_s": float(ideal), "counts": self.counts}


def simulate(run: Run) -> dict:
    torch.set_num_threads(1)
    t0 = time.process_time()
    try:
        out = Sim(run).train()
    except Exception as e:  # reported in the table, the grid goes on
        return {**dataclasses.asdict(run), "name": run.name, "error": f"{type(e).__name__}: {e}"}
    out["cpu_s"] = time.process_time() - t0
    return out


# ---------------------------------------------------------------------------------------------------------
# The grid, its figures and its table

def rules(only: Optional[list]) -> list[str]:
    names = ["sync", *SPEC_RULES, *strategies.PRESETS]
    return [r for r in names if not only or r in only]


def grid(args) -> list[Run]:
    out = []
    for split in SPLITS:
        for seed in range(args.seeds):
            for rule in rules(args.only):
                levels = [0] if rule == "sync" else [*args.levels, *([PRIME_RL_DEFAULT_M] if rule == "prime-rl"
                                                                     and not args.quick else [])]
                for k in levels:
                    out.append(Run(rule, k, split, seed, steps=args.steps, lr_scale=args.lr_scale))
            if args.loss_factor:
                for lr in args.loss_lr_scales:
                    for rule in [r for r in ("areal", "pipelinerl") if not args.only or r in args.only]:
                        for loss in LOSSES:
                            if loss != own_loss(rule) or lr != args.lr_scale:
                                out.append(Run(rule, max(args.levels), split, seed, loss, args.steps, lr))
    return out


def to_target(r: dict, target: float) -> tuple[float, float, float]:
    """(steps, simulated s, samples) when the eval first reached the target; inf where it never did."""
    for c in r["curve"]:
        if c["eval"] >= target:
            return c["step"], c["time"], c["samples"]
    return math.inf, math.inf, math.inf


T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def ci(xs: list) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval over seeds (inf when a seed missed)."""
    xs = [float(x) for x in xs]
    if not xs or any(math.isinf(x) or math.isnan(x) for x in xs):
        return math.inf, math.inf
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return m, T975.get(len(xs) - 1, 1.96) * sd / math.sqrt(len(xs))


def cells(results: list[dict], target: float) -> list[dict]:
    """One row per (split, rule, level, loss, lr scale): the seeds' means and 95% half-widths. The "paired" figures
    divide each seed's samples / time to the target by those of sync on the same seed and split (same task), which
    takes the task-to-task spread out of the comparison; the "loss" ones by those of the rule's own loss with the same
    rule, level, learning rate and seed."""
    ref = {(r["split"], r["seed"]): to_target(r, target) for r in results
           if "error" not in r and r["rule"] == "sync" and r["loss"] == own_loss("sync")}
    ref_loss = {(r["split"], r["seed"], r["rule"], r["level"], r["lr_scale"]): to_target(r, target) for r in results
                if "error" not in r and r["loss"] == own_loss(r["rule"])}
    by: dict = {}
    for r in results:
        by.setdefault((r["split"], r["rule"], r["level"], r["loss"], r["lr_scale"]), []).append(r)
    out = []
    for (split, rule, level, loss, lr), rs in by.items():
        ok = [r for r in rs if "error" not in r]
        row = {"split": split, "rule": rule, "level": level, "loss": loss, "lr_scale": lr, "seeds": len(ok),
               "errors": [r["error"] for r in rs if "error" in r]}
        if ok:
            tt = [to_target(r, target) for r in ok]
            for name, vals in (("steps", [t[0] for t in tt]), ("time", [t[1] for t in tt]),
                               ("samples", [t[2] for t in tt]), ("final", [r["curve"][-1]["eval"] for r in ok]),
                               ("step_s", [r["step_s"] for r in ok]), ("gen_per_trained",
                                                                     [r["generated_per_trained"] for r in ok]),
                               ("stale_mean", [r["staleness_mean"] for r in ok]), ("ess", [r["ess"] for r in ok]),
                               ("kl_step", [r["kl_step"] for r in ok]),
                               ("tokens_per_s", [B * N * r["trained_len"] / r["step_s"] for r in ok])):
                row[name] = ci(vals)
            base = [ref.get((r["split"], r["seed"])) for r in ok]
            if all(b is not None and not math.isinf(b[1]) for b in base):
                row["samples_x"] = ci([t[2] / b[2] for t, b in zip(tt, base)])
                row["time_x"] = ci([t[1] / b[1] for t, b in zip(tt, base)])
            base = [ref_loss.get((r["split"], r["seed"], r["rule"], r["level"], r["lr_scale"])) for r in ok]
            if all(b is not None and not math.isinf(b[1]) for b in base):
                row["loss_samples_x"] = ci([t[2] / b[2] for t, b in zip(tt, base)])
                row["loss_time_x"] = ci([t[1] / b[1] for t, b in zip(tt, base)])
            row["missed"] = sum(math.isinf(t[0]) for t in tt)
            row["stale_max"] = max(r["staleness_max"] for r in ok)
            row["ideal_step_s"] = float(np.mean([r["ideal_step_s"] for r in ok]))
            for k in ("trained_len", "dispatched_len", "trained_difficulty", "dispatched_difficulty"):
                row[k] = float(np.mean([r[k] for r in ok]))
        out.append(row)
    return out


def _pm(c, fmt="{:.0f}") -> str:
    m, h = c
    return "missed" if math.isinf(m) else f"{fmt.format(m)} +- {fmt.format(h)}"


def table(rows: list[dict], target: float) -> str:
    cols = ["split", "rule", "k", "loss", "lr x", f"steps to {target}", f"sim time to {target} (s)",
            "samples to target", "eval at end", "step (s) / ideal", "generated / trained tokens",
            "token staleness mean / max", "IS ESS", "KL per step (x1e-3)", "trained vs dispatched: length, difficulty",
            "paired vs sync: samples x, time x", "paired vs the rule's own loss: samples x"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] * len(cols)) + "|"]
    for r in rows:
        if not r["seeds"]:
            lines.append(f"| {r['split']} | {r['rule']} | {r['level']} | {r['loss']} | {r['lr_scale']:g} | failed: "
                         f"{r['errors'][0]} |" + " - |" * (len(cols) - 6))
            continue
        miss = f" ({r['missed']} missed)" if r["missed"] else ""
        lines.append("| " + " | ".join([
            r["split"].split()[0], r["rule"], str(r["level"]), r["loss"], f"{r['lr_scale']:g}",
            _pm(r["steps"], "{:.1f}") + miss,
            _pm(r["time"]), _pm(r["samples"]), _pm(r["final"], "{:.3f}"),
            f"{r['step_s'][0]:.0f} / {r['ideal_step_s']:.0f}", _pm(r["gen_per_trained"], "{:.3f}"),
            f"{r['stale_mean'][0]:.2f} / {r['stale_max']}", _pm(r["ess"], "{:.3f}"),
            f"{r['kl_step'][0] * 1e3:.2f}",
            f"{r['trained_len']:.1f} vs {r['dispatched_len']:.1f}, {r['trained_difficulty']:.2f} vs "
            f"{r['dispatched_difficulty']:.2f}",
            f"{_pm(r['samples_x'], '{:.2f}')}, {_pm(r['time_x'], '{:.2f}')}" if "samples_x" in r else "-",
            _pm(r["loss_samples_x"], "{:.2f}") if "loss_samples_x" in r else "-"]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], split: str, target: float, path: str, lr_scale: float = 1.0) -> None:
    """Left: every rule and level with its own loss; right: the loss factor at the loosest level (colour = loss,
    marker = rule, hollow = the larger learning rate). Means of the seeds with 95% intervals on both axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(17, 7))
    tab = plt.get_cmap("tab10").colors
    colors = {n: tab[i % 10] for i, n in enumerate(rules(None))}
    loss_colors = {n: tab[i % 10] for i, n in enumerate(LOSSES)}
    level_markers, rule_markers = {0: "*", 1: "o", 2: "s", 4: "^", 8: "D"}, {"areal": "o", "pipelinerl": "s"}
    here = [r for r in rows if r["split"] == split and r["seeds"]]
    kmax = max((r["level"] for r in here if r["rule"] in rule_markers), default=0)
    missed = {"a": [], "b": []}
    for r in here:
        left = r["loss"] == own_loss(r["rule"]) and r["lr_scale"] == lr_scale
        right = r["level"] == kmax and r["rule"] in rule_markers
        for ax, side, on in ((a, "a", left), (b, "b", right)):
            if not on:
                continue
            tag = f"{r['rule']} k={r['level']}" if side == "a" else f"{r['rule']} {r['loss']} lr x{r['lr_scale']:g}"
            xk, yk = ("samples_x", "time_x") if side == "a" else ("loss_samples_x", "loss_time_x")
            if yk not in r or math.isinf(r[yk][0]):
                missed[side].append(tag + f" ({r['missed']}/{r['seeds']} missed)")
                continue
            style = dict(fmt=level_markers.get(r["level"], "o"), color=colors.get(r["rule"], "k")) if side == "a" else \
                dict(fmt=rule_markers[r["rule"]], color=loss_colors.get(r["loss"], "k"))
            hollow = side == "b" and r["lr_scale"] != lr_scale
            ax.errorbar(r[xk][0], r[yk][0], xerr=r[xk][1], yerr=r[yk][1],
                        capsize=3, ms=7, label=tag, mfc="none" if hollow else None, **style)
    for ax, side, title, ref in ((a, "a", f"every rule x k, each with its own loss (lr x{lr_scale:g})", "sync's"),
                                 (b, "b", f"the loss factor at k = {kmax} (hollow: the larger learning rate)",
                                  "the rule's own loss's (same lr)")):
        ax.set_xlabel(f"trained samples to eval {target}, / {ref} on the same seed (left = more sample-efficient)")
        ax.set_ylabel(f"simulated time to eval {target}, / {ref} on the same seed")
        ax.axvline(1, color="k", linewidth=0.6, linestyle=":")
        ax.axhline(1, color="k", linewidth=0.6, linestyle=":")
        if missed[side]:
            title += "\nnever reached: " + "; ".join(missed[side])
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(alpha=0.3)
    fig.suptitle(f"bench/learning_sim.py, {split}: paired ratios to sync (same seed = same task), means of the seeds "
                 "with 95% intervals (left markers: * sync, o k=1, s k=2, ^ k=4, D prime-rl M=8)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_throughput(rows: list[dict], path: str, lr_scale: float = 1.0) -> None:
    """Trained tokens per simulated second against the measured token staleness, a line per rule through its levels
    (its own loss), one panel per split, 95% intervals over the seeds; the dotted line is the split's one ideal."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(SPLITS), figsize=(7.5 * len(SPLITS), 6), squeeze=False)
    tab = plt.get_cmap("tab10").colors
    for ax, split in zip(axes[0], SPLITS):
        here = [r for r in rows if r["split"] == split and r["seeds"] and r["loss"] == own_loss(r["rule"])
                and r["lr_scale"] == lr_scale]
        for i, name in enumerate(rules(None)):
            pts = sorted((r for r in here if r["rule"] == name), key=lambda r: r["level"])
            if not pts:
                continue
            ax.errorbar([r["stale_mean"][0] for r in pts], [r["tokens_per_s"][0] for r in pts],
                        xerr=[r["stale_mean"][1] for r in pts], yerr=[r["tokens_per_s"][1] for r in pts],
                        fmt="*" if name == "sync" else "-o", ms=12 if name == "sync" else 5, capsize=3,
                        color=tab[i % 10], label=name)
            for r in pts:
                ax.annotate(f"k{r['level']}", (r["stale_mean"][0], r["tokens_per_s"][0]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        if here:
            ideal = B * N * float(np.mean([r["dispatched_len"] for r in here])) / float(
                np.mean([r["ideal_step_s"] for r in here]))
            ax.axhline(ideal, color="k", linestyle=":", linewidth=1)
            ax.text(0.02, ideal, "the split's ideal", fontsize=7, va="bottom", transform=ax.get_yaxis_transform())
        ax.set_xlabel("measured token staleness, mean (trainer version - the token's version)")
        ax.set_ylabel("trained tokens per simulated second (scaled tokens)")
        ax.set_title(split, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("bench/learning_sim.py: throughput against measured staleness, every rule over k = 1, 2, 4 "
                 "(means of the seeds, 95% intervals)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rules x k 1,4, one split, 1 seed, 12 steps")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--levels", default="1,2,4")
    ap.add_argument("--only", default=None, help="comma-separated rules (sync, the spec's three, the presets)")
    ap.add_argument("--no-loss-factor", dest="loss_factor", action="store_false")
    ap.add_argument("--lr-scale", type=float, default=1.0, help="x the learning rate (per-step KL grows ~ its square)")
    ap.add_argument("--loss-lr-scales", default="1,4", help="learning-rate scales of the loss factor runs")
    ap.add_argument("--target", type=float, default=None,
                    help="eval reward whose first crossing is timed (default 0.6; --quick 0.45)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--replot", default=None, help="redo the table and figures from this --json file, no runs")
    ap.add_argument("--png-dir", default=None, help="one figure per split here (default: none)")
    args = ap.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    args.loss_lr_scales = [float(x) for x in args.loss_lr_scales.split(",")]
    args.only = args.only.split(",") if args.only else None
    if args.quick:
        args.steps, args.seeds, args.levels, args.loss_factor = 12, 1, [1, 4], False
        args.only = args.only or ["sync", "windowed-fifo", "areal"]
    args.target = args.target or (0.45 if args.quick else 0.6)
    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)["runs"]
        for r in results:
            r["level"], r["lr_scale"] = int(r["level"]), float(r["lr_scale"])
        return report(results, args, time.monotonic())
    plan = grid(args)
    if args.quick:
        plan = [r for r in plan if r.split == next(iter(SPLITS))]
    t0 = time.monotonic()
    print(SIMULATION_NOTE, flush=True)
    print(f"{len(plan)} runs of {args.steps} steps on {args.workers} workers; load average {os.getloadavg()[0]:.1f}",
          flush=True)
    if args.workers > 1:
        with mp.get_context("fork").Pool(args.workers) as pool:
            results = pool.map(simulate, plan, chunksize=1)
    else:
        results = [simulate(r) for r in plan]
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump({"runs": results}, f, indent=1, default=str)
    return report(results, args, t0)


def report(results: list[dict], args, t0: float) -> int:
    rows = cells(results, args.target)
    print(table(rows, args.target))
    kl = [r["kl_step"] for r in results if "error" not in r]
    print(f"per-step KL(pi_v || pi_v+1) per token over all runs: median {np.median(kl):.2e}, "
          f"range {min(kl):.2e}-{max(kl):.2e}")
    if args.png_dir:
        for split in SPLITS:
            path = os.path.join(args.png_dir, f"learning_sim_{split.split()[0]}.png")
            plot(rows, split, args.target, path, args.lr_scale)
            print(f"figure: {path}")
        path = os.path.join(args.png_dir, "learning_sim_throughput.png")
        plot_throughput(rows, path, args.lr_scale)
        print(f"figure: {path}")
    cpu = sum(r.get("cpu_s", 0.0) for r in results)
    print(f"wall time: {time.monotonic() - t0:.0f} s ({cpu:.0f} CPU s in the runs); load average at the end "
          f"{os.getloadavg()[0]:.1f}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
