"""`tandem deploy slurm`: the sbatch script parses (bash -n), has one srun step per component
on the right node, and runs as a job script against stand-in `scontrol`/`srun` commands: every
step started with host-name addresses, a failing step stops the others and fails the job."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tandem.common.config import RunConfig, validate
from tandem.master.cli import tandem
from tandem.master.deploy import SlurmOptions, render_slurm

from deploy_config import CLIENT_SECRET, SERVER_SECRET, run_config
from backstop import BACKSTOP

HOSTS = ["node-a", "node-b", "node-c", "node-d"]


def render(options: SlurmOptions | None = None, **sections) -> str:
    config = validate(RunConfig, run_config(**sections))
    return render_slurm(config, options or SlurmOptions(run_dir="/shared/run"))


def component(call: str) -> str:
    """The tandem program a recorded srun call runs (the trainer's, under tandem-torchrun)."""
    return next(word for word in call.split()
                if word.startswith("tandem-") and word != "tandem-torchrun")


def srun_lines(script: str) -> list[str]:
    lines = script.splitlines()
    return [f"{line[:-2]} {lines[i + 1].strip()}" for i, line in enumerate(lines)
            if line.startswith("srun ")]


def test_script_is_valid_bash(tmp_path):
    path = tmp_path / "run.sbatch"
    path.write_text(render())
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=BACKSTOP)
    assert check.returncode == 0, check.stderr


def test_one_srun_step_per_component():
    script = render()
    assert "#SBATCH --nodes=4" in script
    steps = srun_lines(script)
    assert len(steps) == 6
    master, buffer, reward, trainer, e0, e1 = steps
    assert '--nodelist="$CTRL"' in master and "tandem-master" in master
    assert "master.address=tcp://0.0.0.0:5550" in master
    assert "tandem-buffer" in buffer and "tandem-reward" in reward
    assert "torchrun --nnodes=1" in trainer and "--rdzv-backend=c10d" in trainer
    assert "--no-python tandem-trainer" in trainer and "--resume" in trainer
    assert "--name explorer-0" in e0 and '"${EXPLORER_HOSTS[0]}"' in e0
    assert "--name explorer-1" in e1 and '"${EXPLORER_HOSTS[1]}"' in e1
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    # whole nodes, and each step all of its node's CPUs (a step's default is one CPU)
    assert "#SBATCH --exclusive" in script and "#SBATCH --mem=0" in script
    assert all('--cpus-per-task="$SLURM_CPUS_ON_NODE"' in s for s in steps)


def test_secrets_never_in_the_script():
    script = render()
    assert SERVER_SECRET not in script and CLIENT_SECRET not in script
    assert "${env:TANDEM_CURVE_SERVER_SECRET}" in script


def test_explorers_share_nodes_round_robin():
    script = render(SlurmOptions(run_dir="/r", explorer_nodes=1, trainer_nodes=2,
                                 gpus_per_node=4))
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=4" in script
    trainer = next(s for s in srun_lines(script) if "torchrun" in s)
    assert "--nodes=2" in trainer and "--nproc-per-node=4" in trainer
    explorers = [s for s in srun_lines(script) if "tandem-explorer" in s]
    assert all('"${EXPLORER_HOSTS[0]}"' in s for s in explorers)


FAKE_SCANCEL = """#!/bin/bash
# stands in for `scancel --signal=SIG JOB[.STEP]`: SIG to the tasks of that step, or of
# every step still running (a step's id is its stand-in srun's pid)
echo "$*" >> "$SRUN_LOG.scancel"
sig="${1#--signal=}"
target="${@: -1}"
while read -r pid name; do
  if [[ "$target" != *.* || "$target" == *".$pid" ]]; then kill -"$sig" "$pid" 2>/dev/null; fi
done < "$SRUN_LOG.steps"
exit 0
"""

FAKE_SQUEUE = """#!/bin/bash
# stands in for `squeue --steps --format "%i %j"`: the steps still running, by name
while read -r pid name; do
  if kill -0 "$pid" 2>/dev/null; then echo "$SLURM_JOB_ID.$pid $name"; fi
done < "$SRUN_LOG.steps"
"""

FAKE_SRUN = """#!/bin/bash
# stands in for srun: records the node and the command, then plays the component
node=""
name=""
while [[ "$1" == --* ]]; do
  case "$1" in --nodelist=*) node="${1#--nodelist=}";; --job-name=*) name="${1#--job-name=}";; esac
  shift
done
# a SIGTERM here stands for one that reaches the step's tasks (a real srun would SIGKILL
# them instead: the job must signal steps through scancel); recorded once
trap 'trap "" TERM; echo "TERM $*" >> "$SRUN_LOG"; kill $! 2>/dev/null; exit 143' TERM
echo "$$ $name" >> "$SRUN_LOG.steps"
echo "$node $*" >> "$SRUN_LOG"
if [[ "$*" == *"$FAIL_ON"* ]]; then sleep 0.5; exit 3; fi
# a component stuck in its stop: SIGTERM does nothing, only SIGKILL ends it
if [[ "$*" == *"$STUCK"* ]]; then trap '' TERM; exec sleep 600; fi
# a server (buffer, reward service) serves until it is told to stop
if [[ "$*" == *tandem-buffer* || "$*" == *tandem-reward* ]]; then sleep "$SERVE_SECONDS" & wait $!; fi
sleep "$STEP_SECONDS" & wait $!
"""


