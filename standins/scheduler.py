"""scheduler.py: the model side of engine.py, SGLang's scheduler and model runner in one thread.

engine.py is the HTTP front (it plays SGLang's tokenizer manager: it parses, validates and formats); this file owns
the model and every admitted request. One model thread runs, each iteration, the control calls the HTTP handlers
queued (Scheduler.call), prefills newly admitted requests as one batch, and advances ALL running requests (at most
max_running; the rest wait in a FIFO queue) with ONE batched forward of one token each. The KV cache is one
left-padded [rows, H, capacity, D] slab per layer with an attention mask; requests join by writing their prefilled
rows into spare rows and leave by moving the last row into their place (KVBatch), as SGLang's
schedule_batch.py: ScheduleBatch.filter_batch / merge_batch move request indices, not KV.

Also here: the torch.distributed weight-update group both sides use (init_weight_update_group, broadcast_tensors),
the safe unpickler of /update_weights_from_tensor payloads, and sampling (the log-prob convention is engine.py's).
"""
from __future__ import annotations

import base64
import collections
import concurrent.futures
import datetime
import heapq
import inspect
import io
import logging
import os
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from transformers.cache_utils import DynamicCache, DynamicLayer

import moe

log = logging.getLogger("engine")

KV_HEADROOM = 16  # extra slab columns allocated when a KV slab is (re)built, so most steps append in place
# The KV pool (--max-total-tokens) by default: this fraction of the host's memory (CPU; engine.py shares it with the
# trainer) or of the GPU memory free after the weights loaded, in tokens of the model's K and V
KV_POOL_MEM_FRACTION = {"cpu": 0.05, "cuda": 0.5}
# A request waiting longer than this (since it last entered the queue), or running longer (since its first forward),
# is aborted with 503; <= 0: never (0.5.23's environ.py, EnvFloat(-1); managers/scheduler.py _poll_timeout_aborts)


def _env(name: str, default, parse, kind: str):
    """An SGLang environment value as environ.py's EnvField.get reads it: unset gives the default, a value that
    does not parse warns and gives the default."""
    value = os.environ.get(name)
    try:
        return default if value is None else parse(value)
    except ValueError:
        log.warning('Invalid value for %s: "%s" is not a valid %s value, using default "%s"', name, value, kind,
                    default)
        return default


def _bool(value: str) -> bool:
    if value.lower() not in ("true", "1", "yes", "y", "false", "0", "no", "n"):
        raise ValueError(value)
    return value.lower() in ("true", "1", "yes", "y")


def env_bool(name: str, default: bool) -> bool:
    """EnvBool: lower-cased true/1/yes/y or false/0/no/n."""
    return _env(name, default, _bool, "boolean")


def env_int(name: str, default: int) -> int:
    """EnvInt: int(value)."""
    return _env(name, default, int, "integer")


def env_float(name: str, default: float) -> float:
    """EnvFloat: float(value)."""
    return _env(name, default, float, "float")


def bool_env_var(name: str) -> bool:
    """utils/common.py: get_bool_env_var (the older reader, not environ.py's EnvBool): true or 1 in any case is
    true, anything else false (a value other than true/1/false/0 warns)."""
    value = os.environ.get(name, "false").lower()
    if value not in ("true", "1", "false", "0"):
        log.warning("get_bool_env_var(%s) encountered unrecognized value=%s and will treat as false", name, value)
    return value in ("true", "1")


# KV-pool admission and retraction (0.5.23 environ.py; managers/scheduler_components/new_token_ratio_tracker.py):
# a running request is expected to decode min(its remaining max_new_tokens, CLIP) x new_token_ratio more tokens,
# the ratio starting at INIT, decaying per decode step to INIT x MIN_FACTOR over DECAY_STEPS, re-estimated after
# a retraction; a retraction frees RETRACT_DECODE_STEPS tokens per request left
INIT_NEW_TOKEN_RATIO = env_float("SGLANG_INIT_NEW_TOKEN_RATIO", 0.7)
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * env_float("SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR", 0.14)
NEW_TOKEN_RATIO_DECAY = ((INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO)
                         / env_int("SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS", 600))
RETRACT_DECODE_STEPS = env_int("SGLANG_RETRACT_DECODE_STEPS", 20)
CLIP_MAX_NEW_TOKENS = env_int("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", 4096)
OOM_LAST = ("Out of memory even after retracting all other requests in the decode batch. Aborting the last "
            "request.")  # 0.5.23's message (schedule_batch.py: ScheduleBatch.retract_decode), HTTP 500
REQ_WAITING_TIMEOUT_S = env_float("SGLANG_REQ_WAITING_TIMEOUT", -1.0)
REQ_RUNNING_TIMEOUT_S = env_float("SGLANG_REQ_RUNNING_TIMEOUT", -1.0)
QUEUE_FULL = "The request queue is full."  # 0.5.23's message (managers/scheduler.py _abort_on_queued_limit)
# An unstreamed request outputs every this many tokens before its last (scheduler_components/output_streamer.py
# _GenerationStreamAccumulator.accept), where 0.5.23's tokenizer manager checks its client is still there
FORCE_STREAM_INTERVAL = env_int("SGLANG_FORCE_STREAM_INTERVAL", 50)
# Reported log-probs of sampled tokens at temperature 1 (log_softmax of the logits before the temperature divides
# them) instead of the sampling temperature: layers/sampler.py reads it once at import, with get_bool_env_var
RETURN_ORIGINAL_LOGPROB = bool_env_var("SGLANG_RETURN_ORIGINAL_LOGPROB")


class BadRequest(ValueError):
    """A request field is missing, of the wrong type or out of range: answered with HTTP 400 and this message."""


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 1.0 for greedy requests (the log-prob convention)
    greedy: bool
    top_p: float
    top_k: int  # -1: whole vocabulary
    min_p: float
    stop_strs: list  # list[str]
    stop_token_ids: list  # list[int]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    min_new_tokens: int
    sampling_seed: Optional[int]
    stream_interval: int
    logit_bias: Optional[dict] = None  # token id -> added to its logit before sampling and log-probs (None: none)


@dataclass
class Req:
    """One /generate request. The model thread owns every field after submission; the HTTP side only reads
    prefixes of the append-only lists, and reads everything after `finish` is set."""
    rid: str
    input_ids: list
    sp: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    token_ids_logprob: Optional[list] = None  # ids whose log-probs are reported at every position (None: none)
    stream: bool = False
    cache_ns: tuple = (None, None)  # (extra_key, cache_salt): the prefix cache's namespace of this request
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    created: float = field(default_factory=time.perf_counter)
    queued_at: float = 0.0  # perf_counter when it last entered the waiting queue (time_stats.wait_queue_entry_time)
    forward_at: float = 0.0  # perf_counter of its first prefill (time_stats.forward_entry_time; kept on retract)
    output_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # float per output token
    top_logprobs: list = field(default_factory=list)  # per output token: list of (logprob, id)
    input_logprobs: list = field(default_factory=list)  # (logprob|None, id) per input token from logprob_start_len
    input_top_logprobs: list = field(default_factory=list)  # per input token from logprob_start_len: None | [(lp, id)]
    input_token_ids_logprobs: list = field(default_factory=list)  # the same for the token_ids_logprob ids
    output_token_ids_logprobs: list = field(default_factory=list)  # per output token: [(lp, id)] of those ids
    spans: list = field(default_factory=list)  # [version, start, end) over output token indices
    finish: Optional[dict] = None  # SGLang finish_reason once finished
    finished_at: float = 0.0
    num_retractions: int = 0
    cache_node: Optional["_Node"] = None  # while running: the locked tree node its prefix ends at (Req.last_node)
    tree_len: int = 0  # while running: its tokens held by the tree (the rest are its own in the KV pool)
    abort_sent: bool = False  # an /abort_request for this rid was forwarded (SGLang ignores repeats)
    # ended outside the running batch's output (queued, refused by the queue limit, retracted out of memory): SGLang's
    # scheduler reports it with send_abort_output and its tokenizer manager answers it in _handle_abort_req's form
    abort_output: bool = False
    to_finish: Optional[dict] = None  # aborted while running on a paused server, or its client left (engine.py
    # _run_to_end): finished by its next forward
    generator: Optional[torch.Generator] = None
    notify: Callable[[int, bool], None] = lambda n, final: None  # (tokens so far, final) -> None, thread-safe
    return_routed_experts: bool = False  # meta_info["routed_experts"] at the end (--enable-return-routed-experts)
    routed_experts_start_len: int = 0  # its first position
    # int32 [tokens, layers, top-k] chunks: positions 0, 1, ... so far; None once finished from the waiting queue
    # (0.5.23 answers that abort through tokenizer_manager._handle_abort_req, without routes)
    routes: Optional[list] = field(default_factory=list)


