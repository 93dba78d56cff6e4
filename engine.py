"""engine.py: an SGLang-compatible HTTP inference server around any transformers causal LM.

It serves the subset of SGLang's HTTP API that RL post-training uses (../shared/sglang_api.md: /generate, aborts,
pause/continue, weight updates from disk, over a torch.distributed group or from shared tensors (colocate), weight
versions, memory release, loads), so rollout.py and train.py run one code path against real SGLang or this engine.

Run:   python engine.py --model-path DIR --port 30000 [--max-running-requests 64] [--weight-version 0]
                        [--device auto] [--dtype auto] [--host 127.0.0.1] [--api-key KEY] [--max-request-mb 32]
From Python (tests, benchmarks): `url, handle = engine.launch(model_path, max_running_requests=8)`; `handle.stop()`.
Trainer side of the weight-update group: `pg = engine.init_weight_update_group(addr, port, 0, world_size,
group_name, backend)` then `engine.broadcast_tensors(pg, tensors)` while POSTing /update_weights_from_distributed;
colocate: POST /update_weights_from_tensor, `serialized_named_tensors=[weight_sync.serialize_named_tensors(named)]`.

Log-prob convention (the one losses.token_logprobs uses): `output_token_logprobs` holds, per sampled token,
log_softmax(logits / temperature)[token] in float32, with temperature 1 for greedy requests (temperature < 1e-6, as
SGLang, which turns greedy into temperature 1 + top_k 1). top_p / top_k / min_p and the min_new_tokens ban change
which token is drawn, never the reported log-prob: RL runs sample with top_p=1, top_k=-1 so that it is the
probability the token was drawn with.

How it works: one model thread owns the model and all request state. Each iteration it runs the control calls the
HTTP handlers queued, prefills newly admitted requests as one batch, and advances ALL running requests (at most
--max-running-requests; the rest wait in a FIFO queue) with ONE batched forward of one token each. The KV cache is
one left-padded [rows, H, capacity, D] slab per layer with an attention mask; requests join by writing their
prefilled rows into spare rows and leave by moving the last row into their place (KVBatch). The HTTP side (aiohttp)
only parses, validates and formats, refuses oversized bodies (413, before reading) and texts (before tokenizing),
and parses large ones off the event loop.

Strict like SGLang 0.5.23 where clients go wrong easily (../shared/sglang_api.md "Facts";
tests/test_sglang_conformance.py names each source): an abort (forwarded once per registered rid, prefix-matched) is
lost while its request waits at the pause gate, and one abandoned there still runs after continue; pause "abort"
repeats until no request holds the lock; /health generates through the gate; the prefix cache ignores the weight
version (/flush_cache or a new extra_key / cache_salt keeps old KV out); schema errors are 422, bad values 400;
group and tensor weight updates need a begin/end_weight_update session; --api-key guards all but /health*, /metrics.

Simplifications against SGLang: the prefix cache stores each prefilled sequence whole (matched when it is a request's
tokens or a prefix of them; output tokens are not cached), LRU in PREFIX_CACHE_TOKENS tokens; batches do not stream;
no penalties, logit_bias, grammars or custom logit processors (accepted at their defaults, else 400);
`spaces_between_special_tokens` is ignored; full-attention decoders only; released weights stay in host memory
(generation waits until they are resumed).
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import datetime
import inspect
import io
import json
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

import orjson
import torch
import torch.distributed as dist
from aiohttp import web
from transformers.cache_utils import DynamicCache, DynamicLayer

log = logging.getLogger("engine")

GREEDY_EPS = 1e-6  # temperature below this is greedy (SGLang's _SAMPLING_EPS, sampling/sampling_params.py)
KV_HEADROOM = 16  # extra slab columns allocated when a KV slab is (re)built, so most steps append in place
SGLANG_VERSION = "0.5.23"  # the SGLang release whose HTTP API this engine serves (/server_info "version")
DEFAULT_MAX_RUNNING = 64  # requests decoded together without --max-running-requests (SGLang sizes it from its KV pool)
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")  # SGLang 0.5.23's message
PAUSE_ABORT_POLL_S = 1.0  # pause mode abort: repeat abort-all at this interval until no request holds the lock
PREFIX_CACHE_TOKENS = 1 << 16  # prompt tokens the prefix cache holds (least recently used entries go first)
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))  # /health: 503 after this
HEALTH_GENERATES = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1") not in ("0", "false")  # /health
REQUEST_STATE_WAIT_TIMEOUT_S = float(os.environ.get("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", 4))  # how soon a
# request whose client went away is noticed (tokenizer_manager.py polls is_disconnected at this interval)
SESSION_REQUIRED = ("update_weights_from_distributed must run between begin_weight_update() and "
                    "end_weight_update()")  # SGLang 0.5.23's message (scheduler_components/weight_updater.py)

# SGLang's sampling_params fields and defaults (srt/sampling/sampling_params.py). Every key is validated below.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "stop": None,
    "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "min_new_tokens": 0, "n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "sampling_seed": None, "logit_bias": None, "json_schema": None, "regex": None,
    "ebnf": None, "stop_regex": None, "custom_params": None, "stream_interval": None, "structural_tag": None}
# Fields engine.py implements only at their default value (HTTP 400 otherwise, naming the field).
DEFAULT_ONLY = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "json_schema",
                "regex", "ebnf", "stop_regex", "custom_params", "structural_tag")
RELEASE_TAGS = ("weights", "kv_cache", "cuda_graph")


class BadRequest(ValueError):
    """A request field is missing, of the wrong type or out of range: answered with HTTP 400 and this message."""


class SchemaError(BadRequest):
    """A /generate field of the wrong JSON type, or a body that is not JSON: HTTP 422, as FastAPI's validation of
    GenerateReqInput answers (entrypoints/http_server.py), where values out of range are 400."""


# -- Request parsing and validation --------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_is_str, _is_bool = (lambda v: isinstance(v, str)), (lambda v: isinstance(v, bool))


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """One value that passes check, or a list of them (a batch's per-item field)."""
    return lambda v: check(v) or (isinstance(v, list) and all(map(check, v)))


def _all_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A list of values that each pass check."""
    return lambda v: isinstance(v, list) and all(map(check, v))


def _field(body: dict, name: str, default, check: Callable[[Any], bool], expected: str, where: str = ""):
    """body[name], `default` when absent (null too when the default is null); BadRequest when `check` fails."""
    v = body.get(name, default)
    if v is None and default is None:
        return None
    if not check(v):
        raise BadRequest(f"field `{where}{name}` must be {expected}, got {json.dumps(v)[:80]}")
    return v


def _required(body: dict, name: str, check: Callable[[Any], bool], expected: str):
    if body.get(name) is None:
        raise BadRequest(f"field `{name}` is required")
    return _field(body, name, None, check, expected)


def _flag(body: dict, name: str, default: bool, where: str = "") -> bool:
    return _field(body, name, default, _is_bool, "true or false", where)


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


def parse_sampling_params(sp: Any, vocab_size: int) -> SamplingParams:
    """Validate an SGLang sampling_params dict; unknown keys are rejected the way SGLang rejects them."""
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise BadRequest("field `sampling_params` must be a JSON object")
    for k in sp:
        if k not in SAMPLING_DEFAULTS:
            raise BadRequest(f"unknown field `{k}`, expected one of " + ", ".join(f"`{n}`" for n in SAMPLING_DEFAULTS))
    for k in DEFAULT_ONLY:
        if k in sp and sp[k] is not None and sp[k] != SAMPLING_DEFAULTS[k]:
            raise BadRequest(f"field `sampling_params.{k}` is not supported by engine.py; only its default "
                             f"{json.dumps(SAMPLING_DEFAULTS[k])} is accepted")
    def g(name, check, expected):
        return _field(sp, name, SAMPLING_DEFAULTS[name], check, expected, "sampling_params.")
    max_new = g("max_new_tokens", lambda v: v is None or (_is_int(v) and v >= 0), "an integer >= 0 or null")
    temperature = g("temperature", lambda v: _is_num(v) and v >= 0, "a number >= 0")
    top_p = g("top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]")
    top_k = g("top_k", lambda v: _is_int(v) and (v == -1 or v >= 1), "-1 (disabled) or an integer >= 1")
    min_p = g("min_p", lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]")
    stop = g("stop", _list_of(_is_str), "a string or a list of strings")
    stop_ids = g("stop_token_ids", _all_of(lambda t: _is_int(t) and 0 <= t < vocab_size),
                 f"a list of token ids in [0, {vocab_size})")
    flags = {name: _flag(sp, name, SAMPLING_DEFAULTS[name], "sampling_params.")
             for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim")}
    _flag(sp, "spaces_between_special_tokens", True, "sampling_params.")  # validated, then ignored
    min_new = g("min_new_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    seed = g("sampling_seed", _is_int, "an integer")
    interval = g("stream_interval", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
    if max_new is not None and min_new > max_new:
        raise BadRequest(f"field `sampling_params.min_new_tokens` ({min_new}) must be <= max_new_tokens ({max_new})")
    greedy = temperature < GREEDY_EPS
    return SamplingParams(
        max_new_tokens=max_new, temperature=1.0 if greedy else float(temperature), greedy=greedy, top_p=float(top_p),
        top_k=top_k, min_p=float(min_p), stop_strs=[stop] if isinstance(stop, str) else [s for s in (stop or []) if s],
        stop_token_ids=list(stop_ids or []), min_new_tokens=min_new, sampling_seed=seed, stream_interval=interval or 1,
        **flags)


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
    stream: bool = False
    cache_ns: tuple = (None, None)  # (extra_key, cache_salt): the prefix cache's namespace of this request
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    created: float = field(default_factory=time.perf_counter)
    output_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # float per output token
    top_logprobs: list = field(default_factory=list)  # per output token: list of (logprob, id)
    input_logprobs: list = field(default_factory=list)  # (logprob|None, id) per input token from logprob_start_len
    spans: list = field(default_factory=list)  # [version, start, end) over output token indices
    finish: Optional[dict] = None  # SGLang finish_reason once finished
    finished_at: float = 0.0
    num_retractions: int = 0
    abort_sent: bool = False  # an /abort_request for this rid was forwarded (SGLang ignores repeats)
    to_finish: Optional[dict] = None  # aborted while running on a paused server: finished by its next forward
    generator: Optional[torch.Generator] = None
    notify: Callable[[int, bool], None] = lambda n, final: None  # (tokens so far, final) -> None, thread-safe


# The JSON types of GenerateReqInput's fields (managers/io_struct.py): a value of another type is HTTP 422.
GENERATE_SCHEMA: dict[str, Callable[[Any], bool]] = {
    "text": _list_of(_is_str), "input_ids": _list_of(_all_of(_is_int)), "rid": _list_of(_is_str),
    "sampling_params": _list_of(lambda v: isinstance(v, dict)), "return_logprob": _list_of(_is_bool),
    "logprob_start_len": _list_of(_is_int), "top_logprobs_num": _list_of(_is_int), "return_text_in_logprobs": _is_bool,
    "stream": _is_bool, "extra_key": _list_of(_is_str), "cache_salt": _list_of(_is_str)}
PER_ITEM = ("rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "extra_key",
            "cache_salt")  # fields a batch gives either once for every item or as a list, one per item


def parse_generate(body: dict, tokenizer, vocab_size: int, context_len: int,
                   token_chars: int) -> tuple[list, bool, int]:
    """(requests, listed, n) of a /generate body, as 0.5.23 normalises GenerateReqInput (managers/io_struct.py):
    one prompt, or a batch (`input_ids` a list of lists or `text` a list) with unique rids (a string rid is a prefix:
    rid_0, rid_1, ...) and other per-item fields given once or as a list; `listed`: the reply is a list. With
    sampling_params.n > 1 (one n for all) each prompt is sent n times, prompt-major, each with a fresh random rid."""
    for name, ok in GENERATE_SCHEMA.items():
        if body.get(name) is not None and not ok(body[name]):
            raise SchemaError(f"field `{name}` has the wrong type: {json.dumps(body[name])[:80]}")
    text, ids = body.get("text"), body.get("input_ids")
    batch = isinstance(text, list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))
    if not batch:
        items = [body]
    else:
        size = len(text if text is not None else ids)
        if not size:
            raise BadRequest("field `input_ids`/`text` is an empty batch")
        rid = body.get("rid")
        if isinstance(rid, str):
            body = {**body, "rid": [f"{rid}_{i}" for i in range(size)]}
        elif isinstance(rid, list) and (len(rid) != size or len(set(rid)) != size):
            raise BadRequest(f"field `rid` must hold {size} unique strings, one per item of the batch")
        for k in PER_ITEM:
            if isinstance(body.get(k), list) and len(body[k]) != size:
                raise BadRequest(f"field `{k}` holds {len(body[k])} values for a batch of {size}")
        items = [{**body, "text" if text is not None else "input_ids": (text if text is not None else ids)[i],
                  **{k: body[k][i] for k in PER_ITEM if isinstance(body.get(k), list)}} for i in range(size)]
    ns = {(it.get("sampling_params") or {}).get("n", 1) for it in items}
    n = ns.pop() if len(ns) == 1 else None
    if not (_is_int(n) and n >= 1):
        raise BadRequest("field `sampling_params.n` must be one integer >= 1, the same for every item")
    parsed: dict = {}  # one parse per sampling_params object: a batch that gives one for all items parses it once

    def params(it: dict) -> SamplingParams:
        raw = it.get("sampling_params")
        if id(raw) not in parsed:
            parsed[id(raw)] = parse_sampling_params({k: v for k, v in (raw or {}).items() if k != "n"}, vocab_size)
        return parsed[id(raw)]  # (shared: read-only once parsed; _parse_one replaces, never changes it)
    reqs = [_parse_one({**it, **({"rid": uuid.uuid4().hex} if n > 1 else {})}, params(it), tokenizer, vocab_size,
                       context_len, token_chars) for it in items for _ in range(n)]
    return reqs, batch or n > 1, n


def _parse_one(body: dict, sp: SamplingParams, tokenizer, vocab_size: int, context_len: int, token_chars: int) -> Req:
    """A validated Req from one item of a /generate body. Sizes are checked before the work they bound: a prompt
    too long for the context is refused before its text is tokenized or its ids are checked one by one."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("exactly one of fields `input_ids` and `text` is required")
    if text is not None:  # (GENERATE_SCHEMA made text a string and input_ids a list of integers)
        if len(text) > context_len * token_chars:
            raise BadRequest(f"field `text` has {len(text)} characters, more than the model's context length of "
                             f"{context_len} tokens can hold (a token is at most {token_chars} characters)")
        ids = tokenizer.encode(text)
    if len(ids) >= context_len:
        raise BadRequest(f"field `{'input_ids' if text is None else 'text'}` has {len(ids)} tokens; the model's "
                         f"context length is {context_len}")
    if text is None and not all(0 <= t < vocab_size for t in ids):
        raise BadRequest(f"field `input_ids` must be a list of integers in [0, {vocab_size})")
    if not ids:
        raise BadRequest("field `input_ids` must not be empty")
    rid = _field(body, "rid", None, lambda v: _is_str(v) and v != "", "a non-empty string")
    if sp.max_new_tokens is None:
        sp = replace(sp, max_new_tokens=context_len - len(ids))
    elif len(ids) + sp.max_new_tokens > context_len:
        raise BadRequest(f"field `sampling_params.max_new_tokens` ({sp.max_new_tokens}) plus the {len(ids)} input "
                         f"tokens exceeds the model's context length {context_len}")
    req = Req(
        rid=rid or uuid.uuid4().hex, input_ids=list(ids), sp=sp, return_logprob=_flag(body, "return_logprob", False),
        top_logprobs_num=_field(body, "top_logprobs_num", 0, lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        logprob_start_len=_field(body, "logprob_start_len", -1, lambda v: _is_int(v) and v >= -1, "an integer >= -1"),
        return_text_in_logprobs=_flag(body, "return_text_in_logprobs", False),
        stream=_flag(body, "stream", False), cache_ns=(body.get("extra_key") or None, body.get("cache_salt") or None))
    if req.logprob_start_len >= len(ids):
        raise BadRequest(f"field `logprob_start_len` ({req.logprob_start_len}) must be < the {len(ids)} input tokens")
    return req


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
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                               torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")


def _rebuild_cuda_tensor(*args):
    """torch's CUDA IPC rebuild, with the device given by UUID (weight_sync.serialize_named_tensors, SGLang's
    patch_torch): the sender's CUDA_VISIBLE_DEVICES numbers the GPUs differently."""
    from torch.multiprocessing import reductions
    dev = args[6]
    if isinstance(dev, str):
        dev = next(i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == dev)
    return reductions.rebuild_cuda_tensor(*args[:6], dev, *args[7:])


def deserialize_named_tensors(payload: str) -> list:
    """A /update_weights_from_tensor payload (weight_sync.serialize_named_tensors) -> [(name, tensor)]."""
    import torch.multiprocessing  # noqa: F401  (registers the rebuild functions the payload names)
    named = _TensorUnpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
    if not (isinstance(named, list) and all(isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str)
                                            and isinstance(x[1], torch.Tensor) for x in named)):
        raise ValueError("expected a list of (name, tensor) pairs")
    return [(n, t) for n, t in named]


def _parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise BadRequest(f"field `dtypes` holds {name!r}, which is not a torch dtype name (e.g. 'bfloat16')")
    return dt


# -- Sampling ------------------------------------------------------------------------------------------------------

def sample(logits: torch.Tensor, params: list, generators: list, banned: list) -> tuple:
    """One token per row of logits [B, V] under params[i] (banned[i]: ids it may not draw; generators[i]: its seed or
    None). Returns (logp [B, V], tokens [B]); logp = log_softmax(logits / temperature) in float32 is what's reported."""
    logits = logits.float()
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)
    scores, raw = logp, logits
    if any(banned):
        scores, raw = scores.clone(), raw.clone()
        for i, ids in enumerate(banned):
            scores[i, ids] = float("-inf")
            raw[i, ids] = float("-inf")
    if all(p.greedy for p in params):
        return logp, raw.argmax(-1)
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
    return logp, torch.where(greedy, raw.argmax(-1), drawn)


