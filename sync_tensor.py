"""sync_tensor.py: weight_sync.method tensor (colocate) -- each bucket handed to the servers as shared tensors.

Each bucket is one /update_weights_from_tensor call carrying, per server TP rank, a MultiprocessingSerializer payload
of (name, tensor) views of one flat buffer (serialize_named_tensors): CUDA IPC handles made by the trainer rank on
that GPU (server s, TP rank j <- trainer rank (first rank of s + j) % world), shared-memory files on CPU. Nothing is
copied through the HTTP body but handles. Every trainer rank that serves a server TP rank builds the bucket; rank 0
gathers the payloads and makes the call; every rank frees its bucket only after the servers answered.

The transport interface (begin, buckets, start, finish; weight_sync.WeightSync.push calls it): weight_sync.py.
"""
from __future__ import annotations

import base64
import contextlib
import io
import os
import time
from typing import Optional

import torch
import torch.distributed as dist


def serialize_named_tensors(named: list) -> str:
    """(name, tensor) pairs -> one base64 MultiprocessingSerializer payload of /update_weights_from_tensor. CPU
    tensors move into shared-memory files (file_system sharing: the server opens them by name; no fd passing
    between unrelated processes); CUDA tensors become IPC handles naming their device by UUID, as SGLang's
    patch_torch does, since the server's CUDA_VISIBLE_DEVICES numbers the GPUs differently. Keep the tensors
    alive until the call has returned."""
    import torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions

    tmp.set_sharing_strategy("file_system")

    class Pickler(ForkingPickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor) and obj.is_cuda:  # arg 6 of the CUDA rebuild is the device index
                fn, args = reductions.reduce_tensor(obj)
                return fn, (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
            return NotImplemented
    buf = io.BytesIO()
    Pickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


class TensorTransport:
    """Buckets as shared tensors. sync: the weight_sync.WeightSync it serves (its cfg, rank, world, ctrl, device and
    fleet, read when used)."""
    bucketed = True

    def __init__(self, sync):
        self.sync = sync
        self.targets = [[0]]  # server s, TP rank j <- trainer rank targets[s][j] (rank 0's, then every rank's)

    def begin(self, version: int) -> None:
        """Rank 0, before the session: which trainer rank serves each server TP rank."""
        self.targets = [[0]]  # kept if the servers do not answer (the push fails; every rank still runs it)
        ranks, world = self.sync.fleet.engine_ranks(), self.sync.world
        self.targets = [[(sum(ranks[:i]) + j) % world for j in range(r)] for i, r in enumerate(ranks)]

    @contextlib.contextmanager
    def buckets(self):
        """Every rank, around the bucket loop: rank 0's targets to every rank; yields the ranks that serve a server
        TP rank (they build buckets). On CUDA, expandable segments are off meanwhile: CUDA IPC cannot export their
        blocks (verl)."""
        s = self.sync
        if s.world > 1:
            box = [self.targets]
            dist.broadcast_object_list(box, src=0, group=s.ctrl)
            self.targets = box[0]
        cuda = s.device.type == "cuda"
        if cuda:
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        try:
            yield {r for server in self.targets for r in server}
        finally:
            if cuda and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")

    def start(self, bucket, version: Optional[int], error) -> dict:
        """Every rank that serves a server TP rank serializes its bucket; rank 0 gathers the payloads and starts the
        call, as a future."""
        s = self.sync
        p = {"bucket": bucket, "fut": None, "error": error, "deadline": time.monotonic() + s.cfg.weight_sync.timeout_s}
        mine = s.rank in {r for server in self.targets for r in server}
        payload = None
        if mine and error is None:
            try:
                payload = serialize_named_tensors(bucket.named)
            except Exception as e:  # kept for the status collective; this bucket's gather still runs
                p["error"] = error = e
        payloads = [None] * s.world
        if s.world > 1:
            dist.gather_object(payload, payloads if s.rank == 0 else None, dst=0, group=s.ctrl)
        else:
            payloads = [payload]
        missing = [r for server in self.targets for r in server if payloads[r] is None]
        if s.rank == 0 and error is None and missing:  # that rank's own error comes with the status
            p["error"] = error = RuntimeError(f"weight sync: trainer ranks {missing} sent no tensor payload")
        if s.rank == 0 and error is None:
            flush = version is not None and s.cfg.flush_on_update
            p["fut"] = s.fleet.submit("update_weights_from_tensor", [[payloads[r] for r in server]
                                                                     for server in self.targets], version, flush)
        return p

    def finish(self, p: dict, error):
        """Every rank: wait for the servers' answer, then free the bucket. Returns the first error."""
        s, error = self.sync, error or p["error"]
        if p["fut"] is not None and error is None:
            try:
                p["fut"].result(max(1.0, p["deadline"] - time.monotonic()))
            except Exception as e:
                error = RuntimeError(f"weight sync: /update_weights_from_tensor failed: {e}")
        if s.world > 1:  # the servers have answered: now every rank may free
            dist.barrier(group=s.ctrl)
        if s.device.type == "cuda":
            # The bucket's block was exported by CUDA IPC: the caching allocator keeps such a block out of reuse
            # until the importer has let go, and ipc_collect hands back those it has (slime does so after every
            # bucket, update_weight_from_tensor.py). The block is freed only after the server answered.
            p.pop("bucket", None)
            torch.cuda.ipc_collect()
        return error
