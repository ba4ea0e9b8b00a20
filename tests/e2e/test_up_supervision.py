"""`tandem up` as a supervisor: a dead component fails the run or is restarted
(`up.restart: on-failure`), and no process is left behind. SIGTERM stopping everything is
checked in tests/e2e/test_prometheus.py, on the run that serves the metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from processes import freeze, wait_for
from tandem.common.messages import ExplorerStepDone, TrainerStepDone
from tandem.master.journal import JournalError, read_journal
from tandem.master.quickstart import reversal_tasks, write_jsonl
from backstop import BACKSTOP

pytestmark = pytest.mark.slow
TANDEM = str(Path(sys.executable).parent / "tandem")


def write_config(tmp_path: Path, model_dir: Path, steps: int, **up) -> Path:
    train, _ = reversal_tasks(0)
    config = {
        "run_dir": str(tmp_path / "run"), "model": {"path": str(model_dir)},
        "sync": {"preset": "fully_async", "timeout": BACKSTOP},
        "master": {"total_steps": steps, "taskset": {"path": str(
            write_jsonl(train[:64], tmp_path / "train.jsonl")), "epochs": 100}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-4},
        "reward": {"functions": {"k12": 1.0}},
        "transport": {"liveness": BACKSTOP},  # a component a test holds frozen is not dead
        "logging": {"level": "warning"},
        "up": {"run_timeout": BACKSTOP, "timeline": False, **up},
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




def trained_steps(run_dir: Path) -> int:
    trace = run_dir / "trace" / "trainer.jsonl"
    return trace.read_text().count('"kind":"train"') if trace.exists() else 0


def counted_steps(run_dir: Path) -> int:
    """Trainer steps the master journaled (written as it counts them; the trace is written
    in batches)."""
    try:
        records = read_journal(run_dir / "master" / "journal.bin")
    except (JournalError, OSError):
        return 0
    return len({r.step for r in records if isinstance(r, TrainerStepDone)})


def reported_batches(run_dir: Path) -> int:
    """Explorer batches the master journaled."""
    try:
        records = read_journal(run_dir / "master" / "journal.bin")
    except (JournalError, OSError):
        return 0
    return len({r.batch for r in records if isinstance(r, ExplorerStepDone)})


def component_pid(run_dir: Path, name: str) -> int | None:
    for pid in run_processes(run_dir):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # exited while we looked
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


def test_dead_component_is_reported_with_its_log_and_fails_the_run(tmp_path, tiny_model_dir):
    cfg = write_config(tmp_path, tiny_model_dir, steps=10_000)
    run_dir = tmp_path / "run"
    with tandem_up(cfg) as proc:
        # any moment of a run of 10000 steps: the run needs its explorer
        wait_for(lambda: counted_steps(run_dir) >= 1, BACKSTOP, "a trained step")
        os.kill(wait_for(lambda: component_pid(run_dir, "explorer"), BACKSTOP, "the explorer"),
                signal.SIGKILL)
        out, _ = proc.communicate(timeout=BACKSTOP)  # only against a hang, as above
        assert proc.returncode == 1
        assert "explorer-0 exited with code -9" in out and "last lines of" in out
        assert "up.kill" not in out, out[-3000:]
        assert not run_processes(run_dir)


def test_restart_on_failure_brings_a_killed_explorer_back_and_the_run_finishes(
        tmp_path, tiny_model_dir):
    steps = 12
    cfg = write_config(tmp_path, tiny_model_dir, steps=steps, restart="on-failure")
    run_dir = tmp_path / "run"
    with tandem_up(cfg) as proc:
        # The run is moved forward one side at a time, so it cannot end before the kill however
        # fast the machine: with the explorer frozen the trainer can train only the batches
        # that exist, and with the trainer frozen the explorer runs at most max_staleness
        # batches past the newest weights.
        explorer = wait_for(lambda: component_pid(run_dir, "explorer"), BACKSTOP, "the explorer")
        freeze(explorer)  # still starting up
        trainer = wait_for(lambda: component_pid(run_dir, "trainer"), BACKSTOP, "the trainer")
        freeze(trainer)
        try:
            os.kill(explorer, signal.SIGCONT)
            wait_for(lambda: reported_batches(run_dir) >= 1, BACKSTOP, "a rolled-out batch")
            freeze(explorer)
            os.kill(trainer, signal.SIGCONT)
            wait_for(lambda: counted_steps(run_dir) >= 1, BACKSTOP, "a trained step")
            freeze(trainer)
            # the trainer stands still with only the batches that exist: the run is not over
            assert counted_steps(run_dir) < steps - 1
            os.kill(explorer, signal.SIGKILL)
            wait_for(lambda: component_pid(run_dir, "explorer") not in (None, explorer), BACKSTOP,
                     "`tandem up` to start the explorer again")
        finally:
            os.kill(trainer, signal.SIGCONT)
        out, _ = proc.communicate(timeout=BACKSTOP)  # only against a hang, as above
        assert "restarting explorer-0 (1/3)" in out
        assert proc.returncode == 0, out[-3000:]
        assert trained_steps(run_dir) == steps
        assert not run_processes(run_dir)
