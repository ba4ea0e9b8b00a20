"""Placing a run beyond one machine on an existing engine: Kubernetes manifests, a Slurm script."""

from .k8s import K8sOptions, render_k8s, write_k8s
from .slurm import SlurmOptions, render_slurm

__all__ = ["K8sOptions", "SlurmOptions", "render_k8s", "render_slurm", "write_k8s"]
