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
    go = next(m for t, m in first if t == "trainer")
    assert go["step"] == 0 and go["groups"] == 6 and go["extra_batches"] == 2


# -- asynchronous plans ----------------------------------------------------------------------
# Batches are taken in the order they completed; a short step takes more of them (explorers
# keep producing), and an idle explorer gets a top-up only when none is on the way.


def test_an_async_step_takes_more_batches_until_it_has_enough_informative_groups():
    clock = RunClock(SyncPlan.preset("fully_async"), total_steps=2, top_up_target=2, max_extra=2)
    assert barriers(clock.join("a")) == [("a", 0, 0, 0, False)]
    d = clock.explorer_done("a", 0, 0, 0, groups=2, informative=1)
    # 1 of 2 informative: the trainer waits; "a" goes on with the plan's next batch (step 1's)
    assert gos(d) == [] and barriers(d) == [("a", 1, 1, 0, False)]
    d = clock.explorer_done("a", 1, 1, 0, groups=2, informative=0)
    # still short, all of the plan's batches granted and none on the way: a top-up for step 0
    assert gos(d) == [] and barriers(d) == [("a", 0, 2, 0, False)]
    d = clock.explorer_done("a", 0, 2, 0, groups=2, informative=1)  # 1 + 0 + 1 >= 2
    (go,) = gos(d)
    assert (go.step, go.batches, go.groups, go.extra_batches) == (0, 3, 6, 2)
    # step 0 took step 1's batch: the plan's next batch is step 1's, granted at once
    assert barriers(d) == [("a", 1, 3, 0, False)]
    assert barriers(clock.trainer_step_done(0)) == []
    (go,) = gos(clock.explorer_done("a", 1, 3, 0, groups=2, informative=2))
    assert (go.step, go.batches, go.groups, go.extra_batches) == (1, 1, 2, 0)
    assert clock.windows == {0: (0, 3), 1: (3, 1)} and clock.batches_done == 4


def test_an_async_step_stops_at_max_extra_and_takes_nothing_unknown_further():
    bound = RunClock(SyncPlan.preset("fully_async"), total_steps=1, top_up_target=4,
                     max_extra=1)
    bound.join("a")
    d = bound.explorer_done("a", 0, 0, 0, groups=2, informative=0)
    assert barriers(d) == [("a", 0, 1, 0, False)] and gos(d) == []
    (go,) = gos(bound.explorer_done("a", 0, 1, 0, groups=2, informative=0))
    assert (go.batches, go.groups, go.extra_batches) == (2, 4, 1)
    unknown = RunClock(SyncPlan.preset("fully_async"), total_steps=1, top_up_target=4,
                       max_extra=3)
    unknown.join("a")
    (go,) = gos(unknown.explorer_done("a", 0, 0, 0, groups=2))  # an explorer that did not say
    assert (go.batches, go.extra_batches) == (1, 0)


def test_an_async_step_goes_on_with_what_it_has_once_nothing_more_can_come():
    clock = RunClock(SyncPlan.preset("fully_async"), total_steps=2, top_up_target=4,
                     max_extra=3)
    clock.join("a")
    d = clock.explorer_done("a", 0, 0, 0, groups=2, informative=1)
    assert [b[:3] for b in barriers(d)] == [("a", 1, 1)]
    d = clock.tasks_exhausted("a")  # that batch never comes, and "a" gets no more
    (go,) = gos(d)
    assert (go.step, go.batches, go.extra_batches) == (0, 1, 0)


def drive(clock: RunClock, informative, *, train_every: int = 1):
    """Explorers complete their batches lowest batch number first; batch `b` has
    `informative(b)` of 2 informative groups. The trainer finishes a step once released, after
    every `train_every` explorer reports. Returns (every decision, TrainerGo messages)."""
    out, go_list, reports = [], [], 0
    for name in ("a", "b"):
        out += clock.join(name)
    while not clock.stopped:
        running = sorted((s.running[1], s.name, s.running) for s in clock.alive if s.running)
        if clock.trainer_done < clock.trainer_go and (reports % train_every == 0 or not running):
            d = clock.trainer_step_done(clock.trainer_done)
            d += clock.published(clock.trainer_done)
        else:
            assert running, "nothing runs and the trainer waits: a deadlock"
            batch, name, (step, _, version) = running[0]
            d = clock.explorer_done(name, step, batch, version, groups=2,
                                    informative=informative(batch))
            reports += 1
        out += d
        go_list += gos(d)
    return out, go_list


def test_async_steps_take_batches_rolled_out_for_later_steps_and_lose_none():
    # batches 0, 3, 6, ... carry 2 informative groups, the others none; 2 explorers, 2 batches
    # a step, the trainer slower than the explorers
    def run():
        clock = RunClock(SyncPlan.preset("multi_explorer_async", batches_per_step=2),
                         total_steps=4, top_up_target=2, max_extra=2)
        return clock, *drive(clock, lambda b: 2 if b % 3 == 0 else 0, train_every=3)

    clock, decisions, go_list = run()
    assert [go.step for go in go_list] == [0, 1, 2, 3]
    informative = clock.completed_informative
    for go in go_list:
        first, n = clock.windows[go.step]
        assert go.batches == n == 2 + go.extra_batches
        assert sum(informative[first:first + n]) >= 2 or go.extra_batches == 2
        assert go.groups == 2 * n
    # the windows follow each other: every completed batch is trained once, none is left over
    starts = [clock.windows[t][0] for t in range(4)]
    assert starts == [0] + [sum(clock.windows[s][1] for s in range(t)) for t in range(1, 4)]
    assert sum(go.batches for go in go_list) == clock.batches_done == clock.batches_granted
    assert sum(go.extra_batches for go in go_list) > 0
    # some extra batches were granted as later steps' (the explorers kept producing)
    granted = [(m.step, m.batch) for t, m in decisions if t.startswith("barrier.")]
    assert any(step > t for t in range(4) for step, batch in granted
               if clock.windows[t][0] <= batch < sum(clock.windows[t]))
    # deterministic: the same inputs give the same decisions
    _, again, _ = run()
    assert [(t, m.model_dump()) for t, m in decisions] == [(t, m.model_dump()) for t, m in again]


