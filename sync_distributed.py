"""sync_distributed.py: weight_sync.method distributed -- each bucket broadcast on the weight-update group.

Trainer rank 0 is rank 0 of a broadcast group with every server rank (SGLang /init_weights_update_group): a TCPStore
hosted by rank 0 for the whole run, the group formed on it at the first sync and again, under a new name, after the
servers changed (drop). Each bucket is one /update_weights_from_distributed call (load_format flattened_bucket) while
rank 0 broadcasts the bucket's flat buffer as bytes: one broadcast per bucket. Only rank 0 builds buckets; the other
trainer ranks only join the gathers. NCCL refuses two ranks on one GPU, so not for colocate on GPUs.
weight_sync.delta over this method broadcasts on the same group (sync_delta.py) and waits the same way (wait).

The transport interface (begin, buckets, start, finish; weight_sync.WeightSync.push calls it): weight_sync.py.
"""
from __future__ import annotations

import contextlib
import datetime
import time
from typing import Optional

import torch
import torch.distributed as dist

WEIGHT_GROUP = "weight_update_group"  # name of the trainer-rank-0 + servers broadcast group (SGLang's default)


class DistributedTransport:
    """The weight-update group and the buckets broadcast on it. sync: the weight_sync.WeightSync it serves (its cfg,
    rank, device and fleet, read when used)."""
    bucketed = True

    def __init__(self, sync):
        self.sync = sync
        self.group = None  # the weight-update broadcast group, formed at the first sync
        self.group_name, self.generation = WEIGHT_GROUP, 0  # a new name each time the group is formed again
        self.store = None  # the TCPStore the group forms on, hosted here for the whole run

    def begin(self, version: int) -> None:
        """Rank 0, before the session: the group, formed when there is none."""
        if self.group is None:
            self.group = self.form()

    def buckets(self):
        """Every rank, around the bucket loop: rank 0 alone builds buckets."""
        return contextlib.nullcontext({0})

    def start(self, bucket, version: Optional[int], error) -> dict:
        """Rank 0 starts pushing a bucket: the HTTP call as a future and the broadcast, async."""
        s = self.sync
        p = {"fut": None, "work": None, "error": error, "call": "/update_weights_from_distributed",
             "deadline": time.monotonic() + s.cfg.weight_sync.timeout_s}
        if s.rank != 0 or error is not None:
            return p
        # load_format flattened_bucket (sglang 0.5.23 weight_updater.py _receive_bucketed_weights_from_distributed):
        # each server allocates one uint8 buffer of the tensors back to back in order and joins ONE broadcast of it
        named, flush = bucket.named, version is not None and s.cfg.flush_on_update
        p["fut"] = s.fleet.submit("update_weights_from_distributed", [n for n, _ in named],
                                  [str(t.dtype).replace("torch.", "") for _, t in named],
                                  [list(t.shape) for _, t in named], version, self.group_name, flush,
                                  "flattened_bucket")
        try:
            p["work"] = dist.broadcast(bucket.flat.view(torch.uint8), group=self.group, group_src=0, async_op=True)
        except Exception as e:  # rank 0 only: the weight-update group, not a trainer collective
            p["error"] = RuntimeError(f"weight sync: broadcasting a bucket failed: {e}")
        return p

    def finish(self, p: dict, error):
        return wait(p, error, self.sync.cfg.weight_sync.timeout_s)

    def form(self):
        """Trainer rank 0 is rank 0 of a group with every server's ranks (SGLang /init_weights_update_group):
        a TCPStore hosted here, then the same process group SGLang's init_custom_process_group builds."""
        from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

        ws = self.sync.cfg.weight_sync
        world = 1 + sum(self.sync.fleet.engine_ranks())
        addr = ws.master_address  # set by main(): 127.0.0.1 for servers rank 0 launched, else this host's IP
        backend = "nccl" if self.sync.device.type == "cuda" else "gloo"
        fut = self.sync.fleet.submit("init_weights_update_group", addr, ws.master_port, world, self.group_name,
                                     backend)
        timeout = datetime.timedelta(seconds=ws.timeout_s)
        try:
            if self.store is None:
                self.store = dist.TCPStore(addr, ws.master_port, world, is_master=True, timeout=timeout,
                                           wait_for_workers=False)
            store = PrefixStore(self.group_name, self.store)
            # The group's own timeout (NCCL's watchdog kills the process at it) is twice each bucket's deadline
            # in wait, so a broadcast the servers never join fails there first and the retry is reached.
            pg, _ = _new_process_group_helper(world, 0, [], backend, store, group_name=self.group_name,
                                              timeout=2 * timeout)
        except Exception as e:
            raise RuntimeError(f"the weight-update group did not form on {addr}:{ws.master_port} within "
                               f"weight_sync.timeout_s={ws.timeout_s} s ({world - 1} server ranks expected): {e}; "
                               f"server side: {_future_error(fut)}") from None
        _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        fut.result(ws.timeout_s)
        return pg

    def drop(self) -> None:
        """Rank 0: leave the weight-update group (the servers changed); the next sync forms a new one with every
        server, under a new name on the same TCPStore. The surviving servers leave it too; a relaunched one has
        none (its error is expected)."""
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.sync.fleet.destroy_weights_update_group(self.group_name)
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
        self.group = None
        self.generation += 1
        self.group_name = f"{WEIGHT_GROUP}_{self.generation}"


def wait(p: dict, error, timeout_s: float):
    """Wait for a started bucket: its broadcast (one poll loop: a server that answered with an error must not leave
    us hanging), then its HTTP answers (p["call"] names the call). Returns the first error."""
    error = error or p["error"]
    fut, work = p["fut"], p.get("work")
    if fut is not None and error is None and work is not None:
        while not work.is_completed() and error is None:
            if fut.done() and fut.exception() is not None:
                error = RuntimeError(f"weight sync failed while broadcasting: {fut.exception()}")
            elif time.monotonic() > p["deadline"]:
                error = TimeoutError(f"weight sync: a bucket's broadcast was not received by the servers within "
                                     f"weight_sync.timeout_s={timeout_s} s")
            time.sleep(0.001)
        try:
            if error is None:
                work.wait()
        except Exception as e:
            error = RuntimeError(f"weight sync: a bucket's broadcast failed: {e}")
    if fut is not None and error is None:
        try:
            fut.result(max(1.0, p["deadline"] - time.monotonic()))
        except Exception as e:
            error = RuntimeError(f"weight sync: {p['call']} failed: {e}")
    return error


def _future_error(fut) -> str:
    if not fut.done():
        return "no answer yet"
    return repr(fut.exception()) if fut.exception() is not None else "answered ok"
