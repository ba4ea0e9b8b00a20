"""Taskset loading (JSONL, Parquet, saved datasets) and the dispatcher's order, epochs, leases."""

from __future__ import annotations

import json

import pytest

from tandem.common.config import TasksetConfig
from tandem.common.errors import ConfigError
from tandem.master.taskset import TaskDispatcher, load_rows


def jsonl(path, n, start=0):
    path.write_text("".join(json.dumps({"q": f"{i}+1", "a": i + 1}) + "\n"
                            for i in range(start, start + n)))
    return path


def dispatcher(rows, **kw) -> TaskDispatcher:
    return TaskDispatcher(rows, TasksetConfig(path="x", **kw))


def lease(d: TaskDispatcher, explorer: str, count: int, step: int = 0, now: float = 0.0):
    refs = d.plan_lease(count)
    return d.apply_lease(d.new_lease_id(), explorer, step, refs, now + 10, now)


def test_jsonl_file_and_folder(tmp_path):
    jsonl(tmp_path / "a.jsonl", 3)
    jsonl(tmp_path / "b.jsonl", 2, start=3)
    assert [r["a"] for r in load_rows(TasksetConfig(path=str(tmp_path / "a.jsonl")))] == [1, 2, 3]
    assert len(load_rows(TasksetConfig(path=str(tmp_path)))) == 5


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["1+1", "2+2"], "a": [2, 4]}), tmp_path / "t.parquet")
    assert load_rows(TasksetConfig(path=str(tmp_path / "t.parquet"))) == [
        {"q": "1+1", "a": 2}, {"q": "2+2", "a": 4}]


def test_saved_dataset_and_splits(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"q": ["a", "b", "c"]})
    ds.save_to_disk(str(tmp_path / "one"))
    assert [r["q"] for r in load_rows(TasksetConfig(path=str(tmp_path / "one")))] == ["a", "b", "c"]
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_rows(TasksetConfig(path=str(tmp_path / "dd"), split="test"))) == 1
    with pytest.raises(ConfigError, match="name one"):
        load_rows(TasksetConfig(path=str(tmp_path / "dd")))


def test_bad_tasksets_name_the_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n{"q": \n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2"):
        load_rows(TasksetConfig(path=str(tmp_path / "bad.jsonl")))
    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match="JSON object"):
        load_rows(TasksetConfig(path=str(tmp_path / "list.jsonl")))
    with pytest.raises(ConfigError, match="does not exist"):
        load_rows(TasksetConfig(path=str(tmp_path / "missing.jsonl")))


def test_seeded_shuffle_epochs_and_exhaustion():
    rows = [{"i": i} for i in range(5)]
    d = dispatcher(rows, seed=3, epochs=2)
    got = [d.task(r).payload["i"] for r in lease(d, "a", 10).refs]
    assert sorted(got[:5]) == sorted(got[5:]) == list(range(5))
    assert got[:5] != got[5:] or got[:5] != list(range(5))  # shuffled per epoch
    assert [d.task(r).epoch for r in d.leases[next(iter(d.leases))].refs] == [0] * 5 + [1] * 5
    assert d.exhausted and d.plan_lease(3) == []
    again = dispatcher(rows, seed=3, epochs=2)
    assert [again.task(r).payload["i"] for r in lease(again, "a", 10).refs] == got
    plain = dispatcher(rows, shuffle=False)
    assert [r[1] for r in plain.plan_lease(5)] == [0, 1, 2, 3, 4]


def test_expired_tasks_go_first_and_late_completion_takes_them_back():
    d = dispatcher([{"i": i} for i in range(10)], shuffle=False)
    first = lease(d, "a", 3)
    d.apply_expire(first.lease_id)
    assert [r[1] for r in d.plan_lease(4)] == [0, 1, 2, 3]
    second = lease(d, "b", 2)
    assert [r[1] for r in second.refs] == [0, 1]
    assert d.apply_complete(first.lease_id)  # late: task 2 not re-leased yet comes back
    assert [r[1] for r in d.plan_lease(2)] == [3, 4]
    assert not d.apply_complete("unknown")
    assert d.apply_complete(second.lease_id) and d.apply_complete(second.lease_id)  # repeat
    assert d.completed == 3


def test_replaying_the_same_leases_rebuilds_the_cursor():
    rows = [{"i": i} for i in range(8)]
    d = dispatcher(rows, seed=1)
    log = []
    for explorer in ("a", "b"):
        refs = d.plan_lease(3)
        log.append((explorer, refs))
        d.apply_lease(f"l-{explorer}", explorer, 0, refs, 10.0, 0.0)
    d.apply_expire("l-a")
    replayed = dispatcher(rows, seed=1)
    for explorer, refs in log:
        replayed.apply_lease(f"l-{explorer}", explorer, 0, [list(r) for r in refs], 10.0, 0.0)
    replayed.apply_expire("l-a")
    assert replayed.plan_lease(5) == d.plan_lease(5)
    assert replayed.counters() == d.counters()
