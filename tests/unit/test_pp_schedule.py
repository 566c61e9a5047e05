"""Unit tests of ``lightning_tpp.pipeline.schedule``: each rank's action order, the timing simulation, the config
checks."""

from __future__ import annotations

from collections import Counter

import pytest

import lightning_tpp.pipeline.schedule as sched
import lightning_tpp.pipeline.schedule_input as inputs
from lightning_tpp.pipeline.schedule import ScheduleConfigError, actions, check, simulate, theoretical_bubble

SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "zb-drain", "zb-lead", "interleaved-1f1b")
SPLITTING = ("zero-bubble", "zb-drain", "zb-lead")  # backward split into I and W


def _configs(schedule: str):
    """(pp, m, v) over pp in {2, 3, 4}, m in {pp, 2pp, 8}; interleaved needs pp | m and v in {2, 3}."""
    for pp in (2, 3, 4):
        for m in sorted({pp, 2 * pp, 8}):
            if schedule == "interleaved-1f1b":
                if m % pp == 0:
                    for v in (2, 3):
                        yield pp, m, v
            else:
                yield pp, m, 1


ALL = [(s, *c) for s in SCHEDULES for c in _configs(s)]
ALL_IDS = [f"{s}-pp{pp}-m{m}-v{v}" for s, pp, m, v in ALL]


# ---- actions --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule, pp, m, v", ALL, ids=ALL_IDS)
def test_actions_cover_every_microbatch_once(schedule, pp, m, v):
    for rank in range(pp):
        order = actions(schedule, rank, pp, m, v)
        counts = Counter(order)
        assert all(c == 1 for c in counts.values()), f"rank {rank} repeats {[a for a, c in counts.items() if c > 1]}"
        pos = {a: i for i, a in enumerate(order)}
        assert len(order) == len(pos)
        for mb in range(m):
            for c in range(v):  # F, then either B or I then W
                if ("B", mb, c) in pos:
                    assert pos[("F", mb, c)] < pos[("B", mb, c)]
                    assert ("I", mb, c) not in pos and ("W", mb, c) not in pos
                else:
                    assert schedule in SPLITTING
                    assert pos[("F", mb, c)] < pos[("I", mb, c)] < pos[("W", mb, c)]
        assert len(order) == sum(3 if ("I", mb, c) in pos else 2 for mb in range(m) for c in range(v))


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 4), (3, 3), (3, 8), (4, 4), (4, 8), (4, 16)])
def test_1f1b_order(pp, m):
    for rank in range(pp):
        warmup = pp - 1 - rank
        order = actions("1f1b", rank, pp, m)
        expected = [("F", i, 0) for i in range(warmup)]
        for i in range(m - warmup):
            expected += [("F", warmup + i, 0), ("B", i, 0)]
        expected += [("B", i, 0) for i in range(m - warmup, m)]
        assert order == expected
        # warm-up: pp - 1 - rank forwards, then the first steady forward, then the first backward
        first_b = next(i for i, a in enumerate(order) if a[0] == "B")
        assert first_b == warmup + 1
        # at most pp - rank micro-batches in flight (the activation memory 1F1B promises)
        live = peak = 0
        for kind, _, _ in order:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == pp - rank


def test_1f1b_docstring_example():
    r0 = "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7".split()
    r3 = "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7".split()
    assert actions("1f1b", 0, 4, 8) == [(s[0], int(s[1:]), 0) for s in r0]
    assert actions("1f1b", 3, 4, 8) == [(s[0], int(s[1:]), 0) for s in r3]


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 3), (4, 2), (4, 8)])
def test_gpipe_order(pp, m):
    for rank in range(pp):
        assert actions("gpipe", rank, pp, m) == [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


@pytest.mark.parametrize("pp, m", [(2, 2), (3, 6), (4, 8)])
def test_zero_bubble_defers_w_by_rank(pp, m):
    for rank in range(pp):
        order = actions("zero-bubble", rank, pp, m)
        # dropping W and renaming I -> B gives back 1F1B
        assert [("B" if k == "I" else k, mb, c) for k, mb, c in order if k != "W"] == actions("1f1b", rank, pp, m)
        # W in micro-batch order, and rank 0 does every W right after its I
        ws = [mb for k, mb, _ in order if k == "W"]
        assert ws == list(range(m))
        if rank == 0:
            assert all(order[i + 1] == ("W", mb, c) for i, (k, mb, c) in enumerate(order) if k == "I")
        # the last `rank` W wait for the cool-down
        assert all(k == "W" for k, _, _ in order[len(order) - rank:])


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 8), (3, 3), (3, 6), (4, 8), (4, 16)])
def test_zb_drain_splits_the_first_rank_and_the_last_backward(pp, m):
    for rank in range(pp):
        order = actions("zb-drain", rank, pp, m)
        # dropping W and renaming I -> B gives back 1F1B
        assert [("B" if k == "I" else k, mb, c) for k, mb, c in order if k != "W"] == actions("1f1b", rank, pp, m)
        split = [mb for k, mb, _ in order if k == "I"]
        assert split == ([] if rank == 0 else [*range(rank), m - 1] if rank < m - 1 else list(range(m)))
        # their W fill the drain: they are the last actions, in micro-batch order
        assert order[len(order) - len(split):] == [("W", mb, 0) for mb in split]


