"""rollout.py: the fleet client, response parsing, the concurrency knob, and the producer against standins/engine.py.

The Fleet unit tests use a tiny aiohttp fake where only HTTP behaviour matters (retries, fan-out, router workers);
every producer test runs against standins/engine.py serving the tiny model, started by the test.
"""
import asyncio
import contextlib
import copy
import inspect
import io
import json
import os
import random
import re
import threading
import time
import warnings
from collections import Counter

import pytest
import requests
import torch
from aiohttp import web

import batching
import buffer
import config
import logger as logger_lib
from standins import engine
import rollout
import rollout_fns
import run_modes
import sglang_client
import tasks
from standins import tiny_model
import workers
from buffer import COMPLETED, FAILED, TRUNCATED, Trajectory
from services import free_port  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# Pure parts: rids, response parsing, partial metrics, the concurrency knob

def test_rids_are_never_prefixes_of_each_other():
    rids = [rollout.make_rid("t", e, s, i, a)
            for e in (0, 1) for s in (1, 10, 11) for i in (0, 1, 10) for a in (0, 1, 10)]
    assert len(set(rids)) == len(rids)
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
    prefix = rollout.trajectory_rid_prefix("t", 0, 1, 1)
    assert [r for r in rids if r.startswith(prefix)] == [rollout.make_rid("t", 0, 1, 1, a) for a in (0, 1, 10)]


def site_of(fn, text: str = "raise ") -> str:
    """'tests/test_rollout.py:N': the file and the first line of fn holding `text`, as a failure's reason names where
    it raised (scoring.raised)."""
    lines, start = inspect.getsourcelines(fn)
    return f"{os.path.relpath(inspect.getsourcefile(fn))}:{start + next(i for i, x in enumerate(lines) if text in x)}"


def _response(ids, version="3", spans=None, finish=None):
    meta = {"id": "r", "weight_version": version, "finish_reason": finish or {"type": "stop", "matched": 1},
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(ids)]}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"text": "", "output_ids": ids, "meta_info": meta}


def test_parse_response_versions_from_spans_and_finish():
    g = sglang_client.parse_generate_response(_response([5, 6, 7, 8], "4", [{"version": "3", "start": 0, "end": 3},
                                                                       {"version": "4", "start": 3, "end": 4}]))
    assert g.ids == [5, 6, 7, 8] and g.log_probs == [-0.5, -1.5, -2.5, -3.5]
    assert g.versions == [3, 3, 3, 4] and g.finish == "stop"
    g = sglang_client.parse_generate_response(_response([5, 6], "2", finish={"type": "length", "length": 2}))
    assert g.versions == [2, 2] and g.finish == "length"
    assert sglang_client.parse_generate_response(_response([], "0", finish={"type": "abort", "message": "x"})).ids == []
    assert sglang_client.parse_generate_response(_response([5], "default")).versions == [0]  # SGLang's launch version
    with pytest.raises(ValueError, match="weight_version 'v7' is not an integer"):
        sglang_client.parse_generate_response(_response([5], "v7"))
    bad = _response([5, 6])
    bad["meta_info"]["output_token_logprobs"] = bad["meta_info"]["output_token_logprobs"][:1]
    with pytest.raises(ValueError, match="return_logprob"):
        sglang_client.parse_generate_response(bad)


def test_concurrency_knob_clamps_with_warning_and_rejects_bad_values():
    with pytest.warns(UserWarning, match=r"\(100\) exceeds the inference fleet's concurrency \(24"):
        assert rollout.clamp_max_concurrent_samples(100, 4, 24) == 24
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rollout.clamp_max_concurrent_samples(16, 4, 24) == 16
        assert rollout.clamp_max_concurrent_samples(None, 4, 24) is None
        assert rollout.clamp_max_concurrent_samples(100, 4, None) == 100  # fleet concurrency unknown: no clamp
        # multi-turn: episodes in a tool step hold no server slot, so the bound is the fleet plus the tool slots
        assert rollout.clamp_max_concurrent_samples(30, 4, 24, tool_slots=16) == 30
    with pytest.warns(UserWarning, match=r"\(24, .*\) \+ rollout.env_max_concurrent 16; clamping it to 40"):
        assert rollout.clamp_max_concurrent_samples(100, 4, 24, tool_slots=16) == 40
    with pytest.raises(ValueError, match="must be > 0"):
        rollout.clamp_max_concurrent_samples(0, 4, 24)
    with pytest.raises(ValueError, match=r"\(3\) must be >= data_source.num_trajectories_per_prompt \(4\)"):
        rollout.clamp_max_concurrent_samples(3, 4, 24)
    with pytest.raises(ValueError, match=r"fleet's concurrency \(2.*below.*\(4\)"):
        rollout.clamp_max_concurrent_samples(8, 4, 2)


# ---------------------------------------------------------------------------------------------------------------
# The Fleet's HTTP behaviour against a tiny fake

class FakeServers:
    """aiohttp apps on free ports in a background loop; `routes(i)` gives server i's (method, path, handler)s."""

    def __init__(self, count, routes, port=0):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runners, self.urls = [], []
        for i in range(count):
            url, runner = asyncio.run_coroutine_threadsafe(self._start(routes(i), port), self.loop).result(10)
            self.urls.append(url)
            self.runners.append(runner)

    async def _start(self, routes, port):
        app = web.Application()
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", runner

    def close(self):
        for r in self.runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_fleet_retries_5xx_not_4xx_and_takes_unreachable_servers_out_of_rotation():
    calls = []

    async def generate(request):
        body = await request.json()
        calls.append(body["rid"])
        if len(calls) < 3:
            return web.Response(status=503, text="starting")
        if body["input_ids"] == [0]:
            return web.Response(status=400, text="unknown field `x`")
        return web.json_response(_response([7], "0"))

    servers = FakeServers(1, lambda i: [("POST", "/generate", generate)])
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    sync = sglang_client.SyncFleet(sglang_client.Fleet([dead, servers.urls[0]], retry_backoff_s=0.01, max_retries=6))
    try:
        rids = iter(f"r{i}." for i in range(100))
        out = sync.generate({"input_ids": [1]}, lambda: next(rids))
        assert out["output_ids"] == [7]
        # dead (refused: out of rotation, not a retry), live (503), live (503), live (ok), each a new rid
        assert len(calls) == 3 and len(set(calls)) == 3
        assert sync.fleet.retries == 2 and sync.fleet.requests_in_flight == 0
        assert list(sync.fleet.down) == [dead] and "ConnectionRefused" in sync.fleet.down[dead]
        with pytest.raises(sglang_client.FleetError, match="HTTP 400"):
            sync.generate({"input_ids": [0]}, lambda: next(rids))
        assert len(calls) == 4  # the 400 is not retried
        only_dead = sglang_client.SyncFleet(sglang_client.Fleet([dead], retry_backoff_s=0.01, startup_timeout_s=0.3))
        t0 = time.monotonic()
        with pytest.raises(sglang_client.FleetError, match=r"no inference server answered for "
                                                     r"rollout.startup_timeout_s=0.3 s: http://127.0.0.1:9: "):
            only_dead.generate({"input_ids": [1]})
        assert time.monotonic() - t0 < 2
        only_dead.close()
    finally:
        sync.close()
        servers.close()


def test_sync_fleet_runs_every_fleet_call_blocking_under_its_name():
    """SyncFleet writes no method out: each coroutine method of Fleet is a blocking one of the same name (dir lists
    them), bounded by call_timeout_s and named in its timeout; a plain method is Fleet's own; other names fail."""
    sync = sglang_client.SyncFleet(sglang_client.Fleet(["http://127.0.0.1:9"]))  # discard port: refused
    try:
        calls = {n for n, v in vars(sglang_client.Fleet).items() if asyncio.iscoroutinefunction(v) and n[0] != "_"}
        assert calls - {"close"} <= set(dir(sync)) and "take_abort_failures" in dir(sync)
        assert sync.health() == {"http://127.0.0.1:9": False} and sync.take_abort_failures() == {}
        sync.call_timeout_s = 0.2
        with pytest.raises(TimeoutError, match=r"^Fleet.wait_healthy did not finish within 0.2 s$"):
            sync.wait_healthy(30)
        with pytest.raises(AttributeError, match="SyncFleet has no attribute 'from_config', and Fleet no method"):
            sync.from_config
    finally:
        sync.close()


