"""`tandem deploy slurm`: one sbatch script that runs a whole run inside one allocation.

Node 0 of the allocation runs the master, the buffer and (when `reward.service`) the reward
service; the next `trainer_nodes` nodes run the trainer under torchrun (c10d rendezvous on the
first of them, so no node needs its rank); the remaining nodes run the explorers, round-robin.
With `single_node` every component runs on node 0 (a small run, or a one-node test cluster).
Each component is its own `srun` step (`--overlap`: steps share the job's nodes), so Slurm
accounts, signals and kills each one; addresses are wired by host name from `scontrol show
hostnames`, passed as `--set` overrides, and every server binds all interfaces of its own node.
The job takes its nodes whole (`--exclusive`, `--mem=0`) and every step may use all of its
node's CPUs (`--cpus-per-task=$SLURM_CPUS_ON_NODE`): a step's default is one CPU, to which a
cluster with task/affinity or task/cgroup binds it, trainer and explorer alike.
The job runs in the folder it was rendered in (`--chdir`), so the config's relative paths
(model, taskset) mean what they mean to `tandem up` there, and with the rendering environment's
`bin` first on PATH (`bin_dir`), so every node runs the tandem that rendered it (the same path on
a shared filesystem) whether or not a venv is activated in the submitting shell.

The run config is written into the script verbatim (a quoted here-document: nothing in it is
expanded), with Curve secret keys replaced by `${env:...}` references that the components read
from the environment sbatch passes on: the script refuses to start without them. The run is
over when the master, the trainer and the explorers have ended (the master ends them): the
script then stops the servers that serve until told (buffer, reward service) with SIGTERM, as
`tandem up` does. When one step fails the script stops the others and exits with status 1.

The script signals steps through Slurm (`scancel --signal=TERM`, by step name from `squeue`),
never by signalling an srun: srun turns a SIGTERM it receives into a SIGKILL of its tasks
("forcing job termination"), so nothing could stop cleanly. A stop reaches the script alone
(`scancel --batch --signal=TERM JOBID`, or `--signal=B:TERM@120` before the time limit) and it
stops the run in `tandem up`'s order: the explorers and the trainer first, while the master
still answers (the trainer checkpoints the steps it counted; signalled at once, an explorer
waited 90 s for a master already gone and the trainer skipped its checkpoint), then the rest.
A plain `scancel` SIGTERMs every process, the sruns too, so every step is SIGKILLed at once;
submitting the same script again continues the run either way.
"""

from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem.common.plugins import outside_tandem
from tandem.common.config import RunConfig

from .common import (CURVE_SECRET_ENV, TORCHRUN_PORT, bind_overrides, component_config,
                     reward_service, server_ports)


@dataclass(frozen=True)
class SlurmOptions:
    """What the run config does not say about the cluster."""

    run_dir: str | None = None
    trainer_nodes: int = 1
    gpus_per_node: int = 0
    explorer_nodes: int | None = None
    time: str = "24:00:00"
    partition: str | None = None
    account: str | None = None
    local_dir: str = "${TMPDIR:-/tmp}"
    single_node: bool = False
    workdir: str | None = None
    bin_dir: str | None = None


