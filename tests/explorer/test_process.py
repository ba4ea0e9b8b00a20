"""tandem-explorer as a real process against tandem-master and tandem-buffer processes.

The test plays the trainer over the real protocol: it samples each step's groups from the
buffer, acks them, reports the step, and publishes weights by checkpoint. The explorer rolls out
two steps, waits at the sync point of step 1 until version 1 is published, waits again at step 2
for a version that never comes, and leaves cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from backstop import BACKSTOP
from component_process import ComponentProcess
from tandem.common.messages.buffer import AckLease, SampleGroups
from tandem.common.messages.master import (
    Register, TrainerGo, TrainerStepDone, WeightsPublished)
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient
from tandem.common.trace import read_trace
from tandem.weights import WeightPublisher

BIN = Path(sys.executable).parent


@pytest.fixture
def procs():
    started: list[ComponentProcess] = []

    def start(name, argv):
        started.append(ComponentProcess(name, argv))
        return started[-1]

    yield start
    for p in reversed(started):
        p.stop()


def write_run(tmp_path: Path, model_path: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"c{i}", "expression": f"{i}*7+1"}) + "\n"
                             for i in range(12)))
    config = {
        "run_dir": str(tmp_path / "run"),
        "model": {"path": str(model_path)},
        "master": {"address": "tcp://127.0.0.1:0", "publish_address": "tcp://127.0.0.1:0",
                   "taskset": {"path": str(tasks), "id_field": "id"}, "total_steps": 3,
                   "stop_grace": 0.2},
        "transport": {"heartbeat_interval": 0.2, "liveness": BACKSTOP},
        # the wait for version 2 lasts an hour unless SIGTERM ends it
        "sync": {"method": "checkpoint", "interval": 1, "offset": 0, "timeout": 3600},
        "buffer": {"max_sample_wait": BACKSTOP},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 3,
                       "workflow": "multi_turn",
                       "workflow_args": {"env": "calculator", "max_turns": 2},
                       "sampling": {"max_tokens": 8}, "drain_seconds": 5,
                       "engine": {"options": {"threads": 1}}}],
        "logging": {"json_console": True},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def play_trainer(master: str, publish: str, buffer: str, run_dir: str, model_path: Path,
                       seen: list, published: asyncio.Event):
    """Trainer steps 0 and 1: sample the step's groups, ack, report; publish version 1 only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    rpc = RpcClient(master, peer="master", name="trainer")
    snap = RpcClient(master, peer="master", name="trainer-s")
    buf = RpcClient(buffer, peer="buffer", name="trainer-b")
    sub = Subscriber(publish, topics=["trainer"], snapshot=snap, resync_interval=0.2)
    try:
        await rpc.call(Register(name="trainer", role="trainer"), timeout=BACKSTOP)
        for _ in range(2):
            go = (await sub.recv(BACKSTOP, what="trainer go")).body
            assert isinstance(go, TrainerGo)
            sample = await buf.call(SampleGroups(num_groups=2, wait=BACKSTOP), timeout=BACKSTOP)
            seen.append((go.step, sorted({e.policy_version for e in sample.experiences}),
                         len(sample.experiences)))
            await buf.call(AckLease(lease_id=sample.lease_id), timeout=BACKSTOP)
            await rpc.call(TrainerStepDone(step=go.step, version=go.step + 1), timeout=BACKSTOP)
            if go.publish == 1:
                pub = await asyncio.to_thread(WeightPublisher(run_dir).publish, 1,
                                              model.named_parameters())
                await rpc.call(WeightsPublished(version=1, method="checkpoint",
                                                path=str(pub.path)), timeout=BACKSTOP)
                published.set()
    finally:
        await sub.close()
        await snap.close()
        await buf.close()
        await rpc.close()


async def test_explorer_process_steps_waits_for_weights_and_leaves_on_sigterm(
        tmp_path, tiny_model_path, procs):
    config = write_run(tmp_path, tiny_model_path)
    run_dir = str(tmp_path / "run")
    master = procs("master", [str(BIN / "tandem-master"), "--config", str(config)])
    buffer = procs("buffer", [str(BIN / "tandem-buffer"), "--config", str(config),
                              "--address", "tcp://127.0.0.1:0"])
    started = master.wait_for("master.started")
    buffer_address = buffer.wait_for("buffer.listening")["address"]
    explorer = procs("explorer", [
        sys.executable, "-m", "tandem.explorer.cli", "--config", str(config),
        "--name", "explorer-0", "--set", f"master.address={started['address']}",
        "--set", f"buffer.address={buffer_address}"])
    seen: list = []
    published = asyncio.Event()
    await asyncio.wait_for(play_trainer(started["address"], started["publish"], buffer_address,
                                        run_dir, tiny_model_path, seen, published), BACKSTOP)
    # step 0 rolled out with the base weights, step 1 with version 1 after waiting for it
    assert seen == [(0, [0], 6), (1, [1], 6)]
    await asyncio.to_thread(explorer.wait_for, "explorer.step")  # step 0
    await asyncio.to_thread(explorer.wait_for, "explorer.step")  # step 1
    # step 2 needs version 2, which never comes: the explorer waits until SIGTERM, which
    # ends the wait long before the hour is up (exit code 0, closed by the signal)
    assert explorer.proc.poll() is None
    assert explorer.stop() == 0
    closed = explorer.wait_for("explorer.closed")
    assert closed["steps"] == 2 and closed["reason"] == "signal"

    spans = [s for s in read_trace(run_dir) if s["component"] == "explorer-0"]
    rollouts = [(s["step"], s["version"]) for s in spans if s["kind"] == "rollout"]
    assert rollouts == [(0, 0), (1, 1)]
    [sync] = [s for s in spans if s["kind"] == "sync"]
    assert sync["step"] == 1 and sync["version"] == 1 and sync["attrs"]["method"] == "checkpoint"
    [wait] = [s for s in spans if s["kind"] == "wait" and s["step"] == 1]
    assert wait["end"] <= sync["start"] and rollouts[0] == (0, 0)
