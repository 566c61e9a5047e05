"""Unit tests of ``schedule="auto"``'s pure parts (``lightning_tpp.pipeline.auto``): per-rank costs in the
simulator, costs derived from a measuring step's times, the choice on controlled costs, the configuration checks."""

from __future__ import annotations

import pytest

from lightning_tpp.pipeline.auto import AUTO_CANDIDATES, choose_schedule, costs_from_times, settle_auto
from lightning_tpp.pipeline.schedule import ScheduleConfigError, simulate


def _costs(pp: int, *, f: float = 1.0, b: float = 2.0, split: float = 0.0, w_share: float = 0.5) -> list[dict]:
    """Every rank alike; the first rank's split backward runs whole in W (as the executor runs it)."""
    i, w = (1 - w_share) * b + split / 2, w_share * b + split / 2
    return [{"F": f, "B": b, "I": 0.0, "W": b} if r == 0 else {"F": f, "B": b, "I": i, "W": w} for r in range(pp)]


# ---- simulate with per-rank costs ------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "zb-drain"])
@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 8)])
def test_uniform_rank_costs_match_the_old_signature(schedule: str, pp: int, m: int) -> None:
    old = simulate(schedule, pp, m, f=1.0, b=3.0, w_share=0.4, split_cost=0.2)
    same = [{"F": 1.0, "B": 3.0, "I": 0.6 * 3.0 + 0.1, "W": 0.4 * 3.0 + 0.1}] * pp
    new = simulate(schedule, pp, m, rank_costs=same)
    assert new.makespan == pytest.approx(old.makespan) and new.busy == pytest.approx(old.busy)