def filter_scores(scores: torch.Tensor, params: list) -> torch.Tensor:
    """top_k / top_p / min_p (SGLang's rules) on log-probs [B, V]: removed entries become -inf (not in greedy rows)."""
    dev, vocab = scores.device, scores.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 and not p.greedy else vocab for p in params], device=dev)
    top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=dev)
    min_p = torch.tensor([0.0 if p.greedy else p.min_p for p in params], device=dev)
    s, idx = scores.sort(-1, descending=True)
    probs = s.softmax(-1)
    remove = torch.arange(vocab, device=dev)[None] >= top_k[:, None]
    remove |= ((probs.cumsum(-1) - probs) > top_p[:, None]) & (top_p[:, None] < 1)  # keep the token crossing top_p
    remove |= probs < min_p[:, None] * probs[:, :1]
    remove[:, 0] = False
    return torch.empty_like(scores).scatter_(1, idx, s.masked_fill(remove, float("-inf")))


# -- The model thread ----------------------------------------------------------------------------------------------

def load_model(path: str, device: torch.device, dtype: str):
    from transformers import AutoModelForCausalLM
    torch_dtype = (torch.float32 if device.type == "cpu" else "auto") if dtype == "auto" else getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()
    cfg = model.config.get_text_config()
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"--model-path {path}: engine.py supports full-attention layers only, the model has "
                         f"{sorted(layer_types)}")
    return model


