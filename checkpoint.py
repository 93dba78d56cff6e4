"""checkpoint.py: a run's checkpoints, run_dir/checkpoints/step_NNNNNN/: the sharded model and optimizer by
torch.distributed.checkpoint (DCP, every rank writes its shards) and run_state.pt (rank 0: the step, the weight
version, the buffer's state, the LR scheduler and every rank's RNG state). A directory is written as .tmp and
renamed once complete (commit), so one without ".tmp" always loads; latest_checkpoint finds the newest that does.
After each commit, prune keeps the newest trainer.keep_checkpoints and removes the .tmp of writes that failed; a write
that fails (the disk full, partway through a shard) stops every rank with CheckpointWriteError, the previous
checkpoint untouched. run_state.pt is loaded back (torch.load weights_only=True) before the rename, so every
checkpoint that commits loads: a value a weights_only load refuses (a numpy scalar, a datetime, a frozenset) fails the
write naming where it is. run_state carries the run's id (rundir.py; a resume refuses another run's). The final model
as an HF checkpoint directory is hf_export.py's.
"""
from __future__ import annotations

import collections
import errno
import glob
import itertools
import os
import random
import shutil
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (raised on every rank): its message is the run's one error line."""


last_save_s: Optional[float] = None  # this process's last save, in seconds (preemption.py's bound warns on it)


