"""engine.py: an SGLang-compatible HTTP inference server around any transformers causal LM.

It serves the subset of SGLang's HTTP API that RL post-training uses (docs/sglang.md: /generate, aborts,
pause/continue, weight updates from disk, over a torch.distributed group or from shared tensors (colocate), weight
versions, memory release, loads), so rollout.py and train.py run one code path against real SGLang or this engine.

Run (from the repository root):
       python -m standins.engine --model-path DIR --port 30000 [--max-running-requests 64] [--weight-version default]
           [--device auto] [--dtype auto] [--host 127.0.0.1] [--config KEY.yaml] [--max-request-mb 32]
           [--max-queued-requests N]   (SGLANG_REQ_WAITING_TIMEOUT / _RUNNING_TIMEOUT: 503 aborts)
From Python (tests, benchmarks): `url, handle = engine.launch(model_path, max_running_requests=8)`; `handle.stop()`.
Trainer side of the weight-update group: `pg = scheduler.init_weight_update_group(addr, port, 0, world_size,
group_name, backend)` then `scheduler.broadcast_tensors(pg, tensors)` while POSTing /update_weights_from_distributed;
colocate: POST /update_weights_from_tensor, `serialized_named_tensors=[sync_tensor.serialize_named_tensors(named)]`.

Log-prob convention (0.5.23's, layers/sampler.py: Sampler.forward; the one logprobs.token_logprobs uses):
`output_token_logprobs` holds, per sampled token, log_softmax(logits / temperature)[token] in float32 over the whole
vocabulary, with temperature 1 for greedy requests (temperature < 1e-6, as SGLang, which turns greedy into
temperature 1 + top_k 1) and for every request under SGLANG_RETURN_ORIGINAL_LOGPROB=true. top_p / top_k / min_p and
the min_new_tokens ban change which token is drawn, never the reported log-prob: with top_p < 1 or top_k > 0 it is
not the probability the token was drawn with (the trainer replays the kept set: logprobs.Support). Prompt log-probs
(`input_token_logprobs`) are at temperature 1 always.

How it works: this file is the HTTP front (aiohttp; the part of SGLang that its tokenizer manager plays): it only
parses, validates and formats, refuses oversized bodies (413, before reading) and texts (before tokenizing), and
parses large ones off the event loop. scheduler.py owns the model and every admitted request in one model thread
(continuous batching over a KV slab per layer, the prefix cache, weight loading, sampling).

Strict like SGLang 0.5.23 where clients go wrong easily (docs/sglang.md;
tests/test_sglang_conformance.py names each source): an abort (forwarded once per registered rid, prefix-matched) is
lost while its request waits at the pause gate, where pause "abort" does not reach it either, and one abandoned
there still runs after continue until its first output (an unstreamed one's 50th token) or 4 s without one; pause
"abort" repeats abort-all until no request holds the lock and leaves a scheduler paused in place paused; /health
generates through the gate; the prefix cache ignores the weight version (/flush_cache or a new extra_key /
cache_salt keeps old KV out); schema errors and bad values are 400;
prompt + max_new_tokens above the context length is a 400 (for a whole list request), a prompt of context - 6 tokens
too, max_new_tokens is capped at context - 2 - prompt (/v1/models max_model_len: the context length); group and
tensor weight updates need a begin/end_weight_update session; --api-key (or `api-key:` in a --config YAML file, as
services.py passes it) guards all but /health*, /ready, /metrics;
`logit_bias` is added to the logits before sampling and before the reported log-probs; --max-queued-requests
refuses with 503 what finds the queue full, not counting requests the free running slots take this iteration; a
request ended in the queue is answered in _handle_abort_req's form (no routed_experts).

KV pool as 0.5.23's (--max-total-tokens, default sized by memory): the prefix cache (a radix tree per namespace of
prompts and finished requests) and the running requests share it; a prefill is admitted while the pool has room for
its uncached tokens and expected decode (new_token_ratio), the cache's least recently used unheld leaves are
evicted only when a step lacks slots, and a decode step that still lacks them retracts requests (fewest outputs
first, re-queued with their tokens, /server_info num_retracted_reqs).

Simplifications against SGLang: a custom weight loader's weight_delta.DeltaRefused answers success false (0.5.23
ends the server: weight_delta.py's docstring); the pool counts tokens, not the padded KV slabs the batch really uses (its memory
is the cached KV plus those slabs); batches do not stream;
no penalties, grammars or custom logit processors (accepted at their defaults, else 400); no speculative decoding:
--speculative-algorithm (any but NGRAM / UNO) only adds a draft model runner that weight updates go to as 0.5.23's
`selector` picks them (default "all": the target, then the draft; /update_weights_from_disk every runner) and that
logs each operation it gets instead of loading it (_DraftModel, DRAFT_LOG);
`spaces_between_special_tokens` is ignored; full-attention decoders only; released weights move to host memory
(generation waits until they are resumed) and come back as NaN, buffers too, unless --enable-weights-cpu-backup;
/tokenize takes `prompt` only (no chat template renderer for `messages`).

Outside the subset (HTTP 400 naming the field, so a test here proves nothing about them): penalties,
grammars (json_schema, regex, ebnf, structural_tag) and `custom_params` (sampling_params accepted at their defaults
only: each reshapes the logits before sampling, and RL rollouts here sample from the plain distribution);
`custom_logit_processor` (SGLang runs pickled Python from the request; nothing here calls it); `input_embeds` and
image/video/audio data (text-only decoders, token-id prompts); LoRA, sessions, hidden states, entropy, sampling
masks (`return_sampling_mask`: each output token's kept set; the trainer replays it instead); streaming of
batches and of n > 1 (the client sends list requests unstreamed: one reply in input order, as 0.5.23 gives it).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import orjson
import torch
from aiohttp import web

import moe
from standins.scheduler import (BadRequest, Req, SamplingParams, Scheduler, abort_reason, broadcast_tensors,
                                deserialize_named_tensors, env_bool, env_int, init_weight_update_group, load_model)

ROOT = str(Path(__file__).resolve().parents[1])  # the repository root, where the roles' modules are

log = logging.getLogger("engine")

GREEDY_EPS = 1e-6  # temperature below this is greedy (SGLang's _SAMPLING_EPS, sampling/sampling_params.py)
SGLANG_VERSION = "0.5.23"  # the SGLang release whose HTTP API this engine serves (/server_info "version")
DEFAULT_MAX_RUNNING = 64  # requests decoded together without --max-running-requests (SGLang sizes it from its KV pool)
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")  # SGLang 0.5.23's message
PAUSE_ABORT_POLL_S = 1.0  # pause mode abort: repeat abort-all at this interval until no request holds the lock


# /health: 503 after this many seconds (entrypoints/http_server.py reads it with int(), a non-integer fails the start)
HEALTH_CHECK_TIMEOUT_S = int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
HEALTH_GENERATES = env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True)  # /health generates a token
# how soon a request whose client went away is noticed (tokenizer_manager.py polls is_disconnected at this interval)
REQUEST_STATE_WAIT_TIMEOUT_S = env_int("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", 4)
SESSION_REQUIRED = ("update_weights_from_distributed must run between begin_weight_update() and "
                    "end_weight_update()")  # SGLang 0.5.23's message (scheduler_components/weight_updater.py)
SELECTORS = ("target", "draft", "all")  # a weight update's `selector` (0.5.23 managers/io_struct.py, default "all")
NO_DRAFT_MODEL = ("NGRAM", "UNO", "NONE")  # speculative algorithms whose worker has no draft model runner
DRAFT_LOG = "draft runner:"  # starts the log line of every weight operation the draft model gets (_DraftModel)
# Test-only fault, no SGLang behaviour (docs/engine.md): the paths listed here (comma-separated) take the request and
# never answer, as a server that stopped answering them; e.g. STANDIN_TEST_HANG=/pause_generation.
TEST_HANG = frozenset(p for p in os.environ.get("STANDIN_TEST_HANG", "").split(",") if p)

# SGLang's sampling_params fields and defaults (srt/sampling/sampling_params.py). Every key is validated below.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "stop": None,
    "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "min_new_tokens": 0, "n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "sampling_seed": None, "logit_bias": None, "json_schema": None, "regex": None,
    "ebnf": None, "stop_regex": None, "custom_params": None, "stream_interval": None, "structural_tag": None}
# Fields engine.py implements only at their default value (HTTP 400 otherwise, naming the field).
DEFAULT_ONLY = ("frequency_penalty", "presence_penalty", "repetition_penalty", "json_schema",
                "regex", "ebnf", "stop_regex", "custom_params", "structural_tag")
RELEASE_TAGS = ("weights", "kv_cache", "cuda_graph")


class SchemaError(BadRequest):
    """A /generate field of the wrong JSON type, or a body that is not a JSON object: HTTP 400 with an ErrorResponse
    body {"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}, as 0.5.23 answers a body
    GenerateReqInput does not validate (entrypoints/http_server.py: validation_exception_handler overrides FastAPI's
    422); values out of range are 400 with {"error": {"message"}} (http_server.py: _create_error_response)."""


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
    bias = g("logit_bias", lambda v: isinstance(v, dict) and all(map(_is_num, v.values())),
             "an object of token id strings to numbers")
    logit_bias = {}
    for key, value in (bias or {}).items():  # sampling_params.py verify: int(key) in [0, vocab); "1" and "01" collide
        try:
            tok = int(key)
        except ValueError:
            raise BadRequest(f"field `sampling_params.logit_bias` keys must be token ids, got {json.dumps(key)[:40]}")
        if not 0 <= tok < vocab_size:
            raise BadRequest(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
        logit_bias[tok] = float(value)
    if max_new is not None and min_new > max_new:
        raise BadRequest(f"field `sampling_params.min_new_tokens` ({min_new}) must be <= max_new_tokens ({max_new})")
    greedy = temperature < GREEDY_EPS
    return SamplingParams(
        max_new_tokens=max_new, temperature=1.0 if greedy else float(temperature), greedy=greedy, top_p=float(top_p),
        top_k=top_k, min_p=float(min_p), stop_strs=[stop] if isinstance(stop, str) else [s for s in (stop or []) if s],
        stop_token_ids=list(stop_ids or []), min_new_tokens=min_new, sampling_seed=seed, stream_interval=interval or 1,
        logit_bias=logit_bias or None, **flags)


# The JSON types of GenerateReqInput's fields (managers/io_struct.py): a value of another type is a SchemaError.
GENERATE_SCHEMA: dict[str, Callable[[Any], bool]] = {
    "text": _list_of(_is_str), "input_ids": _list_of(_all_of(_is_int)), "rid": _list_of(_is_str),
    "sampling_params": _list_of(lambda v: isinstance(v, dict)), "return_logprob": _list_of(_is_bool),
    "logprob_start_len": _list_of(_is_int), "top_logprobs_num": _list_of(_is_int), "return_text_in_logprobs": _is_bool,
    "stream": _is_bool, "extra_key": _list_of(_is_str), "cache_salt": _list_of(_is_str),
    "token_ids_logprob": lambda v: _all_of(_is_int)(v) or _all_of(_all_of(_is_int))(v),
    "return_routed_experts": _is_bool, "routed_experts_start_len": _is_int}
# GenerateReqInput fields outside engine.py's subset (see the module docstring): HTTP 400 naming the field unless
# null or false, so that a request that relies on one fails instead of being answered without it.
UNSERVED = ("input_embeds", "image_data", "video_data", "audio_data", "custom_logit_processor", "lora_path",
            "session_params", "return_hidden_states", "return_entropy", "return_sampling_mask")
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
    for name in UNSERVED:
        if body.get(name) not in (None, False):
            raise BadRequest(f"field `{name}` is not supported by engine.py (its docstring lists what it serves)")
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
        elif isinstance(rid, list) and len(rid) != size:
            raise BadRequest(f"field `rid` must hold {size} unique strings, one per item of the batch")
        elif isinstance(rid, list) and len(set(rid)) != size:  # io_struct.py: _validate_rid_uniqueness
            raise BadRequest("Duplicate request IDs detected within the request: "
                             f"{[x for x in dict.fromkeys(rid) if rid.count(x) > 1]}")
        per_item = PER_ITEM + (("token_ids_logprob",) if isinstance((body.get("token_ids_logprob") or [0])[0], list)
                               else ())  # a list of lists: one per item; a flat list: the same for all (io_struct.py)
        for k in per_item:
            if isinstance(body.get(k), list) and len(body[k]) != size:
                raise BadRequest(f"field `{k}` holds {len(body[k])} values for a batch of {size}")
        items = [{**body, "text" if text is not None else "input_ids": (text if text is not None else ids)[i],
                  **{k: body[k][i] for k in per_item if isinstance(body.get(k), list)}} for i in range(size)]
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


def max_req_input_len(context_len: int) -> int:
    """The scheduler's max_req_input_len: a prompt must be shorter. managers/tp_worker.py sets max_req_len =
    min(context_len - 1, KV pool tokens - 1) and max_req_input_len = max_req_len - 5 (this KV slab holds any
    max_running full contexts)."""
    return context_len - 1 - 5


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
    if len(ids) >= context_len:  # the limits and messages of tokenizer_manager.py: _validate_one_request
        raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length ({context_len} "
                         "tokens).")
    if text is None and not all(0 <= t < vocab_size for t in ids):
        raise BadRequest(f"field `input_ids` must be a list of integers in [0, {vocab_size})")
    if not ids:
        raise BadRequest("field `input_ids` must not be empty")
    rid = _field(body, "rid", None, lambda v: _is_str(v) and v != "", "a non-empty string")
    token_ids = body.get("token_ids_logprob") or None  # tokenizer_manager.py: _validate_token_ids_logprob
    if token_ids is not None and not all(map(_is_int, token_ids)):
        raise BadRequest("token_ids_logprob must be a flat list of integers.")
    bad = next((t for t in token_ids or [] if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"token_ids_logprob contains out-of-vocabulary token id {bad}; valid range is "
                         f"[0, {vocab_size}).")
    if sp.max_new_tokens is not None and len(ids) + sp.max_new_tokens > context_len:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                         f"You requested a total of {len(ids) + sp.max_new_tokens} tokens: {len(ids)} tokens from the "
                         f"input messages and {sp.max_new_tokens} tokens for the completion. Please reduce the number "
                         "of tokens in the input messages or the completion to fit within the limit.")
    if len(ids) >= max_req_input_len(context_len):  # the scheduler's check (managers/utils.py: validate_input_length)
        raise BadRequest(f"Input length ({len(ids)} tokens) exceeds the maximum allowed length "
                         f"({max_req_input_len(context_len)} tokens). Use a shorter input or enable "
                         "--allow-auto-truncate.")
    # scheduler.py init_req_max_new_tokens: at most max_req_len - input - 1 (max_req_len: the context length - 1)
    sp = replace(sp, max_new_tokens=min(context_len - 2 - len(ids), 1 << 30 if sp.max_new_tokens is None
                                        else sp.max_new_tokens))
    req = Req(
        rid=rid or uuid.uuid4().hex, input_ids=list(ids), sp=sp, return_logprob=_flag(body, "return_logprob", False),
        top_logprobs_num=_field(body, "top_logprobs_num", 0, lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
        logprob_start_len=_field(body, "logprob_start_len", -1, lambda v: _is_int(v) and v >= -1, "an integer >= -1"),
        return_text_in_logprobs=_flag(body, "return_text_in_logprobs", False), token_ids_logprob=token_ids,
        stream=_flag(body, "stream", False), cache_ns=(body.get("extra_key") or None, body.get("cache_salt") or None))
    if req.logprob_start_len >= len(ids):
        raise BadRequest(f"field `logprob_start_len` ({req.logprob_start_len}) must be < the {len(ids)} input tokens")
    if req.return_logprob and req.logprob_start_len == -1 and token_ids is not None:
        req.logprob_start_len = len(ids) - 1  # 0.5.23 scheduler.py handle_generate_request: the last input token
    req.return_routed_experts = _flag(body, "return_routed_experts", False)
    req.routed_experts_start_len = _field(body, "routed_experts_start_len", 0, lambda v: _is_int(v) and v >= 0,
                                          "an integer >= 0")
    if req.routed_experts_start_len > len(ids):  # 0.5.23 scheduler.py: aborts such a request with this check
        raise BadRequest(f"field `routed_experts_start_len` ({req.routed_experts_start_len}) must be <= the "
                         f"{len(ids)} input tokens")
    return req


def flattened_bucket_layout(names: list, dtypes: list, shapes: list) -> list:
    """load_format "flattened_bucket" of /update_weights_from_distributed: the [start, end) byte range of each
    tensor in the one uint8 buffer the trainer broadcasts, back to back in order. sglang 0.5.23
    weight_sync/tensor_bucket.py FlattenedTensorBucket.empty, with its refusals (ValueError): no tensor, a tensor
    whose byte offset is not a multiple of its dtype's size (a negative dimension is refused before, with `shapes`)."""
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append((offset, offset + size))
        offset += size
    if not out:
        raise ValueError("Cannot create empty tensor bucket")
    return out


def _parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise BadRequest(f"field `dtypes` holds {name!r}, which is not a torch dtype name (e.g. 'bfloat16')")
    return dt


# -- HTTP server ---------------------------------------------------------------------------------------------------

class Gate:
    """Who may start a /generate: SGLang's pause flag (new requests wait while paused) and its model-update lock
    (every /generate reads for its lifetime; an update while not paused writes: it waits for readers, new ones wait).

    As in SGLang's RWLock (utils/aio_rwlock.py), the lock is held across no suspension but the condition's own wait,
    which releases it: so taking it never waits, and a handler cancelled on its way out (its client left, /health's
    request done) still gives its count back. (A wait_for around the wait held it for a loop iteration, during which
    a cancelled leave() kept its reader for good, and every later abort pause waited out --wait-timeout.)"""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.paused, self.writers, self.readers = False, 0, 0

    async def _wait(self, pred, timeout: float, what: str):
        try:
            async with asyncio.timeout(timeout):  # in this task: asyncio.wait_for would wait in another, lock held
                await self.cond.wait_for(pred)
        except TimeoutError:
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


def _error_response(message: str, status: int, kind: str) -> web.Response:
    """SGLang's ErrorResponse body (entrypoints/openai/protocol.py), as its handlers of a RequestValidationError
    (kind "Bad Request") and of an HTTPException (kind str(status)) answer (http_server.py)."""
    return web.json_response({"object": "error", "message": message, "type": kind, "param": None, "code": status},
                             status=status)


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
        self.ready, self.started = False, time.time()
        self.model_path = args.model_path  # the checkpoint served: the launch one, then each /update_weights_from_disk
        self.live: dict = {}  # rid -> Req of every registered /generate (SGLang's rid_to_state)
        self.session: Optional[str] = None  # between /begin_weight_update and /end_weight_update: its selector
        algorithm = (args.speculative_algorithm or "NONE").upper()  # a draft model runner, as 0.5.23 has one
        self.draft = (_DraftModel(args.speculative_draft_model_path or args.model_path)
                      if algorithm not in NO_DRAFT_MODEL else None)
        self.healthy = True  # SGLang's server_status Up (False: UnHealthy, after a /health that timed out)
        self.tasks: set = set()  # handlers of abandoned requests (see _gated)
        max_body = int(args.max_request_mb * 2 ** 20)
        self.app = web.Application(client_max_size=max_body, middlewares=[  # _test_hang: only when a test asks
            *([self._test_hang] if TEST_HANG else []), self._auth, self._errors])
        self.app["max_body"] = max_body
        # the most characters a token stands for (a byte-level token's string has one per byte): a longer text than
        # context_len times this cannot fit the context (for normalizers that delete no characters: BPE, SentencePiece)
        self.token_chars = max(len(t) for t in tokenizer.get_vocab())
        post, get = self.app.router.add_post, self.app.router.add_get
        for name in ("generate", "abort_request", "pause_generation", "continue_generation", "update_weights_from_disk",
                     "init_weights_update_group", "destroy_weights_update_group", "begin_weight_update",
                     "end_weight_update", "update_weights_from_distributed", "update_weights_from_tensor",
                     "update_weight_version", "tokenize", "detokenize"):  # POST /name: the method of that name
            post(f"/{name}", getattr(self, name))
        get("/get_weights_by_name", self.get_weights_by_name)
        post("/get_weights_by_name", self.get_weights_by_name)
        post("/v1/tokenize", self.tokenize)
        post("/v1/detokenize", self.detokenize)
        for path, fn in (("/flush_cache", self.flush_cache), ("/release_memory_occupation", self.release_memory),
                         ("/resume_memory_occupation", self.resume_memory)):
            get(path, fn)
            post(path, fn)
        for path, fn in (("/model_info", self.model_info), ("/get_model_info", self.model_info),
                         ("/server_info", self.server_info), ("/get_server_info", self.server_info),
                         ("/health", self.health), ("/health_generate", self.health), ("/ready", self.ready_),
                         ("/v1/loads", self.loads), ("/get_loads", self.loads), ("/v1/models", self.models)):
            get(path, fn)
        self.app.on_startup.append(self._on_startup)
        self.app.on_shutdown.append(self._on_shutdown)

    async def _on_startup(self, app):
        self.ready = True

    async def _on_shutdown(self, app):
        self.ready = False
        await asyncio.get_running_loop().run_in_executor(None, self.sched.stop)

    @web.middleware
    async def _test_hang(self, request, handler):
        """STANDIN_TEST_HANG (tests only): a listed path is never answered; the client's timeout or a stop ends it."""
        if request.path in TEST_HANG:
            await asyncio.Event().wait()
        return await handler(request)

    @web.middleware
    async def _auth(self, request, handler):
        """SGLang's --api-key check (utils/auth.py decide_request_auth): every path but /health*, /ready*, /metrics
        needs the bearer token."""
        key = self.args.api_key
        if (key and request.method != "OPTIONS" and not request.path.startswith(("/health", "/ready", "/metrics"))
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
            return _error_response(str(e), 400, "Bad Request")
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
        if final and r.abort_output:  # tokenizer_manager.py _handle_abort_req: these keys, no routed_experts
            meta = {"id": r.rid, "finish_reason": fin, "weight_version": self.sched.weight_version}
        else:
            meta = {"id": r.rid, "finish_reason": fin, "prompt_tokens": len(r.input_ids), "completion_tokens": n,
                    "cached_tokens": r.cached_tokens, "num_retractions": r.num_retractions,
                    "weight_version": self.sched.weight_version}
        if final:  # spans only in the final output (scheduler_components/output_streamer.py); a request with no
            # output token has one empty span of the current version (utils/weight_versions.py: compute_weight_version_
            # spans, add_weight_versions_to_meta_info, which also sets weight_version to the last span's)
            spans = [{"version": v, "start": s, "end": min(e, n)} for v, s, e in list(r.spans) if s < n]
            meta["weight_versions"] = spans or [{"version": self.sched.weight_version, "start": 0, "end": 0}]
            meta["weight_version"] = meta["weight_versions"][-1]["version"]
            meta["e2e_latency"] = r.finished_at - r.created
        if final and r.return_routed_experts and self.sched.recorder is not None and not r.abort_output:
            # 0.5.23 (batch_result_processor._maybe_collect_routed_experts): positions [start, prompt + output - 1),
            # collected when a running request finishes (an abort too); none for one finished from the queue
            end = len(r.input_ids) + n - 1
            rows = torch.cat(r.routes) if r.routes else torch.zeros(0, 1, 1, dtype=torch.int32)  # never prefilled
            meta["routed_experts"] = moe.encode(rows[min(r.routed_experts_start_len, end):end])
        if r.return_logprob:
            tt = (lambda t: self.tokenizer.decode([t])) if r.return_text_in_logprobs else (lambda t: None)
            meta["output_token_logprobs"] = [[lp, t, tt(t)] for lp, t in zip(r.logprobs[:n], ids)]
            meta["input_token_logprobs"] = [[lp, t, tt(t)] for lp, t in r.input_logprobs]
            meta["output_token_logprobs_length"] = n  # (add_logprob_to_meta_info)
            # per position a list of [lp, id, text], None where it has none (detokenize_top_logprobs_tokens)
            def tops(rows):
                return [[[lp, t, tt(t)] for lp, t in row] if row else None for row in rows]
            if r.top_logprobs_num:
                meta["output_top_logprobs"] = tops(r.top_logprobs[:n])
                meta["input_top_logprobs"] = tops(r.input_top_logprobs)
            if r.token_ids_logprob is not None:  # tokenizer_manager.py add_logprob_to_meta_info, part 3
                meta["input_token_ids_logprobs"] = tops(r.input_token_ids_logprobs)
                meta["output_token_ids_logprobs"] = tops(r.output_token_ids_logprobs[:n])
        if final and r.abort_output:
            meta["completion_tokens"] = n
        return {"text": text, "output_ids": ids, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request, error=SchemaError)  # a body that is no JSON object fails GenerateReqInput too
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
            if not reqs[i].stream and not final:  # (an unstreamed request's output every FORCE_STREAM_INTERVAL)
                return
            if final and not reqs[i].stream:
                left[0] -= 1
                code = (reqs[i].finish or {}).get("status_code")
                if left[0] and not (_is_int(code) and code >= 400):
                    return
            loop.call_soon_threadsafe(updates.put_nowait, (i, n, final))
        for r in reqs:  # a live rid is refused, never replaced (tokenizer_manager.py: _init_req_state)
            if r.rid in self.live:
                raise BadRequest(f"Duplicate request ID detected: {r.rid}")
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
            self.sched.call(lambda: self.sched.submit(reqs))
            return await self._respond(request, reqs, listed, updates)
        except asyncio.CancelledError:
            if not entered:  # the client left while waiting at the gate: SGLang's handler goes on regardless
                abandoned = True
                task = asyncio.ensure_future(self._gated(reqs, REQUEST_STATE_WAIT_TIMEOUT_S, abandoned=True))
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

    async def _run_to_end(self, reqs: list, timeout: float, client_gone: bool = False) -> None:
        """Submit reqs (their own notify) and wait until all finished, at most `timeout` seconds. client_gone: or
        until one outputs before its end (an unstreamed request every scheduler.FORCE_STREAM_INTERVAL tokens), which
        then ends, aborted, with its next forward pass."""
        loop = asyncio.get_running_loop()
        done = [loop.create_future() for _ in reqs]
        noticed = loop.create_future()

        def notify(r: Req, final: bool, fut: asyncio.Future) -> None:  # on the model thread
            if not final and client_gone and r.to_finish is None:
                r.to_finish, fut = abort_reason("Aborted"), noticed
            if final or fut is noticed:
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
        for r, fut in zip(reqs, done):
            r.notify = lambda n, final, r=r, fut=fut: notify(r, final, fut)
        self.sched.call(lambda: self.sched.submit(reqs))
        every = asyncio.gather(*done)
        try:
            await asyncio.wait([every, noticed], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            every.cancel()

    async def _gated(self, reqs, run_s: float, abandoned: bool = False) -> None:
        """Pass the pause gate, run reqs for at most run_s seconds, abort what is left: /health's request, and one
        whose client left at the gate (abandoned). 0.5.23 tokenizer_manager.py: generate_request waits at the gate
        before anything reaches the scheduler, so /pause_generation does not abort it and its handler goes on after
        continue; _wait_one_response notices the client left (is_disconnected) at the request's first output, an
        unstreamed one's at its FORCE_STREAM_INTERVAL-th token ("type 3"), or after SGLANG_REQUEST_STATE_WAIT_TIMEOUT
        without one ("type 1"), and aborts the whole call (_release_req_states_on_failure). A streamed one here:
        the timeout only."""
        try:
            with contextlib.suppress(TimeoutError):  # (the gate stayed shut: nothing ran)
                await self.gate.enter(self.args.wait_timeout)
                try:
                    await self._run_to_end(reqs, run_s, abandoned and not any(r.stream for r in reqs))
                finally:
                    self.sched.call(lambda: [self.sched.abort(r.rid, exact=True) for r in reqs
                                             if r.finish is None and r.to_finish is None])
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
                # tokenizer_manager.py _handle_abort_finish_reason: 400 is a ValueError, another an HTTPException
                message = reqs[i].finish.get("message") or "request failed"
                return _error(message) if code == 400 else _error_response(message, code, str(code))
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

        def load():  # every runner: 0.5.23's call has no selector (_select_runners() selects all)
            self.sched.load_from_disk(path, version, dtype)
            if self.draft is not None:
                self.draft.record(f"update_weights_from_disk {path}")
        resp = await self._update(lambda: self._run(load), options, f"Succeeded to update model weights from {path}.",
                                  f"loading {path} failed: ", num_paused_requests=0)  # 0.5.23's scheduler: always 0
        if resp.status == 200:  # /model_info names the new checkpoint (tokenizer_manager.py: _update_model_path_info)
            self.model_path = path
        return resp

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
        # in torch.distributed's registry by name, as SGLang's init_custom_process_group (_new_process_group_helper
        # with group_name) leaves it: a custom weight loader finds it there (weight_delta.load_delta)
        from torch.distributed.distributed_c10d import _world
        _world.pg_names[pg] = group
        return web.json_response({"success": True, "message": f"Succeeded to initialize group {group!r}."})

    async def destroy_weights_update_group(self, request):
        group = _field(await _body(request, required=False), "group_name", "weight_update_group", _is_str, "a string")
        entry = self.sched.groups.pop(group, None)
        if entry is None:
            return _fail(f"no weight-update group {group!r}")
        from torch.distributed.distributed_c10d import _world
        _world.pg_names.pop(entry[0], None)
        with contextlib.suppress(Exception):
            entry[0].shutdown()
        return web.json_response({"success": True, "message": f"Succeeded to destroy group {group!r}."})

    async def begin_weight_update(self, request):
        selector = self._selector(await _body(request))
        return await self._session(selector, "a weight-update session is already open; call end_weight_update() first")

    async def end_weight_update(self, request):
        await _body(request)
        return await self._session(None, "no weight-update session is open; call begin_weight_update() first")

    async def _session(self, selector: Optional[str], refusal: str) -> web.Response:
        """Open the session for the runners `selector` selects, or close it (None) for those it was opened for
        (0.5.23 scheduler_components/weight_updater.py begin_weight_update / end_weight_update)."""
        async with self.gate.exclusive(self.args.wait_timeout):  # 0.5.23 takes the writer lock unless paused
            if (self.session is None) == (selector is None):
                return _fail(refusal)
            for model in self._runners(selector or self.session)[1:]:  # the draft's, after the target's
                model.record("begin_weight_update" if selector else "end_weight_update")
            self.session = selector
        return web.json_response({"success": True, "message": "Success"})

    @staticmethod
    def _selector(body: dict) -> str:
        return _field(body, "selector", "all", lambda v: v in SELECTORS, "'target', 'draft' or 'all'")

    def _runners(self, selector: str) -> list:
        """The models a weight update with `selector` goes to, the target's first: the target (a _LoaderModel) and,
        on a server with one, the draft (0.5.23 scheduler_components/weight_updater.py _select_runners)."""
        return ([_LoaderModel(self.sched)] if selector in ("target", "all") else []) + (
            [self.draft] if selector in ("draft", "all") and self.draft is not None else [])

    def _load(self, models: list, named: list, version: Optional[str], loader: Optional[Callable] = None) -> None:
        """On the model thread: `named` to each model in turn, through `loader(model, named)` (a custom weight
        loader) or its load_weights, then the weight version (0.5.23 records it once every runner loaded)."""
        for model in models:
            loader(model, named) if loader is not None else model.load_weights(named)
        if version is not None:
            self.sched.weight_version = version

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
        # any string: 0.5.23's receive_weights_from_distributed treats all but "flattened_bucket" as one broadcast
        # per tensor (model_runner_components/weight_updater.py)
        load_format = _field(body, "load_format", None, _is_str, "a string or null")
        models = self._runners(self._selector(body))
        options = self._update_options(body)
        if group not in self.sched.groups:
            raise BadRequest(f"field `group_name`: no weight-update group {group!r}; call /init_weights_update_group")
        if self.session is None:  # refused before joining the broadcast: a client that broadcasts anyway hangs
            return _fail(SESSION_REQUIRED)
        pg, device = self.sched.groups[group]
        if load_format == "flattened_bucket":
            try:
                layout = flattened_bucket_layout(names, dtypes, shapes)
            except ValueError as e:  # refused before joining the broadcast, as 0.5.23 (success false)
                return _fail(f"Failed to receive weights: {e}")

        async def load():  # receive once, off the model thread (only the target joined the group), then every
            # selected runner loads it between two steps (0.5.23 update_weights_from_distributed)
            if load_format == "flattened_bucket":  # one uint8 broadcast, then views of it
                flat = torch.empty(layout[-1][1], dtype=torch.uint8, device=device)
                await asyncio.to_thread(broadcast_tensors, pg, [flat], self.args.dist_timeout)
                tensors = [flat[a:b].view(dt).reshape(s) for (a, b), s, dt in zip(layout, shapes, dtypes)]
            else:
                tensors = [torch.empty(s, dtype=dt, device=device) for s, dt in zip(shapes, dtypes)]
                await asyncio.to_thread(broadcast_tensors, pg, tensors, self.args.dist_timeout)
            await self._run(lambda: self._load(models, list(zip(names, tensors)), options[2]))
        return await self._update(load, options, f"Succeeded to update {len(names)} parameters.")

    async def update_weights_from_tensor(self, request):
        """Colocate (sglang managers/scheduler_components/weight_updater.py update_weights_from_tensor): each
        `serialized_named_tensors[tp_rank]` is base64 ForkingPickler bytes of (name, tensor) pairs, shared-memory
        files on CPU (torch's file_system sharing), CUDA IPC handles on GPU. Refused outside a weight-update session."""
        body = await _body(request)
        payloads = _required(body, "serialized_named_tensors", lambda v: _all_of(_is_str)(v) and len(v) > 0,
                             "a non-empty list of base64 strings, one per TP rank")
        # model_runner_components/weight_updater.py update_weights_from_tensor: "direct", a --custom-weight-loader
        # (dynamic_import(load_format)(model, named_tensors)) or null; 'flattened_bucket' needs sglang's classes
        custom = self.args.custom_weight_loader or []
        load_format = _field(body, "load_format", None, lambda v: v == "direct" or v in custom,
                             f"null, 'direct' or a --custom-weight-loader of this server ({custom}); Unknown "
                             "load_format")
        models = self._runners(self._selector(body))
        _flag(body, "torch_empty_cache", False)
        options = self._update_options(body)
        if self.session is None:
            return _fail(SESSION_REQUIRED.replace("update_weights_from_distributed", "update_weights_from_tensor"))
        try:  # this engine is TP rank 0 of 1
            named = deserialize_named_tensors(payloads[0])
        except Exception as e:
            raise BadRequest(f"field `serialized_named_tensors`: payload 0 does not deserialize: {e}") from None
        load = ((lambda: self._custom_load(load_format, models, named, options[2])) if load_format in custom else
                (lambda: self._load(models, named, options[2])))  # once per selected runner, the target's first
        return await self._update(lambda: self._run(load), options, "Success")

    def _custom_load(self, load_format: str, models: list, named: list, version: Optional[str]) -> None:
        """On the model thread: a --custom-weight-loader `module.func` called once per selected runner (0.5.23
        update_weights_from_tensor) with its model, whose load_weights loads by checkpoint names (the target's:
        scheduler.load_tensors), and the payload's pairs. A refusal of weight_delta.py's loader
        (DeltaRefused: the bucket was checked before anything of it was applied) answers success false; any other
        exception ends this server as 0.5.23 ends it, where nothing on the scheduler's path catches it, a refusal
        included (weight_delta.py's docstring): managers/scheduler.py run_scheduler_process logs "Scheduler hit an
        exception" and sends SIGQUIT to its parent, the server's main process, whose handler
        (tokenizer_manager.py SignalHandler.running_phase_sigquit_handler; before the first request
        entrypoints/engine.py launch_phase_sigquit_handler) calls utils/common.py kill_process_tree(os.getpid()):
        SIGKILL to every descendant, then to itself. The scheduler kills its process group (os.killpg) only with
        SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=true (environ.py, default false). The caller sees its connection
        dropped; the server's launcher sees it killed by SIGKILL (services.py relaunches it; the next sync is
        full)."""
        import importlib

        from weight_delta import DeltaRefused

        module, _, fn = load_format.rpartition(".")
        try:
            self._load(models, named, version, getattr(importlib.import_module(module), fn))
        except DeltaRefused:
            raise  # answered by _update: success false, the message
        except BaseException:
            import traceback
            log.error("Scheduler hit an exception: %s", traceback.format_exc())
            logging.shutdown()
            kill_process_tree()

    async def get_weights_by_name(self, request):
        """0.5.23 http_server.py get_weights_by_name -> models/llama.py get_weights_by_name: the named parameter (the
        served model's parameter names; a tied lm_head.weight gives the embeddings) in float32 as nested lists, its
        first `truncate_size` rows (default 100); a name it lacks answers 400 "Get parameter by name failed"."""
        body = await _body(request)
        name = _required(body, "name", _is_str, "a string")
        size = _field(body, "truncate_size", 100, lambda v: _is_int(v) and v >= 0, "an integer >= 0")

        def read():
            params = dict(self.sched.model.named_parameters())
            p = params.get(name)
            if p is None and name == "lm_head.weight":
                p = self.sched.model.get_input_embeddings().weight
            return None if p is None else p.detach()[:size].cpu().to(torch.float32).numpy().tolist()
        out = await self._run(read)
        if out is None:
            return _error("Get parameter by name failed")
        return web.json_response(out)

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

    # -- tokenizer endpoints (entrypoints/openai/serving_tokenize.py) ------------------------------------------
    async def tokenize(self, request):
        """/tokenize: {"prompt": str or [str], "add_special_tokens": true} -> {"tokens", "count", "max_model_len"}
        (TokenizeRequest / TokenizeResponse); chat `messages` are not served here (no chat template renderer)."""
        body = await _body(request, error=SchemaError)
        if (body.get("prompt") is None) == (body.get("messages") is None):
            raise SchemaError("Exactly one of 'prompt' or 'messages' must be provided.")
        if body.get("messages") is not None:
            raise BadRequest("field `messages` is not supported by engine.py's /tokenize; send `prompt`")
        prompt = body["prompt"]
        if not _list_of(_is_str)(prompt):
            raise SchemaError(f"field `prompt` must be a string or a list of strings, got {json.dumps(prompt)[:80]}")
        special = _field(body, "add_special_tokens", True, _is_bool, "true or false")
        tokens = [self.tokenizer.encode(t, add_special_tokens=special) for t in ([prompt] if _is_str(prompt)
                                                                                 else prompt)]
        most = getattr(self.tokenizer, "model_max_length", -1)  # a tokenizer's "no limit" (1e30): the context length
        most = self.sched.context_len if _is_int(most) and not -2 ** 63 <= most < 2 ** 64 else most
        return web.json_response({"tokens": tokens[0] if _is_str(prompt) else tokens,
                                  "count": len(tokens[0]) if _is_str(prompt) else [len(t) for t in tokens],
                                  "max_model_len": most})

    async def detokenize(self, request):
        """/detokenize: {"tokens": [int] or [[int]], "skip_special_tokens": true} -> {"text": str or [str]}."""
        body = await _body(request, error=SchemaError)
        tokens = body.get("tokens")
        if not (_all_of(_is_int)(tokens) or _all_of(_all_of(_is_int))(tokens)):
            raise SchemaError(f"field `tokens` must be a list of integers or of lists of integers, got "
                              f"{json.dumps(tokens)[:80]}")
        skip = _field(body, "skip_special_tokens", True, _is_bool, "true or false")
        if tokens and isinstance(tokens[0], list):
            return web.json_response({"text": [self.tokenizer.decode(t, skip_special_tokens=skip) for t in tokens]})
        return web.json_response({"text": self.tokenizer.decode(tokens, skip_special_tokens=skip) if tokens else ""})

    # -- info endpoints ---------------------------------------------------------------------------------------
    async def model_info(self, request):
        cfg = self.sched.model.config
        return web.json_response({
            "model_path": self.model_path, "served_model_name": self.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": self.sched.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False, "model_type": cfg.model_type,
            "architectures": getattr(cfg, "architectures", None)})

    def limits(self) -> dict:
        """/server_info's size fields: `context_length` is the --context-length flag as given (server args, null when
        absent); the scheduler's max_total_num_tokens (the KV slab: max_running full contexts) and max_req_input_len
        (managers/scheduler.py: get_init_info, merged by utils/common.py: build_server_info). The context length
        itself is /v1/models `max_model_len`."""
        return {"context_length": self.args.context_length, "max_req_input_len": max_req_input_len(
            self.sched.context_len), "max_total_num_tokens": self.sched.max_running * self.sched.context_len}

    async def models(self, request):
        """/v1/models (entrypoints/http_server.py: available_models): one ModelCard, max_model_len the context length
        requests are checked against."""
        return web.json_response({"object": "list", "data": [{
            "id": self.model_path, "object": "model", "created": int(self.started), "owned_by": "sglang",
            "root": self.model_path, "parent": None, "max_model_len": self.sched.context_len}]})

    async def server_info(self, request):
        """The launch arguments plus live scheduler state (0.5.23 entrypoints/http_server.py server_info:
        utils/common.py build_server_info over server_args): its weight_version is the launch --weight-version, which
        no update moves; the live one is /model_info's."""
        info = {k: v for k, v in vars(self.args).items() if k not in ("api_key", "report_version")}
        info.update({"version": self.args.report_version, "tp_size": 1, "dp_size": 1, "device": str(self.sched.device),
                     **self.limits(),
                     "internal_states": [{"last_gen_throughput": self.sched.throughput,
                                          "effective_max_running_requests_per_dp": self.sched.max_running,
                                          "max_total_num_tokens": self.sched.max_total_tokens,
                                          "num_retracted_reqs": self.sched.retracted_total}]})
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
        """/v1/loads, counted on the model thread between two steps as 0.5.23's scheduler answers get_loads
        (load_inquirer.py): read from here, a request being prefilled (off the queue, not yet running) was in
        neither count, and a test that waited for "0 running, 0 waiting" went on while one was still coming."""
        s = self.sched
        if not s.thread.is_alive():  # (nothing would answer the call)
            return _error("the model thread is not running", 503)

        def count():
            return len(s.running), len(s.waiting), s.kv.n * len(s.running) if s.kv is not None else 0
        running, waiting, used = await self._run(count)
        return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
            "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_total_reqs": running + waiting,
            "num_used_tokens": used, "max_running_requests": s.max_running, "paused": s.paused}]})


