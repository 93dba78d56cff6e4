"""buffer.py: data source, queues, collector, step boundary, checkpoints, threads and RPC.

Run: python -m pytest -q tests/test_buffer.py   (property tests of the strategies live in test_strategies.py)
"""
import io
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

import buffer
import config
import remote
import staleness
from buffer import ABORTED, COMPLETED, FAILED, TRUNCATED, DataSource, PipelineBuffer, PipelineServer, Trajectory
from services import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------------------
# Helpers shared with test_strategies.py
# ---------------------------------------------------------------------------------------------------------

def make_cfg(B=4, N=2, stale=1.0, window="no-window", fully_async=True, overrides=(), sources=None):
    data = {"colocate": not fully_async,
            "fully_async": {"enable": fully_async, "sliding_window": window, "stale_steps": stale},
            "data_source": {"num_prompts_per_step": B, "num_trajectories_per_prompt": N},
            "trainer": {"mini_batch_size": N}}
    if sources is not None:
        data["data_source"] = sources
    data = config._merge(data, config.parse_overrides(list(overrides)))
    return config.validate(config.from_dict(data))


def make_prompts(n=20, sources=1):
    return [[{"prompt_ids": [s, i, i + 1], "label": f"{s}-{i}", "metadata": {"row": i}} for i in range(n)]
            for s in range(sources)]


def make_server(B=4, N=2, stale=1.0, window="no-window", fully_async=True, overrides=(), n_prompts=20,
                thread=False, sources=None):
    cfg = make_cfg(B, N, stale, window, fully_async, overrides, sources)
    return PipelineServer(cfg, make_prompts(n_prompts, len(cfg.data_source)), collector_thread=thread)


def traj(g, i, reward=None, status=COMPLETED, start=0, end=None, T=3):
    """Trajectory i of group g; its response encodes (seq, i) so tests can check what arrives where."""
    end = start if end is None else end
    return Trajectory(g.epoch, g.seq, i, g.prompt_ids, response_ids=torch.tensor([g.seq, i] + [7] * (T - 2)),
                      rollout_log_probs=torch.full((T,), -0.5), versions=torch.full((T,), end, dtype=torch.long),
                      loss_mask=torch.ones(T, dtype=torch.long), reward=float(i if reward is None else reward),
                      status=status, start_version=start, end_version=end)


def finish(g, n, rewards=None, status=COMPLETED, version=0):
    """What the rollout puts for group g: finished partial trajectories as they are, the others generated now."""
    out = []
    for i in range(n):
        p = g.partial[i] if g.partial else None
        if p is not None and p.status != ABORTED:
            out.append(p)
        else:
            out.append(traj(g, i, None if rewards is None else rewards[i], status, start=version))
    return out


def aborted(g, i, start=0, end=0):
    t = traj(g, i, status=ABORTED, start=start, end=end, T=2)
    t.reward = 0.0
    return t




# ---------------------------------------------------------------------------------------------------------
# DataSource
# ---------------------------------------------------------------------------------------------------------

def test_data_source_epochs_are_seeded_permutations():
    prompts = make_prompts(10)
    a = DataSource(prompts, [1.0], [7], [True])
    b = DataSource(prompts, [1.0], [7], [True])
    ga = [a.pop() for _ in range(25)]
    gb = [b.pop() for _ in range(25)]
    assert [g.data_index for g in ga] == [g.data_index for g in gb]  # deterministic
    assert [g.seq for g in ga] == list(range(25))  # monotonic, one per group
    assert [g.epoch for g in ga] == [0] * 10 + [1] * 10 + [2] * 5
    e0, e1 = [g.data_index for g in ga[:10]], [g.data_index for g in ga[10:20]]
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1  # each row once per epoch, reshuffled
    assert e0 != [g.data_index for g in [DataSource(prompts, [1.0], [8], [True]).pop() for _ in range(10)]]
    plain = DataSource(prompts, [1.0], [7], [False])
    assert [plain.pop().data_index for _ in range(10)] == list(range(10))
    g = ga[3]
    assert g.prompt_ids.tolist() == prompts[0][g.data_index]["prompt_ids"] and g.label == f"0-{g.data_index}"
    with pytest.raises(ValueError, match=r"data_source\[1\]"):
        DataSource([prompts[0], []], [1.0, 1.0], [0, 0], [True, True])


def test_data_source_mixes_sources_by_weight():
    ds = DataSource(make_prompts(50, sources=3), [3.0, 1.0, 0.0001], [0, 1, 2], [True] * 3)
    picks = [ds.pop().source for _ in range(400)]
    assert picks.count(0) == 300 and picks.count(1) == 100 - picks.count(2) and picks.count(2) <= 1
    assert picks[:4].count(0) == 3  # smooth round-robin: proportions hold in every window, not just on average


def test_restored_lane_goes_first_oldest_first_and_keeps_its_prompt_id():
    ds = DataSource(make_prompts(10), [1.0], [0], [True])
    gs = [ds.pop() for _ in range(4)]
    ds.restore([gs[2], gs[0]])
    assert ds.peek_seq() == 0
    assert [ds.pop().prompt_id for _ in range(3)] == [(0, 0), (0, 2), (0, 4)]


def test_data_source_state_dict_resumes_the_same_order():
    prompts = make_prompts(7)
    a = DataSource(prompts, [1.0], [3], [True])
    for _ in range(9):
        a.pop()
    sd = a.state_dict([])
    b = DataSource(prompts, [1.0], [3], [True])
    b.load_state_dict(sd)
    assert [(g.epoch, g.seq, g.data_index) for g in (a.pop() for _ in range(10))] == \
        [(g.epoch, g.seq, g.data_index) for g in (b.pop() for _ in range(10))]
    with pytest.raises(ValueError, match="data_source"):
        DataSource(make_prompts(8), [1.0], [3], [True]).load_state_dict(sd)


