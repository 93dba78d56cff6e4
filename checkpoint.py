"""checkpoint.py: a run's checkpoints, run_dir/checkpoints/step_NNNNNN/: the sharded model and optimizer by
torch.distributed.checkpoint (DCP, every rank writes its shards) and run_state.pt (rank 0: the step, the weight
version, the buffer's state, the LR scheduler and every rank's RNG state). A directory is written as .tmp and
renamed once complete (commit), so one without ".tmp" always loads; latest_checkpoint finds the newest that does.
The final model as an HF checkpoint directory is hf_export.py's.
"""
from __future__ import annotations

import glob
import os
import random
import shutil
import sys
from typing import Optional

import torch
import torch.distributed as dist


def save(model, opt, sched, root: str, steps_done: int, run_state: Optional[dict], group) -> None:
    """Every rank: its model and optimizer shards (DCP) to root/step_NNNNNN, its RNG state to rank 0, which commits
    the directory with run_state (given on rank 0: step, weight_version, buffer) plus the scheduler and the RNGs.
    group: the gloo group for the barriers and the RNG gather."""
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(root, f"step_{steps_done:06d}")
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier(group=group)
    dcp.save(_state(model, opt)[0], checkpoint_id=tmp)
    rng: list = [None] * world
    dist.all_gather_object(rng, rng_state(), group=group)
    if rank == 0:
        commit(tmp, path, {**run_state, "scheduler": sched.state_dict(), "rng": rng})
    dist.barrier(group=group)


def load(model, opt, sched, path: str) -> dict:
    """Every rank: model, optimizer, scheduler and this rank's RNG state from the checkpoint `path` (a run with
    more ranks than the checkpoint's takes rank 0's RNG); returns the run state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state, aliases = _state(model, opt)
    dcp.load(state, checkpoint_id=path)
    state["model"].update({alias: state["model"][name] for alias, name in aliases.items()})
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    run_state = load_run_state(path)
    sched.load_state_dict(run_state["scheduler"])
    rank = dist.get_rank()
    set_rng_state(run_state["rng"][rank] if rank < len(run_state["rng"]) else run_state["rng"][0])
    return run_state


def _state(model, opt) -> tuple[dict, dict]:
    """({"model", "optim"}: this rank's shards as DCP saves and loads them, a tied parameter under its first name
    only; the tied aliases)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    aliases = tied_aliases(model)
    return {"model": {k: v for k, v in model_sd.items() if k not in aliases}, "optim": optim_sd}, aliases


def tied_aliases(model) -> dict:
    """{name: the name it was first listed under} for a parameter the model lists under a second name: a tied
    lm_head is the input embedding (SmolLM2, the tiny model). get_state_dict lists it under both names, so a
    checkpoint would hold the embedding twice (SmolLM2-135M: 621 MiB instead of 513); it is saved once and
    loaded into both names."""
    first, out = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        first.setdefault(id(p), name)
    return out


def rng_state() -> dict:
    """This process's Python, torch and CUDA RNG states (run_state.pt keeps one per rank)."""
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def commit(tmp: str, path: str, run_state: dict) -> None:
    """Write run_state.pt into the finished directory `tmp` and rename it to `path`, each step on disk before the
    next (DCP fsyncs its own files): after a crash at any point, a directory without ".tmp" is complete."""
    with open(os.path.join(tmp, "run_state.pt"), "wb") as f:
        torch.save(run_state, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def load_run_state(path: str) -> dict:
    """run_state.pt of a checkpoint directory: plain data only (weights_only=True: loading runs no code)."""
    return torch.load(os.path.join(path, "run_state.pt"), weights_only=True)


def checkpoint_problem(path: str) -> Optional[str]:
    """Why the checkpoint directory `path` would not load, or None: run_state.pt unreadable, or the DCP shards
    (when there are any; rollout-only checkpoints have none) without their metadata or shorter than it says."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        load_run_state(path)
    except Exception as e:
        return f"run_state.pt does not load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not glob.glob(os.path.join(path, "*.distcp")) and not os.path.exists(os.path.join(path, ".metadata")):
        return None
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:
        return f"its DCP .metadata does not load: {type(e).__name__}: {e}"
    need: dict = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        have = os.path.getsize(os.path.join(path, name)) if os.path.exists(os.path.join(path, name)) else None
        if have is None or have < size:
            return f"shard {name} has {have or 0} bytes, its metadata expects {size}"
    return None


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest run_dir/checkpoints/step_* that loads (being written ones end in .tmp), or None. Newer ones
    that do not load are skipped with a warning naming each and why."""
    done = sorted((p for p in glob.glob(os.path.join(run_dir, "checkpoints", "step_*")) if not p.endswith(".tmp")),
                  reverse=True)
    for path in done:
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        print(f"[train] warning: skipping checkpoint {path}: {problem}; trying the previous one", file=sys.stderr,
              flush=True)
    return None


_MOVED = {n: f"checkpoint.{n} is now hf_export.{n}, the code weight_sync.py shares"
          for n in ("export_hf", "export_dtype", "full_parameter")}


def __getattr__(name: str):  # a name that moved is refused naming where it went
    raise AttributeError(_MOVED.get(name, f"module 'checkpoint' has no attribute '{name}'"))
