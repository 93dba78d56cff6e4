"""strategies.py through buffer.PipelineServer: the spec's numbers and examples, the registry, and property tests
that drive random dispatch / completion / pause / consume / resume schedules through every strategy.

Run: python -m pytest -q tests/test_strategies.py
"""
import io
import os
import random
import re
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import buffer
import config
import staleness
import strategies
from buffer import ABORTED, COMPLETED, FAILED, TRUNCATED
from staleness import Boundary
from strategies import PipelineView
from test_buffer import aborted, finish, make_cfg, make_server, traj

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def view(B=4, C=8, R=0, Q=0, generating=None, consumed=0, next_seq=0, oldest_uncollected=None,
         oldest_uncompleted=None):
    return PipelineView(B, C, R, Q, R if generating is None else generating, consumed, next_seq, oldest_uncollected,
                        oldest_uncompleted)


# ---------------------------------------------------------------------------------------------------------
# The rules one question at a time
# ---------------------------------------------------------------------------------------------------------

def test_registry_holds_the_three_builtins_and_build_picks_by_mode():
    assert {"no-window", "window-gated", "windowed-fifo"} <= set(strategies.REGISTRY)
    assert type(strategies.build("windowed-fifo", 4, 8, fully_async=True)) is strategies.WindowedFifo
    assert type(strategies.build("windowed-fifo", 4, 6, fully_async=False)) is strategies.Synchronous
    with pytest.raises(ValueError, match="fully_async.sliding_window 'fifo'.*no-window, window-gated, windowed-fifo"):
        strategies.build("fifo", 4, 8, fully_async=True)
    with pytest.raises(TypeError, match="Strategy"):
        strategies.register("not-a-strategy")(object)
    with pytest.raises(ValueError, match="already registered"):
        strategies.register("no-window")(type("Other", (strategies.Strategy,), {}))
    with pytest.raises(ValueError, match="C >= B"):
        strategies.NoWindow(4, 3)


def test_no_window_dispatch_count_is_c_minus_r_minus_q():
    s = strategies.NoWindow(B=64, C=128)
    for R, Q in [(0, 0), (100, 20), (128, 0), (0, 128), (60, 70)]:
        v, n = view(64, 128, R, Q), 0
        while s.may_dispatch(v.next_seq, v):
            v.R, v.next_seq, n = v.R + 1, v.next_seq + 1, n + 1
        assert n == max(0, 128 - R - Q)
    assert s.may_collect(10_000, view(oldest_uncompleted=0))


def test_window_gated_needs_next_seq_within_c_of_the_oldest_uncollected():
    s = strategies.WindowGated(B=64, C=128)
    assert s.may_dispatch(127, view(64, 128, R=1, Q=0, oldest_uncollected=0))
    assert not s.may_dispatch(128, view(64, 128, R=1, Q=0, oldest_uncollected=0))
    assert s.may_dispatch(128, view(64, 128, R=1, Q=0, oldest_uncollected=1))
    assert not s.may_dispatch(5, view(64, 128, R=100, Q=28, oldest_uncollected=0))  # capacity too
    assert s.may_dispatch(3, view(64, 128, R=1, Q=0, oldest_uncollected=100))  # a restored old group is the oldest


def test_windowed_fifo_collects_only_within_b_of_the_oldest_uncompleted():
    s = strategies.WindowedFifo(B=64, C=128)
    assert s.may_collect(63, view(64, 128, oldest_uncompleted=0))
    assert not s.may_collect(64, view(64, 128, oldest_uncompleted=0))
    assert s.may_collect(64, view(64, 128, oldest_uncompleted=1))
    assert s.may_collect(500, view(64, 128, oldest_uncompleted=None))
    assert not s.may_dispatch(0, view(64, 128, R=128, Q=0))


def test_synchronous_counts_consumed_groups_until_the_step_boundary():
    s = strategies.Synchronous(B=4, C=6)
    assert s.may_dispatch(0, view(4, 6, R=2, Q=1, consumed=2))
    assert not s.may_dispatch(0, view(4, 6, R=2, Q=1, consumed=3))


# ---------------------------------------------------------------------------------------------------------
# The spec's numbers and examples, end to end through PipelineServer
# ---------------------------------------------------------------------------------------------------------

def test_spec_capacity_b64_stale1_is_128_groups_in_flight_plus_buffered():
    srv = make_server(B=64, N=8, stale=1.0, window="no-window", n_prompts=300)
    gs = srv.dispatch()
    assert srv.C == 128 and len(gs) == 128 and srv.dispatch() == []
    for g in gs[:10]:
        srv.put(finish(g, 8))
    assert (srv.stats()["R"], srv.stats()["Q"]) == (118, 10) and srv.dispatch() == []  # R + Q = C
    srv.get(10, timeout=0)
    assert [g.seq for g in srv.dispatch()] == list(range(128, 138))  # max(0, C - R - Q) = 10
    assert make_server(B=64, N=8, stale=2.0, n_prompts=300).C == 192


def test_spec_windowed_fifo_holds_a_finished_group_outside_the_window_in_trajqueue():
    srv = make_server(B=64, N=8, stale=1.0, window="windowed-fifo", n_prompts=300)
    gs = srv.dispatch()
    srv.put(finish(gs[64], 8))  # 64 - 0 >= B: finished first, but outside the window
    st = srv.stats(keys=True)
    assert st["held_keys"] == [(0, 64)] and st["Q"] == 0 and st["R"] == 128  # still counts in R and capacity
    assert srv.step_metrics()["rollout/held_groups"] == 1
    srv.put(finish(gs[63], 8))  # inside the window
    assert srv.stats(keys=True)["buffered_keys"] == [(0, 63)]
    srv.put(finish(gs[0], 8))  # the front slides to 1: 64 - 1 < B
    st = srv.stats(keys=True)
    assert st["buffered_keys"] == [(0, 0), (0, 63), (0, 64)] and st["held_keys"] == []
    assert st["oldest_uncompleted"] == 1


def test_spec_window_gated_stops_dispatch_behind_one_slow_group():
    srv = make_server(B=64, N=8, stale=1.0, window="window-gated", n_prompts=400)
    free = make_server(B=64, N=8, stale=1.0, window="no-window", n_prompts=400)
    for s in (srv, free):
        gs = s.dispatch()
        for g in gs[1:]:  # everything but group 0 finishes and is trained on
            s.put(finish(g, 8))
        s.get(127, timeout=0)
        assert (s.stats()["R"], s.stats()["Q"]) == (1, 0)
    assert srv.dispatch() == []  # next_seq 128 - oldest uncollected 0 = C: the window cannot slide
    assert len(free.dispatch()) == 127  # no-window fills the capacity
    srv.put(finish(gs[0], 8))
    assert [g.seq for g in srv.dispatch()][:2] == [128, 129] and srv.stats()["R"] == 127


