"""Streaming across step boundaries (`explorers[].lease_ahead`, asynchronous plans), through
real processes: the explorer leases and rolls out its next step while this one drains."""

from __future__ import annotations

import pytest

from tandem.common.config import RunConfig
from tandem.common.trace import read_trace
from tandem.master.quickstart import reversal_tasks, write_jsonl
from tandem.master.up import run_up

pytestmark = pytest.mark.slow
STEPS = 4


def test_the_next_step_starts_while_the_last_groups_of_this_one_finish(tmp_path,
                                                                     tiny_model_dir):
    train, _ = reversal_tasks(0)
    taskset = write_jsonl(train[:64], tmp_path / "train.jsonl")
    config = RunConfig.model_validate({
        "name": "ahead", "run_dir": str(tmp_path / "run"), "model": {"path": str(tiny_model_dir)},
        # staleness 4 over 4 steps: the master never holds a grant back for the trainer
        "sync": {"preset": "fully_async", "timeout": 60},
        "master": {"total_steps": STEPS, "taskset": {"path": str(taskset), "epochs": 10}},
        # one task per engine batch: a step is six batches one after the other, so its first
        # group is scored (a slot frees) long before its last
        "explorers": [{"name": "explorer-0", "batch_size": 6, "repeat_times": 2,
                       "engine": {"max_batch": 2},
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 12}}],
        "trainer": {"groups_per_step": 6, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        "transport": {"liveness": 30.0},
        "logging": {"level": "warning"},
        "up": {"run_timeout": 150},
    })
    assert run_up(config, live=False) == 0
    spans = read_trace(config.run_dir)
    rollouts = sorted((s for s in spans if s["kind"] == "rollout"), key=lambda s: s["start"])
    # every step rolled out once, in order, each with at most max_staleness old weights
    assert [s["step"] for s in rollouts] == list(range(STEPS))
    assert all(s["step"] - s["version"] <= 4 for s in rollouts)
    trains = [s for s in spans if s["kind"] == "train"]
    assert sorted(s["step"] for s in trains) == list(range(STEPS))
    # Without lease_ahead a step's tasks are leased only after the step before is reported,
    # which follows its last put (the end of its rollout span). Here the next step's tasks
    # went to the engine before the last group of the step before was even scored.
    ahead = [(a["step"], b["step"]) for a, b in zip(rollouts, rollouts[1:])
             if b["start"] < a["attrs"]["generated"] <= a["end"]]
    assert ahead, [(s["step"], s["start"], s["attrs"]["generated"], s["end"]) for s in rollouts]