def abort_reason(message: str, status_code: Optional[int] = None, err_type: Optional[str] = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


# -- KV cache: one left-padded slab per layer ----------------------------------------------------------------------

class _SlabLayer(DynamicLayer):
    """One layer's K/V in a preallocated [row capacity, H, column capacity, D] buffer: a step writes into it instead
    of torch.cat-ing the whole cache (DynamicLayer's O(T^2) copying); `keys`/`values`, what attention reads, view
    the first `rows` rows and `n` columns."""

    def __init__(self, kb: Optional[torch.Tensor], vb: Optional[torch.Tensor], n: int, cap: int, rows: int):
        super().__init__()
        self.kb, self.vb, self.n, self.cap, self.rows = kb, vb, n, cap, rows
        if kb is not None:
            self._views()

    def _views(self):
        self.keys, self.values = self.kb[:self.rows, :, :self.n], self.vb[:self.rows, :, :self.n]
        self.is_initialized, self.device = True, self.kb.device

    def update(self, key_states, value_states, *args, **kwargs):
        q = key_states.shape[-2]
        if self.kb is None:
            b, h, _, d = key_states.shape
            self.kb = key_states.new_zeros(b, h, self.cap, d)
            self.vb = value_states.new_zeros(b, h, self.cap, value_states.shape[-1])
        assert self.n + q <= self.cap, "the running batch is compacted (KVBatch.combine) before it overflows"
        self.kb[:self.rows, :, self.n:self.n + q] = key_states
        self.vb[:self.rows, :, self.n:self.n + q] = value_states
        self.n += q
        self._views()
        return self.keys, self.values


class KVBatch:
    """The running batch's cache: per-layer slabs, a [rows, capacity] attention mask (1 = real token; rows are
    left-padded so every row's newest token sits in column n-1), each row's next position id and last token.

    Rows leave and join in place (SGLang's filter_batch / merge_batch move request indices, not KV): a leaving row
    is overwritten by the last row (so, unlike SGLang's, the order of the rows changes), a joining one is written
    into spare rows, right-aligned. Only when the columns
    or the rows run out is the batch rebuilt (combine), which also drops the leading columns no row uses."""

    def __init__(self, layers: list, mask: torch.Tensor, next_pos: torch.Tensor, last_tok: torch.Tensor):
        self.layers, self._mask, self.next_pos, self.last_tok = layers, mask, next_pos, last_tok
        self.cache = DynamicCache()
        self.cache.layers = layers

    @classmethod
    def empty(cls, num_layers: int, batch: int, cap: int, device) -> "KVBatch":
        z = torch.zeros(batch, dtype=torch.long, device=device)
        return cls([_SlabLayer(None, None, 0, cap, batch) for _ in range(num_layers)],
                   torch.zeros(batch, cap, dtype=torch.long, device=device), z, z.clone())

    n = property(lambda self: self.layers[0].n)  # columns in use (every row's newest token is in column n-1)
    rows = property(lambda self: self.layers[0].rows)
    mask = property(lambda self: self._mask[:self.rows])
    cap = property(lambda self: self._mask.shape[1])  # columns allocated

    def _set_rows(self, rows: int) -> None:
        for layer in self.layers:
            layer.rows = rows
            layer._views()

    def _span(self, rows) -> tuple:
        """(first, width) of the columns any of `rows` uses (they end at column n)."""
        start = int(self.mask[rows, :self.n].any(0).int().argmax())
        return start, self.n - start

    def remove(self, dead: list) -> list:
        """Drop rows `dead` in place, each hole filled by one of the last live rows; returns, for each remaining row
        in its new order, its old index (the caller reorders its requests the same way)."""
        left, gone = self.rows - len(dead), set(dead)
        order = list(range(left))
        holes = [i for i in range(left) if i in gone]
        tail = [i for i in range(left, self.rows) if i not in gone]
        if holes:
            dst, src = torch.tensor(holes, device=self._mask.device), torch.tensor(tail, device=self._mask.device)
            for t in [layer.kb for layer in self.layers] + [layer.vb for layer in self.layers]:
                t[dst, :, :self.n] = t[src, :, :self.n]
            for t in (self._mask, self.next_pos, self.last_tok):
                t[dst] = t[src]
            for h, t in zip(holes, tail):
                order[h] = t
        self.next_pos, self.last_tok = self.next_pos[:left], self.last_tok[:left]
        self._set_rows(left)
        return order

    def join(self, other: "KVBatch", keep: list) -> bool:
        """Append rows `keep` of `other` (a prefilled batch) in place, right-aligned to column n; False when they do
        not fit in the spare rows or are longer than n (the caller combines)."""
        idx = torch.tensor(keep, device=self._mask.device)
        start, width = other._span(idx)
        r0, k, n = self.rows, len(keep), self.n
        if r0 + k > self.layers[0].kb.shape[0] or width > n:
            return False
        for layer, new in zip(self.layers, other.layers):
            for dst, src in ((layer.kb, new.kb), (layer.vb, new.vb)):
                dst[r0:r0 + k, :, :n - width].zero_()  # masked, but attention reads it: finite
                dst[r0:r0 + k, :, n - width:n] = src[idx, :, start:other.n]
        self._mask[r0:r0 + k] = 0
        self._mask[r0:r0 + k, n - width:n] = other.mask[idx, start:other.n]
        self.next_pos = torch.cat([self.next_pos, other.next_pos[idx]])
        self.last_tok = torch.cat([self.last_tok, other.last_tok[idx]])
        self._set_rows(r0 + k)
        return True

    @staticmethod
    def combine(parts: list, row_cap: int = 0) -> Optional["KVBatch"]:
        """A new batch made of `rows` of each (KVBatch, rows) part, right-aligned to a common length with the
        leading all-padding columns dropped, with KV_HEADROOM spare columns and room for row_cap rows."""
        pieces = []
        for kv, rows in parts:
            if not rows:
                continue
            idx = torch.tensor(rows, device=kv.mask.device)
            pieces.append((kv, idx, *kv._span(idx)))
        if not pieces:
            return None
        length = max(p[3] for p in pieces)
        cap = length + KV_HEADROOM
        batch = sum(len(p[1]) for p in pieces)
        rows_cap = max(batch, row_cap)
        kv0 = pieces[0][0]
        mask = kv0.mask.new_zeros(rows_cap, cap)
        layers = []
        for li, layer0 in enumerate(kv0.layers):
            # Uninitialised but for the left padding (attention reads it, masked: it must be finite); the columns
            # right of `length` are written before they are read. Zeroing whole slabs cost more than the forward.
            kb = layer0.kb.new_empty(rows_cap, layer0.kb.shape[1], cap, layer0.kb.shape[3])
            vb = layer0.vb.new_empty(rows_cap, layer0.vb.shape[1], cap, layer0.vb.shape[3])
            r = 0
            for kv, idx, start, ln in pieces:
                src = kv.layers[li]
                for dst, t in ((kb, src.kb), (vb, src.vb)):
                    dst[r:r + len(idx), :, :length - ln].zero_()
                    dst[r:r + len(idx), :, length - ln:length] = t[idx, :, start:kv.n]
                r += len(idx)
            layers.append(_SlabLayer(kb, vb, length, cap, batch))
        r = 0
        for kv, idx, start, ln in pieces:
            mask[r:r + len(idx), length - ln:length] = kv.mask[idx, start:kv.n]
            r += len(idx)
        return KVBatch(layers, mask, torch.cat([p[0].next_pos[p[1]] for p in pieces]),
                       torch.cat([p[0].last_tok[p[1]] for p in pieces]))


class _Node:
    """A radix-tree node (mem_cache/radix_cache.py TreeNode): a run of tokens and their per-layer (K, V) [H, len, D],
    children by their first token, the access tick eviction orders leaves by, and how many running requests hold
    it (lock_ref: a held node and its ancestors are not evictable)."""
    __slots__ = ("key", "kv", "parent", "children", "last_access", "lock_ref")

    def __init__(self, key: list, kv: list, parent: Optional["_Node"]):
        self.key, self.kv, self.parent, self.children, self.last_access, self.lock_ref = key, kv, parent, {}, 0, 0


def _common_len(key: list, seq: list, pos: int) -> int:
    """How many leading tokens of key equal seq[pos:] (RadixKey.match)."""
    n = min(len(key), len(seq) - pos)
    i = 0
    while i < n and key[i] == seq[pos + i]:
        i += 1
    return i


# -- Torch distributed weight-update group (both sides use these helpers) ------------------------------------------

def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = "weight_update_group", backend: str = "gloo",
                             timeout_s: float = 300.0):
    """A ProcessGroupGloo/NCCL of `world_size` ranks on a TCPStore at master_address:master_port (hosted by rank 0,
    the trainer), NOT the default process group, so a trainer under torchrun owns it next to its own. The store
    prefixes mirror SGLang's init_custom_process_group (PrefixStore(group_name), then torch's "<group_name>/<device>/"),
    so the trainer side can also face real SGLang over NCCL. Blocks until all ranks joined, raises after timeout_s."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout,
                              multi_tenant=True)
        device = "cuda" if backend == "nccl" else "cpu"
        store = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    except Exception as e:  # re-raised with what did not arrive
        raise RuntimeError(f"weight-update group {group_name!r} (rank {rank} of {world_size}, {backend}) at "
                           f"{master_address}:{master_port} did not form within {timeout_s}s: {e}") from e


def broadcast_tensors(pg, tensors: list, timeout_s: float = 300.0, src: int = 0):
    """Broadcast `tensors` in order from rank `src` of `pg` (send on src, receive in place elsewhere)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    works = [pg.broadcast([t], opts) for t in tensors]
    for i, w in enumerate(works):
        if not w.wait(datetime.timedelta(seconds=timeout_s)):
            raise TimeoutError(f"broadcast of tensor {i} of {len(tensors)} did not complete within {timeout_s}s")


