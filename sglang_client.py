"""sglang_client.py: an asyncio HTTP client of SGLang-compatible inference servers, and a blocking wrapper of it.

Imports only the standard library, aiohttp and orjson, so it copies into another project alone.

- `Fleet`: one asyncio HTTP client for the inference fleet, either a list of server URLs or an sglang-router URL
  (its workers are listed with GET /workers). `/generate` goes to the least-loaded server (or to the router), with
  retries and exponential backoff on connection errors and 5xx. Control calls (abort, pause/continue, flush, weight
  updates, memory release) fan out to every worker, because a router forwards none of them. Every call carries
  `Authorization: Bearer <key>` when the servers have a key (`api_key_file`, read_key_file). At start-up
  `wait_healthy` also checks each server's sglang version (SUPPORTED_SGLANG_VERSIONS). Aborts to a worker that does
  not answer back off (doubling) and are reported once per server per pause, with their count. A server that cannot
  be reached leaves the /generate rotation until its /health answers again.
- `SyncFleet`: a Fleet on its own event-loop thread, so that synchronous code (the trainer, the weight sync, tests)
  calls it too: each coroutine method of Fleet is a blocking method of the same name there (`run` for any
  coroutine, `submit` to start a call without waiting). The rollout producer runs its coroutines on that same loop.
- `parse_generate_response`: a /generate reply as token ids, log-probs, per-token weight versions and finish type.
- `make_key_file` / `read_key_file`: the servers' api key, in a 0600 file of SGLang's --config form.

Weight versions are ints ("default", SGLang's until the first update, is 0); a response's `weight_versions` spans
(end-exclusive) give each token's version.

    fleet = SyncFleet(Fleet(["http://127.0.0.1:31000"]))
    fleet.wait_healthy(60)
    out = fleet.generate({"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {"max_new_tokens": 4}})
    print(parse_generate_response(out).ids)
    fleet.close()
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import json
import logging
import math
import os
import random
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import aiohttp
import orjson

log = logging.getLogger("sglang_client")

CONNECT_TIMEOUT_S = 10.0  # TCP connect timeout of every HTTP call (a dead server is a retry, not a long wait)
MAX_BACKOFF_S = 30.0  # cap of the doubling /generate retry delay
PROBE_MAX_S = 2.0  # cap of the doubling /health probe delay of a server out of rotation (how soon it is back)
FINISH_TYPES = ("stop", "length", "abort")  # finish_reason types of a /generate item
JSON_HEADERS = {"Content-Type": "application/json"}  # of a body sent as orjson bytes
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)  # /server_info "version" of the servers whose HTTP API this file speaks
# The model runners every weight update with a `selector` goes to (0.5.23 managers/io_struct.py, default "all";
# managers/scheduler_components/weight_updater.py _select_runners): the target model only. A speculative draft model's
# weights are not the policy's, so it receives nothing; with "all" a custom weight loader runs once per runner.
WEIGHT_SELECTOR = "target"


# ---------------------------------------------------------------------------------------------------------------
# Responses

@dataclass
class Generation:
    """One /generate response, parsed: the new tokens with their log-probs and weight versions."""
    ids: list[int]
    log_probs: list[float]
    versions: list[int]
    finish: str  # stop | length | abort
    finish_reason: dict  # the server's finish_reason, as sent


def parse_version(value: Any, where: str) -> int:
    """A server's weight_version string as an int (this project's versions are str(int), the first weights 0).
    "default", SGLang's --weight-version until an update sets one (server args), is the launch checkpoint: 0."""
    if value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} weight_version {value!r} is not an integer (nor 'default'); this project's "
                         "servers report str(int) versions (--weight-version N, weight_version in updates)") from None