# ---------------------------------------------------------------------------------------------------------
# Queues, collector, filters, staleness
# ---------------------------------------------------------------------------------------------------------

def test_pipeline_buffer_is_bounded_and_hands_out_oldest_first():
    srv = make_server()
    gs = srv.dispatch()
    pb = PipelineBuffer(max_groups=3)
    for g in (gs[2], gs[0], gs[1]):
        pb.put(buffer.Group(g, []))
    with pytest.raises(RuntimeError, match="full"):
        pb.put(buffer.Group(gs[3], []))
    assert [g.prompt_id for g in pb.pop(2)] == [(0, 0), (0, 1)]


def test_trajqueue_assembles_groups_and_counts_duplicates_and_late_arrivals():
    srv = make_server(B=2, N=3, stale=0.0)
    g0, g1 = srv.dispatch()
    srv.put([traj(g0, 0), traj(g0, 2)])
    st = srv.stats()
    assert (st["R"], st["Q"], st["generating"], st["trajqueue_trajectories"]) == (2, 0, 2, 2)
    srv.put([traj(g0, 0)])  # duplicate: ignored
    srv.put([traj(g0, 1)])
    assert srv.stats()["Q"] == 1
    srv.put([traj(g0, 1)])  # its group is gone already: late
    m = srv.step_metrics()
    assert m["rollout/late_drop"] == 2 and m["rollout/collected_groups"] == 1
    with pytest.raises(ValueError, match="num_trajectories_per_prompt"):
        srv.put([traj(g1, 3)])
    bad = traj(g1, 0)
    bad.versions = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="versions"):
        srv.put([bad])
    bad = traj(g1, 0, status="done")
    with pytest.raises(ValueError, match="status"):
        srv.put([bad])
    with pytest.raises(ValueError, match="step_boundary"):
        srv.put([aborted(g1, 0)])


def test_filters_drop_failed_and_equal_reward_groups_and_count_them():
    srv = make_server(B=4, N=2, overrides=["rollout.filter=[failed, all_equal_reward]"])
    gs = srv.dispatch()
    srv.put(finish(gs[0], 2))  # rewards 0, 1: kept
    srv.put([traj(gs[1], 0), traj(gs[1], 1, status=FAILED)])
    srv.put(finish(gs[2], 2, rewards=[1.0, 1.0]))
    srv.put(finish(gs[3], 2, status=TRUNCATED))  # truncated is a normal finish
    m = srv.step_metrics()
    assert m["rollout/filter_drop"] == 2 and m["rollout/collected_groups"] == 2
    assert [g.prompt_id for g in srv.get(2, timeout=0)] == [(0, 0), (0, 3)]
    keep_equal = make_server(B=1, N=2, stale=0.0)  # default filter: failed only
    (g,) = keep_equal.dispatch()
    keep_equal.put(finish(g, 2, rewards=[0.0, 0.0]))
    assert keep_equal.stats()["Q"] == 1


def test_every_drop_has_one_reason_and_is_counted_by_it():
    """staleness.decide decides every drop (filter, max_weight_staleness, strategy, stale_after, incomplete);
    staleness.carry_out counts each once, under its one name (staleness.DROP_METRICS)."""
    assert set(staleness.DROP_METRICS) == {"filter", "max_weight_staleness", "strategy", "stale_after", "incomplete"}
    srv = make_server(B=4, N=2, stale=1.0, overrides=["rollout.max_weight_staleness=1"])
    gs = srv.dispatch()
    srv.set_weight_version(2)
    srv.put([traj(gs[0], 0), traj(gs[0], 1, status=FAILED)])  # filter
    srv.put([traj(gs[1], 0, start=0, end=2), traj(gs[1], 1, start=2)])  # 2 - 0 > 1: max_weight_staleness
    srv.put([traj(gs[2], 0, start=2)])  # 1 of 2 arrived: incomplete at the step boundary
    m = srv.step_metrics()
    assert m["rollout/filter_drop"] == 1
    assert m["rollout/staleness_drop"] == 1
    assert not [k for k in m if k.startswith("rollout/drop_")]  # the one name per reason, no second one
    m = srv.step_boundary([aborted(gs[2], 1, start=2, end=2)] + [aborted(gs[k], i) for k in (3,) for i in range(2)])
    assert m["rollout/restored_groups"] == 2  # gs[2] is complete with the returned one, gs[3] too
    m = srv.step_metrics()
    assert m["rollout/partial_dropped_incomplete_groups"] == 0
    gs = srv.dispatch()
    srv.put([traj(gs[0], 0, start=2)])
    m = srv.step_boundary([])
    assert m["rollout/partial_dropped_incomplete_groups"] == 1
    assert srv.step_metrics()["rollout/partial_dropped_incomplete_groups"] == 1
    group = buffer.Group(gs[0], [None, None])
    assert staleness.decide(srv, staleness.IN_FLIGHT, group) == staleness.Verdict(staleness.REQUEUE,
                                                                                   "nothing generated")
    assert staleness.decide(srv, staleness.KEPT_IN_FLIGHT, group,
                            aborted=frozenset([group.prompt_id])).reason == "stale_after"