def test_async_max_concurrent_samples_caps_generating_groups():
    # the requirement's example: N = 8 and 128 concurrent samples -> 16 groups in flight
    srv = make_server(B=8, N=8, stale=3.0, overrides=["rollout.async_max_concurrent_samples=128"], n_prompts=100)
    gs = srv.dispatch()
    assert len(gs) == 16 and srv.C == 32
    for g in gs[:4]:
        srv.put(finish(g, 8))
    assert len(srv.dispatch()) == 4  # collected groups stop counting; capacity alone would allow 16 more
    srv.put(finish(gs[4], 8)[:7])  # 7 of 8 back: still generating
    assert srv.dispatch() == []
    unset = make_server(B=8, N=8, stale=3.0, n_prompts=100)
    assert len(unset.dispatch()) == 32  # unset: the capacity rule alone
    odd = make_server(B=8, N=8, stale=3.0, overrides=["rollout.async_max_concurrent_samples=20"], n_prompts=100)
    assert len(odd.dispatch()) == 2  # 20 // 8: whole groups only


# ---------------------------------------------------------------------------------------------------------
# A custom strategy: one class in a module of your own, selected as module:Class (examples/strict_fifo.py, the
# example of strategies.py's docstring and the README; tests/test_plugins.py runs it through torchrun train.py)
# ---------------------------------------------------------------------------------------------------------

EXAMPLES = os.path.join(ROOT, "examples")


def _example_blocks(text):
    """Each indented or fenced code block of `text` that defines StrictFifo, as dedented non-blank lines."""
    blocks = []
    for m in re.finditer(r"([ \t]*import strategies\n\n[ \t]*class StrictFifo\(.*?return [^\n]+\n)", text, re.S):
        lines = [l for l in m.group(1).splitlines() if l.strip()]
        indent = min(len(l) - len(l.lstrip()) for l in lines)
        blocks.append([l[indent:] for l in lines])
    return blocks


def _is_subsequence(part, whole):
    it = iter(whole)
    return all(line in it for line in part)


def test_custom_strategy_example_is_selected_as_module_class_and_runs(monkeypatch):
    example = open(os.path.join(EXAMPLES, "strict_fifo.py")).read().splitlines()
    docs = _example_blocks(strategies.__doc__)
    assert docs, "the StrictFifo example is missing from strategies.py's docstring"
    readme = os.path.join(ROOT, "README.md")
    if os.path.exists(readme):
        docs += _example_blocks(open(readme).read())
    for block in docs:  # the docs' copy is the example file's code, less the line that reports where it runs
        assert _is_subsequence(block, example), f"a StrictFifo example drifted from examples/strict_fifo.py: {block}"
    monkeypatch.syspath_prepend(EXAMPLES)
    spec = "strict_fifo:StrictFifo"
    try:
        srv = make_server(B=2, N=2, stale=1.0, window=spec)  # config.load_plugins loads and registers it
        assert strategies.REGISTRY[spec].__module__ == "strict_fifo"
        gs = srv.dispatch()
        srv.put(finish(gs[1], 2))
        assert srv.stats()["held"] == 1  # 0 is not complete yet
        srv.put(finish(gs[0], 2))
        assert srv.stats(keys=True)["buffered_keys"] == [(0, 0), (0, 1)]
    finally:
        strategies.REGISTRY.pop(spec, None)


def test_a_token_level_keep_plugin_changes_what_the_buffer_keeps(monkeypatch):
    """examples/token_staleness.py, loaded as module:attr: two groups that both start at version 0, one mostly
    generated by the current weights, one mostly by old ones. The start-version rule (rollout.max_weight_staleness,
    any bound) cannot tell them apart and the default strategy keeps both; the plugin keeps the first and drops the
    second (rollout/policy_drop), and drops the first too at the weight update that makes its tokens old."""
    def tokens(g, i, versions):
        t = traj(g, i, start=versions[0], end=versions[-1], T=len(versions))
        t.versions = torch.tensor(versions)
        return t

    def run(window):
        srv = make_server(B=2, N=2, stale=1.0, window=window)
        g0, g1 = srv.dispatch()[:2]
        srv.set_weight_version(3)  # old = more than max_age 1 version behind: versions 0 and 1
        srv.put([tokens(g0, 0, [0, 3, 3, 3]), tokens(g0, 1, [2, 3, 3, 3])])  # 1 old token of 8
        srv.put([tokens(g1, 0, [0, 0, 0, 3]), tokens(g1, 1, [0, 1, 1, 3])])  # 6 old tokens of 8
        return srv, srv.stats(keys=True)["buffered_keys"], srv.step_metrics()

    monkeypatch.syspath_prepend(EXAMPLES)
    spec = "token_staleness:TokenStaleness"
    try:
        srv, kept, m = run(spec)  # config.load_plugins loads and registers it
        assert type(srv.strategy).__name__ == "TokenStaleness"
        assert kept == [(0, 0)] and m["rollout/policy_drop"] == 1 and m["rollout/staleness_drop"] == 0
        assert m["rollout/discarded_tokens"] == 2 * 4
        srv.set_weight_version(4)  # (0, 0): versions 0 and 2 are now old, 2 of 8: kept
        assert srv.stats()["Q"] == 1
        srv.set_weight_version(5)  # every token is old
        assert srv.stats()["Q"] == 0 and srv.step_metrics()["rollout/policy_drop"] == 1
    finally:
        strategies.REGISTRY.pop(spec, None)
    default, kept, m = run("no-window")
    assert kept == [(0, 0), (0, 1)] and m["rollout/policy_drop"] == 0
    g0, g1 = default.get(2, timeout=0)
    assert g0.start_version == g1.start_version == 0
    for bound in range(5):  # the default rule answers the same for both, whatever its bound
        rule = strategies.Strategy(2, 4, max_weight_staleness=bound)
        assert rule.within_max_weight_staleness(g0, default._view()) == rule.within_max_weight_staleness(
            g1, default._view())


def test_a_strategy_written_for_the_start_version_signature_is_refused_at_build_and_start_up(monkeypatch):
    class Old(strategies.Strategy):
        def keep(self, start_version, view):
            return view.version - start_version <= 1

    class OwnInit(strategies.Strategy):
        def __init__(self, B, C):
            super().__init__(B, C)

    monkeypatch.setitem(strategies.REGISTRY, "old", Old)
    monkeypatch.setitem(strategies.REGISTRY, "own-init", OwnInit)
    with pytest.raises(ValueError, match=re.escape("fully_async.sliding_window 'old': Old.keep(self, start_version, "
                                                   "view) has the earlier signature; write keep(self, group, view)")):
        strategies.build("old", 4, 8, True)
    with pytest.raises(ValueError, match=re.escape("OwnInit.__init__ must take max_weight_staleness=None")):
        make_server(window="own-init")
    # config.validate builds the run's strategy as the buffer process will: the run stops before anything starts
    with pytest.raises(ValueError, match=re.escape("Old.keep(self, start_version, view) has the earlier signature")):
        config.load_config("configs/tiny.yaml", ["fully_async.sliding_window=old"])


# ---------------------------------------------------------------------------------------------------------
# Property tests: random schedules, every rule checked after every action
# ---------------------------------------------------------------------------------------------------------

