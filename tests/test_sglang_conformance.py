"""Where standins/engine.py behaves like sglang 0.5.23 because a client that relies on anything else fails on a real
fleet, and the client fixes that depend on it (issue 17). Each test's docstring names the file of the 0.5.23 wheel
(paths under sglang/srt/) and the function whose behaviour it imitates or guards against.

One engine subprocess (two tiny models of different weights, A served first) serves the module, with
SGLANG_HEALTH_CHECK_TIMEOUT=2 and SGLANG_REQUEST_STATE_WAIT_TIMEOUT=1 (20 s and 4 s in SGLang) so that waiting for
them stays short. Tests that change its weights restore A and flush. Run:
.venv/bin/python -m pytest -q tests/test_sglang_conformance.py
"""
import concurrent.futures as cf
import contextlib
import json
import time
import types

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

import buffer
import config
from standins import engine
import logprobs
import rollout
import run_modes
import sglang_client
from standins import scheduler
import tasks
from test_engine import make_model  # a tiny model with random RMSNorm gains, as the engine tests use
from test_rollout import wait_until

HEALTH_S, NOTICE_S = 2, 1  # the module's SGLANG_HEALTH_CHECK_TIMEOUT, SGLANG_REQUEST_STATE_WAIT_TIMEOUT (integers,
# as 0.5.23 reads them)
LONG = 3000  # max_new_tokens of a request meant to be still running when the test acts on it
P = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    paths = {k: make_model(str(root / k), s) for k, s in (("A", 0), ("B", 1))}
    return paths, {k: AutoModelForCausalLM.from_pretrained(p).eval() for k, p in paths.items()}


@pytest.fixture(scope="module")
def url(models):
    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_S), "SGLANG_REQUEST_STATE_WAIT_TIMEOUT": str(NOTICE_S)}
    url, handle = engine.launch(models[0]["A"], max_running_requests=8, num_threads=1, wait_timeout=60, env=env)
    yield url
    handle.stop()


def post(url, path, body=None, timeout=60):
    return requests.post(url + path, json=body if body is not None else {}, timeout=timeout)


def gen(url, ids, timeout=60, **kw):
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    for k in ("rid", "extra_key", "cache_salt"):
        if k in kw:
            body[k] = kw.pop(k)
    body["sampling_params"].update(kw)
    r = post(url, "/generate", body, timeout)
    assert r.status_code == 200, r.text
    return r.json()


def lps(out):
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def reference_lps(model, prompt, output, temperature=1.0):
    """The trainer's log-probs (logprobs.token_logprobs) of `output` after `prompt` under `model`."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits.float()[:, len(prompt) - 1:-1]
    return logprobs.token_logprobs(logits, ids[:, len(prompt):], temperature)[0][0].tolist()


def running(url):
    return requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]["num_running_reqs"]


def set_weights(url, path, version, flush=True):
    r = post(url, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version),
                                                "flush_cache": flush})
    assert r.status_code == 200 and r.json()["success"], r.text


def version(url):
    return sglang_client.parse_version(requests.get(url + "/model_info", timeout=10).json()["weight_version"], url)


# ---------------------------------------------------------------------------------------------------------------
# /health through the pause gate (breakage 1)

def test_health_generates_through_the_pause_gate(url, models):
    """entrypoints/http_server.py: health_generate. A paused server's /health waits SGLANG_HEALTH_CHECK_TIMEOUT for
    output, answers 503 and marks the server unhealthy (/ready 503, tokenizer_manager.py: is_ready); /model_info
    and /server_info answer while paused; after continue /health is 200 and the server healthy again.
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=False (environ.py: EnvBool lower-cases it): /health is 200 without
    generating, also while paused. That server runs without --weight-version: it reports "default" (0.5.23's server
    args default), which the client reads as version 0; its --context-length 64 is /server_info's context_length."""
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/ready", timeout=10).status_code == 200
    assert post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
    try:
        t0 = time.monotonic()
        assert requests.get(url + "/health", timeout=30).status_code == 503
        assert time.monotonic() - t0 >= HEALTH_S - 0.1  # it waited for a token that never came
        assert requests.get(url + "/ready", timeout=10).status_code == 503
        assert requests.get(url + "/model_info", timeout=10).status_code == 200
        assert requests.get(url + "/server_info", timeout=10).status_code == 200
    finally:
        assert post(url, "/continue_generation").status_code == 200
    assert requests.get(url + "/health", timeout=30).status_code == 200
    assert requests.get(url + "/ready", timeout=10).status_code == 200
    off, handle = engine.launch(models[0]["A"], num_threads=1, context_length=64,
                                env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "False",
                                     "SGLANG_HEALTH_CHECK_TIMEOUT": str(HEALTH_S)})
    try:  # (launched without --weight-version: arg_groups/fields/serving.py weight_version defaults to "default")
        assert requests.get(off + "/model_info", timeout=10).json()["weight_version"] == "default"
        info = requests.get(off + "/server_info", timeout=10).json()
        assert (info["context_length"], info["max_req_input_len"]) == (64, 58)  # the flag as given, and its limit
        assert requests.get(off + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 64
        out = gen(off, P, max_new_tokens=2)
        assert out["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 2}]
        assert sglang_client.parse_generate_response(out).versions == [0, 0]  # the client's version 0: the launch weights
        assert post(off, "/pause_generation", {"mode": "in_place"}).status_code == 200
        assert requests.get(off + "/health", timeout=10).status_code == 200
        assert requests.get(off + "/health_generate", timeout=30).status_code == 503  # still generates
    finally:
        handle.stop()


def test_environment_switches_are_read_as_environ_py_reads_them(monkeypatch):
    """environ.py: EnvBool lower-cases the value (true/1/yes/y, false/0/no/n), EnvInt takes int(value), EnvFloat
    float(value); anything else warns and gives the default (EnvField.get)."""
    for value, want in (("False", False), ("NO", False), ("0", False), ("n", False), ("True", True), ("Y", True),
                        ("1", True), ("maybe", True)):
        monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", value)
        assert engine.env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True) is want, value
    monkeypatch.delenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION")
    assert engine.env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True) is True
    for value, want in (("7", 7), ("1.5", 4), ("", 4)):
        monkeypatch.setenv("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", value)
        assert engine.env_int("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", 4) == want, value
    for value, want in (("2.5", 2.5), ("3", 3.0), ("soon", -1.0)):  # EnvFloat: SGLANG_REQ_*_TIMEOUT
        monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", value)
        assert scheduler.env_float("SGLANG_REQ_WAITING_TIMEOUT", -1.0) == want, value
    # utils/common.py: get_bool_env_var, which layers/sampler.py reads SGLANG_RETURN_ORIGINAL_LOGPROB with: true/1 only
    for value, want in (("True", True), ("1", True), ("yes", False), ("False", False), ("maybe", False)):
        monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", value)
        assert scheduler.bool_env_var("SGLANG_RETURN_ORIGINAL_LOGPROB") is want, value
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB")
    assert scheduler.bool_env_var("SGLANG_RETURN_ORIGINAL_LOGPROB") is False


