"""An `agent` workflow run through `tandem up`: a user's openai-client agent (the calculator
agent of examples/agents) rolls out through the explorer's endpoint, and the trainer trains."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tandem.master.quickstart import write_jsonl
from backstop import BACKSTOP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from agent_model import QUESTION, train_through_up

pytestmark = pytest.mark.slow
STEPS = 2


def test_agent_workflow_trains_through_tandem_up(tmp_path, agent_model_dir, monkeypatch):
    rows = [{"id": f"q{i}", "prompt": QUESTION, "answer": 84, "max_tokens": 90}
            for i in range(8)]
    taskset = write_jsonl(rows, tmp_path / "train.jsonl")
    # the explorer process imports the agent by name, as a user's would be
    path = os.pathsep.join([str(ROOT / "examples" / "agents"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    config, _ = train_through_up(
        tmp_path / "run", agent_model_dir, name="agent", steps=STEPS,
        taskset={"path": str(taskset), "epochs": 10},
        explorer={"workflow": "agent",
                  "workflow_args": {"fn": "calculator_agent:run", "timeout": BACKSTOP},
                  "sampling": {"max_tokens": 90, "temperature": 0.7}})
    url = (Path(config.run_dir) / "openai" / "explorer-0.url").read_text().strip()
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")


def test_streaming_agent_trains_on_its_own_tokens_through_tandem_up(tmp_path, agent_model_dir,
                                                                    monkeypatch):
    # an agent that streams with logprobs and sends the streamed messages back: every stored
    # experience passes the explorer's token-true check (no info["token_mismatch"]) and chains
    import sqlite3

    from tandem.buffer.rows import from_row

    rows = [{"id": f"q{i}", "prompt": QUESTION, "answer": 84, "max_tokens": 90}
            for i in range(8)]
    taskset = write_jsonl(rows, tmp_path / "train.jsonl")
    path = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    config, _ = train_through_up(
        tmp_path / "run", agent_model_dir, name="agent-stream", steps=STEPS,
        taskset={"path": str(taskset), "epochs": 10},
        explorer={"workflow": "agent",
                  "workflow_args": {"fn": "agent_model:streaming_calculator", "timeout": BACKSTOP},
                  "sampling": {"max_tokens": 90, "temperature": 0.7}},
        buffer={"keep_consumed": 1000})
    db = sqlite3.connect(Path(config.run_dir) / "buffer.sqlite")
    try:
        stored = [from_row(*row) for row in db.execute(
            "SELECT id, group_id, meta, tokens, action_mask, logprobs, token_versions "
            "FROM experiences").fetchall()]
    finally:
        db.close()
    assert len(stored) >= STEPS * 2 * 2  # groups_per_step x repeat_times
    for exp in stored:
        assert "token_mismatch" not in exp.info, exp.info["token_mismatch"]
        assert exp.info["rule"] == "chained" and exp.action_mask.sum() > 0
