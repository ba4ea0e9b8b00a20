"""A run dir means one run (issue 32 item 6): `tandem up` and the component CLIs on the run dir
of one short finished run, each case decided before any component starts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.common.messages.master import RunAmended, RunStarted
from tandem.master.journal import read_journal
from tandem.master.quickstart import reversal_tasks, write_jsonl
from backstop import BACKSTOP

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def tandem_up(config: Path, *args: str, timeout: float = BACKSTOP) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "tandem"), "up", str(config), "--plain", *args],
                          capture_output=True, text=True, timeout=timeout)


def what_ran(run_dir: Path) -> dict[str, int]:
    """The journal's and every log's size: a component that started would grow one."""
    files = [run_dir / "master" / "journal.bin", *sorted((run_dir / "logs").iterdir())]
    return {str(f): f.stat().st_size for f in files}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """(config, run dir) of a finished 3-step fully_async run."""
    tmp = tmp_path_factory.mktemp("reuse")
    train, _ = reversal_tasks(0)
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(tmp / "run"), "model": {"path": str(tiny_model_dir)},
        "sync": {"preset": "fully_async", "timeout": BACKSTOP},
        "master": {"total_steps": 3, "taskset": {
            "path": str(write_jsonl(train[:64], tmp / "train.jsonl")), "epochs": 100}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-4},
        "reward": {"functions": {"k12": 1.0}},
        "logging": {"level": "warning"},
        "up": {"run_timeout": BACKSTOP, "timeline": False},
    }))
    out = tandem_up(config)
    assert out.returncode == 0, out.stdout + out.stderr
    return config, tmp / "run"


def test_the_same_config_again_says_finished_and_starts_nothing(finished_run):
    config, run_dir = finished_run
    before = what_ran(run_dir)
    out = tandem_up(config, "--set", "logging.level=info")  # not a difference
    assert out.returncode == 0, out.stderr
    head = read_journal(run_dir / "master" / "journal.bin")[0]
    assert isinstance(head, RunStarted) and head.config["trainer"]["lr"] == 1e-4
    assert out.stdout.strip().splitlines()[0].startswith(
        f"tandem up: run {head.run_id} in {run_dir} is finished (3 of 3 trainer steps)")
    assert "result" not in out.stdout  # no run, no summary
    assert what_ran(run_dir) == before


def test_a_changed_config_is_exit_2_naming_each_key_and_the_ways_out(finished_run):
    config, run_dir = finished_run
    before = what_ran(run_dir)
    out = tandem_up(config, "--set", "trainer.lr=1e-5")
    assert out.returncode == 2 and out.stdout == ""
    line = out.stderr.strip()
    assert "\n" not in line and line.startswith(f"tandem up: run_dir {run_dir} holds run ")
    assert "trainer.lr 0.0001 (run) -> 1e-05 (given)" in line
    assert "a new run_dir" in line and "--resume" in line and "master.total_steps" in line
    assert what_ran(run_dir) == before


@pytest.mark.parametrize("resume", [(), ("--resume",)])
def test_a_shorter_run_is_one_clear_line_not_a_replay_error(finished_run, resume):
    config, run_dir = finished_run
    before = what_ran(run_dir)
    out = tandem_up(config, "--set", "master.total_steps=2", *resume)
    assert out.returncode == 2
    line = out.stderr.strip()
    assert "\n" not in line and "master.total_steps 3 (run) -> 2 (given)" in line
    assert "replay" not in line and "journal" not in line
    if resume:
        assert "may only go up on resume" in line
    assert what_ran(run_dir) == before


def test_a_longer_run_needs_resume(finished_run):
    config, _ = finished_run
    out = tandem_up(config, "--set", "master.total_steps=5")
    assert out.returncode == 2
    assert "master.total_steps 3 (run) -> 5 (given)" in out.stderr and "--resume" in out.stderr


def test_every_component_cli_checks_the_run_dir(finished_run):
    _, run_dir = finished_run
    given = run_dir / "config.yaml"  # what tandem up gave its children
    for exe, extra in (("tandem-master", ()), ("tandem-buffer", ()), ("tandem-trainer", ()),
                       ("tandem-explorer", ("--name", "explorer-0"))):
        refused = subprocess.run([str(BIN / exe), "--config", str(given), *extra,
                                  "--set", "seed=7"], capture_output=True, text=True,
                                 timeout=BACKSTOP)
        assert refused.returncode == 2, (exe, refused.stderr)
        assert refused.stderr.startswith(f"{exe}: run_dir {run_dir} holds run ")
        assert "seed 0 (run) -> 7 (given)" in refused.stderr
        done = subprocess.run([str(BIN / exe), "--config", str(given), *extra],
                              capture_output=True, text=True, timeout=BACKSTOP)
        assert done.returncode == 0 and "is finished (3 of 3" in done.stdout, (exe, done.stderr)


def test_resume_with_a_longer_run_continues_and_records_it(finished_run, tmp_path):
    config, run_dir = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("locks"))
    moved = ("--set", f"run_dir={copy}")
    out = tandem_up(config, *moved, "--resume", "--set", "master.total_steps=5")
    assert out.returncode == 0, out.stdout + out.stderr
    head = read_journal(copy / "master" / "journal.bin")[0]
    assert out.stdout.splitlines()[0] == (
        f"tandem up: continuing run {head.run_id} in {copy} at step 3 of 5 "
        "(master.total_steps 3 (run) -> 5 (given))")
    records = read_journal(copy / "master" / "journal.bin")
    assert [r.total_steps for r in records if isinstance(r, RunAmended)] == [5]
    # the run is now a 5-step run: that config again is finished, the old one is refused
    again = tandem_up(config, *moved, "--set", "master.total_steps=5")
    assert again.returncode == 0 and "is finished (5 of 5" in again.stdout
    old = tandem_up(config, *moved)
    assert old.returncode == 2 and "master.total_steps 5 (run) -> 3 (given)" in old.stderr