class Driver:
    """Plays rollout and trainer against one PipelineServer and checks the spec's rules after every action."""

    def __init__(self, srv, window, max_staleness, filters):
        self.srv, self.window, self.max_staleness, self.filters = srv, window, max_staleness, filters
        self.N, self.B, self.C = srv.N, srv.B, srv.C
        self.groups = {}  # key -> PromptGroup as dispatched (the rollout's copy)
        self.todo = {}  # key -> indices not yet put
        self.dispatched = set()  # every key ever dispatched
        self.consumed = []  # keys in consumption order
        self.dropped = 0  # groups counted dropped by the server
        self.version = 0

    # ---- actions ----
    def dispatch(self, max_groups):
        before = self.srv.stats()
        gs = self.srv.dispatch(max_groups)
        if max_groups is not None:
            assert len(gs) <= max_groups
        oldest = before["oldest_uncollected"]
        for g in gs:
            assert g.prompt_id not in self.todo, "a group in flight was dispatched again"
            if self.window == "window-gated":  # its dispatch rule (docs/design.md), checked at each dispatch
                assert g.seq - (g.seq if oldest is None else min(oldest, g.seq)) < self.C
                oldest = g.seq if oldest is None else min(oldest, g.seq)
            self.groups[g.prompt_id] = g
            self.todo[g.prompt_id] = list(range(self.N))
            self.dispatched.add(g.prompt_id)
        return gs

    def put(self, key, count, rng):
        g, idx = self.groups[key], self.todo[key]
        chosen = [idx.pop(rng.randrange(len(idx))) for _ in range(min(count, len(idx)))]
        trajs = []
        for i in chosen:
            p = g.partial[i] if g.partial else None
            if p is not None and p.status != ABORTED:
                trajs.append(p)  # a restored finished trajectory comes back as it is
                continue
            status = rng.choice([COMPLETED] * 6 + [TRUNCATED, FAILED])
            start = rng.randint(max(0, self.version - 2), self.version)
            trajs.append(traj(g, i, reward=rng.choice([0.0, 1.0]), status=status, start=start,
                              end=rng.randint(start, self.version)))
        if not idx:
            del self.todo[key]
        before = set(self.srv.stats(keys=True)["buffered_keys"])
        self.srv.put(trajs)
        st = self.srv.stats(keys=True)
        if self.window == "windowed-fifo":  # collected only inside the window, held only outside
            front = st["oldest_uncompleted"]
            for k in set(st["buffered_keys"]) - before:
                assert front is None or k[1] - front < self.B
            for k in st["held_keys"]:
                assert front is not None and k[1] - front >= self.B

    def consume(self, k, rng):
        st = self.srv.stats(keys=True)
        if st["Q"] < k:
            if rng.random() < 0.1:
                with pytest.raises(TimeoutError, match=f"wanted {k} groups"):
                    self.srv.get(k, timeout=0.001)
            return
        groups = self.srv.get(k, timeout=0)
        assert [g.prompt_id for g in groups] == st["buffered_keys"][:k]  # oldest (epoch, seq) first
        for g in groups:
            index = [t.index for t in g.trajectories]
            assert index == sorted(set(index)) and set(index) <= set(range(self.N))
            assert all(t.prompt_id == g.prompt_id for t in g.trajectories)
            if "failed" in self.filters:  # a failed trajectory leaves its group; rollout.min_group_size (null) stay
                assert all(t.status != FAILED for t in g.trajectories)
                assert len(index) >= (1 if self.N == 1 else max(2, self.N // 2))
            if "all_equal_reward" in self.filters:
                assert len({t.reward for t in g.trajectories}) > 1
            if self.max_staleness is not None:
                assert all(t.start_version < 0 or self.version - t.start_version <= self.max_staleness
                           for t in g.trajectories)
        self.consumed += [g.prompt_id for g in groups]

    def boundary(self, rng, partial=True):
        returned = []
        for key in sorted(self.todo):
            if partial:  # abort: most come back, some get lost (-> incomplete groups)
                returned += [aborted(self.groups[key], i) for i in self.todo[key] if rng.random() < 0.85]
            else:  # rollout.partial=false: wait for everything in flight to finish
                self.put(key, self.N, rng)
        m = self.srv.step_boundary(returned)
        self.dropped += m["rollout/partial_dropped_incomplete_groups"]
        self.todo.clear()
        st = self.srv.stats()
        assert st["R"] == 0 and st["trajqueue_trajectories"] == 0 and st["held"] == 0

    def bump_version(self):
        self.version += 1
        self.srv.set_weight_version(self.version)

    # ---- invariants, after every action ----
    def check(self):
        st = self.srv.stats()
        if self.window == "sync":
            assert st["consumed_step"] + st["R"] + st["Q"] <= self.C
        else:
            assert st["R"] + st["Q"] <= self.C  # the capacity rule, every strategy (docs/design.md)
        if st["max_generating"] is not None:
            assert st["generating"] <= st["max_generating"]
        if self.window not in ("windowed-fifo",):
            assert st["held"] == 0  # any complete group is collected at once
        assert st["R"] == len(set(self.todo) | set(self.srv.stats(keys=True)["held_keys"]))
        assert len(self.consumed) == len(set(self.consumed)), "a group was consumed twice"
        m = self.srv.step_metrics()
        self.dropped += m["rollout/filter_drop"] + m["rollout/staleness_drop"]

    def drain(self, target):
        """Canonical continuation: dispatch, finish everything in flight with clean rewards, consume it all, step
        boundary; until `target` more groups were consumed. Returns the prompts consumed, in order."""
        out = []
        while len(out) < target:
            self.dispatch(None)
            for key in sorted(self.todo):
                g = self.groups[key]
                self.srv.put([p for p in finish(g, self.N, version=self.version)
                              if p.index in self.todo[key]])
            self.todo.clear()
            q = self.srv.stats()["Q"]
            if q:
                got = self.srv.get(q, timeout=0)
                self.consumed += [g.prompt_id for g in got]
                out += [(g.prompt.source, g.prompt.epoch, g.prompt.seq, g.prompt.data_index) for g in got]
            self.boundary(None, partial=False)
            self.check()
        return out[:target]


WINDOWS = ["no-window", "window-gated", "windowed-fifo", "sync"]


@pytest.mark.parametrize("window", WINDOWS)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_schedules_keep_every_rule(window, data):
    draw = data.draw
    B, N = draw(st.integers(1, 4), "B"), draw(st.integers(1, 3), "N")
    stale = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]), "stale")
    over = []
    cap = draw(st.one_of(st.none(), st.integers(N, 4 * N)), "cap")
    if cap is not None:
        over.append(f"rollout.async_max_concurrent_samples={cap}")
    filters = ["failed"] + (["all_equal_reward"] if N > 1 and draw(st.booleans(), "equal") else [])
    over.append(f"rollout.filter=[{', '.join(filters)}]")
    max_staleness = draw(st.one_of(st.none(), st.integers(0, 2)), "max_staleness")
    if max_staleness is not None:
        over.append(f"rollout.max_weight_staleness={max_staleness}")
    if window == "sync":
        over.append(f"rollout.sampler.num_oversample={draw(st.integers(0, 3), 'oversample')}")
    kw = dict(B=B, N=N, stale=stale, window="no-window" if window == "sync" else window,
              fully_async=window != "sync", overrides=over, n_prompts=draw(st.integers(3, 12), "prompts"))
    srv = make_server(**kw)
    rng = random.Random(draw(st.integers(0, 2 ** 16), "seed"))
    d = Driver(srv, window, max_staleness, filters)
    # the schedule comes from a seeded generator (hypothesis shrinks the seed and the sizes): long, busy runs
    n_actions = draw(st.integers(10, 150), "actions")
    weights = {"dispatch": rng.uniform(0.3, 2), "put": rng.uniform(1, 4), "consume": rng.uniform(0.3, 2),
               "boundary": rng.uniform(0, 0.3), "wait-boundary": rng.uniform(0, 0.15), "version": rng.uniform(0, 0.5)}
    for a in rng.choices(list(weights), list(weights.values()), k=n_actions):
        if a == "dispatch":
            d.dispatch(rng.choice([None, None, 0, 1, 2]))
        elif a == "put" and d.todo:
            d.put(rng.choice(sorted(d.todo)), rng.choice([1, 1, N]), rng)
        elif a == "consume":
            d.consume(rng.randint(1, min(srv.C, 2 * B)), rng)
        elif a in ("boundary", "wait-boundary"):
            d.boundary(rng, partial=a == "boundary")
        elif a == "version":
            d.bump_version()
        d.check()

    # a state_dict at this random point, through torch.save, into a fresh buffer: the same future consumption
    f = io.BytesIO()
    torch.save(srv.state_dict(), f)
    f.seek(0)
    fresh = make_server(**kw)
    fresh.load_state_dict(torch.load(f, weights_only=True))
    twin = Driver(fresh, window, max_staleness, filters)
    twin.version = d.version
    target = 2 * srv.C
    assert d.drain(target) == twin.drain(target)

    # every dispatched group ended consumed, counted as dropped, or waiting in the restored lane
    lane = set(srv.stats(keys=True)["lane_keys"])
    assert not lane & set(d.consumed)
    assert len(d.dispatched) == len(d.consumed) + d.dropped + len(lane)


