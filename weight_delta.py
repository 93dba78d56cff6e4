"""weight_delta.py: delta weight sync -- detect, encode and apply the elements whose value in the servers' dtype
changed since the version the servers hold (weight_sync.delta; sync_delta.py is the transport that sends them).

Trainer side (DeltaSender, on the sending rank): a host copy of every checkpoint tensor in the servers' dtype as the
servers last acknowledged it. Each bucket's tensors are compared with it as bit patterns (viewed as an integer dtype
of the same width, so -0.0 against 0.0 and NaN payloads count as changes): a tensor that did not change is not sent,
one that changed in fewer than 1 / (1 + position bytes / value bytes) of its elements goes as int32 (int64 past 2**31
elements) positions + values, any other whole. The copy advances only once every server acknowledged the sync
(commit); a failed sync drops it (reset), so the next sync is full (slime #2104: a sender snapshot advanced before a
failed apply drifts silently). Memory: the model's size in the servers' dtype on the host of that rank, plus one
sync's changes until commit.

Server side (load_delta): sglang 0.5.23 applies a delta only through a custom weight loader (launch flag
`--custom-weight-loader weight_delta.load_delta`, this file on the server's PYTHONPATH), called by
`/update_weights_from_tensor` with `load_format="weight_delta.load_delta"` (model_executor/model_runner_components/
weight_updater.py update_weights_from_tensor: `custom_loader(self.get_model(), named_tensors)`). The payload is
(description, empty tensor) pairs pickled by value (control_payload: MultiprocessingSerializer's SafeUnpickler admits
torch.storage._load_from_bytes through a weights_only torch.load, so it works across nodes); the description (JSON in
the name) says where the bucket is: a file under the sync directory (disk) or a broadcast from rank 0 of the
weight-update group /init_weights_update_group made (found by name in torch.distributed's registry, where
init_custom_process_group's _new_process_group_helper puts it). The loader keeps a host store of every checkpoint
tensor in the server's dtype (per server process: every TP rank holds the whole model's size on its host), applies
the bucket to it and hands each changed tensor whole to `model.load_weights`, so TP sharding, fused qkv / gate_up and
per-expert MoE names go through the server's own loader. Disk buckets are read from under the server's sync
directory only (SYNC_DIR_ENV in its environment, run_dir/sync_weights as services.py launches it; the payload names
a file there, never the directory). Every bucket is checked whole before any of it is applied (DeltaRefused: a
file outside that directory, a layout that does not fit its buffer, positions out of range or of the wrong dtype or
length, a tensor the store lacks or holds in another shape or dtype, or a delta on another base version: the store
is empty after a restart, or behind); a refusal leaves the store without a base, so the next sync must be full.
SGLang 0.5.23 cannot answer a custom loader's refusal as success false: its scheduler ignores the loader's return
value and catches none of its exceptions (model_executor/model_runner_components/weight_updater.py
update_weights_from_tensor returns (True, "Success") after `custom_loader(...)`; managers/scheduler.py
run_scheduler_process ends the server on any exception), so there a refusal ends the server (its log names why;
services.py relaunches it, and the relaunched server is synced in full). The stand-in answers it as success false
and keeps serving (standins/engine.py _custom_load). The trainer checks each server's weight_version first, so a
refusal is never the path a sync takes; with the servers' api key (services.py), only the trainer can send one.
Imports torch and safetensors only.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import threading
from typing import Optional

import torch

LOADER = "weight_delta.load_delta"  # the load_format and the --custom-weight-loader value
SYNC_DIR_ENV = "WEIGHT_DELTA_SYNC_DIR"  # the server's environment: the directory disk deltas may be read from
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ALIGN = 8  # every segment of a packed bucket starts at a multiple of this many bytes


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, flat: two elements are equal here exactly when their bytes are."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat positions where new's bit pattern differs from old's."""
    return torch.nonzero(bits(old) != bits(new)).reshape(-1)


def _pos_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2 ** 31 else torch.int64


def entry_bytes(e: dict) -> int:
    return sum(t.numel() * t.element_size() for t in (e.get("pos"), e["val"]) if t is not None)


