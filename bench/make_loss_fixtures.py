"""Writes tests/fixtures/peer_losses.json: the peers' own loss functions, at pinned versions, on seeded inputs.

tests/test_losses.py compares losses.py with these numbers (loss value, gradient w.r.t. log pi_theta, the metrics the
peer returns). The peers' code is imported from checkouts given on the command line, never copied here; run once
after a pin changes and commit the JSON. Pins (the test file names them too):
  AReaL      v1.0.4 (37d6c6400e99a05fa3409d6a067762a44df40d3b): areal/utils/functional/functional.py
             (ppo_actor_loss_fn, apply_rejection_sampling), areal/trainer/ppo/actor.py
             (compute_prox_logp_approximations, _apply_m2po_masking)
  PipelineRL 58d393458625ad63ed539f2dcd072c85700c557f: pipelinerl/finetune/rl/__init__.py (rl_step, policy_loss
             "reinforce") with conf/finetune/base.yaml's `rl` section (what every PipelineRL run starts from)

Checkouts: `git clone https://github.com/inclusionAI/AReaL && git -C AReaL checkout v1.0.4`, likewise PipelineRL at
its commit (or `git archive <commit>` of the same paths). Run:
  .venv/bin/python bench/make_loss_fixtures.py --areal AReaL --pipelinerl PipelineRL

Stubbed imports, each irrelevant to the numbers taken: every `areal.*` module but the three read here (the trainer
and engine classes, logging, stats_tracker, cli_args: RejectionSamplingConfig is only a type annotation in
functional.py, and the config passed in is a plain namespace with all six of its fields set; areal.utils.data's
KLEstimator serves only the kl_* metrics, not metric="ratio"); `pandas` and `datasets` for PipelineRL (its data
preparation, not rl_step). No package is installed: torch, pydantic and yaml are this project's venv's.

The M2PO repository (Infini-AI-Lab/M2PO af54a3e8feffb7a66a8258003aebefa37759cec0, verl/trainer/ppo/core_algos.py
compute_m2po_policy_loss) is not used: its code clips instead of masking (docs/algorithms.md, "m2po").
"""
from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import types
from types import SimpleNamespace

import torch

AREAL_PIN = "37d6c6400e99a05fa3409d6a067762a44df40d3b"  # v1.0.4
PIPELINERL_PIN = "58d393458625ad63ed539f2dcd072c85700c557f"
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                   "peer_losses.json")
SEED, B, T = 8, 6, 10


class _StubMeta(type):
    def __getattr__(cls, name):
        return _Stub


class _Stub(metaclass=_StubMeta):
    """Stands in for anything a stubbed module exports: a class to subclass, a decorator (returns the function),
    a logger, a constant used as a default."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    def __getattr__(self, name):
        return _Stub


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a _StubModule for every module under `prefixes` except those named in `real`."""

    def __init__(self, prefixes: tuple, real: set):
        self.prefixes, self.real = prefixes, real

    def find_spec(self, fullname, path, target=None):
        if fullname in self.real or not fullname.startswith(self.prefixes):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def _package(name: str, path: str) -> None:
    """An empty package whose submodules load from `path` (its __init__.py, which imports the world, is skipped)."""
    m = types.ModuleType(name)
    m.__path__ = [path]
    sys.modules[name] = m


def _check_pin(root: str, pin: str, who: str) -> None:
    if os.path.isdir(os.path.join(root, ".git")):
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        if head != pin:
            sys.exit(f"{who} checkout {root} is at {head}, the fixtures pin {pin}: check it out first")


def load_areal(root: str):
    _check_pin(root, AREAL_PIN, "AReaL")
    real = {"areal.utils.functional.functional", "areal.utils.constants", "areal.trainer.ppo.actor"}
    for pkg in ("areal", "areal.utils", "areal.utils.functional", "areal.trainer", "areal.trainer.ppo"):
        _package(pkg, os.path.join(root, *pkg.split(".")))
    sys.meta_path.insert(0, _StubFinder(("areal",), real | {"areal", "areal.utils", "areal.utils.functional",
                                                             "areal.trainer", "areal.trainer.ppo"}))
    functional = importlib.import_module("areal.utils.functional.functional")
    for name in ("ppo_actor_loss_fn", "reward_overlong_penalty", "sapo_loss_fn"):
        setattr(sys.modules["areal.utils.functional"], name, getattr(functional, name))
    actor = importlib.import_module("areal.trainer.ppo.actor")
    return functional, actor


