"""`tandem plan`: the simulator replays SyncPlan over durations; timelines pinned by hand."""

from __future__ import annotations

import itertools
import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.sync import PRESETS, SyncPlan, preset_explorers
from tandem.master.cli import tandem
from tandem.master.simulate import simulate


def spans(timeline, lane, kind):
    return [(b.start, b.end) for b in timeline.lane(lane, kind)]


def test_synchronous_alternates_with_a_collective_sync():
    tl = simulate(SyncPlan.preset("synchronous"), steps=3, rollout_times=[2.0], train_time=1.0,
                  sync_time=0.25)
    assert spans(tl, "explorer-0", "rollout") == [(0, 2), (3.25, 5.25), (6.5, 8.5)]
    assert spans(tl, "trainer", "train") == [(2, 3), (5.25, 6.25), (8.5, 9.5)]
    # one purple block on each lane per broadcast, at the same time
    assert spans(tl, "trainer", "sync") == spans(tl, "explorer-0", "sync") == [
        (3, 3.25), (6.25, 6.5)]
    assert {b.method for b in tl.blocks if b.kind == "sync"} == {"nccl"}
    assert [b.version for b in tl.lane("explorer-0", "rollout")] == [0, 1, 2]
    assert tl.makespan == 9.5 and tl.speedup_vs_synchronous == 1.0


def test_one_step_off_policy_trainer_waits_for_the_explorer_at_the_sync_point():
    tl = simulate(SyncPlan.preset("one_step_off_policy"), steps=4, rollout_times=[2.0],
                  train_time=1.0, sync_time=0.0)
    assert spans(tl, "explorer-0", "rollout") == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # trainer step 0 ends at 3 but can only broadcast version 1 when the explorer reaches step 2
    assert spans(tl, "trainer", "train") == [(2, 3), (4, 5), (6, 7), (8, 9)]
    assert [b.version for b in tl.lane("explorer-0", "rollout")] == [0, 0, 1, 2]
    assert tl.speedup_vs_synchronous == pytest.approx(12 / 9)


def test_interval_4_offset_0_rolls_out_four_batches_then_waits():
    tl = simulate(SyncPlan(method="nccl", interval=4, offset=0), steps=8, rollout_times=[1.0],
                  train_time=1.0, sync_time=0.0)
    rollouts = tl.lane("explorer-0", "rollout")
    assert [b.version for b in rollouts] == [0, 0, 0, 0, 4, 4, 4, 4]
    # step 4 waits for trainer steps 0..3, the last of which ends at 5
    assert [b.start for b in rollouts] == [0, 1, 2, 3, 5, 6, 7, 8]
    assert spans(tl, "trainer", "train")[3] == (4, 5)
    assert [b.batches for b in tl.lane("trainer", "train")] == [[t] for t in range(8)]


def test_interval_1_offset_4_runs_four_batches_ahead():
    tl = simulate(SyncPlan(method="checkpoint", interval=1, offset=4), steps=8,
                  rollout_times=[1.0], train_time=1.0, sync_time=0.0)
    rollouts = tl.lane("explorer-0", "rollout")
    assert [b.version for b in rollouts] == [0, 0, 0, 0, 0, 1, 2, 3]
    assert [b.start for b in rollouts] == list(range(8))  # never waits
    # trainer step t starts once batch t is in the buffer
    assert [s for s, _ in spans(tl, "trainer", "train")] == list(range(1, 9))


def test_fully_async_respects_the_staleness_bound_when_the_trainer_is_slow():
    plan = SyncPlan.preset("fully_async")  # max_staleness 4
    tl = simulate(plan, steps=10, rollout_times=[1.0], train_time=3.0, sync_time=0.0)
    rollouts = tl.lane("explorer-0", "rollout")
    assert all(b.version >= b.step - 4 for b in rollouts)
    # steps 0..5 run back to back (version 1 exists at 4), step 6 waits for version 2 at 7
    assert [b.start for b in rollouts[:7]] == [0, 1, 2, 3, 4, 5, 7]
    assert rollouts[5].version == 1 and rollouts[6].version == 2
    assert {b.method for b in tl.blocks if b.kind == "sync"} <= {"checkpoint"}


def test_fully_async_never_waits_with_a_fast_trainer():
    tl = simulate(SyncPlan.preset("fully_async"), steps=6, rollout_times=[2.0], train_time=0.5,
                  sync_time=0.0)
    rollouts = tl.lane("explorer-0", "rollout")
    assert [b.start for b in rollouts] == [0, 2, 4, 6, 8, 10]
    # it loads the newest published version at every step (interval 1)
    assert [b.version for b in rollouts] == [0, 0, 1, 2, 3, 4]


def test_multi_explorer_async_fast_explorer_takes_more_batches():
    plan = SyncPlan.preset("multi_explorer_async", batches_per_step=2)
    tl = simulate(plan, steps=6, rollout_times=[1.0, 3.0], train_time=0.5, sync_time=0.1)
    fast, slow = tl.lane("explorer-0", "rollout"), tl.lane("explorer-1", "rollout")
    assert len(fast) + len(slow) == 12 and len(fast) > len(slow)
    trained = [g for b in tl.lane("trainer", "train") for g in b.batches]
    assert sorted(trained) == list(range(12))  # each batch trained on exactly once
    for b in fast + slow:
        assert b.version >= plan.step_of_batch(b.batch) - plan.max_staleness
    # the trainer only takes batches that are complete
    ends = {b.batch: b.end for b in fast + slow}
    for t in tl.lane("trainer", "train"):
        assert all(ends[g] <= t.start for g in t.batches)


