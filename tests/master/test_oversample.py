"""Dynamic sampling in the clock: a synchronous step short of informative groups gets top-up
batches of new tasks, bounded by `max_extra`, and the trainer is released with every group."""

from __future__ import annotations

from tandem.common.sync import SyncPlan
from tandem.master.clock import RunClock


def barriers(decisions):
    return [(m.explorer, m.step, m.batch, m.version, m.wait) for t, m in decisions
            if t.startswith("barrier.")]


def gos(decisions):
    return [m for t, m in decisions if t == "trainer"]


def test_a_short_step_is_topped_up_until_it_has_enough_informative_groups():
    clock = RunClock(SyncPlan.preset("synchronous"), total_steps=2, top_up_target=4, max_extra=3)
    assert barriers(clock.join("a")) == [("a", 0, 0, 0, False)]
    # 4 groups, only 1 informative: the trainer waits, and "a" rolls out more tasks for step 0
    d = clock.explorer_done("a", 0, 0, 0, groups=4, informative=1)
    assert gos(d) == [] and barriers(d) == [("a", 0, 1, 0, False)]
    d = clock.explorer_done("a", 0, 1, 0, groups=4, informative=2)
    assert gos(d) == [] and barriers(d) == [("a", 0, 2, 0, False)]
    d = clock.explorer_done("a", 0, 2, 0, groups=4, informative=2)  # 5 >= 4: enough
    (go,) = gos(d)
    assert (go.step, go.groups, go.extra_batches, go.batches) == (0, 12, 2, 3)
    assert barriers(d) == []  # step 1 waits for version 1
    clock.trainer_step_done(0)
    d = clock.published(1)
    assert barriers(d) == [("a", 1, 3, 1, True)]  # the next step proper, never an old one
    assert clock.extra == {0: 2}


def test_top_ups_stop_at_max_extra_and_the_step_goes_on_with_what_it_has():
    clock = RunClock(SyncPlan.preset("synchronous"), total_steps=1, top_up_target=8, max_extra=1)
    clock.join("a")
    d = clock.explorer_done("a", 0, 0, 0, groups=4, informative=0)
    assert [b[:2] for b in barriers(d)] == [("a", 0)]
    (go,) = gos(clock.explorer_done("a", 0, 1, 0, groups=4, informative=3))
    assert (go.groups, go.extra_batches) == (8, 1)


def test_no_top_up_without_dynamic_sampling_or_with_an_unknown_count():
    plain = RunClock(SyncPlan.preset("synchronous"), total_steps=1)
    plain.join("a")
    (go,) = gos(plain.explorer_done("a", 0, 0, 0, groups=4, informative=0))
    assert go.extra_batches == 0
    unknown = RunClock(SyncPlan.preset("synchronous"), total_steps=1, top_up_target=4,
                       max_extra=2)
    unknown.join("a")
    (go,) = gos(unknown.explorer_done("a", 0, 0, 0, groups=4))  # an explorer that did not say
    assert go.extra_batches == 0


def test_a_top_up_waits_for_every_explorer_and_goes_to_an_idle_one():
    clock = RunClock(SyncPlan.preset("synchronous", batches_per_step=2), total_steps=1,
                     top_up_target=4, max_extra=2)
    clock.join("a")
    clock.join("b")
    d = clock.explorer_done("a", 0, 0, 0, groups=2, informative=0)
    assert barriers(d) == [] and gos(d) == []  # b's batch first
    d = clock.explorer_done("b", 0, 1, 0, groups=2, informative=1)
    assert [b[:3] for b in barriers(d)] == [("a", 0, 2)]  # one top-up at a time
    # the top-up's explorer dies: the batch is lost, the budget spent, the next goes to b
    d = clock.leave("a")
    assert [b[:3] for b in barriers(d)] == [("b", 0, 3)]
    (go,) = gos(clock.explorer_done("b", 0, 3, 0, groups=2, informative=2))
    assert (go.groups, go.extra_batches) == (6, 2)


def test_replaying_the_same_inputs_gives_the_same_decisions():
    def run():
        clock = RunClock(SyncPlan.preset("one_step_off_policy"), total_steps=3,
                         top_up_target=2, max_extra=2)
        out = [clock.join("a")]
        # one step off policy: the top-up of step 0 goes before step 1, which can wait
        out.append(clock.explorer_done("a", 0, 0, 0, groups=2, informative=0))
        out.append(clock.explorer_done("a", 0, 1, 0, groups=2, informative=1))
        out.append(clock.explorer_done("a", 0, 2, 0, groups=2, informative=1))
        return [(t, m.model_dump()) for d in out for t, m in d]

    first = run()
    assert first == run()
    assert [(m["step"], m["batch"]) for t, m in first if t.startswith("barrier.")] == [
        (0, 0), (0, 1), (0, 2), (1, 3)]
    go = [m for t, m in first if t == "trainer"][0]
    assert go["step"] == 0 and go["groups"] == 6 and go["extra_batches"] == 2
