"""bench/sim_server.py: a simulated SGLang fleet whose requests progress by a latency model on a compressed clock.

Each replica is an aiohttp app on its own port that speaks the subset of SGLang's API (docs/sglang.md) the project uses
(/generate with input_ids, rid, sampling_params, return_logprob, also as a batch of lists; /abort_request by rid prefix; /pause_generation;
/continue_generation; /flush_cache; /update_weights_from_disk, /update_weights_from_distributed,
/update_weight_version; /release_memory_occupation, /resume_memory_occupation; /server_info, /model_info,
/health, /v1/loads) plus GET /sim_stats (counters for the benchmark's per-phase breakdown).

The model (docs/results/pipeline_sim.md, the default `Workload` below): a request's response length is drawn
deterministically from the seed, its prompt ids, its epoch and its trajectory index (read from the rid
`{tag}-{epoch}-{seq}-{index}-{attempt}.`), so every configuration of the benchmark sees the same lengths and a
restored request continues towards the same target. A replica running c requests decodes each at
v(c) = v0 / (1 + c / c_half) tokens/s of simulated time; at most `max_running` run, the rest wait in FIFO order.
Time is simulated time = wall time x `compression`.

Simplifications (a model, not a measurement): prefill and prefix caching cost nothing; a replica of g GPUs where
the workload's replica has G has the same single-stream speed v0 and g/G of its c_half and max_running (so g/G of
its throughput); one output token stands for `token_scale` model tokens (lengths are rounded to whole units) so the
real code moves fewer, larger tokens; pause mode `retract` requeues the running requests at the head of the queue
(their recompute is free, as prefill is) and `in_place` freezes them in their slots; the served token ids are a
filler token (then eos when the response stops) with log-prob -1.

Run (prints one line `READY {"urls": [...]}` once listening; Ctrl-C stops):
    python bench/sim_server.py --replica-gpus 4 4 --compression 100 --token-scale 32
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import heapq
import json
import math
import random
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Optional

from aiohttp import web


@dataclass
class Workload:
    """The latency model. Defaults: the workload model of docs/results/pipeline_sim.md (calibrated to the spec)."""
    seed: int = 0  # seed of the response-length draws
    median_tokens: float = 3500.0  # median of the per-group median response length
    group_sigma: float = 0.6  # log-normal sigma of the group median (prompt hardness)
    traj_sigma: float = 0.45  # log-normal sigma of a trajectory around its group median
    min_tokens: int = 16  # shortest response
    max_new_tokens: int = 20480  # longest response; a clamped one finishes with finish_reason length
    prompt_tokens: int = 200  # prompt length in model tokens (prefill is free in this model)
    replica_gpus: int = 4  # GPUs of the replica the decode curve describes (TP=4)
    v0: float = 95.0  # tokens/s of one request running alone
    c_half: float = 96.0  # v(c) = v0 / (1 + c / c_half)
    max_running: int = 256  # running requests per replica; the rest wait in its queue
    train_tokens_per_s_per_gpu: float = 760.0  # training throughput, response tokens per second per GPU
    update_weights_s: float = 10.0  # weight update after each step
    release_s: float = 8.0  # colocate: engine memory release before training
    resume_s: float = 8.0  # colocate: engine memory resume after training
    num_prompts_per_step: int = 64  # B
    num_trajectories_per_prompt: int = 8  # N
    mini_batch_size: int = 128  # M

    def replica_capacity(self, gpus: int) -> tuple[float, int]:
        """(c_half, max_running) of a replica with `gpus` GPUs: both scale with gpus / replica_gpus."""
        f = gpus / self.replica_gpus
        return self.c_half * f, max(1, int(round(self.max_running * f)))

    def replica_peak_tokens_per_s(self, gpus: int) -> float:
        c_half, cap = self.replica_capacity(gpus)
        return cap * self.v0 / (1 + cap / c_half)

    def response_length(self, prompt_key: str, epoch: int, index: int) -> tuple[int, bool]:
        """(length in model tokens, clamped at max_new_tokens) of trajectory `index` of a prompt: deterministic."""
        g = random.Random(_stable_seed(self.seed, prompt_key, epoch))
        median = math.exp(g.gauss(math.log(self.median_tokens), self.group_sigma))
        t = random.Random(_stable_seed(self.seed, prompt_key, epoch, index))
        length = math.exp(t.gauss(math.log(median), self.traj_sigma))
        if length >= self.max_new_tokens:
            return self.max_new_tokens, True
        return max(self.min_tokens, int(length)), False


def _stable_seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest(), "little")


def load_workload(path: Optional[str]) -> Workload:
    """The default workload, or a YAML file with any of Workload's fields (unknown keys are an error)."""
    if path is None:
        return Workload()
    import yaml
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    names = {f.name for f in dataclasses.fields(Workload)}
    for k in data:
        if k not in names:
            raise ValueError(f"workload key '{k}' in {path} is unknown; accepted: {', '.join(sorted(names))}")
    return Workload(**data)


SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "min_new_tokens", "n",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "sampling_seed", "logit_bias", "json_schema",
    "regex", "ebnf", "stop_regex", "custom_params", "stream_interval", "structural_tag",
}


def parse_rid(rid: str) -> tuple[int, int]:
    """(epoch, index) from a rid `{tag}-{epoch}-{seq}-{index}-{attempt}.`; (0, hash) for any other rid."""
    parts = rid.rstrip(".").split("-")
    if len(parts) >= 5 and all(p.isdigit() for p in parts[-4:]):
        return int(parts[-4]), int(parts[-2])
    return 0, _stable_seed(rid) % 1_000_000


class Request:
    __slots__ = ("rid", "need", "finish", "start_p", "finish_p", "future", "spans", "done_units", "state", "t0",
                 "retractions")

    def __init__(self, rid: str, need: int, finish: dict, version: int):
        self.rid, self.need, self.finish = rid, need, finish
        self.start_p = self.finish_p = 0.0
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.spans = [[version, 0]]  # [version, first output unit] per weight version seen
        self.done_units = 0  # units generated before the request was (re)admitted (after an in-place pause)
        self.state = "waiting"
        self.t0 = time.monotonic()
        self.retractions = 0


class Replica:
    """One inference server: running set + FIFO queue, progressing at v(c) per request on the compressed clock.

    All running requests advance at the same rate, so one "progress" counter P (units per request since start)
    and a heap of finishing points make each event O(log n) instead of O(running).
    """

    def __init__(self, wl: Workload, gpus: int, compression: float, token_scale: int, eos_id: int, filler_id: int):
        self.wl, self.gpus, self.k, self.scale = wl, gpus, compression, token_scale
        self.c_half, self.max_running = wl.replica_capacity(gpus)
        self.eos_id, self.filler_id = eos_id, filler_id
        self.version = 0
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.running: dict[str, Request] = {}
        self.heap: list = []  # (finish_p, seq, rid)
        self.waiting: list[Request] = []
        self.p = 0.0
        self.t_last = self.now()
        self.timer: Optional[asyncio.TimerHandle] = None
        self.n_seq = 0
        # counters for /sim_stats (simulated seconds, model tokens)
        self.stats = {"generated_tokens": 0.0, "running_integral": 0.0, "busy_s": 0.0, "at_cap_s": 0.0,
                      "waiting_integral": 0.0, "completed": 0, "aborted": 0, "requests": 0}

    def now(self) -> float:
        return time.monotonic() * self.k

    def rate(self) -> float:
        """Units per simulated second per running request (0 while paused)."""
        c = len(self.running)
        if c == 0 or self.paused:
            return 0.0
        return self.wl.v0 / (1 + c / self.c_half) / self.scale

    def advance(self) -> None:
        t = self.now()
        dt = max(0.0, t - self.t_last)
        c, r = len(self.running), self.rate()
        self.p += r * dt
        s = self.stats
        s["generated_tokens"] += r * dt * c * self.scale
        s["running_integral"] += c * dt
        s["waiting_integral"] += len(self.waiting) * dt
        if c and r:
            s["busy_s"] += dt
            if c >= self.max_running:
                s["at_cap_s"] += dt
        self.t_last = t

    def progress(self, req: Request) -> int:
        if req.state != "running":
            return req.done_units
        return min(req.need, req.done_units + int(self.p - req.start_p + 1e-9))

    def schedule(self) -> None:
        """Finish what is due, admit from the queue, and arm the timer for the next finish."""
        while self.heap and self.heap[0][0] <= self.p + 1e-9:
            _, _, rid = heapq.heappop(self.heap)
            req = self.running.get(rid)
            if req is not None and req.state == "running" and req.finish_p <= self.p + 1e-9:
                self._finish(req, req.finish)
        while self.waiting and len(self.running) < self.max_running and not self.paused:
            req = self.waiting.pop(0)
            req.state = "running"
            req.start_p = self.p
            req.finish_p = self.p + (req.need - req.done_units)
            self.running[req.rid] = req
            self.n_seq += 1
            heapq.heappush(self.heap, (req.finish_p, self.n_seq, req.rid))
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        r = self.rate()
        if self.heap and r > 0:
            dt_wall = max(0.0, (self.heap[0][0] - self.p) / r / self.k)
            self.timer = asyncio.get_running_loop().call_later(dt_wall, self.tick)

    def tick(self) -> None:
        self.timer = None
        self.advance()
        self.schedule()

    def submit(self, req: Request) -> None:
        self.advance()
        self.stats["requests"] += 1
        self.waiting.append(req)
        self.schedule()

    def _finish(self, req: Request, finish: dict) -> None:
        n = self.progress(req)
        self.running.pop(req.rid, None)
        req.state = "done"
        if not req.future.done():
            req.future.set_result((n, finish))

    def abort(self, prefix: str, abort_all: bool = False) -> int:
        self.advance()
        n = 0
        for req in list(self.running.values()):
            if abort_all or req.rid.startswith(prefix):
                self._finish(req, {"type": "abort", "message": "Abort before finishing", "status_code": None,
                                   "err_type": None})
                self.stats["aborted"] += 1
                n += 1
        keep = []
        for req in self.waiting:
            if abort_all or req.rid.startswith(prefix):
                req.state = "done"
                if not req.future.done():
                    req.future.set_result((req.done_units, {"type": "abort", "message": "Abort in waiting queue",
                                                            "status_code": None, "err_type": None}))
                self.stats["aborted"] += 1
                n += 1
            else:
                keep.append(req)
        self.waiting = keep
        self.schedule()
        return n

    def pause(self, mode: str) -> None:
        """SGLang's pause modes: abort returns everything; in_place freezes the running requests where they are
        (they keep their slots); retract puts them back at the head of the queue (their KV would be recomputed:
        free in this model, as prefill is)."""
        self.advance()
        if mode == "abort":
            self.abort("", abort_all=True)
        for req in self.running.values():
            req.done_units = self.progress(req)
            req.state = "frozen"
        if mode == "retract":
            for req in self.running.values():
                req.state = "waiting"
                req.retractions += 1
            self.waiting[:0] = list(self.running.values())
            self.running.clear()
            self.heap.clear()
        self.paused = True
        self.resumed.clear()
        self.schedule()

    def unpause(self) -> None:
        self.advance()
        if self.paused:
            self.paused = False
            for req in self.running.values():
                if req.state == "frozen":
                    req.state = "running"
                    req.start_p = self.p
                    req.finish_p = self.p + (req.need - req.done_units)
                    self.n_seq += 1
                    heapq.heappush(self.heap, (req.finish_p, self.n_seq, req.rid))
        self.resumed.set()
        self.schedule()

    def flush_cache(self) -> bool:
        """Refused while requests run, or wait while not paused (SGLang: is_fully_idle(ignore_waiting=paused))."""
        return not self.running and (self.paused or not self.waiting)

    def set_version(self, v: int) -> None:
        """New weights: requests still running from here on generate with version v (recorded as a new span)."""
        self.advance()
        self.version = v
        for req in list(self.running.values()) + self.waiting:
            at = self.progress(req)
            if req.spans[-1][1] == at:
                req.spans[-1][0] = v
            else:
                req.spans.append([v, at])

    async def sleep_sim(self, seconds: float) -> None:
        await asyncio.sleep(seconds / self.k)


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def make_app(rep: Replica, wait_timeout_s: float) -> web.Application:
    wl, scale = rep.wl, rep.scale
    prompt_units = max(1, round(wl.prompt_tokens / scale))
    max_units = wl.max_new_tokens // scale

    async def generate(request: web.Request) -> web.Response:
        """One prompt, or a batch as 0.5.23 takes it (input_ids a list of lists, rid a list of unique strings,
        sampling_params one dict or one per item): one list in input order once every item finished."""
        body = await _body(request)
        ids = body.get("input_ids")
        if not isinstance(ids, list):
            return _bad("the simulated server needs `input_ids` (a list of token ids, or a list of them)")
        if body.get("stream"):
            return _bad("the simulated server does not stream; send stream=false")
        if not (ids and isinstance(ids[0], list)):
            return await one(body)
        rids, sps = body.get("rid"), body.get("sampling_params")
        if isinstance(rids, str):  # SGLang's GenerateReqInput: a string rid names the items rid_0, rid_1, ...
            rids = [f"{rids}_{i}" for i in range(len(ids))]
        if not (isinstance(rids, list) and len(rids) == len(set(rids)) == len(ids)):
            return _bad(f"field `rid` must hold {len(ids)} unique strings, one per item of the batch")
        if isinstance(sps, list) and len(sps) != len(ids):
            return _bad(f"field `sampling_params` holds {len(sps)} values for a batch of {len(ids)}")
        items = [{**body, "input_ids": x, "rid": rid, "sampling_params": sps[i] if isinstance(sps, list) else sps}
                 for i, (x, rid) in enumerate(zip(ids, rids))]
        outs = await asyncio.gather(*[one(it) for it in items])
        bad = next((o for o in outs if o.status != 200), None)
        return bad or web.json_response([json.loads(o.body) for o in outs])

    async def one(body: dict) -> web.Response:
        ids = body["input_ids"]
        sp = body.get("sampling_params") or {}
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:
            return _bad(f"unknown field `{unknown[0]}`, expected one of {', '.join(sorted(SAMPLING_KEYS))}")
        try:
            await asyncio.wait_for(rep.resumed.wait(), wait_timeout_s)
        except asyncio.TimeoutError:
            return _bad(f"paused for more than {wait_timeout_s} s without /continue_generation", 503)
        rid = str(body.get("rid") or uuid.uuid4().hex)
        epoch, index = parse_rid(rid)
        length, clamped = wl.response_length(",".join(map(str, ids[:prompt_units])), epoch, index)
        target = min(max_units, max(1, round(length / scale)))
        already = max(0, len(ids) - prompt_units)
        max_new = int(sp.get("max_new_tokens", 128))
        need = max(1, target - already)
        finish = {"type": "length", "length": target} if clamped else {"type": "stop", "matched": rep.eos_id}
        if need > max_new:
            need, finish = max(0, max_new), {"type": "length", "length": max_new}
        req = Request(rid, need, finish, rep.version)
        if need == 0:
            n = 0
        else:
            rep.submit(req)
            n, finish = await req.future
        if finish["type"] != "abort":
            rep.stats["completed"] += 1
        out = [rep.filler_id] * n
        if n and finish["type"] == "stop":
            out[-1] = rep.eos_id
        spans = [s for s in req.spans if s[1] < n] or [req.spans[0]]
        wv = [{"version": str(v), "start": s, "end": (spans[i + 1][1] if i + 1 < len(spans) else n)}
              for i, (v, s) in enumerate(spans)]
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": n,
                "cached_tokens": 0, "weight_version": wv[-1]["version"], "num_retractions": req.retractions,
                "e2e_latency": (time.monotonic() - req.t0) * rep.k, "weight_versions": wv}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-1.0, t, None] for t in out]
            meta["input_token_logprobs"] = []
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def abort_request(request: web.Request) -> web.Response:
        body = await _body(request)
        rep.abort(str(body.get("rid", "")), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def pause_generation(request: web.Request) -> web.Response:
        body = await _body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _bad(f"pause_generation mode must be abort, retract or in_place, got {mode!r}")
        rep.pause(mode)
        return web.json_response({"message": "Generation paused.", "status": "ok"})

    async def continue_generation(request: web.Request) -> web.Response:
        rep.unpause()
        return web.json_response({"message": "Generation continued.", "status": "ok"})

    async def flush_cache(request: web.Request) -> web.Response:
        if not rep.flush_cache():
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.")
        return web.Response(status=200, text="Cache flushed.")

    async def _update(body: dict, version_key: str, cost_s: float) -> web.Response:
        if body.get("abort_all_requests"):
            rep.abort("", abort_all=True)
        await rep.sleep_sim(cost_s)
        v = body.get(version_key)
        if v is not None:
            rep.set_version(int(v))
        if body.get("flush_cache", True) and not rep.flush_cache():  # SGLang fails the update then
            return web.json_response({"success": False, "message": "Weights were updated, but the cache was not "
                                      "flushed because requests are still running or queued.",
                                      "num_paused_requests": 0}, status=400)
        return web.json_response({"success": True, "message": "Succeeded in updating weights (simulated).",
                                  "num_paused_requests": 0, "new_version": str(rep.version)})

    async def update_from_disk(request: web.Request) -> web.Response:
        body = await _body(request)
        if "model_path" not in body:
            return _bad("update_weights_from_disk needs `model_path`")
        return await _update(body, "weight_version", wl.update_weights_s)

    async def update_from_distributed(request: web.Request) -> web.Response:
        return await _update(await _body(request), "weight_version", wl.update_weights_s)

    async def init_group(request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": "simulated: no process group is created"})

    async def update_version(request: web.Request) -> web.Response:
        body = await _body(request)
        if "new_version" not in body:
            return _bad("update_weight_version needs `new_version`")
        if body.get("abort_all_requests", True):
            rep.abort("", abort_all=True)
        rep.set_version(int(body["new_version"]))
        return web.json_response({"success": True, "message": "ok", "new_version": str(rep.version)})

    async def release(request: web.Request) -> web.Response:
        await rep.sleep_sim(wl.release_s)
        return web.json_response({"success": True, "message": "released (simulated)"})

    async def resume(request: web.Request) -> web.Response:
        await rep.sleep_sim(wl.resume_s)
        return web.json_response({"success": True, "message": "resumed (simulated)"})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "sim", "max_running_requests": rep.max_running,
                                  "tp_size": rep.gpus, "weight_version": "default",  # the launch value, as SGLang
                                  "simulated": {"compression": rep.k, "token_scale": scale,
                                                "workload": dataclasses.asdict(wl)}})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "sim", "tokenizer_path": None, "is_generation": True,
                                  "weight_version": str(rep.version)})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def loads(request: web.Request) -> web.Response:
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": len(rep.running),
                                             "num_waiting_reqs": len(rep.waiting)}]})

    async def sim_stats(request: web.Request) -> web.Response:
        rep.advance()
        return web.json_response({**rep.stats, "now_s": rep.now(), "running": len(rep.running),
                                  "waiting": len(rep.waiting), "version": rep.version,
                                  "peak_tokens_per_s": wl.replica_peak_tokens_per_s(rep.gpus),
                                  "max_running": rep.max_running})

    app = web.Application(client_max_size=256 * 1024 ** 2)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/update_weights_from_disk", update_from_disk)
    app.router.add_post("/update_weights_from_distributed", update_from_distributed)
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/destroy_weights_update_group", init_group)
    app.router.add_post("/update_weight_version", update_version)
    app.router.add_post("/release_memory_occupation", release)
    app.router.add_post("/resume_memory_occupation", resume)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, health)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/sim_stats", sim_stats)
    return app