def test_generate_waits_for_a_server_to_come_back_and_stop_ends_the_wait():
    """The only server dies (here: is not there yet); a request waits, and is served once /health answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sync = sglang_client.SyncFleet(sglang_client.Fleet([url], retry_backoff_s=0.05, startup_timeout_s=30))

    async def ok(request):
        return web.json_response(_response([7], "0"))

    servers = None
    try:
        pending = sync.submit("generate", {"input_ids": [1]})
        time.sleep(0.5)
        assert not pending.done() and url in sync.fleet.down
        servers = FakeServers(1, lambda i: [("POST", "/generate", ok), ("GET", "/health", ok)], port=port)
        assert pending.result(10)["output_ids"] == [7]
        assert sync.fleet.down == {} and sync.fleet.retries == 0
        servers.close()
        servers = None
        stop = asyncio.Event()
        pending = sync.submit("generate", {"input_ids": [1]}, None, stop)
        time.sleep(0.3)
        assert not pending.done()
        sync.loop.call_soon_threadsafe(stop.set)  # a pause: the waiting request gives up, to be restored later
        assert pending.result(5) is None
    finally:
        sync.close()
        if servers is not None:
            servers.close()


def test_fleet_fans_control_calls_out_to_router_workers():
    seen = {0: [], 1: []}
    silent = False

    def worker_routes(i):
        async def abort(request):
            seen[i].append((await request.json())["rid"])
            return web.Response(status=200)

        async def info(request):  # worker 0 reports only the enforced limit (2 DP ranks of 4), worker 1 the flag
            if i == 0:
                return web.json_response({"max_running_requests": None, "tp_size": 1, "dp_size": 2, "internal_states": [
                    {"effective_max_running_requests_per_dp": 4}, {"effective_max_running_requests_per_dp": 4}]})
            return web.json_response({"max_running_requests": None if silent else 9, "tp_size": 2, "pp_size": 3})

        async def update(request):
            seen[i].append(("update", (await request.json())["weight_version"]))
            return web.json_response({"success": i == 0, "message": "bad checkpoint" if i else "ok"})
        return [("POST", "/abort_request", abort), ("GET", "/server_info", info),
                ("POST", "/update_weights_from_disk", update)]

    workers = FakeServers(2, worker_routes)

    async def list_workers(request):
        return web.json_response({"workers": [{"url": u, "healthy": True} for u in workers.urls]})

    router = FakeServers(1, lambda i: [("GET", "/workers", list_workers)])
    sync = sglang_client.SyncFleet(sglang_client.Fleet(router_url=router.urls[0], router_max_concurrent_requests=12))
    try:
        assert sync.workers() == workers.urls
        assert sync.engine_ranks() == [2, 6]  # weight-update group ranks: tp x dp x pp of each worker
        assert sync.abort("tag-") == 0
        assert seen == {0: ["tag-"], 1: ["tag-"]}
        assert sync.concurrency() == 12  # min(8 + 9, router limit 12)
        sync.fleet.router_max_concurrent_requests = None
        assert sync.concurrency() == 17
        silent = True
        with pytest.warns(UserWarning, match=workers.urls[1] + " report no concurrency limit"):
            assert sync.concurrency() is None
        with pytest.raises(sglang_client.FleetError, match="bad checkpoint"):
            sync.update_weights_from_disk("/ckpt", 5)
        assert seen[0][-1] == seen[1][-1] == ("update", "5")
    finally:
        sync.close()
        workers.close()
        router.close()
    with pytest.raises(ValueError, match="either rollout.servers"):
        sglang_client.Fleet(["http://a"], router_url="http://b")


def test_aborts_to_a_stalled_server_back_off_and_are_counted_not_logged(monkeypatch, caplog):
    """A server that stops answering (SIGSTOP) gets a few aborts with doubling gaps, not one per call; the good
    server gets every abort; failures are counted per server for one warning per pause."""
    # 1 s: the good server (same process, a loaded 2-core machine) once took longer than 0.2 s to answer, and in a
    # clean-clone CI run 5 of 48 aborts took longer than 0.5 s: the timeout must be far above its answer time
    monkeypatch.setattr(sglang_client, "CONNECT_TIMEOUT_S", 1.0)
    seen = {0: 0, 1: 0}

    def routes(i):
        async def abort(request):
            seen[i] += 1
            if i == 0:
                await asyncio.sleep(2)  # far past the abort timeout (and short, so closing the server is quick)
            return web.json_response({})
        return [("POST", "/abort_request", abort)]

    servers = FakeServers(2, routes)
    sync = sglang_client.SyncFleet(sglang_client.Fleet(servers.urls, retry_backoff_s=0.1))

    async def many_aborts(duration):
        calls, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < duration:
            await asyncio.gather(*[sync.fleet.abort(f"r{calls}-{j}.") for j in range(8)])  # 8 at once, as a pause
            calls += 8
            await asyncio.sleep(0.02)
        return calls

    try:
        with caplog.at_level("WARNING", logger="rollout"):
            calls = sync.run(many_aborts(3.2))
        assert seen[1] == calls >= 5 * 8
        # 8 concurrent failures count as one: retried after 0.1, 0.2 s (+1 s timeouts) -> at most 3 rounds of 8
        # reach it within 3.2 s (fewer on a loaded machine, whose timeouts fire late)
        assert 8 <= seen[0] <= 3 * 8 < calls, (seen, calls)
        failures = sync.take_abort_failures()
        assert list(failures) == [servers.urls[0]] and seen[0] <= failures[servers.urls[0]][0] <= 3 * 8
        assert "did not answer within 1.0 s" in failures[servers.urls[0]][1]
        assert sync.take_abort_failures() == {}
        assert not [r for r in caplog.records if "abort" in r.getMessage()]  # the producer's pause reports them
    finally:
        sync.close()
        servers.close()


def test_rollout_function_names():
    assert rollout_fns.resolve_rollout_function("single_turn") is rollout_fns.single_turn
    # module:function: config.load_plugins loads it (plugins.load) and registers it under that name in every process
    try:
        cfg = config.load_config(None, ["rollout.function=rollout_fns:multi_turn_tool"])
        assert rollout_fns.resolve_rollout_function(cfg.rollout.function) is rollout_fns.multi_turn_tool
    finally:
        rollout_fns.ROLLOUT_FUNCTIONS.pop("rollout_fns:multi_turn_tool", None)
    with pytest.raises(ValueError, match="rollout.function 'nope'"):
        rollout_fns.resolve_rollout_function("nope")
    with pytest.raises(ValueError, match="async function"):
        config.load_config(None, ["rollout.function=rollout:make_rid"])


def test_multi_turn_tool_masks_environment_tokens_and_replays_restored_turns():
    """A scripted server answers "calc 2+3" then "5": the calculator's "=5\\n" gets loss mask 0; a trajectory
    restored after its first turn replays that turn into a fresh environment and only generates the answer."""
    tok = tiny_model.build_tokenizer()
    eos = tok.eos_token_id

    async def generate(request):  # the producer sends list requests (of one item: one per trajectory here)
        body = await request.json()
        out = []
        for ids in body["input_ids"]:
            reply = tok.encode("5" if tok.decode(ids).endswith("=5\n") else "calc 2+3", add_special_tokens=False)
            out.append(_response(reply + [eos], "0"))
        return web.json_response(out)

    async def info(request):
        return web.json_response({"max_running_requests": 8})

    server = FakeServers(1, lambda i: [("POST", "/generate", generate), ("GET", "/server_info", info)])
    cfg = config.load_config(None, ["data_source.task=calc_tool", "data_source.num_prompts_per_step=2",
                                    "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2",
                                    "rollout.function=multi_turn_tool", "rollout.sampling.max_new_tokens=24",
                                    f"rollout.servers=[{server.urls[0]}]"])
    prompt = {"prompt_ids": tok.encode("2+3=", add_special_tokens=False), "label": "5", "metadata": {}}
    buf = run_modes.DatasetBuffer([prompt, prompt], cfg.N)
    first_turn = tok.encode("calc 2+3", add_special_tokens=False) + [eos]
    observation = tok.encode("=5\n", add_special_tokens=False)
    partial = [Trajectory(0, 1, i, buf.pending[1].prompt_ids, status="aborted") for i in range(2)]
    rollout_fns.extend(partial[0], first_turn, [-1.0] * len(first_turn), [0] * len(first_turn), 1)
    rollout_fns.extend(partial[0], observation, [0.0] * 3, [0] * 3, 0)
    partial[0].metadata["env_spans"] = [[len(first_turn), len(first_turn) + 3]]
    buf.pending[1].partial = partial
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, buf, sync, tok)
    try:
        ro.start()
        assert buf.done.wait(30), "the scripted multi-turn episodes did not finish"
    finally:
        ro.stop()
        sync.close()
        server.close()
    answer = tok.encode("5", add_special_tokens=False) + [eos]
    for seq in (0, 1):
        for t in buf.results[seq]:
            assert t.status == "completed" and t.reward == 1.0
            assert t.response_ids.tolist() == first_turn + observation + answer
            assert t.loss_mask.tolist() == [1] * len(first_turn) + [0] * 3 + [1] * len(answer)
            assert len(t.rollout_log_probs) == len(t.versions) == len(t.response_ids)
    restored = next(t for t in buf.results[1] if t.index == 0)
    assert restored.metadata["attempts"] == 1 and restored.metadata["restored"] == 1  # one request: the answer


# ---------------------------------------------------------------------------------------------------------------
# Tool environments (issue 35): a scripted calculator server, environments that are slow, sync, raise, time out

def _calc_server(hold_answers=None):
    """A scripted server for calc_tool: the first turn of "A+B=" is "calc A+B" eos, the turn after the tool's
    "=R\n" is "R" eos. hold_answers: a dict {"paused": asyncio.Event, "resumed": bool} that makes every answer turn
    wait for /pause_generation (then it comes back aborted, with no tokens) until /continue_generation."""
    tok = tiny_model.build_tokenizer()
    eos = tok.eos_token_id

    async def generate(request):
        body = await request.json()
        out = []
        for ids in body["input_ids"]:
            text = tok.decode(ids)
            if text.endswith("\n"):  # after the tool's observation
                if hold_answers is not None and not hold_answers["resumed"]:
                    await hold_answers["paused"].wait()
                    out.append(_response([], "0", finish={"type": "abort"}))
                    continue
                reply = text.rsplit("=", 1)[1].strip()
            else:
                reply = "calc " + text.split("=")[0]
            out.append(_response(tok.encode(reply, add_special_tokens=False) + [eos], "0"))
        return web.json_response(out)

    async def info(request):
        return web.json_response({"max_running_requests": 64})

    async def pause(request):
        hold_answers["paused"].set()
        return web.json_response({})

    async def resume(request):
        hold_answers["resumed"] = True
        return web.json_response({})

    async def ok(request):
        return web.json_response({})

    routes = [("POST", "/generate", generate), ("GET", "/server_info", info), ("POST", "/abort_request", ok)]
    if hold_answers is not None:
        routes += [("POST", "/pause_generation", pause), ("POST", "/continue_generation", resume)]
    return FakeServers(1, lambda i: routes), tok


def _calc_prompts(tok, pairs):
    return [{"prompt_ids": tok.encode(f"{a}+{b}=", add_special_tokens=False), "label": str(a + b), "metadata": {}}
            for a, b in pairs]


class _ToolEnv(tasks.CalcToolEnv):
    """The calculator behind an async step that takes 20 ms, counting the steps it sees at once; label 13 raises,
    label 14 hangs (longer than the test's rollout.env_step_timeout_s)."""
    in_step = most = 0
    threads: set = set()

    def __init__(self, label, metadata):
        super().__init__(label, metadata)
        self.label = label

    async def step(self, turn_text):
        cls = _ToolEnv
        cls.in_step += 1
        cls.most = max(cls.most, cls.in_step)
        try:
            await asyncio.sleep(0.02)
            if self.label == "13":
                raise ValueError("the tool broke")
            if self.label == "14":
                await asyncio.sleep(30)
            return super().step(turn_text)
        finally:
            cls.in_step -= 1


class _SyncToolEnv(tasks.CalcToolEnv):
    threads: set = set()

    def step(self, turn_text):
        _SyncToolEnv.threads.add(threading.current_thread().name)
        return super().step(turn_text)


def _run_calc(monkeypatch, env_cls, pairs, *overrides):
    """Every prompt of `pairs` (N=2) through multi_turn_tool with env_cls as rollout.env=test_env against the
    scripted server; returns (the DatasetBuffer's results, the producer's step metrics)."""
    monkeypatch.setitem(tasks.ENVS, "test_env", env_cls)
    server, tok = _calc_server()
    cfg = config.load_config(None, ["data_source.task=calc_tool", "data_source.num_prompts_per_step=2",
                                    "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2",
                                    "rollout.function=multi_turn_tool", "rollout.env=test_env",
                                    "rollout.sampling.max_new_tokens=24", f"rollout.servers=[{server.urls[0]}]",
                                    *overrides])
    buf = run_modes.DatasetBuffer(_calc_prompts(tok, pairs), cfg.N)
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, buf, sync, tok)
    try:
        ro.start()
        assert buf.done.wait(30), "the scripted episodes did not finish"
        metrics = ro.step_metrics()
    finally:
        ro.stop()
        sync.close()
        server.close()
    return buf.results, metrics