# ---------------------------------------------------------------------------------------------------------
# The peers' presets: (a) admission at its boundary, (b) the filter at its bound, (c) the update-time action
# ---------------------------------------------------------------------------------------------------------

def preset(name, B=4, N=2, param=None, pause_mode="abort", partial=True, overrides=()):
    over = [f"rollout.partial={str(partial).lower()}", f"rollout.pause_mode={pause_mode}", *overrides]
    if param is not None:
        over.append(f"fully_async.policy_param={param}")
    return make_server(B=B, N=N, stale=0.0, window=name, overrides=over, n_prompts=40)


def seqs(groups):
    return [g.seq for g in groups]


def test_areal_counts_consumed_groups_until_the_update_and_frees_rejected_ones():
    # eta 1: consumed + R + Q < (1 + 1) * 4; max_concurrent_rollouts raised to 8 groups (default B: the next test)
    srv = preset("areal", B=4, N=2, overrides=["rollout.async_max_concurrent_samples=16"])
    assert srv.C == 8 and len(srv.dispatch()) == 8
    gs = [srv._in_flight[k] for k in sorted(srv._in_flight)]
    srv.put(finish(gs[0], 2) + finish(gs[1], 2))
    srv.get(2, timeout=0)
    assert srv.dispatch() == []  # 2 consumed + 6 running = 8: no-window would dispatch 2 (R + Q = 6 < 8)
    srv.put(finish(gs[2], 2, status=FAILED))  # rejected: frees its slot
    assert seqs(srv.dispatch()) == [8]
    srv.step_boundary([aborted(g, i) for g in gs[3:] + [srv._in_flight[(0, 8)]] for i in range(2)])
    assert seqs(srv.dispatch()) == [3, 4, 5, 6, 7, 8, 9, 10]  # the update resets `consumed`: 6 restored + 2 new
    assert strategies.AReaL.capacity(0.5, 4, 2) == 6 and strategies.AReaL.capacity(None, 4, 2) == 8


def test_areal_default_concurrency_is_its_companion_knob():
    """AReaL's get_capacity is min(max_concurrent_rollouts - running, staleness budget), max_concurrent_rollouts
    defaulting to the consumer batch size B. Unset, rollout.async_max_concurrent_samples takes it; set, it wins."""
    srv = preset("areal", B=4, N=2, param=4)  # budget (4 + 1) 4 = 20 groups, but only B = 4 may run
    assert srv.max_generating == 4 and len(srv.dispatch()) == 4
    g = srv._in_flight[min(srv._in_flight)]
    srv.put(finish(g, 2))  # one completes: one more may run
    assert len(srv.dispatch()) == 1
    assert preset("areal", B=4, N=2, param=4, overrides=["rollout.async_max_concurrent_samples=12"]).max_generating == 6
    assert preset("verl", B=4, N=2).max_generating is None  # the other presets keep no cap of their own


def test_verl_budget_counts_new_prompts_per_version_and_is_reanchored_at_the_sync():
    srv = preset("verl", B=2, N=2)  # s = 1: (1 + s) * B = 4 new prompts per weight version
    g0, g1, g2, g3 = srv.dispatch()
    srv.put(finish(g0, 2) + finish(g1, 2))
    srv.get(2, timeout=0)
    assert srv.dispatch() == []  # consumed ones still count until the sync
    srv.put(finish(g2, 2, status=FAILED))  # dropped by the filter: gives its slot back (this project's deviation)
    (g4,) = srv.dispatch()
    srv.step_boundary([aborted(g, i) for g in (g3, g4) for i in range(2)])  # carried over: g3, g4 (restored) = 2
    assert seqs(srv.dispatch()) == [3, 4, 5, 6]  # the resumed partials do not count, 2 new prompts do
    assert srv.dispatch() == []
    drain = preset("verl", partial=False)
    assert drain.action == strategies.DRAIN and srv.action == strategies.ABORT_RESUME


def test_pipelinerl_budget_in_samples_counts_old_samples_and_keeps_requests_in_place():
    srv = preset("pipelinerl", B=4, N=2, param=4, pause_mode="in_place")  # ceil(4 / 2) + 4 = 6 groups
    assert srv.C == 6 and len(srv.dispatch()) == 6 and srv.dispatch() == []
    assert strategies.PipelineRL.capacity(None, 4, 2) == 8  # default max_lag = B N samples: one step
    g0, g1 = srv._in_flight[(0, 0)], srv._in_flight[(0, 1)]
    srv.set_weight_version(1)  # a lag of 1 version = 8 samples > 4: counted, not dropped
    srv.put(finish(g0, 2, version=0) + finish(g1, 2, version=1))
    m = srv.step_metrics()
    assert m["rollout/policy_drop"] == 0 and srv.stats()["Q"] == 2
    assert srv.boundary_aborts(Boundary.KEEP) == []
    assert srv.step_boundary([], Boundary.KEEP)["rollout/kept_in_flight_groups"] == 4
    srv.set_weight_version(3)
    assert srv.stats()["Q"] == 2 and "rollout/samples_too_old" not in srv.step_metrics()  # counted at training


def test_pipelinerl_counts_samples_too_old_when_the_trainer_takes_them_not_at_collection():
    """finetune_loop.py counts samples_too_old_to_train on the batch it trains: a group collected young and trained
    old is counted; one collected old and trained at once is counted once; nothing is dropped."""
    srv = preset("pipelinerl", B=2, N=2, param=4, pause_mode="in_place")  # L = 4 samples = one version (B N)
    g0, g1, g2 = srv.dispatch()[:3]
    srv.put(finish(g0, 2, version=0))  # collected at version 0: lag 0
    srv.set_weight_version(1)
    srv.put(finish(g1, 2, version=0) + finish(g2, 2, version=1))  # g1 collected at lag 1 (4 samples: not > 4)
    assert "rollout/samples_too_old" not in srv.step_metrics()  # nothing counted at collection
    srv.set_weight_version(2)  # g0, g1: lag 2 = 8 samples > 4; g2: lag 1
    assert srv.stats()["Q"] == 3
    srv.get(2, timeout=0)
    assert srv.step_metrics()["rollout/samples_too_old"] == 2 * 2  # g0 and g1, N samples each
    srv.get(1, timeout=0)
    m = srv.step_metrics()
    assert "rollout/samples_too_old" not in m and m["rollout/policy_drop"] == 0


