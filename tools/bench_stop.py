"""How long a SIGTERM stop of `tandem up` takes, per sync preset and per moment of the run.

    .venv/bin/python tools/bench_stop.py [--presets synchronous,one_step_off_policy,...]
        [--moments rollout,train,broadcast] [--at-step 2] [--sync-timeout 120]
        [--out .bench/bench_stop.json]

Each row is one `tandem up` of the quickstart task on a tiny Qwen2 built locally (one explorer,
two for multi_explorer_async; `sync.timeout` as given, 120 s as in examples/; the other stop
bounds at their defaults), SIGTERMed at a moment chosen from the master's journal once step
`--at-step` is reached:

| moment    | the journal's newest record                    | what the run is doing           |
|-----------|------------------------------------------------|---------------------------------|
| rollout   | TasksLeased of step >= N                       | an explorer rolls out its batch |
| train     | ExplorerStepDone of step >= N                  | the trainer samples and trains  |
| broadcast | WeightsPublished of version >= N               | the trainer sends the weights   |

`stop s` is this tool's wall clock from the SIGTERM to the exit of `tandem up`; `run's own s`
is the supervisor's `stop` span in run_dir/trace/up.jsonl (from the signal to the last
component's exit), where the code under test writes one. `killed` names the components the
supervisor had to SIGKILL after their bound. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

TANDEM = str(Path(sys.executable).parent / "tandem")
PRESETS = ("synchronous", "one_step_off_policy", "fully_async", "multi_explorer_async")
MOMENTS = {"rollout": "TasksLeased", "train": "ExplorerStepDone", "broadcast": "WeightsPublished"}


def write_config(workdir: Path, model_dir: Path, preset: str, sync_timeout: float) -> Path:
    from tandem.common.sync import preset_explorers
    from tandem.master.quickstart import reversal_tasks, write_jsonl

    train, _ = reversal_tasks(0)
    explorers = preset_explorers(preset)
    config = {
        "name": f"stop-{preset}", "run_dir": str(workdir / "run"),
        "model": {"path": str(model_dir)},
        "sync": {"preset": preset, "timeout": sync_timeout},
        "master": {"total_steps": 1000, "taskset": {
            "path": str(write_jsonl(train[:64], workdir / "train.jsonl")), "epochs": 1000}},
        "explorers": [{"name": f"explorer-{i}", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}} for i in range(explorers)],
        "trainer": {"groups_per_step": 2 * explorers, "lr": 1e-4},
        "reward": {"functions": {"k12": 1.0}},
        "logging": {"level": "info", "metrics": {"port": 0}},
        "up": {"timeline": False},
    }
    path = workdir / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def journal_records(run_dir: Path) -> list:
    """The master's journal as it is now (a torn last record is left out)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from resume_check import journal

    return journal(run_dir)


def moment_reached(records: list, record: str, step: int) -> bool:
    """Whether the journal's newest record is `record` at `step` or later."""
    if not records or type(records[-1]).__name__ != record:
        return False
    last = records[-1]
    return (last.version if record == "WeightsPublished" else last.step) >= step


def stop_span(run_dir: Path) -> dict[str, Any] | None:
    from tandem.common.trace import read_trace

    spans = [s for s in read_trace(run_dir) if s["component"] == "up" and s["kind"] == "stop"]
    return spans[-1] if spans else None


def one_stop(workdir: Path, model_dir: Path, preset: str, moment: str, *, at_step: int,
             sync_timeout: float, start_timeout: float = 600) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_config(workdir, model_dir, preset, sync_timeout)
    run_dir = workdir / "run"
    row: dict[str, Any] = {"preset": preset, "moment": moment, "sync_timeout": sync_timeout}
    proc = subprocess.Popen([TANDEM, "up", str(config), "--plain"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + start_timeout
    while not moment_reached(journal_records(run_dir), MOMENTS[moment], at_step):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, _ = proc.communicate()
            row.update(error="the run ended or stalled before the moment", tail=out[-2000:])
            return row
        time.sleep(0.02)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=900)
    row["stop_seconds"] = round(time.monotonic() - sent, 2)
    row["exit_code"] = proc.returncode
    row["killed"] = sorted({line.split("component=")[1].split()[0] for line in out.splitlines()
                            if "up.kill" in line and "component=" in line})
    span = stop_span(run_dir)
    if span is not None:
        row["run_stop_seconds"] = round(span["end"] - span["start"], 2)
        row["exits"] = (span.get("attrs") or {}).get("exits")
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| preset | moment | stop s | run's own s | exit | killed |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['moment']} | {r['error']} | | | |")
            continue
        lines.append(f"| {r['preset']} | {r['moment']} | {r['stop_seconds']:.1f} | "
                     f"{r.get('run_stop_seconds', '-')} | {r['exit_code']} | "
                     f"{', '.join(r['killed']) or '-'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--moments", default=",".join(MOMENTS))
    parser.add_argument("--at-step", type=int, default=2)
    parser.add_argument("--sync-timeout", type=float, default=120.0)
    parser.add_argument("--out", default=".bench/bench_stop.json")
    args = parser.parse_args()
    from tandem.weights.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-stop-") as tmp:
        model_dir = Path(tmp) / "model"
        build_tiny_model(model_dir)
        for preset in args.presets.split(","):
            for moment in args.moments.split(","):
                row = one_stop(Path(tmp) / f"{preset}-{moment}", model_dir, preset, moment,
                               at_step=args.at_step, sync_timeout=args.sync_timeout)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