def render_slurm(config: RunConfig, options: SlurmOptions) -> str:
    """The sbatch script's text."""
    if options.trainer_nodes < 1:
        raise ValueError("--trainer-nodes must be at least 1")
    explorer_nodes = (len(config.explorers) if options.explorer_nodes is None
                      else options.explorer_nodes)
    if explorer_nodes < 1:
        raise ValueError("--explorer-nodes must be at least 1")
    explorer_nodes = min(explorer_nodes, len(config.explorers))
    if options.single_node and (options.trainer_nodes > 1 or options.explorer_nodes):
        raise ValueError("--single-node runs every component on one node: drop "
                         "--trainer-nodes and --explorer-nodes")
    nodes = 1 if options.single_node else 1 + options.trainer_nodes + explorer_nodes
    workdir = options.workdir or str(Path.cwd())
    bin_dir = options.bin_dir or str(Path(sys.executable).parent)
    run_dir = options.run_dir or str(Path(config.run_dir).absolute())
    fetch = config.weights.transport == "fetch"
    ports = server_ports(config)
    q = shlex.quote

    data = component_config(config, run_dir=run_dir, hosts={
        "master": "localhost", "buffer": "localhost", "reward": "localhost",
        "trainer": "localhost"})
    config_text = yaml.safe_dump(data, sort_keys=False)
    marker = "TANDEM_RUN_CONFIG"
    while marker in config_text:
        marker += "_"

    head = ["#!/bin/bash", f"#SBATCH --job-name={config.name}", f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --mem=0",
            f"#SBATCH --time={options.time}",
            "#SBATCH --signal=B:TERM@120",
            f"#SBATCH --chdir={workdir}",
            "#SBATCH --output=tandem-%x-%j.out"]
    if options.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={options.gpus_per_node}")
    if options.partition:
        head.append(f"#SBATCH --partition={options.partition}")
    if options.account:
        head.append(f"#SBATCH --account={options.account}")
    # the longest a stop may take: the trainer's exit checkpoint, an explorer's drain (as
    # `tandem up` bounds them), and srun's own teardown
    grace = math.ceil(max(config.up.stop_timeout, config.up.trainer_stop_timeout,
                          *(e.drain_seconds for e in config.explorers))) + 15
    lines = head + [
        "# Rendered by `tandem deploy slurm`: submit with `sbatch THIS_FILE`. Stop the run",
        "# cleanly with `scancel --batch --signal=TERM JOBID` (a plain scancel SIGKILLs it). To",
        "# continue a stopped run (scancel, the time limit, a failed node), submit this file",
        "# again: the master and the buffer continue from RUN_DIR, the trainer (always",
        "# `--resume`) from its newest checkpoint.",
        "set -euo pipefail",
        "# tandem-*, torchrun: the environment that rendered this script",
        f'export PATH={q(bin_dir)}:"$PATH"', ""]
    needed = outside_tandem(config.plugins)
    if needed:
        lines += ["# Every node's Python environment must also hold what the run's plugins need",
                  "# (docs/extending.md):"] + [f"#   {item}" for item in needed] + [""]
    if config.transport.curve is not None:
        for env in CURVE_SECRET_ENV.values():
            lines.append(f': "${{{env}:?export {env} (the Curve secret key) before sbatch}}"')
        lines.append("")
    lines += [
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"if (( ${{#HOSTS[@]}} < {nodes} )); then",
        f'  echo "tandem: the allocation has ${{#HOSTS[@]}} nodes, this run needs {nodes}" >&2',
        "  exit 2", "fi",
        'CTRL="${HOSTS[0]}"']
    if options.single_node:
        lines += ['TRAINER_HOSTS=("$CTRL")', 'EXPLORER_HOSTS=("$CTRL")']
        explorer_nodes = 1
    else:
        lines += [
            f'TRAINER_HOSTS=("${{HOSTS[@]:1:{options.trainer_nodes}}}")',
            f'EXPLORER_HOSTS=("${{HOSTS[@]:{1 + options.trainer_nodes}:{explorer_nodes}}}")']
    lines += [
        f"RUN_DIR={q(run_dir)}",
        'mkdir -p "$RUN_DIR"',
        'CONFIG="$RUN_DIR/run.yaml"',
        f"cat > \"$CONFIG\" <<'{marker}'",
        config_text.rstrip("\n"),
        marker, "",
        "# every client reaches the servers by host name",
        "CLIENT=(",
        f'  --set "master.address=tcp://$CTRL:{ports["master"]}"',
        f'  --set "master.publish_address=tcp://$CTRL:{ports["master-pub"]}"',
        f'  --set "buffer.address=tcp://$CTRL:{ports["buffer"]}"',
        f'  --set "reward.address=tcp://$CTRL:{ports["reward"]}"',
        '  --set "weights.rendezvous_host=${TRAINER_HOSTS[0]}"',
        f'  --set "weights.fetch_address=tcp://${{TRAINER_HOSTS[0]}}:{ports["fetch"]}"',
        ")", "",
        "PIDS=()     # every step",
        "RUN=()      # the steps that end by themselves when the run is over",
        "WORKERS=()  # the trainer and the explorers",
        "# SIGTERM through Slurm to every step that still runs (`stop`), or to the steps of",
        "# these names (`stop_steps NAME...`): an srun that is sent SIGTERM SIGKILLs its tasks",
        'stop() { scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true; }',
        "stop_steps() {",
        "  local id name",
        "  while read -r id name; do",
        '    if [[ " $* " == *" $name "* ]]; then scancel --signal=TERM "$id" 2>/dev/null || true; fi',
        '  done < <(squeue --noheader --steps --jobs "$SLURM_JOB_ID" --format "%i %j" 2>/dev/null)',
        "}",
        "# wait for these steps, for at most GRACE s: a step still running then (a component",
        "# stuck in its stop) is SIGKILLed through Slurm, so no stop waits for ever",
        f"GRACE={grace}",
        "drain() {",
        "  local deadline=$((SECONDS + GRACE)) pid alive",
        "  while :; do",
        "    alive=0",
        '    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done',
        "    if (( ! alive || SECONDS >= deadline )); then break; fi",
        "    sleep 1",
        "  done",
        "  if (( alive )); then",
        '    echo "tandem: steps still running ${GRACE}s after SIGTERM: SIGKILL" >&2',
        '    scancel --signal=KILL "$SLURM_JOB_ID" 2>/dev/null || true',
        "  fi",
        '  wait "$@" 2>/dev/null || true',
        "}",
        "# scancel --batch --signal=TERM, or the time limit near (the stop itself is below: a",
        "# `wait` inside a trap that interrupted `wait -n` never returns)",
        "stopping=0",
        "trap 'stopping=1' TERM INT", ""]

    def step(role: str, comment: str, srun: str, argv: list[str]) -> None:
        pids = {"buffer": 'PIDS+=("$!")', "reward": 'PIDS+=("$!")',
                "master": 'PIDS+=("$!"); RUN+=("$!")'}.get(
                    role, 'PIDS+=("$!"); RUN+=("$!"); WORKERS+=("$!")')
        srun = srun.replace("srun ", f"srun --job-name=tandem-{role} ", 1)
        lines.extend([f"# {comment}", f"{srun} \\", "  " + " ".join(argv) + " &", pids, ""])

    cpus = '--cpus-per-task="$SLURM_CPUS_ON_NODE"'
    one = f'srun --nodes=1 --ntasks=1 {cpus} --overlap --kill-on-bad-exit=1'
    step("master", "master", f'{one} --nodelist="$CTRL"',
         ["tandem-master", '--config "$CONFIG"', '"${CLIENT[@]}"',
          *[f"--set {q(s)}" for s in bind_overrides(config, "master")]])
    step("buffer", "buffer", f'{one} --nodelist="$CTRL"',
         ["tandem-buffer", '--config "$CONFIG"', '"${CLIENT[@]}"',
          *[f"--set {q(s)}" for s in bind_overrides(config, "buffer")]])
    if reward_service(config):
        step("reward", "reward service", f'{one} --nodelist="$CTRL"',
             ["tandem-reward", '--config "$CONFIG"', '"${CLIENT[@]}"',
              *[f"--set {q(s)}" for s in bind_overrides(config, "reward")]])
    per_node = max(options.gpus_per_node, 1)
    trainer_argv = ["tandem-torchrun", f"--nnodes={options.trainer_nodes}",
                    f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
                    f'--rdzv-endpoint="${{TRAINER_HOSTS[0]}}:{TORCHRUN_PORT}"',
                    '--rdzv-id="$SLURM_JOB_ID"', "--no-python",
                    "tandem-trainer", '--config "$CONFIG"', "--resume", '"${CLIENT[@]}"',
                    *[f"--set {q(s)}" for s in bind_overrides(config, "trainer")]]
    if options.gpus_per_node:
        trainer_argv.append("--set trainer.device=cuda")
    step("trainer", "trainer: torchrun on every trainer node",
         f'srun --nodes={options.trainer_nodes} --ntasks-per-node=1 {cpus} --overlap '
         '--kill-on-bad-exit=1 '
         '--nodelist="$(IFS=,; echo "${TRAINER_HOSTS[*]}")"', trainer_argv)
    for k, explorer in enumerate(config.explorers):
        argv = ["tandem-explorer", '--config "$CONFIG"', f"--name {q(explorer.name)}",
                '"${CLIENT[@]}"']
        if fetch:
            # nothing shared: the explorer keeps its weights on its own node
            argv.append(f'--set "run_dir={options.local_dir}/tandem-$SLURM_JOB_ID/'
                        f'{explorer.name}"')
        step("explorer", f"explorer {explorer.name}",
             f'{one} --nodelist="${{EXPLORER_HOSTS[{k % explorer_nodes}]}}"', argv)
    lines += [
        "# the first step that fails stops the rest; once the master, the trainer and the",
        "# explorers have ended, the servers are stopped (`wait -n`: bash 4.3 or newer)",
        "while (( ! stopping )); do",
        "  code=0; wait -n || code=$?",
        "  if (( stopping )); then break; fi",
        "  if (( code != 0 )); then stop; drain \"${PIDS[@]}\"; exit 1; fi",
        "  running=0",
        "  for pid in \"${RUN[@]}\"; do kill -0 \"$pid\" 2>/dev/null && running=1; done",
        "  if (( ! running )); then stop; drain \"${PIDS[@]}\"; exit 0; fi",
        "done",
        "# stopped: as `tandem up` does, the explorers and the trainer while the master still",
        "# answers (the trainer checkpoints what the master counted), then the rest",
        "stop_steps tandem-explorer tandem-trainer",
        'drain "${WORKERS[@]}"',
        'stop; drain "${PIDS[@]}"; exit 130', ""]
    return "\n".join(lines)