def load_pipelinerl(root: str):
    _check_pin(root, PIPELINERL_PIN, "PipelineRL")
    sys.meta_path.insert(0, _StubFinder(("pandas", "datasets"), set()))
    sys.path.insert(0, root)
    rl = importlib.import_module("pipelinerl.finetune.rl")
    import yaml

    with open(os.path.join(root, "conf", "finetune", "base.yaml")) as f:
        section = dict(yaml.safe_load(f)["rl"])
    section["final_kl_coef"] = section["kl_coef"]  # the YAML's ${..rl.kl_coef} interpolation, resolved
    section["temperature"] = 1.0  # ${...llm.parameters.temperature}: the stand-in model's logits are at T = 1
    return rl, section


def inputs():
    """Seeded inputs with spread enough that PPO's clip (both sides), dual clip, AReaL's cap 5 on pi_prox / mu,
    M2PO's tau 0.04 and PipelineRL's truncation all bind. float64; log-probs < 0."""
    g = torch.Generator().manual_seed(SEED)
    spread = torch.tensor([0.2, 0.5, 1.0, 1.5, 0.3, 2.0], dtype=torch.float64).unsqueeze(-1)
    mu = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4 - 2.0
    prox = (mu + torch.randn(B, T, generator=g, dtype=torch.float64) * spread).clamp(max=-0.01)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    jump = torch.zeros(B, T, dtype=torch.float64)
    jump[:, 1:3] = 2.0 * (adv < 0).double().unsqueeze(-1)  # A < 0 and pi_theta / pi_prox ~ e^2: dual clip binds
    lp = (prox + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 + jump).clamp(max=-0.01)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True  # every sequence has a loss token
    versions = torch.randint(0, 6, (B, T), generator=g)
    return {"rollout_log_probs": mu, "old_log_probs": prox, "log_probs": lp, "advantages": adv, "loss_mask": mask,
            "versions": versions, "current_version": 6}


def rs_config(action: str, upper: float):
    return SimpleNamespace(level="token", action=action, metric="ratio", agg="mean", upper=upper, lower=None)


def _listed(x: torch.Tensor):
    return x.detach().double().tolist() if x.dtype.is_floating_point else x.tolist()


def areal_case(functional, x: dict, prox: torch.Tensor, loss_mask: torch.Tensor, **kw) -> dict:
    """ppo_actor_loss_fn on x, with pi_prox = prox; the AReaL loss, its gradient and counts from its stats."""
    lp = x["log_probs"].clone().requires_grad_()
    adv = x["advantages"].unsqueeze(-1).expand_as(lp)
    loss, stat = functional.ppo_actor_loss_fn(logprobs=lp, proximal_logprobs=prox, old_logprobs=x["rollout_log_probs"],
                                              advantages=adv, loss_mask=loss_mask, **kw)
    loss.backward()
    clip = stat["clip_mask"]
    out = {"loss": float(loss.detach()), "grad": _listed(lp.grad), "loss_mask_in": _listed(loss_mask),
           "clipped_high": int((clip & (adv > 0)).sum()), "clipped_low": int((clip & (adv < 0)).sum()),
           "dual_clipped": int(stat["dual_clip_mask"].sum())}
    if "behave_mask" in stat:
        behave = stat["behave_mask"]
        out.update(behave_kept=int(behave.sum()), filtered_fraction=float(stat["filtered_fraction"]),
                   behave_imp_weight_mean=float(stat["behave_imp_weight"][behave].mean()))
    return out


