"""`tandem deploy k8s|slurm CONFIG`: render a run for Kubernetes or Slurm; runs nothing.

Exit codes as every tandem CLI: 0 written, 2 a bad config or option (one line naming it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

PROG = "tandem deploy"


def _config(config_path: str, overrides: tuple[str, ...]):
    from tandem.common.cli import load_config_or_exit

    return load_config_or_exit(PROG, config_path, overrides)


def _usage(exc: Exception) -> None:
    from tandem.common.cli import EXIT_USAGE, fail

    sys.exit(fail(PROG, exc, EXIT_USAGE))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def deploy() -> None:
    """Render a run for a cluster engine: Kubernetes manifests or a Slurm sbatch script."""


@deploy.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False),
              help="folder to write the kustomize base into")
@click.option("--image", required=True, help="container image with tandem installed")
@click.option("--name", help="prefix of every object's name (default: the run's name)")
@click.option("--namespace", help="Kubernetes namespace (kustomize sets it on every object)")
@click.option("--storage-class", help="storage class of the run's volume claims")
@click.option("--storage-size", default="20Gi", show_default=True, help="size of each claim")
@click.option("--trainer-nodes", type=int, default=1, show_default=True,
              help="trainer pods (torchrun nodes)")
@click.option("--gpus-per-node", type=int, default=0, show_default=True,
              help="GPUs per trainer pod (torchrun processes per pod; 0 = one CPU process)")
@click.option("--explorer-gpus", type=int, default=0, show_default=True,
              help="GPUs per explorer pod")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config value before rendering (repeatable)")
def k8s(config_path: str, out: str, image: str, name: str | None, namespace: str | None,
        storage_class: str | None, storage_size: str, trainer_nodes: int, gpus_per_node: int,
        explorer_gpus: int, overrides: tuple[str, ...]) -> None:
    """Write a kustomize base for the run in CONFIG (apply with `kubectl apply -k DIR`)."""
    from tandem.common.errors import TandemError

    from .k8s import K8sOptions, write_k8s

    config = _config(config_path, overrides)
    options = K8sOptions(image=image, name=name, namespace=namespace,
                         storage_class=storage_class, storage_size=storage_size,
                         trainer_nodes=trainer_nodes, gpus_per_node=gpus_per_node,
                         explorer_gpus=explorer_gpus)
    try:
        written = write_k8s(config, options, out)
    except (TandemError, ValueError) as exc:
        _usage(exc)
    click.echo(f"wrote {len(written)} files to {Path(out)}")


@deploy.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False),
              help="script file to write (default: print it)")
@click.option("--run-dir", help="run_dir on the cluster's shared filesystem (default: the "
                                "config's, made absolute)")
@click.option("--trainer-nodes", type=int, default=1, show_default=True)
@click.option("--gpus-per-node", type=int, default=0, show_default=True,
              help="GPUs per node (torchrun processes per trainer node)")
@click.option("--explorer-nodes", type=int, help="nodes the explorers share (default: one each)")
@click.option("--bin-dir", help="folder of tandem-* and torchrun on the nodes (default: this "
                                "tandem's, which must then be on the shared filesystem)")
@click.option("--single-node", is_flag=True,
              help="run every component on one node (a small run, or a one-node cluster)")
@click.option("--time", "time_limit", default="24:00:00", show_default=True,
              help="sbatch --time")
@click.option("--partition", help="sbatch --partition")
@click.option("--account", help="sbatch --account")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config value before rendering (repeatable)")
def slurm(config_path: str, out: str | None, run_dir: str | None, trainer_nodes: int,
          gpus_per_node: int, explorer_nodes: int | None, bin_dir: str | None,
          single_node: bool, time_limit: str,
          partition: str | None, account: str | None, overrides: tuple[str, ...]) -> None:
    """Write an sbatch script that runs the run in CONFIG as srun steps of one allocation.

    The job runs in the current folder: relative paths in CONFIG are read from there."""
    from tandem.common.errors import TandemError

    from .slurm import SlurmOptions, render_slurm

    config = _config(config_path, overrides)
    options = SlurmOptions(run_dir=run_dir, trainer_nodes=trainer_nodes,
                           gpus_per_node=gpus_per_node, explorer_nodes=explorer_nodes,
                           bin_dir=bin_dir, single_node=single_node, time=time_limit,
                           partition=partition, account=account)
    try:
        script = render_slurm(config, options)
    except (TandemError, ValueError) as exc:
        _usage(exc)
    if out is None:
        click.echo(script, nl=False)
        return
    Path(out).write_text(script)
    Path(out).chmod(0o755)
    click.echo(f"wrote {out}")
