"""Online RL through `tandem up`: examples/online.yaml trained from the live traffic of
examples/online_app.py (a scripted user of the quickstart task, on the official `openai` client,
as its own process). Every step is trained from the application's conversations, episode groups
by its keys, and nothing expires. Whether the reward rises is measured over enough steps and
seeds by tools/bench_online.py (docs/benchmarks.md), which runs this same `run_online`."""

from __future__ import annotations

import pytest
from backstop import BACKSTOP
from bench_online import run_online

from tandem.master.quickstart import MODEL, reversal_tasks, write_jsonl

pytestmark = pytest.mark.slow
STEPS = 4


def test_online_app_conversations_train_every_step(tmp_path):
    from tandem.weights.tiny import build_tiny_model

    train, _ = reversal_tasks(0)
    data = write_jsonl(train, tmp_path / "train.jsonl")
    build_tiny_model(tmp_path / "model", seed=0, **MODEL)
    # the run's bounds only catch a hang: a loaded machine takes minutes to start it
    run = run_online(tmp_path, tmp_path / "model", data, steps=STEPS, run_timeout=BACKSTOP)
    assert run.code == 0
    assert run.app_code == 0, run.app_err[-2000:]
    assert sorted(s["step"] for s in run.spans if s["kind"] == "train") == list(range(STEPS))
    rollouts = [s for s in run.spans if s["kind"] == "rollout"]
    assert sorted(s["step"] for s in rollouts) == list(range(STEPS))
    # each step: the example's 8 complete groups of 8 episodes, each rewarded by the application
    assert all(s["attrs"]["experiences"] == 64 for s in rollouts), rollouts
    assert run.rounds and all(r["episodes"] == 64 for r in run.rounds)
    assert run.expired == 0
