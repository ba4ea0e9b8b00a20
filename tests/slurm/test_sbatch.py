"""`tandem deploy slurm` on a real (one-node) Slurm cluster: the rendered script of
examples/fully_async.yaml runs to its end under `sbatch`, and a job `scancel`ed mid-run and
submitted again finishes with every step trained once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

import resume_check
from cluster import SlurmCluster
from tandem.common.sockets import free_port
from processes import descendants, freeze, thread_states
from tandem.common.trace import JsonlTail
from backstop import BACKSTOP

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(900)]
TANDEM = str(Path(sys.executable).parent / "tandem")
GROUPS_PER_STEP = 2
STEPS = 8  # of the runs that are stopped and resumed


def render(tmp_path: Path, model_dir: Path, steps: int) -> tuple[Path, Path]:
    """The example as a user renders it, from the repository (its taskset path is relative),
    made small for two cores; on free ports, so that it cannot meet another run on this host."""
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    sets = [f"master.total_steps={steps}", f"model.path={model_dir}",
            "explorers.0.batch_size=2", "explorers.0.repeat_times=2",
            f"trainer.groups_per_step={GROUPS_PER_STEP}", "logging.level=info",
            "transport.liveness=300",  # a component the test holds still is not a dead one
            f"sync.timeout={BACKSTOP:g}",  # nor is one waiting for it stuck
            f"master.address=tcp://localhost:{free_port()}",
            f"master.publish_address=tcp://localhost:{free_port()}",
            f"buffer.address=tcp://localhost:{free_port()}",
            f"reward.address=tcp://localhost:{free_port()}"]
    done = subprocess.run(
        [TANDEM, "deploy", "slurm", "examples/fully_async.yaml", "--single-node",
         "--run-dir", str(run_dir), "-o", str(script), "--time", "00:20:00",
         *[arg for s in sets for arg in ("--set", s)]],
        cwd=REPO, capture_output=True, text=True, timeout=BACKSTOP)
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


def job_output(tmp_path: Path, job: int | str) -> str:
    """The tail of the batch script's own output and its components' stderr."""
    path = tmp_path / f"job-{job}.out"
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def diagnosis(tmp_path: Path, job: int, run_dir: Path | None = None) -> str:
    """What a failed wait reports: the job's output and every component's last log lines."""
    parts = [f"--- job {job} output ---\n{job_output(tmp_path, job)}"]
    for log in sorted((run_dir / "logs").glob("*.jsonl")) if run_dir is not None else ():
        lines = log.read_text(errors="replace").splitlines()[-15:]
        parts.append(f"--- {log.name} ---\n" + "\n".join(line[:300] for line in lines))
    return "\n".join(parts)


def wait_for(predicate, timeout: float, what: str, cluster: SlurmCluster, job: int, *,
             held: set[int] = frozenset(), tmp_path: Path | None = None,
             run_dir: Path | None = None):
    """`predicate()`'s first true value while the job runs. A job that began to stop while
    the test holds one of its components still (SIGTERM waits in it) waits for that step to
    the end of the script's grace (315 s), and a held component never moves the run on: that
    is a failure now, not a wait into pytest's timeout, and like every failure here it reports
    the job's output and logs."""
    def fail(why: str):
        context = "" if tmp_path is None else "\n" + diagnosis(tmp_path, job, run_dir)
        raise AssertionError(f"{why} while waiting for {what}{context}")

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        state = cluster.job(job).get("JobState")
        if state not in ("PENDING", "CONFIGURING", "RUNNING"):
            fail(f"job {job} is {state}")
        stopping = sorted(pid for pid in held if sigterm_pending(pid))
        if stopping:
            fail(f"job {job} began to stop (SIGTERM waits in the held {stopping})")
        time.sleep(0.1)
    fail(f"timed out after {timeout:g}s")