def test_prime_rl_drops_queued_groups_older_than_m_and_aborts_them_in_flight():
    srv = preset("prime-rl", B=2, N=2, param=1, pause_mode="in_place",
                 overrides=["rollout.async_max_concurrent_samples=8"])  # 4 groups generating at most
    g0, g1, g2, g3 = srv.dispatch()
    assert srv.dispatch() == []
    srv.put(finish(g0, 2) + finish(g1, 2))
    srv.get(1, timeout=0)  # g1 stays buffered
    assert srv.boundary_aborts(Boundary.KEEP) == []  # 1 - 0 = 1 <= M: kept in place
    srv.step_boundary([], Boundary.KEEP)
    srv.set_weight_version(1)
    assert srv.stats()["Q"] == 1  # lag 1 <= M
    g4, g5 = srv.dispatch()  # started under version 1, up to the cap
    assert g4.seq == 4 and srv.boundary_aborts(Boundary.KEEP) == [(0, 2), (0, 3)]  # 2 - 0 > M; g4: 2 - 1 = 1
    srv.put([traj(g2, 0)])  # finished before the abort: dropped with its group
    with pytest.raises(ValueError, match=r"groups \[\(0, 9\)\] that are not on the abort list"):
        srv.step_boundary([aborted(SimpleNamespace(epoch=0, seq=9, prompt_ids=g4.prompt_ids), 0)], Boundary.KEEP)
    m = srv.step_boundary([aborted(g2, 1), aborted(g3, 0), aborted(g3, 1)], Boundary.KEEP)
    assert m["rollout/update_dropped_groups"] == 2 and srv.stats(keys=True)["in_flight_keys"] == [(0, 4), (0, 5)]
    srv.set_weight_version(2)  # g1 (start 0) is now 2 > M old: leaves PipelineBuffer
    m = srv.step_metrics()
    assert srv.stats()["Q"] == 0 and m["rollout/policy_drop"] == 1
    assert m["rollout/discarded_tokens"] == 3 + 3 * 2 + 2 * 3  # g2's finished + 3 aborted partials + g1's two


def test_a_group_aborted_by_staleness_is_dropped_even_if_a_late_finisher_makes_it_young_enough():
    """rollout.py asks boundary_aborts(), aborts those groups' requests, then calls step_boundary. A trajectory of
    such a group that finished in between, having waited in a server's queue, carries a later start version, so
    the group would no longer be on the abort list: step_boundary still drops it, by the recorded list (the rollout
    took its other trajectories away; kept in flight it could never complete). bench/pipeline_sim.py --sweep raised
    here on prime-rl at M = 1, 2, 4 when the boundary decided again (546 returned trajectories refused)."""
    srv = preset("prime-rl", B=2, N=2, param=1, pause_mode="in_place",
                 overrides=["rollout.async_max_concurrent_samples=8"])
    g0, g1, g2, g3 = srv.dispatch()
    srv.put(finish(g0, 2) + finish(g1, 2))
    srv.get(2, timeout=0)
    srv.boundary_aborts(Boundary.KEEP)
    srv.step_boundary([], Boundary.KEEP)
    srv.set_weight_version(1)  # g2, g3 dispatched at version 0: 2 - 0 > M at the next update
    assert srv.boundary_aborts(Boundary.KEEP) == [(0, 2), (0, 3)]
    srv.put([traj(g2, 0, start=1, end=1)])  # waited in a queue, started under version 1: g2 now starts at 1
    asked = {key: staleness.decide(srv, staleness.BEFORE_PAUSE, buffer.Group(pg, srv.queue.slots(key))).action
             for key, pg in srv._in_flight.items()}
    assert [key for key in sorted(asked) if asked[key] == staleness.DROP] == [(0, 3)]
    m = srv.step_boundary([aborted(g2, 1), aborted(g3, 0), aborted(g3, 1)], Boundary.KEEP)
    assert m["rollout/update_dropped_groups"] == 2 and srv.stats(keys=True)["in_flight_keys"] == []


def test_prime_rl_gates_on_batches_shipped_not_on_groups_in_flight():
    """orchestrator.py / dispatcher.py: dispatch while (step - 1) - policy.version <= 1, step counting batches
    shipped to the trainer; in flight only the concurrency cap (max_inflight) bounds. Here: consumed + Q < 2 B."""
    srv = preset("prime-rl", B=2, N=2, param=8, pause_mode="in_place",
                 overrides=["rollout.async_max_concurrent_samples=12"])  # max_inflight: 6 groups
    assert srv.C == 2 * 2 + 1024 // 2
    gs = srv.dispatch()
    assert len(gs) == 6  # 3 B in flight: nothing shipped yet (counting in-flight groups would stop at 2 B = 4)
    srv.put(finish(gs[0], 2) + finish(gs[1], 2) + finish(gs[2], 2))
    assert seqs(srv.dispatch()) == [6, 7, 8]  # Q = 3 < 2 B: up to the cap again
    srv.put(finish(gs[3], 2))
    assert srv.stats()["Q"] == 4 and srv.dispatch() == []  # two batches shipped ahead of the weights: closed
    srv.get(2, timeout=0)
    srv.put(finish(gs[4], 2))
    assert srv.dispatch() == []  # consumed 2 + Q 3: the consumed batch counts until the weight update
    srv.boundary_aborts(Boundary.KEEP)
    srv.step_boundary([], Boundary.KEEP)
    srv.set_weight_version(1)  # the trainer's weights moved: one batch shipped ahead, Q = 3 < 2 B
    assert seqs(srv.dispatch()) == [9, 10] and srv.dispatch() == []  # open again, up to the cap of 6 generating
    srv.put(finish(gs[5], 2))
    assert srv.stats()["Q"] == 4 and srv.stats()["generating"] == 5 and srv.dispatch() == []  # the gate again
    assert strategies.PrimeRL.capacity(1, 2, 2) == srv.C


def started(version):
    """A group as keep sees it, by its start version alone (the presets' rules read no more)."""
    return SimpleNamespace(start_version=version, trajectories=[])


def judge(strategy, group, v):
    """keep's answer, heard back as the buffer carries it out (staleness.carry_out calls judged)."""
    kept = strategy.keep(group, v)
    strategy.judged(group, v, kept)
    return kept


def test_roll_filter_at_the_bound_with_the_fractional_quota():
    r = strategies.build("roll", 4, 10, True, 1.5, 2)  # ceil(alpha) = 2; the oldest step fills ceil(0.5 * 4) = 2
    v = view(B=4, C=10)
    v.version = 5
    assert all(r.keep(started(3), v) for _ in range(3))  # asking alone counts nothing
    assert (judge(r, started(4), v) and judge(r, started(3), v) and judge(r, started(3), v)
            and not judge(r, started(3), v) and not judge(r, started(2), v))
    assert r.counts["rollout/roll_slots_lost"] == 2
    r.reset()
    assert judge(r, started(3), v)
    whole = strategies.build("roll", 4, 8, True, 1.0, 2)
    assert all(judge(whole, started(4), v) for _ in range(9)) and not judge(whole, started(3), v)
    assert strategies.Roll.capacity(1.5, 4, 2) == 10  # ceil(alpha B) + B