def test_zb_drain_docstring_example():
    r1 = "F0 I0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 I7 W0 W7".split()
    assert actions("zb-drain", 1, 2, 8) == [(s[0], int(s[1:]), 0) for s in r1]
    assert actions("zb-drain", 0, 2, 8) == actions("1f1b", 0, 2, 8)


@pytest.mark.parametrize("pp, m", [(2, 2), (2, 8), (3, 3), (3, 6), (4, 8), (4, 16)])
def test_zb_lead_is_zb_drain_one_forward_ahead(pp, m):
    """Every rank but the last runs one forward more before its first backward; the same backwards are split and
    the last rank's order is zb-drain's."""
    for rank in range(pp):
        lead, drain = actions("zb-lead", rank, pp, m), actions("zb-drain", rank, pp, m)
        assert sorted(lead) == sorted(drain)
        first_backward = next(i for i, (k, _, _) in enumerate(lead) if k != "F")
        assert first_backward == min(pp - rank + 1 if rank < pp - 1 else 1, m)  # 1F1B: min(pp - rank, m)
        if rank == pp - 1:
            assert lead == drain
        else:  # 1F1B's pattern after the warm-up: one forward, one backward
            steady = lead[first_backward:first_backward + 2 * (m - first_backward)]
            assert [k for k, _, _ in steady[1::2]] == ["F"] * (m - first_backward)
    r0 = "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7".split()  # the docstring's pp=2, m=8
    assert actions("zb-lead", 0, 2, 8) == [(x[0], int(x[1:]), 0) for x in r0]


def test_zb_lead_pays_only_where_actions_vary():
    """Mean costs alike, zb-lead finishes with zb-drain (the last stage sets the pace); with actions that vary by
    10%, as measured on the benchmark's CPU (costs: its ms per action), it finishes sooner, since the next stage no
    longer waits for a forward that ran long."""
    costs = [{"F": 142, "B": 257, "I": 0, "W": 257}, {"F": 155, "B": 262, "I": 160, "W": 112}]
    steady = {s: simulate(s, 2, 8, rank_costs=costs).makespan for s in ("zb-drain", "zb-lead")}
    assert steady["zb-lead"] == pytest.approx(steady["zb-drain"])
    varied = {s: simulate(s, 2, 8, rank_costs=costs, jitter=0.1).makespan for s in ("1f1b", "zb-drain", "zb-lead")}
    assert varied["zb-lead"] < 0.99 * varied["zb-drain"] < 0.96 * varied["1f1b"]
    assert varied["zb-drain"] > steady["zb-drain"]  # a varying action can only delay who waits for it


def test_jittered_simulation_is_reproducible():
    """Every rank must simulate the same numbers: the draws come from a fixed seed, whatever ran before."""
    import random

    one = simulate("1f1b", 3, 6, jitter=0.2, samples=8)
    random.seed(123)
    assert simulate("1f1b", 3, 6, jitter=0.2, samples=8) == one
    assert sum(one.busy) == pytest.approx(3 * 6 * 3.0, rel=0.1)  # the factors average about 1
    assert simulate("1f1b", 3, 6, jitter=0.0) == simulate("1f1b", 3, 6)


