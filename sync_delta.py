"""sync_delta.py: weight_sync.delta -- per bucket only the elements whose value in the servers' dtype changed since
the version every server holds, broadcast (method distributed) or as files (method disk). weight_delta.py holds what
a delta is: its detection and encoding (DeltaSender) and the servers' custom loader that applies it.

Per sync, trainer rank 0 decides whether it goes whole (choose: no acknowledged base, a server at another version,
the servers changed, a retry, every weight_sync.delta_full_every versions) or as a delta; full syncs in this mode go
the same way, whole tensors, and seed the servers' stores. Per bucket rank 0 encodes the bucket against its host copy
and makes one /update_weights_from_tensor call (load_format weight_delta.LOADER) on every server TP rank whose
payload says where the bucket is: broadcast on the weight-update group (distributed:
sync_distributed.DistributedTransport's group, waited for by sync_distributed.wait) or a file under
run_dir/sync_weights/v<version>/ (disk; the previous sync's files are removed when the next begins). The other
trainer ranks only join the gathers. The copy advances only once every server acknowledged the sync (settle).

The transport interface (begin, buckets, start, finish; weight_sync.WeightSync.push calls it): weight_sync.py.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Optional

import torch.distributed as dist

import sync_distributed
import weight_delta


class DeltaTransport:
    """Delta buckets. sync: the weight_sync.WeightSync it serves (its cfg, rank, device, dtype and fleet, read when
    used); distributed: the sync_distributed.DistributedTransport whose group the broadcast buckets go on."""
    bucketed = True

    def __init__(self, sync, distributed):
        self.sync, self.distributed = sync, distributed
        self.sender = weight_delta.DeltaSender() if sync.rank == 0 else None  # rank 0's host copy of the servers'
        self.full_reason: Optional[str] = None  # rank 0: why this sync is full (None: a delta)
        self.engine_ranks: list = []  # rank 0: TP ranks per server; each one gets every bucket's description
        self.copy_logged = False  # rank 0: the host copy's size was printed (after the first full sync)

    # ---- per sync (weight_sync.WeightSync.sync) ----
    def choose(self, version: int, changed: bool) -> bool:
        """Rank 0: whether the sync of `version` goes whole (full_reason; `changed`: the servers answering changed,
        or a retry), from the host copy's base and each server's live weight version (/model_info), so a delta is
        never sent to a server at another version. Returns whether a server is not at the last acknowledged
        version (restarted on its URL: in no group of ours)."""
        try:
            versions = self.sync.fleet.weight_versions()
        except Exception as e:  # unreadable: whole, which needs no base
            self.full_reason = f"the servers' weight versions are unreadable ({e})"
            return True
        restarted = self.sender.version is not None and any(v != self.sender.version for v in versions)
        full_every = self.sync.cfg.weight_sync.delta_full_every
        self.full_reason = ("the servers changed, or a retry" if changed
                            else self.sender.needs_full(version, versions, full_every))
        return restarted

    def settle(self, ok: bool) -> None:
        """Rank 0, after every rank agreed on the push: the copy advances only once every server acknowledged it;
        after a failure it is no base (the next sync is full)."""
        if self.sender is not None and ok:
            self.sender.commit()
        elif self.sender is not None:
            self.sender.reset()

    def metrics(self, version: int) -> dict:
        """Rank 0: whether the sync was a delta and the share of elements that changed; {} on the other ranks."""
        if self.sender is None:
            return {}
        st = self.sender.stats
        if self.sender.full_version == version and not self.copy_logged:
            self.copy_logged = True
            print(f"[train] weight_sync.delta: trainer rank 0 holds a host copy of the servers' weights, "
                  f"{self.sender.nbytes / 2 ** 30:.2f} GiB in {self.sync.dtype}", flush=True)
        return {"perf/weight_sync_delta": float(self.full_reason is None),
                "perf/weight_sync_changed_frac": st["changed"] / max(st["numel"], 1)}

    # ---- per push: the transport interface ----
    def begin(self, version: int) -> None:
        """Rank 0, before the session: the group (distributed), the servers' TP ranks, the sender's sync of
        `version`, and (disk) the files of the last sync (applied) or of a failed one removed: one version kept."""
        s = self.sync
        if s.cfg.weight_sync.method == "distributed":
            self.distributed.begin(version)
        self.engine_ranks = s.fleet.engine_ranks()
        self.sender.begin(version, self.full_reason is not None)
        if s.cfg.weight_sync.method == "disk":
            top = os.path.join(s.cfg.run_dir, "sync_weights")
            for d in os.listdir(top) if os.path.isdir(top) else ():
                if d.startswith("v") and d[1:].isdigit():
                    shutil.rmtree(os.path.join(top, d), ignore_errors=True)

    def buckets(self):
        """Every rank, around the bucket loop: rank 0 alone builds buckets."""
        return contextlib.nullcontext({0})

    def start(self, bucket, version: Optional[int], error) -> dict:
        """Rank 0 encodes the bucket against its host copy (the changed elements, or whole tensors in a full sync),
        writes it (disk) or broadcasts it (distributed) and asks every server's loader to apply it. The pending
        bucket's nbytes: what was packed (0 on the other ranks)."""
        s, ws = self.sync, self.sync.cfg.weight_sync
        p = {"fut": None, "work": None, "error": error, "nbytes": 0, "deadline": time.monotonic() + ws.timeout_s,
             "call": f"/update_weights_from_tensor ({weight_delta.LOADER})"}
        if s.rank != 0 or error is not None:
            return p
        try:
            entries = self.sender.encode(bucket.named)
            target = self.sender.target  # the version this sync makes (DeltaSender.begin)
            desc = {"base": None if self.sender.full else self.sender.version, "version": target,
                    "last": version is not None}
            if ws.method == "disk":
                d = os.path.abspath(os.path.join(s.cfg.run_dir, "sync_weights", f"v{target}"))
                os.makedirs(d, exist_ok=True)
                desc.update(transport="disk", path=os.path.join(d, f"bucket_{len(os.listdir(d))}.safetensors"))
                p["nbytes"] = weight_delta.write_file(desc["path"], entries, desc)
            else:
                layout, flat = weight_delta.pack(entries)
                desc.update(transport="broadcast", group=self.distributed.group_name, nbytes=flat.numel(),
                            layout=layout)
                p["nbytes"] = flat.numel()
            payload = weight_delta.control_payload(desc)
            flush = version is not None and s.cfg.flush_on_update
            p["fut"] = s.fleet.submit("update_weights_from_tensor", [[payload] * r for r in self.engine_ranks],
                                      version, flush, weight_delta.LOADER)
            if ws.method == "distributed" and flat.numel():
                p["flat"] = flat.to(s.device)  # kept alive until the broadcast completed
                p["work"] = dist.broadcast(p["flat"], group=self.distributed.group, group_src=0, async_op=True)
        except Exception as e:
            p["error"] = RuntimeError(f"weight sync (delta): bucket failed: {e}")
        return p

    def finish(self, p: dict, error):
        return sync_distributed.wait(p, error, self.sync.cfg.weight_sync.timeout_s)