class Scheduler:
    """Owns the model and all request state; runs in its own thread. Other threads only enqueue calls."""

    def __init__(self, model, tokenizer, device: torch.device, max_running: int, max_prefill_tokens: int,
                 weight_version: str, disable_radix_cache: bool = False):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.max_running, self.max_prefill_tokens, self.weight_version = max_running, max_prefill_tokens, weight_version
        cfg = model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.context_len = getattr(cfg, "max_position_embeddings", None) or 1 << 20
        eos = set()
        for src in (model.config.eos_token_id, getattr(model.generation_config, "eos_token_id", None),
                    tokenizer.eos_token_id):
            eos.update([src] if _is_int(src) else (src or []))
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
        self.paused: Optional[str] = None  # None | abort | retract | in_place
        self.released: set = set()
        self.groups: dict = {}  # group_name -> (process group, device of its tensors)
        self.disable_radix_cache = disable_radix_cache
        self._cache_clear()  # (namespace, token ids) -> per-layer KV, LRU order; the lengths cached per namespace
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
            try:
                fut.set_result(fn())
            except Exception as e:  # handed to the caller
                fut.set_exception(e)

    def _loop(self):
        tick_t, tick_n = time.perf_counter(), 0
        with torch.inference_mode():
            while not self._stop:
                self._run_calls()
                if not self._busy():
                    continue
                try:
                    if self.waiting and len(self.running) < self.max_running:
                        self._admit()
                    if self.running:
                        self._decode()
                except Exception as e:  # fail the batch, keep serving
                    log.exception("model step failed; aborting the requests in it")
                    for req in self.running + self.prefilling:
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

    def _admit(self):
        """Prefill queued requests (FIFO, up to the running limit and the prefill token budget) as one batch. Each
        starts from the longest cached prefix of its tokens in its namespace (at most all but its last token), so
        only the rest is computed; row i's cached KV sits left of column C, its new tokens end at the slab's end."""
        new, tokens = [], 0
        while self.waiting and len(self.running) + len(new) < self.max_running:
            n = len(self.waiting[0].input_ids) + len(self.waiting[0].output_ids)
            if new and tokens + n > self.max_prefill_tokens:
                break
            new.append(self.waiting.popleft())
            tokens += n
        self.prefilling = new
        seqs = [r.input_ids + r.output_ids for r in new]
        want_input_lp = [r.return_logprob and r.logprob_start_len >= 0 and not r.output_ids for r in new]
        # Requests with the same tokens in the same namespace (a group's samples: one prompt N times) share one row
        # of the forward; src[i] is request i's row. SGLang computes each (on a GPU the copies cost next to nothing,
        # here as much as the first); what a request sees (tokens, log-probs, cached_tokens) is the same.
        rows: dict = {}
        src, first = [], []  # request -> its row; row -> its first request
        for i, (r, s, w) in enumerate(zip(new, seqs, want_input_lp)):
            src.append(rows.setdefault((r.cache_ns, tuple(s), w), len(rows)))
            if src[-1] == len(first):
                first.append(i)
        useqs = [seqs[i] for i in first]
        hits = [(0, None) if want_input_lp[i] else self._cache_match(new[i].cache_ns, seqs[i]) for i in first]
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
        for i, (r, s) in enumerate(zip(new, seqs)):
            r.cached_tokens = hits[src[i]][0]
            if want_input_lp[i]:
                self._input_logprobs(r, logits[src[i], q - len(s):], s)
            if first[src[i]] == i:
                self._cache_insert(r.cache_ns, s, kv, src[i])
            if r.sp.sampling_seed is not None and r.generator is None:
                r.generator = torch.Generator(device=self.device).manual_seed(r.sp.sampling_seed)
            if r.sp.max_new_tokens <= len(r.output_ids):  # max_new_tokens 0 (or a retracted request at its limit)
                self._finish(r, {"type": "length", "length": r.sp.max_new_tokens})
        live = [i for i, r in enumerate(new) if r.finish is None]
        if not live:
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
        self.prefilling = []

    # -- the prefix cache (SGLang's radix cache, mem_cache/radix_cache.py: keyed by token ids + namespace) ----------
    def _cache_match(self, ns: tuple, seq: list) -> tuple:
        """(length, per-layer (K, V) [H, length, D]) of the longest cached prefix of seq in namespace ns, at most
        all but its last token (one is computed, for the logits); (0, None) when none is cached. A cached sequence
        matches when it is seq or a prefix of it (SGLang's radix tree also matches part of a longer one)."""
        for k in sorted(self.cache_lengths.get(ns, ()), reverse=True):
            entry = self.prefix_cache.get((ns, tuple(seq[:k]))) if k <= len(seq) else None
            if entry is not None:
                self.prefix_cache.move_to_end((ns, tuple(seq[:k])))
                use = min(k, len(seq) - 1)
                return (use, [(kk[:, :use], vv[:, :use]) for kk, vv in entry]) if use else (0, None)
        return 0, None

    def _cache_insert(self, ns: tuple, seq: list, kv: KVBatch, row: int) -> None:
        """Cache the KV of row `row` of a prefilled batch (its tokens seq), evicting the least recently used."""
        key = (ns, tuple(seq))
        if self.disable_radix_cache or key in self.prefix_cache:
            return
        cols = kv.mask[row, :kv.n].nonzero()[:, 0]
        self.prefix_cache[key] = [(layer.kb[row, :, cols].clone(), layer.vb[row, :, cols].clone())
                                  for layer in kv.layers]
        self.cache_lengths.setdefault(ns, collections.Counter())[len(seq)] += 1
        self.cache_tokens += len(seq)
        while self.cache_tokens > PREFIX_CACHE_TOKENS:
            (old_ns, old), _ = self.prefix_cache.popitem(last=False)
            self.cache_tokens -= len(old)
            self.cache_lengths[old_ns] -= collections.Counter([len(old)])  # (drops the lengths counted 0)

    def _cache_clear(self) -> None:
        self.prefix_cache, self.cache_lengths, self.cache_tokens = collections.OrderedDict(), {}, 0

    def _decode(self):
        if self.kv.n + 1 > self.kv.cap:  # out of columns: rebuild, dropping those no row uses any more
            self.kv = KVBatch.combine([(self.kv, list(range(len(self.running))))], self._row_cap(len(self.running)))
        kv = self.kv
        kv.mask[:, kv.n] = 1
        logits = self._forward(kv.last_tok[:, None], kv, kv.next_pos[:, None], last_only=True)
        kv.next_pos = kv.next_pos + 1
        kv.last_tok = self._sample_and_append(self.running, logits[:, -1])
        dead = [i for i, r in enumerate(self.running) if r.finish is not None]
        if dead:
            self._remove(dead)

    def _remove(self, dead: list):
        """Drop rows `dead` of the running batch (finished or aborted), in place."""
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
            self._append(r, int(host[0][i]), host[1][i], top)
        return toks

    def _input_logprobs(self, r: Req, logits: torch.Tensor, seq: list):
        """Prompt log-probs from logprob_start_len: position j's token under the prefix before it (None at 0)."""
        lp = torch.log_softmax(logits.float() / r.sp.temperature, -1)
        tgt = torch.tensor(seq[1:], device=lp.device)
        full = [None] + lp[:-1].gather(1, tgt[:, None])[:, 0].cpu().tolist()
        r.input_logprobs = [(full[j], seq[j]) for j in range(r.logprob_start_len, len(seq))]

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
        elif r.stream and (n + 1) % r.sp.stream_interval == 0:
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
    def abort(self, rid: str = "", abort_all: bool = False, exact: bool = False) -> int:
        """Abort (and count) requests whose rid starts with `rid` (equals it when exact; all with abort_all); queued
        ones "Abort in waiting queue". Paused in place, a running one is only marked: SGLang's aborted request "still
        runs one decode forward pass" (managers/scheduler.py), which a paused scheduler runs after continue."""
        def hit(r):
            return abort_all or (r.rid == rid if exact else (rid != "" and r.rid.startswith(rid)))
        queued = [r for r in self.waiting if hit(r)]
        self.waiting = collections.deque(r for r in self.waiting if not hit(r))
        for r in queued:
            self._finish(r, abort_reason("Abort in waiting queue"))
        n, dead = len(queued) + sum(map(hit, self.running)), []
        for i, r in enumerate(self.running):
            if hit(r) and self.paused != "in_place":
                self._finish(r, abort_reason("Aborted"))
                dead.append(i)
            elif hit(r):  # paused in place: finished by its next forward pass
                r.to_finish = abort_reason("Aborted")
        if dead:
            self._remove(dead)
        return n

    def pause(self, mode: str) -> int:
        """SGLang's pause modes: abort (return everything in flight), retract (keep requests, drop their KV; they
        are recomputed after continue), in_place (keep requests and KV). Returns the number of requests kept."""
        if mode == "abort":
            self.abort(abort_all=True)
        elif mode == "retract":
            for r in self.running:
                r.num_retractions += 1
            self.waiting.extendleft(reversed(self.running))
            self.running, self.kv = [], None
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
        """New weights; requests kept by a pause continue with them (their KV cache stays)."""
        device = next(self.model.parameters()).device  # host memory while released
        self.model = load_model(path, device, dtype)
        if version is not None:
            self.weight_version = version

    def load_tensors(self, named: list, version: Optional[str]):
        """Copy received (name, tensor) pairs into the model's parameters (names as in named_parameters)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = [n for n, _ in named if n not in params]
        bad = [f"{n} {tuple(t.shape)} vs {tuple(params[n].shape)}" for n, t in named
               if n in params and params[n].shape != t.shape]
        if unknown or bad:
            raise BadRequest(f"field `names`: unknown parameters {unknown[:5]}, shape mismatches {bad[:5]}")
        for n, t in named:
            params[n].data.copy_(t)
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
        self.released -= set(tags)


# -- HTTP server ---------------------------------------------------------------------------------------------------

class Gate:
    """Who may start a /generate: SGLang's pause flag (new requests wait while paused) and its model-update lock
    (every /generate reads for its lifetime; an update while not paused writes: it waits for readers, new ones wait)."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.paused, self.writers, self.readers = False, 0, 0

    async def _wait(self, pred, timeout: float, what: str):
        try:
            await asyncio.wait_for(self.cond.wait_for(pred), timeout)
        except asyncio.TimeoutError:  # (an alias of TimeoutError only from Python 3.11)
            raise TimeoutError(f"{what} did not happen within {timeout}s (--wait-timeout)") from None

    async def enter(self, timeout: float):
        async with self.cond:
            await self._wait(lambda: not self.paused and not self.writers, timeout,
                             "/continue_generation (or the end of a weight update)")
            self.readers += 1

    async def leave(self):
        async with self.cond:
            self.readers -= 1
            self.cond.notify_all()

    async def set_paused(self, paused: bool):
        async with self.cond:
            self.paused = paused
            self.cond.notify_all()

    async def drained(self, timeout: float):
        async with self.cond:
            await self._wait(lambda: self.readers == 0, timeout, "the end of the in-flight /generate requests")

    @contextlib.asynccontextmanager
    async def exclusive(self, timeout: float):
        """The writer side: a no-op while paused (SGLang updates a paused server immediately)."""
        if self.paused:
            yield
            return
        async with self.cond:
            self.writers += 1
        try:
            await self.drained(timeout)
            yield
        finally:
            async with self.cond:
                self.writers -= 1
                self.cond.notify_all()


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _fail(message: str, **extra) -> web.Response:
    """A weight-update call that failed, answered as SGLang does: 400 with success false and the message."""
    return web.json_response({"success": False, "message": message, **extra}, status=400)


