"""The master's replay of a journal written under another config (issue 32 item 6): a run's
length may only go up, a longer run is recorded as such, any other change is refused."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from backstop import BACKSTOP
from tandem.common.errors import ConfigError
from tandem.common.messages.master import RunAmended, RunStarted
from tandem.common.runrecord import RunDirTaken, read_run_record, recorded_config
from tandem.master.journal import read_journal
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import explorer_loop, make_config, trainer_loop


async def run_to_the_end(config) -> None:
    master = Master(config)
    serving = asyncio.create_task(master.serve())
    await master.start()
    try:
        await asyncio.wait_for(asyncio.gather(explorer_loop(master, "explorer-0", []),
                                              trainer_loop(master, [])), BACKSTOP)
        await asyncio.wait_for(serving, BACKSTOP)
    finally:
        await master.close()


@pytest.fixture
def ran_8_steps(tmp_path, zmq_sockets_closed):
    """A finished fully_async run of 8 steps (its explorer ran ahead of the trainer)."""
    config = make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=8")
    asyncio.run(run_to_the_end(config))
    return tmp_path, config


async def test_the_first_record_holds_the_config(ran_8_steps):
    tmp_path, config = ran_8_steps
    head = read_journal(tmp_path / "run" / "master" / "journal.bin")[0]
    assert isinstance(head, RunStarted) and head.config == recorded_config(config)
    record = read_run_record(tmp_path / "run" / "master" / "journal.bin")
    assert (record.run_id, record.total_steps, record.trainer_steps) == (head.run_id, 8, 8)


async def test_a_lower_total_steps_is_one_clear_error(ran_8_steps):
    tmp_path, _ = ran_8_steps
    master = Master(make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=5"))
    try:
        with pytest.raises(ConfigError) as caught:
            await master.start()
    finally:
        await master.close()
    message = " ".join(caught.value.errors)
    assert "master.total_steps: 5 is below the 8 steps" in message
    assert "may only go up" in message and "new run_dir" in message
    assert "replay" not in message


async def test_a_higher_total_steps_is_recorded_once(ran_8_steps):
    tmp_path, _ = ran_8_steps
    for _ in range(2):  # the second start finds the run already amended
        master = Master(make_config(tmp_path, "sync.preset=fully_async",
                                    "master.total_steps=12"))
        await master.start()
        assert master.clock.counters()["total_steps"] == 12
        await master.close()
    records = read_journal(tmp_path / "run" / "master" / "journal.bin")
    amended = [r for r in records if isinstance(r, RunAmended)]
    assert len(amended) == 1 and amended[0].total_steps == 12
    assert amended[0].config["master"]["total_steps"] == 12
    record = read_run_record(tmp_path / "run" / "master" / "journal.bin")
    assert (record.total_steps, record.trainer_steps) == (12, 8)
    # and the longer run may not shrink back to its first length either
    master = Master(make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=8"))
    try:
        with pytest.raises(ConfigError, match="8 is below the 12 steps"):
            await master.start()
    finally:
        await master.close()


async def test_a_change_that_changes_the_run_is_refused(ran_8_steps):
    tmp_path, _ = ran_8_steps
    master = Master(make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=8",
                                "trainer.lr=1e-4"))
    try:
        with pytest.raises(RunDirTaken, match=r"trainer.lr 1e-05 \(run\) -> 0.0001 \(given\) "
                                              "cannot change on resume"):
            await master.start()
    finally:
        await master.close()