def pipelinerl_case(rl, section: dict, x: dict) -> dict:
    """rl_step with a stand-in model whose logits (2-token vocabulary) give exactly the fixture's log pi_theta at
    the sampled token, so its gradient w.r.t. those log-probs is rl_step's own."""
    lp = x["log_probs"].clone().requires_grad_()
    config = rl.RLConfig(**section)
    config.batch_size = B  # finetune_loop: samples_per_step, the sequences of one optimizer step

    class Model:
        def __call__(self, **inputs):
            x0 = lp - torch.log(-torch.expm1(lp))  # log p(token 0) = x0 - logsumexp(x0, 0) = lp
            logits = torch.stack([x0, torch.zeros_like(x0)], -1)
            return SimpleNamespace(logits=torch.cat([logits, torch.zeros(B, 1, 2, dtype=lp.dtype)], 1))

    def shifted(v):  # position t + 1 holds token t's value (rl_step drops position 0)
        return torch.cat([torch.zeros(B, 1, dtype=v.dtype), v], 1)

    labels = torch.where(shifted(x["loss_mask"].long()) > 0, 0, -100)
    labels[:, 0] = -100
    ones = torch.ones(B, T + 1, dtype=lp.dtype)
    batch = SimpleNamespace(
        input_ids=torch.zeros(B, T + 1, dtype=torch.long), attention_mask=torch.ones(B, T + 1, dtype=torch.long),
        labels=labels, is_packed=False, rewards=ones * 0, ref_logprobs=shifted(x["log_probs"]),
        old_logprobs=shifted(x["rollout_log_probs"]), group_tokens=ones, num_labels=ones,  # num_labels: stats only
        overflow=ones * 0, advantages=x["advantages"].unsqueeze(-1).expand(B, T + 1).clone())
    loss, stats = rl.rl_step(Model(), batch, 0, 1, config)
    loss.backward()
    return {"loss": float(loss.detach()), "grad": _listed(lp.grad), "config": {k: getattr(config, k) for k in (
                "policy_loss", "epsilon_high", "kl_coef", "entropy_bonus")}, "batch_size": B,
            "truncated_tokens": stats["clamp_log_ratio_new_old_indicator"]}  # num_labels = 1: a count of tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--areal", required=True, help="AReaL checkout at v1.0.4")
    p.add_argument("--pipelinerl", required=True, help=f"PipelineRL checkout at {PIPELINERL_PIN}")
    p.add_argument("--out", default=OUT)
    a = p.parse_args(argv)
    functional, actor = load_areal(os.path.abspath(a.areal))
    rl, section = load_pipelinerl(os.path.abspath(a.pipelinerl))
    x = inputs()
    mask, mu, lp = x["loss_mask"], x["rollout_log_probs"], x["log_probs"]
    clip = dict(eps_clip=0.2, eps_clip_higher=0.28)
    loglinear = actor.compute_prox_logp_approximations(old_logp=mu, logprobs=lp, versions=x["versions"],
                                                       current_version=x["current_version"],
                                                       method="loglinear")["loglinear"]
    tau = 0.04
    cases = {
        # decoupled PPO as AReaL's paper: behaviour weight pi_prox / mu, tokens above the cap 5 masked
        "decoupled_ppo_mask": areal_case(functional, x, x["old_log_probs"], mask, c_clip=3.0,
                                         rejection_sampling=rs_config("mask", 5.0), **clip),
        # AReaL's other action: the weight clamped at the cap, every token kept
        "decoupled_ppo_clamp": areal_case(functional, x, x["old_log_probs"], mask, c_clip=3.0,
                                          rejection_sampling=rs_config("clamp", 5.0), **clip),
        # AReaL 1.0.4's default, rejection_sampling None: no behaviour weight at all
        "decoupled_ppo_none": areal_case(functional, x, x["old_log_probs"], mask, c_clip=None, **clip),
        "loglinear_mask": areal_case(functional, x, loglinear, mask, c_clip=None,
                                     rejection_sampling=rs_config("mask", 5.0), **clip),
        # AReaL's M2PO (m2_threshold): the mask of (log mu - log pi_prox)^2, then the PPO clip around pi_prox
        "m2_mask_ppo": areal_case(functional, x, x["old_log_probs"],
                                  actor._apply_m2po_masking(mu, x["old_log_probs"], mask, tau), c_clip=None, **clip),
        # M2PO's paper: the mask of (log pi_theta - log mu)^2 and the ratio pi_theta / mu, no clip (eps 1e9)
        "m2po": areal_case(functional, x, mu, actor._apply_m2po_masking(mu, lp, mask, tau), c_clip=None,
                           eps_clip=1e9),
        "truncated_is": pipelinerl_case(rl, section, x),
    }
    cases["loglinear_mask"]["proximal_log_probs"] = _listed(loglinear)
    data = {
        "pins": {"AReaL": f"v1.0.4 {AREAL_PIN}", "PipelineRL": PIPELINERL_PIN},
        "generated_by": "bench/make_loss_fixtures.py",
        "settings": {"clip_low": 0.2, "clip_high": 0.28, "dual_clip_c": 3.0, "behav_imp_weight_cap": 5.0,
                     "m2po_tau": tau, "truncated_is_epsilon_high": cases["truncated_is"]["config"]["epsilon_high"]},
        "inputs": {k: (v if isinstance(v, int) else _listed(v)) for k, v in x.items()},
        "cases": cases,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1)
    for name, c in cases.items():
        print(f"{name:22s} loss {c['loss']:+.8f}", {k: v for k, v in c.items() if isinstance(v, (int, float))
                                                     and k != "loss"})
    print("wrote", a.out)


if __name__ == "__main__":
    main()