def test_roll_drops_groups_too_old_for_the_next_weights_and_resumes_the_rest():
    srv = preset("roll", B=2, N=2, param=1)
    g0, g1, g2, g3 = srv.dispatch()  # ceil(1 * 2) + 2 = 4
    srv.put(finish(g0, 2) + finish(g1, 2))
    srv.get(2, timeout=0)
    assert srv.step_boundary([aborted(g, i) for g in (g2, g3) for i in range(2)])["rollout/restored_groups"] == 2
    srv.set_weight_version(1)
    r2, r3, g4, g5 = srv.dispatch()
    assert seqs([r2, r3, g4, g5]) == [2, 3, 4, 5]
    m = srv.step_boundary([aborted(g, i, start=g.metadata["dispatch_version"]) for g in (r2, r3, g4, g5)
                           for i in range(2)])  # next weights 2: started at 0 is 2 > ceil(alpha) old
    assert m["rollout/update_dropped_groups"] == 2 and m["rollout/restored_groups"] == 2
    assert srv.stats(keys=True)["lane_keys"] == [(0, 4), (0, 5)]
    assert srv.step_metrics()["rollout/discarded_tokens"] == 2 * 2 * 2


def test_roll_consumes_the_oldest_step_first_and_waits_for_its_running_groups():
    """ReplayBuffer.get_batch takes the oldest step first and, in ItemsGroup.get_batch, waits for that step's running
    prompts: groups of a younger step that finish first wait (held, counted in R) instead of overtaking them."""
    srv = preset("roll", B=2, N=2, param=1)
    g0, g1, g2, g3 = srv.dispatch()  # step 0
    srv.put(finish(g0, 2) + finish(g1, 2))
    srv.get(2, timeout=0)
    srv.step_boundary([aborted(g, i) for g in (g2, g3) for i in range(2)])
    srv.set_weight_version(1)
    r2, r3, g4, g5 = srv.dispatch()  # g2, g3 resumed (step 0), g4, g5 new (step 1)
    srv.put(finish(g4, 2, version=1) + finish(g5, 2, version=1))  # the younger step finishes first
    st = srv.stats(keys=True)
    assert st["Q"] == 0 and st["held_keys"] == [(0, 4), (0, 5)]
    srv.put(finish(r2, 2, version=1))
    assert srv.stats(keys=True)["buffered_keys"] == [(0, 2)]  # step 0's own groups are not held
    srv.put(finish(r3, 2, version=1))  # step 0 has nothing running: step 1 goes too
    assert srv.stats(keys=True)["buffered_keys"] == [(0, 2), (0, 3), (0, 4), (0, 5)]
    assert seqs(g.prompt for g in srv.get(2, timeout=0)) == [2, 3]


def test_roll_gives_no_slot_back_for_a_complete_group_dropped_as_stale():
    """ReplayBuffer: `completed_prompts` only grows and gc drops the finished prompts of too-old steps, so they keep
    their admission slot; a filtered group (abort) gives it back."""
    def run(status):
        srv = preset("roll", B=2, N=2, param=1)  # ceil(alpha B) + B = 4
        gs = srv.dispatch()
        srv.put(finish(gs[0], 2) + finish(gs[1], 2) + finish(gs[2], 2) + finish(gs[3], 2, status=status))
        srv.get(2, timeout=0)
        for v in (1, 2):  # the trainer does not take g2, g3 in time: at version 2 they are 2 > ceil(alpha) old
            srv.step_boundary([])
            srv.set_weight_version(v)
        return srv, srv.step_metrics()
    srv, m = run(COMPLETED)
    assert len(srv.dispatch()) == 2  # 4 - 2 slots lost
    assert m["rollout/policy_drop"] == 2 and m["rollout/roll_slots_lost"] == 2
    srv, m = run(FAILED)  # g3 dropped by the filter: its slot comes back
    assert m["rollout/policy_drop"] == 1 and m["rollout/filter_drop"] == 1
    assert len(srv.dispatch()) == 3


def test_slime_async_tops_up_to_c_generating_and_c_queued_and_resumes_aborted_groups():
    """fully_async_rollout.py _make_done_cb puts an aborted group back unchanged; sglang_rollout.py continues it from
    its partial tokens (_prepare_prompt_ids reuses sample.tokens) and skips its completed samples."""
    srv = preset("slime-async", B=2, N=2)  # C = B = 2 groups of concurrency
    g0, g1 = srv.dispatch()
    srv.put(finish(g0, 2))
    (g2,) = srv.dispatch()  # generating 1 < 2, queued 1 < 2
    srv.put(finish(g1, 2))
    assert srv.dispatch() == []  # queued 2: not below C
    done = traj(g2, 0)  # T = 3, finished before the pause
    part = aborted(g2, 1)  # T = 2 tokens generated, then aborted
    srv.put([done])
    m = srv.step_boundary([part])
    assert m["rollout/restarted_groups"] == 0 and m["rollout/restored_groups"] == 1
    assert m["rollout/partial_restored_count"] == 2 and srv.step_metrics()["rollout/discarded_tokens"] == 0
    srv.get(2, timeout=0)
    (again, new) = srv.dispatch()
    assert again.seq == 2 and new.seq == 3
    assert [t.status for t in again.partial] == [COMPLETED, ABORTED]  # the finished sample is kept as it is
    assert [t.response_ids.tolist() for t in again.partial] == [done.response_ids.tolist(),
                                                                 part.response_ids.tolist()]  # resumed from here
    srv.put(finish(again, 2))  # the rollout re-puts the finished one and completes the partial one
    assert srv.stats()["Q"] == 1 and srv.action == strategies.ABORT_RESUME


@pytest.mark.parametrize("name,over,fragment", [
    ("pipelinerl", ["rollout.partial=false"], "fully_async.sliding_window=pipelinerl (keep in place at the weight "
     "update) needs rollout.partial=true with rollout.pause_mode=in_place; got rollout.partial=false, "
     "rollout.pause_mode=abort"),
    ("slime-async", ["rollout.partial=true", "rollout.pause_mode=in_place"], "needs rollout.partial=true with "
     "rollout.pause_mode=abort; got rollout.partial=true, rollout.pause_mode=in_place"),
    ("areal", ["rollout.partial=false"], "(abort + resume partial at the weight update) needs rollout.partial=true"),
    ("verl", ["rollout.partial=true", "rollout.pause_mode=retract"], "needs rollout.partial=true with "
     "rollout.pause_mode=abort or rollout.partial=false; got"),
    ("prime-rl", ["rollout.partial=true"], "(keep in place, abort groups older than 1 at the weight update) needs "
     "rollout.partial=true with rollout.pause_mode=in_place"),
    ("prime-rl", ["rollout.partial=true", "rollout.pause_mode=in_place", "fully_async.policy_param=1.5"],
     r"fully_async.policy_param \(max_off_policy_steps M\) must be a whole number >= 0, got 1.5"),
    ("areal", ["rollout.partial=true", "fully_async.stale_steps=1"], "fully_async.stale_steps is the spec "
     "strategies' knob; the areal preset takes its eta"),
    ("windowed-fifo", ["fully_async.policy_param=2"], "fully_async.policy_param is the knob of a preset"),
    ("roll", ["rollout.partial=true", "fully_async.enable=false"], "fully_async.sliding_window=roll is a "
     "fully-async staleness policy; set fully_async.enable=true"),
])
def test_wrong_preset_combinations_are_refused_at_start_up_in_one_sentence(name, over, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment) if "\\" not in fragment else fragment):
        make_cfg(B=4, N=2, stale=0.0, window=name, overrides=over)


