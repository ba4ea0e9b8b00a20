"""The `master` section: addresses, liveness, task leases and the taskset."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class TasksetConfig(Section):
    """Where tasks come from: JSONL or Parquet files, or a `datasets` dataset saved to disk."""

    path: str = Field(default="", description="file, folder of files, or saved dataset folder")
    split: str | None = Field(default=None, description="split of a saved DatasetDict")
    shuffle: bool = True
    seed: int = 0
    epochs: int = Field(default=1, ge=1)
    id_field: str | None = Field(default=None, description="column holding task ids; else row index")


class MasterConfig(Section):
    """The run's clock: registry, task dispatch, barriers."""

    address: str = Field(default="tcp://127.0.0.1:5550", description="RPC (ROUTER) address")
    publish_address: str = Field(default="tcp://127.0.0.1:5551", description="PUB address")
    task_lease_seconds: float = Field(default=300.0, gt=0, description="before a lease is reassigned")
    taskset: TasksetConfig = Field(default_factory=TasksetConfig)
    total_steps: int | None = Field(default=None, ge=1, description="explorer steps in the run")