def job_env(tmp_path: Path, fail_on: str = "never", step_seconds: float = 0.2,
            serve_seconds: float = 600, stuck: str = "never") -> dict[str, str]:
    """The job's environment, with stand-ins for Slurm's commands first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(HOSTS) + "\n")
    for tool, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("squeue", FAKE_SQUEUE)):
        (bin_dir / tool).write_text(text)
    for tool in ("scontrol", "srun", "scancel", "squeue"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "srun.log.steps").touch()
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SRUN_LOG": str(tmp_path / "srun.log"), "SLURM_JOB_NODELIST": "node-[a-d]",
            "SLURM_JOB_ID": "77", "SLURM_CPUS_ON_NODE": "8", "FAIL_ON": fail_on,
            "STEP_SECONDS": str(step_seconds), "SERVE_SECONDS": str(serve_seconds),
            "STUCK": stuck,
            "TANDEM_CURVE_SERVER_SECRET": "s", "TANDEM_CURVE_CLIENT_SECRET": "c"}


def srun_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "srun.log"
    return log.read_text().splitlines() if log.exists() else []


def run_job(tmp_path: Path, script: str, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    job = tmp_path / "run.sbatch"
    job.write_text(script)
    done = subprocess.run(["bash", str(job)], env=job_env(tmp_path, **env), capture_output=True,
                          text=True, timeout=BACKSTOP, cwd=tmp_path)
    return done, srun_calls(tmp_path)


def test_a_stop_stops_workers_first_then_the_rest_through_slurm(tmp_path):
    """`scancel --batch --signal=TERM` (or the time limit) reaches the script alone: it stops
    the explorers and the trainer, waits for them, then the master and the servers, as
    `tandem up` does, each step through scancel (never by signalling srun), and exits 130."""
    job = tmp_path / "run.sbatch"
    job.write_text(render(SlurmOptions(run_dir=str(tmp_path / "run"))))
    proc = subprocess.Popen(["bash", str(job)], env=job_env(tmp_path, step_seconds=600),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + BACKSTOP
        while len(srun_calls(tmp_path)) < 6:  # every step started
            assert time.monotonic() < deadline, srun_calls(tmp_path)
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=BACKSTOP)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    stopped = [component(c) for c in srun_calls(tmp_path) if c.startswith("TERM")]
    assert sorted(stopped[:3]) == ["tandem-explorer", "tandem-explorer", "tandem-trainer"]
    assert sorted(stopped[3:]) == ["tandem-buffer", "tandem-master", "tandem-reward"]
    scancels = (tmp_path / "srun.log.scancel").read_text().splitlines()
    assert all(line.startswith("--signal=TERM 77.") for line in scancels[:3]), scancels
    assert scancels[3:] == ["--signal=TERM 77"]


def test_job_starts_every_step_wired_by_host_name(tmp_path):
    done, calls = run_job(tmp_path, render(SlurmOptions(run_dir=str(tmp_path / "run"))))
    assert done.returncode == 0, done.stderr
    by_command = {component(c): c for c in calls if not c.startswith("TERM ")}
    assert by_command["tandem-master"].startswith("node-a ")
    assert by_command["tandem-buffer"].startswith("node-a ")
    assert by_command["tandem-trainer"].startswith("node-b ")
    assert "--rdzv-endpoint=node-b:29500" in by_command["tandem-trainer"]
    explorers = sorted(c for c in calls if "tandem-explorer" in c)
    assert [c.split()[0] for c in explorers] == ["node-c", "node-d"]
    for call in explorers:
        assert "master.address=tcp://node-a:5550" in call
        assert "buffer.address=tcp://node-a:5560" in call
        assert "weights.fetch_address=tcp://node-b:5580" in call
        assert "run_dir=/tmp/tandem-77/" in call or "tandem-77/" in call
    config = validate(RunConfig, __import__("yaml").safe_load(
        (tmp_path / "run" / "run.yaml").read_text()) | {"transport": {}})
    assert config.run_dir == str(tmp_path / "run")


def test_a_failing_step_stops_the_others_and_fails_the_job(tmp_path):
    script = render(SlurmOptions(run_dir=str(tmp_path / "run")))
    done, calls = run_job(tmp_path, script, fail_on="tandem-buffer", step_seconds=20)
    assert done.returncode == 1
    stopped = sorted(component(c) for c in calls if c.startswith("TERM"))
    # every other step got SIGTERM (and the job did not wait out their 20 s)
    assert stopped == ["tandem-explorer", "tandem-explorer", "tandem-master", "tandem-reward",
                       "tandem-trainer"]


def test_a_step_stuck_in_its_stop_is_killed_after_the_grace(tmp_path):
    """The buffer fails, so the job stops the rest; the trainer ignores its SIGTERM (stuck in
    its stop). The script waits for it at most its grace, the longest stop the config allows
    (the trainer's, an explorer's drain) plus srun's teardown, then SIGKILLs what still runs
    through Slurm and fails the job, instead of waiting for the time limit."""
    script = render(SlurmOptions(run_dir=str(tmp_path / "run")),
                    up={"stop_timeout": 0.5, "trainer_stop_timeout": 0.5},
                    explorers=[{"name": "explorer-0", "batch_size": 4, "drain_seconds": 0.5}])
    assert "GRACE=16" in script  # ceil(0.5) + 15
    done, calls = run_job(tmp_path, script, fail_on="tandem-buffer", step_seconds=600,
                          stuck="tandem-trainer")
    assert done.returncode == 1, done.stderr
    assert "tandem: steps still running 16s after SIGTERM: SIGKILL" in done.stderr
    stopped = sorted(component(c) for c in calls if c.startswith("TERM"))
    assert stopped == ["tandem-explorer", "tandem-master", "tandem-reward"]  # not the stuck one
    scancels = (tmp_path / "srun.log.scancel").read_text().splitlines()
    assert scancels == ["--signal=TERM 77", "--signal=KILL 77"], scancels


def test_job_ends_with_the_run_and_stops_the_servers(tmp_path):
    """The buffer and the reward service serve until told: once the master, the trainer and
    the explorers have ended, the job stops them and completes (it used to wait for them)."""
    script = render(SlurmOptions(run_dir=str(tmp_path / "run")))
    done, calls = run_job(tmp_path, script)
    assert done.returncode == 0, done.stderr
    stopped = sorted(component(c) for c in calls if c.startswith("TERM"))
    assert stopped == ["tandem-buffer", "tandem-reward"]
    # through Slurm, never by signalling srun (which would SIGKILL them)
    assert (tmp_path / "srun.log.scancel").read_text() == "--signal=TERM 77\n"


def test_single_node_places_every_step_on_the_one_node(tmp_path):
    script = render(SlurmOptions(run_dir=str(tmp_path / "run"), single_node=True))
    assert "#SBATCH --nodes=1" in script
    done, calls = run_job(tmp_path, script)
    assert done.returncode == 0, done.stderr
    assert {c.split()[0] for c in calls if not c.startswith("TERM ")} == {"node-a"}
    assert all("--overlap" in s for s in srun_lines(script))
    trainer = next(c for c in calls if component(c) == "tandem-trainer")
    assert "--rdzv-endpoint=node-a:29500" in trainer


def test_job_runs_where_it_was_rendered_with_that_tandem(tmp_path):
    script = render(SlurmOptions(run_dir="/r", workdir="/shared/work", bin_dir="/opt/venv/bin"))
    assert "#SBATCH --chdir=/shared/work" in script
    assert 'export PATH=/opt/venv/bin:"$PATH"' in script


def test_job_refuses_to_start_without_the_secret(tmp_path):
    script = render(SlurmOptions(run_dir=str(tmp_path / "run")))
    job = tmp_path / "run.sbatch"
    job.write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_CURVE")}
    done = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True,
                          timeout=BACKSTOP)
    assert done.returncode != 0
    assert "export TANDEM_CURVE_SERVER_SECRET" in done.stderr


def test_cli_writes_the_script(tmp_path, write_config):
    out = tmp_path / "job.sbatch"
    result = CliRunner().invoke(tandem, ["deploy", "slurm", str(write_config()), "-o", str(out),
                                         "--run-dir", "/shared/r", "--partition", "gpu"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH --partition=gpu" in out.read_text()
    assert os.access(out, os.X_OK)


def test_cli_single_node_refuses_node_counts(tmp_path, write_config):
    result = CliRunner().invoke(tandem, ["deploy", "slurm", str(write_config()), "--single-node",
                                         "--trainer-nodes=2"])
    assert result.exit_code == 2
    assert "--single-node runs every component on one node" in result.output


@pytest.mark.parametrize("flag", ["--trainer-nodes=0", "--explorer-nodes=0"])
def test_cli_rejects_bad_node_counts(tmp_path, write_config, flag):
    result = CliRunner().invoke(tandem, ["deploy", "slurm", str(write_config()), flag])
    assert result.exit_code == 2
    assert "must be at least 1" in result.output