def test_max_weight_staleness_drops_at_collection_and_in_the_buffer():
    srv = make_server(B=4, N=2, overrides=["rollout.max_weight_staleness=1"])
    gs = srv.dispatch()
    srv.set_weight_version(2)
    srv.put([traj(gs[0], 0, start=0, end=2), traj(gs[0], 1, start=2)])  # 2 - 0 > 1: dropped
    srv.put([traj(gs[1], 0, start=1, end=2), traj(gs[1], 1, start=2)])  # 2 - 1 = 1: kept
    srv.put(finish(gs[2], 2, version=2))
    assert srv.stats()["Q"] == 2 and srv.step_metrics()["rollout/staleness_drop"] == 1
    srv.set_weight_version(3)  # gs[1] now has 3 - 1 = 2 > 1: leaves PipelineBuffer
    assert srv.stats()["Q"] == 1 and srv.step_metrics()["rollout/staleness_drop"] == 1
    with pytest.raises(ValueError, match="only grow"):
        srv.set_weight_version(1)
    never_started = make_server(B=1, N=1, stale=0.0, overrides=["rollout.max_weight_staleness=0"])
    (g,) = never_started.dispatch()
    never_started.set_weight_version(5)
    never_started.put([traj(g, 0, status=FAILED, start=-1)])  # nothing generated: no staleness, the filter drops it
    assert never_started.step_metrics()["rollout/filter_drop"] == 1


def test_get_times_out_naming_what_is_missing_and_checks_k():
    srv = make_server(B=4, N=2, window="windowed-fifo")
    gs = srv.dispatch()
    srv.put(finish(gs[0], 2))
    srv.put(finish(gs[5], 2))  # 5 - 1 >= B: held in TrajQueue
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        srv.get(2, timeout=0.05)
    assert time.monotonic() - t0 < 1.0
    msg = str(err.value)
    for part in ("wanted 2 groups", "1 buffered", "R=7", "6 still generating", "1 complete but held", "C=8",
                 "buffer.get_timeout_s"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match="1..8"):
        srv.get(9, timeout=0)
    with pytest.raises(ValueError, match="1..8"):
        srv.get(0, timeout=0)


def test_consumed_groups_report_partial_ratio_span_and_staleness():
    srv = make_server(B=2, N=2, stale=0.0)
    g0, g1 = srv.dispatch()
    srv.set_weight_version(3)
    srv.put([traj(g0, 0, start=1, end=3), traj(g0, 1, start=3)])
    srv.put([traj(g1, 0, start=2, end=3), traj(g1, 1, start=-1, status=FAILED)])  # dropped: failed
    srv.get(1, timeout=0)
    m = srv.step_metrics()
    assert m["rollout/partial_ratio"] == 0.5 and m["rollout/partial_span_max"] == 2
    assert m["rollout/staleness_max"] == 2 and m["rollout/staleness_mean"] == 1.0
    assert m["rollout/consumed_groups"] == 1 and m["rollout/filter_drop"] == 1
    assert "rollout/partial_ratio" not in srv.step_metrics()  # popped


def test_step_metrics_show_every_bound():
    srv = make_server(B=4, N=2, stale=1.5, overrides=["rollout.async_max_concurrent_samples=6"])
    m = srv.step_metrics()
    assert m["rollout/capacity"] == 10 and m["rollout/pipeline_buf_max"] == 10
    assert m["rollout/trajqueue_max_groups"] == 10 and m["rollout/max_generating_groups"] == 3
    assert m["rollout/pipeline_buf_size"] == 0 and m["rollout/in_flight_groups"] == 0
    assert len(srv.dispatch()) == 3  # 6 // N = 3 groups generating at most


# ---------------------------------------------------------------------------------------------------------
# Step boundary
# ---------------------------------------------------------------------------------------------------------

def test_step_boundary_restores_complete_groups_drops_incomplete_ones():
    srv = make_server(B=2, N=3, stale=1.0)
    g0, g1, g2, g3 = srv.dispatch()
    srv.put(finish(g0, 3))  # collected, stays in PipelineBuffer
    srv.put([traj(g1, 0)])  # g1: one finished + two aborted partials = complete -> restored
    srv.put([traj(g2, 1)])  # g2: one finished + one aborted, one missing -> dropped
    returned = [aborted(g1, 1), aborted(g1, 2), aborted(g2, 0)]  # g3: nothing came back -> requeued as it was
    m = srv.step_boundary(returned)
    assert m["rollout/partial_restored_count"] == 3 and m["rollout/partial_dropped_incomplete_count"] == 2
    assert m["rollout/partial_dropped_incomplete_groups"] == 1 and m["rollout/requeued_unstarted_groups"] == 1
    assert m["rollout/pipeline_buf_size"] == 1
    st = srv.stats(keys=True)
    assert st["R"] == 0 and st["trajqueue_trajectories"] == 0 and st["lane_keys"] == [(0, 1), (0, 3)]
    r1, r3, fresh = srv.dispatch()  # lane first, then fresh prompts; C - Q = 3
    assert (r1.prompt_id, r3.prompt_id, fresh.prompt_id) == ((0, 1), (0, 3), (0, 4))
    assert [t.status for t in r1.partial] == [COMPLETED, ABORTED, ABORTED] and r3.partial == []
    assert r1.partial[0].response_ids.tolist() == [1, 0, 7]
    srv.put(finish(r1, 3, version=1))
    (grp,) = [g for g in srv.get(2, timeout=0) if g.prompt_id == (0, 1)]
    assert grp.trajectories[0].start_version == 0 and grp.trajectories[2].start_version == 1
    srv.put(finish(fresh, 3))
    srv.put([traj(g2, 0)])  # late: g2 was dropped
    assert srv.step_metrics()["rollout/late_drop"] == 1


