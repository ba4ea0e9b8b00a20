"""A trainer killed mid-run and restarted by `tandem up`, and a run stopped with SIGTERM and
continued with `--resume`, both end with the learner holding exactly the steps the master
counted, every task consumed once in the final lineage, and no checkpoint overwritten."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import resume_check  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 8


def component_pid(up_pid: int, name: str) -> int | None:
    for pid in resume_check.children_of(up_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"tandem-{name}" in cmd:
            return pid
    return None


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_trainer_restarted_by_up_resumes_from_its_checkpoint_and_retrains_once(
        tmp_path, tiny_model_dir):
    config = resume_check.write_config(tmp_path, tiny_model_dir, preset="fully_async",
                                       steps=STEPS, seed=0, run_timeout=200)
    data = yaml.safe_load(config.read_text())
    data["trainer"]["checkpoint_every"] = 3
    data["up"].update({"restart": "on-failure", "max_restarts": 2})
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    proc = resume_check.up_process(config)
    try:
        wait_for(lambda: resume_check.master_steps(run_dir) >= 4, 150, "four counted steps")
        os.kill(wait_for(lambda: component_pid(proc.pid, "trainer"), 5, "the trainer"),
                signal.SIGKILL)
        killed_at = resume_check.master_steps(run_dir)
        checkpoint = resume_check.newest_checkpoint_step(run_dir)
        code, out = resume_check.finish(proc, 200)
    finally:
        if proc.poll() is None:
            resume_check.kill_everything(proc)
    assert "restarting trainer (1/2)" in out
    assert code == 0, out[-3000:]
    report = resume_check.account(run_dir, groups_per_step=2)
    assert report["learner_steps"] == report["master_steps"] == STEPS, report
    assert report["groups_consumed"] == STEPS * 2
    assert report["tasks_trained_twice"] == 0 and report["steps_with_wrong_group_count"] == 0
    assert report["uses_of_unknown_groups"] == 0 and report["checkpoints_overwritten"] == 0
    resumes = [e for e in resume_check.log_events(run_dir) if e.get("event") == "trainer.resume"]
    assert [e["step"] for e in resumes] == [0, checkpoint], resumes
    restarted = resumes[-1]
    assert restarted["master_counted"] >= killed_at > checkpoint
    assert restarted["detail"] == (
        f"resumed from checkpoint {run_dir / 'checkpoints' / f'step_{checkpoint:08d}'}; master "
        f"had counted {restarted['master_counted']}; retraining {checkpoint}.."
        f"{restarted['master_counted'] - 1}")
    assert not any(e.get("event") == "trainer.step_mismatch"
                   for e in resume_check.log_events(run_dir))


def test_sigterm_then_resume_finishes_every_step_without_waiting_for_stale_leases(
        tmp_path, tiny_model_dir):
    """The short resume check of `make test`: default settings, so the only checkpoint is the
    one the trainer writes when it is stopped."""
    steps = 30  # while the explorers stop, the trainer trains what the buffer holds: not 30
    report = resume_check.run_scenario(tmp_path, tiny_model_dir, "fully_async", "sigterm",
                                       steps=steps, stop_at=3, seed=0, run_timeout=240)
    assert resume_check.verdict(report, None) == [], report
    # the stop was not a loss: the trainer checkpointed every step the master had counted
    assert report["checkpoint_at_stop"] is not None
    assert steps > report["checkpoint_at_stop"] >= report["interrupted_at"]
    assert report["retrain_log"][-1].startswith("resumed from checkpoint")
    assert report["retrain_log"][-1].endswith(
        f"the master counted the same {report['checkpoint_at_stop']} steps")
    # no wait for the stopped trainer's lease (buffer.lease_seconds: 120 s)
    assert report["resume_seconds"] < 100, report
