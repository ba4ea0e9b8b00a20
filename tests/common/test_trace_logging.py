"""Tracing writes spans a reader can trust; logging writes JSON lines into the run dir."""

from __future__ import annotations

import json
import logging
import time

import structlog

from tandem.common.logging import configure_logging
from tandem.common.trace import JsonlTail, Tracer, read_logs, read_trace


def test_spans_are_written_in_order_and_torn_lines_skipped(tmp_path):
    tracer = Tracer(tmp_path, "explorer-0", flush_interval=60)
    with tracer.span("rollout", step=0, version=0) as extra:
        time.sleep(0.01)
        extra["tokens"] = 128
    tracer.event("buffer_fill", ready=3)
    tracer.record("train", 1.0, 2.0, step=0, version=1)
    tracer.close()
    with open(tmp_path / "trace" / "explorer-0.jsonl", "a") as f:
        f.write('{"component": "explorer-0", "kind": "roll')  # a process killed mid-write
    spans = read_trace(tmp_path)
    assert [s["kind"] for s in spans] == ["train", "rollout", "buffer_fill"]
    rollout = spans[1]
    assert rollout["end"] - rollout["start"] >= 0.01 and rollout["attrs"] == {"tokens": 128}


def test_disabled_tracer_writes_nothing(tmp_path):
    tracer = Tracer(None, "x")
    with tracer.span("train", step=1):
        pass
    tracer.close()
    assert not tracer.enabled and not (tmp_path / "trace").exists()


def test_logs_are_json_lines_in_the_run_dir(tmp_path):
    configure_logging("buffer", run_dir=tmp_path, json_console=True)
    structlog.get_logger("tandem.test").info("weights.loaded", version=7, seconds=0.41)
    for handler in logging.getLogger().handlers:
        handler.flush()
    lines = (tmp_path / "logs" / "buffer.jsonl").read_text().splitlines()
    event = json.loads(lines[-1])
    assert event["event"] == "weights.loaded" and event["version"] == 7
    assert event["component"] == "buffer" and event["level"] == "info"


def test_a_tail_returns_each_whole_object_once_and_waits_for_a_torn_line(tmp_path):
    path = tmp_path / "logs" / "explorer-0.jsonl"
    path.parent.mkdir()
    tail = JsonlTail()
    assert tail.new_objects(path) == []  # not written yet
    path.write_text('{"event": "a"}\n[1, 2]\nnot json\n{"event": "b", "st')
    assert tail.new_objects(path) == [{"event": "a"}]
    assert tail.new_objects(path) == []
    with open(path, "a") as f:
        f.write('ep": 2}\n{"event": "c"}\n')
    assert tail.new_objects(path) == [{"event": "b", "step": 2}, {"event": "c"}]
    assert [(e["_file"], e["event"]) for e in read_logs(tmp_path)] == [
        ("explorer-0", "a"), ("explorer-0", "b"), ("explorer-0", "c")]