def test_several_explorers_synchronous_trainer_takes_one_batch_from_each():
    tl = simulate(SyncPlan.preset("synchronous", batches_per_step=2), steps=3,
                  rollout_times=[1.0, 2.0], train_time=1.0, sync_time=0.0)
    assert [b.batches for b in tl.lane("trainer", "train")] == [[0, 1], [2, 3], [4, 5]]
    # the broadcast waits for the slower explorer; both then roll out version t
    assert spans(tl, "trainer", "train") == [(2, 3), (5, 6), (8, 9)]
    assert [b.start for b in tl.lane("explorer-0", "rollout")] == [0, 3, 6]
    assert tl.utilization()["explorers"] == [pytest.approx(3 / 9, abs=1e-4),
                                             pytest.approx(6 / 9, abs=1e-4)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(interval=st.integers(1, 4), offset=st.one_of(st.none(), st.integers(0, 5)),
       staleness=st.integers(0, 4), method=st.sampled_from(["nccl", "checkpoint"]),
       explorers=st.integers(1, 3), steps=st.integers(1, 9),
       rollout=st.lists(st.floats(0.5, 3.0), min_size=3, max_size=3),
       train=st.floats(0.2, 3.0), sync=st.floats(0.0, 0.5))
def test_every_plan_terminates_and_keeps_its_promises(interval, offset, staleness, method,
                                                      explorers, steps, rollout, train, sync):
    if offset is None:
        method = "checkpoint"
    plan = SyncPlan(method=method, interval=interval, offset=offset, max_staleness=staleness,
                    batches_per_step=explorers)
    tl = simulate(plan, steps=steps, rollout_times=rollout[:explorers], train_time=train,
                  sync_time=sync, compare=False)
    rollouts = [b for b in tl.blocks if b.kind == "rollout"]
    trains = tl.lane("trainer", "train")
    assert len(rollouts) == steps * explorers and len(trains) == steps
    assert sorted(g for t in trains for g in t.batches) == sorted(b.batch for b in rollouts)
    train_end = {t.step: t.end for t in trains}
    for b in rollouts:
        step = b.step
        if offset is None:
            assert b.version >= step - staleness
        else:
            assert b.version == plan.version_for_step(step)
        if b.version > 0:  # the weights existed before the rollout started
            assert train_end[b.version - 1] <= b.start + 1e-9
    for lane in ["trainer"] + [f"explorer-{i}" for i in range(explorers)]:
        blocks = sorted(tl.lane(lane), key=lambda b: b.start)
        assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(blocks))


@pytest.mark.parametrize("preset", list(PRESETS))
def test_cli_replays_the_explorers_a_preset_runs_with(preset):
    result = CliRunner().invoke(tandem, ["plan", "--preset", preset, "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output)["explorers"]) == preset_explorers(preset)


def test_cli_json_schema():
    result = CliRunner().invoke(tandem, ["plan", "--preset", "multi_explorer_async", "--steps",
                                         "4", "--rollout-time", "1,2", "--train-time", "0.5",
                                         "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data) >= {"explorers", "trainer", "syncs", "makespan", "utilization",
                         "speedup_vs_synchronous"}
    assert len(data["explorers"]) == 2
    assert set(data["explorers"][0][0]) >= {"step", "start", "end", "version"}
    assert set(data["trainer"][0]) >= {"step", "start", "end", "batches"}
    assert set(data["syncs"][0]) >= {"version", "start", "end", "method"}
    assert set(data["utilization"]) == {"trainer", "explorers"}
    assert len(data["utilization"]["explorers"]) == 2


def test_cli_terminal_and_png(tmp_path):
    png = tmp_path / "plan.png"
    result = CliRunner().invoke(tandem, ["plan", "--preset", "one_step_off_policy", "--steps", "4",
                                         "--rollout-time", "2", "--png", str(png)])
    assert result.exit_code == 0, result.output
    for lane in ("explorer-0", "buffer", "trainer", "speedup vs synchronous"):
        assert lane in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--offset", "null", "--method", "nccl"], "checkpoint"),
    (["--explorers", "3", "--rollout-time", "1,2"], "2 rollout times for 3 explorers"),
    (["--offset", "soon"], "integer or null"),
    (["--steps", "0"], "--steps"),
])
def test_cli_bad_arguments_are_one_line_errors(args, message):
    result = CliRunner().invoke(tandem, ["plan", *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_preset_names_and_knob_rules_have_one_home():
    import typing

    from tandem.common.config import SyncConfig, load_config
    from tandem.common.errors import ConfigError
    from tandem.common.sync import PRESETS
    from tandem.master.quickstart import quickstart

    def choices(command):
        return next(p.type.choices for p in command.params if p.name == "preset")

    assert list(choices(tandem.commands["plan"])) == list(PRESETS)
    assert list(choices(quickstart)) == list(PRESETS)
    assert typing.get_args(SyncConfig.model_fields["preset"].annotation)[0] == typing.Literal[
        tuple(PRESETS)]
    # the plan and the config refuse the same knobs with the same words
    for knobs, words in [({"interval": 0}, "sync.interval must be >= 1, got 0"),
                         ({"offset": -1}, "sync.offset must be >= 0"),
                         ({"max_staleness": -2}, "sync.max_staleness must be >= 0, got -2"),
                         ({"offset": None, "method": "nccl"},
                          "sync.offset: null (asynchronous) cannot use sync.method: nccl")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            SyncPlan(**knobs)
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, [f"sync.{k}={'null' if v is None else v}" for k, v in knobs.items()])
    result = CliRunner().invoke(tandem, ["plan", "--preset", "synchronous", "--interval", "0"])
    assert result.exit_code == 2 and "sync.interval must be >= 1, got 0" in result.output