def kill_process_tree() -> None:
    """0.5.23 utils/common.py kill_process_tree(os.getpid()): SIGKILL to every descendant of this process (/proc),
    then to this process; never its process group."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    todo = [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            todo.append(pid)
    os.kill(os.getpid(), signal.SIGKILL)


# -- Launching (CLI and subprocess helper) -------------------------------------------------------------------------

class _LoaderModel:
    """What a custom weight loader gets as `model` here: load_weights by checkpoint names, as SGLang's models."""

    def __init__(self, sched: Scheduler):
        self._sched = sched

    def load_weights(self, named) -> None:
        self._sched.load_tensors(list(named), None)


class _DraftModel:
    """The draft model runner of a server launched with a speculative algorithm that has one (every one but NGRAM
    and UNO: 0.5.23 speculative/base_spec_worker.py weight_update_runners), which weight updates may select. No
    speculative decoding happens here and it holds no weights: each weight operation it gets is one log line,
    DRAFT_LOG first, naming it (and for a load, the tensors and their elements)."""

    def __init__(self, path: str):
        self.path = path  # --speculative-draft-model-path (NEXTN / MTP drafts default to --model-path)

    def record(self, what: str) -> None:
        log.info("%s %s", DRAFT_LOG, what)

    def load_weights(self, named) -> None:
        named = list(named)
        self.record(f"load_weights {len(named)} tensors, {sum(t.numel() for _, t in named)} elements: "
                    f"{[n for n, _ in named][:5]}")


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
    """Start `python -m standins.engine` on a free port (or `port`), wait until /health answers 200 and return (url, handle).
    Keyword arguments become flags (max_running_requests=8 -> --max-running-requests 8); `env` adds environment
    variables (e.g. SGLANG_HEALTH_CHECK_TIMEOUT); the log goes to log_path (default: a temporary file)."""
    if not port:
        from services import free_port  # below the ephemeral range, as train.py's own launches

        port = free_port(host)
    url = f"http://{host}:{port}"
    cmd = [sys.executable, "-m", "standins.engine", "--model-path", str(model_path), "--host", host, "--port",
           str(port)]
    for k, v in kw.items():
        if v is not None and v is not False:
            cmd += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"engine-{port}-", suffix=".log")
        os.close(fd)
    with open(log_path, "w") as logf:
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)  # `-m standins.engine`
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})})
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