def test_restored_group_whose_trajectories_all_finished_flows_through():
    """windowed-fifo: a finished group held outside the window at the boundary is restored; the rollout returns
    its trajectories as they are when it is dispatched again, and the trainer gets it."""
    srv = make_server(B=2, N=2, stale=1.0, window="windowed-fifo")
    gs = srv.dispatch()
    srv.put(finish(gs[3], 2))  # 3 - 0 >= B: held
    assert srv.stats()["held"] == 1
    m = srv.step_boundary([aborted(g, i) for g in gs[:3] for i in range(2)])
    assert m["rollout/restored_groups"] == 4 and m["rollout/partial_restored_count"] == 8
    again = srv.dispatch()
    assert [g.seq for g in again] == [0, 1, 2, 3] and all(t.status == COMPLETED for t in again[3].partial)
    srv.put(finish(again[3], 2))  # returned as-is: still held (0 is uncompleted)
    for g in again[:3]:
        srv.put(finish(g, 2))
    assert [g.prompt_id for g in srv.get(4, timeout=0)] == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_synchronous_mode_tops_up_dropped_groups_and_mixes_sources():
    srv = make_server(B=4, N=2, fully_async=False, overrides=["rollout.sampler.num_oversample=2",
                                                             "rollout.filter=[failed, all_equal_reward]"],
                      sources=[{"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2, "weight": 1.0},
                               {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2, "weight": 1.0,
                                "seed": 1}])
    gs = srv.dispatch()
    assert len(gs) == 6 and srv.dispatch() == []  # B + num_oversample
    assert sorted(g.source for g in gs) == [0, 0, 0, 1, 1, 1]
    srv.put(finish(gs[0], 2, rewards=[1.0, 1.0]))  # dropped by the filter: one more may go out
    assert len(srv.dispatch()) == 1
    for g in gs[1:5]:
        srv.put(finish(g, 2))
    srv.get(4, timeout=0)
    assert srv.dispatch() == []  # consuming does not free a slot within the step
    srv.step_boundary([aborted(gs[5], 0), aborted(gs[5], 1)])
    assert len(srv.dispatch()) == 6  # new step: one restored (gs[5]), the lane first, five more


# ---------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------

def test_state_dict_is_plain_data_for_torch_load_weights_only():
    srv = make_server(B=2, N=2, stale=1.0)
    gs = srv.dispatch()
    srv.put(finish(gs[0], 2))
    srv.put([traj(gs[1], 0)])
    srv.step_boundary([aborted(gs[1], 1)])
    srv.set_weight_version(4)
    f = io.BytesIO()
    torch.save(srv.state_dict(), f)
    f.seek(0)
    sd = torch.load(f, weights_only=True)
    fresh = make_server(B=2, N=2, stale=1.0)
    fresh.load_state_dict(sd)
    st = fresh.stats(keys=True)
    assert st["weight_version"] == 4 and st["lane_keys"] == [(0, 1), (0, 2), (0, 3)]
    assert st["buffered_keys"] == [(0, 0)]  # complete, not trained yet: back in PipelineBuffer as it was
    assert [t.response_ids.tolist() for t in fresh.get(1, timeout=0)[0].trajectories] == [[0, 0, 7], [0, 1, 7]]
    replayed = fresh.dispatch()
    assert [t.status for t in replayed[0].partial] == [COMPLETED, ABORTED] and replayed[1].partial == []
    assert torch.equal(replayed[0].partial[0].response_ids, torch.tensor([1, 0, 7]))
    with pytest.raises(RuntimeError, match="idle"):
        fresh.load_state_dict(sd)
    with pytest.raises(ValueError, match="format"):
        make_server(B=2, N=2).load_state_dict({"format": 99})


def _rich(g, i, start=0):
    """Trajectory i of group g, aborted mid-episode, with every field a checkpoint must carry: a multi-turn
    episode's env_turns / env_spans, routes (uint8, [P + T - 1, layers, top-k]), mixed per-token versions."""
    t = aborted(g, i, start=start, end=start + 1)
    t.response_ids, t.loss_mask = torch.tensor([g.seq, i, 5, 6, 9]), torch.tensor([1, 1, 0, 0, 1])
    t.rollout_log_probs = torch.tensor([-0.25, -0.5, 0.0, 0.0, -1.5])
    t.versions = torch.tensor([start, start, start, start, start + 1])
    t.routed_experts = torch.arange((3 + 5 - 1) * 2 * 2, dtype=torch.uint8).reshape(7, 2, 2)
    t.metadata = {"env_turns": [["1=", "=5\n"]], "env_spans": [[2, 4]], "attempts": 2,
                  "finish_reason": {"type": "abort", "message": None}}
    return t


def _same(a: Trajectory, b: Trajectory) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) if isinstance(getattr(a, f), torch.Tensor)
               else getattr(a, f) == getattr(b, f) for f in vars(a))


