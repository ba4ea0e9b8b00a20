"""Journal compaction (docs/master.md, "Compaction"): a snapshot of the master's state replaces
the records it stands for. Replay after compaction equals replay without it, a crash at each
step of a compaction leaves a journal that replays to the same state, an uncompacted (older)
journal replays and is compacted, and replay reads one record at a time.

The runs are driven through `Master._commit`, the one way the master's state changes, with the
messages its handlers would commit (no sockets): the journals are the master's own, on real
files with real fsync, and every run is the same run."""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import pytest

from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerDraining,
    ExplorerStepDone,
    JournalSnapshot,
    PlanKnobs,
    Register,
    RunStarted,
    TasksLeased,
    TrainerCheckpointed,
    TrainerStepDone,
    WeightsPublished,
)
from tandem.common.runrecord import read_run_record
from tandem.master.journal import Journal, JournalError, read_journal
from tandem.master.service import Master
from tandem.master.snapshot import capture, restore

sys.path.insert(0, str(Path(__file__).parent))
from master_peers import make_config

EXPLORERS = ("explorer-0", "explorer-1")


class Crash(Exception):
    """The master dies here (raised from a compaction step)."""


def config(root: Path, preset: str, compact_bytes: int):
    root.mkdir(parents=True, exist_ok=True)
    return make_config(root, f"sync.preset={preset}", "master.total_steps=12",
                       f"master.journal_compact_bytes={compact_bytes}",
                       "explorers.1.batch_size=4", "explorers.1.name=explorer-1",
                       "trainer.keep_checkpoints=2", tasks=200)


def opened(cfg) -> Master:
    """A master as `start()` leaves it, without its sockets: replayed, journal open."""
    master = Master(cfg)
    master._replay()
    master.journal.open()
    if not master.resumed:
        master._commit(RunStarted(run_id="run-1", total_steps=master.total_steps,
                                  plan=_plan(master),
                                  config=None))
    return master


def _plan(master: Master) -> PlanKnobs:
    return PlanKnobs(**master.plan.describe())


def shut(master: Master) -> None:
    """Drop a master as a killed process leaves it: what it wrote is in the OS, nothing more."""
    if master.journal._file is not None:
        master.journal._file.close()
        master.journal._file = None


def drive(master: Master) -> list:
    """Run the whole run through `master._commit` as its handlers would; returns every
    message committed, in order (RunStarted excluded)."""
    committed, barriers, goes = [], [], []

    def commit(msg):
        committed.append(msg)
        for topic, decision in master._commit(msg):
            if topic.startswith("barrier."):
                barriers.append(decision)
            elif topic == "trainer":
                goes.append(decision)

    commit(Register(name="trainer", role="trainer"))
    for name in EXPLORERS:
        commit(Register(name=name, role="explorer"))
    while not master.clock.stopped and (barriers or goes):
        if barriers:
            b = barriers.pop(0)
            lease = f"lease-{b.batch}"
            commit(TasksLeased(lease_id=lease, explorer=b.explorer, step=b.step,
                               refs=master.dispatcher.plan_lease(4), deadline=1e12,
                               granted_at=1.0))
            if master.plan.asynchronous:
                commit(ExplorerDraining(explorer=b.explorer, step=b.step, batch=b.batch))
            commit(CompleteTasks(lease_id=lease))
            commit(ExplorerStepDone(explorer=b.explorer, step=b.step, batch=b.batch,
                                    version=b.version, informative=2, metrics={"reward": 0.5}))
        if goes:
            go = goes.pop(0)
            commit(TrainerStepDone(step=go.step, version=go.step + 1, metrics={"loss": 0.1}))
            if go.publish is not None:
                commit(WeightsPublished(version=go.publish, method="checkpoint",
                                        path=f"weights/v{go.publish}"))
            if (go.step + 1) % 2 == 0:
                commit(TrainerCheckpointed(step=go.step + 1, checkpoint=f"step_{go.step + 1}"))
    assert master.clock.stopped and master.clock.trainer_done == 12
    return committed


def state(master: Master) -> dict:
    return capture(master).model_dump()


def replayed(cfg) -> tuple[dict, Master]:
    master = Master(cfg)
    master._replay()
    return state(master), master


@pytest.fixture(params=["synchronous", "fully_async"])
def reference(request, tmp_path):
    """A run journaled without compaction: its config, live state, and messages."""
    cfg = config(tmp_path / "plain", request.param, 0)
    master = opened(cfg)
    messages = drive(master)
    live = state(master)
    assert master.clock.forgotten_through == 10  # checkpoints 10 and 12 kept: bounded memory
    master.journal.close()
    return request.param, live, messages, tmp_path


def commit_all(master: Master, messages) -> None:
    for msg in messages:
        master._commit(msg)


def test_replay_after_compaction_equals_replay_without(reference):
    preset, live, messages, tmp_path = reference
    plain = Path(tmp_path / "plain" / "run" / "master" / "journal.bin")
    assert not any(isinstance(r, JournalSnapshot) for r in read_journal(plain))
    assert replayed(config(tmp_path / "plain", preset, 0))[0] == live
    cfg = config(tmp_path / "compacted", preset, 2000)
    master = opened(cfg)
    compactions = []
    master.journal.on_compaction_step = lambda step: compactions.append(step)
    commit_all(master, messages)
    master.journal.close()
    assert compactions.count("dir_synced") >= 5
    path = master.journal.path
    assert path.stat().st_size < plain.stat().st_size / 3
    head = read_journal(path)[0]
    assert isinstance(head, JournalSnapshot) and head.records > 1
    again, _ = replayed(cfg)
    assert again == live  # records numbered on: the same count as the plain journal's
    record = read_run_record(path)
    assert (record.run_id, record.total_steps, record.trainer_steps) == ("run-1", 12, 12)


