"""The master's taskset from the user's own columns: the same order and ids as the rows it
came from, tasks that cross the wire as they are, and a bad row refused at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from backstop import BACKSTOP
from tandem.common import codec
from tandem.common.config import TasksetConfig
from tandem.common.messages.master import TaskLease
from tandem.master.taskset import TaskDispatcher, load_rows

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"uid": f"t{i}", "chat": CHAT, "gold": str(i)}) + "\n"
                            for i in range(n)))
    return path


def test_a_format_keeps_the_order_and_the_ids_of_the_rows(tmp_path):
    path = write_rows(tmp_path / "t.jsonl", 7)
    raw = TasksetConfig(path=str(path), id_field="uid", seed=5, epochs=2)
    made = TasksetConfig(path=str(path), id_field="uid", seed=5, epochs=2,
                         format={"messages": "chat", "answer": "gold"})
    d_raw, d_made = TaskDispatcher(load_rows(raw), raw), TaskDispatcher(load_rows(made), made)
    refs = d_raw.plan_lease(14)
    assert refs == d_made.plan_lease(14)
    assert [d_raw.task(r).id for r in refs] == [d_made.task(r).id for r in refs]
    task = d_made.task(refs[0])
    assert task.payload == {"messages": CHAT, "answer": task.id[1:], "id": task.id}


def test_formatted_tasks_cross_the_wire_as_they_are(tmp_path):
    cfg = TasksetConfig(path=str(write_rows(tmp_path / "t.jsonl", 3)), shuffle=False,
                        format={"messages": "chat", "answer": "gold", "id": "uid",
                                "args": {"n": "gold"}})
    d = TaskDispatcher(load_rows(cfg), cfg)
    lease = TaskLease(lease_id="l", tasks=[d.task(r) for r in d.plan_lease(3)], deadline=1.0)
    back = codec.decode(codec.encode_reply("r", lease), reply_type=TaskLease).body
    assert back == lease and back.tasks[2].payload["reward_args"] == {"n": "2"}


def test_the_master_refuses_a_bad_row_at_start_in_one_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"chat": CHAT}) + "\n" + json.dumps({"chat": "2+2?"}) + "\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\n"
                   "master: {address: 'tcp://127.0.0.1:0', publish_address: "
                   f"'tcp://127.0.0.1:0', "
                   f"taskset: {{path: '{path}', format: {{messages: chat}}}}}}\n"
                   "logging: {level: warning}\n")
    exe = Path(sys.executable).with_name("tandem-master")
    done = subprocess.run([str(exe), "--config", str(cfg)], capture_output=True, text=True,
                          timeout=BACKSTOP)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"tandem-master: invalid config: master.taskset.format.messages: {path} row 2: column "
        "'chat' must be a list of {role, content} messages, got str"]
