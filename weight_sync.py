"""weight_sync.py: the trainer's weights to the inference servers, bucket by bucket (actor.py's Actor drives it).

WeightSync.sync(version) is a step's weight update on every rank: the push to the servers that answer, with the
weight-update group formed again when they change, and one retry by every rank together after a failure.
WeightSync.push is the sequence of one push, whatever the transport: inside a /begin_weight_update ...
/end_weight_update session (0.5.23 refuses updates outside one), bucket by bucket, the weight version and
flush_cache on the last bucket, then every rank agreeing on the outcome.

The transports, one file each, by weight_sync.method's values (delta: weight_sync.delta true):
  distributed  sync_distributed.DistributedTransport: a broadcast per bucket on the weight-update group + one
               /update_weights_from_distributed call (not for colocate on GPUs: NCCL refuses two ranks on one GPU).
  tensor       sync_tensor.TensorTransport (colocate): per bucket one /update_weights_from_tensor call carrying
               shared tensors (CUDA IPC handles, shared-memory files on CPU).
  disk         sync_disk.DiskTransport: an HF checkpoint directory + /update_weights_from_disk, written whole (no
               buckets, no session).
  delta        sync_delta.DeltaTransport (weight_sync.delta with distributed or disk): only the elements changed
               since the version every server holds (weight_delta.py encodes them and is the servers' loader).
A bucketed transport answers: begin(version) on rank 0 before the session opens (what the servers need first: the
group, the ranks that serve them; raises on failure); buckets() on every rank, a context manager around the bucket
loop that yields the trainer ranks that build buckets; start(bucket, version, error) on every rank per bucket (bucket
None on a rank that does not build; version None but on the last bucket; error: this push's first, after which it
sends nothing but still joins its collectives), which returns the pending bucket (a dict; "nbytes": the bytes it
sent, when the transport counts them, else the bucket's size counts); finish(pending, error) on every rank, which
waits for it and returns the first error. DiskTransport answers push(version) instead (bucketed False).

Gathering: the parameters of one FSDP2 unit (a decoder layer, or the root's embeddings/norm/head) are all-gathered
together by FSDP2's own unshard, in its param dtype (bf16 on GPU: cast before the gather, half the bytes), and
copied into the bucket's flat buffer in the servers' dtype by the ranks that send it (rank 0; tensor: each rank that
serves a server TP rank); the other ranks only join the all-gathers (join_gather). Buckets (whole units, at most
weight_sync.bucket_mb, a larger unit alone) overlap:
unit k + 1 is gathered while bucket k's broadcast or HTTP call is in flight. Every push and write carries the
checkpoint's names, shapes and dtypes (hf_export.to_checkpoint, one unit at a time: a Qwen3-MoE layer's fused
experts go out per expert, as save_pretrained writes them and sglang's loader maps them, as views of the fused
tensors; a dense model's names are unchanged).
The weight version and flush_cache travel on the last bucket that carries tensors, never on an empty trailing call.

Run the throughput bench: python bench/weight_sync_bench.py
"""
from __future__ import annotations

import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import hf_export
import sync_delta
import sync_disk
import sync_distributed
import sync_tensor

SESSION_END_TIMEOUT_S = 10.0  # after a failed bucket, /end_weight_update gets this long before the error is raised


def server_dtype(setting: str, device: torch.device) -> torch.dtype:
    """weight_sync.dtype resolved: auto is bfloat16 when the trainer runs on cuda (its servers are GPUs), else
    float32; an explicit one is also the --dtype the servers this project launches get (services.py)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, setting)


def plan_buckets(model, dtype: torch.dtype, limit_bytes: int) -> list:
    """Whole FSDP units per bucket, at most limit_bytes each (a unit larger than that alone), sized by the
    checkpoint tensors they become (to_checkpoint on meta tensors): [[(module, [(checkpoint name, shape)],
    [parameter names])]]. The limit bounds what every server allocates to receive a bucket."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # DTensor: the global shape
    out, cur, size = [], [], 0
    for module, names in hf_export.fsdp_units(model):
        if not names:
            continue
        ckpt = hf_export.to_checkpoint(model, {n: torch.empty(shapes[n], dtype=dtype, device="meta") for n in names})
        unit = sum(t.numel() for t in ckpt.values()) * dtype.itemsize
        if cur and size + unit > limit_bytes:
            out, cur, size = out + [cur], [], 0
        cur.append((module, [(n, tuple(t.shape)) for n, t in ckpt.items()], names))
        size += unit
    return out + ([cur] if cur else [])


def spec_bytes(spec: list, dtype: torch.dtype) -> int:
    """Bytes of a planned bucket in `dtype`."""
    return sum(torch.Size(s).numel() for unit in spec for _, s in unit[1]) * dtype.itemsize