def with_config(argv: list) -> list:
    """SGLang 0.5.23's --config (server_args.py prepare_server_args -> utils/server_args_config_parser.py
    ConfigArgumentMerger.merge_config_with_args): a .yaml / .yml file of `flag-name: value` read inside the server,
    its flags put before the command line's (which win): `true` is a bare flag, `false` none, a list its values.
    How services.py gives a server its api key (`api-key: KEY`) off the command line."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if argv.count("--config") > 1 or at == len(argv) - 1:
        raise SystemExit("--config: give one YAML file (SGLang: 'Multiple config files specified! Only one allowed.')")
    path = argv[at + 1]
    if not path.lower().endswith((".yaml", ".yml")):
        raise SystemExit(f"--config: Config file must be YAML format, got: {os.path.splitext(path)[1]}")
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit("--config: Config file must contain a dictionary at root level")
    flags = []
    for key, value in data.items():
        if value is True:
            flags.append(f"--{key}")
        elif isinstance(value, list):
            flags += [f"--{key}", *map(str, value)] if value else []
        elif value is not False:
            flags += [f"--{key}", str(value)]
    return flags + argv[:at] + argv[at + 2:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", required=True, help="HF checkpoint directory (config, weights, tokenizer)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (not on /health*), as SGLang")
    p.add_argument("--config", default=None, help="a YAML file of flags (SGLang's): `api-key: KEY` keeps the key off\n"
                   "the command line")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-running-requests", type=int, default=None,
                   help=f"requests decoded together; the rest queue (default {DEFAULT_MAX_RUNNING}; /server_info\n"
                        "reports the flag as given, null when absent, and the limit in internal_states)")
    p.add_argument("--context-length", type=int, default=None,
                   help="the context length requests are checked against (default: the model's\n"
                        "max_position_embeddings; at most that)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="a request that finds this many waiting is aborted with 503 \"The request queue is full.\"\n"
                        "(default: unbounded; SGLang's flag)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="the KV pool in tokens, shared by the prefix cache and the running requests; the cache is\n"
                        "evicted, then requests retracted, when a step lacks slots (SGLang's flag; default: sized by\n"
                        "memory, scheduler.KV_POOL_MEM_FRACTION of the host's memory / the free GPU memory)")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix cache: every prompt is prefilled in full (SGLang's flag)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record a MoE's top-k experts per token for requests with return_routed_experts (SGLang's\n"
                        "flag; without it they get no meta_info.routed_experts)")
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="prompt tokens prefilled in one batch")
    p.add_argument("--weight-version", default="default",
                   help="weight_version reported until an update changes it (SGLang's default, 'default')")
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
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="keep released weights (and buffers) in host memory and restore them on resume, as SGLang")
    p.add_argument("--speculative-algorithm", default=None,
                   help="a speculative algorithm: every one but NGRAM / UNO gives this server a draft model runner\n"
                        "that weight updates may select (`selector`; its operations are logged, DRAFT_LOG); no\n"
                        "speculative decoding here (SGLang's flag)")
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None,
                   help="the draft model's checkpoint (SGLang's flag; not loaded here)")
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        p.add_argument(flag, type=int, default=None, help="accepted and unused (SGLang's flag)")
    p.add_argument("--custom-weight-loader", nargs="*", default=None,
                   help="import paths (module.func) /update_weights_from_tensor may name as load_format; each is\n"
                        "called with (model, named_tensors) (SGLang's flag; e.g. weight_delta.load_delta)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(with_config(sys.argv[1:] if argv is None else list(argv)))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s")
    for name, v in (("--max-running-requests", args.max_running_requests),
                    ("--max-prefill-tokens", args.max_prefill_tokens),
                    ("--max-queued-requests", args.max_queued_requests),
                    ("--max-total-tokens", args.max_total_tokens)):
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
                      args.max_prefill_tokens, str(args.weight_version), args.disable_radix_cache,
                      max_queued=args.max_queued_requests, record_routes=args.enable_return_routed_experts,
                      max_total_tokens=args.max_total_tokens)
    sched.weights_cpu_backup = args.enable_weights_cpu_backup
    if args.context_length is not None:
        if not 8 <= args.context_length <= sched.context_len:
            p.error(f"--context-length must be in [8, {sched.context_len}] (the model's max_position_embeddings), "
                    f"got {args.context_length}")
        sched.context_len = args.context_length
    sched.thread.start()
    server = Server(args, sched, tokenizer)
    log.info("serving %s on http://%s:%d (device %s, max_running_requests %d, max_total_num_tokens %d, reporting "
             "sglang %s)", args.model_path, args.host, args.port, device, sched.max_running, sched.max_total_tokens,
             args.report_version)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request (as SGLang)
    web.run_app(server.app, host=args.host, port=args.port, handler_cancellation=True, print=None,
                access_log=None, shutdown_timeout=3.0)


if __name__ == "__main__":
    main()
    from services import exit_process

    exit_process(0)  # the server has shut down: no teardown of torch and transformers to wait for