async def serve(wl: Workload, replica_gpus: list[int], compression: float, token_scale: int, eos_id: int,
                filler_id: int, host: str = "127.0.0.1", wait_timeout_s: float = 600.0) -> None:
    if wl.max_new_tokens % token_scale:
        raise ValueError(f"--token-scale ({token_scale}) must divide the workload's max_new_tokens "
                         f"({wl.max_new_tokens})")
    urls = []
    for gpus in replica_gpus:
        rep = Replica(wl, gpus, compression, token_scale, eos_id, filler_id)
        runner = web.AppRunner(make_app(rep, wait_timeout_s), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        urls.append(f"http://{host}:{port}")
    print("READY " + json.dumps({"urls": urls}), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replica-gpus", type=int, nargs="+", default=[4, 4], help="GPUs of each replica")
    ap.add_argument("--compression", type=float, default=100.0, help="simulated seconds per wall second")
    ap.add_argument("--token-scale", type=int, default=32, help="model tokens per served token")
    ap.add_argument("--workload", default=None, help="YAML file of Workload fields (default: the spec workload)")
    ap.add_argument("--eos-id", type=int, default=1, help="token id that ends a stopped response")
    ap.add_argument("--filler-id", type=int, default=20, help="token id of every other response token")
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args()
    try:
        asyncio.run(serve(load_workload(args.workload), args.replica_gpus, args.compression, args.token_scale,
                          args.eos_id, args.filler_id, args.host))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