class Bucket:
    """One flat buffer of full tensors in the push dtype and (checkpoint name, view) pairs into it: the
    flattened_bucket layout (the tensors back to back in order; one dtype, so every offset is aligned)."""

    def __init__(self, spec: list, dtype: torch.dtype, device: torch.device):
        total = sum(torch.Size(s).numel() for unit in spec for _, s in unit[1])
        self.flat = torch.empty(total, dtype=dtype, device=device)
        self.named, off = [], 0
        for unit in spec:
            for n, s in unit[1]:
                k = torch.Size(s).numel()
                self.named.append((n, self.flat[off:off + k].view(s)))
                off += k

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def join_gather(spec: list) -> None:
    """gather_bucket's collectives alone, for a rank that neither pushes nor writes the bucket: every rank must
    join each unit's FSDP2 all-gather, but only the ranks that send need the bucket built."""
    with torch.no_grad():
        for module, _, _ in spec:
            module.unshard()
            module.reshard()


def gather_bucket(model, spec: list, dtype: torch.dtype, device: torch.device) -> Bucket:
    """A rank that pushes or writes the bucket: unshard each unit of the bucket (FSDP2 all-gather in its param
    dtype; the other ranks join_gather), convert it to checkpoint names (to_checkpoint: views of the unsharded
    parameters), copy into the bucket, reshard."""
    bucket = Bucket(spec, dtype, device)
    views = dict(bucket.named)
    with torch.no_grad():
        for module, _, names in spec:
            module.unshard()
            params = dict(model.named_parameters())
            for n, t in hf_export.to_checkpoint(model, {n: params[n] for n in names}).items():
                views[n].copy_(t)
            module.reshard()
    return bucket


