"""Nothing lost at the end of a run (issue 32): the run is done only once a trainer checkpoint
holds every step the master counted, not when the master counts the last step.

A trainer killed between its last `TrainerStepDone` and its last checkpoint left a run that
`tandem up` reported done with the learner's checkpoint steps behind: the master ended
`stop_grace` after its Stop, before the restarted trainer came back to retrain the lost steps.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from backstop import BACKSTOP
from tandem.common.config import RunConfig
from tandem.common.errors import RequestFailed, TandemError
from tandem.common.messages.master import (
    RunCounters,
    Status,
    TrainerCheckpointed,
    TrainerResumed,
    TrainerStepDone,
    WeightsPublished,
)
from tandem.master.service import Master
from tandem.master.up import Supervisor, checkpoint_short, newest_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import Peer, explorer_loop, make_config


async def dying_trainer(master: Master, checkpoint_every: int) -> int:
    """Trains every step released, reports a checkpoint every `checkpoint_every` steps, and
    dies on the Stop before its last checkpoint; returns its newest checkpoint's step."""
    peer = Peer(master, "trainer", "trainer", ["trainer", "stop"])
    await peer.start()
    newest = 0
    try:
        while True:
            msg = await peer.next("trainer")
            if msg.TYPE == "master.stop":
                return newest  # killed here: the end-of-run checkpoint is never written
            await peer.rpc.call(TrainerStepDone(step=msg.step, version=msg.step + 1))
            if msg.publish is not None:
                await peer.rpc.call(WeightsPublished(version=msg.publish, method="checkpoint",
                                                     path=f"weights/v{msg.publish}"))
            if (msg.step + 1) % checkpoint_every == 0:
                newest = msg.step + 1
                await peer.rpc.call(TrainerCheckpointed(step=newest))
    finally:
        await peer.close()


async def awaiting_checkpoint(master: Master) -> None:
    """Returns once the master's Stop grace is over and it waits for the trainer's checkpoint
    (its own state, not its log: structlog's capture misses a logger cached by an earlier test;
    bounded by the caller)."""
    while not master.awaiting_checkpoint:
        await asyncio.sleep(0.02)


async def run_to_the_stop(master: Master) -> int:
    newest = await asyncio.wait_for(asyncio.gather(
        explorer_loop(master, "explorer-0", []), dying_trainer(master, checkpoint_every=3)),
        BACKSTOP)
    return newest[1]


async def test_a_trainer_lost_before_its_last_checkpoint_keeps_the_run_open(
        tmp_path, zmq_sockets_closed):
    """The master counts step 4 of 4 and stops; the trainer dies before its checkpoint of 4.
    Past `stop_grace` the master still serves, and the trainer restarted from its checkpoint
    of 3 re-opens the run, retrains step 3 and checkpoints it: only then is the run done."""
    config = make_config(tmp_path, "master.total_steps=4",
                         f"master.final_checkpoint_wait={BACKSTOP}")
    master = Master(config)
    serving = asyncio.create_task(master.serve())
    await master.start()
    try:
        assert await run_to_the_stop(master) == 3
        # the grace is over (the master says so); before the fix serve() had returned
        waiting = asyncio.create_task(awaiting_checkpoint(master))
        finished, _ = await asyncio.wait({serving, waiting}, timeout=BACKSTOP,
                                         return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        assert serving not in finished, "the run ended without the checkpoint of step 4"
        assert waiting in finished
        assert master.status().counters.stopped and master.trainer_checkpoint == 3

        peer = Peer(master, "trainer", "trainer", ["trainer", "stop"])
        registered = await peer.start()
        assert registered.trainer_steps == 4
        await peer.rpc.call(TrainerResumed(step=3, checkpoint="step_00000003"))
        assert not master.status().counters.stopped  # re-opened: step 3 is trained again
        go = await peer.next("trainer")
        assert (go.TYPE, go.step) == ("master.trainer.go", 3)
        await peer.rpc.call(TrainerStepDone(step=3, version=4))
        assert (await peer.next("stop")).TYPE == "master.stop"
        assert not serving.done()
        await peer.rpc.call(TrainerCheckpointed(step=4))
        await peer.close()
        await asyncio.wait_for(serving, BACKSTOP)  # done, without a failure
    finally:
        await master.close()
    assert master.clock.trainer_done == 4 and master.trainer_checkpoint == 4


async def test_past_the_bound_the_master_fails_naming_the_steps_and_the_way_out(
        tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=4", "master.final_checkpoint_wait=0.5")
    master = Master(config)
    serving = asyncio.create_task(master.serve())
    await master.start()
    try:
        await run_to_the_stop(master)
        with pytest.raises(TandemError) as failed:
            await asyncio.wait_for(serving, BACKSTOP)
    finally:
        await master.close()
    message = str(failed.value)
    assert "counted 4 trainer steps" in message and "holds 3" in message
    assert "master.final_checkpoint_wait=0.5s" in message and "tandem up --resume" in message

    # restarted on that journal (stopped, checkpoint 3 of 4): bounded again, never forever
    again = Master(config.model_copy(deep=True))
    serving = asyncio.create_task(again.serve())
    try:
        with pytest.raises(TandemError, match="counted 4 trainer steps"):
            await asyncio.wait_for(serving, BACKSTOP)
        assert again.resumed and again.trainer_checkpoint == 3
    finally:
        await again.close()


async def test_a_restarted_master_of_a_checkpointed_run_ends_at_once(tmp_path,
                                                                     zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=3",
                         f"master.final_checkpoint_wait={BACKSTOP}")
    master = Master(config)
    serving = asyncio.create_task(master.serve())
    await master.start()
    try:
        assert await run_to_the_stop(master) == 3  # the checkpoint of the last step came
        await asyncio.wait_for(serving, BACKSTOP)
    finally:
        await master.close()
    again = Master(config.model_copy(deep=True))
    try:
        await asyncio.wait_for(again.serve(), BACKSTOP)  # the journal holds the checkpoint report
    finally:
        await again.close()


async def test_a_checkpoint_ahead_of_the_count_is_refused(tmp_path, zmq_sockets_closed):
    master = Master(make_config(tmp_path, "master.total_steps=4"))
    await master.start()
    peer = Peer(master, "trainer", "trainer", ["trainer", "stop"])
    try:
        await peer.start()
        with pytest.raises(RequestFailed, match="checkpoint of 2 steps but the master counted 0"):
            await peer.rpc.call(TrainerCheckpointed(step=2))
    finally:
        await peer.close()
        await master.close()
    assert master.trainer_checkpoint == 0


def status(counted: int, total: int = 8) -> Status:
    return Status.model_construct(run_id="r", counters=RunCounters.model_construct(
        stopped=True, total_steps=total, trainer_steps_done=counted))


def write_checkpoint(root: Path, step: int, *, complete: bool = True) -> None:
    folder = root / (f"step_{step:08d}" if complete else f".step_{step:08d}.tmp")
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "version": step}))


