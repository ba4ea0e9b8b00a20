"""`tandem deploy slurm` on a real (one-node) Slurm cluster: the rendered script of
examples/fully_async.yaml runs to its end under `sbatch`, and a job `scancel`ed mid-run and
submitted again finishes with every step trained once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import resume_check
from cluster import SlurmCluster, free_port
from processes import descendants, freeze
from tandem.common.messages import ExplorerStepDone
from tandem.common.trace import JsonlTail
from tandem.master.journal import JournalError, read_journal

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]
TANDEM = str(Path(sys.executable).parent / "tandem")
GROUPS_PER_STEP = 2


def render(tmp_path: Path, model_dir: Path, steps: int) -> tuple[Path, Path]:
    """The example as a user renders it, from the repository (its taskset path is relative),
    made small for two cores; on free ports, so that it cannot meet another run on this host."""
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    sets = [f"master.total_steps={steps}", f"model.path={model_dir}",
            "explorers.0.batch_size=2", "explorers.0.repeat_times=2",
            f"trainer.groups_per_step={GROUPS_PER_STEP}", "logging.level=info",
            "transport.liveness=300",  # a component the test holds still is not a dead one
            f"master.address=tcp://localhost:{free_port()}",
            f"master.publish_address=tcp://localhost:{free_port()}",
            f"buffer.address=tcp://localhost:{free_port()}",
            f"reward.address=tcp://localhost:{free_port()}"]
    done = subprocess.run(
        [TANDEM, "deploy", "slurm", "examples/fully_async.yaml", "--single-node",
         "--run-dir", str(run_dir), "-o", str(script), "--time", "00:20:00",
         *[arg for s in sets for arg in ("--set", s)]],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return script, run_dir


def submit(cluster: SlurmCluster, script: Path, tmp_path: Path, jobs: list[int]) -> int:
    """sbatch from a folder other than the one rendered in: the job still runs there (its
    `#SBATCH --chdir`), so the example's relative taskset path is found; its output is kept
    out of the repository."""
    elsewhere = tmp_path / "submit"
    elsewhere.mkdir(exist_ok=True)
    jobs.append(cluster.sbatch(script, cwd=elsewhere, output=tmp_path / "job-%j.out"))
    return jobs[-1]


def job_output(tmp_path: Path, job: int) -> str:
    """The tail of the batch script's own output and its components' stderr."""
    path = tmp_path / f"job-{job}.out"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def journal(run_dir: Path) -> list:
    try:
        return read_journal(run_dir / "master" / "journal.bin")
    except (JournalError, OSError):
        return []


def batches_done(run_dir: Path) -> int:
    return len({r.batch for r in journal(run_dir) if isinstance(r, ExplorerStepDone)})


def wait_for(predicate, timeout: float, what: str, cluster: SlurmCluster, job: int):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        state = cluster.job(job).get("JobState")
        if state not in ("PENDING", "CONFIGURING", "RUNNING"):
            raise AssertionError(f"job {job} is {state} while waiting for {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def component(name: str) -> int | None:
    """The pid of the run's `name` process (below slurmd, so below this test)."""
    for pid, cmd in descendants().items():
        words = cmd.split()
        if (any(Path(w).name == f"tandem-{name}" for w in words[:2])
                and "torchrun" not in cmd):
            return pid
    return None


def test_rendered_example_runs_to_its_end(slurm_cluster, jobs, tiny_model_dir, tmp_path):
    steps = 4
    script, run_dir = render(tmp_path, tiny_model_dir, steps)
    job = submit(slurm_cluster, script, tmp_path, jobs)
    record = slurm_cluster.wait_job(job, timeout=600)
    out = job_output(tmp_path, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (record, out)
    report = resume_check.account(run_dir, groups_per_step=GROUPS_PER_STEP)
    assert report["learner_steps"] == report["master_steps"] == steps, report
    assert report["tasks_trained_twice"] == 0 and report["steps_with_wrong_group_count"] == 0
    assert (run_dir / "run.yaml").exists()


def test_cancelled_job_resubmitted_finishes_every_step_once(slurm_cluster, jobs,
                                                            tiny_model_dir, tmp_path):
    """The cancel lands where the test chooses, whatever the machine's speed: the explorer is
    held still (SIGSTOP) from its start-up and the trainer once it started; the explorer rolls
    out two batches, the trainer trains them, and with both held `scancel` stops the job
    (Slurm sends SIGCONT, then SIGTERM). Held, neither can move the run on before its SIGTERM,
    and the two steps trained are far below the run's 8."""
    steps = 8
    script, run_dir = render(tmp_path, tiny_model_dir, steps)
    trainer_log = run_dir / "logs" / "trainer.jsonl"
    job = submit(slurm_cluster, script, tmp_path, jobs)
    held: set[int] = set()
    try:
        explorer = wait_for(lambda: component("explorer"), 300, "the explorer", slurm_cluster,
                            job)
        freeze(explorer)
        held.add(explorer)
        trainer = wait_for(lambda: component("trainer"), 300, "the trainer", slurm_cluster, job)
        wait_for(lambda: any(e.get("event") == "trainer.started"
                             for e in JsonlTail().new_objects(trainer_log)),
                 300, "the trainer's start", slurm_cluster, job)
        freeze(trainer)
        held.add(trainer)
        os.kill(explorer, signal.SIGCONT)
        wait_for(lambda: batches_done(run_dir) >= 2, 300, "two batches", slurm_cluster, job)
        freeze(explorer)
        os.kill(trainer, signal.SIGCONT)
        wait_for(lambda: resume_check.master_steps(run_dir) == batches_done(run_dir), 300,
                 "the trainer to train every batch", slurm_cluster, job)
        freeze(trainer)
        interrupted_at = resume_check.master_steps(run_dir)
        slurm_cluster.scancel(job)
        held.clear()  # Slurm's own SIGCONT thaws them
        record = slurm_cluster.wait_job(job, timeout=120)
    finally:
        for pid in held:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    first_out = job_output(tmp_path, job)
    assert record["JobState"] == "CANCELLED", (record, first_out)
    counted_at_stop = resume_check.master_steps(run_dir)
    assert 2 <= interrupted_at <= counted_at_stop < steps, (interrupted_at, counted_at_stop)
    # stopped by SIGTERM within Slurm's KillWait, the trainer checkpointed what was counted
    assert resume_check.newest_checkpoint_step(run_dir) == counted_at_stop

    again = submit(slurm_cluster, script, tmp_path, jobs)  # the same script: it resumes
    record = slurm_cluster.wait_job(again, timeout=600)
    out = job_output(tmp_path, again)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (record, out)
    report = {"total_steps": steps, "exit_code": 0,
              **resume_check.account(run_dir, groups_per_step=GROUPS_PER_STEP)}
    assert resume_check.verdict(report, None) == [], report
    resumed = [e.get("detail") for e in resume_check.log_events(run_dir)
               if e.get("event") == "trainer.resume"]
    assert resumed[-1] == (
        f"resumed from checkpoint {run_dir / 'checkpoints' / f'step_{counted_at_stop:08d}'}; "
        f"the master counted the same {counted_at_stop} steps"), resumed