@pytest.mark.parametrize("pp, m, v", [(2, 2, 2), (2, 4, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 3), (3, 6, 3)])
def test_interleaved_covers_pairs_in_chunk_order(pp, m, v):
    for rank in range(pp):
        order = actions("interleaved-1f1b", rank, pp, m, v)
        assert len(order) == 2 * m * v
        fwd = [(mb, c) for k, mb, c in order if k == "F"]
        bwd = [(mb, c) for k, mb, c in order if k == "B"]
        pairs = {(mb, c) for mb in range(m) for c in range(v)}
        assert set(fwd) == pairs and set(bwd) == pairs
        assert len(fwd) == len(bwd) == m * v
        for mb in range(m):  # a micro-batch goes forward through the chunks in order, backward in reverse
            assert [c for b, c in fwd if b == mb] == list(range(v))
            assert [c for b, c in bwd if b == mb] == list(range(v))[::-1]


def test_unknown_schedule_raises():
    with pytest.raises(ScheduleConfigError, match="unknown schedule 'pipedream'"):
        actions("pipedream", 0, 2, 4)


# ---- simulate -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule, pp, m, v", ALL, ids=ALL_IDS)
def test_simulate_never_deadlocks(schedule, pp, m, v):
    sim = simulate(schedule, pp, m, v)
    assert len(sim.busy) == pp and len(sim.bubble) == pp
    per_chunk = 1.0 + 2.0  # f + b (I + W when split)
    assert sim.busy == pytest.approx([m * v * per_chunk] * pp)
    assert sim.makespan >= m * v * per_chunk
    assert all(0.0 <= x < 1.0 for x in sim.bubble)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(pp, m) for pp, m, _ in _configs("1f1b")] + [(1, 1), (1, 4)])
def test_bubble_matches_theory(schedule, pp, m):
    sim = simulate(schedule, pp, m)
    assert sim.bubble == pytest.approx([theoretical_bubble(pp, m)] * pp, abs=1e-9)
    assert sim.makespan == pytest.approx((m + pp - 1) * 3.0)


@pytest.mark.parametrize("f, b", [(1.0, 1.0), (2.0, 3.0), (1.0, 2.5)])
def test_1f1b_bubble_independent_of_costs(f, b):
    for pp, m in [(2, 4), (4, 8), (3, 5)]:
        sim = simulate("1f1b", pp, m, f=f, b=b)
        assert sim.bubble == pytest.approx([theoretical_bubble(pp, m)] * pp, abs=1e-9)


def test_gpipe_with_fewer_microbatches_than_stages():
    sim = simulate("gpipe", 4, 2)
    assert sim.bubble == pytest.approx([theoretical_bubble(4, 2)] * 4, abs=1e-9)


@pytest.mark.parametrize("pp, m, v", list(_configs("interleaved-1f1b")))
def test_interleaved_bubble_matches_theory(pp, m, v):
    sim = simulate("interleaved-1f1b", pp, m, v)
    assert sim.bubble == pytest.approx([theoretical_bubble(pp, m, v)] * pp, abs=1e-9)
    assert max(sim.bubble) < theoretical_bubble(pp, m) - 1e-9  # better than plain 1F1B


@pytest.mark.parametrize("pp, m", [(pp, m) for pp, m, _ in _configs("1f1b")])
def test_zero_bubble_beats_1f1b(pp, m):
    assert max(simulate("zero-bubble", pp, m).bubble) < min(simulate("1f1b", pp, m).bubble) - 1e-9


@pytest.mark.parametrize("pp, m", [(pp, m) for pp, m, _ in _configs("1f1b")])
def test_zb_drain_beats_1f1b(pp, m):
    assert max(simulate("zb-drain", pp, m).bubble) < min(simulate("1f1b", pp, m).bubble) - 1e-9


def test_zb_drain_against_zero_bubble():
    """Why both exist: with free splits zero-bubble leaves the smaller bubble at pp=4; when a split costs a tenth of
    a backward (measured on CPU), zb-drain, splitting 1 to pp backwards per rank instead of all, finishes first."""
    assert simulate("zb-drain", 2, 8).makespan == pytest.approx(simulate("zero-bubble", 2, 8).makespan)
    assert simulate("zero-bubble", 4, 8).makespan < simulate("zb-drain", 4, 8).makespan
    for pp, m in [(2, 8), (4, 16), (8, 32)]:
        assert simulate("zb-drain", pp, m, split_cost=0.2).makespan < \
            simulate("zero-bubble", pp, m, split_cost=0.2).makespan


