"""The end of a run without dead time (issue 27 item 4): after its Stop the master exits as soon
as every registered component said `Goodbye`; `master.stop_grace` bounds only the wait for a
component that never says it. Before, the master always served the whole grace."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from backstop import BACKSTOP
from tandem.common.messages.master import Status
from tandem.master.journal import final_status_path
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import explorer_loop, make_config, trainer_loop


async def run(master: Master, *, explorer_goodbye: bool, trainer_goodbye: bool) -> None:
    """Three steps to the Stop; returns once `serve()` did (the bound only fails a test whose
    master would serve on: it is not what the test measures)."""
    serving = asyncio.create_task(master.serve())
    await master.start()
    trained: list = []
    try:
        await asyncio.wait_for(asyncio.gather(
            explorer_loop(master, "explorer-0", [], goodbye=explorer_goodbye),
            trainer_loop(master, trained, goodbye=trainer_goodbye)), BACKSTOP)
        await asyncio.wait_for(serving, BACKSTOP)
    finally:
        serving.cancel()
        await master.close()
    assert len(trained) == 3


async def test_master_exits_once_every_component_said_goodbye(tmp_path, zmq_sockets_closed):
    # a grace no test waits out: only the goodbyes can end it in time
    config = make_config(tmp_path, "master.total_steps=3", f"master.stop_grace={2 * BACKSTOP}")
    master = Master(config)
    await run(master, explorer_goodbye=True, trainer_goodbye=True)
    assert master.ended_by == "goodbyes"
    # the status it leaves for `tandem up`, which may not have asked after the Stop
    status = Status.model_validate_json(final_status_path(master.journal.path).read_text())
    assert status.counters.stopped and status.counters.trainer_steps_done == 3


async def test_a_component_that_never_says_goodbye_costs_stop_grace(tmp_path,
                                                                    zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=3", "master.stop_grace=0.3")
    master = Master(config)
    await run(master, explorer_goodbye=True, trainer_goodbye=False)
    assert master.ended_by == "stop_grace"
