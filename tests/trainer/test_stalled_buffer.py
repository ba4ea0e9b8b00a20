"""A stalled buffer, from the trainer's and the explorer's side: every wait ends by its own bound
(issue 32 item 3).

A real `tandem-buffer` process is frozen (SIGSTOP) once it logged the first sample (trainer) or
put (explorer) it answered; the next request then waits in its socket. The verdict is the bound
the product reports it used (`PeerDead.bound` and `.key`, both in its message), never the wall
time of a busy machine.

Before the fix a sample's silence bound was `trainer.sample_wait + transport.rpc_timeout` per
attempt (after a 50 s SIGSTOP the trainer's wait ended 35.1 s in, with a bound of 30 s), and a
call inside a loop under its own bound (`trainer.idle_timeout`, `explorers[].put_timeout`)
started with the full RPC bound however little of the loop's was left.
"""

from __future__ import annotations

import signal
import sys

import pytest

from backstop import BACKSTOP
from component_process import ComponentProcess
from processes import freeze
from tandem.common.errors import PeerDead
from tandem.common.messages.buffer import PutExperiences
from tandem.common.messages.master import Barrier
from tandem.common.rpc import RpcClient


class FrozenBuffer(ComponentProcess):
    """`tandem-buffer` on a random port, logging its puts and samples (debug)."""

    def __init__(self, run_dir):
        super().__init__("tandem-buffer", [
            sys.executable, "-m", "tandem.buffer.cli", "--set", f"run_dir={run_dir}",
            "--set", "logging.level=debug", "--address", "tcp://127.0.0.1:0"])
        self.address = self.wait_for("buffer.listening")["address"]

    def freeze_after(self, event: str) -> None:
        self.wait_for(event)
        freeze(self.proc.pid)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.stop()


@pytest.fixture
def stalled_buffer(tmp_path):
    buffer = FrozenBuffer(tmp_path / "buffer-run")
    yield buffer
    buffer.close()


def transport_knobs(config, **knobs):
    config.transport = config.transport.model_copy(update=knobs)
    return config


# The bounds under test apply once the buffer is frozen; the call before it (a put the buffer
# fsyncs, a sample) is bounded by BACKSTOP only.
SHORT_RPC = dict(rpc_timeout=2.0, rpc_retries=1)


@pytest.mark.parametrize("idle_timeout, bound, key", [
    (600.0, 4.0, "transport.rpc_timeout"),  # 2 attempts of rpc_timeout, sample_wait inside
    (3.0, None, "trainer.idle_timeout"),    # the loop's own bound ends the call at once
])
async def test_the_trainer_waits_on_a_stalled_buffer_within_its_bound(
        tmp_path, tiny_model_path, make_config, make_group, stalled_buffer, idle_timeout, bound,
        key):
    from tandem.trainer.trainer import Trainer

    config = transport_knobs(make_config(tiny_model_path, tmp_path / "run", sample_wait=5.0,
                                         idle_timeout=BACKSTOP, groups_per_step=1),
                             rpc_timeout=BACKSTOP)
    trainer = Trainer(config, resume=False)
    trainer._buffer = RpcClient(stalled_buffer.address, peer="buffer", name="trainer",
                                transport=config.transport)
    put = RpcClient(stalled_buffer.address, peer="buffer", name="explorer-0")
    try:
        await put.call(PutExperiences(experiences=make_group("t1", "1+1=", ["2", "3"],
                                                             [1.0, 0.0]), group_size=2),
                       timeout=BACKSTOP, retries=0)
        await trainer._sample(1, 0)
        stalled_buffer.freeze_after("buffer.sample")
        transport_knobs(config, **SHORT_RPC)
        trainer._buffer.transport = config.transport
        config.trainer.idle_timeout = idle_timeout
        with pytest.raises(PeerDead) as stalled:
            await trainer._sample(1, 1)  # nothing ready: it would wait sample_wait, frozen
    finally:
        await put.close()
        await trainer._buffer.close()
    error = stalled.value
    assert error.key == key and key in str(error)
    if bound is not None:
        assert error.bound == bound and "within 4s (2 attempts of 2s)" in str(error)
    else:  # the rest of idle_timeout: at most 3 s, however the machine ran the first sample
        assert 0 < error.bound <= idle_timeout


@pytest.mark.parametrize("put_timeout, bound, key", [
    (300.0, 4.0, "transport.rpc_timeout"),
    (3.0, None, "explorers[].put_timeout"),
])
async def test_the_explorers_put_to_a_stalled_buffer_ends_within_its_bound(
        tmp_path, tiny_model_path, make_group, stalled_buffer, put_timeout, bound, key):
    from tandem.common.config import load_config
    from tandem.explorer.service import Explorer

    config = load_config(None, [f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_path}",
                                f"buffer.address={stalled_buffer.address}",
                                f"explorers.0.put_timeout={BACKSTOP}",
                                f"transport.rpc_timeout={BACKSTOP}"])
    explorer = Explorer(config, "explorer-0")  # its engine is loaded by start(), not needed
    barrier = Barrier(explorer="explorer-0", step=0, version=0, wait=False)
    first = PutExperiences(experiences=make_group("t1", "1+1=", ["2", "3"], [1.0, 0.0]),
                           group_size=2)
    second = PutExperiences(experiences=make_group("t2", "2+2=", ["4", "5"], [1.0, 0.0]),
                            group_size=2)
    try:
        await explorer._put_sized(first, barrier)
        stalled_buffer.freeze_after("buffer.put")
        explorer.buffer.transport = config.transport.model_copy(update=SHORT_RPC)
        explorer.cfg.put_timeout = put_timeout
        with pytest.raises(PeerDead) as stalled:
            await explorer._put_sized(second, barrier)
    finally:
        await explorer.close()
    error = stalled.value
    assert error.key == key and key in str(error)
    if bound is not None:
        assert error.bound == bound and "within 4s (2 attempts of 2s)" in str(error)
    else:
        assert 0 < error.bound <= put_timeout