def test_a_slow_rank_sets_the_step() -> None:
    """1F1B with a last stage twice as slow: the step is the slow stage's work plus the fast one's first forward and
    last backward (the slow rank never waits after its first micro-batch)."""
    costs = [{"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}, {"F": 2.0, "B": 4.0, "I": 2.0, "W": 2.0}]
    sim = simulate("1f1b", 2, 8, rank_costs=costs)
    assert sim.makespan == pytest.approx(1.0 + 8 * 6.0 + 2.0)
    assert sim.bubble[1] < sim.bubble[0]


def test_rank_costs_need_one_entry_per_rank() -> None:
    with pytest.raises(ValueError, match=r"rank_costs has 1 entries, one per rank is needed \(pp=2\)"):
        simulate("1f1b", 2, 4, rank_costs=[{"F": 1, "B": 2, "I": 1, "W": 1}])


# ---- costs from a measuring step ----------------------------------------------------------------------------------
def test_costs_from_zb_drain_times() -> None:
    """Rank 0 timed F and B only (zb-drain splits nothing there); rank 1 F, B and, for 2 micro-batches, I and W;
    those 2 forwards (FS, counted in F too) ran under DeferWeightGrads, 20% dearer here."""
    measured = [{"F": (8.0, 8), "FS": (0.0, 0), "B": (16.0, 8), "I": (0.0, 0), "W": (0.0, 0)},
                {"F": (8.4, 8), "FS": (2.4, 2), "B": (12.0, 6), "I": (2.2, 2), "W": (2.2, 2)}]
    costs = costs_from_times(measured)
    # the first stage's split backward runs whole in W, after a plain forward
    assert costs[0] == {"F": 1.0, "FS": 1.0, "B": 2.0, "I": 0.0, "W": 2.0}
    assert costs[1] == pytest.approx({"F": 1.0, "FS": 1.2, "B": 2.0, "I": 1.1, "W": 1.1})


def test_costs_derive_what_a_rank_did_not_run() -> None:
    """pp=3, m=3 under zb-drain: the last rank splits every backward (no B timed: B = (I + W) / the other ranks'
    ratio); a rank that split nothing takes the median ratio and W share."""
    measured = [{"F": (3.0, 3), "B": (6.0, 3)},
                {"F": (3.0, 3), "B": (2.0, 1), "I": (1.0, 2), "W": (3.4, 2)},  # I + W = 2.2 = 1.1 x B, W share 0.77
                {"F": (3.0, 3), "I": (3.3, 3), "W": (3.3, 3)}]
    costs = costs_from_times(measured)
    assert costs[2]["B"] == pytest.approx(2.2 / 1.1) and costs[2]["I"] == pytest.approx(1.1)
    assert costs_from_times([{"F": (2.0, 2)}, {"F": (2.0, 2), "B": (4.0, 2)}])[1] == pytest.approx(
        {"F": 1.0, "FS": 1.0, "B": 2.0, "I": 1.0, "W": 1.0})  # nothing split anywhere: W half of B, no overhead


def test_a_split_forward_costs_what_the_ranks_that_split_measured() -> None:
    """pp=3: rank 1 timed no split forward (all its forwards plain); rank 2 split 1 of 3, 10% dearer: rank 1 takes
    that ratio, and so does a rank whose every forward was split (its F derived from its FS); alone, FS is its F."""
    measured = [{"F": (3.0, 3), "B": (6.0, 3)},
                {"F": (6.0, 3), "B": (12.0, 3)},
                {"F": (3.1, 3), "FS": (1.1, 1), "B": (4.0, 2), "I": (1.1, 1), "W": (1.1, 1)}]
    costs = costs_from_times(measured)
    assert costs[1]["FS"] == pytest.approx(2.2) and costs[2]["FS"] == pytest.approx(1.1)
    assert costs[2]["F"] == pytest.approx(1.0) and costs[0]["FS"] == costs[0]["F"] == 1.0
    every = costs_from_times([{"F": (1.0, 1)}, {"F": (3.3, 3), "FS": (3.3, 3), "I": (3.0, 3), "W": (3.0, 3)}])
    assert every[1]["F"] == every[1]["FS"] == pytest.approx(1.1)
    measured[1] = {"F": (6.6, 3), "FS": (6.6, 3), "I": (3.0, 3), "W": (3.0, 3)}  # every forward split: F from FS
    assert costs_from_times(measured)[1] == pytest.approx({"F": 2.0, "FS": 2.2, "B": 2.0 / 1.1, "I": 1.0, "W": 1.0})


def test_split_forwards_cost_fs_in_the_simulation() -> None:
    """FS is what a forward costs off the first stage where its backward is split: 1F1B (no split) ignores it,
    zero-bubble (every backward split) pays it on every forward of rank 1, zb-drain on 2 of 8."""
    base = _costs(2)
    dear = [dict(c, FS=c["F"] + 0.5) for c in base]
    assert simulate("1f1b", 2, 8, rank_costs=dear).makespan == simulate("1f1b", 2, 8, rank_costs=base).makespan
    plain, split = simulate("zero-bubble", 2, 8, rank_costs=base), simulate("zero-bubble", 2, 8, rank_costs=dear)
    assert split.busy[0] == plain.busy[0] and split.busy[1] == pytest.approx(plain.busy[1] + 8 * 0.5)
    drain = simulate("zb-drain", 2, 8, rank_costs=dear).busy[1] - simulate("zb-drain", 2, 8, rank_costs=base).busy[1]
    assert drain == pytest.approx(2 * 0.5)


# ---- the choice ---------------------------------------------------------------------------------------------------
def test_free_split_chooses_a_zero_bubble_schedule() -> None:
    choice = choose_schedule(2, 8, _costs(2))
    assert choice.schedule == "zb-drain"  # ties zero-bubble at pp=2 and splits fewer backwards: preferred
    assert choice.makespans["zb-drain"] < choice.makespans["1f1b"]
    assert choice.schedule == choose_schedule(2, 8, _costs(2)).schedule  # deterministic
    assert choose_schedule(8, 16, _costs(8)).schedule == "zero-bubble"  # larger pp: every backward split pays


def test_costly_split_chooses_1f1b() -> None:
    """I + W taking a whole forward more than B: zb-drain's few split backwards cost more than the bubble saved."""
    choice = choose_schedule(2, 8, _costs(2, split=1.5))
    assert choice.schedule == "1f1b"
    assert set(choice.makespans) == set(AUTO_CANDIDATES)


def test_cpu_like_split_overhead_still_chooses_zb_drain() -> None:
    """On the benchmark's CPU a split backward costs ~10% more: zb-drain (2 splits on rank 1) still wins."""
    choice = choose_schedule(2, 8, _costs(2, split=0.2))
    assert choice.schedule == "zb-drain" and choice.makespans["zb-drain"] < 0.97 * choice.makespans["1f1b"]


def test_varying_actions_choose_zb_lead() -> None:
    """The benchmark's costs (ms per action, CPU): zb-lead only where the measured action times vary enough for its
    slack to pay (10% here), zb-drain where they do not (it holds less)."""
    costs = [{"F": 142, "B": 257, "I": 0, "W": 257}, {"F": 155, "B": 262, "I": 160, "W": 112}]
    assert choose_schedule(2, 8, costs).schedule == "zb-drain"
    assert choose_schedule(2, 8, costs, jitter=0.01).schedule == "zb-drain"
    choice = choose_schedule(2, 8, costs, jitter=0.1)
    assert choice.schedule == "zb-lead" and choice.jitter == 0.1
    assert choice.describe().endswith("; action times vary by 10.0%)")


def test_a_dearer_split_forward_keeps_zero_bubble_out() -> None:
    """Benchmark-like costs with 7% jitter: zero-bubble wins while its split forwards are taken to cost a plain
    forward, not once they cost the 3% more the benchmark measures (every one of rank 1's forwards pays it)."""
    costs = [{"F": 142, "B": 257, "I": 0, "W": 257}, {"F": 155, "B": 262, "I": 140, "W": 120}]
    cheap = choose_schedule(2, 8, costs, jitter=0.07)
    assert cheap.schedule == "zero-bubble"
    dearer = [dict(costs[0], FS=142), dict(costs[1], FS=160)]
    choice = choose_schedule(2, 8, dearer, jitter=0.07)
    assert choice.schedule == "zb-drain"  # zero-bubble no longer more than the tie margin ahead of it
    gain = {c.schedule: c.makespans["zb-drain"] / c.makespans["zero-bubble"] for c in (cheap, choice)}
    assert gain["zero-bubble"] > 1.01 > gain["zb-drain"]
    seconds = [{k: v / 1000 for k, v in c.items()} for c in dearer]
    assert "F=142.00/155.00 FS=142.00/160.00 B=257.00/262.00" in choose_schedule(2, 8, seconds).describe()


def test_ties_go_to_the_simpler_schedule() -> None:
    """GPipe and 1F1B take the same time here (no split schedule allowed): 1F1B, listed first, is chosen; a gain
    under the tie margin does not switch."""
    assert choose_schedule(2, 8, _costs(2), candidates=("1f1b", "gpipe")).schedule == "1f1b"
    assert choose_schedule(2, 8, _costs(2), candidates=("1f1b", "zb-drain"), tie=0.1).schedule == "1f1b"


def test_describe_names_the_choice_and_the_costs() -> None:
    line = choose_schedule(2, 8, _costs(2, f=0.01, b=0.02)).describe()
    assert line.startswith("schedule='auto': chose 'zb-drain' (simulated step 0.926 x 1f1b; candidates 1f1b 1.000, ")
    assert "F=10.00/10.00 B=20.00/20.00 I=0.00/10.00 W=20.00/10.00" in line


# ---- configuration ------------------------------------------------------------------------------------------------
def test_auto_settles_where_the_layout_decides() -> None:
    assert settle_auto(2, 4, 1) is None  # measure, then choose
    choice = settle_auto(2, 4, 2)
    assert choice.schedule == "interleaved-1f1b"
    assert choice.describe() == ("schedule='auto': chose 'interleaved-1f1b' (virtual_stages=2: the one schedule "
                                 "with several chunks per rank)")
    assert settle_auto(4, 2, 1).schedule == "gpipe"  # zb-drain (which measures) and 1F1B need m >= pp
    with pytest.raises(ScheduleConfigError, match="needs microbatches divisible by pp=2, got 3"):
        settle_auto(2, 3, 2)


def test_strategy_accepts_auto_and_keeps_it_in_its_config() -> None:
    from lightning_tpp import TensorPipeStrategy

    strategy = TensorPipeStrategy(pp=2, schedule="auto")
    assert strategy.schedule == "auto" and strategy.microbatches == 4
    assert strategy._config()["schedule"] == "'auto'"
    assert TensorPipeStrategy(pp=2).schedule == "auto"  # the default
    TensorPipeStrategy(pp=2, virtual_stages=2)  # interleaved 1F1B
    TensorPipeStrategy(pp=4, microbatches=2)  # GPipe
    with pytest.raises(ScheduleConfigError, match="needs microbatches divisible by pp=2, got 3"):
        TensorPipeStrategy(pp=2, microbatches=3, virtual_stages=2)


# ---- what the engine measures -------------------------------------------------------------------------------------
def test_engine_costs_are_means_over_the_measured_steps_and_jitter_their_spread() -> None:
    """Two measured steps: each kind's cost is its mean over both (not its faster step), and the jitter the spread
    of the F and B actions, weighted by their count (I and W, a few per step, are left out)."""
    from types import SimpleNamespace

    from lightning_tpp.pipeline.engine import PipelineEngine
    from lightning_tpp.pipeline.executor import StepTimes

    engine = PipelineEngine.__new__(PipelineEngine)  # only the measuring state
    engine._auto_moments = {}
    # step 1: F 0.1 and 0.2, B 0.3 twice, one I; step 2: F 0.1 and 0.2, B 0.3 twice, one I of another length
    for i in (0.1, 0.3):
        engine.executor = SimpleNamespace(times=StepTimes(
            0.0, 1.0, 0.0, 0.0, 2, costs={"F": (0.3, 2), "B": (0.6, 2), "I": (i, 1), "W": (0.0, 0)},
            squares={"F": 0.1 ** 2 + 0.2 ** 2, "B": 2 * 0.3 ** 2, "I": i ** 2, "W": 0.0}))
        engine._add_measured()
    assert engine._auto_moments["I"] == pytest.approx((2, 0.4, 0.1))  # the mean, 0.2: not the faster step's 0.1
    assert "W" not in engine._auto_moments
    # F: mean 0.15, standard deviation 0.05 (cv 1/3) over 4 actions; B: no spread over 4
    assert engine._jitter() == pytest.approx((4 * (1 / 3) + 4 * 0.0) / 8)