class _TensorUnpickler(pickle.Unpickler):
    """Loads what torch's ForkingPickler wrote for (name, tensor) pairs and nothing else: SGLang's SafeUnpickler
    (utils/common.py) allow-list, cut to plain containers, dtypes and torch's tensor/storage rebuild functions."""
    ALLOWED = {("builtins", n) for n in ("list", "tuple", "dict", "str", "int", "float", "bool", "slice")} | {
        ("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"),
        ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
        ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
        ("torch.nn.parameter", "Parameter"), ("torch._utils", "_rebuild_parameter")} | {
        ("torch.multiprocessing.reductions", n) for n in (
            "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
            "rebuild_storage_empty", "rebuild_typed_storage", "rebuild_typed_storage_child")}

    def find_class(self, module, name):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        if (module, name) == ("torch.storage", "_load_from_bytes"):  # a tensor by value: SGLang's
            return _load_storage  # _safe_load_torch_storage
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                               torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")


def _rebuild_cuda_tensor(*args):
    """torch's CUDA IPC rebuild, with the device given by UUID (sync_tensor.serialize_named_tensors, SGLang's
    patch_torch): the sender's CUDA_VISIBLE_DEVICES numbers the GPUs differently."""
    from torch.multiprocessing import reductions
    dev = args[6]
    if isinstance(dev, str):
        dev = next(i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == dev)
    return reductions.rebuild_cuda_tensor(*args[:6], dev, *args[7:])


def _load_storage(data: bytes):
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


def deserialize_named_tensors(payload: str) -> list:
    """A /update_weights_from_tensor payload (sync_tensor.serialize_named_tensors) -> [(name, tensor)]."""
    import torch.multiprocessing  # noqa: F401  (registers the rebuild functions the payload names)
    named = _TensorUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    if not (isinstance(named, list) and all(isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], torch.Tensor) for x in named)):
        raise ValueError("expected a list of (name, tensor) pairs")
    return [(n, t) for n, t in named]


# -- Sampling ------------------------------------------------------------------------------------------------------

def sample(logits: torch.Tensor, params: list, generators: list, banned: list) -> tuple:
    """One token per row of logits [B, V] under params[i] (banned[i]: ids it may not draw; generators[i]: its seed or
    None). Returns (logp [B, V], tokens [B]); logp = log_softmax((logits + logit_bias) / temperature) in float32 is
    what's reported (0.5.23 adds the bias to the logits both are taken from: model_runner.py sample ->
    SamplingBatchInfo.apply_logits_bias): the full vocabulary's, whatever top_k / top_p / min_p keep, and at
    temperature 1 under SGLANG_RETURN_ORIGINAL_LOGPROB (layers/sampler.py: Sampler.forward, which takes
    log(probs) before it filters them, or the log_softmax of the logits before it divides them)."""
    logits = logits.float()
    dev = logits.device
    if any(p.logit_bias for p in params):  # sampling_batch_info.py: logits.add_(logit_bias), before temperature
        bias = torch.zeros_like(logits)
        for i, p in enumerate(params):
            if p.logit_bias:
                bias[i, list(p.logit_bias)] = torch.tensor(list(p.logit_bias.values()), device=dev)
        logits = logits + bias
    temp = torch.tensor([p.temperature for p in params], device=dev)
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)
    scores, raw = logp, logits
    if any(banned):
        scores, raw = scores.clone(), raw.clone()
        for i, ids in enumerate(banned):
            scores[i, ids] = float("-inf")
            raw[i, ids] = float("-inf")
    reported = torch.log_softmax(logits, dim=-1) if RETURN_ORIGINAL_LOGPROB else logp
    if all(p.greedy for p in params):
        return reported, raw.argmax(-1)
    if any(not p.greedy and (p.top_p < 1 or p.top_k > 0 or p.min_p > 0) for p in params):
        scores = filter_scores(scores, params)
    # inverse-CDF sampling: one uniform per row (on CPU far cheaper than a Gumbel draw per vocabulary entry)
    cdf = scores.exp().cumsum(-1)
    u = torch.rand(len(params), device=dev)
    for i, g in enumerate(generators):  # seeded requests draw from their own generator: reproducible
        if g is not None:
            u[i] = torch.rand((), generator=g, device=dev)
    # right=True: the first entry whose cdf exceeds u, so a token of probability 0 is never drawn
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
    return reported, torch.where(greedy, raw.argmax(-1), drawn)


def filter_scores(scores: torch.Tensor, params: list) -> torch.Tensor:
    """top_k / top_p / min_p on log-probs [B, V] by 0.5.23's default backend on CUDA, flashinfer 0.7.2
    (layers/sampler.py: Sampler._sample_from_probs): removed entries become -inf (not in greedy rows). Token j is kept
    when count(p > p_j) < top_k and mass(p > p_j) < top_p, on the whole distribution (top_k_top_p_sampling_from_probs
    with filter_apply_order="joint": sampling.cuh TopKTopPSamplingFromProbKernel): by value, so tied tokens stay or
    go together, and strict, so a token with exactly top_p ranked above it goes. With min_p > 0 in any request of the
    batch (sampling_batch_info.py: need_min_p_sampling) every row goes through top_k_renorm_prob (the same top_k
    test), top_p_renorm_prob (the top_p test on the top-k set renormalised) and min_p_sampling_from_probs (p >=
    min_p x the largest). A row at top_p 1 skips the top_p test (the kernels' float32 mass of the rest may round to
    1 for the least likely tokens; a mass under 1e-7)."""
    dev, vocab = scores.device, scores.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 and not p.greedy else vocab for p in params], device=dev)
    top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=dev)
    min_p = torch.tensor([0.0 if p.greedy else p.min_p for p in params], device=dev)
    s, idx = scores.sort(-1, descending=True)
    probs = s.softmax(-1)  # float32, as the kernels take them
    # each token's count(p > p_j): where its run of ties starts in the sorted row
    larger = torch.searchsorted(-probs, -probs, right=False)
    keep = larger < top_k[:, None]
    if any(p.min_p > 0 for p in params):
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    above = (probs.cumsum(-1) - probs).gather(1, larger)  # mass(p > p_j)
    keep &= (above < top_p[:, None]) | (top_p[:, None] >= 1)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    return torch.empty_like(scores).scatter_(1, idx, s.masked_fill(~keep, float("-inf")))


