"""Online RL through `tandem up`: examples/online.yaml trained from the live traffic of
examples/online_app.py (a scripted user of the quickstart task, on the official `openai` client),
and the reward it sees rises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem.common.config import RunConfig
from tandem.common.trace import read_trace
from tandem.master.quickstart import MODEL, reversal_tasks, warm_start, write_jsonl
from tandem.master.up import run_up

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
STEPS = 40


def test_online_app_reward_rises(tmp_path):
    from tandem.weights.tiny import build_tiny_model

    # the quickstart's warm start, briefly: the format known, the answer often wrong
    train, _ = reversal_tasks(0)
    data = write_jsonl(train, tmp_path / "train.jsonl")
    build_tiny_model(tmp_path / "init", seed=0, **MODEL)
    warm_start(tmp_path / "init", tmp_path / "sft", train, steps=80)
    run_dir = tmp_path / "run"
    raw = yaml.safe_load((ROOT / "examples" / "online.yaml").read_text())
    raw.update(run_dir=str(run_dir), model={"path": str(tmp_path / "sft")},
               logging={"level": "warning", "metrics": {"enabled": False}},
               up={"timeline": False, "run_timeout": 240})
    raw["master"]["total_steps"] = STEPS
    raw["explorers"][0]["engine"] = {"options": {"threads": 1}}
    config = RunConfig.model_validate(raw)
    log = tmp_path / "app.jsonl"
    app = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "online_app.py"),
         "--url-file", str(run_dir / "openai" / "explorer-0.url"), "--data", str(data),
         "--group-size", "8", "--questions", "8", "--seconds", "240", "--wait", "120",
         "--log", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert run_up(config, live=False) == 0
        # the endpoint is gone with the run: the application's next call fails and it exits
        _, err = app.communicate(timeout=60)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(10)
    assert app.returncode == 0, err[-2000:]
    spans = read_trace(config.run_dir)
    assert sorted(s["step"] for s in spans if s["kind"] == "train") == list(range(STEPS))
    rollouts = sorted((s for s in spans if s["kind"] == "rollout"), key=lambda s: s["step"])
    curve = [s["attrs"]["reward_mean"] for s in rollouts]
    print("online reward per step:", " ".join(f"{r:.2f}" for r in curve))
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    print("online app accuracy per round:", " ".join(f"{r['accuracy']:.2f}" for r in rounds))
    third = len(curve) // 3
    first, last = sum(curve[:third]) / third, sum(curve[-third:]) / third
    assert last > first + 0.1, curve
    assert not [s for s in spans if s["kind"] == "online_expired"]
