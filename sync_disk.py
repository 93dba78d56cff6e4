"""sync_disk.py: weight_sync.method disk -- the weights as an HF checkpoint directory, then /update_weights_from_disk.

The directory is run_dir/sync_weights: safetensors shards of at most hf_export.SHARD_BYTES and their index, as
save_pretrained writes them, in the servers' dtype (hf_export.export_hf, as the final export writes run_dir/hf: one
FSDP2 unit gathered at a time by every rank, rank 0 writing), then one /update_weights_from_disk call per server. It
is written whole: no buckets, and no weight-update session (the servers need none for it). weight_sync.delta over
this method writes one file per bucket instead (sync_delta.py).
"""
from __future__ import annotations

import os

import hf_export


class DiskTransport:
    """The whole-directory push. sync: the weight_sync.WeightSync it serves (its cfg, model, dtype, rank and fleet,
    read when used)."""
    bucketed = False  # weight_sync.WeightSync.push calls push, not the per-bucket interface

    def __init__(self, sync):
        self.sync = sync

    def push(self, version: int) -> int:
        """Every rank gathers and rank 0 writes the directory, then asks every server to load it as `version`.
        Returns the bytes written (rank 0; 0 on the others)."""
        s = self.sync
        path = os.path.join(s.cfg.run_dir, "sync_weights")
        nbytes = hf_export.export_hf(s.model, s.cfg.model.path, path, s.dtype)
        if s.rank == 0:
            s.fleet.update_weights_from_disk(os.path.abspath(path), version, s.cfg.flush_on_update)
        return nbytes
