"""Resume check: a run stopped or killed mid-way and continued with `--resume` ends exactly
where the same run ends uninterrupted.

    .venv/bin/python tools/resume_check.py [--preset synchronous|fully_async|both] [--steps 8]
        [--stop-at 4] [--scenarios uninterrupted,sigterm,sigkill] [--seed 0]
        [--out .bench/resume_check.json]

Per preset, with default settings (`trainer.checkpoint_every: 0`, `up.stop_timeout`,
`buffer.lease_seconds`, retention) on the quickstart task and a tiny Qwen2 built locally:

| scenario      | what happens                                                                   |
|---------------|--------------------------------------------------------------------------------|
| uninterrupted | `tandem up` to the end                                                         |
| sigterm       | SIGTERM to `tandem up` once the master counted `--stop-at` trainer steps, then |
|               | `tandem up --resume` to the end                                                |
| sigkill       | SIGKILL to `tandem up` and every component at that moment (no exit checkpoint: |
|               | the trainer restarts from model.path and retrains), then `tandem up --resume`  |
| sigkill-cycles| the same three times (at `--stop-at`, then 2 and 4 steps later, each once the  |
|               | incarnation's trainer counted that many, then frozen at once), `--resume` after|
|               | each: every resumed trainer moves the lost lineage's versions aside while      |
|               | explorers register (issue 32 item 5)                                           |

Each run is accounted from its run dir alone: the final learner step (the newest checkpoint's
trainer_state.json), the steps the master counted (its journal), every group's uses and the
steps that consumed them (the buffer database, read-only), and the wall time of the resumed
part. A scenario passes when the learner holds `total_steps`, the master counted them, every
step consumed `groups_per_step` groups, no task was consumed twice, and the per-task
consumption equals the uninterrupted run's. Prints a table, writes JSON; exit code 1 if any
scenario fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

TANDEM = str(Path(sys.executable).parent / "tandem")
SCENARIOS = ("uninterrupted", "sigterm", "sigkill", "sigkill-cycles")
# the explorer's error for a version that is not on disk
NOT_FOUND = re.compile(r"weights version \d+ not found")


def write_config(workdir: Path, model_dir: Path, *, preset: str, steps: int, seed: int,
                 run_timeout: float) -> Path:
    """The quickstart task, one explorer, default settings for everything this check is about."""
    from tandem.master.quickstart import reversal_tasks, write_jsonl

    train, _ = reversal_tasks(seed)
    config = {
        "name": f"resume-{preset}", "run_dir": str(workdir / "run"), "seed": seed,
        "model": {"path": str(model_dir)},
        "sync": {"preset": preset, "timeout": 60},
        "master": {"total_steps": steps, "taskset": {
            "path": str(write_jsonl(train[:64], workdir / "train.jsonl")), "seed": seed,
            "epochs": 100}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-4},
        "reward": {"functions": {"k12": 1.0}},
        "transport": {"liveness": 30.0},
        "logging": {"level": "info"},
        "up": {"run_timeout": run_timeout, "timeline": False},
    }
    from tandem.common.config.logs import LoggingConfig

    if "metrics" in LoggingConfig.model_fields:  # free /metrics ports: runs may share a host
        config["logging"]["metrics"] = {"port": 0}
    path = workdir / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def journal(run_dir: Path) -> list:
    """The master's journal as it is now (a torn last record is left out)."""
    from tandem.master.journal import JournalError, read_journal

    try:
        return read_journal(run_dir / "master" / "journal.bin")
    except (JournalError, OSError):
        return []


def batches_done(run_dir: Path) -> int:
    """Batches the explorers reported (each once, whatever restarts)."""
    return len({r.batch for r in journal(run_dir) if type(r).__name__ == "ExplorerStepDone"})