class DeltaSender:
    """The sending rank's host copy in the servers' dtype and one sync's changes until the servers acknowledged it.
    begin(version, full) -> encode(named) per bucket -> commit() after every server answered, or reset()."""

    def __init__(self):
        self.copy: dict = {}  # checkpoint name -> CPU tensor, the servers' weights at self.version
        self.version: Optional[int] = None  # the version every server acknowledged (None: next sync full)
        self.full_version: Optional[int] = None  # the last full sync's version
        self.pending: dict = {}
        self.target: Optional[int] = None
        self.full = True
        self.stats = {"changed": 0, "numel": 0, "bytes": 0}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.copy.values())

    def needs_full(self, version: int, server_versions: list, full_every: int) -> Optional[str]:
        """Why the sync of `version` must be full (None: a delta may go). server_versions: each server's
        weight_version as an int (None: unreadable)."""
        if self.version is None:
            return "no acknowledged base (first sync, resume, or a failed sync)"
        behind = [v for v in server_versions if v != self.version]
        if behind:
            return f"a server holds version {behind[0]}, not the base {self.version} (restarted or rejoined)"
        if self.full_version is None or version - self.full_version >= full_every:
            return f"weight_sync.delta_full_every={full_every}"
        return None

    def begin(self, version: int, full: bool) -> None:
        """Start the sync of `version`. A full sync still compares with a copy it has (the changed share is
        reported); it replaces the copy tensor by tensor, so the copy and the new weights never coexist whole."""
        self.target, self.full, self.pending = version, full, {}
        self.stats = {"changed": 0, "numel": 0, "bytes": 0}
        if full:
            self.version = None  # until commit, the copy is no base (a failure leaves it partly replaced)

    def encode(self, named: list) -> list:
        """One bucket's (checkpoint name, tensor in the servers' dtype) -> its entries: {"name", "shape", "dtype",
        "pos" (None: whole), "val"}; unchanged tensors of a delta give none."""
        out = []
        for name, t in named:
            t = t.detach().to("cpu", copy=True).contiguous()
            old = self.copy.get(name)
            same = old is not None and old.shape == t.shape and old.dtype == t.dtype
            pos = changed(old, t) if same else None
            self.stats["numel"] += t.numel()
            self.stats["changed"] += t.numel() if pos is None else pos.numel()
            if self.full or pos is None:
                pos = None
                self.copy.pop(name, None)  # replaced at commit; freed now, so a full sync holds one copy
            elif pos.numel() == 0:
                continue
            elif pos.numel() * (_pos_dtype(t.numel()).itemsize + t.element_size()) >= t.numel() * t.element_size():
                pos = None  # whole: fewer bytes than positions + values
            flat = t.reshape(-1)
            e = {"name": name, "shape": list(t.shape), "dtype": t.dtype,
                 "pos": None if pos is None else pos.to(_pos_dtype(t.numel())),
                 "val": flat if pos is None else flat[pos]}
            self.pending[name] = e
            self.stats["bytes"] += entry_bytes(e)
            out.append(e)
        return out

    def commit(self) -> None:
        """Every server acknowledged the sync: the copy becomes its weights."""
        for name, e in self.pending.items():
            apply_entry(self.copy, e)
        self.version, self.pending = self.target, {}
        if self.full:
            self.full_version = self.target

    def reset(self) -> None:
        """A sync failed: what the servers hold is unknown, so the copy is no base and the next sync is full."""
        self.version, self.pending = None, {}


def apply_entry(store: dict, e: dict) -> torch.Tensor:
    """An entry into `store` (name -> flat-backed tensor): whole, or values at positions. Returns the tensor."""
    if e["pos"] is None:
        store[e["name"]] = e["val"].clone().reshape(e["shape"])
    else:
        cur = store[e["name"]]
        cur.view(-1)[e["pos"].long()] = e["val"]
    return store[e["name"]]


# ---- the wire: one flat uint8 buffer per bucket (broadcast) or one safetensors file (disk) ----
def pack(entries: list) -> tuple:
    """Entries -> (layout, flat uint8 CPU tensor): per entry [name, shape, dtype, count, pos dtype or None, offset],
    positions then values, each segment 8-byte aligned."""
    layout, parts, off = [], [], 0
    for e in entries:
        segs = ([e["pos"]] if e["pos"] is not None else []) + [e["val"]]
        layout.append([e["name"], e["shape"], str(e["dtype"]).replace("torch.", ""), e["val"].numel(),
                       None if e["pos"] is None else str(e["pos"].dtype).replace("torch.", ""), off])
        for s in segs:
            b = s.contiguous().view(torch.uint8)
            pad = -b.numel() % _ALIGN
            parts += [b] + ([torch.zeros(pad, dtype=torch.uint8)] if pad else [])
            off += b.numel() + pad
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return layout, flat