@pytest.mark.parametrize("name", sorted(strategies.REGISTRY))
@pytest.mark.parametrize("param", [None, 2.0])
def test_the_update_actions_config_validate_checks_are_the_built_strategys(name, param):
    """config.validate checks the update action without building the strategy (Strategy.check_action): the classmethod
    update_actions gives what an instance holds, for the default knob and another."""
    cls = strategies.REGISTRY[name]
    if not issubclass(cls, strategies.Preset):
        param = None
    C = cls.capacity(param, 4, 2) if issubclass(cls, strategies.Preset) else 8
    assert cls.update_actions(param, 4, 2) == strategies.build(name, 4, C, True, param, 2).actions


def test_spec_strategies_take_any_update_action_and_presets_cite_their_source():
    for name in ("no-window", "window-gated", "windowed-fifo"):
        assert strategies.REGISTRY[name].actions == ()
    assert make_server(window="windowed-fifo", overrides=["rollout.partial=true", "rollout.pause_mode=retract"]
                       ).action == strategies.UpdateAction("retract")
    for name in strategies.PRESETS:
        assert issubclass(strategies.REGISTRY[name], strategies.Preset)
        assert re.search(r"\(\S+\.py", strategies.REGISTRY[name].__doc__), name  # names the file it is read from


def test_presets_declare_their_peers_loss_and_mask_only_where_the_peer_uses_it():
    import batching
    import losses

    want = {"areal": ("decoupled_ppo", False), "verl": ("ppo", False), "pipelinerl": ("truncated_is", False),
            "prime-rl": ("ppo", False), "roll": ("ppo", False), "slime-async": ("ppo", None)}
    assert set(want) == set(strategies.PRESETS)
    for name in strategies.PRESETS:
        cls = strategies.REGISTRY[name]
        assert (cls.policy_loss, cls.offpolicy_mask) == want[name], name
        assert cls.policy_loss in losses.POLICY_LOSSES
        action = (cls.actions or cls(4, 8, None, 2).actions)[0]
        partial, mode = action.rollout_settings
        cfg = make_cfg(B=4, N=2, stale=0.0, window=name, overrides=[
            f"rollout.partial={str(partial).lower()}", f"rollout.pause_mode={mode}",
            "rollout.mask_offpolicy_in_partial_rollout=true" if partial else "rollout.partial=false",
            *strategies.peer_overrides(name)])
        assert strategies.pairing_note(name, cfg.algorithm.policy_loss,
                                       cfg.rollout.mask_offpolicy_in_partial_rollout) is None, name
        # an in-place trajectory that spans a weight update (versions 0, 0, 1): the peer's mask setting decides
        seq = {"prompt": [1, 2], "response": [3, 4, 5], "mask": [1, 1, 1], "rollout_lp": [-1.0] * 3,
               "versions": [0, 0, 1], "adv": 1.0}
        kept = batching.collate([seq], cfg.rollout.mask_offpolicy_in_partial_rollout)["mask"].sum()
        assert kept == (1 if name == "slime-async" else 3), name  # slime-async keeps tiny.yaml's mask (optional)
    note = strategies.pairing_note("areal", "ppo", True)  # tiny.yaml's loss under areal
    assert "algorithm.policy_loss=ppo (its peer trains with decoupled_ppo or loglinear)" in note
    assert strategies.pairing_note("areal", "loglinear", False) is None  # AReaL's other proximal policy
    assert "(its peer trains with truncated_is)" in strategies.pairing_note("pipelinerl", "decoupled_ppo", False)
    assert "rollout.mask_offpolicy_in_partial_rollout=true (its peer: false)" in note
    assert strategies.pairing_note("slime-async", "ppo", False) is None
    assert strategies.pairing_note("windowed-fifo", "truncated_is", True) is None  # the spec's rules pair with any


def test_areal_preset_gives_areal_papers_decoupled_loss_and_pipelinerl_its_normalisation():
    """AReaL's paper: decoupled PPO with the behaviour weight masked above 5 (algorithm.decoupled_ppo's defaults);
    tiny.yaml turns algorithm.is_correction on, which decoupled_ppo refuses, and the preset's overrides turn it off.
    PipelineRL divides by the sequences of a step: its overrides set that aggregation."""
    import config

    cfg = config.load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        "fully_async.sliding_window=areal", "fully_async.stale_steps=0", *strategies.peer_overrides("areal")])
    assert cfg.algorithm.policy_loss == "decoupled_ppo" and cfg.algorithm.is_correction.enable is False
    assert cfg.algorithm.decoupled_ppo.behav_imp_weight_cap == 5.0
    assert cfg.algorithm.decoupled_ppo.behav_imp_weight_action == "mask"
    cfg = config.load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
        "fully_async.sliding_window=pipelinerl", "fully_async.stale_steps=0", "rollout.pause_mode=in_place",
        *strategies.peer_overrides("pipelinerl")])
    assert cfg.algorithm.policy_loss == "truncated_is" and cfg.algorithm.loss_agg_mode == "seq-mean-token-sum"
    assert strategies.peer_overrides("verl") == ["algorithm.policy_loss=ppo",
                                                 "rollout.mask_offpolicy_in_partial_rollout=false"]


def test_a_preset_run_with_another_peers_loss_says_so_once_at_start_up(tmp_path, monkeypatch, capsys):
    import train

    def stop(*args, **kwargs):
        raise RuntimeError("stopped after start-up")

    monkeypatch.setattr(train.dist, "init_process_group", stop)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # main() would set it for a plain `python train.py`
    base = ["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "trainer.num_gpus_per_node=1",
            f"model.path={tmp_path}/model", "fully_async.sliding_window=pipelinerl",
            "fully_async.stale_steps=0", "rollout.pause_mode=in_place"]
    for i, (extra, lines) in enumerate((([], 1), (strategies.peer_overrides("pipelinerl"), 0))):
        with pytest.raises(RuntimeError, match="stopped after start-up"):  # (this process keeps run_dir's lock)
            train.main(base + [f"run_dir={tmp_path}/run{i}"] + extra)
        out = capsys.readouterr().out
        assert out.count("fully_async.sliding_window=pipelinerl runs with") == lines, out


