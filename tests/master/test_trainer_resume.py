"""A trainer that (re)starts from a checkpoint at step S: the clock goes back to S and releases
TrainerGo from there; the master journals it as `TrainerResumed` and replays it the same way."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from backstop import BACKSTOP
from tandem.common.errors import RequestFailed
from tandem.common.messages.master import Register, TrainerResumed
from tandem.common.sync import SyncPlan
from tandem.master.clock import RunClock, StepMismatch
from tandem.master.journal import read_journal
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))

from master_peers import explorer_loop, make_config, master_client, trainer_loop


def gos(decisions):
    return [m.step for t, m in decisions if t == "trainer"]


def run_async_clock(steps: int, trained: int) -> RunClock:
    """fully_async: every batch done, the trainer through `trained` steps, each published."""
    clock = RunClock(SyncPlan.preset("fully_async"), total_steps=steps)
    clock.join("a")
    while True:
        running = clock.explorers["a"].running
        if running is not None:
            clock.explorer_done("a", *running)
        elif clock.trainer_done < trained and clock.trainer_go > clock.trainer_done:
            clock.trainer_step_done(clock.trainer_done)
            clock.published(clock.trainer_done)
        else:
            break
    return clock


def test_resume_rewinds_the_trainer_count_and_releases_go_again():
    clock = run_async_clock(steps=8, trained=5)
    assert (clock.trainer_done, clock.trainer_go, clock.newest) == (5, 6, 5)
    d = clock.trainer_resumed(2)
    assert gos(d) == [2]  # steps 2..4 are trained again
    assert (clock.trainer_done, clock.trainer_go) == (2, 3)
    assert clock.newest == 2 and clock.published_versions == [1, 2]  # 3..5: the lost lineage
    assert gos(clock.trainer_step_done(2)) == [3]
    with pytest.raises(StepMismatch, match="counted only 3"):
        clock.trainer_resumed(4)


def test_resume_at_the_count_releases_the_step_in_flight_again_and_loses_nothing():
    clock = run_async_clock(steps=8, trained=3)
    assert gos(clock.trainer_resumed(3)) == [3]  # its go was out already: sent again
    assert (clock.trainer_done, clock.newest) == (3, 3)


def test_a_run_stopped_for_want_of_the_lost_steps_goes_on():
    clock = run_async_clock(steps=4, trained=4)
    assert clock.stopped
    assert clock.trainer_resumed(4) == []  # the checkpoint holds every step: still over
    d = clock.trainer_resumed(1)
    assert not clock.stopped and gos(d) == [1]
    for t in (1, 2):
        clock.trainer_step_done(t)
    assert [t for t, _ in clock.trainer_step_done(3)] == ["stop"] and clock.stopped


async def test_master_journals_the_resume_tells_the_count_and_replays_it(
        tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=6")
    master = Master(config)
    await master.start()
    trained: list = []
    explorer = asyncio.create_task(explorer_loop(master, "explorer-0", []))
    # the trainer dies once it reported step 3: no report of a later step can reach the
    # master after the count is read (a cancel at any moment could leave one on its way)
    trainer = asyncio.create_task(trainer_loop(master, trained, until=4))
    client = master_client(master, "trainer-2")
    try:
        await asyncio.wait_for(trainer, BACKSTOP)
        counted = master.clock.trainer_done
        assert counted == 4 and [step for step, *_ in trained] == [0, 1, 2, 3]
        registered = await client.call(Register(name="trainer", role="trainer"))
        assert registered.trainer_steps == counted
        with pytest.raises(RequestFailed, match="newer than the master's journal") as failed:
            await client.call(TrainerResumed(step=counted + 1, checkpoint="step_x"))
        assert failed.value.code == "resume_ahead"
        await client.call(TrainerResumed(step=2, lineage="abc"))
        assert master.clock.trainer_done == 2 and master.clock.last_go.step == 2
        assert (await client.call(Register(name="trainer", role="trainer"))).trainer_steps == 2
    finally:
        explorer.cancel()
        await asyncio.gather(explorer, return_exceptions=True)
        await client.close()
        await master.close()
    records = read_journal(tmp_path / "run" / "master" / "journal.bin")
    assert [r.step for r in records if isinstance(r, TrainerResumed)] == [2]  # refused: no trace
    again = Master(config.model_copy(deep=True))
    await again.start()
    try:
        assert again.resumed and again.clock.trainer_done == 2
        assert again.clock.last_go.step == 2 and again.clock.trainer_go == 3
    finally:
        await again.close()


def test_with_nccl_the_versions_a_lost_lineage_broadcast_stand_and_are_not_broadcast_again():
    clock = RunClock(SyncPlan.preset("synchronous"), total_steps=8)
    clock.join("a")
    for t in range(5):  # batch t rolled out with version t, trained, version t+1 broadcast
        clock.explorer_done("a", *clock.explorers["a"].running)
        clock.trainer_step_done(t)
        clock.published(t + 1)
    assert clock.explorers["a"].running == (5, 5, 5)
    d = clock.trainer_resumed(2)
    assert [(m.step, m.publish) for t, m in d if t == "trainer"] == [(2, None)]
    assert clock.newest == 5  # explorer a holds version 5: nobody waits for 3..5 again
    publishes = [(m.publish, m.publish_by) for t in (2, 3, 4)
                 for topic, m in clock.trainer_step_done(t) if topic == "trainer"]
    # steps 3 and 4 released; step 4 reaches version 5 again, which goes to disk only (for an
    # explorer that restarted and cannot take 5 by broadcast any more)
    assert publishes == [(None, None), (5, "checkpoint")]
    d = clock.explorer_done("a", 5, 5, 5)
    assert [(m.step, m.publish) for t, m in d if t == "trainer"] == [(5, 6)]