def parse_generate_response(out: dict) -> Generation:
    """Token ids, log-probs, per-token versions (from the `weight_versions` spans) and finish type of a response."""
    meta = out.get("meta_info") or {}
    ids = list(out.get("output_ids") or [])
    lps = meta.get("output_token_logprobs") or []
    if len(lps) != len(ids):
        raise ValueError(f"/generate response {meta.get('id')} has {len(ids)} output_ids but {len(lps)} "
                         "output_token_logprobs; send return_logprob=true")
    for (lp, tok, *_), i in zip(lps, ids):
        if tok != i:
            raise ValueError(f"/generate response {meta.get('id')}: output_token_logprobs token {tok} != output id {i}")
    rid = meta.get("id")
    versions = [parse_version(meta.get("weight_version"), f"/generate response {rid}")] * len(ids)
    for span in meta.get("weight_versions") or []:  # spans over output token indices, end exclusive
        v = parse_version(span["version"], f"/generate response {rid} span")
        start, end = max(0, int(span["start"])), min(len(ids), int(span["end"]))
        versions[start:end] = [v] * max(0, end - start)
    reason = meta.get("finish_reason") or {}
    finish = reason.get("type") if isinstance(reason, dict) else str(reason)
    if finish not in FINISH_TYPES:
        raise ValueError(f"/generate response {rid} has finish_reason {reason!r}; expected type stop, length or abort")
    return Generation(ids, [float(lp[0]) for lp in lps], versions, finish, reason)


# ---------------------------------------------------------------------------------------------------------------
# The fleet client

KEY_FILE_SETTING = "rollout.sglang_args.api_key_file"


def read_key_file(path: str) -> str:
    """The api key in `path`: SGLang's --config form, one line `api-key: KEY` (server_args.py prepare_server_args ->
    utils/server_args_config_parser.py ConfigArgumentMerger, which turns it into --api-key KEY inside the server,
    off its command line). Refused when the file is open to group or others (it must be mode 0600 or stricter)."""
    try:
        mode = os.stat(path).st_mode & 0o777
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{KEY_FILE_SETTING}: cannot read the servers' key file {path}: {e}") from None
    if not path.endswith((".yaml", ".yml")):  # SGLang refuses a --config file of any other name
        raise ValueError(f"{KEY_FILE_SETTING}: {path} must end in .yaml or .yml (SGLang reads it as --config)")
    if mode & 0o077:
        raise ValueError(f"{KEY_FILE_SETTING}: {path} (the servers' api key) has mode {mode:04o}, open to group or "
                         f"others; chmod 600 {path}")
    keys = [v.strip().strip("'\"") for k, _, v in (ln.partition(":") for ln in text.splitlines())
            if k.strip() == "api-key"]
    if len(keys) != 1 or not keys[0]:
        raise ValueError(f"{KEY_FILE_SETTING}: {path} must hold one line `api-key: KEY` (SGLang's --config YAML), "
                         f"found {len(keys)} api-key line(s)")
    return keys[0]


def make_key_file(path: str, key: Optional[str] = None) -> str:
    """The key in `path` (read_key_file) if it has one, else a new one (32 random bytes as hex) written there, mode
    0600 from its creation on (os.open), linked into place (two processes racing to make it agree on one key).
    With `key`: the file holds that key (replaced if it held another). Returns the key."""
    import secrets

    if os.path.exists(path) and (key is None or read_key_file(path) == key):
        return read_key_file(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"api-key: {key or secrets.token_hex(32)}\n")
        if key is not None:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):  # another process made it first: its key is the run's
                os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return read_key_file(path)


def key_headers(key_file: Optional[str]) -> dict:
    """The Authorization header of the key in key_file ({} without one)."""
    return {"Authorization": f"Bearer {read_key_file(key_file)}"} if key_file else {}


class FleetError(RuntimeError):
    """A fleet call failed for good: retries exhausted, an HTTP 4xx, a timeout, or a worker answered success=false."""


class ServerUnreachable(FleetError):
    """A control call found no server at the URL (connection refused or dropped): it is dead or restarting."""