class DeltaRefused(ValueError):
    """A bucket the loader refuses before it changes anything: a file outside the sync directory, a layout that does
    not fit its buffer, positions out of range, a tensor the store lacks or holds in another shape or dtype, or a
    delta on another base version."""


_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                      torch.float8_e4m3fn, torch.float8_e5m2, torch.int64,
                                                      torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
_POS_DTYPES = ("int32", "int64")


def unpack(layout: list, flat: torch.Tensor) -> list:
    """pack's inverse; a layout that pack cannot have made (a segment past the buffer's end or unaligned, an
    unknown dtype, a count that is not the shape's for a whole tensor) is refused (DeltaRefused)."""
    out = []
    if not isinstance(layout, list):
        raise DeltaRefused(f"weight_delta: the layout is a {type(layout).__name__}, not a list")
    for item in layout:
        try:
            name, shape, dtype, n, pdt, off = item
        except (TypeError, ValueError):
            raise DeltaRefused(f"weight_delta: a layout entry {str(item)[:80]} is not [name, shape, dtype, count, "
                               "position dtype, offset]") from None
        ints = [n, off, *shape] if isinstance(shape, list) else None
        if (not isinstance(name, str) or ints is None or not all(type(i) is int and i >= 0 for i in ints)
                or dtype not in _DTYPES or pdt not in (None, *_POS_DTYPES)):
            raise DeltaRefused(f"weight_delta: the layout entry of {str(name)[:80]} is malformed: shape {shape}, "
                               f"dtype {dtype}, count {n}, position dtype {pdt}, offset {off}")
        if pdt is None and n != _numel(shape):
            raise DeltaRefused(f"weight_delta: {name} is sent whole with {n} values for shape {shape}")
        dt, pos = _DTYPES[dtype], None
        if pdt is not None:
            p = getattr(torch, pdt)
            pos = _segment(flat, off, n * p.itemsize, name).view(p)
            off += n * p.itemsize + (-(n * p.itemsize) % _ALIGN)
        val = _segment(flat, off, n * dt.itemsize, name).view(dt)
        out.append({"name": name, "shape": shape, "dtype": dt, "pos": pos, "val": val})
    return out


def _numel(shape: list) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _segment(flat: torch.Tensor, off: int, nbytes: int, name: str) -> torch.Tensor:
    if off % _ALIGN or off + nbytes > flat.numel():
        raise DeltaRefused(f"weight_delta: {name}'s segment at byte {off} ({nbytes} bytes) is unaligned or past the "
                           f"end of the {flat.numel()}-byte buffer")
    return flat[off:off + nbytes]


def check_entries(store: dict, entries: list) -> None:
    """Refuse (DeltaRefused) a bucket whose positions do not all address the store's tensor of that name: each
    delta's tensor held in the store with the entry's shape and dtype, its positions a flat int32 / int64 tensor of
    the values' length, each in [0, numel). Nothing is applied before every entry of the bucket passed."""
    for e in entries:
        if e["pos"] is None:
            continue
        cur = store.get(e["name"])
        if cur is None or list(cur.shape) != list(e["shape"]) or cur.dtype != e["dtype"]:
            held = "nothing" if cur is None else f"{list(cur.shape)} {cur.dtype}"
            raise DeltaRefused(f"weight_delta: a delta of {e['name']} ({e['shape']} {e['dtype']}) on a store holding "
                               f"{held} there")
        pos = e["pos"]
        if pos.dtype not in (torch.int32, torch.int64) or pos.dim() != 1 or pos.numel() != e["val"].numel():
            raise DeltaRefused(f"weight_delta: {e['name']}'s positions are {pos.dtype} of shape {list(pos.shape)} "
                               f"for {e['val'].numel()} values; expected a flat int32 / int64 tensor of as many")
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= cur.numel()):
            raise DeltaRefused(f"weight_delta: {e['name']}'s positions span [{int(pos.min())}, {int(pos.max())}], "
                               f"outside [0, {cur.numel()}) of the tensor")


