"""Evaluation: the `eval` tasksets rolled out on the weights an engine holds, scored by the
run's reward, summarised as mean reward, accuracy and pass@k, one row per taskset.

The rollout is the explorer's own workflow (`Workflow.run`) with the eval sampling: greedy
(temperature 0, one answer per task) and/or sampled (`eval.repeat_times` answers per task, a
fixed seed so every version is scored on the same random stream). Nothing is put into the
buffer. `Evaluator.evaluate` is called by an explorer between its steps; `tandem eval` (this
module's `main`) runs it once on a saved model.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from tandem.common.config import EvalConfig, RunConfig
from tandem.common.messages.experience import Task
from tandem.common.tasks import load_tasks

from .engine import Engine
from .rewards import RewardScorer
from .sampling import SamplingParams
from .workflows import RolloutContext, Workflow


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k answers drawn without replacement from n, c of them
    correct, is correct: 1 - C(n-c, k) / C(n, k) (the unbiased estimator of pass@k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarise(rewards: Sequence[Sequence[float]], *, correct_at: float,
              ks: Sequence[int] = ()) -> dict[str, float]:
    """Metrics of one mode from each task's rewards: reward_mean, accuracy (share of answers
    with reward >= correct_at) and pass@k averaged over tasks, for each k <= answers per task."""
    answers = [r for task in rewards for r in task]
    out = {"reward_mean": sum(answers) / len(answers),
           "accuracy": sum(r >= correct_at for r in answers) / len(answers)}
    n = min(len(task) for task in rewards)
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = sum(pass_at_k(len(task), sum(r >= correct_at for r in task), k)
                                   for task in rewards) / len(rewards)
    return out


@dataclass
class EvalTaskset:
    name: str
    tasks: list[Task]


class Evaluator:
    """The run's `eval` section bound to one explorer's workflow, sampling and reward."""

    def __init__(self, config: RunConfig, explorer: str):
        self.cfg: EvalConfig = config.eval
        self.explorer = explorer
        self.path = Path(config.run_dir) / "eval.jsonl"
        base = self.cfg.sampling or config.explorer(explorer).sampling
        self.modes: dict[str, tuple[SamplingParams, int]] = {}
        if "greedy" in self.cfg.modes:
            self.modes["greedy"] = (SamplingParams.from_config(base, temperature=0.0,
                                                               seed=self.cfg.seed), 1)
        if "sampled" in self.cfg.modes:
            self.modes["sampled"] = (SamplingParams.from_config(base, seed=self.cfg.seed),
                                     self.cfg.repeat_times)
        self.tasksets = [self._load(i) for i in range(len(self.cfg.tasksets))]
        self.last_version: int | None = None  # the newest version evaluated
        self.last_rows: list[dict[str, Any]] = []

    def _load(self, i: int) -> EvalTaskset:
        ts = self.cfg.tasksets[i]
        # load_tasks, not the raw rows: a task's images are read and checked as the training
        # taskset's are (the engine takes their bytes; a bad one skips its task with a warning).
        rows = load_tasks(ts.path, ts.split, key=f"eval.tasksets[{i}]")[:ts.limit]
        return EvalTaskset(ts.name, [
            Task(id=f"eval-{ts.name}-{row[ts.id_field] if ts.id_field else n}", payload=row)
            for n, row in enumerate(rows)])

    def due(self, version: int) -> bool:
        """Whether the weights of `version` are to be evaluated before the next step: the
        first weights this explorer holds (`at_start`), then each time `every` versions have
        passed since the last evaluation (with no evaluation yet, at version `every`)."""
        if self.last_version is None:
            return self.cfg.at_start or (self.cfg.every > 0 and version >= self.cfg.every)
        return self.cfg.every > 0 and version >= self.last_version + self.cfg.every

    async def evaluate(self, engine: Engine, workflow: Workflow, scorer: RewardScorer | None,
                       *, version: int, step: int | None = None, final: bool = False,
                       checkpoint: str | None = None, write: bool = True,
                       endpoint: Any = None) -> list[dict[str, Any]]:
        """Every taskset in every mode on the weights `engine` holds; one row per taskset,
        appended to run_dir/eval.jsonl when `write`. The end-of-run evaluation (`final`) of
        weights already evaluated repeats those rows (the seeds are fixed: they would be the
        same) instead of rolling out again. `endpoint`: the explorer's OpenAI endpoint, for the
        agent workflow."""
        if final and version == self.last_version:
            rows = [dict(r, time=round(time.time(), 3), step=step, final=True)
                    for r in self.last_rows]
            if write:
                append_rows(self.path, rows)
            return rows
        rows = []
        for ts in self.tasksets:
            start = time.time()
            metrics: dict[str, float] = {}
            for mode, (sampling, repeat) in self.modes.items():
                ctx = RolloutContext(engine=engine, sampling=sampling, repeat_times=repeat,
                                     explorer=self.explorer, run="eval", step=step or 0,
                                     scorer=scorer, version=version, endpoint=endpoint)
                experiences = await workflow.run(ts.tasks, ctx)
                per_task: dict[str, list[float]] = {}
                for e in experiences:
                    per_task.setdefault(e.task_id, []).append(float(e.reward))
                summary = summarise(list(per_task.values()), correct_at=self.cfg.correct_at,
                                    ks=self.cfg.pass_k if mode == "sampled" else ())
                metrics.update({f"{mode}/{k}": round(v, 6) for k, v in summary.items()})
            rows.append({"time": round(time.time(), 3), "explorer": self.explorer,
                         "version": version, "step": step, "final": final,
                         "checkpoint": checkpoint, "taskset": ts.name, "tasks": len(ts.tasks),
                         "seconds": round(time.time() - start, 3), "metrics": metrics})
        self.last_version, self.last_rows = version, rows
        if write:
            append_rows(self.path, rows)
        return rows


def append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append rows to an eval.jsonl in one write, so a reader never sees half a row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
