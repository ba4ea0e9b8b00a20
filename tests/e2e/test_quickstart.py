"""A shortened `tandem quickstart`: SFT warm start, GRPO through real processes, and the
held-out accuracy rises (fixed seeds)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from processes import run_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1560)]


def test_quickstart_raises_heldout_accuracy(tmp_path):
    run_dir = tmp_path / "qs"
    tandem = Path(sys.executable).parent / "tandem"
    # about 100 s on 2 quiet cores and about 90 s of CPU, which a loaded machine stretches to
    # many minutes: a hang is a run that stops computing (`stall`), not a slow one
    proc = run_group(
        [str(tandem), "quickstart", "--plain", "--run-dir", str(run_dir), "--steps", "50"],
        timeout=1500, stall=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["after"]["sampled/accuracy"] >= result["before"]["sampled/accuracy"] + 0.1, \
        result
    # measured by the run's own evaluation: before the first step and at the end
    lines = (run_dir / "grpo" / "eval.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert next((r["version"], r["final"]) for r in rows) == (0, False) and rows[-1]["final"]
    assert result["versions"] == [0, rows[-1]["version"]]
    assert "held-out accuracy" in proc.stdout
    assert (run_dir / "grpo" / "timeline.png").exists()
    trace = run_dir / "grpo" / "trace"
    assert sorted(p.name for p in trace.glob("*.jsonl")) == [
        "buffer.jsonl", "explorer-0.jsonl", "trainer.jsonl", "up.jsonl"]
    # the supervisor's own lane: the end of the run, each component's exit, none SIGKILLed
    stops = [json.loads(line) for line in (trace / "up.jsonl").read_text().splitlines()]
    assert [s["kind"] for s in stops] == ["stop"] and not stops[0]["attrs"].get("killed"), stops