def write_file(path: str, entries: list, desc: dict) -> int:
    """A bucket as one safetensors file (a uint8 tensor "flat" and the layout in its metadata, with the base and
    new version); returns the bytes of its tensor data."""
    from safetensors.torch import save_file

    layout, flat = pack(entries)
    tmp = path + ".tmp"
    save_file({"flat": flat}, tmp, metadata={"layout": json.dumps(layout), "desc": json.dumps(desc)})
    os.replace(tmp, path)  # a server never reads a half-written file
    return flat.numel()


def read_file(path: str) -> tuple:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta, flat = f.metadata(), f.get_tensor("flat")
    return json.loads(meta["desc"]), unpack(json.loads(meta["layout"]), flat)


def control_payload(desc: dict) -> str:
    """The /update_weights_from_tensor payload of one bucket: [(JSON description, empty tensor)], pickled by value
    (base64), so it needs no shared memory with the server."""
    return base64.b64encode(pickle.dumps([(json.dumps(desc), torch.empty(0, dtype=torch.uint8))])).decode()


# ---- server side: the custom weight loader ----
_STORE: dict = {"version": None, "building": None, "tensors": {}}
_LOCK = threading.Lock()


def _group(name: str):
    from torch.distributed.distributed_c10d import _world

    for pg, n in list(_world.pg_names.items()):
        if n == name:
            return pg
    raise ValueError(f"weight_delta: no process group named {name!r} (call /init_weights_update_group first)")


def sync_dir() -> str:
    """The only directory this server reads deltas from (SYNC_DIR_ENV, set by how it was launched: services.py gives
    run_dir/sync_weights; never the payload's to choose)."""
    root = os.environ.get(SYNC_DIR_ENV)
    if not root:
        raise DeltaRefused(f"weight_delta: this server was launched without {SYNC_DIR_ENV} (the run's sync_weights "
                           "directory), so it reads no delta from disk")
    return os.path.realpath(root)


def _receive(desc: dict) -> list:
    if desc["transport"] == "disk":
        root, path = sync_dir(), os.path.realpath(str(desc["path"]))
        if os.path.commonpath([root, path]) != root:
            raise DeltaRefused(f"weight_delta: refused to read {desc['path']}: outside {root} ({SYNC_DIR_ENV})")
        fdesc, entries = read_file(path)
        if (fdesc["base"], fdesc["version"]) != (desc["base"], desc["version"]):
            raise DeltaRefused(f"weight_delta: {desc['path']} holds {fdesc['base']} -> {fdesc['version']}, the call "
                               f"named {desc['base']} -> {desc['version']}")
        return entries
    if desc["nbytes"] == 0:
        return []
    pg = _group(desc["group"])
    backend = pg.name() if hasattr(pg, "name") else "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend).lower() else "cpu"
    flat = torch.empty(desc["nbytes"], dtype=torch.uint8, device=device)
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([flat], opts).wait()
    return unpack(desc["layout"], flat.cpu())


def load_delta(model, named_tensors: list) -> None:
    """The custom weight loader (sglang: `custom_loader(self.get_model(), named_tensors)`): each pair's name is a
    bucket's description (base, version, last, transport); its bucket is applied to this process's store and the
    tensors it touched go whole to model.load_weights. A bucket is checked whole before any of it is applied
    (check_entries, unpack, the sync directory); a refused one (DeltaRefused) leaves the store without a base, so no
    later delta lands on a half-applied sync: the next sync must be full."""
    with _LOCK:
        for desc_json, _ in named_tensors:
            s = _STORE
            try:
                desc = json.loads(desc_json)
                base, version = desc["base"], desc["version"]
            except (TypeError, ValueError, KeyError):
                raise DeltaRefused(f"weight_delta: a bucket description {str(desc_json)[:80]!r} is not JSON with "
                                   "base and version") from None
            if base is not None and not (s["version"] == base or s["building"] == (base, version)):
                raise DeltaRefused(f"weight_delta: refused the delta {base} -> {version}: this server's store holds "
                                   f"version {s['version'] if s['building'] is None else s['building']} "
                                   "(empty after a restart, or another version); the trainer must send a full sync")
            if s["building"] != (base, version):
                s["building"], s["version"] = (base, version), None  # mid-sync: no base until the last bucket
            try:
                entries = _receive(desc)
                check_entries(s["tensors"], entries)
            except DeltaRefused:
                s["building"] = s["version"] = None
                raise
            touched = [(e["name"], apply_entry(s["tensors"], e)) for e in entries]
            if touched:
                model.load_weights(touched)
            if desc["last"]:
                s["version"], s["building"] = version, None

