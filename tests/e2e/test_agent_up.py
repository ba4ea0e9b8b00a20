"""An `agent` workflow run through `tandem up`: a user's openai-client agent (the calculator
agent of examples/agents) rolls out through the explorer's endpoint, and the trainer trains."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tandem.common.config import RunConfig
from tandem.common.trace import read_trace
from tandem.master.quickstart import write_jsonl
from tandem.master.up import run_up

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from agent_model import QUESTION  # noqa: E402

pytestmark = pytest.mark.slow
STEPS = 2


def test_agent_workflow_trains_through_tandem_up(tmp_path, agent_model_dir, monkeypatch):
    rows = [{"id": f"q{i}", "prompt": QUESTION, "answer": 84, "max_tokens": 90}
            for i in range(8)]
    taskset = write_jsonl(rows, tmp_path / "train.jsonl")
    # the explorer process imports the agent by name, as a user's would be
    path = os.pathsep.join([str(ROOT / "examples" / "agents"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    config = RunConfig.model_validate({
        "name": "agent", "run_dir": str(tmp_path / "run"),
        "model": {"path": str(agent_model_dir)},  # the session's: the run only reads it
        "sync": {"preset": "synchronous", "timeout": 60},
        "master": {"total_steps": STEPS, "taskset": {"path": str(taskset), "epochs": 10}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow": "agent",
                       "workflow_args": {"fn": "calculator_agent:run", "timeout": 60},
                       "sampling": {"max_tokens": 90, "temperature": 0.7},
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
    url = (Path(config.run_dir) / "openai" / "explorer-0.url").read_text().strip()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