def test_env_steps_are_bounded_and_failures_fail_their_trajectory_and_are_counted(monkeypatch, caplog):
    """rollout.env_max_concurrent=2 bounds the steps the environment sees at once; a step that raises or outlives
    rollout.env_step_timeout_s fails its trajectory (the reason in its metadata), counted and logged once per kind,
    and every other episode completes."""
    _ToolEnv.in_step = _ToolEnv.most = 0
    pairs = [(2, 3), (6, 7), (7, 7), (1, 1), (4, 4), (3, 5), (2, 2), (9, 0)]  # 6+7 raises, 7+7 hangs
    with caplog.at_level("WARNING", logger="rollout"):
        results, m = _run_calc(monkeypatch, _ToolEnv, pairs, "rollout.env_max_concurrent=2",
                               "rollout.env_step_timeout_s=0.5")
    assert _ToolEnv.most == 2 and m["rollout/env_in_use_max"] == 2
    assert m["rollout/env_error_count"] == 2 and m["rollout/env_timeout_count"] == 2
    # two steps per good episode (the call; the answer, which ends it), one per failed one
    assert m["rollout/env_steps"] == 6 * 2 * 2 + 4 and m["rollout/failed_count"] == 4
    assert m["rollout/env_wait_s_mean"] > 0 and m["rollout/env_step_s_mean"] >= 0.02
    for seq, (a, b) in enumerate(pairs):
        for t in results[seq]:
            if a + b in (13, 14):
                kind = "error" if a + b == 13 else "timeout"
                assert t.status == FAILED and t.metadata["env_error"]["kind"] == kind
                assert t.metadata["env_error"]["turn"] == 1 and t.metadata["error"].startswith(
                    "the tool environment rollout.env=test_env: its step of turn 1 ")
                assert ("raised ValueError('the tool broke')" if kind == "error" else
                        "did not return within rollout.env_step_timeout_s=0.5 s") in t.metadata["error"]
            else:
                assert t.status == "completed" and t.reward == 1.0
                assert t.metadata["env_turns"] == [[f"calc {a}+{b}", f"={a + b}\n"]]
    logged = [r.getMessage() for r in caplog.records if "first environment" in r.getMessage()]
    assert len(logged) == 2 and "'6+7='" in logged[0] + logged[1] and "'7+7='" in logged[0] + logged[1]


def test_a_sync_step_runs_off_the_event_loop_and_a_failing_env_stops_the_run(monkeypatch):
    _SyncToolEnv.threads = set()
    results, m = _run_calc(monkeypatch, _SyncToolEnv, [(1, 2), (3, 4)], "rollout.env_max_concurrent=3")
    assert _SyncToolEnv.threads and all(name.startswith("env") for name in _SyncToolEnv.threads)
    assert len(_SyncToolEnv.threads) <= 3 and m["rollout/env_in_use_max"] <= 3
    assert all(t.status == "completed" for ts in results.values() for t in ts)

    class Down(tasks.CalcToolEnv):
        def step(self, turn_text):
            raise ConnectionError("tool backend down")

    results, m = _run_calc(monkeypatch, Down, [(1, 2), (3, 4)], "rollout.env_fail_stop_steps=3")
    stops = [t.metadata["stop"] for ts in results.values() for t in ts if "stop" in t.metadata]
    assert len(stops) == 1 and m["rollout/env_error_count"] == 4  # the run goes on until the buffer stops it
    assert stops[0] == ("nothing can be trained: the tool environment rollout.env=test_env failed each of its "
                        "last 3 steps; the first of them: its step of turn 1 raised ConnectionError('tool backend "
                        f"down') at {site_of(Down.step)}; fix the environment (or raise rollout.env_fail_stop_steps; "
                        "0 turns this stop off)")
    # the buffer hands that sentence to the trainer, which stops as the filter stop does (NothingToTrain)
    cfg = config.load_config(None, ["data_source.num_prompts_per_step=2", "data_source.num_trajectories_per_prompt=2",
                                    "trainer.mini_batch_size=2", "data_source.num_prompts=8"])
    buf = buffer.PipelineServer(cfg, [[{"prompt_ids": [5, 6], "label": "1"}] * 8], collector_thread=False)
    try:
        g = buf.dispatch(1)[0]
        trajs = [Trajectory(g.epoch, g.seq, i, g.prompt_ids, status=FAILED) for i in range(2)]
        trajs[1].metadata["stop"] = stops[0]
        buf.put(trajs)
        assert buf.wait(1, 0.1)["stop"] == stops[0]
    finally:
        buf.close()


@pytest.mark.parametrize("override,sentence", [
    ("rollout.env_max_concurrent=0", "rollout.env_max_concurrent must be > 0, got 0"),
    ("rollout.env_max_concurrent=2.5", "config key 'rollout.env_max_concurrent' must be an integer, got 2.5"),
    ("rollout.env_step_timeout_s=0", "rollout.env_step_timeout_s must be > 0, got 0.0"),
    ("rollout.env_step_timeout_s=700 rollout.function=multi_turn_tool", "rollout.env_step_timeout_s (700) must be "
                                                                        "below rollout.pause_timeout_s (600): "
                                       "a pause waits for the environment steps in progress, which are never cut "
                                       "short (their side effects would be half done)"),
    ("rollout.env_fail_stop_steps=-1", "rollout.env_fail_stop_steps must be >= 0 (0: never stop), got -1"),
    ("rollout.env_retries=-1", "rollout.env_retries must be >= 0 (0: a failed step is not run again), got -1"),
    ("rollout.env_step_timeout_s=300 rollout.env_retries=1 rollout.function=multi_turn_tool",
     "rollout.env_step_timeout_s x (rollout.env_retries + 1) (300 x 2, a step and its retries) must be below "
     "rollout.pause_timeout_s (600): a pause waits for the environment steps in progress, which are never cut short "
     "(their side effects would be half done)"),
])
def test_env_settings_are_validated_in_one_sentence(override, sentence):
    with pytest.raises(ValueError) as e:
        config.load_config(None, override.split())
    assert str(e.value) == sentence


class _FlakyToolEnv(tasks.CalcToolEnv):
    """The calculator whose every step fails its first k attempts, k drawn per prompt (label) by the test from a
    seeded RNG: odd attempts raise, even ones hang past rollout.env_step_timeout_s. Each attempt is recorded."""
    k: dict = {}  # label -> failing attempts before each step succeeds
    attempts: list = []  # the label of every attempt

    def __init__(self, label, metadata):
        super().__init__(label, metadata)
        self.label, self.tries = label, 0

    async def step(self, turn_text):
        _FlakyToolEnv.attempts.append(self.label)
        self.tries += 1
        if self.tries <= _FlakyToolEnv.k[self.label]:
            if self.tries % 2 == 0:
                await asyncio.sleep(30)
            raise ConnectionError(f"dropped attempt {self.tries}")
        self.tries = 0
        return super().step(turn_text)