def test_an_abort_with_status_400_or_above_is_that_http_error_in_sglangs_body():
    """managers/tokenizer_manager.py: _handle_abort_finish_reason raises a ValueError for status 400 (http_server.py
    _create_error_response: {"error": {"message"}}) and an HTTPException otherwise, which http_server.py's
    HTTPException handler answers with an ErrorResponse {"object": "error", "message", "type": str(status), "param":
    null, "code": status}."""
    import asyncio

    server = engine.Server.__new__(engine.Server)
    for status, want in ((400, {"error": {"message": "bad"}}),
                         (503, {"object": "error", "message": "bad", "type": "503", "param": None, "code": 503}),
                         (500, {"object": "error", "message": "bad", "type": "500", "param": None, "code": 500})):
        r = scheduler.Req("r", [1], engine.parse_sampling_params({"max_new_tokens": 1}, 10))
        r.finish = scheduler.abort_reason("bad", status, "X")

        async def respond():
            updates = asyncio.Queue()
            updates.put_nowait((0, 0, True))
            return await server._respond(None, [r], False, updates)
        resp = asyncio.run(respond())
        assert (resp.status, json.loads(resp.body)) == (status, want)


def test_weight_sync_liveness_answers_on_paused_servers(url):
    """Breakage 1, the client: train.py's sync_weights runs Fleet.live_workers while the servers are paused
    (rollout.partial: true). With /health (entrypoints/http_server.py: health_generate) every paused server looked
    dead and the sync raised after rollout.startup_timeout_s; /model_info passes no gate."""
    sync = sglang_client.SyncFleet(sglang_client.Fleet([url]))
    try:
        sync.pause("in_place")
        try:
            assert sync.live_workers(HEALTH_S + 1.0) == [url]
        finally:
            sync.continue_()
    finally:
        sync.close()


# ---------------------------------------------------------------------------------------------------------------
# The prefix cache (breakages 2 and 3)

def test_prefix_cache_is_keyed_on_tokens_and_namespace_and_outlives_weight_updates(url, models):
    """mem_cache/radix_cache.py: RadixKey (token ids + extra_key / cache_salt, never the weight version);
    managers/scheduler.py: flush_cache. A repeated prompt reuses all but its last token; another extra_key or
    cache_salt does not; a weight update without a flush leaves the old weights' KV in use, so the log-probs stop
    matching the trainer's; a flush (or a new namespace) restores them. /flush_cache is refused while a request
    runs (is_fully_idle)."""
    paths, refs = models
    v0 = version(url)
    assert post(url, "/flush_cache").status_code == 200
    first = gen(url, P)
    again = gen(url, P)
    assert (first["meta_info"]["cached_tokens"], again["meta_info"]["cached_tokens"]) == (0, len(P) - 1)
    assert again["output_ids"] == first["output_ids"] and max(map(abs, map(float.__sub__, lps(again),
                                                                           lps(first)))) < 1e-5
    assert gen(url, P, extra_key="other")["meta_info"]["cached_tokens"] == 0
    assert gen(url, P, cache_salt="salt")["meta_info"]["cached_tokens"] == 0
    try:
        set_weights(url, paths["B"], v0 + 1, flush=False)
        stale = gen(url, P)
        fresh = gen(url, P, extra_key=f"weights-{v0 + 1}")
        assert stale["meta_info"]["cached_tokens"] == len(P) - 1 and fresh["meta_info"]["cached_tokens"] == 0
        want = reference_lps(refs["B"], P, stale["output_ids"])
        assert max(abs(a - b) for a, b in zip(lps(stale), want)) > 1e-2  # old KV under the new weights
        want = reference_lps(refs["B"], P, fresh["output_ids"])
        assert max(abs(a - b) for a, b in zip(lps(fresh), want)) < 1e-4
        with cf.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(gen, url, [3, 4], max_new_tokens=LONG, ignore_eos=True, rid="flush-block.")
            wait_until(lambda: running(url) == 1, 30, "the blocking request to run")
            assert post(url, "/flush_cache").status_code == 400
            post(url, "/abort_request", {"rid": "flush-block."})
            assert fut.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        assert post(url, "/flush_cache").status_code == 200
        flushed = gen(url, P)
        assert flushed["meta_info"]["cached_tokens"] == 0
        want = reference_lps(refs["B"], P, flushed["output_ids"])
        assert max(abs(a - b) for a, b in zip(lps(flushed), want)) < 1e-4
    finally:
        set_weights(url, paths["A"], v0 + 2)


def test_the_last_weight_bucket_carries_tensors_the_version_and_the_flush(tmp_path, monkeypatch):
    """Breakage 2: a bucket is pushed once it reaches weight_sync.bucket_mb; when that emptied it, the last call was
    /update_weight_version, which never flushes (managers/scheduler.py: update_weights_from_distributed flushes
    only with flush_cache), and the radix cache kept serving old-weight prefix KV. Here the last FSDP unit (the
    root: embeddings, final norm, head) exactly fills its bucket; weight_sync.WeightSync.push runs with the
    gathering and the HTTP/broadcast of each bucket recorded instead."""
    import hf_export
    import weight_sync

    model = AutoModelForCausalLM.from_pretrained(make_model(str(tmp_path / "m"), 0))
    units = hf_export.fsdp_units(model)
    params = dict(model.named_parameters())
    root_mb = sum(params[n].numel() for n in units[-1][1]) * 4 / 2 ** 20  # float32 on CPU
    ws = object.__new__(weight_sync.WeightSync)
    ws.cfg = types.SimpleNamespace(weight_sync=types.SimpleNamespace(method="distributed", bucket_mb=root_mb,
                                                                     delta=False), flush_on_update=True)
    ws.model, ws.device, ws.dtype, ws.rank, ws.world = model, torch.device("cpu"), torch.float32, 0, 1
    calls, pushes = [], []
    ws.fleet = types.SimpleNamespace(begin_weight_update=lambda: calls.append("begin"),
                                     end_weight_update=lambda *a: calls.append("end"))
    monkeypatch.setattr(weight_sync, "gather_bucket", lambda m, spec, dtype, device: weight_sync.Bucket(spec, dtype,
                                                                                                       device))
    transport = types.SimpleNamespace(  # the distributed transport's interface, recording instead of sending
        bucketed=True, begin=lambda version: calls.append("transport"), buckets=lambda: contextlib.nullcontext({0}),
        start=lambda bucket, version, error: pushes.append(([n for n, _ in bucket.named], version)) or {},
        finish=lambda p, error: error)
    ws.delta, ws.transports = None, {"distributed": transport}
    ws.push(7)
    assert len(pushes) >= 2 and all(names for names, _ in pushes), pushes
    assert [v for _, v in pushes] == [None] * (len(pushes) - 1) + [7]  # the version (and the flush) on the last
    assert pushes[-1][0] == units[-1][1] and calls == ["transport", "begin", "end"]
    assert [n for names, _ in pushes for n in names] == [n for _, names in units for n in names]