def master_steps(run_dir: Path, *, resumes: int = 0, since: int = 0) -> int:
    """Trainer steps the master counted so far (its journal, read as it grows), from its record
    `since` on; 0 until those records hold `resumes` TrainerResumed records (a trainer's first
    start sends one too)."""
    counted, seen = 0, 0
    for r in journal(run_dir)[since:]:
        kind = type(r).__name__
        if kind == "TrainerStepDone":
            counted = max(counted, r.step + 1)
        elif kind == "TrainerResumed":
            counted, seen = min(counted, r.step), seen + 1
    return counted if seen >= resumes else 0


def trainers_resumed(records: list) -> list[int]:
    """The steps of the TrainerResumed records among `records`: one per trainer that joined."""
    return [r.step for r in records if type(r).__name__ == "TrainerResumed"]


def up_process(config: Path, *resume: str) -> subprocess.Popen:
    return subprocess.Popen([TANDEM, "up", str(config), "--plain", *resume],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def children_of(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def freeze_trainer(proc: subprocess.Popen) -> None:
    """SIGSTOP `tandem up`'s trainer, so it steps no further while everything is killed."""
    for pid in children_of(proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(Path(a.decode(errors="replace")).name == "tandem-trainer" for a in argv):
                os.kill(pid, signal.SIGSTOP)
        except OSError:  # gone already
            continue


def kill_everything(proc: subprocess.Popen) -> None:
    """SIGKILL `tandem up` and every component at once (each runs in its own session)."""
    components = children_of(proc.pid)
    groups = set()
    for pid in components:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    proc.kill()
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in components):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_everything(proc)
        out, _ = proc.communicate()
        return 124, out
    return proc.returncode, out


def run_scenario(workdir: Path, model_dir: Path, preset: str, scenario: str, *, steps: int,
                 stop_at: int, seed: int, run_timeout: float = 300) -> dict[str, Any]:
    """One run of `scenario`; the report (also what the test asserts on)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = write_config(workdir, model_dir, preset=preset, steps=steps, seed=seed,
                          run_timeout=run_timeout)
    run_dir = workdir / "run"
    report: dict[str, Any] = {"preset": preset, "scenario": scenario, "total_steps": steps}
    start = time.monotonic()
    if scenario == "sigkill-cycles":
        kills = [k for k in (stop_at, stop_at + 2, stop_at + 4) if k < steps]
        report.update(kill_cycles(config, run_dir, kills, run_timeout=run_timeout))
        report["seconds"] = round(time.monotonic() - start, 2)
        report.update(account(run_dir, groups_per_step=2))
        return report
    proc = up_process(config)
    outputs = []
    if scenario != "uninterrupted":
        deadline = time.monotonic() + run_timeout
        while master_steps(run_dir) < stop_at and proc.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        report["interrupted_at"] = master_steps(run_dir)
        if scenario == "sigterm":
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code, out = finish(proc, 60 + 300)
            report["stop_seconds"] = round(time.monotonic() - sent, 2)
        else:
            kill_everything(proc)
            code, out = proc.returncode, proc.stdout.read()
        report["first_exit_code"] = code
        report["first_ended_by_itself"] = report["interrupted_at"] < stop_at
        if report["first_ended_by_itself"]:
            report["first_output_tail"] = out[-3000:]
        outputs.append(out)
        report["checkpoint_at_stop"] = newest_checkpoint_step(run_dir)
        resumed = time.monotonic()
        proc = up_process(config, "--resume")
        code, out = finish(proc, run_timeout)
        report["resume_seconds"] = round(time.monotonic() - resumed, 2)
    else:
        code, out = finish(proc, run_timeout)
    outputs.append(out)
    report["seconds"] = round(time.monotonic() - start, 2)
    report["exit_code"] = code
    report.update(account(run_dir, groups_per_step=2))
    report["retrain_log"] = [e.get("detail") for e in log_events(run_dir)
                             if e.get("event") == "trainer.resume"]
    if code != 0:
        report["output_tail"] = "\n".join(outputs)[-3000:]
    return report


def kill_cycles(config: Path, run_dir: Path, kills: list[int], *,
                run_timeout: float) -> dict[str, Any]:
    """`tandem up`, SIGKILL of everything once the master counted each of `kills` steps, and
    `tandem up --resume` after each; the last one runs to the end. Per incarnation: where it
    was killed, and its exit code when it ended by itself."""
    cycles, outputs = [], []
    mark = 0  # the journal's records before this incarnation
    proc = up_process(config)
    for k in kills:
        # counted by this incarnation's trainer, in the records after the killed one's: the
        # count before its TrainerResumed is the killed one's (a kill that overshot its target
        # would strike again at once, before this trainer even registered)
        deadline = time.monotonic() + run_timeout
        while (master_steps(run_dir, resumes=1, since=mark) < k and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.1)
        if proc.poll() is not None:  # it ended (failed) before the kill
            code, out = finish(proc, 10)
            cycles.append({"killed_at": None, "exit_code": code})
            outputs.append(out)
            break
        freeze_trainer(proc)  # no step after the one seen: the kill lands where it was aimed
        kill_everything(proc)
        outputs.append(proc.stdout.read())
        records = journal(run_dir)  # whole records only: what the next master goes on from
        cycles.append({"killed_at": master_steps(run_dir, resumes=1, since=mark),
                       "checkpoint": newest_checkpoint_step(run_dir),
                       "trainers_resumed": trainers_resumed(records[mark:])})
        mark = len(records)
        proc = up_process(config, "--resume")
    code, out = finish(proc, run_timeout)
    outputs.append(out)
    cycles.append({"exit_code": code, "trainers_resumed": trainers_resumed(journal(run_dir)[mark:])})
    text = "\n".join(outputs)
    report = {"cycles": cycles, "exit_code": code,
              "interrupted_at": [c.get("killed_at") for c in cycles[:-1]],
              "versions_not_found": len(NOT_FOUND.findall(text)) + sum(
                  bool(NOT_FOUND.search(json.dumps(e))) for e in log_events(run_dir)),
              "retrain_log": [e.get("detail") for e in log_events(run_dir)
                              if e.get("event") == "trainer.resume"]}
    if code != 0 or report["versions_not_found"]:
        report["output_tail"] = text[-3000:]
    return report


def newest_checkpoint_step(run_dir: Path) -> int | None:
    steps = []
    for path in (run_dir / "checkpoints").glob("step_*"):
        try:
            steps.append(json.loads((path / "trainer_state.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            continue
    return max(steps, default=None)


def log_events(run_dir: Path) -> list[dict[str, Any]]:
    from tandem.common.trace import read_logs

    return read_logs(run_dir)


def account(run_dir: Path, *, groups_per_step: int) -> dict[str, Any]:
    """What the final lineage trained, from the run dir alone."""
    conn = sqlite3.connect(f"file:{run_dir / 'buffer.sqlite'}?mode=ro", uri=True)
    try:
        groups = conn.execute("SELECT group_id, task_id, uses FROM groups").fetchall()
        uses = conn.execute("SELECT group_id, step FROM uses").fetchall()
    finally:
        conn.close()
    task_of = {g: t for g, t, _ in groups}
    per_task = Counter()
    for group_id, task_id, n in groups:
        if n:
            per_task[task_id] += n
    per_step = Counter(step for _, step in uses)
    counted = master_steps(run_dir)
    events = log_events(run_dir)
    saved = Counter(e.get("path") for e in events if e.get("event") == "checkpoint.saved")
    return {
        "learner_steps": newest_checkpoint_step(run_dir),
        "master_steps": counted,
        "groups_consumed": sum(per_task.values()),
        "tasks_trained_twice": sum(1 for n in per_task.values() if n > 1),
        "steps_with_wrong_group_count": sum(
            1 for s in range(counted) if per_step.get(s, 0) != groups_per_step),
        "uses_of_unknown_groups": sum(1 for g, _ in uses if g not in task_of),
        "checkpoints_overwritten": sum(n - 1 for n in saved.values() if n > 1) + sum(
            1 for e in events if e.get("event") == "checkpoint.superseded"),
        "consumption": dict(sorted(per_task.items())),
    }


def verdict(report: dict[str, Any], reference: dict[str, Any] | None) -> list[str]:
    """What is wrong with this scenario's outcome (empty: it passes)."""
    wrong = []
    steps = report["total_steps"]
    if report.get("first_ended_by_itself"):
        wrong.append(f"the first run ended (exit code {report['first_exit_code']}) before it "
                     f"could be interrupted at step {report['interrupted_at']}")
    if report["exit_code"] != 0:
        wrong.append(f"exit code {report['exit_code']}")
    if report.get("versions_not_found"):
        wrong.append(f"an explorer was told to load a version that was not on disk "
                     f"{report['versions_not_found']} times")
    if report["learner_steps"] != steps:
        wrong.append(f"learner holds {report['learner_steps']} of {steps} steps")
    if report["master_steps"] != steps:
        wrong.append(f"master counted {report['master_steps']} of {steps} steps")
    for key in ("tasks_trained_twice", "steps_with_wrong_group_count",
                "uses_of_unknown_groups", "checkpoints_overwritten"):
        if report[key]:
            wrong.append(f"{key}: {report[key]}")
    if reference is not None and report["consumption"] != reference["consumption"]:
        mine, theirs = report["consumption"], reference["consumption"]
        differ = sorted(t for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t))
        wrong.append(f"per-task consumption differs from uninterrupted on {len(differ)} tasks "
                     f"(e.g. {differ[:3]})")
    return wrong


def print_table(reports: list[dict[str, Any]]) -> None:
    cols = ("preset", "scenario", "interrupted_at", "checkpoint_at_stop", "learner_steps",
            "master_steps", "groups_consumed", "tasks_trained_twice", "stop_seconds",
            "resume_seconds", "seconds", "ok")
    rows = [[str(r.get(c, "-") if r.get(c) is not None else "-") for c in cols] for r in reports]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    for r in reports:
        if r["problems"]:
            print(f"{r['preset']}/{r['scenario']}: " + "; ".join(r["problems"]))


def check_preset(workdir: Path, model_dir: Path, preset: str, scenarios: list[str], *,
                 steps: int, stop_at: int, seed: int, log=print) -> list[dict[str, Any]]:
    reports = []
    reference = None
    for scenario in scenarios:
        log(f"{preset}/{scenario}: {steps} steps, interrupted at {stop_at}")
        report = run_scenario(workdir / f"{preset}-{scenario}", model_dir, preset, scenario,
                              steps=steps, stop_at=stop_at, seed=seed)
        report["problems"] = verdict(report, reference)
        report["ok"] = not report["problems"]
        if scenario == "uninterrupted":
            reference = report
        reports.append(report)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="synchronous",
                        choices=["synchronous", "fully_async", "both"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=None, help="default: steps // 2")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a model folder (default: a tiny Qwen2)")
    parser.add_argument("--out", default=".bench/resume_check.json")
    args = parser.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"--scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    stop_at = args.stop_at if args.stop_at is not None else args.steps // 2
    if not 0 < stop_at < args.steps:
        parser.error(f"--stop-at must be between 1 and steps - 1, got {stop_at}")
    presets = ["synchronous", "fully_async"] if args.preset == "both" else [args.preset]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a finished run may still be drawing its timeline into the run dir as this cleans up
    with tempfile.TemporaryDirectory(prefix="tandem-resume-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        model_dir = Path(args.model) if args.model else workdir / "tiny-model"
        if not args.model:
            from tandem.weights.tiny import build_tiny_model

            build_tiny_model(model_dir)
        reports = []
        for preset in presets:
            reports += check_preset(workdir, model_dir, preset, scenarios, steps=args.steps,
                                    stop_at=stop_at, seed=args.seed)
            out.write_text(json.dumps({"steps": args.steps, "stop_at": stop_at,
                                       "reports": reports}, indent=1))
    print_table(reports)
    print(f"wrote {out}")
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