def test_prime_rl_through_train_py_aborts_stale_groups_and_accounts_for_every_prompt(tmp_path):
    """torchrun train.py with the prime-rl preset at M = 0 on the CPU default (standins/engine.py, 2 ranks): in-place
    pauses, and before each one the rollout aborts every group started under older weights (buffer.boundary_aborts), and
    the buffer drops older buffered groups. Every dispatched prompt is trained exactly once, counted as dropped, or in
    the last checkpoint (its restored lane or its buffered groups)."""
    import subprocess

    import checkpoint
    from standins import tiny_model
    from test_train import TINY, TORCHRUN, _read_rows, _run_overrides, held_prompts

    model = tiny_model.make_tiny_model(str(tmp_path / "model"))
    run_dir = tmp_path / "run"
    p = subprocess.run([*TORCHRUN, "train.py", "--config", TINY, *_run_overrides(run_dir, model),
                        "trainer.eval_freq=0", "trainer.save_freq=0", "trainer.export_hf=false",
                        "data_source.num_prompts=20", "trainer.total_steps=4", "fully_async.sliding_window=prime-rl",
                        "fully_async.stale_steps=0", "fully_async.policy_param=0", "rollout.pause_mode=in_place",
                        "rollout.mask_offpolicy_in_partial_rollout=false", "rollout.sampling.max_new_tokens=64",
                        # 4 requests at a time on the engine: groups are still generating when the step ends
                        "rollout.sglang_args.max_running_requests=4", "rollout.async_max_concurrent_samples=null"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [row for row in _read_rows(run_dir) if row["step"] > 0]
    trained = [tuple(pid) for row in rows for pid in row["data/prompt_ids"]]
    assert len(trained) == 16 and len(set(trained)) == 16, trained
    dropped = sum(row[k] for row in rows for k in ("rollout/filter_drop", "rollout/staleness_drop",
                                                   "rollout/policy_drop", "rollout/update_dropped_groups"))
    buffer_state = checkpoint.load_run_state(checkpoint.latest_checkpoint(str(run_dir)))["buffer"]
    state = buffer_state["data"]
    pending = held_prompts(buffer_state)
    assert not pending & set(trained)
    assert len(trained) + dropped + len(pending) == state["next_seq"], (len(trained), dropped, pending, state)
    assert all(row["rollout/staleness_max"] == 0 for row in rows)  # M = 0: nothing older than the trainer's weights
    # Dispatch is eager, so at each boundary groups beyond the step's batch exist: aborted in flight or dropped
    # from the buffer at the update (which of the two depends on timing; their sum does not vanish)
    assert sum(row["rollout/update_dropped_groups"] + row["rollout/policy_drop"] for row in rows) > 0


class _FakeRollout:
    """A seeded producer for one PipelineServer, the way rollout.Rollout drives it: dispatch, put some trajectories
    (some groups only partly), the trainer takes B groups a step, then the boundary of rollout.partial /
    rollout.pause_mode, or the pause before a checkpoint (Rollout.pause(checkpoint=True)). `trace` is what the
    buffer did: the groups dispatched, trained and dropped, step by step."""

    def __init__(self, srv, seed, partial, mode):
        self.srv, self.rng, self.partial, self.mode = srv, random.Random(seed), partial, mode
        self.groups, self.pending, self.trace, self.version = {}, {}, [], 0

    def step(self, checkpoint=False):
        srv, B, consumed, out = self.srv, self.srv.B, 0, []
        for _ in range(1000):
            if consumed == B:
                break
            for g in srv.dispatch():
                self.groups[g.prompt_id], self.pending[g.prompt_id] = g, set(range(srv.N))
                out.append(("dispatch", g.prompt_id, len(g.partial)))
            for key in sorted(self.pending):
                if self.rng.random() < 0.4:
                    idx = set(sorted(self.pending[key])[:1]) if self.rng.random() < 0.5 else self.pending[key]
                    self._finish(key, idx)
            take = min(B - consumed, srv.stats()["Q"])
            if take:
                got = srv.get(take, timeout=0)
                out.append(("trained", [g.prompt_id for g in got]))
                consumed += take
            elif self.pending:
                self._finish(min(self.pending), self.pending[min(self.pending)])
        else:
            raise AssertionError("the schedule made no progress")
        kind = staleness.boundary_kind(self.partial, self.mode, checkpoint)
        stale = srv.boundary_aborts(kind)
        if kind == Boundary.DRAIN:  # the pause waits for everything
            for key in sorted(self.pending):
                self._finish(key, self.pending[key])
            m = srv.step_boundary([], kind)
        elif kind != Boundary.KEEP:  # abort, checkpoint: every request aborted
            back = [aborted(self.groups[k], i, start=self.version, end=self.version) for k in sorted(self.pending)
                    for i in sorted(self.pending[k])]
            m = srv.step_boundary(back, kind)
            self.groups, self.pending = {}, {}
        else:
            m = srv.step_boundary([aborted(self.groups[k], i, start=self.version, end=self.version) for k in stale
                                   for i in sorted(self.pending.get(k, ()))], kind)
            for k in stale:
                self.pending.pop(k, None)
        out.append(("boundary", {k: v for k, v in m.items() if v}))
        out.append(("metrics", {k: v for k, v in srv.step_metrics().items() if v and k.endswith(
            ("_drop", "dropped_groups", "discarded_tokens", "collected_groups", "consumed_groups", "_size"))}))
        self.trace.append(out)

    def update(self):
        self.version += 1
        self.srv.set_weight_version(self.version)

    def _finish(self, key, idx):
        self.srv.put([t for t in finish(self.groups[key], self.srv.N, version=self.version) if t.index in idx])
        self.pending[key] = self.pending[key] - set(idx)
        if not self.pending[key]:
            del self.pending[key]


@pytest.mark.parametrize("name", sorted(strategies.REGISTRY))
def test_a_resumed_buffer_goes_on_as_the_one_that_saved_the_checkpoint(name):
    """Every strategy, in each update action it accepts: the same seeded schedule drives a buffer through a
    checkpoint boundary and on, and drives a second one resumed from that checkpoint (the state through
    torch.load(weights_only=True), its first weight update as train.main does it): from the boundary on, both
    dispatch, restore, train and drop the same groups (a resumed run behaves as the uninterrupted one would)."""
    cls = strategies.REGISTRY[name]
    C = cls.capacity(None, 2, 2) if issubclass(cls, strategies.Preset) else 4
    actions = strategies.build(name, 2, C, True, None, 2).actions  # (a preset may set its own in __init__)
    settings = [a.rollout_settings for a in actions] or [(True, "abort"), (True, "retract"), (False, "abort")]
    for partial, mode in settings:
        def server():
            if issubclass(cls, strategies.Preset):
                return preset(name, B=2, N=2, pause_mode=mode, partial=partial)
            over = [f"rollout.partial={str(partial).lower()}", f"rollout.pause_mode={mode}"]
            return make_server(B=2, N=2, stale=1.0, window=name, overrides=over, n_prompts=40)

        a = _FakeRollout(server(), 7, partial, mode)
        for step in range(3):
            a.step()
            a.update()
        a.step(checkpoint=True)
        f = io.BytesIO()
        torch.save(a.srv.state_dict(), f)
        f.seek(0)
        assert a.srv.stats()["R"] == 0 or not partial  # a checkpoint boundary leaves nothing in flight
        b = _FakeRollout(server(), None, partial, mode)
        b.srv.load_state_dict(torch.load(f, weights_only=True))
        b.rng.setstate(a.rng.getstate())
        b.version, mark = a.version, len(a.trace)
        for run in (a, b):
            run.update()
            for step in range(4):
                run.step()
                run.update()
        assert a.trace[mark:] == b.trace, (name, partial, mode)