def in_place_cfg(url):
    return config.load_config(None, [
        "colocate=false", "fully_async.enable=true", "fully_async.stale_steps=1", "data_source.num_prompts_per_step=2",
        "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2", "data_source.num_prompts=2",
        "rollout.sampling.max_new_tokens=6", f"rollout.servers=[{url}]", "rollout.pause_timeout_s=60",
        "rollout.partial=true", "rollout.pause_mode=in_place", "rollout.reward_pool=inline"])


def test_in_place_sends_a_cache_namespace_per_weight_version(url, models):
    """Breakage 3: with rollout.pause_mode in_place the update cannot flush (requests still run), and the radix
    cache (mem_cache/radix_cache.py: RadixKey) would give every later request of a prompt seen before the update
    the old weights' KV. Each /generate carries extra_key = its weight version, so the trajectories generated
    wholly after the update have the trainer's log-probs under the new weights."""
    paths, refs = models
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths["A"])
    cfg = in_place_cfg(url)
    v0 = version(url)
    buf = buffer.PipelineServer(cfg, [tasks.load_prompts(cfg.data_source[0], tok, "train")])
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, buf, sync, tok)
    try:
        ro.start()
        buf.get(2, timeout=60)  # both prompts generated (and cached) under A
        ro.pause()
        # groups in flight now may still be prefilled after the update, under their old namespace (in_place's
        # known mix of weights): only groups dispatched after resume are checked
        kept = set(buf.stats(keys=True)["in_flight_keys"])
        set_weights(url, paths["B"], v0 + 1, flush=False)
        buf.set_weight_version(v0 + 1)
        ro.resume(v0 + 1)
        checked, deadline = 0, time.monotonic() + 60
        while checked < 4:
            assert time.monotonic() < deadline, f"only {checked} trajectories wholly of version {v0 + 1} in 60 s"
            for g in buf.get(1, timeout=60):
                for t in g.trajectories:
                    if g.prompt.prompt_id in kept or set(t.versions.tolist()) != {v0 + 1}:
                        continue
                    want = reference_lps(refs["B"], t.prompt_ids.tolist(), t.response_ids.tolist())
                    assert max(abs(a - b) for a, b in zip(t.rollout_log_probs.tolist(), want)) < 1e-4
                    checked += 1
        ro.pause()
    finally:
        ro.stop()
        sync.close()
        buf.close()
        set_weights(url, paths["A"], v0 + 2)


# ---------------------------------------------------------------------------------------------------------------
# Pause in place, and requests abandoned at the pause gate (breakages 4 and 5)

def test_in_place_pause_runs_no_forward_and_aborts_answer_at_continue(url):
    """Breakage 4, managers/scheduler.py (abort handling): an aborted running request "still runs one decode
    forward pass", which a scheduler paused in place does not run, so the abort's reply comes after
    /continue_generation, one token longer. (Trajectory timeouts and stop are not instant on a paused server.)"""
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(gen, url, [3, 4], max_new_tokens=LONG, ignore_eos=True, rid="inplace-abort.")
        wait_until(lambda: running(url) == 1, 30, "the request to run")
        assert post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
        try:
            used = requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]["num_used_tokens"]
            assert post(url, "/abort_request", {"rid": "inplace-abort."}).status_code == 200
            time.sleep(0.5)
            assert not fut.done()  # no reply while paused
            assert requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]["num_used_tokens"] == used
        finally:
            assert post(url, "/continue_generation").status_code == 200
        out = fut.result(30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    # KV columns at the pause: the 2 prompt tokens and all generated tokens but the newest (used - 1 tokens)
    assert out["meta_info"]["completion_tokens"] == used - 1 + 1  # plus the token of that last pass


def test_requests_parked_at_the_pause_gate_outlive_abort_pauses_and_one_given_up_runs_to_its_first_output(models):
    """Breakage 5, managers/tokenizer_manager.py: generate_request waits at the pause gate (is_pause_cond) before
    it tokenizes and dispatches, and pause_generation mode abort aborts only what the scheduler holds
    (abort_request(abort_all)) until no request holds the model lock, which a parked one does not. So a request
    parked there, through two abort pauses, runs to its end after /continue_generation. One whose client left is
    dispatched too and runs until _wait_one_response notices (request.is_disconnected): at its first output, for an
    unstreamed request its SGLANG_FORCE_STREAM_INTERVAL-th (50th) token (scheduler_components/output_streamer.py
    _GenerationStreamAccumulator.accept), or SGLANG_REQUEST_STATE_WAIT_TIMEOUT without one (raised to 60 s on this
    test's own engine, so only the first can end it); the abort (managers/scheduler.py abort_request: to_finish)
    ends it with its next forward pass, at 51 tokens. Seen through the prefix cache: its namespace then holds its
    prompt and its first 50 tokens (greedy, so a reference request elsewhere gives them), the KV of all but its
    last."""
    url, handle = engine.launch(models[0]["A"], num_threads=1, env={"SGLANG_REQUEST_STATE_WAIT_TIMEOUT": "60"})
    ns, prompt = "given-up", [3, 4]
    try:
        with cf.ThreadPoolExecutor(1) as ex:
            assert post(url, "/pause_generation", {"mode": "abort"}).status_code == 200
            try:
                live = ex.submit(gen, url, [5, 6], max_new_tokens=5, ignore_eos=True)
                with pytest.raises(requests.exceptions.ReadTimeout):
                    requests.post(url + "/generate", json={"input_ids": prompt, "extra_key": ns, "sampling_params": {
                        "max_new_tokens": LONG, "ignore_eos": True, "temperature": 0}}, timeout=0.5)
                assert post(url, "/pause_generation", {"mode": "abort"}).status_code == 200
                assert not live.done() and running(url) == 0
            finally:
                assert post(url, "/continue_generation").status_code == 200
            out = live.result(30)
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}  # not aborted
        wait_until(lambda: running(url) == 0, 50, "the given-up request to end")
        reference = gen(url, prompt, max_new_tokens=60, ignore_eos=True, extra_key=ns + "-reference")["output_ids"]
        probe = gen(url, prompt + reference, max_new_tokens=1, extra_key=ns)
        assert probe["meta_info"]["cached_tokens"] == len(prompt) + 50
    finally:
        handle.stop()


