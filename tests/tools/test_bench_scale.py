"""tools/bench_scale.py --quick: the real master and buffer against a few simulated explorers
and a simulated trainer. Checks the tool's accounting, never its timings: every step trained
once, every group put trained exactly once, nothing stored twice, and the master's journal
replays to the state the live master reported, also compacted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from backstop import BACKSTOP

ROOT = Path(__file__).resolve().parents[2]


def test_quick_simulation_trains_every_step_and_group_once_and_the_journal_replays(tmp_path):
    out = tmp_path / "scale.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_scale.py"), "--quick",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=BACKSTOP)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["quick"] and report["accounting_failures"] == []
    (row,) = report["results"]
    acc, live = row["accounting"], row["accounting"]["live_counters"]
    tasks = row["explorers"] * row["steps"] * 2  # --quick: 2 tasks per explorer and step
    assert acc["steps_trained_once"] and acc["groups_trained_once"]
    assert acc["groups_put_all_trained"] and acc["groups_trained"] == tasks
    assert acc["experiences_stored"] == tasks * 2 and acc["duplicates"] == 0  # 2 responses
    assert live["trainer_steps_done"] == row["steps"] and live["stopped"]
    assert live["tasks_completed"] == live["tasks_dispatched"] == tasks
    assert live["batches_done"] == row["explorers"] * row["steps"]
    assert acc["replay_matches_live"]
    assert row["journal_records"] > 0 and row["journal_bytes"] > 0
    # the journal phase: the same run compacted and not, each replayed in a fresh process
    (journal,) = report["journals"]
    assert journal["replay_matches"] and journal["snapshots"] > 0
    assert journal["bytes"][1] < journal["bytes"][0]
