"""Only the registered trainer reports trainer steps, and only steps the clock released: a
stranger's TrainerStepDone, or one for a step never released, is refused and counts nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from backstop import BACKSTOP
from tandem.common.errors import RequestFailed
from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerStepDone,
    LeaseTasks,
    Register,
    TrainerResumed,
    TrainerStepDone,
)
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import make_config, master_client


async def test_step_reports_come_from_the_trainer_and_for_released_steps(
        tmp_path, zmq_sockets_closed):
    master = Master(make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=40"))
    await master.start()
    explorer = master_client(master, "explorer-0")
    trainer = master_client(master, "trainer")
    stranger = master_client(master, "stranger")
    try:
        # no trainer has registered: nobody's step report counts
        with pytest.raises(RequestFailed) as err:
            await stranger.call(TrainerStepDone(step=0, version=1))
        assert err.value.code == "not_the_trainer" and "register" in err.value.message
        await trainer.call(Register(name="trainer", role="trainer"))
        await explorer.call(Register(name="explorer-0", role="explorer"))
        # the trainer itself may not report a step the clock has not released
        with pytest.raises(RequestFailed) as err:
            await trainer.call(TrainerStepDone(step=0, version=1))
        assert err.value.code == "unexpected_step" and "released" in err.value.message
        lease = await explorer.call(LeaseTasks(explorer="explorer-0", count=4, step=0))
        await explorer.call(CompleteTasks(lease_id=lease.lease_id))
        await explorer.call(ExplorerStepDone(explorer="explorer-0", step=0, batch=0, version=0))
        assert master.clock.trainer_go == 1  # step 0 released
        for step in range(40):  # the attack of issue 14: every step, from a stranger
            with pytest.raises(RequestFailed, match="not_the_trainer|registered"):
                await stranger.call(TrainerStepDone(step=step, version=step + 1))
        with pytest.raises(RequestFailed, match="step 5"):
            await trainer.call(TrainerStepDone(step=5, version=6))
        with pytest.raises(RequestFailed) as err:
            await stranger.call(TrainerResumed(step=0, checkpoint="x"))
        assert err.value.code == "not_the_trainer"
        assert master.clock.trainer_done == 0 and not master.clock.stopped
        await trainer.call(TrainerStepDone(step=0, version=1))
        await trainer.call(TrainerStepDone(step=0, version=1))  # a resend: no-op
        assert master.clock.trainer_done == 1
    finally:
        for client in (explorer, trainer, stranger):
            await client.close()
        await master.close()


async def test_a_refused_report_names_the_peer_readably(tmp_path, zmq_sockets_closed):
    # issue 32 item 8: the refusal printed a ZeroMQ-generated routing id as raw bytes
    import zmq
    import zmq.asyncio

    from tandem.common import codec

    master = Master(make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=4"))
    await master.start()
    explorer = master_client(master, "explorer-0")
    context = zmq.asyncio.Context()
    raw = context.socket(zmq.DEALER)  # no identity set: the master sees ZeroMQ's 5 bytes
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(master.address)
    try:
        await raw.send_multipart(codec.encode_request(TrainerStepDone(step=0, version=1), "r1"))
        assert await raw.poll(int(BACKSTOP * 1000)), "the master did not answer"
        reply = codec.decode(await raw.recv_multipart())
        message = reply.error.message
        assert reply.error.code == "not_the_trainer"
        assert message.isprintable() and "an unregistered client (connection <0x" in message
        # a registered component is named by what it registered as
        await explorer.call(Register(name="explorer-0", role="explorer"))
        with pytest.raises(RequestFailed) as err:
            await explorer.call(TrainerStepDone(step=0, version=1))
        assert err.value.code == "not_the_trainer"
        assert "from explorer-0 (connection explorer-0-" in err.value.message
    finally:
        raw.close(linger=0)
        context.term()
        await explorer.close()
        await master.close()