class WeightSync:
    """The push of one weight version from every trainer rank (all gather; rank 0 talks to the servers). fleet is
    set on rank 0 by train.main; ctrl is train.py's gloo control group. The transports read cfg, model, device,
    dtype, rank, world, ctrl and fleet from here when they run."""

    def __init__(self, cfg, model, device: torch.device, ctrl):
        self.cfg, self.model, self.device, self.ctrl = cfg, model, device, ctrl
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.fleet = None  # sglang_client.SyncFleet on rank 0 when there are servers
        self.dtype = server_dtype(cfg.weight_sync.dtype, device)  # the servers' dtype: pushed and compared in it
        self.last_bytes = 0  # bytes pushed by the last sync (perf/weight_sync_gbps)
        self.members: Optional[list] = None  # rank 0: the server URLs the last sync went to
        self.distributed = sync_distributed.DistributedTransport(self)  # holds the weight-update group
        self.transports = {"distributed": self.distributed, "tensor": sync_tensor.TensorTransport(self),
                           "disk": sync_disk.DiskTransport(self)}
        # weight_sync.delta: the delta transport (rank 0 holds a host copy of the servers' weights)
        self.delta = sync_delta.DeltaTransport(self, self.distributed) if cfg.weight_sync.delta else None

    def transport(self):
        """This push's transport: the delta one with weight_sync.delta, else weight_sync.method's."""
        return self.delta if self.delta is not None else self.transports[self.cfg.weight_sync.method]

    # ---- one sync: the push, retried once with a new group ----
    def sync(self, version: int, services=None) -> dict:
        """Every rank: push the weights to every server as `version`. The sync goes to the servers that answer
        /health (rank 0 waits up to rollout.startup_timeout_s for one); the weight-update group is formed again when
        they change or one that rank 0 launched was relaunched (`services`: rank 0's services.Services, which
        relaunches them; None elsewhere). A failed push is retried once by every rank with a new group (after the
        relaunch of a server that died): _push_agreed makes every rank see the failure, so the retry pairs up bucket
        for bucket. A second failure raises (rank 0: the server's message). Returns this sync's metrics."""
        t0 = time.perf_counter()
        retry, push_s = False, 0.0
        for attempt in (1, 2):
            if self.rank == 0:
                replaced = services is not None and services.take_replaced()
                live = self.fleet.live_workers(self.cfg.rollout.startup_timeout_s)
                changed = retry or replaced or live != self.members
                if self.delta is not None:  # a replaced, new or restarted server, or a retry: full
                    restarted = self.delta.choose(version, changed)
                    changed = changed or restarted  # a server restarted on its URL is in no group of ours
                if changed:
                    if self.members is not None and live != self.members:
                        print(f"[train] warning: the servers answering are now {live} (were {self.members}): the "
                              "weight-update group is formed again with them", file=sys.stderr, flush=True)
                    self.distributed.drop()
                self.members = live
            if self.world > 1:  # the other ranks wait out rank 0's checks here, under the control group's timeout
                dist.barrier(group=self.ctrl)
            t1 = time.perf_counter()
            error = self._push_agreed(version)
            push_s = time.perf_counter() - t1
            if self.delta is not None:  # the host copy advances only once every server acknowledged the sync
                self.delta.settle(error is None)
            if error is None:
                break
            if attempt == 2:  # rank 0 stops the run with the error
                raise error
            # A server died (ours is relaunched: take_replaced waits for it) or restarted on its URL (no longer in
            # the group): once more with a new group of the servers that answer.
            retry = True
            if self.rank == 0:
                if services is not None:
                    services.server_died()
                print(f"[train] warning: weight sync of version {version} failed ({str(error).splitlines()[0]}); "
                      "retrying once with a new weight-update group of the servers that answer", file=sys.stderr,
                      flush=True)
        out = {"timing/update_weights": time.perf_counter() - t0,
               "perf/weight_sync_gbps": self.last_bytes / 1e9 / max(push_s, 1e-9),
               "perf/weight_sync_bytes": self.last_bytes}
        if self.delta is not None:
            out.update(self.delta.metrics(version))
        if services is not None:
            out["rollout/server_restarts"] = services.server_restarts
            group = self.distributed.group_name if self.distributed.group is not None else None
            services.synced(version, group)
        return out

    def _push_agreed(self, version: int) -> Optional[Exception]:
        """Every rank: push(version); None, or on every rank the push's failure (rank 0's exception; on the others
        a RuntimeError saying so). push's own status collective and rank 0's outcome, broadcast, make every rank
        agree, also for the disk method, whose failure only rank 0 sees."""
        error = None
        try:
            self.push(version)
        except Exception as e:
            if self.rank != 0:
                raise
            error = e
        if self.world > 1:
            box = [None if error is None else f"{type(error).__name__}: {error}"]
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
            if self.rank != 0 and box[0] is not None:
                error = RuntimeError(f"weight sync of version {version} failed on trainer rank 0: {box[0]}")
        return error

    def push(self, version: int) -> None:
        """Every rank gathers; the transport sends (rank 0 talks to the servers). A failure on one rank (a broadcast
        on a group a dead server left, a payload that does not serialize) stops its sending, never its collectives:
        every rank runs every bucket's gathers and the transport's collectives, so all leave the loop together. They
        then agree on the outcome (one all_gather_object of each rank's error on the control group) before any of
        them acts on it: rank 0 raises the first error, naming its rank, and its caller may retry with a fresh push
        that pairs with a fresh one on every rank; the other ranks say it in one line and return."""
        tx = self.transport()
        if not tx.bucketed:  # disk: the directory, written whole, outside a session
            self.last_bytes = tx.push(version)
            return
        error, session = None, False
        if self.rank == 0:
            try:
                tx.begin(version)
                self.fleet.begin_weight_update()
                session = True
            except Exception as e:
                error = e
        plan = plan_buckets(self.model, self.dtype, self.cfg.weight_sync.bucket_mb * 2 ** 20)
        pending, self.last_bytes = None, 0  # the bucket in flight
        try:
            with tx.buckets() as senders:
                builds = self.rank in senders  # the ranks that send build buckets; the others join the all-gathers
                for k, spec in enumerate(plan):  # the gather overlaps the previous bucket's push
                    bucket = gather_bucket(self.model, spec, self.dtype, self.device) if builds else join_gather(spec)
                    if pending is not None:
                        error = tx.finish(pending, error)
                    # the last bucket (it always carries tensors) carries the version label and the flush
                    pending = tx.start(bucket, version if k == len(plan) - 1 else None, error)
                    nbytes = pending.get("nbytes")  # the bytes the transport sent, or the bucket's
                    self.last_bytes += spec_bytes(spec, self.dtype) if nbytes is None else nbytes
                if pending is not None:
                    error = tx.finish(pending, error)
        except Exception as e:  # a collective itself failed: the session must still close, or the retry's
            error = error or e  # /begin_weight_update finds it open and the run stops
        if session:
            try:
                self.fleet.end_weight_update(None if error is None else SESSION_END_TIMEOUT_S)
            except Exception as e:
                error = error or e
        if self.world > 1:  # the status collective: every rank knows whether the push failed, and why
            status = [None] * self.world
            dist.all_gather_object(status, None if error is None else f"{type(error).__name__}: {error}",
                                   group=self.ctrl)
            failed = [(r, s) for r, s in enumerate(status) if s is not None]
            if failed and self.rank != 0:
                print(f"[train] rank {self.rank}: weight sync of version {version} failed on trainer rank "
                      f"{failed[0][0]}: {failed[0][1].splitlines()[0][:300]}", flush=True)
                return
            if failed and error is None:
                error = RuntimeError(f"weight sync failed on trainer rank {failed[0][0]}: {failed[0][1]}")
        if error is not None:
            raise error