def component(name: str) -> int | None:
    """The pid of the run's `name` process (below slurmd, so below this test): the topmost
    one, not a worker it forked (the explorer's reward pool shares its command line)."""
    found = {pid for pid, cmd in descendants().items()
             if any(Path(w).name == f"tandem-{name}" for w in cmd.split()[:2])}
    for pid in found:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent not in found:
            return pid
    return None


def test_rendered_example_runs_to_its_end(slurm_cluster, jobs, tiny_model_dir, tmp_path):
    steps = 4
    script, run_dir = render(tmp_path, tiny_model_dir, steps)
    job = submit(slurm_cluster, script, tmp_path, jobs)
    record = slurm_cluster.wait_job(job)
    out = job_output(tmp_path, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (record, out)
    report = resume_check.account(run_dir, groups_per_step=GROUPS_PER_STEP)
    assert report["learner_steps"] == report["master_steps"] == steps, report
    assert report["tasks_trained_twice"] == 0 and report["steps_with_wrong_group_count"] == 0
    assert (run_dir / "run.yaml").exists()


def sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits to be handled by `pid` (held still, it cannot be yet)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = [int(line.split()[1], 16) for line in status.splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in masks)


def stopped_at_step_two(cluster: SlurmCluster, jobs: list[int], model_dir: Path, tmp_path: Path,
                        stop) -> tuple[Path, Path, int, dict[str, str]]:
    """Submit a run of 8 steps and stop it with `stop(job)` at step 2, whatever the machine's
    speed: the explorer is held still (SIGSTOP) from its start-up and the trainer once it
    started; the explorer rolls out two batches, the trainer trains them, and with both held
    the job is stopped. Both are let go only once the SIGTERM waits in each, so it is the first
    thing each does: neither can move the run on, and two steps are far below its 8. The
    script, the run dir, the steps counted when stopped and the job's final record."""
    script, run_dir = render(tmp_path, model_dir, STEPS)
    trainer_log = run_dir / "logs" / "trainer.jsonl"
    job = submit(cluster, script, tmp_path, jobs)
    held: set[int] = set()

    def until(predicate, what: str):
        return wait_for(predicate, BACKSTOP, what, cluster, job, held=held, tmp_path=tmp_path,
                        run_dir=run_dir)

    try:
        explorer = until(lambda: component("explorer"), "the explorer")
        freeze(explorer)
        held.add(explorer)
        trainer = until(lambda: component("trainer"), "the trainer")
        until(lambda: any(e.get("event") == "trainer.started"
                          for e in JsonlTail().new_objects(trainer_log)), "the trainer's start")
        freeze(trainer)
        held.add(trainer)
        # bound by Slurm to the CPUs of its step: each may use every CPU of the node
        node_cpus = len(os.sched_getaffinity(0))
        assert [len(os.sched_getaffinity(pid)) for pid in (explorer, trainer)] == [node_cpus] * 2
        os.kill(explorer, signal.SIGCONT)
        until(lambda: resume_check.batches_done(run_dir) >= 2, "two batches")
        freeze(explorer)
        os.kill(trainer, signal.SIGCONT)
        until(lambda: resume_check.master_steps(run_dir) == resume_check.batches_done(run_dir),
              "the trainer to train every batch")
        freeze(trainer)
        counted = resume_check.master_steps(run_dir)
        stop(job)
        # a plain scancel thaws them itself (SIGCONT, then SIGTERM)
        deadline = time.monotonic() + BACKSTOP
        while not all(sigterm_pending(pid) or not {"t", "T"} & set(thread_states(pid))
                      for pid in held):
            assert time.monotonic() < deadline, "SIGTERM did not reach the held components"
            time.sleep(0.05)
    finally:
        for pid in held:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return script, run_dir, counted, cluster.wait_job(job)


def resumed_to_the_end(cluster: SlurmCluster, jobs: list[int], script: Path, run_dir: Path,
                       tmp_path: Path) -> None:
    """The same script submitted again completes the run with every step trained once."""
    again = submit(cluster, script, tmp_path, jobs)
    record = cluster.wait_job(again)
    out = job_output(tmp_path, again)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", (record, out)
    report = {"total_steps": STEPS, "exit_code": 0,
              **resume_check.account(run_dir, groups_per_step=GROUPS_PER_STEP)}
    assert resume_check.verdict(report, None) == [], report


def test_stopped_job_resubmitted_finishes_every_step_once(slurm_cluster, jobs, tiny_model_dir,
                                                          tmp_path):
    """`scancel --batch --signal=TERM`, the clean stop the script documents: the script stops
    the explorer and the trainer while the master still answers, then the rest, nothing is
    SIGKILLed, the trainer checkpoints the steps the master counted, and the run resumes there
    without retraining any."""
    script, run_dir, counted, record = stopped_at_step_two(
        slurm_cluster, jobs, tiny_model_dir, tmp_path,
        lambda job: slurm_cluster.scancel(job, "--batch", "--signal=TERM"))
    out = job_output(tmp_path, record["JobId"])
    assert record["ExitCode"] == "130:0", (record, out)  # stopped, as `tandem up` says it
    counted_at_stop = resume_check.master_steps(run_dir)
    assert 2 <= counted <= counted_at_stop < STEPS, (counted, counted_at_stop, out)
    assert resume_check.newest_checkpoint_step(run_dir) == counted_at_stop, out
    assert "forcing job termination" not in out and "Killed" not in out, out
    resumed_to_the_end(slurm_cluster, jobs, script, run_dir, tmp_path)
    resumed = [e.get("detail") for e in resume_check.log_events(run_dir)
               if e.get("event") == "trainer.resume"]
    assert resumed[-1] == (
        f"resumed from checkpoint {run_dir / 'checkpoints' / f'step_{counted_at_stop:08d}'}; "
        f"the master counted the same {counted_at_stop} steps"), resumed


def test_cancelled_job_resubmitted_finishes_every_step_once(slurm_cluster, jobs, tiny_model_dir,
                                                            tmp_path):
    """A plain `scancel`: Slurm SIGTERMs every process of the job, srun included, and an srun
    SIGKILLs its tasks when it gets one, so whether the trainer's checkpoint on stop is written
    depends on which lands first. Either way the resumed run trains every step exactly once,
    from the newest checkpoint there is (or from model.path)."""
    script, run_dir, counted, record = stopped_at_step_two(
        slurm_cluster, jobs, tiny_model_dir, tmp_path, slurm_cluster.scancel)
    out = job_output(tmp_path, record["JobId"])
    assert record["JobState"] == "CANCELLED", (record, out)
    counted_at_stop = resume_check.master_steps(run_dir)
    assert 2 <= counted <= counted_at_stop < STEPS, (counted, counted_at_stop, out)
    assert (resume_check.newest_checkpoint_step(run_dir) or 0) <= counted_at_stop
    resumed_to_the_end(slurm_cluster, jobs, script, run_dir, tmp_path)


def test_a_step_that_fails_while_the_explorer_is_held_fails_the_wait(
        slurm_cluster, jobs, tiny_model_dir, tmp_path, monkeypatch):
    """The master cannot bind its port (a listener holds it), so its step fails and the script
    stops the job's other steps while the test holds the explorer still. Held, the explorer
    cannot end, so the script waits for it to the end of its grace: the test's wait fails at
    once with the master's own error instead of waiting with none (before the grace, until
    pytest's timeout)."""
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    port, free = holder.getsockname()[1], free_port
    taken = iter([port])  # render()'s first port is the master's
    monkeypatch.setitem(globals(), "free_port", lambda: next(taken, None) or free())
    with holder, pytest.raises(AssertionError) as failed:
        stopped_at_step_two(slurm_cluster, jobs, tiny_model_dir, tmp_path, lambda job: None)
    message = str(failed.value)
    assert "began to stop" in message or "is FAILED" in message, message
    assert f"tandem-master: cannot bind tcp://0.0.0.0:{port}" in message, message