def test_a_resumed_trainer_is_released_on_the_same_async_batches():
    clock = RunClock(SyncPlan.preset("fully_async"), total_steps=3, top_up_target=2, max_extra=2)
    _, first = drive(clock, lambda b: 1)
    assert [(go.batches, go.extra_batches) for go in first] == [(2, 1)] * 3
    again = gos(clock.trainer_resumed(1))  # checkpoint after step 0: steps 1, 2 once more
    assert [(go.step, go.batches, go.groups) for go in again] == [(1, 2, 4)]
    assert clock.windows[1] == (2, 2)


def test_an_async_step_whose_batches_an_earlier_one_took_gets_more_as_that_one_is_released():
    clock = RunClock(SyncPlan.preset("multi_explorer_async", batches_per_step=2), total_steps=2,
                     top_up_target=2, max_extra=2)
    clock.join("a")
    clock.join("b")
    assert [b[:3] for b in barriers(clock.explorer_done("a", 0, 0, 0, groups=2,
                                                        informative=0))] == [("a", 1, 2)]
    assert [b[:3] for b in barriers(clock.explorer_done("b", 0, 1, 0, groups=2,
                                                        informative=0))] == [("b", 1, 3)]
    assert clock.explorer_done("a", 1, 2, 0, groups=2, informative=0) == []
    d = clock.explorer_done("b", 1, 3, 0, groups=2, informative=0)
    (go,) = gos(d)
    assert (go.step, go.batches, go.extra_batches) == (0, 4, 2)  # the bound: step 1's batches
    # step 0 took step 1's 2 batches: step 1 gets 2 more, and both idle explorers roll one out
    # while the trainer trains step 0
    assert [b[:3] for b in barriers(d)] == [("a", 1, 4), ("b", 1, 5)]
    assert barriers(clock.trainer_step_done(0)) == []
    clock.explorer_done("a", 1, 4, 0, groups=2, informative=1)
    (go,) = gos(clock.explorer_done("b", 1, 5, 0, groups=2, informative=1))
    assert (go.step, go.batches, go.extra_batches) == (1, 2, 0)


def test_batches_after_a_step_that_took_extra_are_labelled_with_the_step_that_trains_them():
    # one explorer, staleness 1: step e may start once version e - 1 is out
    clock = RunClock(SyncPlan.preset("fully_async", max_staleness=1), total_steps=4,
                     top_up_target=2, max_extra=2)
    clock.join("a")
    assert barriers(clock.explorer_done("a", 0, 0, 0, groups=2, informative=0)) == [
        ("a", 1, 1, 0, False)]
    # batch 2 would be step 2's (needs version 1): none on the way, so a top-up for step 0
    assert barriers(clock.explorer_done("a", 1, 1, 0, groups=2, informative=0)) == [
        ("a", 0, 2, 0, False)]
    d = clock.explorer_done("a", 0, 2, 0, groups=2, informative=2)
    (go,) = gos(d)
    assert (go.step, go.batches, go.extra_batches) == (0, 3, 2)
    # step 0 took batches 0-2, so batch 3 is step 1's (no version needed), not step 3's
    # (version 2): it is granted at once, while the trainer trains step 0
    assert barriers(d) == [("a", 1, 3, 0, False)]
    # batch 4 is step 2's: it waits for version 1 only, and goes as one explorer drains
    assert clock.explorer_draining("a", 1, 3) == []
    assert gos(clock.trainer_step_done(0)) == []
    assert barriers(clock.published(1)) == [("a", 2, 4, 1, True)]
    (go,) = gos(clock.explorer_done("a", 1, 3, 0, groups=2, informative=2))
    assert (go.step, go.batches, go.extra_batches) == (1, 1, 0)
    assert clock.windows[1] == (3, 1)  # the batch labelled step 1 is the one step 1 trains
    clock.trainer_step_done(1)
    clock.published(2)
    (go,) = gos(clock.explorer_done("a", 2, 4, 1, groups=2, informative=2))
    assert clock.windows[2] == (4, 1) and go.step == 2
    # the labels come from state the inputs rebuild: a replay reaches the same clock
    replay = RunClock(SyncPlan.preset("fully_async", max_staleness=1), total_steps=4,
                      top_up_target=2, max_extra=2)
    replay.join("a")
    for step, batch, version, informative in [(0, 0, 0, 0), (1, 1, 0, 0), (0, 2, 0, 2)]:
        replay.explorer_done("a", step, batch, version, groups=2, informative=informative)
    replay.explorer_draining("a", 1, 3)
    replay.trainer_step_done(0)
    replay.published(1)
    replay.explorer_done("a", 1, 3, 0, groups=2, informative=2)
    replay.trainer_step_done(1)
    replay.published(2)
    replay.explorer_done("a", 2, 4, 1, groups=2, informative=2)
    assert replay == clock