class Fleet:
    """Async HTTP client of the inference fleet: server URLs, or a router whose workers GET /workers lists.

    Every method is a coroutine of the event loop that first uses the Fleet (its aiohttp session lives there).
    """

    def __init__(self, urls: Optional[list[str]] = None, router_url: Optional[str] = None, *,
                 request_timeout_s: float = 1500.0, control_timeout_s: float = 600.0, max_retries: int = 5,
                 retry_backoff_s: float = 0.5, router_max_concurrent_requests: Optional[int] = None,
                 api_key_file: Optional[str] = None, startup_timeout_s: float = 300.0):
        if bool(urls) == bool(router_url):
            raise ValueError("the fleet needs either rollout.servers (a list of URLs) or rollout.router_url, "
                             f"not both and not neither; got servers={urls!r}, router_url={router_url!r}")
        self.urls = [u.rstrip("/") for u in urls or []]
        self.router_url = router_url.rstrip("/") if router_url else None
        self.request_timeout_s, self.control_timeout_s = request_timeout_s, control_timeout_s
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.startup_timeout_s = startup_timeout_s  # longest /generate waits for a server while every one is down
        self.down: dict[str, str] = {}  # url -> error: servers out of /generate rotation, probed until they answer
        self.down_events = 0  # times a server left the rotation since the Fleet was made
        self.skip: set = set()  # workers left out of control calls (see live_workers)
        self._probes: set = set()
        self.router_max_concurrent_requests = router_max_concurrent_requests
        self.headers = key_headers(api_key_file)  # the key is read here, never kept in a config
        self.in_flight = {u: 0 for u in self.urls}  # samples of our /generate requests per server (least-loaded)
        self.requests_in_flight = 0  # samples of our /generate requests in flight, all servers together
        self.retries = 0  # /generate retries since the Fleet was made
        self._abort_down: dict[str, list] = {}  # url -> [consecutive failures, time of the last, retry after]
        self.abort_failures: dict[str, list] = {}  # url -> [failed aborts, last error], see take_abort_failures
        self._session: Optional[aiohttp.ClientSession] = None
        self._generate_timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=CONNECT_TIMEOUT_S)

    @classmethod
    def from_config(cls, cfg) -> "Fleet":
        """The Fleet of a run's config (read by attribute, duck-typed: rollout.*, weight_sync.timeout_s), whose key
        names the errors here use."""
        r = cfg.rollout
        return cls(r.servers, r.router_url, request_timeout_s=r.request_timeout_s,
                   control_timeout_s=cfg.weight_sync.timeout_s, max_retries=r.max_retries,
                   retry_backoff_s=r.retry_backoff_s, router_max_concurrent_requests=r.router_max_concurrent_requests,
                   api_key_file=r.sglang_args.api_key_file, startup_timeout_s=r.startup_timeout_s)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:  # limit=0: our own bound (groups in flight) decides the concurrency, not aiohttp's
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=self.headers)
        return self._session

    async def close(self) -> None:
        for task in list(self._probes):
            task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- /generate ----
    async def _pick(self, avoid: Optional[str], stop: Optional[asyncio.Event]) -> Optional[str]:
        """The server in rotation with the fewest of our requests in flight (not `avoid`, the one that just failed,
        if others). While every server is down it waits for one to come back (None if `stop` is set meanwhile);
        FleetError after rollout.startup_timeout_s."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            up = [u for u in self.urls if u not in self.down]
            if up:
                return min([u for u in up if u != avoid] or up, key=lambda u: self.in_flight[u])
            if stop is not None and stop.is_set():
                return None
            if time.monotonic() > deadline:
                raise FleetError(f"no inference server answered for rollout.startup_timeout_s="
                                 f"{self.startup_timeout_s} s: " + "; ".join(f"{u}: {e}" for u, e in self.down.items()))
            await asyncio.sleep(0.05)

    def _mark_down(self, url: str, error: str) -> None:
        """Take a server that does not answer out of rotation; a probe puts it back once /health answers."""
        if url in self.down:
            return
        self.down[url] = error
        self.down_events += 1
        log.warning("inference server %s does not answer (%s): out of rotation until /health answers", url, error)
        task = asyncio.ensure_future(self._probe(url))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, url: str) -> None:
        delay = self.retry_backoff_s
        while True:
            await asyncio.sleep(delay)
            try:
                await self._call(url, "GET", "/health", None, CONNECT_TIMEOUT_S)
            except FleetError as e:
                self.down[url] = str(e)
                delay = min(2 * delay, PROBE_MAX_S)
                continue
            del self.down[url]
            log.warning("inference server %s answers again: back in rotation", url)
            return

    async def generate(self, payload: dict, next_rid: Optional[Callable[[], str]] = None,
                       stop: Optional[asyncio.Event] = None) -> Optional[dict]:
        """POST /generate with retries; returns the response JSON, or None if `stop` was set before a server took it.

        `next_rid()` gives the rid of each attempt. Connection errors and 5xx are retried (on another server when
        there is one) after rollout.retry_backoff_s, doubling; HTTP 4xx and the request timeout are not. A server
        that cannot be reached (refused, reset, or gone mid-answer) is no retry: it leaves the rotation (_mark_down)
        and the request goes to another server, or waits for one (_pick).
        """
        last_error = ""
        avoid = None
        attempt = 0
        ids = payload.get("input_ids")
        size = len(ids) if ids and isinstance(ids[0], list) else 1  # samples: what least-loaded routing counts
        while attempt <= self.max_retries:
            if stop is not None and stop.is_set():
                return None
            url = self.router_url or await self._pick(avoid, stop)
            if url is None:
                return None
            if next_rid is not None:
                payload["rid"] = next_rid()
            self.requests_in_flight += size
            if url in self.in_flight:
                self.in_flight[url] += size
            try:
                async with self._http().post(url + "/generate", data=orjson.dumps(payload), headers=JSON_HEADERS,
                                             timeout=self._generate_timeout) as resp:
                    if resp.status < 400:
                        return orjson.loads(await resp.read())
                    body = (await resp.text())[:300]
                    if resp.status < 500:
                        raise FleetError(f"{url}/generate answered HTTP {resp.status}: {body}")
                    last_error = f"{url}/generate answered HTTP {resp.status}: {body}"
            except asyncio.TimeoutError as e:
                if not isinstance(e, aiohttp.ServerTimeoutError):
                    raise FleetError(f"{url}/generate did not answer within rollout.request_timeout_s="
                                     f"{self.request_timeout_s} s") from None
                last_error = f"{url}/generate: {e!r}"  # connect or socket timeout: the server is not there
                lost = True
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                last_error = f"{url}/generate: {e!r}"
                lost = True
            else:
                lost = False
            finally:
                self.requests_in_flight -= size
                if url in self.in_flight:
                    self.in_flight[url] -= size
            avoid = url
            if lost and not self.router_url:
                self._mark_down(url, last_error)
                continue
            if attempt == self.max_retries:
                break
            attempt += 1
            self.retries += 1
            delay = min(self.retry_backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S) * (1 + 0.25 * random.random())
            log.warning("retrying /generate in %.1f s (retry %d of rollout.max_retries=%d): %s",
                        delay, attempt, self.max_retries, last_error)
            if stop is None:
                await asyncio.sleep(delay)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                    return None
                except asyncio.TimeoutError:
                    pass
        raise FleetError(f"/generate failed after rollout.max_retries={self.max_retries} retries: {last_error}")

    # ---- control calls ----
    async def _call(self, url: str, method: str, path: str, body: Optional[dict] = None,
                    timeout_s: Optional[float] = None, bound: str = "") -> Any:
        """One control call to one worker: the JSON (or text) answer; FleetError on HTTP >= 400 or success=false.
        Its timeout is timeout_s (default control_timeout_s); `bound` names the setting that gives it, for the error."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.control_timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        try:
            async with self._http().request(method, url + path, json=body, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise FleetError(f"{method} {url}{path} answered HTTP {resp.status}: {text[:300]}")
        except asyncio.TimeoutError:
            raise FleetError(f"{method} {url}{path} did not answer within {timeout.total:.1f} s"
                             + (f" ({bound})" if bound else "")) from None
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as e:  # refused, reset or closed
            raise ServerUnreachable(f"{method} {url}{path} failed: {e!r}") from None
        except aiohttp.ClientError as e:
            raise FleetError(f"{method} {url}{path} failed: {e!r}") from None
        try:
            data = json.loads(text) if text else None
        except json.JSONDecodeError:
            return text
        if isinstance(data, dict) and data.get("success") is False:
            raise FleetError(f"{method} {url}{path} failed: {data.get('message')}")
        return data

    async def workers(self, timeout_s: Optional[float] = None, bound: str = "") -> list[str]:
        """The worker URLs: the configured servers, or the router's GET /workers (within timeout_s, as _call);
        without those live_workers found not answering (control calls go to the live ones)."""
        if self.router_url is None:
            urls = list(self.urls)
        else:
            data = await self._call(self.router_url, "GET", "/workers", None, timeout_s, bound)
            items = data.get("workers", data.get("urls", [])) if isinstance(data, dict) else data
            urls = [(w["url"] if isinstance(w, dict) else w).rstrip("/") for w in items or []]
            if not urls:
                raise FleetError(f"router {self.router_url} lists no workers in GET /workers: {data!r}")
        return [u for u in urls if u not in self.skip]

    async def live_workers(self, timeout_s: float) -> list[str]:
        """The workers answering GET /model_info now, waiting up to timeout_s for at least one (FleetError naming
        them after that); the others are skipped by control calls until the next live_workers (the trainer's weight
        sync forms its group with the live servers only). Not /health: 0.5.23's generates a token through the pause
        gate, so on a paused server it answers 503 after 20 s (and marks the server unhealthy)."""
        self.skip = set()
        deadline = time.monotonic() + timeout_s
        said = False
        while True:
            health = await self.health("/model_info")
            if any(health.values()):
                self.skip = {u for u, ok in health.items() if not ok}
                return [u for u, ok in health.items() if ok]
            if not said:  # the wait can be long (a server restarting): say what it waits for, once
                log.warning("no inference server answers /model_info (%s): waiting up to %s s for one",
                            ", ".join(health), timeout_s)
                said = True
            if time.monotonic() > deadline:
                raise FleetError(f"no inference server answered /model_info for rollout.startup_timeout_s="
                                 f"{timeout_s} s: {', '.join(health)}")
            await asyncio.sleep(0.5)

    async def _fan_out(self, method: str, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None,
                       skip_unreachable: bool = False, bound: str = "") -> list:
        """The call on every worker (each within timeout_s, named `bound` in its error). skip_unreachable: a worker
        with no server at its URL is taken out of /generate rotation (its probe brings it back) instead of failing
        the call; for pause and continue, since a dead server runs nothing to stop and a relaunched one starts
        unpaused."""
        urls = await self.workers(timeout_s, bound)
        out = await asyncio.gather(*[self._call(u, method, path, body, timeout_s, bound) for u in urls],
                                   return_exceptions=True)
        for url, r in zip(urls, out):
            if skip_unreachable and isinstance(r, ServerUnreachable):
                self._mark_down(url, str(r))
            elif isinstance(r, BaseException):
                raise r
        return [r for r in out if not isinstance(r, BaseException)]

    async def abort(self, rid_prefix: str = "", abort_all: bool = False) -> int:
        """Abort matching requests on every worker; returns how many workers were not reached. A worker whose abort
        failed (dead, or stalled past CONNECT_TIMEOUT_S) is skipped for rollout.retry_backoff_s, doubling with each
        consecutive failure up to MAX_BACKOFF_S, so a pause's repeated aborts do not pile up on it. Failures are
        counted, not logged: the caller reports them once (take_abort_failures)."""
        urls = await self.workers()
        now = time.monotonic()
        live = [u for u in urls if self._abort_down.get(u, [0, 0.0, 0.0])[2] <= now]
        results = await asyncio.gather(*[self._call(u, "POST", "/abort_request",
                                                    {"rid": rid_prefix, "abort_all": abort_all}, CONNECT_TIMEOUT_S)
                                         for u in live], return_exceptions=True)
        for u, r in zip(live, results):
            if not isinstance(r, Exception):
                self._abort_down.pop(u, None)
                continue
            down = self._abort_down.setdefault(u, [0, 0.0, 0.0])
            if now >= down[1]:  # started after the last known failure: a new one (concurrent calls count once)
                down[0] += 1
            down[1] = time.monotonic()
            down[2] = down[1] + min(self.retry_backoff_s * 2 ** (down[0] - 1), MAX_BACKOFF_S)
            count = self.abort_failures.setdefault(u, [0, ""])
            count[0], count[1] = count[0] + 1, str(r)
        return len(urls) - sum(not isinstance(r, Exception) for r in results)

    def take_abort_failures(self) -> dict[str, list]:
        """url -> [failed aborts, last error] since the last call (and reset)."""
        out, self.abort_failures = self.abort_failures, {}
        return out

    async def pause(self, mode: str = "abort", timeout_s: Optional[float] = None, bound: str = "") -> list:
        """/pause_generation on every worker, each within timeout_s (default control_timeout_s); a worker that does
        not answer fails the call naming its URL, the endpoint and `bound` (the setting that gave timeout_s)."""
        return await self._fan_out("POST", "/pause_generation", {"mode": mode}, timeout_s, True, bound)

    async def continue_(self, timeout_s: Optional[float] = None, bound: str = "") -> list:
        """/continue_generation on every worker, bounded as pause."""
        return await self._fan_out("POST", "/continue_generation", {}, timeout_s, True, bound)

    async def flush_cache(self) -> list:
        return await self._fan_out("POST", "/flush_cache")

    async def update_weights_from_disk(self, path: str, version: int, flush_cache: bool = True) -> list:
        """Every worker reloads every model it runs from `path`: 0.5.23's call has no selector, so a speculative
        draft model is reloaded from it too (config.validate refuses weight_sync.method=disk with one)."""
        return await self._fan_out("POST", "/update_weights_from_disk",
                                   {"model_path": path, "weight_version": str(version), "flush_cache": flush_cache})

    async def engine_ranks(self) -> list[int]:
        """Ranks each worker brings to a weight-update group: tp x dp x pp of its /server_info."""
        return [math.prod(int(info.get(k) or 1) for k in ("tp_size", "dp_size", "pp_size"))
                for info in await self.server_infos()]

    async def init_weights_update_group(self, master_address: str, master_port: int, world_size: int,
                                        group_name: str = "weight_update_group", backend: str = "nccl") -> list:
        """Every worker joins the trainer's broadcast group (trainer rank 0 is rank 0, workers follow in order).

        The calls return only once the group has formed, so the trainer joins it while this runs (SyncFleet.submit).
        """
        urls, ranks = await self.workers(), await self.engine_ranks()
        if world_size != 1 + sum(ranks):
            raise ValueError(f"weight-update group world_size {world_size} != 1 + the workers' ranks {ranks}")
        offsets = [1 + sum(ranks[:i]) for i in range(len(urls))]
        body = {"master_address": master_address, "master_port": master_port, "world_size": world_size,
                "group_name": group_name, "backend": backend}
        return list(await asyncio.gather(*[self._call(u, "POST", "/init_weights_update_group",
                                                      {**body, "rank_offset": off}) for u, off in zip(urls, offsets)]))

    async def begin_weight_update(self) -> list:
        """Open the weight-update session on every worker, for the target model (WEIGHT_SELECTOR): 0.5.23 refuses
        /update_weights_from_distributed outside one (HTTP 400, without joining the broadcast)."""
        return await self._fan_out("POST", "/begin_weight_update", {"selector": WEIGHT_SELECTOR})

    async def end_weight_update(self, timeout_s: Optional[float] = None) -> list:
        return await self._fan_out("POST", "/end_weight_update", {}, timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> list:
        return await self._fan_out("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: Optional[int] = None, group_name: str = "weight_update_group",
                                              flush_cache: bool = True, load_format: Optional[str] = None) -> list:
        """Every worker receives these tensors from the group's broadcast (the trainer broadcasts meanwhile) into its
        target model (WEIGHT_SELECTOR), inside a begin_weight_update ... end_weight_update session. flush_cache=true
        fails the call while requests run. load_format "flattened_bucket": one broadcast of a uint8 buffer holding
        the tensors back to back."""
        return await self._fan_out("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": None if version is None else str(version), "load_format": load_format,
            "selector": WEIGHT_SELECTOR})

    async def update_weights_from_tensor(self, payloads: list[list[str]], version: Optional[int] = None,
                                         flush_cache: bool = True, load_format: Optional[str] = None) -> list:
        """Worker i loads payloads[i] into its target model (WEIGHT_SELECTOR): one MultiprocessingSerializer payload
        per TP rank (sync_tensor.py), inside a begin_weight_update ... end_weight_update session. load_format: None
        (the model's load_weights), or a custom loader the server was launched with (--custom-weight-loader;
        weight_delta.LOADER), which runs once, on the target."""
        urls = await self.workers()
        if len(urls) != len(payloads):
            raise ValueError(f"{len(payloads)} tensor payload lists for {len(urls)} workers")
        body = {"flush_cache": flush_cache, "weight_version": None if version is None else str(version),
                "selector": WEIGHT_SELECTOR}
        if load_format is not None:
            body["load_format"] = load_format
        return list(await asyncio.gather(*[self._call(u, "POST", "/update_weights_from_tensor",
                                                      {**body, "serialized_named_tensors": p})
                                           for u, p in zip(urls, payloads)]))

    async def update_weight_version(self, version: int, abort_all_requests: bool = False) -> list:
        return await self._fan_out("POST", "/update_weight_version",
                                   {"new_version": str(version), "abort_all_requests": abort_all_requests})

    async def release_memory(self, tags: Optional[list[str]] = None) -> list:
        return await self._fan_out("POST", "/release_memory_occupation", {} if tags is None else {"tags": tags})

    async def resume_memory(self, tags: Optional[list[str]] = None) -> list:
        return await self._fan_out("POST", "/resume_memory_occupation", {} if tags is None else {"tags": tags})

    async def server_infos(self) -> list[dict]:
        """GET /server_info of every worker: the launch configuration (its weight_version is the launch
        --weight-version, never moved by an update) plus live scheduler state."""
        return await self._fan_out("GET", "/server_info")

    async def weight_versions(self) -> list[int]:
        """Every worker's live weight version: /model_info's weight_version (0.5.23 entrypoints/http_server.py
        model_info reads the tokenizer manager's, which each weight update moves; /server_info's is the launch
        value)."""
        infos = await self._fan_out("GET", "/model_info")
        return [parse_version(i.get("weight_version"), "/model_info") for i in infos]

    async def loads(self) -> list[dict]:
        """GET /v1/loads of every worker (running and waiting requests, per DP rank)."""
        return await self._fan_out("GET", "/v1/loads")

    async def health(self, path: str = "/health") -> dict[str, bool]:
        """Worker URL -> whether GET `path` answers 200 (/health: 503 while starting, shutting down or paused)."""
        urls = await self.workers()
        results = await asyncio.gather(*[self._call(u, "GET", path, None, CONNECT_TIMEOUT_S) for u in urls],
                                       return_exceptions=True)
        return {u: not isinstance(r, Exception) for u, r in zip(urls, results)}

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every worker answers /health, then check their sglang versions (check_versions); TimeoutError
        naming the ones that did not answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                down = [u for u, ok in (await self.health()).items() if not ok]
            except FleetError as e:  # a router that is still starting
                down = [f"{self.router_url} ({e})"]
            if not down:
                return await self.check_versions()
            if time.monotonic() > deadline:
                raise TimeoutError(f"inference servers not healthy after rollout.startup_timeout_s={timeout_s} s: "
                                   f"{', '.join(down)}")
            await asyncio.sleep(0.5)

    async def check_versions(self) -> None:
        """FleetError naming every worker whose sglang version is not in SUPPORTED_SGLANG_VERSIONS (0.5.2 and older
        have no /server_info: their /get_server_info names the version)."""
        async def version(url: str) -> str:
            try:
                return str((await self._call(url, "GET", "/server_info")).get("version"))
            except FleetError as e:
                if "HTTP 404" not in str(e):
                    raise
                with contextlib.suppress(FleetError, AttributeError):
                    return f"{(await self._call(url, 'GET', '/get_server_info')).get('version')} (no /server_info)"
                return "unknown (no /server_info)"
        urls = await self.workers()
        versions = await asyncio.gather(*[version(u) for u in urls])
        bad = [f"{u} runs sglang {v}" for u, v in zip(urls, versions) if v not in SUPPORTED_SGLANG_VERSIONS]
        if bad:
            raise FleetError(f"{'; '.join(bad)}: this project speaks the HTTP API of sglang "
                             f"{' or '.join(SUPPORTED_SGLANG_VERSIONS)} only (requirements-gpu.txt pins it)")

    async def context_limits(self) -> tuple[Optional[int], Optional[int]]:
        """(context length, max_req_input_len) that every worker takes: the least /v1/models `max_model_len` (0.5.23's
        tokenizer manager refuses prompt + max_new_tokens above it, tokenizer_manager.py _validate_one_request; its
        /server_info `context_length` is the raw flag, null by default) and the least /server_info `max_req_input_len`
        (the scheduler refuses a prompt of as many tokens, managers/utils.py validate_input_length); None where no
        worker reports one (a server without /v1/models)."""
        async def model_len(url: str) -> Optional[int]:
            with contextlib.suppress(FleetError, AttributeError, LookupError, TypeError):
                return (await self._call(url, "GET", "/v1/models"))["data"][0]["max_model_len"]
        lens = await asyncio.gather(*[model_len(u) for u in await self.workers()])
        inputs = [info.get("max_req_input_len") for info in await self.server_infos()]

        def least(xs: list) -> Optional[int]:
            return min((x for x in xs if isinstance(x, int) and x > 0), default=None)
        return least(lens), least(inputs)

    async def concurrency(self) -> Optional[int]:
        """The fleet's concurrency: sum of the workers' enforced limits (server_concurrency of /server_info), capped
        by rollout.router_max_concurrent_requests; None (with a warning) when a server reports none and no router
        limit is set."""
        urls, infos = await self.workers(), await self.server_infos()
        limits = [server_concurrency(info) for info in infos]
        total = sum(limits) if limits and None not in limits else None
        if total is None:
            unknown = [u for u, x in zip(urls, limits) if x is None]
            warnings.warn(f"{', '.join(unknown)} report no concurrency limit in /server_info (neither internal_states"
                          "[].effective_max_running_requests_per_dp nor max_running_requests), so "
                          "rollout.async_max_concurrent_samples is not clamped to the fleet's", stacklevel=2)
        router = self.router_max_concurrent_requests if self.router_url else None
        if router is not None and router > 0:
            return router if total is None else min(total, router)
        return total


def server_concurrency(info: dict) -> Optional[int]:
    """The requests one server runs at once: the limit it enforces (sum of internal_states' per-DP-rank
    effective_max_running_requests_per_dp, scaled to dp_size entries), else its raw --max-running-requests flag;
    None when it reports neither."""
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
    per_dp = [s.get("effective_max_running_requests_per_dp") for s in states]
    if per_dp and all(isinstance(x, int) and x > 0 for x in per_dp):
        return sum(per_dp) * int(info.get("dp_size") or len(per_dp)) // len(per_dp)
    flag = info.get("max_running_requests")
    return flag if isinstance(flag, int) and flag > 0 else None


class SyncFleet:
    """A Fleet on its own event-loop thread, callable from synchronous code: every coroutine method of Fleet is a
    blocking method of the same name and arguments here (__getattr__ runs it on the loop, bounded by
    call_timeout_s): generate, workers, live_workers, health, wait_healthy, check_versions, server_infos,
    weight_versions, loads,
    concurrency, context_limits, abort, pause, continue_, flush_cache, release_memory, resume_memory,
    update_weights_from_disk, update_weight_version, engine_ranks, init_weights_update_group, begin_weight_update,
    end_weight_update, destroy_weights_update_group, update_weights_from_distributed, update_weights_from_tensor
    (see Fleet for what each does), e.g. `SyncFleet(fleet).update_weights_from_disk(path, 3)`. `submit` starts one
    and returns a Future instead, `run` waits for any coroutine of the loop. Fleet's plain methods
    (take_abort_failures) are Fleet's own.

    The Rollout producer runs on this same loop, so one process has one event loop and one HTTP session.
    """

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self._thread.start()
        # A fleet call is bounded by its own HTTP timeouts; this outer bound only catches a wedged loop.
        self.call_timeout_s = max(fleet.control_timeout_s, fleet.request_timeout_s) + 60.0

    def __getattr__(self, name: str):
        fn = inspect.getattr_static(Fleet, name, None)
        if name.startswith("_") or not inspect.isfunction(fn):
            raise AttributeError(f"SyncFleet has no attribute '{name}', and Fleet no method of that name")
        method = getattr(self.fleet, name)
        if not inspect.iscoroutinefunction(fn):
            return method  # a plain method (take_abort_failures): nothing to run on the loop

        @functools.wraps(method)
        def blocking(*args, **kwargs):
            return self.run(method(*args, **kwargs), what=f"Fleet.{name}")

        return blocking

    def __dir__(self):
        return sorted({*super().__dir__(), *(n for n, v in vars(Fleet).items()
                                             if not n.startswith("_") and inspect.isfunction(v))})

    def run(self, coro, timeout_s: Optional[float] = None, what: str = "fleet call"):
        """Run a coroutine on the loop and wait for its result (TimeoutError naming `what` after timeout_s)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s or self.call_timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"{what} did not finish within {timeout_s or self.call_timeout_s} s") from None

    def submit(self, method: str, *args, **kwargs) -> concurrent.futures.Future:
        """Start a Fleet method without waiting (e.g. init_weights_update_group while the trainer joins the group)."""
        return asyncio.run_coroutine_threadsafe(getattr(self.fleet, method)(*args, **kwargs), self.loop)

    def close(self) -> None:
        if self.loop.is_running():
            self.run(self.fleet.close(), 30.0, "closing the fleet's HTTP session")
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10.0)
