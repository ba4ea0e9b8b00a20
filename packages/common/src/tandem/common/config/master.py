"""The `master` section: addresses, liveness, task leases, the taskset and the run's length."""

from __future__ import annotations

from pydantic import Field

from .base import Section


class TasksetConfig(Section):
    """Where tasks come from: JSONL or Parquet files, or a `datasets` dataset saved to disk."""

    path: str = Field(default="", description="file, folder of files, or saved dataset folder")
    split: str | None = Field(default=None, description="split of a saved DatasetDict")
    shuffle: bool = Field(default=True, description="shuffle each epoch (seeded, reproducible)")
    seed: int = Field(default=0, description="shuffle seed; epoch k uses seed + k")
    epochs: int = Field(default=1, ge=1, description="passes over the taskset")
    id_field: str | None = Field(default=None, description="column holding task ids; else row index")


class MasterConfig(Section):
    """The run's clock: registry, task dispatch, barriers."""

    address: str = Field(default="tcp://127.0.0.1:5550", description="RPC (ROUTER) address")
    publish_address: str = Field(default="tcp://127.0.0.1:5551", description="PUB address")
    task_lease_seconds: float = Field(default=300.0, gt=0, description="before a lease is reassigned")
    taskset: TasksetConfig = Field(default_factory=TasksetConfig)
    total_steps: int | None = Field(
        default=None, ge=1,
        description="sync-plan steps (= trainer steps) in the run; default: as many as the "
                    "taskset fills, epochs x tasks // tasks per step")
    journal: str = Field(default="master/journal.bin",
                         description="the run journal (the messages that changed the run), "
                                     "relative to the run dir")
    stop_grace: float = Field(default=2.0, ge=0,
                              description="seconds the master keeps serving after `Stop`, so "
                                          "every component hears it and `tandem status` works")