def save(model, opt, sched, root: str, steps_done: int, run_state: Optional[dict], group, keep: int = 0) -> None:
    """Every rank: its model and optimizer shards (DCP) to root/step_NNNNNN, its RNG state to rank 0, which commits
    the directory with run_state (given on rank 0: step, weight_version, buffer) plus the scheduler and the RNGs,
    then prunes to the newest `keep` (0: all). group: the gloo group of the collectives around it, which also agree
    on failure: a write that fails on any rank (rank 0's directory or commit; a shard, which DCP reports to every
    rank) raises CheckpointWriteError on every rank, so none is left waiting in a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    global last_save_s
    t0 = time.monotonic()
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(root, f"step_{steps_done:06d}")
    tmp = path + ".tmp"
    box: list = [None]
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            box = [_describe(e, 0)]
    dist.broadcast_object_list(box, src=0, group=group)
    error = box[0]
    if error is None:
        try:
            dcp.save(_state(model, opt)[0], checkpoint_id=tmp)
        except (Exception, CheckpointException) as e:
            error = _describe(e, rank)
    rng: list = [None] * world
    dist.all_gather_object(rng, rng_state(), group=group)
    if rank == 0 and error is None:
        try:
            commit(tmp, path, {**run_state, "scheduler": sched.state_dict(), "rng": rng})
        except Exception as e:
            error = _describe(e, 0)
    errors: list = [None] * world
    dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e is not None]
    if failed:  # the most telling: a disk errno, else a rank's own error, else what DCP said
        message = write_error_message(tmp, root, min(failed, key=lambda e: (e["errno"] not in _DISK_ERRNOS,
                                                                          not e["own"], e["rank"])), keep)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # its space back (resume never picks a .tmp)
        raise CheckpointWriteError(message)
    if rank == 0:
        prune(root, keep, path)
    dist.barrier(group=group)
    last_save_s = time.monotonic() - t0


_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # disk full, quota, file size limit (ulimit -f)


def _describe(error: BaseException, rank: int) -> dict:
    """A failed write as plain data for the agreement: {"rank", "errno", "text", "own"}. DCP raises the same
    CheckpointException on every rank, holding {rank: (exception, traceback)} of the ranks whose write failed: this
    rank's own if it is there ("own"). A write the kernel cuts short inside torch.save's zip writer comes out as
    RuntimeError "unexpected pos", without its errno, so a finite file-size limit of this process is named too."""
    import resource

    failures = getattr(error, "failures", None)
    own = failures is None or rank in failures
    if failures:
        rank, (error, _) = (rank, failures[rank]) if rank in failures else min(failures.items())
    text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if own and limit != resource.RLIM_INFINITY:
        text += f" (rank {rank} runs under a file size limit, ulimit -f, of {limit} bytes)"
    return {"rank": rank, "errno": getattr(error, "errno", None), "text": text, "own": own}


def write_error_message(tmp: str, root: str, failed: dict, keep: int) -> str:
    """One line: the directory that failed, the error, the free space where it was written and what resume loads."""
    usage = shutil.disk_usage(root)
    previous = newest_complete(root)
    advice = (f"free space there, lower trainer.keep_checkpoints (now {keep or '0: every checkpoint is kept'}) or "
              "set run_dir on a larger disk")
    if failed["errno"] not in _DISK_ERRNOS:  # torch's zip writer says "unexpected pos" where a write came up short
        advice = f"if that disk is full: {advice}"
    return (f"writing checkpoint {tmp} failed on rank {failed['rank']}: {failed['text']} ({_size(usage.free)} free of "
            f"{_size(usage.total)} on its filesystem); trainer.resume=auto continues from the newest complete "
            f"checkpoint, {previous or 'none (there is none)'}; {advice}")


def _size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 2 ** k:
            return f"{n / 2 ** k:.2f} {unit}"
    return f"{n} B"


def steps_of(root: str) -> list:
    """[(step, path)] of the complete checkpoint directories under root (no .tmp), oldest first."""
    out = []
    for p in glob.glob(os.path.join(root, "step_*")):
        tail = os.path.basename(p)[len("step_"):]
        if tail.isdigit() and os.path.isdir(p):
            out.append((int(tail), p))
    return sorted(out)


def newest_complete(root: str) -> Optional[str]:
    done = steps_of(root)
    return done[-1][1] if done else None


def prune(root: str, keep: int, newest: str) -> list:
    """After `newest` is committed (rank 0): remove the .tmp directories of writes that failed or were cut short,
    then the complete checkpoints older than `newest` beyond the newest `keep` (trainer.keep_checkpoints; 0 keeps
    every one), oldest first. `newest` is never removed, nor one with a later step (another run's, which resume=auto
    would pick). Returns the removed paths."""
    removed = []
    for tmp in glob.glob(os.path.join(root, "step_*.tmp")):
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    if keep:
        step = int(os.path.basename(newest)[len("step_"):])
        older = [p for s, p in steps_of(root) if s < step]
        for p in older[:max(0, len(older) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


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
    """Write run_state.pt into the finished directory `tmp`, load it back as resume will (weights_only), and rename
    `tmp` to `path`, each step on disk before the next (DCP fsyncs its own files): after a crash at any point, a
    directory without ".tmp" is complete and loads. A run_state holding what a weights_only load refuses raises
    ValueError naming where, and nothing is renamed."""
    problem = unloadable(run_state, "run_state")
    if problem is not None:
        raise ValueError(f"{problem}, so the checkpoint would not load")
    with open(os.path.join(tmp, "run_state.pt"), "wb") as f:
        torch.save(run_state, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        load_run_state(tmp)
    except Exception as e:  # what unloadable does not know of: torch's own word, its "Unsupported global" line
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else "")
        raise ValueError(f"run_state.pt does not load back (torch.load weights_only=True): {type(e).__name__}: "
                         f"{why[:300]}") from e
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


_LEAVES = frozenset({str, int, float, bool, type(None), bytes, complex, torch.Size, torch.dtype, torch.device,
                     torch.Tensor, torch.nn.Parameter})
_SEQUENCES = (list, tuple, set)


def unloadable(value, where: str) -> Optional[str]:
    """Where in `value` (named `where`) the first thing is that torch.load(weights_only=True) refuses, and what it
    is, e.g. "metadata['score'] holds a numpy.float64 (0.5)"; None when it is all plain data: str, int, float, bool,
    None, bytes, complex, tensors, and lists, tuples, sets and dicts of them. Types are matched exactly: a numpy
    scalar or an IntEnum subclasses int or float and is refused, as is a frozenset, a datetime or a Fraction."""
    stack = [(value, where)]
    while stack:
        v, at = stack.pop()
        kind = type(v)
        if kind in _LEAVES:
            continue
        if kind in _SEQUENCES:
            if not set(map(type, v)) <= _LEAVES:  # (a long list of numbers is one C-level pass)
                stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
            continue
        if kind is dict or kind is collections.OrderedDict:
            stack.extend(itertools.chain.from_iterable(((k, f"{at} key {k!r}"), (x, f"{at}[{k!r}]"))
                                                       for k, x in v.items()))
            continue
        text = repr(v)
        return (f"{at} holds a {kind.__module__}.{kind.__qualname__} ({text[:60]}{'...' if len(text) > 60 else ''}), "
                "which torch.load(weights_only=True) refuses: only str, int, float, bool, None, bytes, tensors and "
                "lists, tuples, sets and dicts of them")
    return None


def load_run_state(path: str) -> dict:
    """run_state.pt of a checkpoint directory: plain data only (weights_only=True: loading runs no code)."""
    return torch.load(os.path.join(path, "run_state.pt"), weights_only=True)


def checkpoint_problem(path: str, shards: bool = True) -> Optional[str]:
    """Why the checkpoint directory `path` would not load, or None: run_state.pt unreadable, or the DCP shards
    without their metadata or shorter than it says, or (shards: a training run resumes it) none at all: a directory
    with run_state.pt alone is a rollout-only run's, or a training run's whose shards were lost."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        load_run_state(path)
    except Exception as e:
        return f"run_state.pt does not load: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not glob.glob(os.path.join(path, "*.distcp")) and not os.path.exists(os.path.join(path, ".metadata")):
        return ("it has run_state.pt but no model and optimizer shards (no .metadata, no *.distcp): a rollout-only "
                "run's, or its shards were removed") if shards else None
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


def newest_loading(run_dir: str, shards: bool = True) -> tuple[Optional[str], list]:
    """(the newest run_dir/checkpoints/step_* that loads, or None; [(path, why)] of the newer ones that do not, newest
    first). Directories being written end in .tmp and are not checkpoints."""
    skipped = []
    for _, path in reversed(steps_of(os.path.join(run_dir, "checkpoints"))):
        problem = checkpoint_problem(path, shards)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def latest_checkpoint(run_dir: str, shards: bool = True) -> Optional[str]:
    """The newest run_dir/checkpoints/step_* that loads, or None. Newer ones that do not load are skipped with a
    warning naming each and why (trainer.resume=auto: rundir.claim, which stops when none loads)."""
    path, skipped = newest_loading(run_dir, shards)
    for bad, problem in skipped:
        print(f"[train] warning: skipping checkpoint {bad}: {problem}; trying the previous one", file=sys.stderr,
              flush=True)
    return path