# ---------------------------------------------------------------------------------------------------------------
# Batched /generate, n > 1, and the smaller points

def test_batched_generate_answers_in_order_and_aborts_one_item_only(url):
    """managers/tokenizer_manager.py: _handle_batch_request, managers/io_struct.py: GenerateReqInput.normalize. A list
    of input_ids with unique rids and per-item sampling_params is answered as one list in input order once every
    item finished; aborting one rid ends that item only, with its partial output; an item the server refuses fails
    the whole call."""
    rids = ["batch-0.", "batch-1.", "batch-2."]
    body = {"input_ids": [[5, 6], [7, 8, 9], [10]], "rid": rids, "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 3, "ignore_eos": True}, {"max_new_tokens": LONG, "ignore_eos": True},
                                {"max_new_tokens": 5, "ignore_eos": True}]}
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post, url, "/generate", body)
        wait_until(lambda: running(url) == 1, 30, "the long item to be the only one running")
        assert not fut.done()  # the finished items wait for the last one
        assert post(url, "/abort_request", {"rid": "batch-1."}).status_code == 200
        r = fut.result(30)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["id"] for o in out] == rids
    assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["length", "abort", "length"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3, 1]
    assert out[0]["meta_info"]["completion_tokens"] == 3 and out[2]["meta_info"]["completion_tokens"] == 5
    assert 0 < len(out[1]["output_ids"]) == len(out[1]["meta_info"]["output_token_logprobs"]) < LONG
    bad = post(url, "/generate", {"input_ids": [[5], [6]], "sampling_params": [{}, {"max_new_tokens": 10 ** 6}]})
    assert bad.status_code == 400 and "maximum context length" in bad.json()["error"]["message"]


