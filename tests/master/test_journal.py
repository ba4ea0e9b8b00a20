"""The master's journal: records are the accepted messages, replay reproduces the state, and
nothing that fails to read back is skipped (only a torn last record, a crash mid-write)."""

from __future__ import annotations

import asyncio
import struct
import sys
import zlib
from pathlib import Path

import msgpack
import pytest

from backstop import BACKSTOP
from tandem.common.codec import encode_request
from tandem.common.messages.base import Heartbeat
from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerStepDone,
    JournalSnapshot,
    LeaseTasks,
    Register,
    RunStarted,
    TrainerStepDone,
    WeightsPublished,
    barrier_topic,
)
from tandem.master.journal import Journal, JournalError, read_journal
from tandem.master.service import Master

sys.path.insert(0, str(Path(__file__).parent))
from processes import until
from master_peers import Peer, explorer_loop, make_config, master_client, trainer_loop


def frame(payload: bytes) -> bytes:
    return struct.pack(">II", len(payload), zlib.crc32(payload)) + payload


def record(type_name: str, body: dict, number: int = 99) -> bytes:
    """A record as the journal writes it, for a message the codec may not know."""
    return frame(msgpack.packb({"v": 1, "type": type_name, "id": str(number), "body": body}))


def journal_path(tmp_path):
    return tmp_path / "run" / "master" / "journal.bin"


async def short_run(tmp_path, *overrides):
    """A master with one explorer step and one trainer step done; returns its journal path."""
    master = Master(make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=4",
                                *overrides))
    await master.start()
    client = master_client(master, "x")
    try:
        await client.call(Register(name="explorer-0", role="explorer"))
        lease = await client.call(LeaseTasks(explorer="explorer-0", count=4, step=0))
        await client.call(CompleteTasks(lease_id=lease.lease_id))
        await client.call(ExplorerStepDone(explorer="explorer-0", step=0, batch=0, version=0))
        await client.call(Register(name="trainer", role="trainer"))
        await client.call(TrainerStepDone(step=0, version=1))
    finally:
        await client.close()
        await master.close()
    return journal_path(tmp_path)


def test_records_round_trip_through_the_codec(tmp_path):
    journal = Journal(tmp_path / "j.bin")
    journal.open()
    sent = [Register(name="e", role="explorer", terms={"sync.interval": 2, "model.path": "/m"}),
            TrainerStepDone(step=3, version=4, metrics={"loss": 0.5}),
            WeightsPublished(version=4, method="nccl", path="/w/v4")]
    for msg in sent:
        journal.append(msg)
    journal.close()
    assert read_journal(tmp_path / "j.bin") == sent


def test_the_weight_groups_member_key_never_reaches_the_journal(tmp_path):
    member_secret = "S" * 40
    published = WeightsPublished(version=4, method="nccl", rendezvous=dict(
        host="h", port=7, session="s", store_key="P" * 40, member_secret=member_secret,
        epoch=1, members=["e/0"]))
    journal = Journal(tmp_path / "j.bin")
    journal.open()
    journal.append(published)
    journal.close()
    assert member_secret.encode() not in (tmp_path / "j.bin").read_bytes()
    assert read_journal(tmp_path / "j.bin") == [published.model_copy(update={"rendezvous": None})]


@pytest.mark.parametrize("compact", [0, 1500], ids=["uncompacted", "compacted"])
async def test_replay_reproduces_the_state_of_a_finished_run(tmp_path, zmq_sockets_closed,
                                                             compact):
    config = make_config(tmp_path, "sync.preset=one_step_off_policy", "master.total_steps=4",
                         f"master.task_lease_seconds={BACKSTOP}",
                         f"master.journal_compact_bytes={compact}")
    master = Master(config)
    await master.start()
    seen, trained = [], []
    try:
        await asyncio.wait_for(asyncio.gather(explorer_loop(master, "explorer-0", seen),
                                              trainer_loop(master, trained, "nccl")), BACKSTOP)
        live = master.status()
    finally:
        await master.close()
    again = Master(config.model_copy(deep=True))
    await again.start()
    try:
        replayed = again.status()
    finally:
        await again.close()
    assert again.resumed and replayed.run_id == live.run_id
    assert replayed.counters == live.counters and replayed.counters.trainer_steps_done == 4
    assert replayed.explorers == live.explorers and replayed.leases == live.leases == []
    assert [(c.name, c.role) for c in replayed.components] == [
        (c.name, c.role) for c in live.components]
    assert again.dispatcher.cursor == master.dispatcher.cursor == 16
    assert again.clock.published_count == master.clock.published_count
    # compacted by the live master's handlers: a snapshot first, then the records after it
    head = read_journal(journal_path(tmp_path))[0]
    assert isinstance(head, JournalSnapshot) == bool(compact)


