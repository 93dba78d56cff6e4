"""colocate.py: the trainer and the inference servers taking turns on the same GPUs (colocate=true, synchronous mode).

Every trainer rank calls each method at the same point of the step (train.run_steps, actor.Actor.sync_weights);
rank 0 alone talks to the servers (`fleet`, None on the other ranks). The memory moves in these stages:

  memory_to_trainer   after generation: the servers release their weights, KV cache and CUDA graphs
                      (/release_memory_occupation), then every rank onloads its parameters and optimizer state
  (training)
  memory_to_servers   after training, stage 1: every rank leaves what the push does not need (optimizer state to the
                      host, the CUDA cache emptied), then the servers take their weights back (the push needs them)
  (the weight push, weight_sync.py)
  after_push          stage 2: the parameters go to the host, then the servers take back their KV cache and graphs

SGLang's weights thus land in memory the trainer has given up, not beside its optimizer state and cached blocks
(verl offloads the optimizer and empties the cache before resume(tags=["weights"]), fsdp_workers.py; slime's
sleep()). No gradients exist between steps (zero_grad(set_to_none)). The servers need --enable-memory-saver and
--enable-weights-cpu-backup (services.py launches them so). perf/memory_* are this rank's GiB (model.memory_now).
"""
from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist

import model as model_lib


class Colocate:
    """The trainer side of colocate's turns: `released` says the servers' memory is released (every rank)."""

    def __init__(self, model, optimizer, device: torch.device, ctrl):
        self.model, self.opt, self.device, self.ctrl = model, optimizer, device, ctrl
        self.rank = dist.get_rank()
        self.released = False

    def offload(self, where, params: bool = True) -> None:
        """Parameters (FSDP2 shards; unless params=False) and optimizer state to `where` ("cpu", or the device),
        then the CUDA cache emptied so that the servers get the memory."""
        if params:
            self.model.to(where)
        for state in self.opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(where, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            # cuBLAS's per-stream workspaces (32 MiB each on Hopper) live in the caching allocator and pin the
            # segments they were cut from (what stayed reserved without this: docs/results/gpu_smoke.md)
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            torch.cuda.empty_cache()

    def memory_to_trainer(self, fleet) -> dict:
        """After generation: the servers release everything (rank 0 asks them), then every rank onloads."""
        t0 = time.perf_counter()
        if self.rank == 0:
            fleet.release_memory()
        self.released = True
        dist.barrier(group=self.ctrl)  # no rank onloads before the servers have let go
        t1 = time.perf_counter()
        self.offload(self.device)
        return {"timing/release_rollout": t1 - t0, "timing/onload_train": time.perf_counter() - t1}

    def memory_to_servers(self, fleet) -> dict:
        """After training, stage 1: leave_for_push on every rank, then the servers' weights come back."""
        t0 = time.perf_counter()
        out = self.leave_for_push()
        dist.barrier(group=self.ctrl)  # the servers' weights come back once every rank has left
        if self.rank == 0:
            fleet.resume_memory(["weights"])
        return out | {"timing/resume_rollout": time.perf_counter() - t0}

    def leave_for_push(self) -> dict:
        """The optimizer state to the host and the CUDA cache emptied; this rank's memory before and after."""
        before = model_lib.memory_now(self.device)
        self.offload("cpu", params=False)
        gc.collect()
        return {"perf/memory_train_end": before, "perf/memory_before_push": model_lib.memory_now(self.device)}

    def after_push(self, fleet) -> dict:
        """Stage 2, after a successful push: the parameters to the host, then (if the servers were released) their
        KV cache and CUDA graphs come back."""
        self.offload("cpu")
        out = {"perf/memory_after_offload": model_lib.memory_now(self.device)}
        if self.released:
            t0 = time.perf_counter()
            if self.rank == 0:
                fleet.resume_memory(["kv_cache", "cuda_graph"])
            self.released = False
            out["timing/resume_kv_cache"] = time.perf_counter() - t0
        return out
