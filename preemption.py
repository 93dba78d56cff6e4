"""preemption.py: SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) as a checkpoint at the next step
boundary and exit 0; a second Ctrl-C stops at once; a refusal's sentence as the root cause in torchrun's summary.

torchrun (torch 2.13) forwards a SIGTERM or SIGINT it gets (a terminal's Ctrl-C reaches torchrun's process group,
not the ranks: each rank leads a session of its own) to every worker's process group (os.killpg,
torch/distributed/elastic/multiprocessing/subprocess_handler), waits up to its --shutdown-timeout (default 30 s;
PET_SHUTDOWN_TIMEOUT, TORCH_ELASTIC_SHUTDOWN_TIMEOUT) for them, SIGKILLs the ones left, and then exits 1 itself
whatever the workers did (elastic/agent/server/api.py `run`: `self._shutdown(e.sigval, ...)` then `raise`). A second
signal to torchrun while it waits ends that wait and starts a second shutdown, which sends SIGTERM. So the contract is
the workers': every rank exits 0 and the checkpoint of the step it stopped at is complete.

train.py installs the handler (`install`). While the step loop runs (`steps()`), the first SIGTERM or SIGINT only
sets a flag: at the checkpoint block of each step every rank calls `stop_here`, one all-reduce of the flag on the gloo
control group, so a signal on any rank stops all of them at the same boundary, which then checkpoints and ends the
run; rank 0 ends with the command that continues it (`resume_command`). Outside the loop (start-up, the final export,
a failure's handling), the first signal raises Preempted, a SystemExit(0): the process stops at once (rank 0 stops its
children in main's `finally`); a start-up has trained nothing since the checkpoint it resumed from. After a SIGINT a
second signal (a second Ctrl-C, which torchrun forwards as SIGTERM) raises Interrupted, a SystemExit(130): the process
stops at once, without a checkpoint. A later SIGTERM after a SIGTERM is ignored (torchrun's SIGKILL follows at the end
of its grace). The children of rank 0 are started in sessions of their own (services.py), so torchrun's killpg does
not reach them before rank 0 has saved the buffer's state and stopped them. Bound: from the signal to the exit takes
at most one step period (a step's training, its checkpoint and weight sync, the eval) plus one checkpoint and the
shut-down; rank 0 warns once when its measured step period plus its last checkpoint exceed torchrun's grace
(docs/faults.md).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

import checkpoint


class Preempted(SystemExit):
    """SIGTERM or SIGINT outside the step loop (start-up, shut-down): no step to finish; the process exits 0 at once."""


class Interrupted(SystemExit):
    """A signal after a SIGINT (a second Ctrl-C): the process exits 130 at once, without a checkpoint."""


_state = {"at": None, "signal": None, "in_steps": False, "stopped": False, "step": None, "last_call": None,
          "period": 0.0, "warned": False}
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT (Ctrl-C)"}


def install() -> None:
    """The trainer's SIGTERM and SIGINT handler (the main thread of train.py; never in a library or a test process)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)