@pytest.mark.parametrize("tear", ["cut", "zeroed"])
async def test_a_torn_last_record_is_cut_and_the_run_goes_on(tmp_path, zmq_sockets_closed, tear):
    path = await short_run(tmp_path)
    whole = path.read_bytes()
    if tear == "cut":  # killed in the middle of writing TrainerStepDone
        path.write_bytes(whole[:-3])
    else:  # a machine crash: the file grew but the last page never reached the disk
        path.write_bytes(whole[:-5] + bytes(5))
    master = Master(make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=4"))
    await master.start()
    try:
        assert master.resumed and master.clock.batches_done == 1
        assert master.clock.trainer_done == 0  # the torn report is not counted
        client = master_client(master, "t")
        await client.call(TrainerStepDone(step=0, version=1))  # the trainer resends
        await client.close()
    finally:
        await master.close()
    kinds = [type(m).__name__ for m in read_journal(path)]
    assert kinds[-3:] == ["ExplorerStepDone", "Register", "TrainerStepDone"]


@pytest.mark.parametrize("damage, message", [
    ("flip", r"journal\.bin record 3 at byte \d+: fails its checksum and records follow"),
    ("length", r"journal\.bin record 3 at byte \d+: claims \d+ bytes"),
], ids=["bit-flip", "huge-length"])
async def test_a_damaged_record_in_the_middle_stops_the_master(tmp_path, zmq_sockets_closed,
                                                              damage, message):
    path = await short_run(tmp_path)
    data = bytearray(path.read_bytes())
    offsets, pos = [], 0
    while pos < len(data):
        offsets.append(pos)
        pos += 8 + struct.unpack_from(">I", data, pos)[0]
    third = offsets[2]
    if damage == "flip":
        data[third + 12] ^= 0xFF
    else:
        struct.pack_into(">I", data, third, 2**31)
    path.write_bytes(bytes(data))
    master = Master(make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=4"))
    with pytest.raises(JournalError, match=message):
        await master.start()
    await master.close()


@pytest.mark.parametrize("bad, message", [
    # a misspelt field: the old journal skipped such a line with a warning and lost the step
    (record("master.trainer.step", {"stepp": 1, "version": 2}),
     r"record 8: master\.trainer\.step: step: Field required; stepp: Extra inputs"),
    (record("master.trainer.stepdone", {"step": 1, "version": 2}),
     r"record 8: unknown message type 'master\.trainer\.stepdone'"),
    (frame(encode_request(Heartbeat(name="x"), "7")[0]),
     r"record 8: 'heartbeat' changes no state of the master and is not a journal record"),
    (frame(encode_request(RunStarted(run_id="r", total_steps=4, plan=dict(
        method="nccl", interval=1, offset=0, max_staleness=0, batches_per_step=1)), "7")[0]),
     r"record 8: 'master\.journal\.started' where a journal has 'master\.journal\.started' once"),
    (frame(encode_request(ExplorerStepDone(explorer="explorer-0", step=3, batch=3, version=0),
                          "7")[0]),
     r"record 8 \(master\.explorer\.step\): explorer-0 reported step 3 .* does not replay"),
], ids=["misspelt-field", "unknown-type", "not-a-record", "second-start", "inconsistent"])
async def test_a_record_that_does_not_replay_stops_the_master_naming_it(
        tmp_path, zmq_sockets_closed, bad, message):
    path = await short_run(tmp_path)
    assert len(read_journal(path)) == 7
    with open(path, "ab") as f:
        f.write(bad)
        f.write(frame(encode_request(TrainerStepDone(step=1, version=2), "8")[0]))
    master = Master(make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=4"))
    with pytest.raises(JournalError, match=str(path).replace(".", r"\.") + " " + message):
        await master.start()
    await master.close()


async def test_a_journal_must_start_with_the_run(tmp_path, zmq_sockets_closed):
    path = journal_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(frame(encode_request(TrainerStepDone(step=0, version=1), "1")[0]))
    master = Master(make_config(tmp_path, "master.total_steps=4"))
    with pytest.raises(JournalError, match="record 1: 'master.trainer.step' where a journal has "
                                           "'master.journal.started' first"):
        await master.start()
    await master.close()


async def test_an_explorer_declared_dead_is_one_record_that_replays(tmp_path,
                                                                   zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=3", "transport.liveness=1")
    master = Master(config)
    await master.start()
    client = master_client(master, "a")
    try:
        await client.call(Register(name="explorer-0", role="explorer"))
        await client.call(LeaseTasks(explorer="explorer-0", count=4, step=0))
        await until(lambda: not master.registry["explorer-0"].alive,  # silent past liveness
                    "explorer-0's declared death")
        assert master.dispatcher.expired == 1 and master.clock.batches_lost == 1
    finally:
        await client.close()
        await master.close()
    kinds = [type(m).__name__ for m in read_journal(journal_path(tmp_path))]
    assert kinds == ["RunStarted", "Register", "TasksLeased", "ExplorerLeft"]
    again = Master(config.model_copy(deep=True))
    await again.start()
    try:
        assert again.dispatcher.expired == 1 and again.clock.batches_lost == 1
        assert again.registry["explorer-0"].alive is False
        peer = Peer(again, "explorer-0", "explorer", [barrier_topic("explorer-0")])
        await peer.start()  # registers again and is granted the lost step's batch anew
        barrier = await peer.next("barrier")
        assert (barrier.step, barrier.batch) == (0, 1)
        await peer.close()
    finally:
        await again.close()