BIG_BODY = 1 << 20  # bodies above this many bytes are parsed off the event loop, so other requests go on meanwhile


class TooLarge(BadRequest):
    """The request body (of `size` bytes; None: not known) exceeds --max-request-mb (`limit` bytes): HTTP 413."""

    def __init__(self, size: Optional[int], limit: int):
        got = f"{size / 2 ** 20:.1f} MiB" if size is not None else "more"
        super().__init__(f"request body of {got} exceeds the server's limit of {limit / 2 ** 20:g} MiB "
                         "(engine.py --max-request-mb)")


async def _body(request: web.Request, required: bool = True, error: type = BadRequest) -> dict:
    """The request's JSON object ({} for an empty body unless required); `error` is raised when it is not one."""
    limit = request.app["max_body"]
    if request.content_length is not None and request.content_length > limit:  # refused before reading it
        raise TooLarge(request.content_length, limit)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a chunked body, counted while read
        raise TooLarge(None, limit) from None
    if not raw.strip():
        if required:
            raise error("request body must be a JSON object (send {} for defaults)")
        return {}
    try:
        body = orjson.loads(raw) if len(raw) < BIG_BODY else await asyncio.to_thread(orjson.loads, raw)
    except orjson.JSONDecodeError as e:  # (SGLang reads bodies with orjson too: http_server.py ORJSONRequest)
        raise error(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise error("request body must be a JSON object")
    return body


class Server:
    """The aiohttp application: validates and formats on the event loop; the Scheduler does the work."""

    def __init__(self, args, sched: Scheduler, tokenizer):
        self.args, self.sched, self.tokenizer = args, sched, tokenizer
        self.gate = Gate()
        self.ready = False
        self.live: dict = {}  # rid -> Req of every registered /generate (SGLang's rid_to_state)
        self.session_open = False  # between /begin_weight_update and /end_weight_update
        self.healthy = True  # SGLang's server_status Up (False: UnHealthy, after a /health that timed out)
        self.tasks: set = set()  # handlers of abandoned requests (see _gated)
        max_body = int(args.max_request_mb * 2 ** 20)
        self.app = web.Application(client_max_size=max_body, middlewares=[self._auth, self._errors])
        self.app["max_body"] = max_body
        # the most characters a token stands for (a byte-level token's string has one per byte): a longer text than
        # context_len times this cannot fit the context (for normalizers that delete no characters: BPE, SentencePiece)
        self.token_chars = max(len(t) for t in tokenizer.get_vocab())
        post, get = self.app.router.add_post, self.app.router.add_get
        for name in ("generate", "abort_request", "pause_generation", "continue_generation", "update_weights_from_disk",
                     "init_weights_update_group", "destroy_weights_update_group", "begin_weight_update",
                     "end_weight_update", "update_weights_from_distributed", "update_weights_from_tensor",
                     "update_weight_version"):  # POST /name is served by the method of that name
            post(f"/{name}", getattr(self, name))
        for path, fn in (("/flush_cache", self.flush_cache), ("/release_memory_occupation", self.release_memory),
                         ("/resume_memory_occupation", self.resume_memory)):
            get(path, fn)
            post(path, fn)
        for path, fn in (("/model_info", self.model_info), ("/get_model_info", self.model_info),
                         ("/server_info", self.server_info), ("/get_server_info", self.server_info),
                         ("/health", self.health), ("/health_generate", self.health), ("/ready", self.ready_),
                         ("/v1/loads", self.loads), ("/get_loads", self.loads)):
            get(path, fn)
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)

    async def _on_startup(self, app):
        self.ready = True

    async def _on_shutdown(self, app):
        self.ready = False
        await asyncio.get_running_loop().run_in_executor(None, self.sched.stop)

    @web.middleware
    async def _auth(self, request, handler):
        """SGLang's --api-key check: every path but /health* and /metrics needs the bearer token."""
        key = self.args.api_key
        if (key and request.method != "OPTIONS" and not request.path.startswith(("/health", "/metrics"))
                and request.headers.get("Authorization") != f"Bearer {key}"):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except TooLarge as e:
            return _error(str(e), 413)
        except SchemaError as e:
            return web.json_response({"detail": [{"type": "model_attributes_type", "msg": str(e)}]}, status=422)
        except BadRequest as e:
            return _error(str(e))
        except TimeoutError as e:
            return _error(str(e), 503)

    async def _run(self, fn: Callable[[], Any]):
        """Run fn on the model thread and await its result (at most --wait-timeout)."""
        return await asyncio.wait_for(asyncio.wrap_future(self.sched.call(fn)), self.args.wait_timeout)

    # -- /generate --------------------------------------------------------------------------------------------
    def _output(self, r: Req, n: int, final: bool) -> dict:
        ids = r.output_ids[:n]
        fin = r.finish if final else None
        trim = fin.get("matched") if fin and fin["type"] == "stop" and not r.sp.no_stop_trim else None  # id or str
        text = self.tokenizer.decode(ids[:-1] if _is_int(trim) else ids, skip_special_tokens=r.sp.skip_special_tokens)
        if isinstance(trim, str) and trim in text:
            text = text[:text.find(trim)]
        spans = [{"version": v, "start": s, "end": min(e, n)} for v, s, e in list(r.spans) if s < n]
        meta = {"id": r.rid, "finish_reason": fin, "prompt_tokens": len(r.input_ids), "completion_tokens": n,
                "cached_tokens": r.cached_tokens, "weight_versions": spans, "num_retractions": r.num_retractions,
                "weight_version": spans[-1]["version"] if spans else self.sched.weight_version}
        if final:
            meta["e2e_latency"] = r.finished_at - r.created
        if r.return_logprob:
            tt = (lambda t: self.tokenizer.decode([t])) if r.return_text_in_logprobs else (lambda t: None)
            meta["output_token_logprobs"] = [[lp, t, tt(t)] for lp, t in zip(r.logprobs[:n], ids)]
            meta["input_token_logprobs"] = [[lp, t, tt(t)] for lp, t in r.input_logprobs]
            if r.top_logprobs_num:
                meta["output_top_logprobs"] = [[[lp, t, tt(t)] for lp, t in top] for top in r.top_logprobs[:n]]
                meta["input_top_logprobs"] = []
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request, error=SchemaError)  # FastAPI answers a body that is not a JSON object with 422
        args = (body, self.tokenizer, self.sched.vocab_size, self.sched.context_len, self.token_chars)
        long = any(isinstance(v, (str, list)) and len(v) > 4096 for v in (body.get("text"), body.get("input_ids")))
        # a long prompt is tokenized / checked off the event loop, which meanwhile serves everyone else
        reqs, listed, n = await asyncio.to_thread(parse_generate, *args) if long else parse_generate(*args)
        if listed and any(r.stream for r in reqs):
            raise BadRequest("field `stream`: engine.py streams single prompts only (send a batch unstreamed)")
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        left = [len(reqs)]  # unstreamed items wake the handler once: when the last finished, or one failed

        def notify(i: int, n: int, final: bool) -> None:  # on the model thread
            if final and not reqs[i].stream:
                left[0] -= 1
                code = (reqs[i].finish or {}).get("status_code")
                if left[0] and not (_is_int(code) and code >= 400):
                    return
            loop.call_soon_threadsafe(updates.put_nowait, (i, n, final))
        for i, r in enumerate(reqs):
            r.notify = lambda n, final, i=i: notify(i, n, final)
            self.live[r.rid] = r  # registered before the pause gate, as SGLang's tokenizer manager does
        entered = abandoned = False
        try:
            await self.gate.enter(self.args.wait_timeout)
            entered = True
            if self.args.dispatch_delay_s:  # SGLang tokenizes and sends here: an abort now finds nothing
                await asyncio.sleep(self.args.dispatch_delay_s)
            if n > 1:  # 0.5.23 first prefills each prompt alone (max_new_tokens 0), so its n samples share the KV
                await self._run_to_end([Req(rid=uuid.uuid4().hex, input_ids=r.input_ids, cache_ns=r.cache_ns,
                                            sp=replace(r.sp, max_new_tokens=0)) for r in reqs[::n]],
                                       self.args.wait_timeout)  # (tokenizer_manager.py)
            self.sched.call(lambda: self.sched.waiting.extend(reqs))
            return await self._respond(request, reqs, listed, updates)
        except asyncio.CancelledError:
            if not entered:  # the client left while waiting at the gate: SGLang's handler goes on regardless
                abandoned = True
                task = asyncio.ensure_future(self._gated(reqs, REQUEST_STATE_WAIT_TIMEOUT_S))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            raise
        finally:
            if entered:
                if any(r.finish is None for r in reqs):  # the client went away, or an item failed: free the slots
                    self.sched.call(lambda: [self.sched.abort(r.rid, exact=True) for r in reqs if r.finish is None])
                await self.gate.leave()
            if not abandoned:
                self._forget(reqs)

    def _forget(self, reqs: list) -> None:
        for r in reqs:
            if self.live.get(r.rid) is r:
                del self.live[r.rid]

    async def _run_to_end(self, reqs: list, timeout: float) -> None:
        """Submit reqs (their own notify) and wait until all finished, at most `timeout` seconds."""
        loop = asyncio.get_running_loop()
        done = [loop.create_future() for _ in reqs]
        for r, fut in zip(reqs, done):  # a request is notified final once
            r.notify = lambda n, final, fut=fut: final and loop.call_soon_threadsafe(fut.set_result, None)
        self.sched.call(lambda: self.sched.waiting.extend(reqs))
        await asyncio.wait(done, timeout=timeout)

    async def _gated(self, reqs, run_s: float) -> None:
        """Pass the pause gate, run reqs for at most run_s seconds, abort what is left: /health's request, and one
        whose client left at the gate (SGLang's handler goes on: dispatched at continue, it runs until the disconnect
        is noticed, SGLANG_REQUEST_STATE_WAIT_TIMEOUT without a reply, tokenizer_manager.py _wait_one_response)."""
        try:
            with contextlib.suppress(TimeoutError):  # (the gate stayed shut: nothing ran)
                await self.gate.enter(self.args.wait_timeout)
                try:
                    await self._run_to_end(reqs, run_s)
                finally:
                    self.sched.call(lambda: [self.sched.abort(r.rid, exact=True) for r in reqs if r.finish is None])
                    await self.gate.leave()
        finally:
            self._forget(reqs)

    async def _respond(self, request: web.Request, reqs: list, listed: bool,
                       updates: asyncio.Queue) -> web.StreamResponse:
        """The reply once every item finished, in input order; an item that ends with status_code >= 400 makes
        the whole call that HTTP error (the finally of generate aborts the rest), as 0.5.23 does."""
        r = reqs[0]
        if not r.stream:  # woken once: every item finished, or item i failed
            i = (await updates.get())[0]
            code = (reqs[i].finish or {}).get("status_code")
            if _is_int(code) and code >= 400:
                return _error(reqs[i].finish.get("message") or "request failed", code)
            outs = [self._output(x, len(x.output_ids), True) for x in reqs]
            # SGLang answers with orjson too (http_server.py: ORJSONResponse)
            return web.Response(body=orjson.dumps(outs if listed else outs[0]), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        final = False
        while not final:
            _, n, final = await updates.get()
            while not final and not updates.empty():  # coalesce when the client reads slower than we decode
                _, n, final = updates.get_nowait()
            out = self._output(r, len(r.output_ids) if final else n, final)
            await resp.write(f"data: {json.dumps(out)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    # -- control endpoints ------------------------------------------------------------------------------------
    async def abort_request(self, request):
        body = await _body(request, required=False)
        rid = _field(body, "rid", "", _is_str, "a string")
        abort_all = _flag(body, "abort_all", False)
        if not abort_all:  # SGLang's HTTP layer: only a registered rid, only once (then prefix-matched)
            r = self.live.get(rid)
            if r is None or r.abort_sent:
                return web.Response(status=200)
            r.abort_sent = True
        await self._run(lambda: self.sched.abort(rid, abort_all))
        return web.Response(status=200)

    async def pause_generation(self, request):
        mode = _field(await _body(request), "mode", "abort", lambda v: v in ("abort", "retract", "in_place"),
                      "one of abort, retract, in_place")
        await self.gate.set_paused(True)
        deadline = time.monotonic() + self.args.wait_timeout
        while True:
            await self._run(lambda: self.sched.pause(mode))
            if mode != "abort":
                break
            try:  # abort again until no request holds the lock: one dispatched after the last abort-all is caught
                await self.gate.drained(PAUSE_ABORT_POLL_S)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"pause_generation: in-flight /generate requests were not answered within "
                                       f"{self.args.wait_timeout}s (--wait-timeout)") from None
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request):
        _flag(await _body(request, required=False), "torch_empty_cache", True)
        await self._run(self.sched.resume_generation)
        await self.gate.set_paused(False)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request):
        ok = await self._run(self.sched.flush_cache)
        text = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting " \
               "requests, the operation will not be performed.)"
        return web.Response(text=text, status=200 if ok else 400)

    def _version_field(self, body: dict, name: str = "weight_version") -> Optional[str]:
        v = _field(body, name, None, lambda x: isinstance(x, (str, int)) and not isinstance(x, bool), "a string")
        return None if v is None else str(v)

    def _update_options(self, body: dict) -> tuple:
        """(flush_cache, abort_all_requests, weight_version) of a weight-update body."""
        return _flag(body, "flush_cache", True), _flag(body, "abort_all_requests", False), self._version_field(body)

    async def _update(self, load: Callable[[], Any], options: tuple, message: str, failed: str = "", **extra):
        """The three weight updates' shared tail: abort if asked, await load() under the writer lock (a failure answers
        400, success false, `failed` + its message), flush the cache (SGLang fails the call when that is refused)."""
        flush, abort_all, version = options
        if abort_all:
            await self._run(lambda: self.sched.abort(abort_all=True))
        async with self.gate.exclusive(self.args.wait_timeout):
            try:
                await load()
            except Exception as e:  # reported to the caller
                return _fail(failed + str(e), **extra)
        if flush and not await self._run(self.sched.flush_cache):
            return _fail(FLUSH_REFUSED, **extra)
        return web.json_response({"success": True, **extra, "message": message
                                  + (f" Weight version updated to {version}." if version else "")})

    async def update_weights_from_disk(self, request):
        body = await _body(request)
        path = _required(body, "model_path", _is_str, "a string")
        _field(body, "load_format", None, lambda v: v in ("auto", "safetensors"), "null, 'auto' or 'safetensors'")
        options = self._update_options(body)
        if not Path(path).is_dir():
            return _fail(f"model_path {path} is not a directory", num_paused_requests=0)
        version, dtype = options[2], self.args.dtype
        return await self._update(lambda: self._run(lambda: self.sched.load_from_disk(path, version, dtype)), options,
                                  f"Succeeded to update model weights from {path}.", f"loading {path} failed: ",
                                  num_paused_requests=0)  # 0.5.23's scheduler always answers 0

    async def init_weights_update_group(self, request):
        body = await _body(request)
        addr = _required(body, "master_address", _is_str, "a string")
        port = _required(body, "master_port", lambda v: _is_int(v) and 0 < v < 65536, "a port number")
        rank = _required(body, "rank_offset", lambda v: _is_int(v) and v >= 1, "an integer >= 1")
        world = _required(body, "world_size", lambda v: _is_int(v) and v >= 2, "an integer >= 2")
        if rank >= world:
            raise BadRequest(f"field `rank_offset` ({rank}) must be < world_size ({world})")
        group = _field(body, "group_name", "weight_update_group", _is_str, "a string")
        backend = _field(body, "backend", "nccl", lambda v: v in ("nccl", "gloo"), "'nccl' or 'gloo'")
        if backend == "nccl" and self.sched.device.type != "cuda":
            raise BadRequest("field `backend` is 'nccl' but this engine runs on CPU; use 'gloo'")
        if group in self.sched.groups:
            raise BadRequest(f"field `group_name`: group {group!r} already exists; destroy it first")
        try:  # off the model thread: generation goes on while the trainer joins
            pg = await asyncio.to_thread(init_weight_update_group, addr, port, rank, world, group, backend,
                                         self.args.dist_timeout)
        except RuntimeError as e:
            return _fail(str(e))
        self.sched.groups[group] = (pg, self.sched.device if backend == "nccl" else torch.device("cpu"))
        return web.json_response({"success": True, "message": f"Succeeded to initialize group {group!r}."})

    async def destroy_weights_update_group(self, request):
        group = _field(await _body(request, required=False), "group_name", "weight_update_group", _is_str, "a string")
        entry = self.sched.groups.pop(group, None)
        if entry is None:
            return _fail(f"no weight-update group {group!r}")
        with contextlib.suppress(Exception):
            entry[0].shutdown()
        return web.json_response({"success": True, "message": f"Succeeded to destroy group {group!r}."})

    async def begin_weight_update(self, request):
        _field(await _body(request), "selector", "all", _is_str, "a string")
        return await self._session(True, "a weight-update session is already open; call end_weight_update() first")

    async def end_weight_update(self, request):
        await _body(request)
        return await self._session(False, "no weight-update session is open; call begin_weight_update() first")

    async def _session(self, open_: bool, refusal: str) -> web.Response:
        async with self.gate.exclusive(self.args.wait_timeout):  # 0.5.23 takes the writer lock unless paused
            if self.session_open == open_:
                return _fail(refusal)
            self.session_open = open_
        return web.json_response({"success": True, "message": "Success"})

    async def update_weights_from_distributed(self, request):
        body = await _body(request)
        names = _required(body, "names", _all_of(_is_str), "a list of strings")
        dtypes = _required(body, "dtypes", _all_of(_is_str), "a list of strings")
        shapes = _required(body, "shapes", _all_of(_all_of(lambda d: _is_int(d) and d >= 0)),
                           "a list of shapes (lists of ints)")
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("fields `names`, `dtypes` and `shapes` must have the same length")
        dtypes = [_parse_dtype(d) for d in dtypes]
        group = _field(body, "group_name", "weight_update_group", _is_str, "a string")
        _field(body, "load_format", None, lambda v: False, "null (the only supported load_format)")
        options = self._update_options(body)
        if group not in self.sched.groups:
            raise BadRequest(f"field `group_name`: no weight-update group {group!r}; call /init_weights_update_group")
        if not self.session_open:  # refused before joining the broadcast: a client that broadcasts anyway hangs
            return _fail(SESSION_REQUIRED)
        pg, device = self.sched.groups[group]

        async def load():  # receive off the model thread, then swap between two steps
            tensors = [torch.empty(s, dtype=dt, device=device) for s, dt in zip(shapes, dtypes)]
            await asyncio.to_thread(broadcast_tensors, pg, tensors, self.args.dist_timeout)
            await self._run(lambda: self.sched.load_tensors(list(zip(names, tensors)), options[2]))
        return await self._update(load, options, f"Succeeded to update {len(names)} parameters.")

    async def update_weights_from_tensor(self, request):
        """Colocate (sglang managers/scheduler_components/weight_updater.py update_weights_from_tensor): each
        `serialized_named_tensors[tp_rank]` is base64 ForkingPickler bytes of (name, tensor) pairs, shared-memory
        files on CPU (torch's file_system sharing), CUDA IPC handles on GPU. Refused outside a weight-update session."""
        body = await _body(request)
        payloads = _required(body, "serialized_named_tensors", lambda v: _all_of(_is_str)(v) and len(v) > 0,
                             "a non-empty list of base64 strings, one per TP rank")
        _field(body, "load_format", None, lambda v: v in ("direct",), "null or 'direct' (engine.py loads by "
               "parameter name; 'flattened_bucket' needs sglang's classes)")
        _field(body, "selector", "all", lambda v: v in ("target", "draft", "all"), "'target', 'draft' or 'all'")
        _flag(body, "torch_empty_cache", False)
        options = self._update_options(body)
        if not self.session_open:
            return _fail(SESSION_REQUIRED.replace("update_weights_from_distributed", "update_weights_from_tensor"))
        try:  # this engine is TP rank 0 of 1
            named = deserialize_named_tensors(payloads[0])
        except Exception as e:
            raise BadRequest(f"field `serialized_named_tensors`: payload 0 does not deserialize: {e}") from None
        return await self._update(lambda: self._run(lambda: self.sched.load_tensors(named, options[2])), options,
                                  "Success")

    async def update_weight_version(self, request):
        body = await _body(request)
        v = self._version_field(body, "new_version")
        if v is None:
            raise BadRequest("field `new_version` is required")
        abort_all = _flag(body, "abort_all_requests", True)
        await self._run(lambda: self.sched.set_version(v, abort_all))
        return web.json_response({"success": True, "message": f"Weight version updated to {v}.", "new_version": v})

    async def _memory(self, request, fn: Callable[[list], None], done: str) -> web.Response:
        """/release_memory_occupation and /resume_memory_occupation: `tags` absent means all of RELEASE_TAGS."""
        tags = _field(await _body(request, required=False), "tags", None, _all_of(lambda t: t in RELEASE_TAGS),
                      "a list of " + ", ".join(RELEASE_TAGS))
        tags = list(RELEASE_TAGS) if tags is None else tags
        await self._run(lambda: fn(tags))
        return web.json_response({"success": True, "message": f"{done} {tags}."})

    async def release_memory(self, request):
        return await self._memory(request, self.sched.release, "Released")

    async def resume_memory(self, request):
        return await self._memory(request, self.sched.resume_memory, "Resumed")

    # -- info endpoints ---------------------------------------------------------------------------------------
    async def model_info(self, request):
        cfg = self.sched.model.config
        return web.json_response({
            "model_path": self.args.model_path, "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.sched.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": cfg.model_type,
            "architectures": getattr(cfg, "architectures", None)})

    async def server_info(self, request):
        info = {k: v for k, v in vars(self.args).items() if k not in ("api_key", "report_version")}
        info.update({"version": self.args.report_version, "tp_size": 1, "dp_size": 1, "device": str(self.sched.device),
                     "weight_version": self.sched.weight_version, "context_length": self.sched.context_len,
                     "internal_states": [{"last_gen_throughput": self.sched.throughput,
                                          "effective_max_running_requests_per_dp": self.sched.max_running}]})
        return web.json_response(info)

    async def health(self, request):
        """/health, /health_generate (entrypoints/http_server.py health_generate): a one-token request through the
        pause gate, so never 200 while paused; 200 once the scheduler output anything after the call began, else 503
        after SGLANG_HEALTH_CHECK_TIMEOUT and unhealthy (/ready 503) until one succeeds.
        SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false: /health answers 200 without generating."""
        if not (self.ready and self.sched.thread.is_alive()):
            return web.Response(status=503)
        if request.path == "/health" and not HEALTH_GENERATES:
            return web.Response(status=200)
        t0 = time.perf_counter()
        r = Req(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
                sp=parse_sampling_params({"max_new_tokens": 1, "temperature": 0}, self.sched.vocab_size))
        task = asyncio.ensure_future(self._gated([r], HEALTH_CHECK_TIMEOUT_S))
        try:
            while time.perf_counter() < t0 + HEALTH_CHECK_TIMEOUT_S:
                await asyncio.sleep(0.02)
                if self.sched.last_output > t0:
                    self.healthy = True
                    return web.Response(status=200)
        finally:
            task.cancel()
        log.error("health check failed: no output from the scheduler within %g s", HEALTH_CHECK_TIMEOUT_S)
        self.healthy = False
        return web.Response(status=503, text=f"no token generated within {HEALTH_CHECK_TIMEOUT_S:g} s")

    async def ready_(self, request):
        """/ready: 503 while paused or unhealthy (tokenizer_manager.py: is_ready)."""
        ok = self.ready and self.healthy and not self.gate.paused and self.sched.thread.is_alive()
        return web.Response(status=200 if ok else 503)

    async def loads(self, request):
        s, kv = self.sched, self.sched.kv
        # a request that just finished leaves the batch at the end of its step: count only unfinished ones
        running, waiting = sum(r.finish is None for r in list(s.running)), len(s.waiting)
        used = kv.n * len(s.running) if kv is not None else 0
        return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_total_reqs": running + waiting,
            "num_used_tokens": used, "max_running_requests": s.max_running, "paused": s.paused}]})


