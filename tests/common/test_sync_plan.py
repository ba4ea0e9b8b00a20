"""SyncPlan: the rules of docs/design.md §4, pinned without sockets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.common.config import load_config
from tandem.common.errors import ConfigError
from tandem.common.sync import PRESET_EXPLORERS, PRESETS, Go, SyncPlan, preset_explorers


def test_presets_match_the_design_table():
    assert PRESETS["synchronous"] == dict(method="nccl", interval=1, offset=0, max_staleness=0)
    assert PRESETS["one_step_off_policy"] == dict(method="nccl", interval=1, offset=1,
                                                  max_staleness=1)
    for name in ("fully_async", "multi_explorer_async"):
        assert PRESETS[name] == dict(method="checkpoint", interval=1, offset=None,
                                     max_staleness=4)


def test_only_multi_explorer_async_runs_several_explorers_unless_told():
    assert set(PRESET_EXPLORERS) <= set(PRESETS)  # a renamed preset cannot leave a stale entry
    assert {name: preset_explorers(name) for name in PRESETS} == {
        "synchronous": 1, "one_step_off_policy": 1, "fully_async": 1, "multi_explorer_async": 2}
    assert preset_explorers(None) == 1


def test_synchronous_batch_e_uses_version_e():
    plan = SyncPlan.preset("synchronous")
    assert [plan.version_for_step(e) for e in range(6)] == [0, 1, 2, 3, 4, 5]
    assert [plan.required_trainer_step(e) for e in range(4)] == [None, 0, 1, 2]
    assert [plan.publish_after(t) for t in range(3)] == [1, 2, 3]
    assert plan.broadcast_step(3) == 3


def test_one_step_off_policy_batch_e_uses_version_e_minus_1():
    plan = SyncPlan.preset("one_step_off_policy")
    assert [plan.version_for_step(e) for e in range(6)] == [0, 0, 1, 2, 3, 4]
    assert [plan.is_sync_point(e) for e in range(4)] == [False, False, True, True]
    # step 2 needs trainer step 0 (version 1); version 1 is broadcast when the explorer reaches 2
    assert plan.required_trainer_step(2) == 0
    assert plan.broadcast_step(1) == 2


@pytest.mark.parametrize("name", ["fully_async", "multi_explorer_async"])
def test_async_presets_wait_only_for_staleness(name):
    plan = SyncPlan.preset(name)
    assert plan.asynchronous and plan.method == "checkpoint"
    assert [plan.min_version(e) for e in range(7)] == [0, 0, 0, 0, 0, 1, 2]
    assert plan.decide(5, newest=0, held=0) is None
    assert plan.decide(5, newest=1, held=0) == Go(5, 1, load=True)
    assert plan.decide(4, newest=0, held=0) == Go(4, 0, load=False)
    assert [plan.publish_after(t) for t in range(3)] == [1, 2, 3]
    assert plan.broadcast_step(1) is None


def test_interval_4_offset_0_timeline():
    """Left timeline of the sync-interval figure: 0-3 with v0, wait, 4-7 with v4."""
    plan = SyncPlan(method="nccl", interval=4, offset=0)
    assert [plan.version_for_step(e) for e in range(8)] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert [e for e in range(13) if plan.is_sync_point(e)] == [4, 8, 12]
    # before step 4 the trainer must have finished batches 0..3
    assert plan.required_trainer_step(4) == 3
    assert [plan.required_trainer_step(e) for e in (1, 2, 3, 5, 6, 7)] == [None] * 6
    # the trainer publishes only the versions a sync point needs
    assert [plan.publish_after(t) for t in range(8)] == [None, None, None, 4, None, None, None, 8]
    assert plan.decide(4, newest=0, held=0) is None
    assert plan.decide(4, newest=4, held=0) == Go(4, 4, load=True)
    assert plan.decide(5, newest=4, held=4) == Go(5, 4, load=False)


def test_interval_1_offset_4_timeline():
    """Right timeline: the explorer runs four batches ahead, batch e uses version e-4."""
    plan = SyncPlan(method="nccl", interval=1, offset=4)
    assert [plan.version_for_step(e) for e in range(10)] == [0, 0, 0, 0, 0, 1, 2, 3, 4, 5]
    assert [e for e in range(8) if plan.is_sync_point(e)] == [5, 6, 7]
    # steps 0..4 never wait; step 5 needs trainer step 0 done (version 1)
    assert [plan.required_trainer_step(e) for e in range(8)] == [None] * 5 + [0, 1, 2]
    assert plan.broadcast_step(1) == 5


def test_interval_larger_than_the_run_never_syncs():
    plan = SyncPlan(method="nccl", interval=100, offset=0)
    assert all(plan.version_for_step(e) == 0 for e in range(20))
    assert all(plan.publish_after(t, total_steps=20) is None for t in range(20))


def test_offset_larger_than_interval():
    plan = SyncPlan(method="checkpoint", interval=2, offset=5)
    assert [e for e in range(12) if plan.is_sync_point(e)] == [7, 9, 11]
    assert [plan.version_for_step(e) for e in range(12)] == [0] * 7 + [2, 2, 4, 4, 6]
    assert plan.publish_after(1) == 2 and plan.publish_after(0) is None
    assert plan.publish_after(1, total_steps=7) is None  # version 2 is first used by step 7


def test_publish_after_skips_versions_no_step_uses():
    plan = SyncPlan.preset("synchronous")
    assert plan.publish_after(8, total_steps=10) == 9
    assert plan.publish_after(9, total_steps=10) is None


def test_late_joiner_with_nccl_waits_for_the_next_sync_point():
    plan = SyncPlan(method="nccl", interval=4, offset=0)
    assert plan.join_step(0) == 0
    assert plan.join_step(5) == 8  # v4 was broadcast at step 4; the next broadcast is at 8
    assert plan.join_step(8) == 8
    # with checkpoint it loads the current version from disk and joins at once
    ckpt = SyncPlan(method="checkpoint", interval=4, offset=0)
    assert ckpt.join_step(5) == 5
    assert ckpt.decide(5, newest=4, held=None) == Go(5, 4, load=True)
    # before any sync point a joiner needs nothing: version 0 is the base model
    assert SyncPlan(method="nccl", interval=1, offset=4).join_step(3) == 3


def test_late_joiner_in_async_loads_the_newest_version():
    plan = SyncPlan.preset("fully_async")
    assert plan.join_step(7) == 7
    assert plan.decide(7, newest=5, held=None) == Go(7, 5, load=True)
    assert plan.decide(0, newest=0, held=None) == Go(0, 0, load=False)


def test_async_interval_counts_batches_since_the_last_load():
    plan = SyncPlan(method="checkpoint", interval=3, offset=None, max_staleness=10)
    assert plan.decide(4, newest=2, held=0, since_load=2) == Go(4, 0, load=False)
    assert plan.decide(4, newest=2, held=0, since_load=3) == Go(4, 2, load=True)
    # the staleness bound forces a load between intervals
    tight = SyncPlan(method="checkpoint", interval=3, offset=None, max_staleness=1)
    assert tight.decide(4, newest=3, held=1, since_load=1) == Go(4, 3, load=True)


def test_several_explorers_async_batches_map_to_steps():
    plan = SyncPlan.preset("multi_explorer_async", batches_per_step=2)
    assert [plan.step_of_batch(g) for g in range(6)] == [0, 0, 1, 1, 2, 2]


def test_invalid_knobs_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="checkpoint"):
        SyncPlan(method="nccl", offset=None)
    with pytest.raises(ValueError, match="interval"):
        SyncPlan(interval=0)
    with pytest.raises(ValueError, match="unknown sync preset"):
        SyncPlan.preset("fast")
    with pytest.raises(ValueError, match="synchronous plans only"):
        SyncPlan.preset("fully_async").version_for_step(3)


def test_config_preset_fills_knobs_and_explicit_keys_win():
    cfg = load_config(None, ["sync.preset=one_step_off_policy", "sync.interval=2"])
    plan = SyncPlan.from_config(cfg.sync)
    assert (plan.method, plan.interval, plan.offset, plan.max_staleness) == ("nccl", 2, 1, 1)
    with pytest.raises(ConfigError, match="sync.method"):
        load_config(None, ["sync.offset=null", "sync.method=nccl"])


@settings(derandomize=True, max_examples=200, deadline=None)
@given(interval=st.integers(1, 6), offset=st.integers(0, 6), step=st.integers(0, 60))
def test_synchronous_rule_properties(interval, offset, step):
    plan = SyncPlan(method="checkpoint", interval=interval, offset=offset)
    version = plan.version_for_step(step)
    # never newer than the trainer can have produced, never staler than offset + interval - 1
    assert 0 <= version <= max(0, step - offset)
    assert version == 0 or step - offset - version < interval
    # versions only move at sync points, and every version used was published by the trainer
    if step > 0 and version != plan.version_for_step(step - 1):
        assert plan.is_sync_point(step)
    if version > 0:
        assert plan.publish_after(version - 1) == version
        assert plan.decide(step, newest=version - 1, held=None) is None


def test_a_fresh_incarnation_under_nccl_takes_the_newest_version_then_keeps_it():
    """A restarted explorer redoing step 5 of one_step_off_policy cannot receive version 4: it
    went by in a broadcast the explorer was not in. It takes the version the trainer broadcasts
    next (the newest), and keeps it until the schedule catches up instead of asking again for
    versions that are never sent."""
    plan = SyncPlan.preset("one_step_off_policy")
    assert plan.decide(5, newest=6, held=None) == Go(5, 6, load=True)
    assert plan.decide(6, newest=6, held=6) == Go(6, 6, load=False)
    assert plan.decide(7, newest=7, held=6) == Go(7, 6, load=False)
    assert plan.decide(8, newest=7, held=6) == Go(8, 7, load=True)
    # with checkpoint any version can be read from disk: the step's own one
    ckpt = SyncPlan(method="checkpoint", interval=1, offset=1)
    assert ckpt.decide(5, newest=6, held=None) == Go(5, 4, load=True)
