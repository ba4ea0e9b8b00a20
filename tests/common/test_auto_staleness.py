"""The self-setting staleness bound's rule (`tandem.common.staleness`), without sockets."""

from __future__ import annotations

import pytest

from tandem.common.config import load_config
from tandem.common.staleness import StalenessRule, StalenessState
from tandem.common.sync import SyncPlan

RULE = StalenessRule(metric="mismatch/kl", below=0.02, min=1, max=4, start=2, patience=2,
                     widen_below=0.5)


def fold(rule: StalenessRule, values: list[float | None], state: StalenessState | None = None):
    """Each value as one trainer step's report (None: the step did not report the metric),
    applying every change the rule decides, as the master does; returns the final state and
    the actions taken."""
    state = state or rule.initial()
    actions = []
    for value in values:
        state = rule.observe(state, {} if value is None else {rule.metric: value, "loss": 9.0})
        decision = rule.decide(state)
        actions.append(decision.action)
        if decision.changed:
            state = state.set(decision.bound)
    return state, actions


def test_widens_by_one_after_patience_steps_well_under_the_target():
    state, actions = fold(RULE, [0.005, 0.009])
    assert actions == ["hold", "widen"] and state.bound == 3 and state.measured == ()


def test_narrows_to_half_when_the_mean_rises_above_the_target():
    state, actions = fold(RULE, [0.005, 0.005, 0.001, 0.001, 0.03, 0.05])
    assert actions == ["hold", "widen", "hold", "widen", "hold", "narrow"]
    assert state.bound == 2  # 4 // 2


def test_holds_in_the_band_between_widen_below_and_below():
    # 0.01 < x <= 0.02: neither widen (needs <= 0.01) nor narrow (needs mean > 0.02)
    state, actions = fold(RULE, [0.015, 0.019, 0.02, 0.012, 0.011, 0.018])
    assert set(actions) == {"hold"} and state.bound == 2


def test_one_value_over_widen_below_blocks_a_widen_and_the_mean_decides_a_narrow():
    _, actions = fold(RULE, [0.001, 0.011])  # the max judges a widen: 0.011 > 0.01
    assert actions == ["hold", "hold"]
    _, actions = fold(RULE, [0.001, 0.03])  # mean 0.0155 <= 0.02: a single spike holds
    assert actions == ["hold", "hold"]
    _, actions = fold(RULE, [0.015, 0.03])  # mean 0.0225 > 0.02
    assert actions == ["hold", "narrow"]


def test_never_leaves_min_and_max():
    state, actions = fold(RULE, [0.0] * 12)
    assert state.bound == 4 and actions.count("widen") == 2  # 2 -> 3 -> 4, then held at max
    decision = RULE.decide(RULE.observe(RULE.observe(state, {"mismatch/kl": 0.0}),
                                        {"mismatch/kl": 0.0}))
    assert decision.action == "hold" and "at max 4" in decision.why
    state, actions = fold(RULE, [0.5] * 12)
    assert state.bound == 1 and actions.count("narrow") == 1  # 2 -> 1, then held at min
    state, _ = fold(StalenessRule(min=0, max=8, start=8, patience=1), [1.0] * 6)
    assert state.bound == 0  # 8 -> 4 -> 2 -> 1 -> 0


def test_hysteresis_each_change_waits_patience_fresh_steps():
    """The steps trained right after a change still hold rollouts granted under the old bound:
    values measured before the change never judge the next one."""
    rule = StalenessRule(below=0.02, min=0, max=8, start=8, patience=3)
    state, actions = fold(rule, [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert actions == ["hold", "hold", "narrow", "hold", "hold", "narrow", "hold"]
    assert state.bound == 2 and state.measured == (0.5,)
    # right after a narrow, good values widen only once `patience` of them are in
    state, actions = fold(rule, [0.001, 0.001, 0.001], state.set(2))
    assert actions == ["hold", "hold", "widen"] and state.bound == 3


def test_steps_without_the_metric_or_with_nan_count_nothing():
    state, actions = fold(RULE, [None, float("nan"), None, 0.0])
    assert actions == ["hold"] * 4 and state.measured == (0.0,) and state.bound == 2
    assert "1 of 2 steps measured" in RULE.decide(state).why


def test_start_defaults_to_min():
    assert StalenessRule(min=3, max=5).initial() == StalenessState(bound=3)


@pytest.mark.parametrize("knobs, message", [
    (dict(min=5, max=2), "0 <= min <= max"),
    (dict(start=9, max=8), "sync.auto.start must lie in"),
    (dict(below=0.0), "sync.auto.target.below must be > 0"),
    (dict(patience=0), "sync.auto.patience must be >= 1"),
    (dict(widen_below=1.5), "sync.auto.widen_below"),
])
def test_rule_refuses_knobs_that_cannot_work(knobs, message):
    with pytest.raises(ValueError, match=message):
        StalenessRule(**knobs)


def test_config_auto_starts_the_plan_at_its_first_bound(tmp_path):
    config = load_config(None, [
        f"run_dir={tmp_path}", "sync.preset=fully_async", "sync.max_staleness=auto",
        "sync.auto.target.metric=correction/masked_is/masked_frac", "sync.auto.target.below=0.1",
        "sync.auto.min=2", "sync.auto.max=6"])
    sync = config.sync
    assert sync.auto_staleness and sync.initial_staleness == 2
    assert SyncPlan.from_config(sync).max_staleness == 2
    rule = sync.auto.rule()
    assert (rule.metric, rule.below, rule.min, rule.max) == (
        "correction/masked_is/masked_frac", 0.1, 2, 6)
    fixed = load_config(None, [f"run_dir={tmp_path}", "sync.preset=fully_async"]).sync
    assert not fixed.auto_staleness and fixed.initial_staleness == 4


@pytest.mark.parametrize("overrides, message", [
    (["sync.preset=one_step_off_policy", "sync.max_staleness=auto"],
     "moves the bound of asynchronous plans only"),
    (["sync.preset=fully_async", "sync.max_staleness=auto", "sync.auto.min=5",
      "sync.auto.max=3"], "0 <= min <= max"),
    (["sync.preset=fully_async", "sync.max_staleness=often"], "max_staleness"),
])
def test_config_refuses_auto_where_it_cannot_work(tmp_path, overrides, message):
    with pytest.raises(Exception, match=message):
        load_config(None, [f"run_dir={tmp_path}", *overrides])