def _say(text: str) -> None:
    """Rank 0's line on stderr, by os.write: a print in a handler could re-enter one the main thread is in."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"[train] {text}\n".encode())


def _on_signal(signum, frame) -> None:
    if _state["at"] is not None:
        if signal.SIGINT in (signum, _state["signal"]):
            _say(f"{NAMES[signum]} after {NAMES[_state['signal']]}: stopping now, without a checkpoint; to continue "
                 f"from the newest checkpoint: {resume_command()}")
            raise Interrupted(130)
        return  # a later SIGTERM: the stop under way goes on
    _state["at"], _state["signal"] = time.monotonic(), signum
    if not _state["in_steps"]:
        _say(f"{NAMES[signum]} outside the step loop (start-up or shut-down): stopping now; to continue from the "
             f"newest checkpoint: {resume_command()}")
        raise Preempted(0)


def requested() -> bool:
    """Whether this process got SIGTERM or SIGINT."""
    return _state["at"] is not None


def stopped() -> bool:
    """Whether the step loop stopped early for a SIGTERM or SIGINT (stop_here said so)."""
    return _state["stopped"]


@contextlib.contextmanager
def steps():
    """While the step loop runs, SIGTERM or SIGINT sets the flag that stop_here reads: a step is never cut short."""
    _state["in_steps"] = True
    try:
        yield
    finally:
        _state["in_steps"] = False


def stop_here(group, steps_done: int, total: int) -> bool:
    """Every rank in the loop, at the same point of each step (before its checkpoint): whether any rank got SIGTERM or
    SIGINT, by one all-reduce (MAX) of the flag over `group`, the gloo control group (None: this process alone, as
    run_mode=rollout-only's rank 0). True: this step is checkpointed and the loop ends (False after the last step,
    which ends the run anyway, with its eval and export)."""
    flag = torch.tensor([1 if requested() else 0])
    if group is not None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    rank = dist.get_rank() if dist.is_initialized() else 0
    now = time.monotonic()
    if _state["last_call"] is not None:
        _state["period"] = max(_state["period"], now - _state["last_call"])
    _state["last_call"] = now
    if rank == 0:
        _warn_over_grace()
    _state["stopped"] = bool(flag.item()) and steps_done < total
    if _state["stopped"]:
        _state["step"] = steps_done
    if _state["stopped"] and rank == 0:
        ago = f"{NAMES[_state['signal']]} {now - _state['at']:.1f} s ago" if requested() else \
            "SIGTERM or SIGINT on another rank"
        print(f"[train] {ago}: checkpointing step {steps_done}, then the run stops (exit 0); "
              "trainer.resume=auto continues from it", flush=True)
    return _state["stopped"]


def continue_line() -> str:
    """Rank 0's last line after stop_here stopped the run: the step checkpointed and the command that continues."""
    return f"[train] stopped at step {_state['step']}, checkpointed; to continue: {resume_command()}"


def resume_command() -> str:
    """The command that started this run with trainer.resume=auto in place of any trainer.resume / trainer.overwrite:
    torchrun's command line (the parent's, without the interpreter its script names) or this process's."""
    args = []
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")[:-1]
    if len(args) > 1 and os.path.basename(args[1]) == "torchrun":  # `torchrun ...`: python /path/torchrun ...
        args = args[1:]
    args = args or ["python", *sys.argv]
    args = [a for a in args if not a.startswith(("trainer.resume=", "trainer.overwrite="))]
    return shlex.join([*args, "trainer.resume=auto"])


def report_to_torchrun(message: str) -> None:
    """`message` as this rank's root cause in torchrun's final summary (its "traceback :" line): written to the
    error file torchrun names (TORCHELASTIC_ERROR_FILE) in the format torch's ErrorHandler writes, without a
    traceback; nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}, f)


def _warn_over_grace() -> None:
    """Once: the longest step period plus the last checkpoint's time is longer than torchrun's grace, so a SIGTERM or
    Ctrl-C there would end in SIGKILL before its checkpoint (the one before stays what resume=auto loads)."""
    if _state["warned"]:
        return
    if "grace" not in _state:  # torchrun's command line and environment: read once (stop_here runs every step)
        _state["grace"] = grace_s()
    grace, save = _state["grace"], checkpoint.last_save_s or 0.0
    need = _state["period"] + save
    if grace is None or need <= grace:
        return
    _state["warned"] = True
    print(f"[train] warning: after a SIGTERM or Ctrl-C this run needs up to {need:.0f} s to reach its next step "
          f"boundary and checkpoint it (a step period of up to {_state['period']:.0f} s, a checkpoint of "
          f"{save:.0f} s), more than torchrun's grace of {grace:g} s before it SIGKILLs the ranks; start torchrun with "
          f"--shutdown-timeout {10 * math.ceil(2 * need / 10)} and give the scheduler as long", file=sys.stderr,
          flush=True)


def grace_s() -> Optional[float]:
    """How long torchrun waits for the workers after forwarding a SIGTERM or SIGINT before SIGKILL: its
    --shutdown-timeout (read from the parent's command line, up to the training script), else PET_SHUTDOWN_TIMEOUT or
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 (torch/distributed/launcher/api.py). None outside torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
        for i, arg in enumerate(args):
            if arg.endswith(".py") and i > 1:  # the training script: its own arguments follow
                break
            if arg in ("--shutdown-timeout", "--shutdown_timeout"):
                return float(args[i + 1])
            if arg.startswith(("--shutdown-timeout=", "--shutdown_timeout=")):
                return float(arg.split("=", 1)[1])
    for key in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        with contextlib.suppress(ValueError):
            if os.environ.get(key):
                return float(os.environ[key])
    return 30.0
