"""The Slurm tier (`make test-slurm`, docs/deployment.md): tests marked `slurm` run a real
one-node cluster and several real runs, minutes of a 2-core machine, so `make test` skips them;
they run under `pytest -m slurm`, as root, where slurm-wlm and munge are installed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cluster import SlurmCluster, missing_tools


def pytest_collection_modifyitems(config, items):
    selected = "slurm" in (config.option.markexpr or "")
    missing = missing_tools()
    if not selected:
        reason = "the Slurm tier runs under `make test-slurm` (pytest -m slurm)"
    elif missing:
        reason = f"needs {', '.join(missing)}: `make slurm` (apt-get install slurm-wlm munge)"
    elif os.geteuid() != 0:
        reason = "the one-node Slurm cluster runs its daemons as root"
    else:
        return
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """munged + slurmctld + slurmd for this host, stopped (every job cancelled first) however
    the session ends."""
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def jobs(slurm_cluster):
    """Job ids a test submitted: any still queued or running at its end is cancelled and
    waited for, so a failed test leaves no step running into the next one."""
    submitted: list[int] = []
    yield submitted
    for job in submitted:
        if slurm_cluster.job(job).get("JobState") in slurm_cluster.ACTIVE:
            slurm_cluster.scancel(job)
            slurm_cluster.wait_job(job)
