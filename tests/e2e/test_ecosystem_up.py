"""A verifiers environment trained through `tandem up`, unchanged: the user's environment package
(written to a folder on PYTHONPATH, as an installed Hub environment would be) gives the master its
taskset through the reader `verifiers` and the explorer its rollouts and rubric through the
workflow `verifiers`, and the trainer trains on the experiences."""

from __future__ import annotations

import os
import textwrap

import pytest

from tandem.common.config import RunConfig
from tandem.common.trace import read_trace
from tandem.master.up import run_up

pytestmark = pytest.mark.slow
pytest.importorskip("verifiers")  # the optional extra tandem-explorer[verifiers]
STEPS = 2

ENVIRONMENT = '''
import verifiers as vf
from datasets import Dataset


def load_environment(n: int = 8):
    rows = [{"question": f"What is {i}*7?", "answer": str(7 * i)} for i in range(n)]

    def says_answer(completion, answer) -> float:
        return float(answer in completion[-1]["content"])

    def brevity(completion) -> float:
        return 1.0 / (1.0 + len(completion[-1]["content"]))

    rubric = vf.Rubric(funcs=[says_answer, brevity], weights=[1.0, 0.5])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=rubric)
'''


def test_verifiers_environment_trains_through_tandem_up(tmp_path, agent_model_dir, monkeypatch):
    package = tmp_path / "site"
    package.mkdir()
    (package / "times_seven.py").write_text(textwrap.dedent(ENVIRONMENT))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(package),
                                                      os.environ.get("PYTHONPATH", "")]))
    config = RunConfig.model_validate({
        "name": "verifiers", "run_dir": str(tmp_path / "run"),
        "model": {"path": str(agent_model_dir)},  # the session's: the run only reads it
        "sync": {"preset": "synchronous", "timeout": 60},
        "master": {"total_steps": STEPS,
                   "taskset": {"reader": "verifiers", "path": "times-seven?n=8",
                               "id_field": "example_id", "epochs": 10}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow": "verifiers",
                       "workflow_args": {"env": "times-seven", "env_args": {"n": 8},
                                         "timeout": 60},
                       "sampling": {"max_tokens": 24, "temperature": 0.7},
                       "engine": {"options": {"threads": 1}}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-3},
        "transport": {"liveness": 30.0},
        "logging": {"level": "warning", "metrics": {"enabled": False}},
        "up": {"run_timeout": 120, "timeline": False},
    })
    assert run_up(config, live=False) == 0
    spans = read_trace(config.run_dir)
    trains = sorted(s["step"] for s in spans if s["kind"] == "train")
    assert trains == list(range(STEPS))
    rollouts = [s for s in spans if s["kind"] == "rollout"]
    assert rollouts and all((s.get("attrs") or {}).get("experiences", 0) > 0 for s in rollouts)
    # the rubric's rewards: says_answer (0 or 1) + 0.5 * brevity (in (0, 0.5])
    assert all(0 < s["attrs"]["reward_mean"] <= 1.5 for s in rollouts)
