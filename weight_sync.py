"""weight_sync.py: the trainer's weights to the inference servers, bucket by bucket (actor.py's Actor drives it).

WeightSync.sync(version) is a step's weight update on every rank: the push to the servers that answer, with the
weight-update group formed again when they change, and one retry by every rank together after a failure.

weight_sync.method:
  distributed: trainer rank 0 is rank 0 of a broadcast group with every server rank (SGLang
      /init_weights_update_group); each bucket is one /update_weights_from_distributed call (load_format
      flattened_bucket) while rank 0 broadcasts the bucket's flat buffer as bytes: one broadcast per bucket. NCCL
      refuses two ranks on one GPU, so not for colocate on GPUs.
  tensor: colocate. Each bucket is one /update_weights_from_tensor call carrying, per server TP rank, a
      MultiprocessingSerializer payload of (name, tensor) views of one flat buffer: CUDA IPC handles made by the
      trainer rank on that GPU (server s, TP rank j <- trainer rank (first rank of s + j) % world), shared-memory
      files on CPU. Nothing is copied through the HTTP body but handles.
  disk: an HF checkpoint directory (safetensors shards, as save_pretrained writes them) + /update_weights_from_disk.
weight_sync.delta (distributed and disk): only the elements whose value in the servers' dtype changed since the
  version every server holds (weight_delta.py: the detection, the encoding and the servers' custom loader); per
  bucket one /update_weights_from_tensor call (load_format weight_delta.LOADER) whose payload says where the bucket
  is: broadcast on the group (distributed) or a file under run_dir/sync_weights/v<version>/ (disk). Full syncs in
  that mode go the same way, whole tensors, and seed the servers' stores.
All in a /begin_weight_update ... /end_weight_update session (0.5.23 refuses updates outside one).

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

import base64
import contextlib
import datetime
import io
import os
import shutil
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import hf_export
import weight_delta

WEIGHT_GROUP = "weight_update_group"  # name of the trainer-rank-0 + servers broadcast group (SGLang's default)
SESSION_END_TIMEOUT_S = 10.0  # after a failed bucket, /end_weight_update gets this long before the error is raised


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
    set on rank 0 by train.main; ctrl is train.py's gloo control group."""

    def __init__(self, cfg, model, device: torch.device, ctrl):
        self.cfg, self.model, self.device, self.ctrl = cfg, model, device, ctrl
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.fleet = None  # sglang_client.SyncFleet on rank 0 when there are servers
        self.dtype = server_dtype(cfg.weight_sync.dtype, device)  # the servers' dtype: pushed and compared in it
        self.group = None  # weight-update broadcast group (distributed), made at the first sync
        self.group_name, self.generation = WEIGHT_GROUP, 0  # a new name each time the group is re-created
        self.store = None  # the TCPStore the group forms on, hosted here for the whole run
        self.last_bytes = 0  # bytes pushed by the last sync (perf/weight_sync_gbps)
        self.members: Optional[list] = None  # rank 0: the server URLs the last sync went to
        # weight_sync.delta: rank 0's host copy of the servers' weights (weight_delta.DeltaSender)
        self.delta = weight_delta.DeltaSender() if cfg.weight_sync.delta and self.rank == 0 else None
        self.full_reason: Optional[str] = None  # rank 0, delta: why this sync is full (None: a delta)
        self.copy_logged = False  # rank 0, delta: the host copy's size was printed (after the first full sync)

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
                    why, restarted = self._full_reason(version)
                    self.full_reason = "the servers changed, or a retry" if changed else why
                    changed = changed or restarted  # a server restarted on its URL is in no group of ours
                if changed:
                    if self.members is not None and live != self.members:
                        print(f"[train] warning: the servers answering are now {live} (were {self.members}): the "
                              "weight-update group is formed again with them", file=sys.stderr, flush=True)
                    self.drop_group()
                self.members = live
            if self.world > 1:  # the other ranks wait out rank 0's checks here, under the control group's timeout
                dist.barrier(group=self.ctrl)
            t1 = time.perf_counter()
            error = self._push_agreed(version)
            push_s = time.perf_counter() - t1
            if self.delta is not None:  # the copy advances only once every server acknowledged the sync
                if error is None:
                    self.delta.commit()
                else:
                    self.delta.reset()
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
            st = self.delta.stats
            out["perf/weight_sync_delta"] = float(self.full_reason is None)
            out["perf/weight_sync_changed_frac"] = st["changed"] / max(st["numel"], 1)
            if self.delta.full_version == version and not self.copy_logged:
                self.copy_logged = True
                print(f"[train] weight_sync.delta: trainer rank 0 holds a host copy of the servers' weights, "
                      f"{self.delta.nbytes / 2 ** 30:.2f} GiB in {self.dtype}", flush=True)
        if services is not None:
            out["rollout/server_restarts"] = services.server_restarts
            services.synced(version, self.group_name if self.group is not None else None)
        return out

    def _full_reason(self, version: int) -> tuple:
        """Rank 0, delta: (why the sync of `version` goes whole, or None for a delta; whether a server is not at
        the last acknowledged version), from the host copy's base and each server's live weight version
        (/model_info), so a delta is never sent to a server at another version."""
        try:
            versions = self.fleet.weight_versions()
        except Exception as e:  # unreadable: whole, which needs no base
            return f"the servers' weight versions are unreadable ({e})", True
        restarted = self.delta.version is not None and any(v != self.delta.version for v in versions)
        return self.delta.needs_full(version, versions, self.cfg.weight_sync.delta_full_every), restarted

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
        """Every rank gathers; rank 0 pushes. A failure on one rank (a broadcast on a group a dead server left, a
        payload that does not serialize) stops its pushing, never its collectives: every rank runs every bucket's
        gathers and control calls, so all leave the loop together. They then agree on the outcome (one
        all_gather_object of each rank's error on the control group) before any of them acts on it: rank 0 raises
        the first error, naming its rank, and its caller may retry with a fresh push that pairs with a fresh one on
        every rank; the other ranks say it in one line and return."""
        method, delta = self.cfg.weight_sync.method, self.cfg.weight_sync.delta
        if method == "disk" and not delta:
            path = os.path.join(self.cfg.run_dir, "sync_weights")
            self.export(path, self.dtype)
            if self.rank == 0:
                self.fleet.update_weights_from_disk(os.path.abspath(path), version, self.cfg.flush_on_update)
            return
        error, session, targets = None, False, [[0]]
        if self.rank == 0:
            try:
                if method == "distributed" and self.group is None:
                    self.group = self._init_weight_group()
                if method == "tensor":
                    targets = [[(sum(ranks[:i]) + j) % self.world for j in range(r)]
                               for ranks in [self.fleet.engine_ranks()] for i, r in enumerate(ranks)]
                if delta:  # every TP rank of every server gets the bucket's description
                    self.engine_ranks = self.fleet.engine_ranks()
                    self.delta.begin(version, self.full_reason is not None)
                    if method == "disk":  # the files of the last sync (applied) or of a failed one: one version kept
                        top = os.path.join(self.cfg.run_dir, "sync_weights")
                        for d in os.listdir(top) if os.path.isdir(top) else ():
                            if d.startswith("v") and d[1:].isdigit():
                                shutil.rmtree(os.path.join(top, d), ignore_errors=True)
                self.fleet.begin_weight_update()
                session = True
            except Exception as e:
                error = e
        if method == "tensor" and self.world > 1:  # server s, TP rank j <- trainer rank targets[s][j]
            box = [targets]
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
            targets = box[0]
        plan = plan_buckets(self.model, self.dtype, self.cfg.weight_sync.bucket_mb * 2 ** 20)
        pending, self.last_bytes = None, 0  # the bucket in flight and its handles
        no_expandable = method == "tensor" and self.device.type == "cuda"
        if no_expandable:  # CUDA IPC cannot export expandable segments' blocks: off while buckets are made (verl)
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        # the ranks that send build buckets (rank 0; with tensor, the ranks serving a server TP rank); the others
        # only join the all-gathers
        builds = self.rank in {r for server in targets for r in server}
        try:
            for k, spec in enumerate(plan):  # the gather overlaps the previous bucket's push
                bucket = gather_bucket(self.model, spec, self.dtype, self.device) if builds else join_gather(spec)
                if pending is not None:
                    error = self._finish(pending, error)
                if not delta:  # a delta counts what it packs (_start_delta)
                    self.last_bytes += spec_bytes(spec, self.dtype)
                # the last bucket (it always carries tensors) carries the version label and the flush
                pending = (self._start_delta if delta else self._start)(bucket, version if k == len(plan) - 1
                                                                         else None, targets, error)
            if pending is not None:
                error = self._finish(pending, error)
        except Exception as e:  # a collective itself failed: the session must still close, or the retry's
            error = error or e  # /begin_weight_update finds it open and the run stops
        finally:
            if no_expandable and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
                torch.cuda.memory._set_allocator_settings("expandable_segments:True")
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

    def _start(self, bucket: Bucket, version: Optional[int], targets: list, error) -> dict:
        """Start pushing a bucket: the HTTP call(s) as a future, and (distributed) the async broadcasts."""
        ws, flush = self.cfg.weight_sync, version is not None and self.cfg.flush_on_update
        p = {"bucket": bucket, "fut": None, "works": [], "deadline": time.monotonic() + ws.timeout_s, "error": error}
        if ws.method == "tensor":
            mine = self.rank in {r for server in targets for r in server}
            payload = None
            if mine and error is None:
                try:
                    payload = serialize_named_tensors(bucket.named)
                except Exception as e:  # kept for the status collective; this bucket's gather still runs
                    p["error"] = error = e
            payloads = [None] * self.world
            if self.world > 1:
                dist.gather_object(payload, payloads if self.rank == 0 else None, dst=0, group=self.ctrl)
            else:
                payloads = [payload]
            missing = [r for server in targets for r in server if payloads[r] is None]
            if self.rank == 0 and error is None and missing:  # that rank's own error comes with the status
                p["error"] = error = RuntimeError(f"weight sync: trainer ranks {missing} sent no tensor payload")
            if self.rank == 0 and error is None:
                p["fut"] = self.fleet.submit("update_weights_from_tensor", [[payloads[r] for r in s] for s in targets],
                                             version, flush)
            return p
        if self.rank != 0 or error is not None:
            return p
        # load_format flattened_bucket (sglang 0.5.23 weight_updater.py _receive_bucketed_weights_from_distributed):
        # each server allocates one uint8 buffer of the tensors back to back in order and joins ONE broadcast of it
        named = bucket.named
        p["fut"] = self.fleet.submit("update_weights_from_distributed", [n for n, _ in named],
                                     [str(t.dtype).replace("torch.", "") for _, t in named],
                                     [list(t.shape) for _, t in named], version, self.group_name, flush,
                                     "flattened_bucket")
        try:
            p["works"] = [dist.broadcast(bucket.flat.view(torch.uint8), group=self.group, group_src=0,
                                         async_op=True)]
        except Exception as e:  # rank 0 only: the weight-update group, not a trainer collective
            p["error"] = RuntimeError(f"weight sync: broadcasting a bucket failed: {e}")
        return p

    def _start_delta(self, bucket: Bucket, version: Optional[int], targets: list, error) -> dict:
        """weight_sync.delta: rank 0 encodes the bucket against its host copy (weight_delta.DeltaSender: the
        changed elements, or whole tensors in a full sync), writes it (disk) or broadcasts it (distributed) and asks
        every server's custom loader to apply it; the other ranks only gathered."""
        ws, p = self.cfg.weight_sync, {"fut": None, "works": [], "error": error}
        p["deadline"] = time.monotonic() + ws.timeout_s
        if self.rank != 0 or error is not None:
            return p
        try:
            entries = self.delta.encode(bucket.named)
            target = self.delta.target  # the version this sync makes (DeltaSender.begin)
            desc = {"base": None if self.delta.full else self.delta.version, "version": target,
                    "last": version is not None}
            if ws.method == "disk":
                d = os.path.abspath(os.path.join(self.cfg.run_dir, "sync_weights", f"v{target}"))
                os.makedirs(d, exist_ok=True)
                desc.update(transport="disk", path=os.path.join(d, f"bucket_{len(os.listdir(d))}.safetensors"))
                self.last_bytes += weight_delta.write_file(desc["path"], entries, desc)
            else:
                layout, flat = weight_delta.pack(entries)
                desc.update(transport="broadcast", group=self.group_name, nbytes=flat.numel(), layout=layout)
                self.last_bytes += flat.numel()
            payload = weight_delta.control_payload(desc)
            flush = version is not None and self.cfg.flush_on_update
            p["fut"] = self.fleet.submit("update_weights_from_tensor", [[payload] * r for r in self.engine_ranks],
                                         version, flush, weight_delta.LOADER)
            if ws.method == "distributed" and flat.numel():
                p["flat"] = flat.to(self.device)  # kept alive until the broadcast completed
                p["works"] = [dist.broadcast(p["flat"], group=self.group, group_src=0, async_op=True)]
        except Exception as e:
            p["error"] = RuntimeError(f"weight sync (delta): bucket failed: {e}")
        return p

    def _finish(self, p: dict, error):
        """Wait for a started bucket: its broadcasts (one poll loop: a server that answered with an error must not
        leave us hanging), then its HTTP answers. Returns the first error."""
        error = error or p["error"]
        ws, fut = self.cfg.weight_sync, p["fut"]
        if fut is not None and error is None and p["works"]:
            last = p["works"][-1]
            while not last.is_completed() and error is None:
                if fut.done() and fut.exception() is not None:
                    error = RuntimeError(f"weight sync failed while broadcasting: {fut.exception()}")
                elif time.monotonic() > p["deadline"]:
                    error = TimeoutError(f"weight sync: a bucket's broadcast was not received by the servers within "
                                         f"weight_sync.timeout_s={ws.timeout_s} s")
                time.sleep(0.001)
            try:
                for w in p["works"] if error is None else ():
                    w.wait()
            except Exception as e:
                error = RuntimeError(f"weight sync: a bucket's broadcast failed: {e}")
        if fut is not None and error is None:
            try:
                fut.result(max(1.0, p["deadline"] - time.monotonic()))
            except Exception as e:
                error = RuntimeError(f"weight sync: /update_weights_from_{ws.method} failed: {e}")
        if ws.method == "tensor" and self.world > 1:  # the servers have answered: now every rank may free
            dist.barrier(group=self.ctrl)
        if ws.method == "tensor" and self.device.type == "cuda":
            # The bucket's block was exported by CUDA IPC: the caching allocator keeps such a block out of reuse
            # until the importer has let go, and ipc_collect hands back those it has (slime does so after every
            # bucket, update_weight_from_tensor.py). The block is freed only after the server answered.
            p.pop("bucket", None)
            torch.cuda.ipc_collect()
        return error

    # ---- the broadcast group (distributed) ----
    def _init_weight_group(self):
        """Trainer rank 0 is rank 0 of a group with every server's ranks (SGLang /init_weights_update_group):
        a TCPStore hosted here, then the same process group SGLang's init_custom_process_group builds."""
        from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

        ws = self.cfg.weight_sync
        world = 1 + sum(self.fleet.engine_ranks())
        addr = ws.master_address  # set by main(): 127.0.0.1 for servers rank 0 launched, else this host's IP
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        fut = self.fleet.submit("init_weights_update_group", addr, ws.master_port, world, self.group_name, backend)
        timeout = datetime.timedelta(seconds=ws.timeout_s)
        try:
            if self.store is None:
                self.store = dist.TCPStore(addr, ws.master_port, world, is_master=True, timeout=timeout,
                                           wait_for_workers=False)
            store = PrefixStore(self.group_name, self.store)
            # The group's own timeout (NCCL's watchdog kills the process at it) is twice each bucket's deadline
            # in _finish, so a broadcast the servers never join fails there first and the retry is reached.
            pg, _ = _new_process_group_helper(world, 0, [], backend, store, group_name=self.group_name,
                                              timeout=2 * timeout)
        except Exception as e:
            raise RuntimeError(f"the weight-update group did not form on {addr}:{ws.master_port} within "
                               f"weight_sync.timeout_s={ws.timeout_s} s ({world - 1} server ranks expected): {e}; "
                               f"server side: {_future_error(fut)}") from None
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        fut.result(ws.timeout_s)
        return pg

    def drop_group(self) -> None:
        """Leave the weight-update group (a server in it was replaced); the next push forms a new one with every
        server, under a new name on the same TCPStore. The surviving servers leave it too; a relaunched one has
        none (its error is expected)."""
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.fleet.destroy_weights_update_group(self.group_name)
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
        self.group = None
        self.generation += 1
        self.group_name = f"{WEIGHT_GROUP}_{self.generation}"

    # ---- disk: an HF checkpoint directory ----
    def export(self, path: str, dtype: torch.dtype) -> None:
        """The weights as an HF checkpoint directory, as the final export writes it (hf_export.export_hf: config
        and tokenizer of model.path, safetensors shards and their index, one FSDP2 unit gathered at a time);
        written by rank 0, which counts its bytes for perf/weight_sync_gbps."""
        self.last_bytes = hf_export.export_hf(self.model, self.cfg.model.path, path, dtype)


def _future_error(fut) -> str:
    if not fut.done():
        return "no answer yet"
    return repr(fut.exception()) if fut.exception() is not None else "answered ok"
