"""`RunClock`'s memory is bounded by the steps since the oldest checkpoint the trainer keeps
and by its explorers, not by the run's length; and forgetting changes no decision."""

from __future__ import annotations

import pytest

from tandem.common.sync import SyncPlan
from tandem.master.clock import RunClock, StepMismatch


def run(clock: RunClock, steps_per_checkpoint: int = 5) -> list:
    """A run of 3 explorers, streaming ahead in asynchronous plans; every decision, in order."""
    log, barriers, goes = [], [], []

    def take(decisions):
        log.append(decisions)
        for topic, msg in decisions:
            (barriers if topic.startswith("barrier.") else goes if topic == "trainer"
             else []).append(msg)

    for name in ("e0", "e1", "e2"):
        take(clock.join(name))
    while not clock.stopped and (barriers or goes):
        if barriers:
            b = barriers.pop(0)
            take(clock.explorer_draining(b.explorer, b.step, b.batch))
            take(clock.explorer_done(b.explorer, b.step, b.batch, b.version, groups=4,
                                     informative=1 + b.batch % 3))
        if goes:
            go = goes.pop(0)
            take(clock.trainer_step_done(go.step))
            if go.publish is not None:
                take(clock.published(go.publish))
            if (go.step + 1) % steps_per_checkpoint == 0:
                clock.checkpointed(go.step + 1)
    return log


@pytest.mark.parametrize("preset, top_up", [("synchronous", None), ("synchronous", 8),
                                            ("one_step_off_policy", None),
                                            ("fully_async", None), ("fully_async", 8)])
def test_forgetting_changes_no_decision_and_bounds_the_clock(preset, top_up):
    plan = SyncPlan.preset(preset)
    plan = SyncPlan(**{**plan.__dict__, "batches_per_step": 3})
    kept = RunClock(plan, 200, top_up_target=top_up, max_extra=2, keep_checkpoints=10**6)
    bounded = RunClock(plan, 200, top_up_target=top_up, max_extra=2, keep_checkpoints=2)
    assert run(bounded) == run(kept)
    assert bounded.trainer_done == kept.trainer_done == 200
    assert bounded.forgotten_through == 195 and kept.forgotten_through == 0
    per_batch = (len(bounded.reported), len(bounded.completed_groups))
    per_step = (len(bounded.done), len(bounded.windows), len(bounded.extra),
                len(bounded.published_versions))
    assert max(per_batch) <= 6 * (3 + 2) and max(per_step) <= 6  # 5 steps (+ 1 in flight)
    assert len(kept.reported) >= 600  # what it kept without forgetting


def test_a_trainer_cannot_resume_before_the_oldest_checkpoint_it_keeps():
    clock = RunClock(SyncPlan.preset("fully_async"), 40, keep_checkpoints=2)
    run(clock)
    assert clock.checkpoints == [35, 40] and clock.forgotten_through == 35
    with pytest.raises(StepMismatch, match="before its checkpoint of step 35"):
        clock.trainer_resumed(30)
    clock.trainer_resumed(35)  # the oldest it keeps: the steps after it are trained again
    assert clock.trainer_done == 35 and clock.last_go.step == 35 and not clock.stopped
