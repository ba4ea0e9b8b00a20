"""`tandem plan --from RUN_DIR`: durations measured from a trace, replayed over every preset,
and the advice under a staleness bound. The trace is written in the trace format by hand: a
synchronous run with rollout 1 s, train 2 s, publish and load 0.1 s, whose first step also
pays a warm-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from tandem.common.config import RunConfig
from tandem.common.sync import SyncPlan
from tandem.master import plan_from
from tandem.master.cli import tandem

ROLLOUT, TRAIN, SYNC, STEPS = 1.0, 2.0, 0.1, 6
T0 = 1_800_000_000.0


def span(component: str, kind: str, start: float, end: float, step: int | None,
         version: int | None, **attrs) -> str:
    return json.dumps({"component": component, "kind": kind, "step": step, "version": version,
                       "start": T0 + start, "end": T0 + end, "pid": 1, "attrs": attrs})


def write_sync_run(run_dir: Path, preset: str = "synchronous") -> Path:
    explorer, trainer = [], []
    t = 0.0
    for e in range(STEPS):
        if e:
            explorer.append(span("explorer-0", "sync", t, t + SYNC, e, e, method="nccl"))
            t += SYNC
        rollout = ROLLOUT + (3.0 if e == 0 else 0.0)  # the first step warms up
        explorer.append(span("explorer-0", "rollout", t, t + rollout, e, e, groups=2))
        t += rollout
        train = TRAIN + (5.0 if e == 0 else 0.0)
        trainer.append(span("trainer", "train", t, t + train, e, e + 1))
        t += train
        if e < STEPS - 1:
            trainer.append(span("trainer", "sync", t, t + SYNC, e, e + 1, method="nccl"))
    (run_dir / "trace").mkdir(parents=True)
    (run_dir / "trace" / "explorer-0.jsonl").write_text("\n".join(explorer) + "\n")
    (run_dir / "trace" / "trainer.jsonl").write_text("\n".join(trainer) + "\n")
    # one thread a side on two cores: overlapping sides do not slow each other
    config = RunConfig.model_validate({
        "run_dir": str(run_dir), "sync": {"preset": preset},
        "placement": {"cores": 2, "trainer": {"threads": 1}, "explorers": {"threads": 1}}})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return run_dir


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