# -- Launching (CLI and subprocess helper) -------------------------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineProcess:
    """Handle of an engine subprocess started by launch()."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: str):
        self.proc, self.url, self.log_path = proc, url, log_path

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
        return ""

    def stop(self, timeout: float = 15.0):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


def launch(model_path: str, port: Optional[int] = None, host: str = "127.0.0.1", timeout: float = 180.0,
           log_path: Optional[str] = None, env: Optional[dict] = None, **kw) -> tuple[str, EngineProcess]:
    """Start `python engine.py` on a free port (or `port`), wait until /health answers 200 and return (url, handle).
    Keyword arguments become flags (max_running_requests=8 -> --max-running-requests 8); `env` adds environment
    variables (e.g. SGLANG_HEALTH_CHECK_TIMEOUT); the log goes to log_path (default: a temporary file)."""
    port = port or free_port(host)
    url = f"http://{host}:{port}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--model-path", str(model_path), "--host", host,
           "--port", str(port)]
    for k, v in kw.items():
        if v is not None and v is not False:
            cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"engine-{port}-", suffix=".log")
        os.close(fd)
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                "PYTHONUNBUFFERED": "1", **(env or {})})
    handle = EngineProcess(proc, url, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine for {model_path} exited with code {proc.returncode} before answering "
                               f"/health; log {log_path}:\n{handle.log_tail()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2) as resp:
            if resp.status == 200:
                return url, handle
        time.sleep(0.2)
    handle.stop()
    raise TimeoutError(f"engine for {model_path} did not answer {url}/health within {timeout}s; log {log_path}:\n"
                       f"{handle.log_tail()}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config, weights, tokenizer)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (not on /health*), as SGLang")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=None,
                   help=f"requests decoded together; the rest queue (default {DEFAULT_MAX_RUNNING}; /server_info\n"
                        "reports the flag as given, null when absent, and the limit in internal_states)")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix cache: every prompt is prefilled in full (SGLang's flag)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="prompt tokens prefilled in one batch")
    p.add_argument("--weight-version", default="0", help="weight_version reported until an update changes it")
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, the checkpoint's dtype on GPU")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads; default 1 on CPU (the engine shares the CPU with the trainer, and\n"
                        "oversubscribed OpenMP threads made it ~10x slower in engine_bench), torch's on GPU")
    p.add_argument("--wait-timeout", type=float, default=1800.0,
                   help="longest a request waits for /continue_generation or a weight update (s)")
    p.add_argument("--dist-timeout", type=float, default=300.0, help="timeout of weight-update group collectives (s)")
    p.add_argument("--dispatch-delay-s", type=float, default=0.0,
                   help="tests: seconds a registered request waits before reaching the model thread (SGLang's\n"
                        "tokenize-and-send window, where an /abort_request for it is lost)")
    p.add_argument("--report-version", default=SGLANG_VERSION,
                   help="tests: the sglang version /server_info reports (clients refuse unsupported ones)")
    p.add_argument("--max-request-mb", type=float, default=32.0,
                   help="largest request body accepted (MiB); larger ones get HTTP 413 before being read")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
    for name, v in (("--max-running-requests", args.max_running_requests),
                    ("--max-prefill-tokens", args.max_prefill_tokens)):
        if v is not None and v < 1:
            p.error(f"{name} must be >= 1, got {v}")
    if not args.max_request_mb > 0:
        p.error(f"--max-request-mb must be > 0, got {args.max_request_mb}")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.num_threads or device.type == "cpu":
        torch.set_num_threads(args.num_threads or 1)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    model = load_model(args.model_path, device, args.dtype)
    sched = Scheduler(model, tokenizer, device, args.max_running_requests or DEFAULT_MAX_RUNNING,
                      args.max_prefill_tokens, str(args.weight_version), args.disable_radix_cache)
    sched.thread.start()
    server = Server(args, sched, tokenizer)
    log.info("serving %s on http://%s:%d (device %s, max_running_requests %d, reporting sglang %s)",
             args.model_path, args.host, args.port, device, sched.max_running, args.report_version)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request (as SGLang)
    web.run_app(server.app, host=args.host, port=args.port, handler_cancellation=True, print=None,
                access_log=None, shutdown_timeout=3.0)


if __name__ == "__main__":
    main()
