"""The `master` section: addresses, liveness, task leases, the taskset and the run's length."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from ..tasks import TASK_KEYS, task_id_key
from .base import Section


class TasksetFormat(Section):
    """How a row of your data becomes a task (docs/master.md#your-data): the columns that hold
    the prompt or the chat messages, the answer, the id and the reward's arguments. A task
    carries tandem's keys (`prompt` or `messages`, `system`, `answer`, `reward_args`, `id`),
    which the `single_turn` workflow reads by default."""

    name: str = Field(default="columns",
                      description="the format: columns (tandem's, these keys) or one a plugin "
                                  "registers (TASKSET_FORMATS)")
    prompt: str | None = Field(default=None, description="column holding the prompt text")
    messages: str | None = Field(
        default=None, description="column holding the chat messages: a list of {role, "
                                  "content} (or JSON text of one), not ending with the assistant")
    system: str | None = Field(default=None, description="system prompt of every task")
    system_column: str | None = Field(default=None,
                                      description="column holding each task's system prompt")
    images: str | None = Field(
        default=None, description="column holding the task's images: a path relative to the "
                                  "taskset's folder, bytes, a datasets/Parquet image cell, or a "
                                  "list of them (docs/vision.md)")
    answer: str | None = Field(default=None,
                               description="column holding the gold answer the reward checks")
    id: str | None = Field(default=None, description="column holding unique task ids; else the "
                                                     "row index (`id_field` is the same)")
    args: str | dict[str, str] | None = Field(
        default=None, description="the reward's per-task arguments: a column holding a mapping "
                                  "(or JSON text of one), or a mapping of argument to column")
    keep: list[str] = Field(default_factory=list,
                            description="more columns copied into the task as they are (for "
                                        "an environment or an agent)")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="settings of a plugin's format")

    @model_validator(mode="after")
    def _consistent(self) -> TasksetFormat:
        if self.prompt and self.messages:
            raise ValueError("prompt and messages are both set; a task has one or the other")
        if self.system is not None and self.system_column:
            raise ValueError("system and system_column are both set; set one")
        if self.name == "columns" and not (self.prompt or self.messages):
            raise ValueError("set prompt (the column of prompt text) or messages (the column "
                             "of chat messages)")
        taken = [c for c in self.keep if c in TASK_KEYS]
        if taken:
            raise ValueError(f"keep: {taken[0]!r} is a key tandem sets in a task "
                             f"({', '.join(TASK_KEYS)}); map it with its own key instead")
        return self


class TasksetConfig(Section):
    """Where tasks come from: JSONL, Parquet or CSV files, a `datasets` dataset saved to disk,
    a dataset by name, or a plugin's reader; and how each row becomes a task."""

    path: str = Field(default="", description="file, folder of files, saved dataset folder, or "
                                              "a dataset name (reader: hub)")
    split: str | None = Field(default=None, description="split of a DatasetDict")
    reader: str | None = Field(
        default=None, description="jsonl, parquet, csv, datasets (a save_to_disk folder), hub "
                                  "(datasets.load_dataset by name; owner/name:config) or a "
                                  "plugin's (TASKSET_READERS); null: by the file's suffix or "
                                  "the folder's contents")
    format: TasksetFormat | None = Field(
        default=None, description="the columns of your data that make a task; null: each row "
                                  "is a task as it is")
    shuffle: bool = Field(default=True, description="shuffle each epoch (seeded, reproducible)")
    seed: int = Field(default=0, description="shuffle seed; epoch k uses seed + k")
    epochs: int = Field(default=1, ge=1, description="passes over the taskset")
    id_field: str | None = Field(
        default=None, description="column holding unique task ids; else the row index (with "
                                  "a format: the same as format.id)")

    @model_validator(mode="after")
    def _one_id_column(self) -> TasksetConfig:
        if self.format is not None and self.id_field:
            if self.format.id not in (None, self.id_field):
                raise ValueError(f"id_field {self.id_field!r} and format.id "
                                 f"{self.format.id!r} name different columns; set one")
            self.format.id = self.id_field
        return self

    @property
    def id_key(self) -> str | None:
        """The key of a loaded task holding its id; None: the row index names it."""
        return task_id_key(self.format, self.id_field)


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
    journal_compact_bytes: int = Field(
        default=16 * 2**20, ge=0,
        description="bytes of records after which the master writes its state as a snapshot "
                    "that replaces the journal (bounds its size and replay time); 0: never")
    stop_grace: float = Field(default=2.0, ge=0,
                              description="seconds the master keeps serving after `Stop`, so "
                                          "every component hears it and `tandem status` works")
    final_checkpoint_wait: float = Field(
        default=300.0, gt=0,
        description="seconds after `Stop` the master waits for the trainer's checkpoint of "
                    "every step it counted (a trainer restarted meanwhile re-opens the run); "
                    "past it the master exits non-zero")
