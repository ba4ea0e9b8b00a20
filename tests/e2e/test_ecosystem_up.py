"""A verifiers environment trained through `tandem up`, unchanged: the user's environment package
(written to a folder on PYTHONPATH, as an installed Hub environment would be) gives the master its
taskset through the reader `verifiers` and the explorer its rollouts and rubric through the
workflow `verifiers`, and the trainer trains on the experiences."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from agent_model import train_through_up
from backstop import BACKSTOP


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
    _, rollouts = train_through_up(
        tmp_path / "run", agent_model_dir, name="verifiers", steps=STEPS,
        taskset={"reader": "verifiers", "path": "times-seven?n=8", "id_field": "example_id",
                 "epochs": 10},
        explorer={"workflow": "verifiers",
                  "workflow_args": {"env": "times-seven", "env_args": {"n": 8}, "timeout": BACKSTOP},
                  "sampling": {"max_tokens": 24, "temperature": 0.7}})
    # the rubric's rewards: says_answer (0 or 1) + 0.5 * brevity (in (0, 0.5])
    assert all(0 < s["attrs"]["reward_mean"] <= 1.5 for s in rollouts)
