"""Dynamic sampling done fully: real `tandem-master` and `tandem-buffer` processes, the trainer
embedded, the test playing the explorer. A step short of informative groups is topped up with
new tasks by the master; the trainer consumes every group of the step and trains only the
informative ones; what was discarded is counted in the metrics and the trace."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from backstop import BACKSTOP

from tandem.common.config import load_config
from tandem.common.errors import PeerDead
from tandem.common.groups import informative_groups
from tandem.common.messages.buffer import GetBufferStats, PutExperiences
from tandem.common.messages.experience import Experience, experience_id, group_id
from tandem.common.messages.master import (
    CompleteTasks, ExplorerStepDone, GetStatus, LeaseTasks, Register, barrier_topic)
from tandem.common.heartbeat import Heartbeater
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient
from tandem.common.trace import read_trace
from tandem.trainer.algorithms import informative_rows
from tandem.trainer.trainer import Trainer
from tandem.common.sockets import free_port

BIN = Path(sys.executable).parent


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_ready(client: RpcClient, request, log: Path) -> None:
    deadline = time.monotonic() + BACKSTOP
    while True:
        try:
            await client.call(request, timeout=1.0, retries=0)
            return
        except PeerDead:
            if time.monotonic() > deadline:
                raise AssertionError(f"did not start:\n{log.read_text()[-2000:]}")


def rewards_of(task_id: str) -> list[float]:
    """Tasks t0, t2, ... are solved by every response (no signal); t1, t3, ... by half."""
    return [1.0, 1.0] if int(task_id[1:]) % 2 == 0 else [1.0, 0.0]


async def play_explorer(cfg, tokenizer, batches: list) -> None:
    name = "explorer-0"
    rpc = RpcClient(cfg.master.address, peer="master", name=name)
    snap = RpcClient(cfg.master.address, peer="master", name=name + "-s")
    buffer = RpcClient(cfg.buffer.address, peer="buffer", name=name + "-b")
    sub = Subscriber(cfg.master.publish_address, topics=[barrier_topic(name), "stop"],
                     snapshot=snap, resync_interval=0.2)
    await sub.start()
    await rpc.call(Register(name=name, role="explorer", pid=os.getpid()), timeout=BACKSTOP)
    heartbeat = Heartbeater(rpc, name=name, role="explorer",
                            interval=cfg.transport.heartbeat_interval,
                            liveness=cfg.transport.liveness)
    heartbeat.start()
    done = -1
    try:
        while True:
            msg = (await sub.recv(BACKSTOP, what="barrier")).body
            if msg.TYPE == "master.stop":
                return
            if msg.batch <= done:
                continue
            done = msg.batch
            lease = await rpc.call(LeaseTasks(explorer=name, count=2, step=msg.step),
                                   timeout=BACKSTOP)
            experiences = []
            for task in lease.tasks:
                prompt = tokenizer(task.payload["prompt"])["input_ids"]
                for i, reward in enumerate(rewards_of(task.id)):
                    response = tokenizer(str(i + 7))["input_ids"]
                    experiences.append(Experience(
                        id=experience_id(task.id, i, msg.version, name), task_id=task.id,
                        group_id=group_id(task.id, msg.version),
                        tokens=np.array(prompt + response, dtype=np.int32), prompt_len=len(prompt),
                        action_mask=np.ones(len(response), dtype=np.uint8),
                        logprobs=np.full(len(response), -4.6, dtype=np.float32), reward=reward,
                        policy_version=msg.version, explorer=name))
            await buffer.call(PutExperiences(experiences=experiences), timeout=BACKSTOP)
            batches.append((msg.step, msg.batch, [t.id for t in lease.tasks]))
            await rpc.call(CompleteTasks(lease_id=lease.lease_id), timeout=BACKSTOP)
            await rpc.call(ExplorerStepDone(
                explorer=name, step=msg.step, batch=msg.batch, version=msg.version,
                informative=informative_groups(experiences)), timeout=BACKSTOP)
    finally:
        await heartbeat.close()
        await sub.close()
        for client in (rpc, snap, buffer):
            await client.close()


SYNCHRONOUS = {"method": "checkpoint", "interval": 1, "offset": 0, "timeout": BACKSTOP}
FULLY_ASYNC = {"method": "checkpoint", "interval": 1, "offset": None, "max_staleness": 4,
               "timeout": BACKSTOP}


async def scenario(tmp_path, tiny_model_path, tokenizer, sync=SYNCHRONOUS):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"{i}+1="}) + "\n"
                             for i in range(8)))
    run_dir = tmp_path / "run"
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({
        "run_dir": str(run_dir),
        "model": {"path": str(tiny_model_path)},
        "sync": sync,
        "transport": {"liveness": BACKSTOP, "heartbeat_interval": 0.2},
        "master": {"address": f"tcp://127.0.0.1:{free_port()}",
                   "publish_address": f"tcp://127.0.0.1:{free_port()}",
                   "taskset": {"path": str(tasks), "id_field": "id", "shuffle": False},
                   "total_steps": 2, "stop_grace": BACKSTOP},
        "buffer": {"address": f"tcp://127.0.0.1:{free_port()}"},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2}],
        "trainer": {"groups_per_step": 2, "lr": 1e-3, "micro_batch_tokens": 64,
                    "sample_wait": 1.0, "idle_timeout": BACKSTOP, "tensorboard": False,
                    "dynamic_sampling": True, "max_oversample": 1},
    }))
    cfg = load_config(config_file)
    logs = {n: tmp_path / f"{n}.log" for n in ("master", "buffer")}
    procs = [subprocess.Popen([str(BIN / f"tandem-{n}"), "--config", str(config_file)],
                              stdout=subprocess.DEVNULL, stderr=open(log, "w"))
             for n, log in logs.items()]
    probe_m = RpcClient(cfg.master.address, peer="master", name="probe-m")
    probe_b = RpcClient(cfg.buffer.address, peer="buffer", name="probe-b")
    try:
        await wait_ready(probe_m, GetStatus(), logs["master"])
        await wait_ready(probe_b, GetBufferStats(), logs["buffer"])
        batches: list = []
        trainer = Trainer(cfg)
        try:
            await asyncio.wait_for(asyncio.gather(trainer.serve(),
                                                  play_explorer(cfg, tokenizer, batches)), BACKSTOP)
        finally:
            await trainer.close()
        stats = await probe_b.call(GetBufferStats(), timeout=BACKSTOP)
        status = await probe_m.call(GetStatus(), timeout=BACKSTOP)
        return trainer, batches, stats, status, run_dir
    finally:
        for client in (probe_m, probe_b):
            await client.close()
        for proc in procs:
            stop(proc)


@pytest.mark.slow
@pytest.mark.parametrize("sync, labels", [
    (SYNCHRONOUS, [(0, 0), (0, 1), (1, 2), (1, 3)]),
    # asynchronous: the plan's batch for step 1 goes to step 0, then step 1 gets two top-ups
    (FULLY_ASYNC, [(0, 0), (1, 1), (1, 2), (1, 3)]),
], ids=["synchronous", "fully_async"])
def test_short_steps_are_topped_up_and_every_group_is_consumed_once(tmp_path, tiny_model_path,
                                                                    tokenizer, sync, labels):
    trainer, batches, stats, status, run_dir = asyncio.run(
        scenario(tmp_path, tiny_model_path, tokenizer, sync))
    assert trainer.step == 2 and status.counters.trainer_steps_done == 2
    # each batch of 2 tasks has 1 informative group: every step takes one batch more
    # (max_oversample) to reach groups_per_step = 2 informative groups
    assert [(s, b) for s, b, _ in batches] == labels
    leased = [t for _, _, tasks in batches for t in tasks]
    assert sorted(leased) == [f"t{i}" for i in range(8)]  # every task leased once
    # all 8 groups consumed (acked) by the two steps: none trained twice, none left behind
    assert stats.by_state.get("consumed") == 16 and stats.groups_ready == 0
    assert stats.by_state.get("leased", 0) == 0
    spans = [s for s in read_trace(run_dir) if s["kind"] == "train"]
    assert [(s["attrs"]["discarded_groups"], s["attrs"]["extra_batches"]) for s in spans] == [
        (2, 1), (2, 1)]


def test_the_explorer_and_the_trainer_count_informative_groups_alike(make_group):
    experiences = (make_group("a", "1+1=", ["2", "3"], [1.0, 1.0])
                   + make_group("b", "1+2=", ["3", "4"], [1.0, 1.0 + 1e-7])
                   + make_group("c", "1+3=", ["4", "5"], [0.5, 0.0])
                   + make_group("d", "1+4=", ["5"], [1.0]))
    ids = {g: i for i, g in enumerate(dict.fromkeys(e.group_id for e in experiences))}
    _keep, dropped = informative_rows(torch.tensor([e.reward for e in experiences]),
                                     torch.tensor([ids[e.group_id] for e in experiences]))
    assert informative_groups(experiences) == len(ids) - dropped == 1
