"""tools/bench_sync.py's arithmetic: the ideal speedup, staleness and reward from trace spans, and
the per-schedule rows that set each run against its own round's synchronous run."""

from __future__ import annotations

import statistics

import pytest


import bench_sync


def rollout(step: int, version: int, end: float, reward: float | None = None) -> dict:
    attrs = {} if reward is None else {"reward_mean": reward}
    return {"kind": "rollout", "step": step, "version": version, "start": end - 1, "end": end,
            "attrs": attrs}


def test_ideal_speedup_is_the_sum_over_the_slower_side():
    assert bench_sync.ideal_speedup(2.0, 1.0) == pytest.approx(1.5)
    assert bench_sync.ideal_speedup(1.0, 4.0) == pytest.approx(1.25)
    assert bench_sync.ideal_speedup(3.0, 3.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="rollout and train"):
        bench_sync.ideal_speedup(0.0, 1.0)


def test_staleness_counts_rollouts_only():
    spans = [rollout(0, 0, 1), rollout(1, 0, 2), rollout(2, 1, 3), rollout(3, 1, 4),
             {"kind": "train", "step": 9, "version": 0, "start": 0, "end": 1},
             {"kind": "rollout", "step": None, "version": None, "start": 0, "end": 1}]
    assert bench_sync.staleness(spans) == (pytest.approx(1.0), 2)
    assert bench_sync.staleness([]) == (0.0, 0)


def test_reward_is_the_mean_of_the_last_batches_to_finish():
    spans = [rollout(3, 3, 40, 0.9), rollout(0, 0, 10, 0.1), rollout(2, 2, 30, 0.7),
             rollout(1, 1, 20, 0.3), rollout(4, 4, 50)]  # no reward: not counted
    assert bench_sync.reward_after(spans, last=2) == pytest.approx(0.8)
    assert bench_sync.reward_after([rollout(0, 0, 1)]) is None


def run(rnd: int, schedule: str, step_time: float, ok: bool = True, **extra) -> dict:
    return {"round": rnd, "ratio": 1.0, "schedule": schedule, "ok": ok, "step_time": step_time,
            "staleness_mean": 0.5, "staleness_max": 1, "reward": 0.4,
            "heldout": {"sampled/accuracy": 0.5, "greedy/accuracy": 0.6}, **extra}


def test_rows_set_each_run_against_its_own_rounds_synchronous_run():
    # round 0: R 2, T 1 (ideal 1.5); round 1: R 1, T 1 (ideal 2)
    runs = [run(0, "synchronous", 3.0, rollout=2.0, train=1.0,
                predicted={"synchronous": 3.0, "fully_async": 2.1}),
            run(0, "fully_async", 2.0),
            run(1, "synchronous", 2.0, rollout=1.0, train=1.0,
                predicted={"synchronous": 2.0, "fully_async": 1.05}),
            run(1, "fully_async", 1.0, staleness_max=3),
            run(1, "fully_async", 9.0, ok=False)]
    rows = {r["schedule"]: r for r in bench_sync.summarise(runs)}
    fully = rows["fully_async"]
    # speedups 1.5 and 2.0, each the ideal of its round: a share of 1 in both
    assert fully["speedup"] == pytest.approx(1.75) and fully["share"] == pytest.approx(1.0)
    assert fully["ideal"] == pytest.approx(1.75) and fully["measured_ratio"] == pytest.approx(1.5)
    # plan errors +5% and +5%
    assert fully["plan_error"] == pytest.approx(0.05)
    assert fully["runs"] == 2 and fully["failed"] == 1 and fully["staleness_max"] == 3
    sync = rows["synchronous"]
    assert sync["speedup"] == pytest.approx(1.0) and sync["plan_error"] == pytest.approx(0.0)
    assert sync["share"] == pytest.approx(statistics.median([1 / 1.5, 1 / 2.0]))
    lines = bench_sync.verdicts(list(rows.values()))
    assert any(line.startswith("met: fully_async at ratio 1") for line in lines)
    assert any(line.startswith("met: the plan is within 10%") for line in lines)


def test_a_round_without_its_synchronous_run_is_left_out_of_the_ratios():
    runs = [run(0, "synchronous", 3.0, ok=False), run(0, "one_step_off_policy", 2.0)]
    row = {r["schedule"]: r for r in bench_sync.summarise(runs)}["one_step_off_policy"]
    assert row["step_time"] == pytest.approx(2.0)
    assert row["speedup"] is None and row["share"] is None and row["plan_error"] is None
    assert not any("one_step_off_policy at ratio" in v for v in bench_sync.verdicts([row]))



def test_idle_and_slower_side_shares_are_medians_with_their_verdicts():
    runs = [run(0, "synchronous", 3.0, rollout=2.0, train=1.0, predicted={}, neither=0.12,
                slower_busy=0.6),
            run(1, "synchronous", 3.0, rollout=2.0, train=1.0, predicted={}, neither=0.02,
                slower_busy=0.6),
            run(0, "fully_async", 2.0, neither=0.0, slower_busy=0.97),
            run(1, "fully_async", 2.0, neither=0.0, slower_busy=0.99)]
    rows = {r["schedule"]: r for r in bench_sync.summarise(runs)}
    assert rows["synchronous"]["neither"] == pytest.approx(0.07)
    assert rows["fully_async"]["slower_busy"] == pytest.approx(0.98)
    lines = bench_sync.verdicts(list(rows.values()))
    assert "NOT met: synchronous at ratio 1 has neither side working 7.0%" in "\n".join(lines)
    assert any(line.startswith("met: fully_async at ratio 1 keeps its slower side busy 98.0%")
               for line in lines)
