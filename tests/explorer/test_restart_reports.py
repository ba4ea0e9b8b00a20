"""A restarted explorer never rolls out a step it already reported (issue 32 item 2).

A real master, buffer and explorer on loopback; `play_trainer` stands in for the trainer. The
explorer rolls out steps 0 and 1 with version 0; step 2 (staleness 1) waits for version 1
while one component is paused, the explorer exits on that pause, and a new incarnation takes
over:

- trainer: nothing trains, so the explorer's barrier wait ends at `sync.timeout`;
- master: the same, and the master, when it wakes, declares the silent explorer dead;
- buffer: a real `tandem-buffer` process is frozen (SIGSTOP) as the master counts the
  explorer's first step; its put of step 1 ends at `transport.rpc_timeout`, and the new
  incarnation redoes step 1 with the same tasks.

Before the fix the new incarnation took its subscription's snapshot, the barrier of the step
it had reported, leased new tasks for it and reported it again: the master counted nothing
twice but the groups were stored and never trained (trainer, buffer), or refused the report
`unexpected_step` and the explorer exited 1 (master). Now it learns from `Registered` which
batch it reported, skips that barrier, and every task is leased once for the run's batches.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest
import yaml

from backstop import BACKSTOP
from component_process import ComponentProcess
from processes import freeze
from tandem.buffer import Buffer
from tandem.common.errors import PeerDead, WaitTimeout
from tandem.explorer.service import Explorer
from tandem.explorer.transformers_engine import TransformersEngine
from tandem.master.journal import read_journal
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))
from test_faults import declare_dead, groups_per_task
from test_service import make_config, play_trainer

STEPS, BATCH = 3, 2


class BufferProcess(ComponentProcess):
    """`tandem-buffer` with the run's config, on a random port."""

    def __init__(self, config, path: Path):
        path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        super().__init__("tandem-buffer", [
            sys.executable, "-m", "tandem.buffer.cli", "--config", str(path),
            "--address", "tcp://127.0.0.1:0"])
        self.address = self.wait_for("buffer.listening")["address"]


class FreezesBufferAtFirstStep(Master):
    """A master that freezes the buffer process the moment it counted the first explorer step
    (the explorer's next put then waits in the frozen buffer)."""

    buffer_pid: int | None = None

    def _apply_explorer_step(self, msg):
        decisions = super()._apply_explorer_step(msg)
        if self.buffer_pid is not None and self.clock.batches_done == 1:
            freeze(self.buffer_pid)
        return decisions


@pytest.mark.parametrize("paused", ["trainer", "master", "buffer"])
async def test_a_restarted_explorer_never_rolls_out_a_reported_step_again(
        tmp_path, tiny_model_path, paused):
    # the first incarnation's pause ends at sync.timeout, or, the buffer frozen, at its put's
    # transport.rpc_timeout
    config = make_config(tmp_path, tiny_model_path, "sync.preset=fully_async",
                         "sync.offset=null", "sync.max_staleness=1",
                         f"master.total_steps={STEPS}",
                         "explorers.0.lease_ahead=false", "sync.timeout=3",
                         f"transport.rpc_timeout={3 if paused == 'buffer' else BACKSTOP}",
                         "transport.rpc_retries=0")
    master = FreezesBufferAtFirstStep(config)
    await master.start()
    config.master.address = master.address
    process = buffer = None
    if paused == "buffer":
        process = BufferProcess(config, tmp_path / "run.yaml")
        config.buffer.address = process.address
        master.buffer_pid = process.proc.pid
    else:
        buffer = Buffer(config)
        config.buffer.address = await buffer.start()
    engine = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    trained = TransformersEngine.from_pretrained(tiny_model_path)
    first = Explorer(config, "explorer-0", engine=engine)
    # the new incarnation runs to the end: neither bound may run out in its run
    carried_on = config.model_copy(deep=True)
    carried_on.sync.timeout = carried_on.transport.rpc_timeout = BACKSTOP
    second = Explorer(carried_on, "explorer-0", engine=engine)
    trainer = None
    try:
        with pytest.raises(PeerDead if paused == "buffer" else WaitTimeout):
            await asyncio.wait_for(first.serve(), BACKSTOP)
        await first.close()
        if paused == "master":
            await declare_dead(master, "explorer-0")  # what it does when it wakes
        if process is not None:
            process.proc.send_signal(signal.SIGCONT)
        trainer = asyncio.create_task(play_trainer(config, master.address,
                                                   master.publish_address, trained, []))
        await asyncio.wait_for(second.serve(), BACKSTOP)
        await asyncio.wait_for(trainer, BACKSTOP)
        status = master.status()
    finally:
        if trainer is not None:
            trainer.cancel()
        await first.close()
        await second.close()
        if buffer is not None:
            await buffer.close()
        if process is not None:
            process.proc.send_signal(signal.SIGCONT)
            process.stop()
        await master.close()
        engine.close()
        trained.close()
    assert second.stop_reason.startswith("done"), second.stop_reason
    assert status.counters.batches_done == STEPS
    journal = read_journal(Path(config.run_dir) / config.master.journal)
    leased = [r for r in journal if type(r).__name__ == "TasksLeased"]
    reports = [(r.step, r.batch) for r in journal if type(r).__name__ == "ExplorerStepDone"]
    # every step's tasks leased once (a redo after the buffer's pause leases the same tasks
    # again: the lease is the explorer's for that step), each batch reported once
    assert sum(len(r.refs) for r in leased) == STEPS * BATCH, [(r.step, r.refs) for r in leased]
    assert len(reports) == len(set(reports)) == STEPS, reports
    per_task, stored = groups_per_task(config)
    assert len(per_task) == STEPS * BATCH and set(per_task.values()) == {1}
    assert stored == STEPS * BATCH * 2  # repeat_times 2: nothing stored twice