@pytest.mark.parametrize("retries", [0, 2])
def test_env_retries_recover_a_flaky_step_and_never_retry_past_the_limit(monkeypatch, retries):
    """rollout.env_retries = R runs a step that raised or timed out again, up to R times: a step whose first k
    attempts fail succeeds when k <= R (its trajectory completes, 2 steps of k + 1 attempts), otherwise it fails
    after exactly R + 1 attempts, with the last one's reason; the default 0 runs every step once."""
    rng = random.Random(5)
    pairs = [(a, 10 * i) for i, a in enumerate([1, 2, 3, 4, 5, 6, 7, 8])]  # distinct sums: one label each
    _FlakyToolEnv.k = {str(a + b): rng.choice([0, 0, 1, 2, 3]) for a, b in pairs}
    _FlakyToolEnv.attempts = []
    assert set(_FlakyToolEnv.k.values()) == {0, 1, 2, 3}
    overrides = ["rollout.env_step_timeout_s=0.3"] + ([f"rollout.env_retries={retries}"] if retries else [])
    results, m = _run_calc(monkeypatch, _FlakyToolEnv, pairs, *overrides)
    want_attempts, steps, failed = Counter(), 0, Counter()
    for label, k in _FlakyToolEnv.k.items():  # N = 2 trajectories of each prompt, each its own environment
        ok = k <= retries
        want_attempts[label] = 2 * (2 * (k + 1) if ok else retries + 1)
        steps += 2 * (2 if ok else 1)
        if not ok:
            failed["timeout" if (retries + 1) % 2 == 0 else "error"] += 2
    assert Counter(_FlakyToolEnv.attempts) == want_attempts
    assert m["rollout/env_retry_count"] == sum(want_attempts.values()) - steps
    assert m["rollout/env_steps"] == steps and m["rollout/failed_count"] == sum(failed.values())
    assert (m["rollout/env_error_count"], m["rollout/env_timeout_count"]) == (failed["error"], failed["timeout"])
    for seq, (a, b) in enumerate(pairs):
        for t in results[seq]:
            if _FlakyToolEnv.k[str(a + b)] <= retries:
                assert t.status == COMPLETED and t.reward == 1.0
            else:
                assert t.status == FAILED and t.metadata["env_error"]["turn"] == 1
                assert t.metadata["error"].endswith(" (the last of 3 attempts, rollout.env_retries=2)" if retries else
                                                    "raised ConnectionError('dropped attempt 1') at "
                                                    + site_of(_FlakyToolEnv.step))


class _PauseBuffer(run_modes.DatasetBuffer):
    """DatasetBuffer that restores at step_boundary, as PipelineServer does: each group with an aborted trajectory
    goes out again first, with all N of its trajectories (the finished ones are put again as they are)."""

    def step_boundary(self, returned, kind):
        with self.lock:
            for seq in sorted({t.seq for t in returned}, reverse=True):
                mine = [t for t in returned if t.seq == seq] + self.results.pop(seq, [])
                g = copy.copy(self.prompts[seq])
                g.partial = sorted(mine, key=lambda t: t.index)
                self.pending.appendleft(g)
        self.returned = returned
        return {}


class _SlowOnceEnv(tasks.CalcToolEnv):
    """An async calculator whose steps take 0.3 s and record every call, and whose restore records its turns."""
    calls: list = []
    restores: list = []

    def __init__(self, label, metadata):
        super().__init__(label, metadata)
        self.label = label

    async def step(self, turn_text):
        _SlowOnceEnv.calls.append((self.label, turn_text))
        await asyncio.sleep(0.3)
        return super().step(turn_text)

    async def restore(self, turns):
        _SlowOnceEnv.restores.append((self.label, turns))
        super().restore(turns)


def test_an_episode_aborted_mid_way_is_restored_without_running_its_tool_calls_again(monkeypatch):
    """Partial rollout across turns: paused (abort) while the slow tool runs and while the answers generate, every
    episode comes back with its first turn and observation; restored into a fresh environment (restore(turns)), it
    generates only its answer. Each tool call ran once, and the observations are the ones the tool gave."""
    _SlowOnceEnv.calls, _SlowOnceEnv.restores = [], []
    monkeypatch.setitem(tasks.ENVS, "test_env", _SlowOnceEnv)
    hold = {"paused": None, "resumed": False}
    server, tok = _calc_server(hold)
    hold["paused"] = asyncio.run_coroutine_threadsafe(_new_event(), server.loop).result(5)
    cfg = config.load_config(None, ["data_source.task=calc_tool", "data_source.num_prompts_per_step=2",
                                    "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2",
                                    "rollout.function=multi_turn_tool", "rollout.env=test_env",
                                    "rollout.env_max_concurrent=2", "rollout.partial=true",
                                    "rollout.sampling.max_new_tokens=24", f"rollout.servers=[{server.urls[0]}]"])
    pairs = [(2, 3), (4, 5)]
    buf = _PauseBuffer(_calc_prompts(tok, pairs), cfg.N)
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, buf, sync, tok)
    try:
        ro.start()
        wait_until(lambda: _SlowOnceEnv.calls, 30, "a tool call")
        pause = ro.pause()  # two steps run (the bound), two wait for a slot: all four finish, then abort
        assert pause["rollout/partial_aborted_count"] == 4 and not buf.done.is_set()
        ro.resume(1)
        assert buf.done.wait(30), "the restored episodes did not finish"
    finally:
        ro.stop()
        sync.close()
        server.close()
    calls = [c for c in _SlowOnceEnv.calls if c[1].startswith("calc")]
    assert sorted(calls) == sorted([(str(a + b), f"calc {a}+{b}") for a, b in pairs for _ in range(2)])
    assert len(_SlowOnceEnv.restores) == 4
    eos = tok.eos_token_id
    for seq, (a, b) in enumerate(pairs):
        turns = [[f"calc {a}+{b}", f"={a + b}\n"]]
        assert sorted(_SlowOnceEnv.restores)[2 * seq:2 * seq + 2] == [(str(a + b), turns)] * 2
        for t in buf.results[seq]:
            assert t.status == "completed" and t.reward == 1.0 and t.metadata["restored"] == 1
            assert t.metadata["env_turns"] == turns
            assert t.response_ids.tolist() == (tok.encode(f"calc {a}+{b}", add_special_tokens=False) + [eos]
                                               + tok.encode(f"={a + b}\n", add_special_tokens=False)
                                               + tok.encode(str(a + b), add_special_tokens=False) + [eos])


async def _new_event():
    return asyncio.Event()