@pytest.mark.parametrize("step", ["written", "synced", "renamed", "dir_synced"])
def test_a_crash_at_each_compaction_step_replays_to_the_same_state(reference, step):
    preset, live, messages, tmp_path = reference
    cfg = config(tmp_path / "crashed", preset, 2000)
    master = opened(cfg)
    seen = []

    def crash_third(name):
        seen.append(name)
        if name == step and seen.count(step) == 3:
            raise Crash(step)

    master.journal.on_compaction_step = crash_third
    with pytest.raises(Crash):
        commit_all(master, messages)
    shut(master)
    done = master.journal.records  # the record whose commit compacted is journaled
    leftover = master.journal.compacting_path.exists()
    assert leftover == (step in ("written", "synced"))
    # the same records, journaled plainly, replay to the same state
    prefix = config(tmp_path / "prefix", preset, 0)
    journal = Journal(Path(prefix.run_dir) / prefix.master.journal)
    journal.open()
    for msg in [RunStarted(run_id="run-1", total_steps=12, plan=_plan(master)),
                *messages[:done - 1]]:
        journal.append(msg)
    journal.close()
    expected, _ = replayed(prefix)
    restarted = opened(cfg)
    assert state(restarted) == expected and restarted.journal.records == done
    assert not restarted.journal.compacting_path.exists()
    commit_all(restarted, messages[done - 1:])  # and the run goes on to the same end
    restarted.journal.close()
    assert replayed(cfg)[0] == live


def test_an_uncompacted_journal_replays_and_is_compacted(reference):
    preset, live, _, tmp_path = reference
    # the journal an older tandem (or journal_compact_bytes: 0) wrote, resumed with compaction
    cfg = config(tmp_path / "plain", preset, 2000)
    master = Master(cfg)
    master._replay()
    assert state(master) == live
    master.journal.open()
    master._commit(Register(name="trainer", role="trainer"))  # its first commit compacts
    master.journal.close()
    records = read_journal(master.journal.path)
    assert [type(r) for r in records] == [JournalSnapshot]
    again, _ = replayed(cfg)
    assert again == state(master)


def unsorted_pair() -> set[str]:
    """Two explorer names whose set iterates out of sorted order in this process (which pair
    does depends on the hash seed)."""
    for i in range(100):
        pair = {f"explorer-{i}", f"explorer-{i + 1}"}
        if list(pair) != sorted(pair):
            return pair
    raise AssertionError("no pair of names iterates unsorted")


def test_a_snapshot_writes_its_sets_sorted_so_the_same_state_is_the_same_snapshot(tmp_path):
    # a set iterates in an order set by the hash seed and the order its members came in; a
    # restored master builds its sets from the snapshot's lists, so the same state written as
    # it iterates could read back as another snapshot (found: the replayed state differing from
    # the live one in the order of `clock.done`, in one process of four)
    master = opened(config(tmp_path / "run", "synchronous", 0))
    master._commit(Register(name="trainer", role="trainer"))
    master.clock.done[3] = unsorted_pair()
    master.clock.on_disk = {8, 1}  # iterates 8, 1
    master.clock.uncounted = {16, 2}
    snap = capture(master)
    clock = snap.state["clock"]
    assert clock["done"]["3"] == sorted(master.clock.done[3])
    assert clock["on_disk"] == [1, 8] and clock["uncounted"] == [2, 16]
    again = Master(config(tmp_path / "again", "synchronous", 0))
    restore(again, snap, "test")
    again.journal.records = snap.records  # as replaying the journal counts them
    assert again.clock.done[3] == master.clock.done[3] and again.clock.on_disk == {1, 8}
    assert capture(again).model_dump() == snap.model_dump()


def test_a_snapshot_of_a_newer_format_is_one_clear_error(reference):
    preset, _, _, tmp_path = reference
    cfg = config(tmp_path / "plain", preset, 2000)
    master = Master(cfg)
    master._replay()
    snap = capture(master).model_copy(update={"format": 99})
    path = master.journal.path
    path.unlink()
    journal = Journal(path)
    journal.open()
    journal.records = snap.records
    journal.compact(snap)
    journal.close()
    with pytest.raises(JournalError, match=r"journal\.bin snapshot of records 1\.\.\d+: a "
                                           r"snapshot of format 99, newer than this tandem"):
        Master(cfg)._replay()


def test_replay_reads_one_record_at_a_time(tmp_path):
    path = tmp_path / "j.bin"
    journal = Journal(path)
    journal.open()
    big = {f"m{i:05d}": float(i) for i in range(4000)}  # about 64 KB a record
    for step in range(128):
        journal.append(TrainerStepDone(step=step, version=step + 1, metrics=big))
    journal.close()
    assert path.stat().st_size > 7 * 2**20
    tracemalloc.start()
    try:
        count = sum(1 for _ in Journal(path).replay())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 128 and peak < 2 * 2**20  # a record or two, never the file
