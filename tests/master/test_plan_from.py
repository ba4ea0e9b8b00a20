"""`tandem plan --from RUN_DIR`: durations measured from a trace, replayed over every preset,
and the advice under a staleness bound. The trace is written in the trace format by hand: a
synchronous run with rollout 1 s, train 2 s, publish and load 0.1 s, whose first step also
pays a warm-up."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from plan_traces import ROLLOUT, STEPS, SYNC, TRAIN, write_shared_run, write_sync_run

from tandem.common.sync import SyncPlan
from tandem.master import plan_from
from tandem.master.cli import tandem
from tandem.master.simulate import Gaps, simulate

@pytest.fixture
def run_dir(tmp_path) -> Path:
    return write_sync_run(tmp_path / "run")


def test_durations_are_the_means_after_the_warm_up_step(run_dir):
    d = plan_from.measure(run_dir)
    assert d.explorers == ["explorer-0"] and d.steps == STEPS
    assert d.rollout == pytest.approx([ROLLOUT]) and d.load == pytest.approx([SYNC])
    assert (d.train, d.publish) == pytest.approx((TRAIN, SYNC))
    assert d.step_time == pytest.approx((ROLLOUT + TRAIN + SYNC) + (8.0 - SYNC) / STEPS)


def test_every_preset_is_replayed_with_its_step_time_and_staleness(run_dir):
    d = plan_from.measure(run_dir)
    own = SyncPlan.preset("synchronous")
    by_name = {p.name: p for p in plan_from.replay_all(d, own)}
    assert set(by_name) == {"your knobs", "synchronous", "one_step_off_policy", "fully_async"}
    sync, off, fully = (by_name[n] for n in ("synchronous", "one_step_off_policy",
                                              "fully_async"))
    assert by_name["your knobs"].step_time == pytest.approx(sync.step_time)
    # synchronous: each step pays rollout + train + the broadcast, nothing overlaps
    assert sync.step_time == pytest.approx(ROLLOUT + TRAIN + SYNC, rel=0.05)
    assert sync.staleness() == (0.0, 0)
    # overlapping, the step is bound by the slower side (train) plus its publish
    for p in (off, fully):
        assert p.step_time < 0.8 * sync.step_time
        assert p.step_time >= TRAIN
    assert off.staleness()[1] == 1 and fully.staleness()[1] <= 4
    assert fully.timeline.utilization()["trainer"] > sync.timeline.utilization()["trainer"]


def test_advice_respects_the_bound_and_says_what_it_gains(run_dir):
    d = plan_from.measure(run_dir)
    own = plan_from.predict(d, "your knobs", SyncPlan.preset("synchronous"))
    fresh = plan_from.advise(d, own, max_staleness=0)
    assert fresh.staleness()[1] == 0
    assert fresh.step_time == pytest.approx(own.step_time)  # nothing to gain without staleness
    one = plan_from.advise(d, own, max_staleness=1)
    assert one.staleness()[1] <= 1
    assert own.step_time / one.step_time > 1.25
    # a looser bound never predicts less throughput
    assert plan_from.advise(d, own, max_staleness=3).step_time <= one.step_time + 1e-9


def test_cli_prints_the_table_and_the_advice(run_dir):
    result = CliRunner().invoke(tandem, ["plan", "--from", str(run_dir), "--advise",
                                         "--max-staleness", "1"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("measured: rollout explorer-0 1.000s (load 0.100s)")
    assert any(line.startswith("fully_async") for line in lines)
    assert "advice (staleness <= 1)" in lines[-1] and "x the throughput" in lines[-1]

    result = CliRunner().invoke(tandem, ["plan", "--from", str(run_dir), "--json",
                                         "--interval", "2"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["predictions"][0]["knobs"]["interval"] == 2  # the run's knobs, with ours on top
    assert out["predictions"][0]["knobs"]["method"] == "nccl" and out["advice"] is None

    result = CliRunner().invoke(tandem, ["plan", "--from", str(run_dir), "--json", "--advise",
                                         "--max-staleness", "2"])
    out = json.loads(result.output)
    ranked = out["ranked"]  # the candidates, the shortest predicted step first
    assert ranked[0]["knobs"] == out["advice"]["knobs"] and len(ranked) == 5
    assert [r["step_time"] for r in ranked] == sorted(r["step_time"] for r in ranked)
    assert all(r["staleness_max"] <= 2 for r in ranked)


def test_bad_uses_are_one_line_errors(run_dir, tmp_path):
    runner = CliRunner()
    result = runner.invoke(tandem, ["plan", "--from", str(run_dir), "--advise"])
    assert result.exit_code == 2 and "--advise needs --from RUN_DIR and --max-staleness" \
        in result.output
    empty = tmp_path / "empty"
    (empty / "trace").mkdir(parents=True)
    result = runner.invoke(tandem, ["plan", "--from", str(empty)])
    assert result.exit_code == 1
    assert "the trace has no rollout, train or sync spans" in result.output


def test_steady_step_time_leaves_out_the_warm_up(run_dir):
    d = plan_from.measure(run_dir)
    sync = plan_from.predict(d, "synchronous", SyncPlan.preset("synchronous"))
    assert sync.steady_step_time == pytest.approx(ROLLOUT + TRAIN + SYNC)
    # the run's own train ends: the first step's warm-up is before the first end
    ends = [json.loads(line)["end"] for line in
            (run_dir / "trace" / "trainer.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"]
    assert plan_from.steady_step_time(ends) == pytest.approx(ROLLOUT + TRAIN + SYNC)
    with pytest.raises(ValueError, match="two train steps"):
        plan_from.steady_step_time(ends[:1])


def test_gaps_are_measured_per_kind_and_replayed(tmp_path):
    gaps = dict(sample=0.05, publish=0.02, load=0.01, rollout_gap=0.005)
    run_dir = write_sync_run(tmp_path / "run", **gaps)
    d = plan_from.measure(run_dir)
    assert (d.gaps.sample, d.gaps.publish, d.gaps.load, d.gaps.rollout) == pytest.approx(
        (0.05, 0.02, 0.01, 0.005), abs=1e-5)  # T0's float resolution
    # a synchronous run never rolls out twice in a row: with lease-ahead (the default) the
    # rollout after a rollout starts as one after a load does
    assert d.gaps.next_rollout == pytest.approx(0.005, abs=1e-5)
    # the broadcast is timed from the moment the explorer joined it, not the trainer's wait
    assert d.publish == pytest.approx(SYNC, abs=1e-5)
    sync = plan_from.predict(d, "synchronous", SyncPlan.preset("synchronous"))
    assert sync.steady_step_time == pytest.approx(ROLLOUT + TRAIN + SYNC + sum(gaps.values()),
                                                  abs=1e-4)


def test_simulator_starts_each_block_its_gap_after_what_it_waits_for():
    gaps = Gaps(sample=0.1, publish=0.2, load=0.3, rollout=0.4, next_rollout=-0.5)
    sync = simulate(SyncPlan.preset("synchronous"), steps=3, rollout_times=[1.0],
                    train_time=2.0, sync_time=0.0, gaps=gaps, compare=False)
    rollouts, trains = sync.lane("explorer-0", "rollout"), sync.lane("trainer", "train")
    assert trains[0].start == pytest.approx(rollouts[0].end + 0.1)
    # the broadcast: publish after the train step, the explorer joins `load` after, then rolls
    assert rollouts[1].start == pytest.approx(trains[0].end + 0.2 + 0.3 + 0.4)
    fully = simulate(SyncPlan.preset("fully_async", max_staleness=8), steps=4,
                     rollout_times=[1.0], train_time=0.5, sync_time=0.0, gaps=gaps,
                     compare=False)
    ro = fully.lane("explorer-0", "rollout")
    # a pipelining explorer starts its next rollout before the previous one's span ends
    assert [b.start for b in ro[:2]] == pytest.approx([0.0, 0.5])
    with pytest.raises(ValueError, match="gaps must be >= 0"):
        Gaps(sample=-0.1)


def test_sharing_is_fitted_from_spans_alone_and_overlapping(tmp_path):
    d = plan_from.measure(write_shared_run(tmp_path / "run", stretch=1.6))
    # two threads on cores that behave as 1.25 stretch each side 2 / 1.25 = 1.6
    assert d.sharing.calibrated and d.sharing.cores == pytest.approx(1.25)
    assert d.sharing.threads == {"trainer": 1, "explorer-0": 1}
    # the durations are the work alone, the stretch taken out
    assert (d.rollout[0], d.train) == pytest.approx((1.0, 1.0))
    # a run whose sides never overlapped cannot tell: the run's cores are taken as they are
    sync = plan_from.measure(write_sync_run(tmp_path / "sync"))
    assert not sync.sharing.calibrated and sync.sharing.cores == 2


def test_the_replay_stretches_the_sides_that_share_cores():
    base = plan_from.Durations(explorers=["explorer-0"], rollout=[1.0], load=[0.0], train=1.0,
                               publish=0.0, steps=12, step_time=0.0)
    plan = SyncPlan.preset("fully_async", max_staleness=8)

    def step(cores: float, run_cores: int = 2) -> float:
        sharing = plan_from.Sharing({"trainer": 1, "explorer-0": 1}, cores, run_cores)
        return plan_from.predict(replace(base, sharing=sharing), "p", plan).steady_step_time

    # free cores: the sides overlap at full speed; one core: each runs at half speed
    assert step(2.0) == pytest.approx(1.0)
    assert step(1.0) == pytest.approx(2.0, rel=0.02)
    # the same machine's sharing, on a machine with twice the cores
    shared = plan_from.Sharing({"trainer": 1, "explorer-0": 1}, 1.0, 2).on(4)
    assert shared.cores == 2.0 and shared.run_cores == 4
    # a synchronous plan never overlaps: no stretch whatever the cores
    sync = plan_from.predict(replace(base, sharing=plan_from.Sharing(
        {"trainer": 1, "explorer-0": 1}, 1.0, 2)), "s", SyncPlan.preset("synchronous"))
    assert sync.steady_step_time == pytest.approx(2.0)


def test_cli_plans_for_another_machine_and_takes_the_sharing_from_another_run(tmp_path):
    shared = write_shared_run(tmp_path / "shared", stretch=1.6)
    sync = write_sync_run(tmp_path / "sync")
    runner = CliRunner()
    result = runner.invoke(tandem, ["plan", "--from", str(sync), "--stretch-from", str(shared),
                                    "--json"])
    assert result.exit_code == 0, result.output
    sharing = json.loads(result.output)["measured"]["sharing"]
    assert sharing["calibrated"] and sharing["cores"] == pytest.approx(1.25)
    result = runner.invoke(tandem, ["plan", "--from", str(shared), "--cores", "4", "--json"])
    assert json.loads(result.output)["measured"]["sharing"]["cores"] == pytest.approx(2.5)
    result = runner.invoke(tandem, ["plan", "--stretch-from", str(shared)])
    assert result.exit_code == 2 and "--stretch-from needs --from" in result.output


def test_plan_without_a_run_takes_a_gap_and_the_cores(tmp_path):
    def makespan(*args: str) -> float:
        result = CliRunner().invoke(tandem, ["plan", "--preset", "fully_async", "--steps", "8",
                                             "--rollout-time", "1", "--train-time", "1",
                                             "--sync-time", "0", "--json", *args])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["makespan"]

    free = makespan()
    assert makespan("--cores", "2") == pytest.approx(free)  # one thread a side on 2 cores
    assert makespan("--cores", "1") > 1.8 * free  # on one core each side runs at half speed
    # a gap before every train step and publish: at least the steps' gaps are added
    assert makespan("--gap", "0.1") >= free + 8 * 0.1