# -- The model thread ----------------------------------------------------------------------------------------------

def load_model(path: str, device: torch.device, dtype: str):
    from transformers import AutoModelForCausalLM
    torch_dtype = (torch.float32 if device.type == "cpu" else "auto") if dtype == "auto" else getattr(torch, dtype)
    # experts_implementation: a MoE's experts one matmul per expert on CPU (transformers' default grouped_mm is ~10x
    # slower there on the tiny MoE); the trainer does the same (model.load_model), so both compute alike
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, experts_implementation="eager" if
                                                 device.type == "cpu" else None).to(device).eval()
    cfg = model.config.get_text_config()
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"--model-path {path}: engine.py supports full-attention layers only, the model has "
                         f"{sorted(layer_types)}")
    return model


def kv_pool_tokens(model, device: torch.device) -> int:
    """The default KV pool in tokens, sized by memory as SGLang sizes its token_to_kv_pool: KV_POOL_MEM_FRACTION of
    the host's memory (CPU) or of the GPU memory free now (after the weights), over the bytes one token's K and V
    take in every layer."""
    cfg = model.config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * heads * head_dim * next(model.parameters()).element_size()
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] * KV_POOL_MEM_FRACTION["cuda"]
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * KV_POOL_MEM_FRACTION["cpu"]
    return max(int(budget // per_token), 1024)


def checkpoint_targets(model) -> dict:
    """{checkpoint name: () -> the view of the served model's parameter it fills}. A transformers 5 Qwen3-MoE layer
    keeps its experts fused (mlp.experts.gate_up_proj [E, 2I, H], gate rows first, then up; mlp.experts.down_proj
    [E, H, I]), its checkpoint per expert (mlp.experts.{i}.gate_proj/up_proj/down_proj.weight): the mapping
    sglang 0.5.23 builds with FusedMoE.make_expert_params_mapping in Qwen3MoeForCausalLM.load_weights, and the
    inverse of transformers' core_model_loading.revert_weight_conversion. Every other parameter keeps its name.
    Views are made at load time (release/resume_memory move the parameters)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, p in params.items():
        base = name[:-len("gate_up_proj")] if name.endswith("experts.gate_up_proj") else None
        if base is not None and p.dim() == 3:
            half = p.shape[1] // 2
            for i in range(p.shape[0]):
                out[f"{base}{i}.gate_proj.weight"] = lambda name=name, i=i, h=half: params_of(model, name)[i, :h]
                out[f"{base}{i}.up_proj.weight"] = lambda name=name, i=i, h=half: params_of(model, name)[i, h:]
        elif name.endswith("experts.down_proj") and p.dim() == 3:
            base = name[:-len("down_proj")]
            for i in range(p.shape[0]):
                out[f"{base}{i}.down_proj.weight"] = lambda name=name, i=i: params_of(model, name)[i]
        else:
            out[name] = lambda name=name: params_of(model, name)
    return out


def params_of(model, name: str) -> torch.Tensor:
    return model.get_parameter(name).data


class Scheduler:
    """Owns the model and all request state; runs in its own thread. Other threads only enqueue calls."""

    def __init__(self, model, tokenizer, device: torch.device, max_running: int, max_prefill_tokens: int,
                 weight_version: str, disable_radix_cache: bool = False, max_queued: Optional[int] = None,
                 record_routes: bool = False, max_total_tokens: Optional[int] = None):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        # a MoE's routed experts per token (sglang's --enable-return-routed-experts; moe.Recorder)
        self.recorder = moe.Recorder(model) if record_routes else None
        self._targets = None  # checkpoint name -> parameter view (checkpoint_targets), made at the first load
        self.max_running, self.max_prefill_tokens, self.weight_version = max_running, max_prefill_tokens, weight_version
        cfg = model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_len = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        eos = set()
        for src in (model.config.eos_token_id, getattr(model.generation_config, "eos_token_id", None),
                    tokenizer.eos_token_id):
            eos.update([src] if isinstance(src, int) else (src or []))
        self.eos_ids = sorted(eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.logits_to_keep = "logits_to_keep" in params
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: collections.deque = collections.deque()
        self.running: list = []  # row i of self.kv belongs to running[i]
        self.prefilling: list = []  # admitted, being prefilled (neither waiting nor running yet)
        self.kv: Optional[KVBatch] = None
        self.paused: Optional[str] = None  # None | retract | in_place (pause_generation's modes that reach it)
        self.released: set = set()
        self.weights_cpu_backup = False  # --enable-weights-cpu-backup: released weights come back as they were
        self.groups: dict = {}  # group_name -> (process group, device of its tensors)
        self.disable_radix_cache = disable_radix_cache
        self.max_queued = max_queued  # --max-queued-requests: None, unbounded
        self._cache_clear()  # the radix trees of the prefix cache, one per (extra_key, cache_salt)
        # the KV pool in tokens (--max-total-tokens): the tree and the running requests' own tokens share it
        self.max_total_tokens = max_total_tokens or kv_pool_tokens(model, device)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO  # decode tokens expected per remaining max_new_token
        self.retracted_total = 0  # requests retracted for KV pool space since the start
        self.evict_pops = 0  # eviction heap entries popped (stale ones included) since the start
        self.evicted_nodes = 0  # tree nodes evicted since the start
        self.last_output = 0.0  # perf_counter of the last token generated (/health: did the scheduler answer)
        self.generated_tokens = 0  # total, for throughput in /server_info
        self.throughput = 0.0
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name="engine-model", daemon=True)

    # -- called from other threads ------------------------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn on the model thread between two steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((fn, fut))
        return fut

    def stop(self):
        self._stop = True
        self.inbox.put((lambda: None, concurrent.futures.Future()))
        self.thread.join(timeout=30)

    # -- loop ---------------------------------------------------------------------------------------------------
    def submit(self, reqs: list) -> None:
        """Queue new requests, in order (on the model thread)."""
        for r in reqs:
            self._enqueue(r)

    def _enqueue(self, r: Req) -> None:
        """Scheduler._add_request_to_queue: a request that finds --max-queued-requests already waiting is aborted
        with 503 (_abort_on_queued_limit), also a retracted one; else it joins the end of the queue. Requests that
        this iteration will admit (free running slots, not paused) are not counted as waiting: SGLang's scheduler
        admits each request in the iteration after it arrives, so with --max-running-requests 1
        --max-queued-requests 1 ten requests sent at once get 200, 200 and eight 503 (test_request_queue_validation.py)
        however many of them reach the model thread in one batch of calls."""
        free = 0 if self.paused else max(self.max_running - len(self.running), 0)
        if self.max_queued is not None and len(self.waiting) + 1 > self.max_queued + free:
            r.abort_output = True
            self._finish(r, abort_reason(QUEUE_FULL, 503))
            return
        r.queued_at = time.perf_counter()
        self.waiting.append(r)

    def _poll_timeouts(self) -> None:
        """Scheduler._poll_timeout_aborts, run every iteration (paused too): 503 aborts of requests waiting longer
        than SGLANG_REQ_WAITING_TIMEOUT and of running ones past SGLANG_REQ_RUNNING_TIMEOUT since their first
        forward (a running one paused in place is finished by its next forward, as any abort)."""
        now = time.perf_counter()
        late = []
        if REQ_WAITING_TIMEOUT_S > 0:
            late += [(r, "waiting") for r in self.waiting if 0 < r.queued_at < now - REQ_WAITING_TIMEOUT_S]
        if REQ_RUNNING_TIMEOUT_S > 0:
            late += [(r, "running") for r in self.running
                     if r.finish is None and r.to_finish is None and 0 < r.forward_at < now - REQ_RUNNING_TIMEOUT_S]
        for r, where in late:
            self.abort(r.rid, exact=True, reason=abort_reason(f"Request {where} timeout reached.", 503))

    def _busy(self) -> bool:
        return bool(self.running or self.waiting) and self.paused is None and not self.released

    def _run_calls(self):
        """Run the queued control calls; when there is nothing to decode, wait (up to 1 s) for the first one."""
        block = not self._busy()
        while True:
            try:
                fn, fut = self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            # A call whose caller gave up (its future cancelled) still runs, as a control request that reached
            # 0.5.23's scheduler does; its answer is dropped. set_running_or_notify_cancel makes the future
            # uncancellable from here on, so handing the answer over cannot raise and stop this thread.
            waited = fut.set_running_or_notify_cancel()
            try:
                result, error = fn(), None
            except Exception as e:  # handed to the caller
                result, error = None, e
            if waited:
                fut.set_result(result) if error is None else fut.set_exception(error)

    def _loop(self):
        tick_t, tick_n = time.perf_counter(), 0
        with torch.inference_mode():
            while not self._stop:
                self._run_calls()
                self._poll_timeouts()
                if not self._busy():
                    if not (self.running or self.waiting):  # idle (Scheduler.on_idle): the ratio starts again
                        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
                    continue
                try:
                    if self.waiting and len(self.running) < self.max_running:
                        self._admit()
                    if self.running:
                        self._decode()
                except Exception as e:  # fail the batch, keep serving
                    log.exception("model step failed; aborting the requests in it")
                    for req in self.running + self.prefilling:
                        self._release(req)
                        if req.finish is None:
                            self._finish(req, abort_reason(f"engine error: {e}", 500, "InternalServerError"))
                    self.running, self.prefilling, self.kv = [], [], None
                now = time.perf_counter()
                if now - tick_t > 2.0:
                    self.throughput = (self.generated_tokens - tick_n) / (now - tick_t)
                    tick_t, tick_n = now, self.generated_tokens

    def _forward(self, ids: torch.Tensor, kv: KVBatch, pos: torch.Tensor, last_only: bool) -> torch.Tensor:
        q = ids.shape[1]
        kw = {self.cache_kw: kv.cache, "attention_mask": kv.mask[:, :kv.n + q], "position_ids": pos, "use_cache": True}
        if last_only and self.logits_to_keep:
            kw["logits_to_keep"] = 1
        return self.model(input_ids=ids, **kw).logits

    def _select(self) -> list:
        """Take queued requests to prefill (schedule_policy.py PrefillAdder, FIFO): up to the running limit and the
        prefill token budget, while the KV pool has room for each one's uncached tokens and its expected decode
        (min(remaining max_new_tokens, CLIP) x new_token_ratio, as for every running request), the tree's
        unheld tokens counting as room. The first one waits for nothing but its own tokens, so a lone request
        always runs. The prefixes they will reuse are held meanwhile; then the pool is made room for them."""
        def expect(r):
            return min(max(r.sp.max_new_tokens - len(r.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        room = (self.pool_free() + self.cache_tokens - self.protected_tokens
                - sum(expect(r) * self.new_token_ratio for r in self.running))
        new, tokens, extend, rows = [], 0, 0, set()
        while self.waiting and len(self.running) + len(new) < self.max_running:
            r = self.waiting[0]
            seq = r.input_ids + r.output_ids
            if new and tokens + len(seq) > self.max_prefill_tokens:
                break
            key = (r.cache_ns, tuple(seq))
            m, node = (0, None) if self.disable_radix_cache else self._match_node(r.cache_ns, seq, len(seq) - 1)
            ext = 0 if key in rows else len(seq) - m  # a group's samples share one row (see _admit)
            if (new or self.running) and ext + expect(r) > room:
                break  # AddReqResult.NO_TOKEN: the rest wait
            if len(seq) > self.max_total_tokens - 1:
                self.waiting.popleft()
                r.abort_output = True
                self._finish(r, abort_reason(f"The input ({len(seq)} tokens) does not fit in the KV pool "
                                             f"({self.max_total_tokens} tokens, --max-total-tokens).", 400))
                continue
            self.waiting.popleft()
            self._lock(node, 1)  # held until _admit holds what it inserts
            r.cache_node, r.tree_len = node, 0
            new.append(r)
            r.forward_at = r.forward_at or time.perf_counter()
            rows.add(key)
            tokens += len(seq)
            extend += ext
            room -= ext + expect(r) * self.new_token_ratio
        if new and not self._make_room(extend):  # (room counted only what eviction can free)
            log.warning("KV pool: %d tokens free for a prefill of %d", self.pool_free(), extend)
        return new

    def _admit(self):
        """Prefill queued requests (FIFO, up to the running limit, the prefill token budget and the KV pool: _select)
        as one batch. Each
        starts from the longest cached prefix of its tokens in its namespace (at most all but its last token), so
        only the rest is computed; row i's cached KV sits left of column C, its new tokens end at the slab's end."""
        new = self._select()
        if not new:
            return
        self.prefilling = new
        seqs = [r.input_ids + r.output_ids for r in new]
        want_input_lp = [r.return_logprob and r.logprob_start_len >= 0 and not r.output_ids for r in new]
        # At most all but the last token is matched, and no further than logprob_start_len when input log-probs are
        # asked for (Req._compute_max_prefix_len): the logits after the cached part are computed.
        limits = [min(len(s) - 1, r.logprob_start_len) if w else len(s) - 1
                  for r, s, w in zip(new, seqs, want_input_lp)]
        # A request that wants its routed experts is prefilled in full (no cached prefix: its positions' routes are
        # all computed here; sglang keeps the cached tokens' routes beside their KV)
        full = [r.return_routed_experts and self.recorder is not None for r in new]
        # Requests with the same tokens in the same namespace (a group's samples: one prompt N times) share one row
        # of the forward; src[i] is request i's row. SGLang computes each (on a GPU the copies cost next to nothing,
        # here as much as the first); what a request sees (tokens, log-probs, cached_tokens) is the same.
        rows: dict = {}
        src, first = [], []  # request -> its row; row -> its first request
        for i, (r, s, w, lim, f) in enumerate(zip(new, seqs, want_input_lp, limits, full)):
            src.append(rows.setdefault((r.cache_ns, tuple(s), w, lim, f), len(rows)))
            if src[-1] == len(first):
                first.append(i)
        useqs = [seqs[i] for i in first]
        hits = [(0, None) if full[i] else self._cache_match(new[i].cache_ns, seqs[i], limits[i]) for i in first]
        cached = max(c for c, _ in hits)
        width = cached + max(len(s) - c for s, (c, _) in zip(useqs, hits))
        q = width - cached  # the columns this forward computes
        ids = torch.full((len(rows), q), self.pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), q), dtype=torch.long)
        kv = KVBatch.empty(self.num_layers, len(rows), width + KV_HEADROOM, self.device)
        for j, (s, (c, _)) in enumerate(zip(useqs, hits)):
            ids[j, q - (len(s) - c):] = torch.tensor(s[c:])
            pos[j, q - (len(s) - c):] = torch.arange(c, len(s))
            kv.mask[j, cached - c:cached] = 1
            kv.mask[j, width - (len(s) - c):width] = 1
        if cached:  # the slabs start with every row's cached KV (zeros where a row has less)
            for li in range(self.num_layers):
                k0 = next(e for c, e in hits if c)[li][0]
                kb = k0.new_zeros(len(rows), k0.shape[0], width + KV_HEADROOM, k0.shape[2])
                vb = torch.zeros_like(kb)
                for j, (c, e) in enumerate(hits):
                    if c:
                        kb[j, :, cached - c:cached], vb[j, :, cached - c:cached] = e[li]
                kv.layers[li] = _SlabLayer(kb, vb, cached, width + KV_HEADROOM, len(rows))
            kv.cache.layers = kv.layers
        logits = self._forward(ids.to(self.device), kv, pos.to(self.device), last_only=not any(want_input_lp))
        kv.next_pos = torch.tensor([len(s) for s in useqs], device=self.device)
        inserted: dict = {}  # row -> the tree node its tokens end at
        routed = self.recorder.take().view(len(rows), q, self.num_layers, -1) if self.recorder and any(
            r.return_routed_experts for r in new) else None
        for i, (r, s) in enumerate(zip(new, seqs)):
            if routed is not None and r.return_routed_experts:  # every position of s (a retracted one's again)
                r.routes = [routed[src[i], q - len(s):]]
            r.cached_tokens = hits[src[i]][0]
            if want_input_lp[i]:  # the row's computed columns: positions cached_tokens .. len(s) - 1
                self._input_logprobs(r, logits[src[i], q - (len(s) - r.cached_tokens):], s, r.cached_tokens)
            if first[src[i]] == i:
                inserted[src[i]] = self._cache_insert(r.cache_ns, s, kv, src[i])
            self._hold(r, inserted[src[i]], len(s) if inserted[src[i]] is not None else 0)
            if r.sp.sampling_seed is not None and r.generator is None:
                r.generator = torch.Generator(device=self.device).manual_seed(r.sp.sampling_seed)
            if r.sp.max_new_tokens <= len(r.output_ids):  # max_new_tokens 0 (or a retracted request at its limit)
                self._finish(r, {"type": "length", "length": r.sp.max_new_tokens})
        live = [i for i, r in enumerate(new) if r.finish is None]
        if not live:
            for r in new:
                self._release(r)
            self.prefilling = []
            return
        toks = self._sample_and_append([new[i] for i in live], logits[torch.tensor([src[i] for i in live]), -1])
        keep = [k for k, i in enumerate(live) if new[i].finish is None]  # positions in live
        rows_of = [src[live[k]] for k in keep]  # their rows of kv, a shared row once per request
        if keep and not (self.kv is not None and self.kv.join(kv, rows_of)):
            parts = [(self.kv, list(range(len(self.running))))] if self.kv is not None else []
            self.kv = KVBatch.combine(parts + [(kv, rows_of)], self._row_cap(len(self.running) + len(keep)))
        if keep:  # the joined rows are the last ones; each has its own first token
            self.kv.last_tok[self.kv.rows - len(keep):] = toks[torch.tensor(keep, device=self.device)]
        self.running += [new[live[k]] for k in keep]
        for r in new:
            if r.finish is not None:  # finished by its first token: its prompt stays cached, unheld
                self._release(r)
        self.prefilling = []

    # -- the prefix cache (SGLang's radix cache, mem_cache/radix_cache.py: a token tree per namespace) -------------
    # The tree and the running requests share one KV pool of max_total_tokens tokens (SGLang's token_to_kv_pool):
    # cache_tokens in the tree, of which protected_tokens are held by running requests (lock_ref > 0), and each
    # running request's own tokens past its tree_len. Eviction runs only when a prefill or a decode step lacks
    # slots, sized by what it lacks; it pops the least recently used of the evictable leaves, which are kept
    # current on every change (RadixCache.evictable_leaves, _update_leaf_status) and ordered by a lazy heap: an
    # eviction costs O(evicted log n), not a walk of the tree.
    def _cache_match(self, ns: tuple, seq: list, limit: int) -> tuple:
        """(length, per-layer (K, V) [H, length, D]) of the longest cached prefix of seq[:limit] in namespace ns;
        (0, None) when none. The walk of RadixCache._match_prefix_helper: whole nodes, then the matched part of the
        node where seq diverges (split there, as SGLang splits, so the next walk ends on a node boundary)."""
        node, pos, parts = self.radix.get(ns), 0, []
        key = seq[:limit]
        self._tick += 1
        while node is not None and pos < len(key) and key[pos] in node.children:
            child = node.children[key[pos]]
            m = _common_len(child.key, key, pos)
            if m < len(child.key):
                child = self._split(child, m)
            self._touch(child)
            parts.append(child.kv)
            node, pos = child, pos + m
        if not pos:
            return 0, None
        return pos, [(torch.cat([p[li][0] for p in parts], 1), torch.cat([p[li][1] for p in parts], 1))
                     for li in range(self.num_layers)]

    def _match_node(self, ns: tuple, seq: list, limit: int) -> tuple:
        """(length, node) of the longest cached prefix of seq[:limit], changing nothing: the node is the last one
        the prefix enters (it may go on past the prefix); (0, None) when none."""
        node, pos = self.radix.get(ns), 0
        last = None
        while node is not None and pos < limit and seq[pos] in node.children:
            child = node.children[seq[pos]]
            m = _common_len(child.key, seq[:limit], pos)
            last, node, pos = child, child, pos + m
            if m < len(child.key):
                break
        return pos, last

    def _split(self, child: "_Node", m: int) -> "_Node":
        """RadixCache._split_node: child's first m tokens become a new node above it (holding the same locks)."""
        top = _Node(child.key[:m], [(k[:, :m].clone(), v[:, :m].clone()) for k, v in child.kv], child.parent)
        top.children, top.last_access, top.lock_ref = {child.key[m]: child}, child.last_access, child.lock_ref
        child.parent.children[child.key[0]] = top
        child.key, child.parent = child.key[m:], top
        child.kv = [(k[:, m:].clone(), v[:, m:].clone()) for k, v in child.kv]
        return top

    def _touch(self, node: "_Node") -> None:
        """A new access tick; an evictable leaf gets a heap entry under it (its old entry goes stale)."""
        node.last_access = self._tick
        if node in self.evictable_leaves:
            self._push(node)

    def _push(self, node: "_Node") -> None:
        self._seq += 1
        heapq.heappush(self._heap, (node.last_access, self._seq, node))
        if len(self._heap) > 2 * len(self.evictable_leaves) + 64:  # mostly stale: rebuild (amortised O(1) a push)
            self._heap = [(n.last_access, i, n) for i, n in enumerate(self.evictable_leaves)]
            heapq.heapify(self._heap)

    def _update_leaf(self, node: "_Node") -> None:
        """RadixCache._update_leaf_status: node is an evictable leaf iff it has no children and no lock."""
        if node.parent is None:  # a root
            return
        if node.children or node.lock_ref > 0:
            self.evictable_leaves.discard(node)
        elif node not in self.evictable_leaves:
            self.evictable_leaves.add(node)
            self._push(node)

    def _lock(self, node: Optional["_Node"], delta: int) -> None:
        """RadixCache.inc_lock_ref (delta 1) / dec_lock_ref (-1): node and its ancestors are held by one more / one
        fewer running request; a node's tokens count as protected while any holds it."""
        while node is not None and node.parent is not None:
            if node.lock_ref == (0 if delta > 0 else 1):
                self.protected_tokens += len(node.key) * delta
            node.lock_ref += delta
            self._update_leaf(node)
            node = node.parent

    def _cache_insert(self, ns: tuple, seq: list, kv: KVBatch, row: int) -> Optional["_Node"]:
        """RadixCache.insert of row `row` of kv (its real columns hold the KV of seq); returns the node seq ends
        at (None with the cache disabled)."""
        if self.disable_radix_cache or not seq:
            return None

        def take(pos):
            cols = kv.mask[row, :kv.n].nonzero()[:, 0]
            assert len(cols) == len(seq), (len(cols), len(seq))
            return [(layer.kb[row, :, cols[pos:]].clone(), layer.vb[row, :, cols[pos:]].clone())
                    for layer in kv.layers]
        return self._tree_insert(ns, seq, take)

    def _tree_insert(self, ns: tuple, seq: list, take: Callable[[int], list]) -> "_Node":
        """RadixCache._insert_helper: the tokens past the longest cached prefix of seq become a new leaf with the KV
        take(pos) gives for seq[pos:] (the cached part keeps its KV). Nothing is evicted here: the tokens were the
        request's own in the pool already."""
        node = self.radix.setdefault(ns, _Node([], [], None))
        pos = 0
        self._tick += 1
        while pos < len(seq) and seq[pos] in node.children:
            child = node.children[seq[pos]]
            m = _common_len(child.key, seq, pos)
            if m < len(child.key):
                child = self._split(child, m)
            self._touch(child)
            node, pos = child, pos + m
        if pos < len(seq):
            leaf = _Node(seq[pos:], take(pos), node)
            leaf.last_access = self._tick
            node.children[seq[pos]] = leaf
            self.cache_tokens += len(leaf.key)
            self._update_leaf(node)
            self._update_leaf(leaf)
            node = leaf
        return node

    def _evict(self, tokens: int) -> int:
        """RadixCache.evict: free least recently used evictable leaves (a parent left childless and unheld becomes
        one) until `tokens` tokens are freed or none is left; returns the tokens freed."""
        freed = 0
        while freed < tokens and self._heap:
            tick, _, n = heapq.heappop(self._heap)
            self.evict_pops += 1
            if n.last_access != tick or n not in self.evictable_leaves:
                continue  # stale: touched since, or no longer an evictable leaf
            self.evictable_leaves.discard(n)
            del n.parent.children[n.key[0]]
            freed += len(n.key)
            self.cache_tokens -= len(n.key)
            self.evicted_nodes += 1
            n.kv = []
            self._update_leaf(n.parent)
        return freed

    def _cache_clear(self) -> None:
        self.radix, self.cache_tokens, self._tick = {}, 0, 0  # namespace -> root _Node; tokens held; access clock
        self.protected_tokens = 0  # of cache_tokens, those in nodes running requests hold
        self.evictable_leaves: set = set()  # unheld childless nodes (RadixCache.evictable_leaves)
        self._heap, self._seq = [], 0  # (last_access, seq, node) of evictable leaves, lazily invalidated

    # -- the KV pool ------------------------------------------------------------------------------------------
    @staticmethod
    def _own(r: Req) -> int:
        """Pool tokens a running request holds outside the tree: its prompt and outputs whose KV exists (all but
        the last output token, not yet forwarded), less its tree_len."""
        return len(r.input_ids) + max(len(r.output_ids) - 1, 0) - r.tree_len

    def pool_free(self, reqs: Optional[list] = None) -> int:
        """Free KV-pool tokens with `reqs` (default: the running batch) holding their own."""
        return self.max_total_tokens - self.cache_tokens - sum(map(self._own, self.running if reqs is None else reqs))

    def _make_room(self, tokens: int, reqs: Optional[list] = None) -> bool:
        """TokenToKVPoolAllocator's eviction before an allocation: evict the tree's least recently used leaves
        until `tokens` slots are free; False when even then they are not."""
        short = tokens - self.pool_free(reqs)
        if short > 0:
            self._evict(short)
        return self.pool_free(reqs) >= tokens

    def _hold(self, r: Req, node: Optional["_Node"], tree_len: int) -> None:
        """r now holds `node` (its first tree_len tokens are in the tree), in place of what it held."""
        self._lock(node, 1)
        self._lock(r.cache_node, -1)
        r.cache_node, r.tree_len = node, tree_len

    def _release(self, r: Req) -> None:
        self._lock(r.cache_node, -1)
        r.cache_node, r.tree_len = None, 0

    def _decode(self):
        if not self._make_room(len(self.running)):  # one slot per request (ScheduleBatch.check_decode_mem)
            self._retract_decode()
            if not self.running:
                return
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        if self.kv.n + 1 > self.kv.cap:  # out of columns: rebuild, dropping those no row uses any more
            self.kv = KVBatch.combine([(self.kv, list(range(len(self.running))))], self._row_cap(len(self.running)))
        kv = self.kv
        kv.mask[:, kv.n] = 1
        logits = self._forward(kv.last_tok[:, None], kv, kv.next_pos[:, None], last_only=True)
        if self.recorder and any(r.return_routed_experts for r in self.running):
            routed = self.recorder.take()  # row i: the route of running[i]'s last token
            for i, r in enumerate(self.running):
                if r.return_routed_experts:
                    r.routes.append(routed[i:i + 1])
        kv.next_pos = kv.next_pos + 1
        kv.last_tok = self._sample_and_append(self.running, logits[:, -1])
        dead = [i for i, r in enumerate(self.running) if r.finish is not None]
        if dead:
            self._remove(dead)

    def _retract_decode(self) -> None:
        """Scheduler.update_running_batch when the pool lacks a slot per running request (0.5.23
        schedule_batch.py: ScheduleBatch.retract_decode, _get_decode_retraction_order, release_req): requests are
        retracted in order, fewest output tokens first (then the longest prompt), until the rest fit, always keeping
        one; each one's KV is freed, not cached, and RETRACT_DECODE_STEPS tokens per request left are evicted from
        the tree at once; the last one aborts (500) if even it does not fit. A retracted request keeps its output
        tokens (recomputed with its prompt when it is admitted again), counts a retraction and goes to the end of
        the queue (_add_request_to_queue(is_retracted=True): a full queue aborts it with 503); new_token_ratio is
        re-estimated from the requests left."""
        order = sorted(range(len(self.running)), key=lambda i: (len(self.running[i].output_ids),
                                                               -len(self.running[i].input_ids)), reverse=True)
        retracted, aborted = [], []
        while True:
            if len(order) == 1:
                break
            i = order.pop()
            self._release(self.running[i])
            retracted.append(i)
            self._evict(len(order) * RETRACT_DECODE_STEPS)
            if self._make_room(len(order), [self.running[j] for j in order]):
                break
        if len(order) == 1 and not self._make_room(1, [self.running[order[0]]]):
            aborted.append(order.pop())
            self.running[aborted[0]].abort_output = True
            self._finish(self.running[aborted[0]], abort_reason(OOM_LAST, 500))
        out = [self.running[i] for i in retracted]
        self._remove(retracted + aborted, cache=False)
        left, old_ratio = self.running, self.new_token_ratio
        self.new_token_ratio = min(1.0, (sum(len(r.output_ids) for r in left) + RETRACT_DECODE_STEPS * len(left))
                                   / (sum(r.sp.max_new_tokens for r in left) + 1))
        log.warning("KV cache pool is full. Retract requests. #retracted_reqs: %d, #new_token_ratio: %.4f -> %.4f",
                    len(out), old_ratio, self.new_token_ratio)
        self.retracted_total += len(out)
        for r in out:
            r.num_retractions += 1
            r.routes = []  # (Req.reset_for_retract: routed_experts = None; recomputed with the prompt)
            self._enqueue(r)

    def _remove(self, dead: list, cache: bool = True):
        """Drop rows `dead` of the running batch (finished or aborted), in place, caching each one's KV first: its
        prompt and all but its last output token, the last one never having been forwarded (0.5.23's
        release_kv_cache(checkpoint=True) of a finished request; a retracted one, cache=False, is not cached:
        release_req); each lets go of the tree nodes it held."""
        for i in dead:
            r = self.running[i]
            if cache:
                self._cache_insert(r.cache_ns, r.input_ids + r.output_ids[:-1], self.kv, i)
            self._release(r)
        if len(dead) == len(self.running):
            self.kv, self.running = None, []
        else:
            self.running = [self.running[i] for i in self.kv.remove(dead)]

    def _row_cap(self, rows: int) -> int:
        """Rows a rebuilt batch has room for: twice its rows (joins then rarely rebuild), within the running limit."""
        return min(self.max_running, max(2 * rows, 16))

    # -- sampling -----------------------------------------------------------------------------------------------
    def _sample_and_append(self, reqs: list, logits: torch.Tensor) -> torch.Tensor:
        """Draw one token per row, append it (with log-prob, weight version) to its request, finish those that stop."""
        banned = [r.sp.stop_token_ids + ([] if r.sp.ignore_eos else self.eos_ids)
                  if len(r.output_ids) < r.sp.min_new_tokens else [] for r in reqs]
        logp, toks = sample(logits, [r.sp for r in reqs], [r.generator for r in reqs], banned)
        chosen = logp.gather(1, toks[:, None])[:, 0]
        host = torch.stack([toks.double(), chosen.double()]).cpu().tolist()  # one device->host copy per step
        k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        if k:
            tv, ti = (t.cpu().tolist() for t in logp.topk(min(k, logp.shape[1]), dim=-1))
        for i, r in enumerate(reqs):
            top = list(zip(tv[i], ti[i]))[:r.top_logprobs_num] if k else None
            if r.return_logprob and r.token_ids_logprob is not None:  # (before _append, which may notify)
                r.output_token_ids_logprobs.append(list(zip(logp[i, r.token_ids_logprob].cpu().tolist(),
                                                            r.token_ids_logprob)))
            self._append(r, int(host[0][i]), host[1][i], top)
        return toks

    def _input_logprobs(self, r: Req, logits: torch.Tensor, seq: list, c: int):
        """Prompt log-probs from logprob_start_len (logits: positions c..len-1, c <= logprob_start_len): token j's
        under the prefix before it, with None at logprob_start_len itself, as 0.5.23 lays out input_token_logprobs,
        input_top_logprobs and input_token_ids_logprobs (logprob_result_processor.py: [None] + values[:-1])."""
        start = r.logprob_start_len
        # at temperature 1 whatever the request's: 0.5.23 takes the prompt's log-probs from the logits as they come out
        # of the lm_head (layers/logprob_processor.py: LogprobProcessor._forward_by_chunk divides by no temperature)
        lp = torch.log_softmax(logits[start - c:len(seq) - 1 - c].float(), -1)
        tgt = torch.tensor(seq[start + 1:], device=lp.device, dtype=torch.long)
        vals = [None] + lp.gather(1, tgt[:, None])[:, 0].cpu().tolist()
        r.input_logprobs = list(zip(vals, seq[start:]))
        if r.top_logprobs_num:
            tv, ti = (t.cpu().tolist() for t in lp.topk(min(r.top_logprobs_num, lp.shape[1]), dim=-1))
            r.input_top_logprobs = [None] + [list(zip(v, i)) for v, i in zip(tv, ti)]
        if r.token_ids_logprob is not None:
            ids = r.token_ids_logprob
            r.input_token_ids_logprobs = [None] + [list(zip(v, ids)) for v in lp[:, ids].cpu().tolist()]

    def _append(self, r: Req, tok: int, lp: float, top: Optional[list]):
        n = len(r.output_ids)
        r.output_ids.append(tok)
        r.logprobs.append(lp)
        if r.return_logprob and r.top_logprobs_num:
            r.top_logprobs.append(top or [])
        v = self.weight_version
        if r.spans and r.spans[-1][0] == v:
            r.spans[-1][2] = n + 1
        else:
            r.spans.append([v, n, n + 1])
        self.generated_tokens += 1
        self.last_output = time.perf_counter()
        # 0.5.23's order (schedule_batch.py: Req.update_finish_state): an abort that came while it ran (its one more
        # forward pass, scheduler.py abort_request), stop strings, stop tokens / eos (unless ignore_eos), the length
        # last: an eos drawn as the last allowed token is a stop, not a length finish.
        reason = r.to_finish or self._stop_str(r)
        if reason is None and not r.sp.ignore_eos and (tok in r.sp.stop_token_ids or tok in self.eos_ids):
            reason = {"type": "stop", "matched": tok}
        if reason is None and n + 1 >= r.sp.max_new_tokens:
            reason = {"type": "length", "length": r.sp.max_new_tokens}
        if reason is not None:
            self._finish(r, reason)
        elif (n + 1) % (r.sp.stream_interval if r.stream else FORCE_STREAM_INTERVAL) == 0:
            r.notify(n + 1, False)

    def _stop_str(self, r: Req) -> Optional[dict]:
        if not r.sp.stop_strs:
            return None
        width = max(len(s) for s in r.sp.stop_strs) + 1
        tail = self.tokenizer.decode(r.output_ids[-width:], skip_special_tokens=r.sp.skip_special_tokens)
        matched = next((s for s in r.sp.stop_strs if s in tail), None)
        return None if matched is None else {"type": "stop", "matched": matched}

    def _finish(self, r: Req, reason: dict):
        r.finish, r.finished_at = reason, time.perf_counter()
        r.notify(len(r.output_ids), True)

    # -- control calls (run on the model thread via call()) -----------------------------------------------------
    def abort(self, rid: str = "", abort_all: bool = False, exact: bool = False, reason: Optional[dict] = None) -> int:
        """Abort (and count) requests whose rid starts with `rid` (equals it when exact; all with abort_all) with
        `reason` (default: queued ones "Abort in waiting queue", running ones "Aborted"). Paused in place, a running
        one is only marked: SGLang's aborted request "still runs one decode forward pass" (managers/scheduler.py),
        which a paused scheduler runs after continue."""
        def hit(r):
            return abort_all or (r.rid == rid if exact else (rid != "" and r.rid.startswith(rid)))
        queued = [r for r in self.waiting if hit(r)]
        self.waiting = collections.deque(r for r in self.waiting if not hit(r))
        for r in queued:  # a retracted one too: its routes went with its KV (Req.reset_for_retract)
            r.abort_output = True
            self._finish(r, reason or abort_reason("Abort in waiting queue"))
        n, dead = len(queued) + sum(map(hit, self.running)), []
        for i, r in enumerate(self.running):
            if hit(r) and self.paused != "in_place":
                self._finish(r, reason or abort_reason("Aborted"))
                dead.append(i)
            elif hit(r):  # paused in place: finished by its next forward pass
                r.to_finish = reason or abort_reason("Aborted")
        if dead:
            self._remove(dead)
        return n

    def pause(self, mode: str) -> int:
        """SGLang's pause modes: abort (return everything in flight), retract (keep requests, drop their KV; they
        are recomputed after continue), in_place (keep requests and KV). Returns the number of requests kept.
        Mode abort is an abort-all and nothing else (0.5.23 tokenizer_manager.py pause_generation sends the
        scheduler only AbortReq(abort_all); managers/scheduler.py pause_generation takes in_place and retract): a
        scheduler paused before stays paused (running requests paused in place are finished by their next forward,
        after continue), and one that was not runs whatever reaches it until the next abort-all."""
        if mode == "abort":
            self.abort(abort_all=True)
            return len(self.running) + len(self.waiting)
        if mode == "retract":  # 0.5.23 pause_generation: each to the end of the queue (_add_request_to_queue)
            retracted, self.running, self.kv = self.running, [], None
            self.paused = mode  # (a paused scheduler admits nothing: the queue limit counts every waiting request)
            for r in retracted:
                self._release(r)
                r.num_retractions += 1
                self._enqueue(r)
        self.paused = mode
        return len(self.running) + len(self.waiting)

    def resume_generation(self):
        self.paused = None

    def flush_cache(self) -> bool:
        """Refused while requests run, or wait while not paused (SGLang: is_fully_idle(ignore_waiting=paused)), so
        it works after a retract pause (the kept requests wait) but not after an in_place one."""
        if self.running or (self.waiting and self.paused is None):
            return False
        self._cache_clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def set_version(self, version: str, abort_all: bool):
        if abort_all:
            self.abort(abort_all=True)
        self.weight_version = version

    def load_from_disk(self, path: str, version: Optional[str], dtype: str) -> None:
        """New weights from a checkpoint directory's safetensors files, loaded into the served model by checkpoint
        names (load_tensors), as 0.5.23's update_weights_from_disk feeds the files to the same model's load_weights;
        requests kept by a pause continue with them (their KV cache stays)."""
        from safetensors.torch import load_file
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise BadRequest(f"model_path {path} has no *.safetensors files")
        for f in files:
            self.load_tensors(list(load_file(str(f)).items()), None)
        if version is not None:
            self.weight_version = version

    def load_tensors(self, named: list, version: Optional[str]):
        """Copy received (name, tensor) pairs, named as in the checkpoint (save_pretrained), into the served model's
        parameters (checkpoint_targets). A name the model does not know is skipped silently, as sglang 0.5.23
        models/qwen3_moe.py Qwen3MoeForCausalLM.load_weights does (`if name not in params_dict: continue`), so a
        trainer that pushes its own fused names shows up as a log-prob gap, not as an error; a known name with
        another shape is refused (0.5.23's weight_loader asserts the shapes)."""
        if self._targets is None:
            self._targets = checkpoint_targets(self.model)
        known = [(n, t, self._targets[n]()) for n, t in named if n in self._targets]
        bad = [f"{n} {tuple(t.shape)} vs {tuple(d.shape)}" for n, t, d in known if d.shape != t.shape]
        if bad:
            raise BadRequest(f"field `names`: shape mismatches {bad[:5]}")
        with torch.no_grad():
            for _, t, d in known:
                d.copy_(t)
        if version is not None:
            self.weight_version = version

    def release(self, tags: list) -> None:
        if self.running:
            raise BadRequest(f"{len(self.running)} requests are running; pause generation before releasing memory")
        if "weights" in tags and self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        if "kv_cache" in tags:
            self._cache_clear()
        self.released |= set(tags)

    def resume_memory(self, tags: list) -> None:
        if "weights" in tags and "weights" in self.released:
            self.model.to(self.device)
            if not self.weights_cpu_backup:
                self._undefined_weights()
        self.released -= set(tags)

    def _undefined_weights(self) -> None:
        """SGLang's memory saver gives the weights region back re-mapped, contents undefined, unless the server
        runs with --enable-weights-cpu-backup (model_runner_components/load_model_utils.py: the weights region's
        enable_cpu_backup; sgl-project/sglang#15246). The region holds the module buffers too (rotary caches),
        which no weight update can restore: load_weights skips names it does not know. NaN stands for undefined
        here, so whatever the trainer does not push back shows up as NaN log-probs, not as a silent drift."""
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                t.fill_(float("nan") if t.is_floating_point() else 0)