# ---------------------------------------------------------------------------------------------------------------
# The producer against standins/engine.py serving the tiny model

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One standins/engine.py for the module (the kill-and-restart test, last, replaces its process on the same port).
    Started without --max-running-requests, as SGLang usually is: /server_info's flag is null and the limit it
    enforces (engine.DEFAULT_MAX_RUNNING) is only in internal_states."""
    model = tiny_model.make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    url, handle = engine.launch(model, num_threads=1)
    srv = {"url": url, "handle": handle, "model": model}
    yield srv
    srv["handle"].stop()


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(server["model"])


def make_cfg(url, *overrides):
    """Fully-async, B=2 groups of N=2, short responses; `overrides` are a.b=c strings on top."""
    return config.load_config(None, [
        "colocate=false", "fully_async.enable=true", "fully_async.stale_steps=1", "data_source.num_prompts_per_step=2",
        "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2", "data_source.num_prompts=64",
        "rollout.sampling.max_new_tokens=12", f"rollout.servers=[{url}]", "rollout.pause_timeout_s=60",
        *overrides])


class RecordingBuffer(buffer.Exchange):
    """A PipelineServer that remembers (copies of) what the rollout hands to step_boundary, and the keys of the
    groups dispatched and of the trajectories put."""

    def __init__(self, inner):
        self.inner, self.returned, self.dispatched, self.put_keys = inner, [], [], []

    def dispatch(self, *args, **kwargs):
        out = self.inner.dispatch(*args, **kwargs)
        self.dispatched += [g.prompt_id for g in out]
        return out

    def put(self, trajs):
        self.put_keys += [t.prompt_id + (t.index,) for t in trajs]
        return self.inner.put(trajs)

    def step_boundary(self, returned, *args):
        self.returned.append(copy.deepcopy(returned))
        return self.inner.step_boundary(returned, *args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def producer(cfg, tokenizer, state=None, ignore_eos=False):
    """A PipelineServer over the task's train prompts (resumed from the buffer `state`: its state_dict), a Fleet, a
    started Rollout; all stopped afterwards. ignore_eos=True: every request runs to max_new_tokens (SGLang's
    sampling_params.ignore_eos), so a test that pauses on requests it saw running is not raced by the tiny model's
    end token (a random model: some responses end within a few tokens of any moment)."""
    buf = RecordingBuffer(buffer.PipelineServer(cfg, [tasks.load_prompts(cfg.data_source[0], tokenizer, "train")]))
    if state is not None:
        buf.load_state_dict(state)
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, buf, sync, tokenizer)
    ro.sampling_params["ignore_eos"] = ignore_eos
    try:
        ro.start()
        yield buf, ro, sync
    finally:
        ro.stop()
        sync.close()
        buf.inner.close()


def trained_mask(g, t, cfg) -> list:
    """The loss mask the trainer's batch gives t's response tokens (batching.make_sequences of its group, then
    collate with rollout.mask_offpolicy_in_partial_rollout)."""
    seq = batching.make_sequences([g], cfg)[next(i for i, x in enumerate(g.trajectories) if x is t)]
    mask = batching.collate([seq], cfg.rollout.mask_offpolicy_in_partial_rollout)["mask"][0]
    return mask[len(t.prompt_ids) - 1:].int().tolist()


def wait_until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout} s for {what}")
        time.sleep(0.01)


def engine_load(url, headers=None):
    """(running, waiting, used KV columns) as the engine reports them in /v1/loads."""
    load = requests.get(url + "/v1/loads", headers=headers, timeout=5).json()["loads"][0]
    return load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"]


def test_groups_end_to_end_with_shapes_versions_and_the_clamp(server, tokenizer):
    cfg = make_cfg(server["url"], "rollout.async_max_concurrent_samples=100")
    info = requests.get(server["url"] + "/server_info", timeout=5).json()
    assert info["max_running_requests"] is None  # the raw flag: the clamp must read the enforced limit
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == engine.DEFAULT_MAX_RUNNING == 64
    with pytest.warns(UserWarning, match=r"\(100\) exceeds the inference fleet's concurrency \(64"):
        ctx = producer(cfg, tokenizer)
        buf, ro, sync = ctx.__enter__()
    try:
        assert ro.max_samples == 64 and ro.max_groups == 32
        assert buf.stats()["max_generating"] == 32  # the buffer enforces the clamped cap, not the configured 100 // 2
        groups = buf.get(2, timeout=60)
        pause = ro.pause()
        metrics = ro.step_metrics()
    finally:
        ctx.__exit__(None, None, None)
    eos = tokenizer.eos_token_id
    for g in groups:
        assert [t.index for t in g.trajectories] == [0, 1]
        for t in g.trajectories:
            T = len(t.response_ids)
            assert torch.equal(t.prompt_ids, g.prompt.prompt_ids) and 1 <= T <= 12
            assert t.rollout_log_probs.shape == t.versions.shape == t.loss_mask.shape == (T,)
            assert bool((t.rollout_log_probs <= 0).all()) and bool(torch.isfinite(t.rollout_log_probs).all())
            assert t.versions.tolist() == [0] * T and t.loss_mask.tolist() == [1] * T
            assert (t.start_version, t.end_version) == (0, 0)
            if t.status == "completed":
                assert t.response_ids[-1] == eos
            else:
                assert t.status == "truncated" and T == 12
            assert 0.0 <= t.reward <= 1.0 and t.metadata["attempts"] == 1
    assert pause["timing/pause_delay"] > 0 and pause["rollout/partial_aborted_count"] == 0
    assert metrics["rollout/trajectories_finished"] >= 4 and metrics["rollout/failed_count"] == 0
    assert 1 <= metrics["rollout/response_length_mean"] <= metrics["rollout/response_length_max"] <= 12
    assert metrics["rollout/max_concurrent_samples"] == 64 and metrics["rollout/generated_tokens_per_s"] > 0
    spans = [t.end_version - t.start_version for g in groups for t in g.trajectories]
    assert spans == [0] * len(spans)  # no weight update happened: no trajectory is partial


def test_partial_pause_restores_and_finishes_across_a_weight_update(server, tokenizer):
    cfg = make_cfg(server["url"], "rollout.partial=true", "rollout.mask_offpolicy_in_partial_rollout=true",
                   "rollout.sampling.max_new_tokens=400")  # long: a warm engine decodes ~1 token/ms
    with producer(cfg, tokenizer, ignore_eos=True) as (buf, ro, sync):
        # pause once some request is 8+ tokens into its response (prompts are at most 6 tokens long)
        wait_until(lambda: engine_load(server["url"])[2] >= 14, 60, "a request 8 tokens into its response")
        pause = ro.pause()
        partials = {t.prompt_id + (t.index,): t for t in buf.returned[-1]}
        assert pause["rollout/partial_aborted_count"] == len(partials) > 0
        assert pause["rollout/partial_restored_count"] > 0 and engine_load(server["url"])[:2] == (0, 0)
        assert all(t.status == "aborted" and set(t.versions.tolist()) <= {0} for t in partials.values())
        sync.update_weight_version(1)
        buf.set_weight_version(1)
        ro.resume(1)
        # Take groups until every group with a trajectory aborted mid-response is back (the restored lane is
        # dispatched first, but complete groups buffered before the pause may be handed out before it).
        wanted = {t.prompt_id for t in partials.values() if len(t.response_ids) > 0}
        assert wanted, "the pause caught no request mid-response"
        spanning, seen, deadline = [], set(), time.monotonic() + 60
        while wanted - seen:
            assert time.monotonic() < deadline, f"restored groups {sorted(wanted - seen)} did not come back in 60 s"
            for g in buf.get(1, timeout=60):
                for t in g.trajectories:
                    seen.add(t.prompt_id)
                    old = partials.get(t.prompt_id + (t.index,))
                    if old is not None and len(old.response_ids) > 0:
                        spanning.append((old, t, g))
        ro.pause()
        assert ro.step_metrics()["rollout/old_version_responses"] == 0
    assert spanning, "no trajectory aborted mid-response came back"
    for old, t, g in spanning:
        k, T = len(old.response_ids), len(t.response_ids)
        assert T > k and torch.equal(t.response_ids[:k], old.response_ids)
        assert torch.equal(t.rollout_log_probs[:k], old.rollout_log_probs)
        assert t.versions.tolist() == [0] * k + [1] * (T - k)
        assert t.loss_mask.tolist() == [1] * T  # as generated: the trainer's batch masks by version
        assert trained_mask(g, t, cfg) == [0] * k + [1] * (T - k)  # older tokens masked (the option is on)
        assert (t.start_version, t.end_version) == (0, 1) and t.metadata["restored"] == 1
        assert buffer.consumed_metrics([(t.start_version, t.end_version, 1)])["rollout/partial_span_max"] == 1


@pytest.mark.parametrize("mode,mask", [("in_place", True), ("retract", False)])
def test_kept_pause_continues_every_request_across_a_weight_update(server, tokenizer, mode, mask):
    """rollout.pause_mode retract / in_place: the boundary aborts, restores and re-sends nothing; every request of
    the groups in flight continues after a real (disk) weight update, its tokens labelled [v..v, v+1..v+1]."""
    cfg = make_cfg(server["url"], "rollout.partial=true", f"rollout.pause_mode={mode}",
                   f"rollout.mask_offpolicy_in_partial_rollout={str(mask).lower()}",
                   "rollout.sampling.max_new_tokens=400")
    wait_until(lambda: engine_load(server["url"])[:2] == (0, 0), 10, "the previous test's requests to end")
    v0 = sglang_client.parse_version(requests.get(server["url"] + "/model_info", timeout=5).json()["weight_version"],
                               "/model_info")  # earlier tests'
    with producer(cfg, tokenizer, ignore_eos=True) as (buf, ro, sync):
        wait_until(lambda: engine_load(server["url"])[2] >= 14, 60, "a request 8 tokens into its response")
        pause = ro.pause()
        kept = buf.stats(keys=True)["in_flight_keys"]
        running, waiting, used = engine_load(server["url"])
        # kept: the trajectories of the live list requests, whose unfinished items the paused servers hold (a group
        # whose request has just returned may still be on its way to the buffer, in flight there)
        assert 0 < running + waiting <= pause["rollout/partial_kept_count"] <= cfg.N * len(kept)
        assert buf.returned == [[]]
        assert pause["rollout/kept_in_flight_groups"] == len(kept) > 0 and "rollout/partial_aborted_count" not in pause
        assert (running == 0) == (mode == "retract")  # retract: the kept requests wait, their KV dropped
        time.sleep(0.3)
        assert engine_load(server["url"])[2] == used  # nothing decodes while paused
        sync.update_weights_from_disk(server["model"], v0 + 1, cfg.flush_on_update)
        buf.set_weight_version(v0 + 1)
        ro.resume(v0 + 1)
        seen = {}
        deadline = time.monotonic() + 60
        while not set(kept) <= seen.keys():
            assert time.monotonic() < deadline, f"kept groups {sorted(set(kept) - seen.keys())} never came back"
            for g in buf.get(1, timeout=60):
                seen[g.prompt.prompt_id] = g
        ro.pause()
        assert ro.step_metrics()["rollout/old_version_responses"] == 0
        consumed = buf.step_metrics()
    assert len(buf.dispatched) == len(set(buf.dispatched))  # no group was dispatched twice
    spanning = 0
    for key in kept:
        for t in seen[key].trajectories:
            T, k = len(t.response_ids), int((t.versions == v0).sum())
            assert t.metadata["attempts"] == 1 and "restored" not in t.metadata  # one request, never re-sent
            assert t.versions.tolist() == [v0] * k + [v0 + 1] * (T - k)
            assert t.loss_mask.tolist() == [1] * T  # as generated: the trainer's batch masks by version
            assert trained_mask(seen[key], t, cfg) == ([0] * k + [1] * (T - k) if mask and k < T else [1] * T)
            assert (t.start_version, t.end_version) == (v0 + (k == 0), v0 + (k < T))
            spanning += 0 < k < T
    assert spanning > 0, "no kept request was generating across the update"
    assert consumed["rollout/partial_ratio"] > 0 and consumed["rollout/partial_span_max"] == 1


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_pause_before_a_checkpoint_brings_every_request_back_and_a_resumed_run_continues_each(server, tokenizer,
                                                                                                mode):
    """rollout.pause_mode retract / in_place with a checkpoint due (Rollout.pause(checkpoint=True)): the servers keep
    nothing, and every group in flight (requests kept since an earlier boundary among them) is restored whole. The
    buffer's state, through torch.load(weights_only=True) into a new buffer and producer (a resumed run on newer
    weights), continues each trajectory from its saved tokens: its first k tokens, log-probs and versions are the
    saved ones, the rest are new tokens of the resumed weights; a finished one is trained as it was saved."""
    cfg = make_cfg(server["url"], "rollout.partial=true", f"rollout.pause_mode={mode}",
                   "rollout.sampling.max_new_tokens=1000")  # >= 0.9 s from the first pause to any end (ignore_eos)
    wait_until(lambda: engine_load(server["url"])[:2] == (0, 0), 10, "the previous test's requests to end")
    v0 = sglang_client.parse_version(requests.get(server["url"] + "/model_info", timeout=5).json()["weight_version"],
                                     "/model_info")
    with producer(cfg, tokenizer, ignore_eos=True) as (buf, ro, sync):
        wait_until(lambda: engine_load(server["url"])[2] >= 14, 60, "a request 8 tokens into its response")
        assert "rollout/kept_in_flight_groups" in ro.pause()  # a boundary without a checkpoint keeps them
        sync.update_weights_from_disk(server["model"], v0 + 1, cfg.flush_on_update)
        buf.set_weight_version(v0 + 1)
        ro.resume(v0 + 1)
        wait_until(lambda: engine_load(server["url"])[2] >= 14, 60, "a request 8 tokens into its response")
        pause = ro.pause(checkpoint=True)
        assert engine_load(server["url"])[:2] == (0, 0) and buf.stats()["R"] == 0  # nothing kept anywhere
        assert pause["rollout/partial_aborted_count"] == len(buf.returned[-1]) > 0
        f = io.BytesIO()
        torch.save(buf.state_dict(), f)
    f.seek(0)
    state = torch.load(f, weights_only=True)
    saved = {(g["epoch"], g["seq"], t["index"]): t for g in state["data"]["lane"] for t in g["partial"]}
    cut = [k for k, t in saved.items() if t["status"] == "aborted" and len(t["response_ids"]) > 0]
    assert cut, "the pause caught no request mid-response"
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    try:  # the resumed run's weights are on the servers before its producer starts (train.main)
        sync.update_weights_from_disk(server["model"], v0 + 2, cfg.flush_on_update)
    finally:
        sync.close()
    with producer(cfg, tokenizer, state) as (buf, ro, sync):
        final, deadline = {}, time.monotonic() + 60
        while not saved.keys() <= final.keys():
            assert time.monotonic() < deadline, f"saved trajectories {sorted(saved.keys() - final.keys())} never came"
            for g in buf.get(1, timeout=60):
                final.update({t.prompt_id + (t.index,): t for t in g.trajectories})
        ro.pause()
    for key, s in saved.items():
        t, k = final[key], len(s["response_ids"])
        assert torch.equal(t.response_ids[:k], s["response_ids"]) and torch.equal(t.versions[:k], s["versions"])
        assert torch.equal(t.rollout_log_probs[:k], s["rollout_log_probs"])
        if s["status"] != "aborted":  # finished before the pause: as it was
            assert len(t.response_ids) == k and t.status == s["status"]
        else:  # generated after the resume: the total minus what was saved, all of the resumed weights
            assert t.versions[k:].tolist() == [v0 + 2] * (len(t.response_ids) - k) and len(t.response_ids) > k
            assert t.metadata["restored"] == s["metadata"].get("restored", 0) + 1


# Pausing as real SGLang behaves: requests queued, registering (registered, not yet at the scheduler, where an abort
# by rid is lost) and waiting at a server's pause gate must all come back, within seconds.

KEY = "k3y"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    """The servers' key as services.py passes it: a 0600 file `api-key: KEY`, SGLang's --config form."""
    path = str(tmp_path_factory.mktemp("key") / "api_key.yaml")
    sglang_client.make_key_file(path, KEY)
    return path


@pytest.fixture(scope="module")
def strict_server(server, key_file):
    """standins/engine.py keyed by a --config file, 2 running requests and a 1 s window between registration and
    dispatch."""
    url, handle = engine.launch(server["model"], max_running_requests=2, dispatch_delay_s=1.0, config=key_file,
                                num_threads=1)
    yield url
    handle.stop()


def marks(buf):
    return len(buf.dispatched), len(buf.put_keys), len(buf.returned)


def assert_accounted(buf, since, n):
    """Every trajectory of every group dispatched since `since` was put to the buffer or handed back at the pause,
    exactly once: none lost, none twice."""
    d, p, r = since
    got = buf.put_keys[p:] + [t.prompt_id + (t.index,) for ret in buf.returned[r:] for t in ret]
    assert sorted(got) == sorted(k + (i,) for k in buf.dispatched[d:] for i in range(n))


def test_partial_pause_stops_requests_in_every_state_within_seconds(strict_server, key_file, tokenizer):
    headers = {"Authorization": f"Bearer {KEY}"}  # every Fleet call must send it, or the engine answers 401
    cfg = make_cfg(strict_server, "rollout.partial=true", "rollout.sampling.max_new_tokens=200",
                   f"rollout.sglang_args.api_key_file={key_file}")
    with producer(cfg, tokenizer, ignore_eos=True) as (buf, ro, sync):
        deadline = time.monotonic() + 60
        while True:  # consume (so that groups keep being dispatched) until all three states are seen at once
            running, waiting, _ = engine_load(strict_server, headers)
            registering = sync.fleet.requests_in_flight - running - waiting
            if running == 2 and waiting >= 1 and registering >= 1:
                break
            assert time.monotonic() < deadline, "never saw running, queued and registering requests at once"
            with contextlib.suppress(TimeoutError):
                buf.get(1, timeout=0.05)
        t0 = time.monotonic()
        pause = ro.pause()
        took = time.monotonic() - t0
        assert took < 5 and engine_load(strict_server, headers)[:2] == (0, 0), took
        assert pause["rollout/partial_aborted_count"] >= 3 and sync.fleet.requests_in_flight == 0
        assert_accounted(buf, (0, 0, 0), cfg.N)

        # A pause the producer did not ask for aborts its requests; their retries wait at the servers' pause gate
        # (registered, generating nothing). The producer's own pause gives those calls up instead of waiting.
        mark = marks(buf)
        sync.update_weight_version(1)
        buf.set_weight_version(1)
        ro.resume(1)  # continues the servers
        wait_until(lambda: engine_load(strict_server, headers)[0] == 2, 30, "requests running after resume")
        sync.pause("abort")
        wait_until(lambda: sync.fleet.requests_in_flight > 0 and engine_load(strict_server, headers)[:2] == (0, 0),
                   30, "retried requests waiting at the pause gate")
        t0 = time.monotonic()
        ro.pause()
        took = time.monotonic() - t0
        assert took < rollout.PAUSE_GRACE_S + 3 and sync.fleet.requests_in_flight == 0, took
        assert_accounted(buf, mark, cfg.N)
    # stop() continued the servers: the calls given up at their pause gate are dispatched there and run until the
    # server notices the disconnect (SGLANG_REQUEST_STATE_WAIT_TIMEOUT), then nothing is left
    wait_until(lambda: engine_load(strict_server, headers)[:2] == (0, 0), engine.REQUEST_STATE_WAIT_TIMEOUT_S + 10,
               "the given-up calls to be noticed and aborted")


@pytest.mark.parametrize("partial", [True, False])
def test_requests_parked_at_the_pause_gate_are_neither_lost_nor_trained_twice(server, tokenizer, partial):
    """Requests parked at a server's pause gate when the step boundary comes (sglang 0.5.23 tokenizer_manager.py:
    generate_request waits at the gate before dispatch; pause_generation mode abort aborts only what the scheduler
    holds): here the retries of the requests someone else's /pause_generation abort aborted. rollout.partial=true:
    Rollout.pause gives their calls up PAUSE_GRACE_S after its own pause and hands the trajectories back as they
    were; after the resume the server dispatches the given-up calls and drops them at their first output (nobody
    reads it), while the trajectories are re-sent under new rids. rollout.partial=false: the rollout pauses no
    server and waits for them; they run once the server is continued. Either way every group dispatched before the
    boundary is delivered by buffer.get exactly once, with all N trajectories finished and none failed."""
    url = server["url"]
    cfg = make_cfg(url, f"rollout.partial={str(partial).lower()}", "rollout.sampling.max_new_tokens=200")
    wait_until(lambda: engine_load(url)[:2] == (0, 0), 10, "the previous test's requests to end")
    v0 = sglang_client.parse_version(requests.get(url + "/model_info", timeout=5).json()["weight_version"],
                                     "/model_info")
    with producer(cfg, tokenizer, ignore_eos=True) as (buf, ro, sync):
        wait_until(lambda: engine_load(url)[0] > 0, 60, "requests running")
        assert requests.post(url + "/pause_generation", json={"mode": "abort"}, timeout=30).status_code == 200
        wait_until(lambda: sync.fleet.requests_in_flight > 0 and engine_load(url)[:2] == (0, 0), 30,
                   "the aborted requests' retries parked at the pause gate")
        parked = sync.fleet.requests_in_flight
        if partial:
            pause = ro.pause()
            assert sync.fleet.requests_in_flight == 0 and pause["rollout/partial_aborted_count"] >= parked
            assert all(t.status == "aborted" for t in buf.returned[-1])
        else:  # someone continues the servers within rollout.pause_timeout_s
            later = threading.Timer(1.0, requests.post, (url + "/continue_generation",), {"json": {}, "timeout": 30})
            later.start()
            ro.pause()
            later.join()
            assert buf.returned == [[]] and sync.fleet.requests_in_flight == 0
        assert_accounted(buf, (0, 0, 0), cfg.N)
        wanted = set(buf.dispatched)
        sync.update_weight_version(v0 + 1)
        buf.set_weight_version(v0 + 1)
        ro.resume(v0 + 1)  # partial: continues the servers, which dispatch the given-up calls
        delivered, deadline = Counter(), time.monotonic() + 90
        while not wanted <= delivered.keys():
            assert time.monotonic() < deadline, f"groups {sorted(wanted - delivered.keys())} never came back"
            for g in buf.get(1, timeout=60):
                delivered[g.prompt.prompt_id] += 1
                assert len(g.trajectories) == cfg.N
                assert all(t.status in (COMPLETED, TRUNCATED) for t in g.trajectories), g.prompt.prompt_id
        ro.pause()
        metrics = ro.step_metrics()
    assert max(delivered.values()) == 1, delivered
    assert metrics["rollout/failed_count"] == 0
    wait_until(lambda: engine_load(url)[:2] == (0, 0), engine.REQUEST_STATE_WAIT_TIMEOUT_S + 10,
               "the given-up calls to be noticed and dropped")


def test_a_server_of_an_unsupported_version_is_refused_at_start_up(server, tmp_path):
    assert engine.SGLANG_VERSION in sglang_client.SUPPORTED_SGLANG_VERSIONS
    url, handle = engine.launch(server["model"], report_version="0.5.2", num_threads=1)
    try:
        cfg_path = tmp_path / "standalone.yaml"
        cfg_path.write_text(f"model:\n  path: {server['model']}\n")
        with pytest.raises(sglang_client.FleetError, match=re.escape(
                f"{url} runs sglang 0.5.2: this project speaks the HTTP API of sglang 0.5.23 only")):
            workers.main(["generate", "--config", str(cfg_path), f"rollout.servers=[{url}]", "--limit", "1",
                          "--out", str(tmp_path / "out.jsonl")])
    finally:
        handle.stop()


def test_pause_without_partial_waits_for_everything_and_loses_nothing(server, tokenizer):
    cfg = make_cfg(server["url"], "rollout.sampling.max_new_tokens=24")
    with producer(cfg, tokenizer) as (buf, ro, sync):
        wait_until(lambda: buf.stats()["R"] == 4, 60, "4 groups in flight")
        consumed = buf.get(1, timeout=60)
        pause = ro.pause()
        stats, counts = buf.stats(), buf.step_metrics()
        assert buf.returned == [[]]  # nothing aborted, nothing handed back
        assert engine_load(server["url"])[:2] == (0, 0)
        assert stats["R"] == 0 and stats["lane"] == 0 and stats["Q"] == counts["rollout/dispatched_groups"] - 1
        assert counts["rollout/collected_groups"] == counts["rollout/dispatched_groups"]
        assert counts["rollout/filter_drop"] == counts["rollout/late_drop"] == 0
        assert pause["rollout/partial_restored_count"] == pause["rollout/partial_dropped_incomplete_count"] == 0
        rest = buf.get(stats["Q"], timeout=5)
    for g in consumed + rest:
        assert all(t.status in ("completed", "truncated") for t in g.trajectories)


def test_a_server_that_stops_answering_pause_fails_the_pause_naming_it_and_the_setting(server, tokenizer):
    """A server that takes /pause_generation and never answers (engine.py's test-only STANDIN_TEST_HANG) fails
    Rollout.pause within rollout.pause_timeout_s, naming that server, the endpoint and the setting. Over RPC the
    trainer waits longer than the pause's own bound (rollout.rpc_waits), so this error is the one it reports."""
    url, handle = engine.launch(server["model"], num_threads=1, env={"STANDIN_TEST_HANG": "/pause_generation"})
    try:
        cfg = make_cfg(url, "rollout.partial=true", "rollout.pause_timeout_s=2", "rollout.sampling.max_new_tokens=200")
        with producer(cfg, tokenizer) as (buf, ro, sync):
            wait_until(lambda: sync.fleet.requests_in_flight > 0, 30, "requests in flight")
            t0 = time.monotonic()
            with pytest.raises(sglang_client.FleetError) as err:
                ro.pause()
            took = time.monotonic() - t0
    finally:
        handle.stop()
    assert took < 2 + 10, took  # the pause's bound (2 s), with room for a loaded machine
    assert re.fullmatch(rf"POST {url}/pause_generation did not answer within [12]\.\d s \(the rest of "
                        r"rollout\.pause_timeout_s=2 s\)", str(err.value)), str(err.value)
    own, what = rollout.rpc_waits(cfg)["pause"]
    assert own > cfg.rollout.pause_timeout_s and what == "rollout.pause_timeout_s=2 s + 60 s"


def test_in_flight_never_exceeds_the_bound_as_the_engine_counts_it(server, tokenizer):
    cfg = make_cfg(server["url"], "rollout.async_max_concurrent_samples=5", "data_source.num_prompts_per_step=4",
                   "fully_async.stale_steps=2", "rollout.sampling.max_new_tokens=200")
    seen, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            running, waiting, _ = engine_load(server["url"])
            seen.append(running + waiting)
            time.sleep(0.005)

    with producer(cfg, tokenizer) as (buf, ro, sync):
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:  # a trainer that consumes as fast as it can, so the capacity never binds, until 4 ran at once
            deadline = time.monotonic() + 60
            while max(seen, default=0) < 4 and time.monotonic() < deadline:
                buf.get(1, timeout=60)
        finally:
            stop.set()
            poller.join(10)
        ro.pause()
        metrics = ro.step_metrics()
    # 5 samples // N=2 -> 2 groups -> at most 4 generating trajectories, though the capacity C=12 would allow more
    # reached, never exceeded (how soon all 4 run at once is luck: a group is re-dispatched only when both of its
    # trajectories ended, and the other group's may have ended one by then; short responses make it rarer)
    assert max(seen) == 4, f"engine-side in-flight counts: {sorted(set(seen))}"
    assert metrics["rollout/in_flight_trajectories_max"] == 4 and metrics["rollout/max_concurrent_samples"] == 5


def _odd_label_fails(text, label, stopped):
    if int(label) % 2:
        raise KeyError("odd")
    return len(text) + stopped


@pytest.mark.parametrize("pool", ["inline", "thread"])
def test_rewards_are_scored_per_trajectory_and_a_raising_reward_fails_only_its_own(server, tokenizer, pool):
    cfg = make_cfg(server["url"], f"rollout.reward_pool={pool}",
                   "data_source.reward=test_rollout:_odd_label_fails")
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    ro = rollout.Rollout(cfg, None, sync, tokenizer)
    try:
        for label, want in (("12", [3.0, 1.0]), ("7", None)):
            g = buffer.PromptGroup(0, 0, 0, torch.tensor([5, 6]), label=label)
            trajs = [buffer.Trajectory(0, 0, i, g.prompt_ids, torch.tensor(ids), status=status)
                     for i, (ids, status) in enumerate([(tokenizer.encode("21") + [tokenizer.eos_token_id], COMPLETED),
                                                        ([tokenizer.encode("9")[0]], TRUNCATED)])]
            sync.run(ro._score(g, trajs), 30)
            if want:
                assert [t.reward for t in trajs] == want and all(t.status != FAILED for t in trajs)
            else:
                assert all(t.status == FAILED and t.metadata["error"] == "the reward function "
                           f"test_rollout:_odd_label_fails raised KeyError('odd') at {site_of(_odd_label_fails)}"
                           for t in trajs)
    finally:
        ro.stop()
        sync.close()


def _raises_on_odd(text, label, stopped):
    """1.0 for a label that ends in an even digit; a ZeroDivisionError for one that ends in an odd digit."""
    return 1.0 / (1 - int(label[-1]) % 2)


def _always_raises(text, label, stopped):
    raise RuntimeError("the verifier is down")


def test_the_eval_counts_its_failed_prompts_scores_only_the_others_and_logs_each_first_traceback(
        server, tokenizer, tmp_path, capsys):
    """A reward raising on some eval prompts: those are counted (eval/failed_count), never averaged in as 0.0 (the
    rest all score 1.0, so any failure in the mean would lower it), one line says so naming the line that raised, and
    run_dir/logs/eval.log holds its traceback once. A reward raising on all of them: no score at all."""
    base = ["data_source.num_eval_prompts=16", "rollout.reward_pool=thread", f"run_dir={tmp_path}"]
    cfg = make_cfg(server["url"], *base, "data_source.reward=test_rollout:_raises_on_odd")
    labels = [p["label"] for p in tasks.load_prompts(cfg.data_source[0], tokenizer, "eval")]
    odd = sum(int(x[-1]) % 2 for x in labels)
    assert 0 < odd < len(labels)
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    try:
        got = run_modes.make_evaluator(cfg, sync, tokenizer)(5)
        err = capsys.readouterr().err
        site = site_of(_raises_on_odd, "1.0 /")
        assert got["eval/failed_count"] == odd
        assert got["eval/reward_mean"] == 1.0 and got["eval/exact_ratio"] == 1.0
        assert sum(r["reward"] is None for r in got["data/eval_samples"]) == odd
        line = [ln for ln in err.splitlines() if ln.startswith("[train] step 5: ")]
        assert line == [f"[train] step 5: {odd} of 16 eval prompts failed and are not scored (eval/failed_count; "
                        f"eval/reward_mean is over the other {16 - odd}); the first: the reward function "
                        f"test_rollout:_raises_on_odd raised ZeroDivisionError('float division by zero') at {site}; "
                        f"the first traceback of each distinct failure is in {tmp_path}/logs/eval.log"], err
        text = (tmp_path / "logs" / "eval.log").read_text()
        assert text.count("Traceback (most recent call last)") == 1
        assert f"the first failure of the reward function test_rollout:_raises_on_odd, raised at {site} (its " \
               "traceback; not logged again):\nTraceback (most recent call last):\n" in text
        assert "ZeroDivisionError: float division by zero" in text and "return 1.0 / (1 - int(label[-1]) % 2)" in text
        logger_lib.Logger(cfg, tokenizer=tokenizer).log(5, dict(got))  # the step line: the score, the failures beside
        assert f" | eval 1.000 ({odd} failed) | " in capsys.readouterr().out
        rows = [json.loads(x) for x in (tmp_path / "samples" / "step_000005.jsonl").read_text().splitlines()]
        assert len(rows) == 16 and sum(r["reward"] is None for r in rows) == odd

        cfg = make_cfg(server["url"], *base, "data_source.reward=test_rollout:_always_raises")
        got = run_modes.make_evaluator(cfg, sync, tokenizer)(0)
        err = capsys.readouterr().err
        assert got["eval/failed_count"] == 16 and "eval/reward_mean" not in got and "eval/exact_ratio" not in got
        assert [ln for ln in err.splitlines() if ln.startswith("[train] step 0: ")] == [
            "[train] step 0: all 16 eval prompts failed, so there is no eval score; the first: the reward function "
            f"test_rollout:_always_raises raised RuntimeError('the verifier is down') at {site_of(_always_raises)}; "
            f"the first traceback of each distinct failure is in {tmp_path}/logs/eval.log"], err
        assert (tmp_path / "logs" / "eval.log").read_text().count("Traceback (most recent call last)") == 2
    finally:
        sync.close()


async def _raising_rollout_fn(ctx, trajs):
    await ctx.generate_batch(trajs)
    raise ValueError(f"cannot parse {len(trajs)} responses")


def test_a_rollout_function_that_raises_fails_its_trajectories_naming_the_line_and_logs_its_traceback_once(
        server, tokenizer, caplog):
    cfg = make_cfg(server["url"], "rollout.function=test_rollout:_raising_rollout_fn", "rollout.env_step_timeout_s=5")
    prompts = tasks.load_prompts(cfg.data_source[0], tokenizer, "eval")[:3]
    sync = sglang_client.SyncFleet(sglang_client.Fleet.from_config(cfg))
    try:
        with caplog.at_level("WARNING", logger="rollout"):
            buf, summary = run_modes.generate_dataset(cfg, prompts, sync, tokenizer, 60.0)
    finally:
        sync.close()
    site = site_of(_raising_rollout_fn)
    trajs = [t for ts in buf.results.values() for t in ts]
    assert summary["failed"] == len(trajs) == 6 and summary["reward_mean"] is None and summary["pass_rate"] is None
    assert all(t.status == FAILED and t.metadata["error"] == "the rollout function test_rollout:_raising_rollout_fn "
               f"raised ValueError('cannot parse 2 responses') at {site}" for t in trajs)
    tracebacks = [r.getMessage() for r in caplog.records if "Traceback (most recent call last)" in r.getMessage()]
    assert len(tracebacks) == 1 and tracebacks[0].startswith(
        f"the first failure of the rollout function test_rollout:_raising_rollout_fn, raised at {site} ")
    assert tracebacks[0].endswith("ValueError: cannot parse 2 responses")


def test_stuck_request_is_aborted_at_the_timeout_and_counted(server, tokenizer):
    # A capacity of 62 groups keeps the producer dispatching (4 trajectories at a time) for seconds, so the engine
    # runs 4 requests most of that time; with the default capacity of 4 groups it could stop before the poll saw 4.
    cfg = make_cfg(server["url"], "rollout.async_max_concurrent_samples=4", "rollout.trajectory_timeout_s=1.5",
                   "rollout.sampling.max_new_tokens=64", "fully_async.stale_steps=30")
    with producer(cfg, tokenizer) as (buf, ro, sync):
        # Every trajectory the producer hands the buffer failed by its timeout: on a loaded machine requests that
        # were never stuck can time out too (64 tokens past 1.5 s), and each of those is counted as well.
        timed_out, put = [], buf.put
        buf.put = lambda trajs: (timed_out.extend((*t.prompt_id, t.index) for t in trajs if "trajectory_timeout_s"
                                                  in t.metadata.get("error", "")), put(trajs))[1]
        # The engine keeps paused requests but stops decoding them: they are stuck. A request can finish between
        # the poll and the pause; then this pause caught fewer than 4, so it is continued (within milliseconds, far
        # below the timeout) and taken again. With 4 caught nothing else can start: the cap is 4 samples.
        for _ in range(50):
            wait_until(lambda: engine_load(server["url"])[0] == 4, 60, "4 requests running in the engine")
            sync.pause("in_place")
            if engine_load(server["url"])[0] == 4:
                break
            sync.continue_()
        else:
            pytest.fail("no in_place pause caught 4 running requests in 50 tries")
        try:  # the timeouts abort them; a server paused in place answers those aborts only after continue
            wait_until(lambda: sum(len(a.trajs) for a in list(ro._active.values()) if a.timed_out) == 4, 30,
                       "the trajectory timeouts of the 4 stuck requests")
            stuck = {(*t.prompt_id, t.index) for a in list(ro._active.values()) if a.timed_out for t in a.trajs}
            assert engine_load(server["url"])[0] == 4
        finally:
            sync.continue_()
        wait_until(lambda: engine_load(server["url"])[:2] == (0, 0), 30, "the aborted requests to end at continue")
        groups = buf.get(2, timeout=60)  # and production goes on
        ro.pause()
        metrics, counts = ro.step_metrics(), buf.step_metrics()
    assert len(stuck) == 4 and stuck <= set(timed_out)  # the stuck ones failed by their timeout
    assert metrics["rollout/timeout_count"] == len(timed_out) == len(set(timed_out))  # each counted once
    assert metrics["rollout/failed_count"] >= len(timed_out)
    assert counts["rollout/filter_drop"] >= 2  # their groups were failed and filtered out, not trained on
    assert all(t.status != "failed" for g in groups for t in g.trajectories)


def test_standalone_generation_writes_jsonl_and_a_summary(server, tmp_path, capsys):
    cfg_path = tmp_path / "standalone.yaml"
    cfg_path.write_text(f"model:\n  path: {server['model']}\n")
    out = tmp_path / "out.jsonl"
    workers.main(["generate", "--config", str(cfg_path), f"rollout.servers=[{server['url']}]",
                  "data_source.num_trajectories_per_prompt=2", "trainer.mini_batch_size=2",
                  "rollout.sampling.max_new_tokens=8", "--limit", "3", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["data_index"], r["index"]) for r in rows] == [(i, j) for i in range(3) for j in range(2)]
    assert all(r["status"] in ("completed", "truncated") and 1 <= r["response_length"] <= 8 for r in rows)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rollout_summary"]
    assert summary["prompts"] == 3 and summary["trajectories"] == 6 and summary["failed"] == 0
    assert summary["max_concurrent_samples"] == 64  # unset: the engine's enforced max_running_requests


def test_server_killed_and_restarted_mid_run_loses_no_group(server, tokenizer):
    """Runs last: it replaces the module's engine process (same port, same URL)."""
    # Capacity 62 groups: the producer is still dispatching when the server stops (with 4 it could have filled
    # the buffer and sent nothing while the server was gone, so no request would see it down).
    cfg = make_cfg(server["url"], "rollout.retry_backoff_s=0.5", "rollout.max_retries=8",
                   "rollout.sampling.max_new_tokens=24", "fully_async.stale_steps=30")
    port = int(server["url"].rsplit(":", 1)[1])
    with producer(cfg, tokenizer) as (buf, ro, sync):
        sync.update_weight_version(1)
        ro.resume(1)  # the restarted server will come back with its initial weights, version 0
        wait_until(lambda: engine_load(server["url"])[0] >= 2, 60, "requests running in the engine")
        server["handle"].stop()
        server["url"], server["handle"] = engine.launch(server["model"], port=port, num_threads=1)
        got = [g for _ in range(4) for g in buf.get(1, timeout=120)]
        ro.pause()
        metrics, counts = ro.step_metrics(), buf.step_metrics()
        stats = buf.stats()
    # the dead server left the rotation (not a retry) and came back; nothing failed
    assert metrics["rollout/server_down_count"] >= 1 and metrics["rollout/failed_count"] == 0
    assert metrics["rollout/old_version_responses"] > 0  # the restarted server missed the update: counted, warned
    assert counts["rollout/collected_groups"] == counts["rollout/dispatched_groups"] == len(got) + stats["Q"]
    assert counts["rollout/filter_drop"] == 0 and stats["R"] == 0
    assert all(t.status in ("completed", "truncated") for g in got for t in g.trajectories)