def test_a_live_rid_is_refused_not_replaced_and_a_batch_needs_unique_rids(url):
    """managers/tokenizer_manager.py: _init_req_state refuses a request whose rid is still live with a ValueError
    (400 "Duplicate request ID detected: <rid>") and leaves the first request alone, so /abort_request still reaches
    it; managers/io_struct.py: _validate_rid_uniqueness refuses a batch naming one rid twice."""
    with cf.ThreadPoolExecutor(1) as ex:
        first = ex.submit(gen, url, [3, 4], max_new_tokens=LONG, ignore_eos=True, rid="dup.")
        wait_until(lambda: running(url) == 1, 30, "the first request to run")
        r = post(url, "/generate", {"input_ids": [5], "rid": "dup.", "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and r.json()["error"]["message"] == "Duplicate request ID detected: dup.", r.text
        r = post(url, "/generate", {"input_ids": [[5], [6]], "rid": ["dup.", "other."]})
        assert r.status_code == 400 and r.json()["error"]["message"] == "Duplicate request ID detected: dup.", r.text
        assert running(url) == 1
        assert post(url, "/abort_request", {"rid": "dup."}).status_code == 200
        out = first.result(30)
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < LONG
    r = post(url, "/generate", {"input_ids": [[5], [6], [7]], "rid": ["x.", "y.", "x."]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "Duplicate request IDs detected within the request: ['x.']"
    assert gen(url, [5], rid="dup.")["meta_info"]["id"] == "dup."  # free again once the first one finished


def test_model_info_names_the_checkpoint_of_the_last_update_from_disk(url, models):
    """managers/tokenizer_manager.py: _update_model_path_info. A successful /update_weights_from_disk makes its
    model_path the /model_info model_path and served_model_name; a failed one leaves them."""
    paths = models[0]

    def info():
        return requests.get(url + "/model_info", timeout=10).json()
    assert (info()["model_path"], info()["served_model_name"]) == (paths["A"], paths["A"])
    v0 = version(url)
    try:
        set_weights(url, paths["B"], v0 + 1)
        assert (info()["model_path"], info()["served_model_name"]) == (paths["B"], paths["B"])
        assert post(url, "/update_weights_from_disk", {"model_path": paths["B"] + "-missing"}).status_code == 400
        assert info()["model_path"] == paths["B"]
    finally:
        set_weights(url, paths["A"], v0 + 2)
    assert info()["model_path"] == paths["A"]


def test_weight_versions_come_with_the_final_output_and_an_unstarted_abort_has_an_empty_span(url):
    """scheduler_components/output_streamer.py: spans are computed for finished requests only, so a stream's chunks
    carry weight_version (the server's) but no weight_versions until the last; utils/weight_versions.py:
    compute_weight_version_spans gives a request aborted before its first token [{"version": v, "start": 0,
    "end": 0}]. The client's parser (sglang_client.parse_generate_response) takes both."""
    v = requests.get(url + "/model_info", timeout=10).json()["weight_version"]
    # A long request, ended by an abort once a chunk has come: a short one's tokens can all be decoded before the
    # handler writes its first chunk, which then is the last (the handler sends the latest output, as SGLang's
    # _wait_one_response takes out_list[-1]), and the check of the chunks before the last would test nothing.
    body = {"input_ids": P, "stream": True, "return_logprob": True, "rid": "stream-spans.",
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "stream_interval": 1}}
    chunks = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=60) as r:
        for ln in r.iter_lines():
            if ln and ln != b"data: [DONE]":
                chunks.append(json.loads(ln[6:]))
                if len(chunks) == 1:
                    assert post(url, "/abort_request", {"rid": "stream-spans."}).status_code == 200
    assert len(chunks) > 1 and all("weight_versions" not in c["meta_info"] for c in chunks[:-1])
    assert all(c["meta_info"]["weight_version"] == v for c in chunks)
    n = len(chunks[-1]["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort" and 0 < n < LONG
    assert chunks[-1]["meta_info"]["weight_versions"] == [{"version": v, "start": 0, "end": n}]
    full = {"input_ids": [P] * 8, "rid": [f"full-{i}." for i in range(8)],
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(2) as ex:
        batch = ex.submit(post, url, "/generate", full)
        wait_until(lambda: running(url) == 8, 30, "8 requests to fill max_running_requests")
        queued = ex.submit(gen, url, P, rid="queued.")
        wait_until(lambda: requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]["num_waiting_reqs"] == 1,
                   30, "the ninth request to wait")
        assert post(url, "/abort_request", {"rid": "queued."}).status_code == 200
        out = queued.result(30)
        post(url, "/abort_request", {"abort_all": True})
        assert batch.result(30).status_code == 200
    m = out["meta_info"]
    assert m["finish_reason"]["type"] == "abort" and out["output_ids"] == []
    assert m["weight_versions"] == [{"version": v, "start": 0, "end": 0}] and m["weight_version"] == v
    g = sglang_client.parse_generate_response(out)
    assert (g.ids, g.versions, g.finish) == ([], [], "abort")


def test_a_batch_with_one_string_rid_names_its_items_rid_i(url):
    """managers/io_struct.py: GenerateReqInput._normalize_rid turns a batch's string rid into f"{rid}_{i}" (the only
    form sglang-router 0.3.2 forwards: it refuses a list of rids, and of sampling_params). The producer sends this:
    its aborts name those item rids, so an item is abortable by its own name."""
    body = {"input_ids": [[5, 6], [7, 8, 9]], "rid": "one.", "return_logprob": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post, url, "/generate", body)
        wait_until(lambda: running(url) == 2, 30, "both items to run")
        assert post(url, "/abort_request", {"rid": "one._0"}).status_code == 200
        assert post(url, "/abort_request", {"rid": "one._1"}).status_code == 200
        r = fut.result(30)
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["id"] for o in r.json()] == ["one._0", "one._1"]
    assert [o["meta_info"]["finish_reason"]["type"] for o in r.json()] == ["abort", "abort"]


def test_n_samples_get_fresh_rids_prompt_major_after_a_prefill_warm_up(url):
    """managers/tokenizer_manager.py: _handle_batch_request with parallel_sample_num > 1: a prefill-only pass per
    prompt first (so the n samples reuse its KV), then n requests per prompt with fresh random rids (the client's
    rid is dropped: they cannot be aborted by it), answered prompt-major."""
    assert post(url, "/flush_cache").status_code == 200
    r = post(url, "/generate", {"input_ids": [[5, 6, 7], [8, 9]], "rid": ["n-0.", "n-1."],
                                "sampling_params": {"n": 3, "max_new_tokens": 4, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 3, 2, 2, 2]
    assert [o["meta_info"]["cached_tokens"] for o in out] == [2, 2, 2, 1, 1, 1]
    ids = [o["meta_info"]["id"] for o in out]
    assert len(set(ids)) == 6 and not {"n-0.", "n-1."} & set(ids)
    single = post(url, "/generate", {"input_ids": [5], "sampling_params": {"n": 2, "max_new_tokens": 2}}).json()
    assert isinstance(single, list) and len(single) == 2


def test_schema_errors_and_value_errors_are_400(url):
    """entrypoints/http_server.py: generate_request takes GenerateReqInput; a field of the wrong type or a body that
    is no JSON object is a RequestValidationError, which validation_exception_handler answers with 400 (not FastAPI's
    422) and an ErrorResponse body; sampling/sampling_params.py: verify and unknown keys are ValueErrors, 400 with
    {"error": {"message"}} (_create_error_response)."""
    for body in ({"input_ids": "abc"}, {"input_ids": [1], "return_logprob": "yes"}, {"input_ids": [1], "rid": 3},
                 {"input_ids": [1], "sampling_params": "hot"}):
        r = post(url, "/generate", body)
        assert r.status_code == 400, (body, r.text)
        j = r.json()
        assert (j["object"], j["type"], j["code"], j["param"]) == ("error", "Bad Request", 400, None) and j["message"]
    r = requests.post(url + "/generate", data=b"{no", timeout=10)
    assert r.status_code == 400 and r.json()["code"] == 400
    for sp in ({"top_p": 0}, {"tempreature": 1}):
        r = post(url, "/generate", {"input_ids": [1], "sampling_params": sp})
        assert r.status_code == 400 and r.json()["error"]["message"]


def test_tokenize_and_detokenize(url, models):
    """entrypoints/openai/serving_tokenize.py: OpenAIServingTokenize / OpenAIServingDetokenize, served at /tokenize,
    /detokenize and their /v1/ paths (http_server.py): a prompt string or list gives tokens, count and max_model_len
    (the tokenizer's model_max_length, else the context length); tokens give text; exactly one of prompt and
    messages, else a schema error (400)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models[0]["A"])
    ctx = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    limit = tok.model_max_length if tok.model_max_length < 2 ** 63 else ctx
    one = post(url, "/tokenize", {"prompt": "12+34="}).json()
    assert one == {"tokens": tok.encode("12+34="), "count": len(tok.encode("12+34=")), "max_model_len": limit}
    two = post(url, "/v1/tokenize", {"prompt": ["1", "22"], "add_special_tokens": False}).json()
    assert two["tokens"] == [tok.encode(t, add_special_tokens=False) for t in ("1", "22")]
    assert two["count"] == [len(t) for t in two["tokens"]]
    assert post(url, "/detokenize", {"tokens": one["tokens"]}).json() == {"text": tok.decode(one["tokens"],
                                                                                              skip_special_tokens=True)}
    assert post(url, "/v1/detokenize", {"tokens": two["tokens"]}).json() == {"text": ["1", "22"]}
    assert post(url, "/detokenize", {"tokens": []}).json() == {"text": ""}
    for path, body in (("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/detokenize", {"tokens": [1, [2]]})):
        r = post(url, path, body)
        assert r.status_code == 400 and r.json()["code"] == 400, (path, body, r.text)


def test_greedy_below_1e_6(url, models):
    """sampling/sampling_params.py: _SAMPLING_EPS = 1e-6. Temperature 5e-6 samples at that temperature (its
    log-probs); 5e-7 is greedy, whose log-probs are reported at temperature 1 (the log-prob convention)."""
    ref = models[1]["A"]
    sampled, greedy = gen(url, P, temperature=5e-6), gen(url, P, temperature=5e-7)
    assert greedy["output_ids"] == sampled["output_ids"] == gen(url, P, temperature=0)["output_ids"]
    at_1 = reference_lps(ref, P, greedy["output_ids"])
    assert min(at_1) < -1e-2  # the two conventions differ here
    assert max(abs(a - b) for a, b in zip(lps(greedy), at_1)) < 1e-4
    ids = torch.tensor([P + sampled["output_ids"]])
    with torch.no_grad():
        logits = ref(ids).logits.float()[0, len(P) - 1:-1]
    plain = torch.log_softmax(logits / 5e-6, -1).gather(-1, ids[0, len(P):, None])[:, 0].tolist()
    at_t = reference_lps(ref, P, sampled["output_ids"], 5e-6)  # the trainer's convention agrees
    assert max(abs(a - b) for a, b in zip(lps(sampled), plain)) < 1e-3 and max(map(abs, map(float.__sub__, at_t,
                                                                                      plain))) < 1e-3


def test_a_stop_token_drawn_as_the_last_allowed_token_is_a_stop_and_an_abort_outranks_both(url):
    """managers/schedule_batch.py: Req.update_finish_state checks `to_finish` (an abort that came while the request
    ran, set by scheduler.py abort_request), then stop strings, then stop tokens / eos, and the length last. A
    response whose eos is its max_new_tokens-th token has stopped (a reward that asks for the eos pays it)."""
    out = gen(url, P, max_new_tokens=4, ignore_eos=True)["output_ids"]
    k = next(i for i, t in enumerate(out) if t not in out[:i] and i > 0)  # a token not drawn before it
    stop = gen(url, P, max_new_tokens=k + 1, stop_token_ids=[out[k]])
    assert stop["output_ids"] == out[:k + 1]
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": out[k]}
    # the abort of a request paused in place is finished by its next forward pass: abort, whatever it draws
    sched = scheduler.Scheduler.__new__(scheduler.Scheduler)
    sched.weight_version, sched.generated_tokens, sched.eos_ids, sched.tokenizer = "0", 0, [2], None
    for to_finish, expected in ((None, {"type": "stop", "matched": 2}), (scheduler.abort_reason("Aborted"), None)):
        r = scheduler.Req("r", [1], engine.parse_sampling_params({"max_new_tokens": 1}, 10), to_finish=to_finish)
        sched._append(r, 2, -0.5, None)
        assert r.finish == (expected or to_finish)


def test_begin_and_end_weight_update_take_the_writer_lock(url):
    """managers/tokenizer_control_mixin.py: _weight_update_session_call. On a server that is not paused, begin and
    end_weight_update take the model-update writer lock: they wait until the running requests are done."""
    with cf.ThreadPoolExecutor(2) as ex:
        fut = ex.submit(gen, url, [3, 4], max_new_tokens=LONG, ignore_eos=True, rid="writer.")
        wait_until(lambda: running(url) == 1, 30, "the request to run")
        begin = ex.submit(post, url, "/begin_weight_update", {})
        time.sleep(0.5)
        assert not begin.done()  # waits for the reader
        post(url, "/abort_request", {"rid": "writer."})
        assert fut.result(30)["meta_info"]["finish_reason"]["type"] == "abort"
        assert begin.result(30).json()["success"] is True
    assert post(url, "/end_weight_update", {}).json()["success"] is True


def test_a_reader_cancelled_at_any_moment_gives_its_count_back():
    """utils/aio_rwlock.py: RWLock, whose lock no coroutine holds across a suspension, so a /generate handler (or
    /health's request) cancelled on its way out still releases its reader, and pause "abort" (tokenizer_manager.py:
    pause_generation, which aborts until the lock is free) answers. Handlers pass the gate while a pause polls for
    the readers to drain; handlers are cancelled at random moments (seeded). engine.Gate's old wait_for kept ~160
    of 3000 readers here, and a run's next abort pause then waited out --wait-timeout."""
    import asyncio
    import contextlib
    import random

    async def main():
        gate, rng = engine.Gate(), random.Random(0)

        async def handler():  # engine.Server.generate's use of the gate
            await gate.enter(30)
            try:
                for _ in range(rng.randint(0, 3)):
                    await asyncio.sleep(0)
            finally:
                await gate.leave()

        async def pause_polls():  # pause_generation's wait for the readers, again and again
            while True:
                with contextlib.suppress(TimeoutError):
                    await gate.drained(0.001)
                await asyncio.sleep(0)

        poller, live = asyncio.ensure_future(pause_polls()), []
        for _ in range(3000):
            live.append(asyncio.ensure_future(handler()))
            if rng.random() < 0.5:
                rng.choice(live).cancel()
            if rng.random() < 0.5:
                await asyncio.sleep(0)
            live = [t for t in live if not t.done()]
        await asyncio.gather(*live, return_exceptions=True)
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        return gate.readers

    assert asyncio.run(main()) == 0


def test_request_timeout_below_the_routers_is_checked_at_start_up():
    """sglang_router/router_args.py: request_timeout_secs 1800 (with retry_max_retries 5). With rollout.router_url
    our /generate timeout must fire first, so the client decides what happens to a request that runs too long."""
    with pytest.raises(ValueError, match=r"rollout.request_timeout_s \(3600\) must be below "
                                         r"rollout.router_request_timeout_s \(1800"):
        config.load_config(None, ["rollout.router_url=http://127.0.0.1:1", "rollout.request_timeout_s=3600"])
    cfg = config.load_config(None, ["rollout.router_url=http://127.0.0.1:1"])
    assert cfg.rollout.request_timeout_s < cfg.rollout.router_request_timeout_s == 1800
    assert config.load_config(None, ["rollout.request_timeout_s=3600"]).rollout.request_timeout_s == 3600


def test_context_limits_are_0_5_23s_and_the_client_caps_max_new_tokens_to_them(url, models):
    """managers/tokenizer_manager.py: _validate_one_request refuses prompt + max_new_tokens > the context length with
    a ValueError (400 for the whole list request); the scheduler refuses a prompt of max_req_input_len = context - 6
    tokens or more (managers/utils.py: validate_input_length, managers/tp_worker.py) and caps max_new_tokens at
    context - 2 - prompt (scheduler.py: init_req_max_new_tokens). /v1/models max_model_len is the context length
    (http_server.py: available_models); /server_info's context_length is the raw flag, next to the scheduler's
    max_req_input_len and max_total_num_tokens (utils/common.py: build_server_info). The client reads both limits
    once and caps each item's max_new_tokens, so a prompt near the context is a truncated trajectory, not a 400."""
    ctx = requests.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    info = requests.get(url + "/server_info", timeout=10).json()
    assert (info["context_length"], info["max_req_input_len"], info["max_total_num_tokens"]) == (None, ctx - 6, 8 * ctx)
    near = (P * ctx)[:ctx - 16]
    r = post(url, "/generate", {"input_ids": [P, near], "sampling_params": {"max_new_tokens": 17}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a total "
        f"of {ctx + 1} tokens"), r.text
    out = gen(url, near, max_new_tokens=16, ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 14}
    too_long = (P * ctx)[:ctx - 6]
    r = post(url, "/generate", {"input_ids": too_long, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        f"Input length ({ctx - 6} tokens) exceeds the maximum allowed length ({ctx - 6} tokens)."), r.text

    from transformers import AutoTokenizer
    cfg = config.load_config(None, ["data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=1",
                                    "trainer.mini_batch_size=2", "rollout.sampling.max_new_tokens=24",
                                    "rollout.sampling.temperature=1e-7", f"rollout.servers=[{url}]"])
    buf = run_modes.DatasetBuffer([{"prompt_ids": near, "label": ""}, {"prompt_ids": too_long, "label": ""}], 1)
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, buf, sync, AutoTokenizer.from_pretrained(models[0]["A"]))
    try:
        ro.start()
        assert (ro.context_len, ro.max_input_len) == (ctx, ctx - 6)
        assert buf.done.wait(60), "the two trajectories did not finish"
    finally:
        ro.stop()
        sync.close()
    capped, too_long = buf.results[0][0], buf.results[1][0]
    assert capped.status == "truncated" and capped.metadata["finish_reason"] == {"type": "length", "length": 14}
    assert capped.response_ids.numel() == 14
    assert too_long.status == "truncated" and too_long.response_ids.numel() == 0


# ---------------------------------------------------------------------------------------------------------------
# SGLang's own HTTP tests that standins/engine.py failed (issue 36: logit_bias, forbidden tokens, top-k log-probs vs HF)

def test_logit_bias_forces_a_token_and_a_forbidden_token_never_appears(url, models):
    """test/srt/test_srt_endpoint.py: TestSRTEndpoint.test_logit_bias (+100 on one token: every sampled token is
    it) and test_forbidden_token (-100: it never appears), at temperature 1; sampling/sampling_params.py:
    SamplingParams.logit_bias (token id strings -> numbers, verify: keys in [0, vocab)) and
    sampling_batch_info.py: added to the logits before sampling, so the reported log-probs include it."""
    ref = models[1]["A"]
    greedy = gen(url, P, max_new_tokens=6, ignore_eos=True)["output_ids"]
    target, forbidden = 41, greedy[0]
    out = gen(url, P, max_new_tokens=6, temperature=1.0, ignore_eos=True, logit_bias={str(target): 100.0})
    assert out["output_ids"] == [target] * 6 and max(abs(lp) for lp in lps(out)) < 1e-4
    for seed in range(4):
        out = gen(url, P, max_new_tokens=6, temperature=1.0, ignore_eos=True, sampling_seed=seed,
                  logit_bias={str(forbidden): -100.0})
        assert forbidden not in out["output_ids"]
    # greedy with a bias of +2 on the runner-up: the reported log-prob is log_softmax(logits + bias)
    with torch.no_grad():
        logits = ref(torch.tensor([P])).logits[0, -1].float()
    second = int(logits.topk(2).indices[1])
    out = gen(url, P, max_new_tokens=1, logit_bias={str(second): 2.0, "0" + str(second): 2.0})
    biased = logits.clone()
    biased[second] += 2.0
    assert out["output_ids"] == [int(biased.argmax())]
    assert abs(lps(out)[0] - torch.log_softmax(biased, -1)[out["output_ids"][0]].item()) < 1e-4
    for bad, msg in (({"100000": 1.0}, "logit_bias must has keys in [0, "), ({"x": 1.0}, "keys must be token ids"),
                     ({"3": "a"}, "logit_bias")):
        r = post(url, "/generate", {"input_ids": P, "sampling_params": {"max_new_tokens": 1, "logit_bias": bad}})
        assert r.status_code == 400 and msg in r.text, r.text


def test_top_logprobs_match_hf_in_value_and_order(url, models):
    """test/runners.py: HFRunner.forward_generation_raw against SRTRunner.forward_generation_raw as
    check_close_model_outputs compares them (test/srt/models/test_generation_models.py): greedy, NUM_TOP_LOGPROBS
    5, logprob_start_len 0; input_top_logprobs[1:] + output_top_logprobs[0] against get_top_logprobs (log_softmax in
    float32, torch.topk) of the HF forward's logits, output_top_logprobs against those of HF generate's scores;
    here the ids too, in order (layers/logprob_processor.py: get_top_logprobs_raw, logprobs.topk: a tie keeps
    topk's order, the same call on the same values)."""
    from transformers import GenerationConfig
    ref = models[1]["A"]
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    m = r.json()["meta_info"]
    with torch.no_grad():
        hf = ref.generate(input_ids=torch.tensor([prompt]), generation_config=GenerationConfig(
            do_sample=False, temperature=None, top_p=None, max_new_tokens=6, return_dict_in_generate=True,
            output_scores=True, disable_compile=True, eos_token_id=None, pad_token_id=0))
        input_logits = ref(torch.tensor([prompt])).logits[0]
    assert hf.sequences[0, len(prompt):].tolist() == r.json()["output_ids"]

    def top(logits):
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32).topk(5, dim=-1)
    srt_in = m["input_top_logprobs"][1:] + [m["output_top_logprobs"][0]]
    want = top(input_logits)
    assert len(srt_in) == len(prompt)
    for row, v, i in zip(srt_in, want.values.tolist(), want.indices.tolist()):
        assert [t for _, t, _ in row] == i and max(abs(a - b) for (a, _, _), b in zip(row, v)) < 1e-4
    for row, scores in zip(m["output_top_logprobs"], hf.scores):
        w = top(scores[0])
        assert [t for _, t, _ in row] == w.indices.tolist()
        assert max(abs(a - b) for (a, _, _), b in zip(row, w.values.tolist())) < 1e-4


def test_reported_logprobs_are_the_whole_vocabularys_at_the_temperature_or_at_1_under_return_original_logprob(
        url, models):
    """test/registered/sampling/test_original_logprobs.py: TestOriginalLogprob.test_logprob_match (temperature 0.5,
    top_k 10, one new token, 50 top log-probs and 10 random token ids, with SGLANG_RETURN_ORIGINAL_LOGPROB True and
    False) as layers/sampler.py: Sampler.forward answers it: output_token_logprobs, output_top_logprobs and
    output_token_ids_logprobs are log_softmax(logits / 0.5) over the whole vocabulary (it takes log(probs) before
    top_k / top_p / min_p filter the probabilities), and log_softmax(logits) under the switch (the logits before the
    temperature divides them). Also with top_p 0.3: the reported log-prob is not the one the token was drawn with.
    Prompt log-probs are at temperature 1 either way (layers/logprob_processor.py: LogprobProcessor._forward_by_chunk
    divides by no temperature). standins/engine.py failed the switch's half: it reported temperature 0.5's."""
    ref = models[1]["A"]
    with torch.no_grad():
        logits = ref(torch.tensor([P])).logits[0].float()
    vocab = logits.shape[-1]
    ids = sorted(torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:10].tolist())
    prompt_lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(P[1:])[:, None])[:, 0].tolist()
    original, handle = engine.launch(models[0]["A"], num_threads=1, env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "True"})
    try:
        for server, temperature in ((url, 0.5), (original, 1.0)):
            want = torch.log_softmax(logits[-1] / temperature, -1)
            for top_p in (1.0, 0.3):
                body = {"input_ids": P, "return_logprob": True, "top_logprobs_num": 50, "token_ids_logprob": ids,
                        "logprob_start_len": 0, "sampling_params": {"temperature": 0.5, "top_p": top_p, "top_k": 10,
                                                                    "max_new_tokens": 1}}
                r = post(server, "/generate", body)
                assert r.status_code == 200, r.text
                m = r.json()["meta_info"]
                (lp, tok, _), = m["output_token_logprobs"]
                assert abs(lp - want[tok].item()) < 1e-4, (server, top_p)
                top = want.topk(min(50, vocab))
                assert [t for _, t, _ in m["output_top_logprobs"][0]] == top.indices.tolist()
                assert max(abs(a - b) for (a, _, _), b in zip(m["output_top_logprobs"][0], top.values.tolist())) < 1e-4
                assert [t for _, t, _ in m["output_token_ids_logprobs"][0]] == ids
                assert max(abs(a - want[t].item()) for a, t, _ in m["output_token_ids_logprobs"][0]) < 1e-4
                got = [a for a, _, _ in m["input_token_logprobs"][1:]]
                assert max(abs(a - b) for a, b in zip(got, prompt_lp)) < 1e-4
    finally:
        handle.stop()


def test_weight_updates_reach_the_runners_their_selector_picks(models, tmp_path):
    """managers/scheduler_components/weight_updater.py _select_runners: on a server with a speculative draft model
    (--speculative-algorithm EAGLE), `selector` "all" (managers/io_struct.py's default) is the target runner then the
    draft's, "target" the target's alone. begin_weight_update opens the session on the runners it selects and
    end_weight_update closes it on the same ones; update_weights_from_tensor calls each selected runner's
    update_weights_from_tensor, so a custom weight loader runs once per runner: weight_delta.load_delta's second call
    of a delta's last bucket finds its store already at the new version and refuses (over a broadcast it would wait
    for a second broadcast); update_weights_from_disk has no selector and reloads every runner.
    sglang_client.WEIGHT_SELECTOR ("target") is what the trainer sends: the draft gets nothing."""
    import weight_delta

    sync = tmp_path / "sync_weights"
    sync.mkdir()
    url, handle = engine.launch(models[0]["A"], speculative_algorithm="EAGLE", speculative_draft_model_path=
                                models[0]["B"], custom_weight_loader=weight_delta.LOADER, wait_timeout=60,
                                env={weight_delta.SYNC_DIR_ENV: str(sync)})

    def draft_log() -> list:
        with open(handle.log_path) as f:
            return [ln.split(engine.DRAFT_LOG, 1)[1].split()[0] for ln in f if engine.DRAFT_LOG in ln]

    name = "model.embed_tokens.weight"

    def held() -> torch.Tensor:
        return torch.tensor(post(url, "/get_weights_by_name", {"name": name, "truncate_size": 10 ** 6}).json())

    def bucket(base, version: int, val: torch.Tensor, pos=None, **body) -> dict:
        desc = {"base": base, "version": version, "last": True, "transport": "disk",
                "path": str(sync / f"v{version}.safetensors")}
        weight_delta.write_file(desc["path"], [{"name": name, "shape": list(before.shape), "dtype": torch.float32,
                                                "pos": pos, "val": val}], desc)
        return post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [
            weight_delta.control_payload(desc)], "load_format": weight_delta.LOADER, "weight_version": str(version),
            **body}).json()

    try:
        info = requests.get(url + "/server_info", timeout=30).json()
        assert info["speculative_algorithm"] == "EAGLE" and info["speculative_draft_model_path"] == models[0]["B"]
        before = held()
        assert post(url, "/begin_weight_update", {}).json()["success"] is True  # selector "all"
        assert draft_log() == ["begin_weight_update"]
        assert bucket(None, 1, before.reshape(-1))["success"] is True  # whole: the loader ran on both runners
        assert draft_log() == ["begin_weight_update", "load_weights"]
        one = torch.ones(1)
        r = bucket(1, 2, one, torch.tensor([0], dtype=torch.int32))  # a delta: the draft's call is refused
        assert r["success"] is False and "refused the delta 1 -> 2" in r["message"], r
        assert held().reshape(-1)[0] == 1  # the target's call had applied it
        assert post(url, "/end_weight_update", {}).json()["success"] is True
        assert draft_log()[-1] == "end_weight_update"
        seen = len(draft_log())
        target = {"selector": "target"}
        assert post(url, "/begin_weight_update", target).json()["success"] is True
        assert bucket(None, 3, before.reshape(-1), **target)["success"] is True
        assert bucket(3, 4, one * 2, torch.tensor([0], dtype=torch.int32), **target)["success"] is True
        assert held().reshape(-1)[0] == 2 and len(draft_log()) == seen  # the target alone
        assert post(url, "/end_weight_update", {}).json()["success"] is True
        assert len(draft_log()) == seen
        r = post(url, "/begin_weight_update", {"selector": "both"})
        assert r.status_code == 400 and "selector" in r.text
        assert post(url, "/update_weights_from_disk", {"model_path": models[0]["A"]}).json()["success"] is True
        assert draft_log()[seen:] == ["update_weights_from_disk"]
        assert handle.proc.poll() is None
    finally:
        handle.stop()