def test_up_reports_no_success_while_the_checkpoint_is_behind_the_count(tmp_path):
    """`tandem up` judges the end of a run by the checkpoints on disk too: the master counted
    8 steps, the learner's newest checkpoint holds 6, so steps 6..7 would be lost."""
    sup = Supervisor(RunConfig.model_validate({"run_dir": str(tmp_path)}), live=False)
    sup.progress.status = status(8)
    root = tmp_path / "checkpoints"
    assert newest_checkpoint(root) == (0, None)
    assert "newest checkpoint holds 0 (none in" in checkpoint_short(status(8), root)
    write_checkpoint(root, 3)
    write_checkpoint(root, 6)
    write_checkpoint(root, 8, complete=False)  # still being written: not a checkpoint
    (root / "step_00000009").mkdir()  # no trainer_state.json: not complete either
    short = checkpoint_short(status(8), root)
    assert short == (f"the master counted 8 trainer steps but the newest checkpoint holds 6 "
                     f"({root / 'step_00000006'}); `tandem up --resume` retrains steps 6..7")
    assert sup._finish() == 1  # every child exited 0 and the master counted 8 of 8
    write_checkpoint(root, 8)
    assert sup._finish() == 0
    assert newest_checkpoint(root) == (8, root / "step_00000008")
    assert checkpoint_short(status(8), root) is None
    assert checkpoint_short(None, root) is None


async def test_a_run_killed_before_any_checkpoint_is_retrained_from_the_start_on_resume(
        tmp_path, zmq_sockets_closed):
    """Everything killed once the master counted the last step, before the trainer wrote any
    checkpoint: the restarted master re-sends its Stop, which a trainer resuming from model.path
    (0 steps) must not take as its own. Its TrainerResumed(0) re-opens the run, withdraws that
    Stop from later snapshots, and steps 0..3 are trained again before the run ends."""
    config = make_config(tmp_path, "master.total_steps=4",
                         f"master.final_checkpoint_wait={BACKSTOP}")
    master = Master(config)
    serving = asyncio.create_task(master.serve())
    await master.start()
    try:
        newest = await asyncio.wait_for(asyncio.gather(
            explorer_loop(master, "explorer-0", []), dying_trainer(master, checkpoint_every=99)),
            BACKSTOP)
        assert newest[1] == 0  # no checkpoint of any step
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await master.close()  # the SIGKILL of everything: the journal is all that is left

    again = Master(config.model_copy(deep=True))
    serving = asyncio.create_task(again.serve())
    await again.start()
    try:
        peer = Peer(again, "trainer", "trainer", ["trainer", "stop"])
        registered = await peer.start()
    except BaseException:
        await again.close()
        raise
    try:
        assert registered.trainer_steps == 4
        stale = await peer.next("stop")  # the restarted master's Stop, from the snapshot
        assert stale.steps == 4 and not stale.ends(0) and stale.ends(4)
        await peer.rpc.call(TrainerResumed(step=0))
        assert not again.status().counters.stopped
        assert again.publisher.snapshot(["stop"]) == []  # a late joiner is not told to stop
        for step in range(4):
            go = await peer.next("trainer")
            assert (go.TYPE, go.step) == ("master.trainer.go", step)
            await peer.rpc.call(TrainerStepDone(step=step, version=step + 1))
        assert (await peer.next("stop")).ends(4)
        await peer.rpc.call(TrainerCheckpointed(step=4))
        await asyncio.wait_for(serving, BACKSTOP)
    finally:
        await peer.close()
        await again.close()
    assert again.clock.trainer_done == 4 and again.trainer_checkpoint == 4