@pytest.mark.parametrize("schedule", SPLITTING)
def test_split_cost_is_paid_per_split(schedule):
    one, split = simulate("1f1b", 4, 8), simulate(schedule, 4, 8, split_cost=0.5)
    splits = sum(k == "I" for rank in range(4) for k, _, _ in actions(schedule, rank, 4, 8))
    assert sum(split.busy) == pytest.approx(sum(one.busy) + 0.5 * splits)


def test_zero_bubble_pp4_m8():
    assert simulate("zero-bubble", 4, 8).bubble == pytest.approx([1 / 9] * 4, abs=1e-9)
    assert simulate("1f1b", 4, 8).bubble == pytest.approx([3 / 11] * 4, abs=1e-9)


def test_theoretical_bubble():
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble(1, 4) == 0.0


def _patch_orders(monkeypatch, orders):
    monkeypatch.setattr(sched, "actions", lambda schedule, rank, pp, m, v=1: orders[rank])


def test_simulate_detects_deadlock(monkeypatch):
    # rank 0 waits for B0 before sending F1; rank 1 waits for F1 before doing B0
    orders = [
        [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)],
        [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)],
    ]
    _patch_orders(monkeypatch, orders)
    with pytest.raises(ScheduleConfigError, match=r"schedule '1f1b' deadlocks \(pp=2, m=2, v=1\): ranks wait at") as e:
        simulate("1f1b", 2, 2)
    msg = str(e.value)
    assert "('B', 0, 0)" in msg and "('F', 1, 0)" in msg


def test_simulate_detects_backward_before_forward(monkeypatch):
    _patch_orders(monkeypatch, [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]])
    with pytest.raises(ScheduleConfigError, match="deadlocks"):
        simulate("gpipe", 2, 1)


def test_simulate_accepts_a_valid_custom_order(monkeypatch):
    # the patch itself is sound: gpipe orders pass through unchanged
    _patch_orders(monkeypatch, [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]] * 2)
    assert simulate("gpipe", 2, 2).bubble == pytest.approx([theoretical_bubble(2, 2)] * 2)


# ---- check ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble", "zb-drain", "interleaved-1f1b"])
def test_check_too_few_microbatches(schedule):
    v = 2 if schedule == "interleaved-1f1b" else 1
    with pytest.raises(ScheduleConfigError, match=r"needs microbatches >= pp: got microbatches=3, pp=4\. "
                                                  r"Use microbatches=8 .*or schedule='gpipe'"):
        check(schedule, 4, 3, v)


def test_check_suggested_bubble_is_right():
    with pytest.raises(ScheduleConfigError) as e:
        check("1f1b", 4, 2, 1)
    assert f"= {theoretical_bubble(4, 8):.0%}" in str(e.value)


@pytest.mark.parametrize("v", [0, 1])
def test_check_interleaved_needs_virtual(v):
    with pytest.raises(ScheduleConfigError, match=rf"needs virtual_stages >= 2, got {v}"):
        check("interleaved-1f1b", 2, 4, v)


