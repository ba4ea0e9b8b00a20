"""`tandem up` as a supervisor: SIGTERM stops everything, a dead component fails the run or is
restarted (`up.restart: on-failure`), and no process is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from tandem.master.quickstart import reversal_tasks, write_jsonl

pytestmark = pytest.mark.slow
TANDEM = str(Path(sys.executable).parent / "tandem")


def write_config(tmp_path: Path, model_dir: Path, steps: int, **up) -> Path:
    train, _ = reversal_tasks(0)
    config = {
        "run_dir": str(tmp_path / "run"), "model": {"path": str(model_dir)},
        "sync": {"preset": "fully_async", "timeout": 60},
        "master": {"total_steps": steps, "taskset": {"path": str(
            write_jsonl(train[:64], tmp_path / "train.jsonl")), "epochs": 100}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-4},
        "reward": {"functions": {"k12": 1.0}},
        "logging": {"level": "warning"},
        "up": {"run_timeout": 120, "timeline": False, **up},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_processes(run_dir: Path) -> list[int]:
    """Processes whose command line mentions this run's config."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(run_dir) in cmd and "tandem-" in cmd:
                found.append(int(entry.name))
    return found


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def trained_steps(run_dir: Path) -> int:
    trace = run_dir / "trace" / "trainer.jsonl"
    return trace.read_text().count('"kind":"train"') if trace.exists() else 0


def component_pid(run_dir: Path, name: str) -> int | None:
    for pid in run_processes(run_dir):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        if f"tandem-{name}" in cmd:
            return pid
    return None


@contextmanager
def tandem_up(config: Path):
    """`tandem up CONFIG --plain` as a process, killed on the way out if still running."""
    proc = subprocess.Popen([TANDEM, "up", str(config), "--plain"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_stops_every_process_within_seconds(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path, tiny_model_dir, steps=10_000)
    run_dir = tmp_path / "run"
    with tandem_up(cfg) as proc:
        wait_for(lambda: trained_steps(run_dir) >= 1, 90, "a trained step")
        assert len(run_processes(run_dir)) == 4
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        assert time.monotonic() - start < 10
        assert code != 0  # the run did not finish its steps
        wait_for(lambda: not run_processes(run_dir), 5, "every component to exit")


def test_dead_component_is_reported_with_its_log_and_fails_the_run(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path, tiny_model_dir, steps=10_000)
    run_dir = tmp_path / "run"
    with tandem_up(cfg) as proc:
        wait_for(lambda: trained_steps(run_dir) >= 1, 90, "a trained step")
        os.kill(wait_for(lambda: component_pid(run_dir, "explorer"), 5, "the explorer"),
                signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 1
        assert "explorer-0 exited with code -9" in out and "last lines of" in out
        wait_for(lambda: not run_processes(run_dir), 5, "every component to exit")


def test_restart_on_failure_brings_a_killed_explorer_back_and_the_run_finishes(
        tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path, tiny_model_dir, steps=12, restart="on-failure")
    run_dir = tmp_path / "run"
    with tandem_up(cfg) as proc:
        wait_for(lambda: trained_steps(run_dir) >= 1, 90, "a trained step")
        os.kill(wait_for(lambda: component_pid(run_dir, "explorer"), 5, "the explorer"),
                signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
        assert "restarting explorer-0 (1/3)" in out
        assert proc.returncode == 0, out[-3000:]
        assert trained_steps(run_dir) == 12
        wait_for(lambda: not run_processes(run_dir), 5, "every component to exit")