def test_a_boundary_before_a_checkpoint_restores_kept_groups_whole_into_a_weights_only_state():
    """rollout.pause_mode in_place (retract alike) with a checkpoint due: the pause aborted every request and handed
    every unfinished trajectory back (Rollout.pause(checkpoint=True)). The groups boundary_aborts(checkpoint) names,
    those keeping would drop (abort by staleness, prime-rl M=1), are dropped; every other group in flight
    goes to the restored lane with all N trajectories (put, partial or never started). The state holds each one
    field for field through torch.load(weights_only=True), and a resumed buffer hands them out first, with the
    weight version they were dispatched under."""
    def server():
        return make_server(B=2, N=3, stale=0.0, window="prime-rl", n_prompts=40,
                           overrides=["rollout.partial=true", "rollout.pause_mode=in_place",
                                      "fully_async.policy_param=1", "rollout.async_max_concurrent_samples=12"])

    srv = server()
    g0, g1, g2, g3 = srv.dispatch()
    srv.put(finish(g0, 3))
    srv.get(1, timeout=0)
    assert srv.boundary_aborts(staleness.Boundary.KEEP) == []
    srv.step_boundary([], staleness.Boundary.KEEP)  # a boundary without a checkpoint: g1, g2, g3 kept in flight
    srv.set_weight_version(1)
    g4, = srv.dispatch(1)  # dispatched under version 1
    srv.put([traj(g1, 0)] + finish(g2, 3) + [traj(g4, 2, start=1)])  # g2 complete: buffered
    assert srv.boundary_aborts("checkpoint") == [(0, 1), (0, 3)]  # started under version 0: 2 - 0 > M; g4: 2 - 1 = 1
    back = [_rich(g1, 1), _rich(g1, 2)] + [_rich(g3, i) for i in range(3)] + [_rich(g4, 0, start=1)]
    back.append(aborted(g4, 1, start=-1, end=-1))  # a request that had generated nothing
    m = srv.step_boundary(back, staleness.Boundary.CHECKPOINT)
    assert m["rollout/update_dropped_groups"] == 2 and m["rollout/restored_groups"] == 1
    assert m["rollout/kept_in_flight_groups"] == 0 and m["rollout/partial_restored_count"] == 3
    st = srv.stats(keys=True)
    assert st["in_flight_keys"] == [] and st["lane_keys"] == [(0, 4)] and st["buffered_keys"] == [(0, 2)]
    f = io.BytesIO()
    torch.save(srv.state_dict(), f)
    f.seek(0)
    fresh = server()
    fresh.load_state_dict(torch.load(f, weights_only=True))
    assert fresh.stats(keys=True)["buffered_keys"] == [(0, 2)]  # complete: back where it was, as it was
    assert all(_same(a, b) for a, b in zip(fresh.pbuf.groups()[0].trajectories, finish(g2, 3)))
    fresh.set_weight_version(2)  # asked about at the resumed run's first weight update, as it would have been
    assert fresh.stats(keys=True)["buffered_keys"] == [] and fresh.step_metrics()["rollout/policy_drop"] == 1
    second, = fresh.dispatch(1)  # in flight: continued, with the version it was dispatched under
    assert second.prompt_id == (0, 4) and second.metadata["dispatch_version"] == 1
    saved = [back[5], back[6], traj(g4, 2, start=1)]  # by index: partial, nothing generated, put
    assert [t.index for t in second.partial] == [0, 1, 2]
    assert all(_same(a, b) for a, b in zip(second.partial, saved))
    assert second.partial[0].routed_experts.dtype == torch.uint8


def test_a_checkpoint_boundary_restores_a_complete_group_the_window_holds_in_flight():
    """windowed-fifo keeps a complete group outside its window in flight (in TrajQueue, not collected): a
    checkpoint boundary of a keeping pause (retract / in_place; nothing of it was handed back, all of it was put)
    restores it whole, as put, with the unfinished group and its handed-back trajectories (it raised KeyError)."""
    srv = make_server(B=2, N=2, window="windowed-fifo", n_prompts=40,
                      overrides=["rollout.partial=true", "rollout.pause_mode=retract"])
    g0, g1, g2, g3 = srv.dispatch()
    srv.put(finish(g1, 2) + finish(g2, 2) + finish(g3, 2))  # g2, g3: seq - oldest uncompleted (g0) >= B, held
    assert srv.stats()["held"] == 2
    back = [aborted(g0, 0), aborted(g0, 1)]
    assert srv.boundary_aborts(staleness.Boundary.CHECKPOINT) == []
    m = srv.step_boundary(back, staleness.Boundary.CHECKPOINT)
    assert m["rollout/restored_groups"] == 3 and m["rollout/partial_restored_count"] == 6
    st = srv.stats(keys=True)
    assert st["in_flight_keys"] == [] and st["lane_keys"] == [(0, 0), (0, 2), (0, 3)]
    assert st["buffered_keys"] == [(0, 1)]
    lane = {g.prompt_id: g for g in srv.dispatch()}
    assert all(_same(a, b) for a, b in zip(lane[(0, 0)].partial, back))
    assert all(_same(a, b) for g in (g2, g3) for a, b in zip(lane[g.prompt_id].partial, finish(g, 2)))


