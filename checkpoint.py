"""checkpoint.py: a run's checkpoints, run_dir/checkpoints/step_NNNNNN/: the sharded model and optimizer by
torch.distributed.checkpoint (DCP, every rank writes its shards) and run_state.pt (rank 0: the step, the weight
version, the buffer's state, the LR scheduler and every rank's RNG state). A directory is written as .tmp and
renamed once complete (commit), so one without ".tmp" always loads; latest_checkpoint finds the newest that does.
export_hf: the final model as an HF checkpoint directory, from the float32 master shards (not FSDP2's bf16 unshard).
"""
from __future__ import annotations

import glob
import json
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
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(root, f"step_{steps_done:06d}")
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    rng: list = [None] * world
    dist.all_gather_object(rng, rng_state(), group=group)
    if rank == 0:
        commit(tmp, path, {**run_state, "scheduler": sched.state_dict(), "rng": rng})
    dist.barrier(group=group)


def load(model, opt, sched, path: str) -> dict:
    """Every rank: model, optimizer, scheduler and this rank's RNG state from the checkpoint `path` (a run with
    more ranks than the checkpoint's takes rank 0's RNG); returns the run state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    run_state = load_run_state(path)
    sched.load_state_dict(run_state["scheduler"])
    rank = dist.get_rank()
    set_rng_state(run_state["rng"][rank] if rank < len(run_state["rng"]) else run_state["rng"][0])
    return run_state


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


def export_dtype(setting: str, model_path: str) -> torch.dtype:
    """trainer.export_dtype with auto resolved: the dtype model.path's config.json names (transformers 5 writes
    "dtype", 4 "torch_dtype"; a multimodal one under text_config), float32 when it names none. The default, because
    a trained checkpoint is expected in its base's format: Qwen3-30B-A3B's bf16 comes back as 61 GB of bf16, which
    is also what SGLang serves, not as 122 GB of float32; float32 keeps the master weights' bits."""
    if setting != "auto":
        return getattr(torch, setting)
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            c = json.load(f)
    except OSError:
        return torch.float32
    for d in (c, c.get("text_config") or {}):
        name = d.get("dtype") or d.get("torch_dtype")
        if isinstance(name, str) and isinstance(getattr(torch, name.removeprefix("torch."), None), torch.dtype):
            return getattr(torch, name.removeprefix("torch."))
    return torch.float32


def full_parameter(p: torch.Tensor) -> torch.Tensor:
    """Every rank: the whole parameter from its FSDP2 shards in their own dtype (the float32 master weights), not
    the param_dtype copy (bf16 on cuda) that FSDP2's unshard gathers. A shard offloaded to host memory is moved to
    the mesh's device type for the all-gather first (as torch's _gather_state_dict does)."""
    if not hasattr(p, "full_tensor"):
        return p.detach()
    if p.device.type != p.device_mesh.device_type:
        p = p.to(p.device_mesh.device_type)
    return p.detach().full_tensor()


def export_hf(model, model_path: str, path: str, dtype: torch.dtype) -> int:
    """Every rank: the model as an HF checkpoint directory (config and tokenizer files of model_path, safetensors
    shards of at most weight_sync.SHARD_BYTES and their index, in checkpoint names: weight_sync.to_checkpoint), one
    FSDP2 unit gathered at a time from the float32 shards (full_parameter) and cast once to `dtype`; rank 0 writes
    each shard file as it fills, so host memory holds one shard, not the model. Returns the bytes written (0 on
    the other ranks)."""
    from safetensors.torch import save_file

    import weight_sync

    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model_path, tmp, ignore=shutil.ignore_patterns(
            "*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt"))
    params = dict(model.named_parameters())
    files, weight_map, shard, size, total = [], {}, {}, 0, 0

    def flush():
        nonlocal shard, size
        files.append(f"part-{len(files):05d}.safetensors")
        save_file(shard, os.path.join(tmp, files[-1]), metadata={"format": "pt"})
        weight_map.update((n, files[-1]) for n in shard)
        shard, size = {}, 0

    with torch.no_grad():
        for _, names in weight_sync.fsdp_units(model):
            full = {n: full_parameter(params[n]) for n in names}
            if rank == 0:
                for n, t in weight_sync.to_checkpoint(model, full).items():
                    t = t.to("cpu", dtype).contiguous()
                    if shard and size + t.nbytes > weight_sync.SHARD_BYTES:
                        flush()
                    shard[n], size, total = t, size + t.nbytes, total + t.nbytes
            del full
    if rank != 0:
        return 0
    if shard or not files:
        flush()
    if len(files) == 1:  # as save_pretrained: one file, no index
        os.replace(os.path.join(tmp, files[0]), os.path.join(tmp, "model.safetensors"))
    else:
        names = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
        for f, name in names.items():
            os.replace(os.path.join(tmp, f), os.path.join(tmp, name))
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": {n: names[f] for n, f in sorted(weight_map.items())}}, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return total
