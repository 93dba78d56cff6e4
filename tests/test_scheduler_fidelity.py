"""scheduler.py as SGLang 0.5.23's scheduler behaves (issue 29): the radix prefix cache, the queue and timeout
limits, and the logprob fields. Each test's docstring names the 0.5.23 file (under sglang/srt/) and the function
it follows. One engine subprocess (tiny Qwen3) serves the module; tests that need other flags launch their own.
Run: .venv/bin/python -m pytest -q tests/test_scheduler_fidelity.py
"""
import asyncio
import concurrent.futures as cf
import json
import threading
import time
import types

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from standins import engine
import sglang_client
from standins import scheduler
from test_engine import make_model
from test_sglang_conformance import reference_lps

QUEUE_FULL = "The request queue is full."


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("fidelity") / "A"), 0)


@pytest.fixture(scope="module")
def ref(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path).eval()


@pytest.fixture(scope="module")
def url(model_path):
    url, handle = engine.launch(model_path, max_running_requests=8, num_threads=1, wait_timeout=60)
    yield url
    handle.stop()


def post(url, path, body=None, timeout=60):
    return requests.post(url + path, json=body if body is not None else {}, timeout=timeout)


def gen(url, ids, **kw):
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    body.update(kw)
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def lps(out):
    return [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def close_to_reference(ref, prompt, out, tol=1e-4):
    want = reference_lps(ref, prompt, out["output_ids"])
    return max(abs(a - b) for a, b in zip(lps(out), want)) < tol


# ---------------------------------------------------------------------------------------------------------------
# The radix prefix cache (issue 29 item 9)

LONG_PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def test_prefix_cache_matches_token_prefixes_like_a_radix_tree(url, ref):
    """mem_cache/radix_cache.py: RadixCache.match_prefix / _match_prefix_helper (the longest cached token prefix,
    splitting a node where the match ends) and managers/schedule_batch.py: Req._compute_max_prefix_len (at most
    input_len - 1). A strict prefix of a cached prompt reuses all but its last token, a prompt that diverges
    inside a cached one reuses the common part, and the reused KV gives the model's own log-probs."""
    assert post(url, "/flush_cache").status_code == 200
    first = gen(url, LONG_PROMPT)
    assert first["meta_info"]["cached_tokens"] == 0
    head = LONG_PROMPT[:7]
    short = gen(url, head)
    assert short["meta_info"]["cached_tokens"] == len(head) - 1
    assert close_to_reference(ref, head, short)
    fork = LONG_PROMPT[:5] + [40, 41, 42]
    forked = gen(url, fork)
    assert forked["meta_info"]["cached_tokens"] == 5
    assert close_to_reference(ref, fork, forked)
    again = gen(url, fork[:6] + [50])  # ends one past the node boundary the last match split
    assert again["meta_info"]["cached_tokens"] == 6
    assert gen(url, head, extra_key="other")["meta_info"]["cached_tokens"] == 0
    assert gen(url, head, cache_salt="s")["meta_info"]["cached_tokens"] == 0


def test_a_finished_request_caches_its_prompt_and_output(url, ref):
    """mem_cache/common.py: release_kv_cache(checkpoint=True) -> RadixCache.checkpoint of a finished request: its
    prompt and all output tokens but the last (never forwarded) go into the tree, so a multi-turn rollout's next
    turn (prompt + answer + new text) reuses them; the decoded KV gives the model's log-probs."""
    assert post(url, "/flush_cache").status_code == 200
    turn1 = gen(url, LONG_PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    out = turn1["output_ids"]
    prompt2 = LONG_PROMPT + out + [30, 31]
    turn2 = gen(url, prompt2)
    assert turn2["meta_info"]["cached_tokens"] == len(LONG_PROMPT) + len(out) - 1
    assert close_to_reference(ref, prompt2, turn2)


def _run(sched, reqs):
    """Drive the scheduler in this thread until reqs finished (its loop without the thread)."""
    sched.waiting.extend(reqs)
    _drive(sched)


def _req(ids, n=1):
    sp = engine.parse_sampling_params({"max_new_tokens": n, "temperature": 0}, 1 << 30)
    return scheduler.Req(rid=str(ids), input_ids=list(ids), sp=sp)


def test_prefix_cache_evicts_least_recently_used_leaves_within_its_bound(model_path):
    """mem_cache/radix_cache.py: RadixCache.evict (least recently used leaves first, a parent left childless
    becomes a leaf) keeps the tree within the KV pool (--max-total-tokens, here 20), evicting when a prefill lacks
    slots; a shared prefix is stored once."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    sched = scheduler.Scheduler(model, AutoTokenizer.from_pretrained(model_path), torch.device("cpu"), 4, 1024, "0",
                                max_total_tokens=20)
    stem = [3, 4, 5, 6, 7, 8]
    _run(sched, [_req(stem + [9, 10])])  # max_new_tokens 1: only the prompt is cached (8 tokens)
    _run(sched, [_req(stem + [11, 12])])  # shares the stem: 2 more tokens
    assert sched.cache_tokens == 10
    _run(sched, [_req(stem + [9, 10, 13])])  # reuses stem+[9, 10], adds [13]: [11, 12] is the least recently used
    assert sched.cache_tokens == 11
    _run(sched, [_req([20 + i for i in range(12)])])  # 12 new tokens: 23 > 20, [11, 12] then [13] go
    assert sched.cache_tokens == 20
    assert sched._cache_match((None, None), stem + [11, 12, 0], 8)[0] == 6
    assert sched._cache_match((None, None), stem + [9, 10, 0], 8)[0] == 8


@pytest.fixture
def one_thread():
    """One torch thread, as standins/engine.py's model thread on CPU (two spin-waiting OpenMP threads on a loaded 2-core
    machine made each tiny forward ~30 ms)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _sched(model_path, ref, **kw):
    return scheduler.Scheduler(ref, AutoTokenizer.from_pretrained(model_path), torch.device("cpu"), 8, 1024, "0", **kw)


def _leaves(sched):
    """The unheld childless nodes, found by walking every tree (what the incremental set must equal)."""
    out, stack = set(), list(sched.radix.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        if n.parent is not None and not n.children and n.lock_ref == 0:
            out.add(n)
    return out


def test_eviction_pops_only_the_leaves_it_frees_from_a_leaf_set_kept_current(model_path, ref):
    """mem_cache/radix_cache.py: RadixCache.evictable_leaves, kept by _update_leaf_status on every insert, split,
    delete and inc_lock_ref / dec_lock_ref, and RadixCache.evict, which pops least recently used leaves from it (a
    held prefix is not evictable) and runs only when an allocation lacks slots (mem_cache/common.py:
    evict_from_tree_cache). Issue 36 item 9: the old _evict walked every node of every tree and heap-sorted all
    leaves to free a few tokens on each insert past its bound (~50x slower generation with a full cache); here
    freeing 3 leaves of 2,000 pops a few heap entries, and inserting never evicts."""
    sched = _sched(model_path, ref, max_total_tokens=4000)
    kv = [(torch.zeros(1, 2, 1), torch.zeros(1, 2, 1))] * sched.num_layers

    def insert(seq):
        return sched._tree_insert((None, None), seq, lambda pos: kv)
    insert([1, 2])
    leaves = [insert([1, 2, 3 + i // 90, 3 + i % 90]) for i in range(2000)]  # 2,000 leaves under 23 inner nodes
    assert sched.cache_tokens == 2 + 2 * 2000 - 2000 + 23 and sched.evicted_nodes == 0  # never at insert
    assert sched.evictable_leaves == _leaves(sched) == set(leaves)
    sched._lock(leaves[0], 1)  # a running request holds the oldest leaf (and its ancestors)
    assert leaves[0] not in sched.evictable_leaves and sched.protected_tokens == 1 + 1 + 2
    pops = sched.evict_pops
    full = sched.max_total_tokens - sched.cache_tokens  # the pool's free slots; ask for 3 more
    assert sched._make_room(full + 3)
    # O(evicted), not O(nodes): the 3 leaves and the few stale heap entries of nodes that stopped being evictable
    # leaves (the stem before it had children, the held leaf); the old walk visited all 4,000+ nodes
    assert sched.evicted_nodes == 3 and sched.evict_pops - pops < 10
    assert [n in sched.evictable_leaves for n in leaves[:5]] == [False, False, False, False, True]
    assert leaves[0].parent is not None and leaves[0] in leaves[0].parent.children.values()  # held: kept
    sched._lock(leaves[0], -1)
    assert sched.protected_tokens == 0 and sched.evictable_leaves == _leaves(sched)
    sched._cache_match((None, None), [1, 2, 3, 7, 0], 4)  # touched: now the most recently used
    sched._evict(sched.cache_tokens - 4)  # all but the 4 tokens of the touched path, leaves before their parents
    assert sched.cache_tokens == 4 and sched._cache_match((None, None), [1, 2, 3, 7, 0], 4)[0] == 4
    assert sched.evictable_leaves == _leaves(sched) and len(sched._heap) <= 2 * len(sched.evictable_leaves) + 64


def _drive(sched, check=lambda: None):
    """The model loop without the thread: admit and decode until nothing is left, `check` after every step."""
    with torch.inference_mode():
        while sched.waiting or sched.running:
            if sched.waiting and len(sched.running) < sched.max_running:
                sched._admit()
            if sched.running:
                sched._decode()
            check()


def _long(rid, prompt, n):
    sp = engine.parse_sampling_params({"max_new_tokens": n, "temperature": 0, "ignore_eos": True}, 1 << 30)
    return scheduler.Req(rid=rid, input_ids=list(prompt), sp=sp)


def test_a_full_kv_pool_retracts_the_least_advanced_requests_and_requeues_them(model_path, ref, one_thread):
    """managers/scheduler.py: update_running_batch and managers/schedule_batch.py: ScheduleBatch.retract_decode /
    _get_decode_retraction_order / release_req: when the running batch lacks a KV slot per request for the next
    decode (check_decode_mem) after evicting the tree, requests are retracted, fewest output tokens first, then
    the longest prompt, until the rest fit (one always stays); a retracted one's KV is freed, not cached, it keeps
    its output tokens, counts a retraction and goes to the end of the queue (_add_request_to_queue), where an
    abort-all finds it ("Abort in waiting queue", scheduler.py abort_request); readmitted, it recomputes its KV and
    continues to the same greedy tokens."""
    prompts = {"a": [3, 4, 5, 6], "b": [7, 8, 9, 10, 11, 12], "c": [13, 14, 15, 16, 17]}
    free = _sched(model_path, ref)
    reqs = [_long(k, p, 8) for k, p in prompts.items()]
    free.submit(reqs)
    _drive(free)
    want = {r.rid: r.output_ids for r in reqs}
    assert all(r.num_retractions == 0 for r in reqs)

    def retracting():
        """Three running requests (4 tokens out each), then a pool 2 slots short for the next decode step."""
        sched = _sched(model_path, ref)
        reqs = [_long(k, p, 8) for k, p in prompts.items()]
        sched.submit(reqs)
        with torch.inference_mode():
            sched._admit()
            for _ in range(3):
                sched._decode()
            assert [r.rid for r in sched.running] == ["a", "b", "c"] and sched.cache_tokens == 15
            # the pool shrinks to what the batch holds now (its prompts in the tree, 3 own tokens each) + 1 slot
            sched.max_total_tokens = sched.max_total_tokens - sched.pool_free() + 1
            sched._decode()
        return sched, reqs
    sched, reqs = retracting()
    # equal outputs: the longest prompt (b) goes first; its prompt, no longer held, is evicted, and a and c fit
    assert [r.rid for r in sched.running] == ["a", "c"] and [r.rid for r in sched.waiting] == ["b"]
    b = sched.waiting[0]
    assert b.num_retractions == 1 and b.output_ids == want["b"][:4] and b.cache_node is None and b.finish is None
    assert sched.cache_tokens == 9 and sched.retracted_total == 1
    assert sched.new_token_ratio == min(1.0, (5 + 5 + 2 * 20) / (16 + 1))
    assert sched.pool_free() >= 0 and sched.evictable_leaves == _leaves(sched)
    sched.max_total_tokens += 1000
    _drive(sched, lambda: sched.pool_free() >= 0)
    assert {r.rid: r.output_ids for r in reqs} == want and [r.num_retractions for r in reqs] == [0, 1, 0]
    assert sched.protected_tokens == 0 and sched.evictable_leaves == _leaves(sched)

    sched, reqs = retracting()  # an abort-all while b is retracted finds it in the queue
    assert sched.abort(abort_all=True) == 3
    assert [r.finish["message"] for r in reqs] == ["Aborted", "Abort in waiting queue", "Aborted"]
    assert [len(r.output_ids) for r in reqs] == [5, 4, 5] and not sched.running and not sched.waiting
    assert sched.protected_tokens == 0
    # b is answered as tokenizer_manager.py _handle_abort_req answers an AbortReq: these keys only (no
    # routed_experts, no prompt_tokens); a, aborted while running, by the ordinary output path
    front = types.SimpleNamespace(tokenizer=sched.tokenizer, sched=types.SimpleNamespace(
        weight_version="0", recorder=object()))
    for r in reqs:
        r.return_routed_experts = True
    outs = [engine.Server._output(front, r, len(r.output_ids), True) for r in reqs]
    assert list(outs[1]["meta_info"]) == ["id", "finish_reason", "weight_version", "weight_versions", "e2e_latency",
                                          "completion_tokens"]
    assert outs[1]["output_ids"] == reqs[1].output_ids and outs[1]["meta_info"]["completion_tokens"] == 4
    assert "prompt_tokens" in outs[0]["meta_info"] and "routed_experts" in outs[0]["meta_info"]


def test_a_request_that_alone_outgrows_the_kv_pool_is_aborted_with_500(model_path, ref, one_thread):
    """managers/schedule_batch.py: ScheduleBatch.retract_decode: when even the last request left cannot get a
    slot it is aborted with 500 "Out of memory even after retracting all other requests in the decode batch.
    Aborting the last request."; a prompt longer than the pool is refused (400) before it is prefilled."""
    sched = _sched(model_path, ref, max_total_tokens=12)
    r = _long("x", [3, 4, 5, 6, 7, 8], 20)
    too_long = _long("y", list(range(3, 20)), 1)
    sched.submit([r, too_long])
    _drive(sched)
    assert r.finish == scheduler.abort_reason(scheduler.OOM_LAST, 500) and len(r.output_ids) == 12 - 6 + 1
    assert too_long.finish["status_code"] == 400 and "--max-total-tokens" in too_long.finish["message"]


# ---------------------------------------------------------------------------------------------------------------
# Server limits an RL client meets (issue 29 item 8)

LONG = 3000  # max_new_tokens of a request meant to be still running when the test acts on it


def loads(url):
    load = requests.get(url + "/v1/loads", timeout=10).json()["loads"][0]
    return load["num_running_reqs"], load["num_waiting_reqs"]


def wait_until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def queued_url(model_path):
    """One running request, one queued: the third is refused."""
    url, handle = engine.launch(model_path, max_running_requests=1, max_queued_requests=1, num_threads=1)
    yield url
    handle.stop()


def long_body(rid):
    return {"input_ids": [3, 4, 5], "rid": rid, "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}


def test_a_full_queue_answers_503_and_the_client_retries_it(queued_url):
    """managers/scheduler.py: _add_request_to_queue -> _abort_on_queued_limit: a request that finds
    --max-queued-requests waiting is aborted with 503 "The request queue is full." (tokenizer_manager.py:
    _handle_abort_finish_reason raises it as the HTTP status), also a request retracted by a pause (pause_generation
    re-queues each). sglang_client.Fleet.generate retries a 5xx with backoff, so the trajectory goes on once the queue
    drains, and after rollout.max_retries it fails naming the status and the message."""
    url = queued_url
    with cf.ThreadPoolExecutor(2) as ex:
        a = ex.submit(post, url, "/generate", long_body("q-a"))
        wait_until(lambda: loads(url) == (1, 0), 30, "the first request to run")
        b = ex.submit(post, url, "/generate", long_body("q-b"))
        wait_until(lambda: loads(url) == (1, 1), 30, "the second request to queue")
        full = post(url, "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
        assert full.status_code == 503 and QUEUE_FULL in full.text
        sync = sglang_client.SyncFleet(sglang_client.Fleet([url], max_retries=0))
        with pytest.raises(sglang_client.FleetError, match=r"HTTP 503.*The request queue is full\."):
            sync.generate({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
        sync.close()
        sync = sglang_client.SyncFleet(sglang_client.Fleet([url], max_retries=50, retry_backoff_s=0.05))
        try:
            c = sync.submit("generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2,
                                                                                   "ignore_eos": True}})
            wait_until(lambda: sync.fleet.retries >= 1, 30, "the client to retry a 503")
            assert post(url, "/abort_request", {"rid": "q-b"}).status_code == 200
            assert post(url, "/abort_request", {"rid": "q-a"}).status_code == 200
            out = c.result(60)
            assert len(out["output_ids"]) == 2 and out["meta_info"]["finish_reason"]["type"] == "length"
        finally:
            sync.close()
        assert [f.result(30).json()["meta_info"]["finish_reason"]["type"] for f in (a, b)] == ["abort", "abort"]
    # a retract pause re-queues the running request: with one already waiting, it is refused
    with cf.ThreadPoolExecutor(2) as ex:
        a = ex.submit(post, url, "/generate", long_body("r-a"))
        wait_until(lambda: loads(url) == (1, 0), 30, "the first request to run")
        b = ex.submit(post, url, "/generate", long_body("r-b"))
        wait_until(lambda: loads(url) == (1, 1), 30, "the second request to queue")
        assert post(url, "/pause_generation", {"mode": "retract"}).status_code == 200
        try:
            ra = a.result(30)
            assert ra.status_code == 503 and QUEUE_FULL in ra.text
            assert loads(url) == (0, 1)
        finally:
            assert post(url, "/continue_generation").status_code == 200
            post(url, "/abort_request", {"rid": "r-b"})
        assert b.result(30).json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_ten_concurrent_requests_with_one_running_and_one_queued_slot_get_two_200s(queued_url):
    """test/srt/test_request_queue_validation.py: TestMaxQueuedRequests.
    test_max_queued_requests_validation_with_concurrent_requests (--max-running-requests 1 --max-queued-requests
    1; test/test_utils.py send_concurrent_generate_requests: ten at once, text prompt, temperature 0, 500 new
    tokens): two 200 and eight 503. managers/scheduler.py: _abort_on_queued_limit counts the waiting queue, which
    the iteration after a request arrives empties into the free running slot; here the ten may reach the model
    thread in one batch of calls, and a request the free slot will take is not counted as waiting
    (Scheduler._enqueue). Which two get 200 depends on arrival order (the SGLang test lists them first); the two
    are long and aborted once the eight were refused, so the test neither races a finish nor waits for one."""
    prompt = ("\n            System: You are a helpful assistant.\n            User: What is the capital of France?"
              "\n            Assistant: The capital of France is\n            ")

    async def send():
        import aiohttp
        async with aiohttp.ClientSession() as s:
            async def one():
                body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": LONG,
                                                            "ignore_eos": True}}
                async with s.post(queued_url + "/generate", json=body) as r:
                    return r.status, await r.text()
            tasks = [asyncio.ensure_future(one()) for _ in range(10)]
            deadline = time.monotonic() + 60
            while sum(t.done() for t in tasks) < 8:  # the refused ones answer at once, two run (or wait) on
                assert time.monotonic() < deadline, "waited 60 s for eight of ten requests to be answered"
                await asyncio.sleep(0.05)
            async with s.post(queued_url + "/abort_request", json={"abort_all": True}) as r:
                assert r.status == 200
            return await asyncio.gather(*tasks)
    out = asyncio.run(send())
    assert sorted(st for st, _ in out) == [200, 200] + [503] * 8, out
    assert all(QUEUE_FULL in text for st, text in out if st == 503)


def test_waiting_and_running_timeouts_abort_with_503(model_path):
    """managers/scheduler.py: _poll_timeout_aborts: SGLANG_REQ_WAITING_TIMEOUT aborts a request queued longer
    (since it entered the queue) with 503 "Request waiting timeout reached.", SGLANG_REQ_RUNNING_TIMEOUT one
    running longer since its first forward with 503 "Request running timeout reached.". The first request is held
    by an in-place pause once the second is queued (still running, generating nothing), so that it cannot finish
    before its timeout however fast the machine is; the abort marked meanwhile ends it at its next step."""
    env = {"SGLANG_REQ_WAITING_TIMEOUT": "1", "SGLANG_REQ_RUNNING_TIMEOUT": "3"}
    url, handle = engine.launch(model_path, max_running_requests=1, num_threads=1, env=env)
    try:
        with cf.ThreadPoolExecutor(2) as ex:
            a = ex.submit(post, url, "/generate", long_body("t-a"))
            wait_until(lambda: loads(url) == (1, 0), 30, "the first request to run")
            t0 = t_run = time.monotonic()  # a's first forward was before this
            fb = ex.submit(post, url, "/generate", long_body("t-b"))
            wait_until(lambda: loads(url) == (1, 1) or fb.done(), 30, "the second request to queue")
            # (a paused server holds new requests at its gate, before the queue: pause once b is queued)
            assert post(url, "/pause_generation", {"mode": "in_place"}).status_code == 200
            b = fb.result(60)
            assert b.status_code == 503 and "Request waiting timeout reached." in b.text
            assert time.monotonic() - t0 >= 1.0
            # paused, a's abort is only marked (it finishes at its next step, as in 0.5.23): past its timeout,
            # continue, and its next step ends it
            time.sleep(max(0.0, t_run + 3.5 - time.monotonic()))
            assert post(url, "/continue_generation", {}).status_code == 200
            ra = a.result(60)
            assert ra.status_code == 503 and "Request running timeout reached." in ra.text
            short = post(url, "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 3}})
            assert short.status_code == 200 and len(short.json()["output_ids"]) <= 3
    finally:
        handle.stop()


# ---------------------------------------------------------------------------------------------------------------
# /v1/loads is a snapshot between two steps (issue 27: the kept-pause test's flaky start)

def test_loads_counts_a_request_while_it_is_prefilled(model_path):
    """managers/scheduler_components/load_inquirer.py: get_loads runs on the scheduler between two batches, so a
    request is always in the running batch or the waiting queue. Read from the HTTP thread, a request popped off
    the queue and being prefilled was in neither: test_rollout's kept-pause test waited for "0 running, 0 waiting"
    after the previous test, saw it while that test's abandoned requests (dispatched at its final continue) were
    prefilled, and then found them held next to its own at its pause (10 > partial_kept_count 8). Here the model's
    forward is held while a request is prefilled and /v1/loads is asked meanwhile."""
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    sched = scheduler.Scheduler(model, tok, torch.device("cpu"), 4, 1024, "0")
    entered, release = threading.Event(), threading.Event()
    forward = model.forward

    def held(*args, **kw):
        entered.set()
        assert release.wait(30)
        return forward(*args, **kw)
    model.forward = held
    args = types.SimpleNamespace(max_request_mb=1.0, api_key=None, wait_timeout=30.0, model_path="tiny",
                                 speculative_algorithm=None, speculative_draft_model_path=None)
    server = engine.Server(args, sched, tok)
    sched.thread.start()
    try:
        sched.call(lambda: sched.submit([_req([3, 4, 5], 50)]))
        assert entered.wait(30)

        async def ask():
            task = asyncio.ensure_future(server.loads(None))
            while not task.done() and sched.inbox.empty():  # asked: waiting for the step to end
                await asyncio.sleep(0.001)
            release.set()
            return json.loads((await task).body)["loads"][0]
        load = asyncio.run(ask())
        assert load["num_running_reqs"] + load["num_waiting_reqs"] == 1
    finally:
        release.set()
        sched.stop()


# ---------------------------------------------------------------------------------------------------------------
# Logprob fields (issue 29 item 4)

def reference_logp(ref, ids):
    """log_softmax of the model's logits at every position of ids (float32) [len(ids), V]."""
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)


def test_input_top_logprobs_and_token_ids_logprob_are_answered_per_position(url, ref):
    """managers/scheduler_components/logprob_result_processor.py: _process_input_top_logprobs /
    _process_input_token_ids_logprobs ([None] + one row per later input position) and tokenizer_manager.py:
    add_logprob_to_meta_info (input_top_logprobs, input_token_ids_logprobs, output_token_ids_logprobs: per
    position a list of [logprob, id, text], None where there is none; output_token_logprobs_length). Each value
    is the model's own."""
    prompt, ids = [11, 12, 13, 14, 15, 16], [5, 7]
    out = gen(url, prompt, logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=ids,
              sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    m = out["meta_info"]
    lp = reference_logp(ref, prompt + out["output_ids"])
    assert m["input_top_logprobs"][0] is None and len(m["input_top_logprobs"]) == len(prompt)
    for j, row in enumerate(m["input_top_logprobs"][1:], 1):
        want = lp[j - 1].topk(3)
        assert [t for _, t, _ in row] == want.indices.tolist()
        assert max(abs(a - b) for (a, _, _), b in zip(row, want.values.tolist())) < 1e-4
    assert m["input_token_ids_logprobs"][0] is None and len(m["input_token_ids_logprobs"]) == len(prompt)
    for j, row in enumerate(m["input_token_ids_logprobs"][1:], 1):
        assert [t for _, t, _ in row] == ids
        assert max(abs(a - lp[j - 1, t].item()) for a, t, _ in row) < 1e-4
    assert len(m["output_token_ids_logprobs"]) == len(out["output_ids"]) == m["output_token_logprobs_length"] == 3
    for k, row in enumerate(m["output_token_ids_logprobs"]):
        assert [t for _, t, _ in row] == ids
        assert max(abs(a - lp[len(prompt) - 1 + k, t].item()) for a, t, _ in row) < 1e-4
    text = gen(url, prompt, token_ids_logprob=ids, return_text_in_logprobs=True)["meta_info"]
    assert len(text["output_token_ids_logprobs"][0][0]) == 3 and isinstance(text["output_token_ids_logprobs"][0][0][2],
                                                                            str)
    # logprob_start_len -1 with token ids: the last input position only (scheduler.py handle_generate_request)
    assert text["input_token_ids_logprobs"] == [None] and [t for _, t, _ in text["input_token_logprobs"]] == [16]


def test_input_logprobs_start_at_logprob_start_len_after_a_cached_prefix(url, ref):
    """managers/schedule_batch.py: Req._compute_max_prefix_len caps the cache match at logprob_start_len, and
    logprob_result_processor.py puts None at logprob_start_len itself: the prompt's cached part is reused and the
    reported log-probs are the model's."""
    assert post(url, "/flush_cache").status_code == 200
    prompt = [21, 22, 23, 24, 25, 26, 27]
    gen(url, prompt)
    out = gen(url, prompt, logprob_start_len=3)
    m = out["meta_info"]
    assert m["cached_tokens"] == 3
    lp = reference_logp(ref, prompt)
    assert [t for _, t, _ in m["input_token_logprobs"]] == prompt[3:] and m["input_token_logprobs"][0][0] is None
    assert max(abs(a - lp[j - 1, prompt[j]].item()) for j, (a, _, _) in enumerate(m["input_token_logprobs"][1:], 4)
               ) < 1e-4


def test_token_ids_logprob_is_validated(url):
    """managers/tokenizer_manager.py: _validate_token_ids_logprob (400: a flat list of in-vocabulary ints) and
    managers/io_struct.py: GenerateReqInput.token_ids_logprob (a list of lists: one per item of a batch, a flat
    list: the same for every item; another JSON type fails the schema check, which 0.5.23 answers with 400:
    entrypoints/http_server.py, validation_exception_handler)."""
    body = {"input_ids": [3, 4], "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    r = post(url, "/generate", {**body, "token_ids_logprob": [1, 10 ** 7]})
    assert r.status_code == 400 and "out-of-vocabulary token id 10000000" in r.text, r.text
    r = post(url, "/generate", {**body, "token_ids_logprob": [[1, 2]]})
    assert r.status_code == 400 and "token_ids_logprob must be a flat list of integers." in r.text, r.text
    r = post(url, "/generate", {**body, "token_ids_logprob": ["a"]})
    assert r.status_code == 400 and r.json()["type"] == "Bad Request", r.text
    batch = {**body, "input_ids": [[3, 4], [5, 6]]}
    flat = post(url, "/generate", {**batch, "token_ids_logprob": [1, 2]}).json()
    assert [[t for _, t, _ in o["meta_info"]["output_token_ids_logprobs"][0]] for o in flat] == [[1, 2], [1, 2]]
    nested = post(url, "/generate", {**batch, "token_ids_logprob": [[1], [2, 3]]}).json()
    assert [[t for _, t, _ in o["meta_info"]["output_token_ids_logprobs"][0]] for o in nested] == [[1], [2, 3]]


def test_a_control_call_whose_caller_gave_up_still_runs_and_the_model_thread_keeps_serving(model_path, ref):
    """managers/scheduler.py: a control request that reached 0.5.23's scheduler (its process_input_requests loop)
    runs whether or not the HTTP client still waits for its answer. Here the caller's future is cancelled before
    the model thread takes the call (a client that timed out under load: asyncio.wrap_future cancels it). The call
    runs, and the thread goes on answering: before, handing an answer to a cancelled future raised
    InvalidStateError out of the loop, the thread died and the server hung with every later request."""
    sched = _sched(model_path, ref)
    ran = threading.Event()
    first = sched.call(ran.set)
    assert first.cancel()  # not yet taken by the model thread (it has not started)
    sched.thread.start()
    try:
        assert sched.call(lambda: 7).result(30) == 7
        assert ran.is_set() and first.cancelled()
        failing = sched.call(lambda: 1 / 0)
        assert failing.cancel()
        assert sched.call(lambda: "still serving").result(30) == "still serving"
        assert sched.thread.is_alive()
    finally:
        sched.stop()