def test_trajectories_pickle_short_tensors_as_bytes_and_come_back_equal():
    """_WireState: what RPC sends. Short token tensors travel as bytes (no tensor in the pickle's state), long ones as
    tensors; either way the copy has the same values, dtypes and metadata, and owns its storage."""
    import pickle

    prompt = buffer.PromptGroup(0, 3, 1, torch.tensor([7, 8, 9]), label=("x", b"y"))
    short = Trajectory(0, 3, 1, prompt.prompt_ids, torch.tensor([4, 5]), torch.tensor([-0.5, -0.25]),
                       torch.tensor([2, 3]), torch.tensor([1, 0]), reward=0.5, status=TRUNCATED,
                       metadata={"finish_reason": ("length", b"6")})
    long = Trajectory(0, 3, 2, torch.arange(buffer.WIRE_BYTES_MAX + 1), torch.zeros(0, dtype=torch.long))
    prompt.partial = [short, long]
    state, wired = short.__getstate__()
    assert sorted(wired) == ["loss_mask", "prompt_ids", "response_ids", "rollout_log_probs", "routed_experts",
                             "versions"]
    assert not any(isinstance(v, torch.Tensor) for v in state.values())
    assert "prompt_ids" not in long.__getstate__()[1] and "response_ids" in long.__getstate__()[1]
    back = pickle.loads(pickle.dumps(prompt))
    for a, b in zip([prompt, *prompt.partial], [back, *back.partial]):
        for k, v in vars(a).items():
            if isinstance(v, torch.Tensor):
                assert vars(b)[k].dtype == v.dtype and torch.equal(vars(b)[k], v), k
            elif k != "partial":
                assert vars(b)[k] == v, k
    back.partial[0].response_ids[0] = 99
    assert int(short.response_ids[0]) == 4


