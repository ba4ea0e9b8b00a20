"""The `eval` section: held-out tasksets an explorer evaluates between its steps."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section
from .explorer import SamplingConfig


class EvalTasksetConfig(Section):
    """One held-out taskset: the same formats as `master.taskset`."""

    name: str = Field(min_length=1, description="names its results (eval/<name>/... metrics)")
    path: str = Field(description="JSONL or Parquet file, folder of them, or saved dataset folder")
    split: str | None = Field(default=None, description="split of a saved DatasetDict")
    id_field: str | None = Field(default=None,
                                 description="column holding task ids; else row index")
    limit: int | None = Field(default=None, ge=1, description="evaluate only the first N rows")

    @model_validator(mode="after")
    def _name_is_a_path(self) -> EvalTasksetConfig:
        if any(ch.isspace() for ch in self.name) or "/" in self.name:
            raise ValueError(f"name {self.name!r}: no spaces or '/' (it is part of metric names)")
        return self


class EvalConfig(Section):
    """Evaluation during training (docs/explorer.md#evaluation-eval-section). One explorer
    (`explorer`) evaluates every taskset on the weights it holds: before its first step,
    whenever the version it holds has advanced `every` trainer steps since the last
    evaluation, and when the run ends. Results go to run_dir/eval.jsonl, the trace (an `eval`
    span), the trainer's trackers and `tandem up`'s panel."""

    tasksets: list[EvalTasksetConfig] = Field(
        default_factory=list, description="held-out tasksets; none: no evaluation")
    every: int = Field(default=0, ge=0,
                       description="trainer steps (weight versions) between evaluations; "
                                   "0: only before the first step and at the end")
    at_start: bool = Field(default=True, description="evaluate the weights the run starts from")
    at_end: bool = Field(default=True, description="evaluate the weights held when the run ends")
    modes: list[Literal["greedy", "sampled"]] = Field(
        default_factory=lambda: ["greedy", "sampled"], min_length=1,
        description="greedy: one answer per task at temperature 0; sampled: repeat_times "
                    "answers per task under `sampling`")
    repeat_times: int = Field(default=4, ge=1, description="sampled answers per task")
    k: list[int] = Field(default_factory=list,
                         description="pass@k values reported for sampled mode; default: "
                                     "1 and repeat_times")
    correct_at: float = Field(default=1.0,
                              description="a response counts as correct (accuracy, pass@k) "
                                          "when its reward is at least this")
    sampling: SamplingConfig | None = Field(
        default=None, description="sampled mode's policy; default: the evaluating explorer's "
                                  "sampling, with seed `seed`")
    seed: int = Field(default=0, description="sampling seed of sampled mode, the same at every "
                                             "evaluation so versions compare on equal terms")
    answer_key: str | None = Field(
        default=None, description="task field holding the gold answer that the reward needs; "
                                  "default: the explorer's workflow_args.answer_key "
                                  "(single_turn: answer)")
    explorer: str | None = Field(default=None,
                                 description="the explorer that evaluates; default: the first")
    final_wait: float = Field(
        default=60.0, ge=0,
        description="seconds the trainer waits at its close for the end-of-run evaluation, so "
                    "its trackers get it")

    @property
    def enabled(self) -> bool:
        return bool(self.tasksets)

    @property
    def pass_k(self) -> list[int]:
        return sorted(set(self.k or [1, self.repeat_times]))

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        names = [t.name for t in self.tasksets]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"eval.tasksets: names must be unique, {dup} repeat")
        big = [k for k in self.k if k < 1 or k > self.repeat_times]
        if big:
            raise ValueError(f"eval.k: {big} outside 1..eval.repeat_times ({self.repeat_times}); "
                             "raise eval.repeat_times or lower eval.k")
        return self