def test_check_interleaved_needs_divisible_microbatches():
    with pytest.raises(ScheduleConfigError, match=r"needs microbatches divisible by pp=4, got 6; use 8"):
        check("interleaved-1f1b", 4, 6, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_check_virtual_only_for_interleaved(schedule):
    msg = rf"virtual_stages=2 needs schedule='interleaved-1f1b', not '{schedule}'"
    with pytest.raises(ScheduleConfigError, match=msg):
        check(schedule, 2, 4, 2)


@pytest.mark.parametrize("m", [0, -1])
def test_check_microbatches_at_least_one(m):
    with pytest.raises(ScheduleConfigError, match=rf"microbatches={m} must be at least 1"):
        check("gpipe", 2, m, 1)


def test_check_accepts_valid_configs():
    check("gpipe", 4, 1, 1)  # gpipe runs with fewer micro-batches than stages
    check("1f1b", 4, 4, 1)
    check("zero-bubble", 2, 8, 1)
    check("interleaved-1f1b", 4, 8, 3)


def test_actions_validates():
    with pytest.raises(ScheduleConfigError, match="needs microbatches >= pp"):
        actions("1f1b", 0, 4, 2)


# ---- registry, user schedules ---------------------------------------------------------------------------------------
def _one_f_one_b_lists(pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    return [actions("1f1b", r, pp, m) for r in range(pp)]


def test_registry_holds_the_builtins_in_order():
    assert tuple(sched.SCHEDULES) == ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zb-drain", "zb-lead")
    assert all(isinstance(s, sched.Schedule) and s.name == n for n, s in sched.SCHEDULES.items())


def test_registered_schedule_runs_through_simulate(monkeypatch):
    monkeypatch.setattr(sched, "SCHEDULES", dict(sched.SCHEDULES))  # leave the real registry as it was

    def reversed_gpipe(rank, pp, m, v):  # backwards in reverse micro-batch order
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in reversed(range(m))]

    spec = sched.register_schedule(sched.Schedule("reversed-gpipe", reversed_gpipe, min_microbatches=1))
    assert inputs.resolve("reversed-gpipe") is spec and inputs.normalize(spec) == "reversed-gpipe"
    sched.validate("reversed-gpipe", 3, 2, 1)
    assert simulate("reversed-gpipe", 3, 2).makespan == pytest.approx(simulate("gpipe", 3, 2).makespan)
    with pytest.raises(ScheduleConfigError, match=r"a schedule named 'reversed-gpipe' is already registered .*"
                                                  r"choose another name or pass replace=True"):
        sched.register_schedule(sched.Schedule("reversed-gpipe", sched.SCHEDULES["gpipe"].orders))
    with pytest.raises(TypeError, match=r"register_schedule takes a Schedule, got function"):
        sched.register_schedule(reversed_gpipe)


def test_unregistered_schedule_repr_is_stable():
    spec = sched.Schedule("mine", sched.SCHEDULES["1f1b"].orders)
    assert inputs.normalize(spec) is spec  # not the registered '1f1b' object: kept as a Schedule
    assert repr(spec) == ("Schedule(name='mine', orders=lightning_tpp.pipeline.schedule._one_f_one_b, "
                          "min_microbatches='pp', interleaved=False, fixed=None)")


def test_action_lists_equal_to_1f1b():
    lists = _one_f_one_b_lists(2, 4)
    spec = inputs.resolve(lists)
    assert spec.fixed == (2, 4, 1) and "actions-sha256:" in repr(spec)
    assert repr(inputs.resolve([list(o) for o in lists])) == repr(spec)  # the same lists give the same repr
    sched.validate(spec, 2, 4, 1)
    assert [spec.actions(r, 2, 4) for r in range(2)] == lists
    assert simulate(spec, 2, 4).bubble == pytest.approx(simulate("1f1b", 2, 4).bubble)
    with pytest.raises(ScheduleConfigError, match=r"schedule 'custom' is action lists for pp=2, microbatches=4, "
                                                  r"virtual_stages=1 .*but got microbatches=8; pass pp=2"):
        sched.validate(spec, 2, 8, 1)


def test_action_lists_with_split_backwards():
    lists = [actions("zb-drain", r, 2, 4) for r in range(2)]
    sched.validate(inputs.resolve(lists), 2, 4, 1)


@pytest.mark.parametrize("lists, message", [
    ([], r"one non-empty list per pipeline rank of \(kind, microbatch, chunk\) tuples"),
    ("1f1b-ish", r"unknown schedule '1f1b-ish'"),
    ([[("F", 0, 0), ("X", 0, 0)]], r"rank 0, action 1: \('X', 0, 0\) is not \(kind, microbatch, chunk\)"),
    ([[("F", 0, 0), ("B", -1, 0)]], r"rank 0, action 1: \('B', -1, 0\) is not"),
    ([[("F", 0, 0), ("B", 0, 0)], [("F", 0, 0)]],
     r"schedule 'custom', rank 1: micro-batch 0, chunk 0 has 1 F, 0 B, 0 I, 0 W; each micro-batch and chunk needs "
     r"one F, then one B or one I then one W"),
    ([[("F", 0, 0), ("B", 0, 0), ("B", 0, 0)]] * 2, r"rank 0: micro-batch 0, chunk 0 has 1 F, 2 B"),
    ([[("F", 0, 0), ("I", 0, 0), ("B", 0, 0), ("W", 0, 0)]] * 2, r"has 1 F, 1 B, 1 I, 1 W"),
    ([[("B", 0, 0), ("F", 0, 0)]] * 2, r"rank 0: micro-batch 0, chunk 0: B \(action 0\) comes before its F "
                                       r"\(action 1\); a backward must follow its forward"),
    ([[("F", 0, 0), ("W", 0, 0), ("I", 0, 0)]] * 2, r"W \(action 1\) comes before its I \(action 2\)"),
    ([[("F", 1, 0), ("B", 1, 0)]] * 2, r"micro-batch 0, chunk 0 has 0 F"),
    ([[("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)], [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]],
     r"schedule 'custom' deadlocks \(pp=2, m=2, v=1\): ranks wait at .*reorder them"),
])
def test_action_list_errors(lists, message):
    with pytest.raises(ScheduleConfigError, match=message):
        spec = inputs.resolve(lists)
        pp, m, v = spec.fixed
        sched.validate(spec, pp, m, v)


def test_action_lists_of_wrong_pp():
    with pytest.raises(ScheduleConfigError, match=r"action lists for pp=2, .*but got pp=4; pass pp=2"):
        sched.validate(inputs.resolve(_one_f_one_b_lists(2, 4)), 4, 4, 1)


def test_torch_pipelining_classes():
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    assert [inputs.normalize(c) for c in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)] == \
        ["gpipe", "1f1b", "interleaved-1f1b"]


@pytest.mark.parametrize("name, message", [
    ("ScheduleZBVZeroBubble", r"schedule=ScheduleZBVZeroBubble is not supported: it places stages in a V .*"
                              r"V-shaped placements are not supported.*Supported torch.distributed.pipelining "
                              r"classes: ScheduleGPipe \('gpipe'\), Schedule1F1B \('1f1b'\)"),
    ("ScheduleDualPipeV", r"ScheduleDualPipeV is not supported: it places stages in a V"),
    ("ScheduleInterleavedZeroBubble", r"ScheduleInterleavedZeroBubble is not supported: its order \(ZB1P .*is not "
                                      r"schedule='zero-bubble'"),
    ("ScheduleLoopedBFS", r"ScheduleLoopedBFS is not supported: its breadth-first order"),
])
def test_torch_pipelining_classes_refused(name, message):
    import torch.distributed.pipelining.schedules as torch_schedules

    with pytest.raises(ScheduleConfigError, match=message):
        inputs.resolve(getattr(torch_schedules, name))


def test_other_classes_and_types_refused():
    with pytest.raises(ScheduleConfigError, match=r"schedule=Counter is a class lightning_tpp cannot run"):
        inputs.resolve(Counter)
    with pytest.raises(TypeError, match=r"schedule must be a registered name .*got int: 3"):
        inputs.resolve(3)


def test_strategy_takes_every_form():
    from torch.distributed.pipelining import Schedule1F1B

    from lightning_tpp import TensorPipeStrategy

    assert TensorPipeStrategy(pp=2, schedule=Schedule1F1B).schedule == "1f1b"
    lists = _one_f_one_b_lists(2, 6)
    strategy = TensorPipeStrategy(pp=2, schedule=lists)
    assert strategy.microbatches == 6 and isinstance(strategy.schedule, sched.Schedule)  # read from the lists
    with pytest.raises(ValueError, match=r"action lists for pp=2, microbatches=6, virtual_stages=1 .*but got "
                                         r"microbatches=4"):
        TensorPipeStrategy(pp=2, schedule=lists, microbatches=4)
    with pytest.raises(ValueError, match=r"deadlocks"):
        TensorPipeStrategy(pp=2, schedule=[[("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)],
                                           [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]])


def test_split_backwards_are_the_i_actions_off_the_first_stage() -> None:
    """What the executor runs split and the simulator charges FS for: zb-drain at pp=2 splits micro-batches 0 and 7
    on rank 1; rank 0's I/W run a whole backward (nothing split); interleaved chunks past the first stage count."""
    assert sched.split_backwards(actions("zb-drain", 1, 2, 8), 1, 2) == {(0, 0), (7, 0)}
    assert sched.split_backwards(actions("zero-bubble", 0, 2, 8), 0, 2) == set()
    assert sched.split_backwards([("I", 3, 1)], 0, 2) == {(3, 1)}  # chunk 1 of rank 0 is stage 2