@pytest.mark.parametrize("keep", [False, True], ids=["abort", "keep"])
@pytest.mark.parametrize("window", ["no-window", "windowed-fifo"])
def test_every_prompt_of_an_epoch_is_trained_exactly_once_across_a_resume(window, keep):
    """Partial rollouts, a held group, leftovers in PipelineBuffer and a crash-resume in the middle of the epoch:
    the trainer still sees each of the epoch's prompts exactly once. keep (rollout.pause_mode retract /
    in_place): the boundaries keep the groups in flight, some with only part of their trajectories put, except the
    one before the checkpoint, whose pause hands every unfinished trajectory back (Rollout.pause(checkpoint=True)):
    the checkpoint holds them all, and after the crash each continues from its saved tokens."""
    n_prompts, B, N = 24, 4, 2
    rng = random.Random(0)
    srv = make_server(B=B, N=N, stale=1.0, window=window, n_prompts=n_prompts)
    trained, version = [], 0
    groups, pending = {}, {}  # what "the rollout" holds: dispatched groups, and the trajectories not yet put
    saved = {}
    for step in range(n_prompts // B + 3):
        if step == 3:  # checkpoint after the step boundary, "crash", resume into a new process's buffer
            sd = srv.state_dict()
            assert srv.stats()["R"] == 0  # nothing in flight: every trajectory of those groups is in the state
            saved = {(g["epoch"], g["seq"], t["index"]): t for g in sd["data"]["lane"] for t in g["partial"]}
            statuses = [{t["status"] for t in g["partial"]} for g in sd["data"]["lane"]]
            assert any(len(st) > 1 and ABORTED in st for st in statuses)  # some put, the rest partial
            srv = make_server(B=B, N=N, stale=1.0, window=window, n_prompts=n_prompts)
            srv.load_state_dict(sd)
            groups, pending = {}, {}  # the rollout process died with them
        consumed = 0
        while consumed < B:
            for g in srv.dispatch():
                assert g.prompt_id not in groups, f"group {g.prompt_id} dispatched twice"
                for t in g.partial if step == 3 else []:  # the resume hands out each saved trajectory as saved
                    assert torch.equal(t.response_ids, saved.pop(g.prompt_id + (t.index,))["response_ids"])
                groups[g.prompt_id] = g
                pending[g.prompt_id] = set(range(N))
            for key in sorted(pending):
                if rng.random() < 0.5:  # some finish within the step (some only partly), the rest are cut
                    idx = set(list(pending[key])[:1]) if rng.random() < 0.5 else set(pending[key])
                    srv.put([t for t in finish(groups[key], N, version=version) if t.index in idx])
                    pending[key] -= idx
                    if not pending[key]:
                        del pending[key]
            take = min(B - consumed, srv.stats()["Q"])
            if take == 0:  # nothing buffered yet: the oldest group finishes
                key = min(pending)
                idx = pending.pop(key)
                srv.put([t for t in finish(groups[key], N, version=version) if t.index in idx])
                continue
            got = srv.get(take, timeout=0)
            trained += [(g.prompt.epoch, g.prompt.data_index) for g in got]
            for g in got:
                groups.pop(g.prompt.prompt_id, None)  # (a group buffered before a boundary is not held)
            consumed += take
        if keep and step != 2:
            srv.boundary_aborts(staleness.Boundary.KEEP)
            srv.step_boundary([], staleness.Boundary.KEEP)
        else:  # (keep: the pause before the checkpoint aborts every request, handing back their trajectories)
            kind = staleness.Boundary.CHECKPOINT if keep else staleness.Boundary.ABORT
            srv.boundary_aborts(kind)
            srv.step_boundary([aborted(groups[k], i) for k in sorted(pending) for i in pending[k]], kind)
            pending.clear()
            groups.clear()  # everything in flight went to the restored lane
        version += 1
        srv.set_weight_version(version)
    for _ in range(4):  # the end: what is in flight or restored finishes, and everything buffered is trained
        for g in srv.dispatch():
            groups[g.prompt_id], pending[g.prompt_id] = g, set(range(N))
        for key in sorted(pending):
            srv.put([t for t in finish(groups[key], N, version=version) if t.index in pending[key]])
        pending.clear()
        q = srv.stats()["Q"]
        trained += [(g.prompt.epoch, g.prompt.data_index) for g in (srv.get(q, timeout=0) if q else [])]
    epoch0 = [idx for e, idx in trained if e == 0]
    assert sorted(epoch0) == list(range(n_prompts))
    assert not saved  # every saved trajectory was handed out again


# ---------------------------------------------------------------------------------------------------------
# Threads: producer, collector, consumer
# ---------------------------------------------------------------------------------------------------------

def test_producer_collector_consumer_threads_with_partial_pauses():
    """A producer thread dispatches, three generator threads finish trajectories out of order and put them one by
    one, the collector thread collects, and the main thread trains B groups per step, then pauses (aborting what
    is still generating), runs the step boundary and bumps the weight version."""
    B, N, steps = 8, 4, 6
    srv = make_server(B=B, N=N, stale=1.0, window="windowed-fifo", n_prompts=40, thread=True)
    lock = threading.Condition()
    state = {"pausing": False, "stop": False, "busy": 0, "partials": [], "version": 0, "errors": [], "max_rq": 0}
    work = []  # (group, index) waiting to be generated
    rng = random.Random(1)

    def producer():
        try:
            while True:
                with lock:
                    lock.wait_for(lambda: state["stop"] or not state["pausing"], timeout=5)
                    if state["stop"]:
                        return
                    gs = srv.dispatch()
                    work.extend((g, i) for g in gs for i in range(N))
                    lock.notify_all()
                if not gs:
                    time.sleep(0.001)
                st = srv.stats()
                state["max_rq"] = max(state["max_rq"], st["R"] + st["Q"])
        except BaseException as e:
            state["errors"].append(e)

    def generator():
        try:
            while True:
                with lock:
                    lock.wait_for(lambda: state["stop"] or work, timeout=5)
                    if state["stop"]:
                        return
                    if not work:
                        continue
                    g, i = work.pop(rng.randrange(len(work)))  # out of order, like a real fleet
                    state["busy"] += 1
                time.sleep(rng.random() * 0.002)
                with lock:
                    if state["pausing"]:
                        state["partials"].append(aborted(g, i))
                    else:
                        srv.put([finish(g, N, version=state["version"])[i]])
                    state["busy"] -= 1
                    lock.notify_all()
        except BaseException as e:
            state["errors"].append(e)

    threads = [threading.Thread(target=producer)] + [threading.Thread(target=generator) for _ in range(3)]
    for th in threads:
        th.start()
    got = []
    try:
        for step in range(steps):
            for _ in range(B // 2):
                got += srv.get(2, timeout=10)
            with lock:  # pause: no more dispatch, queued work is aborted, running work comes back aborted
                state["pausing"] = True
                state["partials"] += [aborted(g, i) for g, i in work]
                work.clear()
                assert lock.wait_for(lambda: state["busy"] == 0, timeout=10)
                partials, state["partials"] = state["partials"], []
            srv.step_boundary(partials)
            with lock:
                state["version"] = step + 1
                srv.set_weight_version(step + 1)
                state["pausing"] = False
                lock.notify_all()
    finally:
        with lock:
            state["stop"] = True
            lock.notify_all()
        for th in threads:
            th.join(timeout=10)
        srv.close()
    assert not state["errors"], state["errors"]
    assert len(got) == steps * B
    keys = [g.prompt_id for g in got]
    assert len(set(keys)) == len(keys) and len({(g.prompt.epoch, g.prompt.data_index) for g in got}) == len(got)
    for g in got:  # every trajectory arrived intact and in its place
        assert [t.response_ids[:2].tolist() for t in g.trajectories] == [[g.prompt.seq, i] for i in range(N)]
    assert 0 < state["max_rq"] <= srv.C


# ---------------------------------------------------------------------------------------------------------
# RPC across processes
# ---------------------------------------------------------------------------------------------------------

RPC_B, RPC_N, RPC_STEPS, RPC_T = 4, 2, 3, 1024


def _rpc_worker(rank, init, out_dir, settings):
    """rank 0: the buffer process; rank 1: a producer ("rollout"); rank 2: a consumer ("trainer")."""
    import torch.distributed.rpc as rpc
    prompts = make_prompts(30)
    if rank == 0:
        remote.serve_buffer(settings, init, 0, 3, prompts)
        return
    name = "rollout" if rank == 1 else "trainer"
    remote.init_rpc(name, rank, 3, init, timeout=30)
    rb = remote.Proxy("buffer", 30, remote.BUFFER_METHODS)
    result = {}
    total = RPC_B * RPC_STEPS
    if rank == 1:
        rb.set_max_concurrent_samples(2 * RPC_N)  # what Rollout.start() sends: served, and it caps what follows
        sent = 0
        while sent < total:
            for g in rb.dispatch(total - sent, 0.2):
                sent += 1
                trajs = [traj(g, i, T=RPC_T) for i in range(RPC_N)]
                rb.put(trajs)
        result["sent"] = sent
        (g,) = rb.dispatch(1, 1.0)  # a partial rollout over RPC: restored with its trajectories, dispatched again
        rb.put([traj(g, 0, T=RPC_T)])
        m = rb.step_boundary([aborted(g, 1)])
        (again,) = rb.dispatch(1, 1.0)
        result["restored"] = [m["rollout/partial_restored_count"], list(again.prompt_id), list(g.prompt_id),
                              [t.status for t in again.partial], again.partial[0].response_ids.tolist()[:2],
                              again.partial[0].response_ids.dtype == torch.long]
    else:
        got = []
        for _ in range(total // 2):
            got += rb.get(2, 20)
        result["keys"] = [list(g.prompt_id) for g in got]
        result["intact"] = all(t.response_ids.numel() == RPC_T and t.response_ids[:2].tolist() == [g.prompt.seq, i]
                               for g in got for i, t in enumerate(g.trajectories))
        try:
            rb.get(1, 0.2)
        except TimeoutError as e:
            result["timeout"] = str(e)
        result["metrics"] = rb.step_metrics()
        result["state_format"] = rb.state_dict()["format"]
        refused = []  # a method outside BUFFER_METHODS: refused by the proxy, and by the server when called anyway
        for call in (lambda: rb.close(), lambda: rpc.rpc_sync("buffer", remote._invoke, args=("close",)),
                     lambda: rb.get(1)):  # a wait without its timeout: the RPC's own could not cover it
            try:
                call()
            except Exception as e:
                refused.append(f"{type(e).__name__}: {e}")
        result["refused"] = refused
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(result, f)
    rpc.shutdown()


def test_rpc_buffer_process_serves_producer_and_trainer(tmp_path):
    import torch.multiprocessing as mp
    cfg = make_cfg(B=RPC_B, N=RPC_N, stale=1.0, overrides=["buffer.rpc_timeout_s=30"])
    mp.spawn(_rpc_worker, args=(f"tcp://127.0.0.1:{free_port()}", str(tmp_path), cfg.buffer_settings()), nprocs=3,
             join=True)
    rollout = json.load(open(tmp_path / "rollout.json"))
    trainer = json.load(open(tmp_path / "trainer.json"))
    assert rollout["sent"] == RPC_B * RPC_STEPS
    keys = [tuple(k) for k in trainer["keys"]]
    assert sorted(keys) == [(0, s) for s in range(RPC_B * RPC_STEPS)] and trainer["intact"]
    # the server's TimeoutError crosses the process boundary, its message on the first line after the call's name
    assert trainer["timeout"].startswith("buffer.get() in RPC worker 'buffer' failed: TimeoutError: "
                                         "PipelineBuffer.get: wanted 1 groups"), trainer["timeout"][:300]
    assert trainer["metrics"]["rollout/consumed_groups"] == RPC_B * RPC_STEPS
    assert trainer["metrics"]["rollout/max_generating_groups"] == 2
    assert trainer["state_format"] == 1
    seq = RPC_B * RPC_STEPS
    assert rollout["restored"] == [RPC_N, [0, seq], [0, seq], [COMPLETED, ABORTED], [seq, 0], True]
    unserved, server_side, no_wait = trainer["refused"]
    assert unserved.startswith("AttributeError: RPC worker 'buffer' serves no method 'close'; served: dispatch, ")
    assert "ValueError: buffer method 'close' is not served" in server_side
    assert no_wait.startswith("ValueError: get over RPC needs its timeout (argument 2)")


def test_an_rpc_that_does_not_answer_names_the_call_the_process_and_the_settings(monkeypatch):
    """The trainer's pause RPC waits buffer.rpc_timeout_s plus the pause's own bound (rollout.rpc_waits), and when
    even that passes its error names the call, the process and what bounded it, not torch's bare RPC timeout."""
    import rollout
    sent = {}

    def no_answer(worker, fn, args, kwargs, timeout):
        sent.update(worker=worker, args=args, timeout=timeout)
        raise RuntimeError("RPCErr:1:RPC ran for more than set timeout (1260000 ms) and will now be marked with an "
                           "error")  # torch 2.x's text

    monkeypatch.setattr(remote.rpc, "rpc_sync", no_answer)
    cfg = config.load_config(None, ["buffer.rpc_timeout_s=600", "rollout.pause_timeout_s=600"])
    ro = remote.Proxy("rollout", cfg.buffer.rpc_timeout_s, remote.ROLLOUT_METHODS, rollout.rpc_waits(cfg),
                      "the rollout process (pid 7, log runs/x/logs/rollout.log)")
    with pytest.raises(TimeoutError) as err:
        ro.pause()
    assert sent == {"worker": "rollout", "args": ("pause",), "timeout": 1260.0}
    assert str(err.value) == ("rollout.pause() in the rollout process (pid 7, log runs/x/logs/rollout.log) did not "
                              "answer within 1260 s (buffer.rpc_timeout_s=600 s + rollout.pause_timeout_s=600 s + "
                              "60 s); it may still be running there")
    with pytest.raises(remote.RemoteError, match=r"^buffer\.get\(\) in RPC worker 'buffer' did not answer within 630 s "
                       r"\(buffer\.rpc_timeout_s=600 s \+ its timeout argument 30 s\)"):
        remote.Proxy("buffer", 600, remote.BUFFER_METHODS).get(2, 30)


@pytest.mark.parametrize("served", ["buffer.PipelineServer", "rollout.Rollout"])
def test_every_served_method_exists_and_a_wait_is_its_timeout_argument(served):
    """The proxy and the server go by one table a served object: each name in it is a method of the object, and
    a method waits (its RPC timeout grows by the wait) exactly when it has a `timeout` argument, at that position."""
    import importlib
    import inspect

    module, name = served.split(".")
    cls = getattr(importlib.import_module(module), name)
    table = {"buffer": remote.BUFFER_METHODS, "rollout": remote.ROLLOUT_METHODS}[module]
    for method, how in table.items():
        params = list(inspect.signature(getattr(cls, method)).parameters)[1:]  # without self
        at = how.timeout_arg
        assert at == (params.index("timeout") if "timeout" in params else None), (method, at, params)


def test_rpc_start_up_times_out_naming_the_missing_workers():
    code = ("import remote\n"
            f"remote.init_rpc('trainer', 0, 3, 'tcp://127.0.0.1:{free_port()}', timeout=1.0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "TimeoutError" in proc.stderr and "not all 3 workers" in proc.stderr and "trainer" in proc.stderr
