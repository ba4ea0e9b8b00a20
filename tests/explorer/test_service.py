"""The explorer service against a real master on loopback: barriers, leases, puts, sync points.

The trainer's side is played by the test over the same protocol a trainer speaks (TrainerGo in,
TrainerStepDone and WeightsPublished out, weights by the real WeightPublisher or
WeightBroadcaster); the buffer is the real one, embedded in the same event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from backstop import BACKSTOP
from tandem.common.config import load_config
from tandem.common.errors import WaitTimeout
from tandem.buffer import Buffer
from tandem.common.messages.buffer import GetBufferStats, SampleGroups
from tandem.common.messages.master import (
    Register, TasksLeased, TrainerGo, TrainerStepDone, WeightsPublished, barrier_topic)
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient
from tandem.common.trace import read_trace
from tandem.weights import WeightBroadcaster, WeightPublisher, engine_member
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.service import Explorer
from tandem.explorer.transformers_engine import TransformersEngine
from tandem.explorer.weights import WeightLoader
from tandem.master.service import Master


def write_tasks(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": f"g{i}", "secret": i % 10 + 1, "low": 1, "high": 10}) + "\n" for i in range(n))
    return path


def make_config(tmp_path: Path, model_path: Path, *overrides: str):
    taskset = write_tasks(tmp_path / "tasks.jsonl", 8)
    return load_config(None, [
        f"run_dir={tmp_path / 'run'}", f"model.path={model_path}",
        "master.address=tcp://127.0.0.1:0", "master.publish_address=tcp://127.0.0.1:0",
        "buffer.address=tcp://127.0.0.1:0",
        f"master.taskset.path={taskset}", "master.taskset.id_field=id", "master.stop_grace=0.2",
        "master.total_steps=2", "transport.heartbeat_interval=0.2",
        f"transport.liveness={BACKSTOP}", "sync.method=checkpoint", "sync.interval=1",
        "sync.offset=0", f"sync.timeout={BACKSTOP}",
        "explorers.0.batch_size=2", "explorers.0.repeat_times=2",
        "explorers.0.workflow=multi_turn", "explorers.0.workflow_args.env=guess_number",
        "explorers.0.workflow_args.max_turns=2", "explorers.0.sampling.max_tokens=6",
        *overrides])


async def play_trainer(config, master_address, publish_address, trained: TransformersEngine,
                       log: list, before_done=None):
    """Train (nothing) on each TrainerGo, publish the trained weights when told to: as files
    plus a notice, or by announcing a broadcast group and broadcasting into it.
    `await before_done(step)`, when given, comes before each step's report: the moment the
    test wants the explorer to have reached."""
    rpc = RpcClient(master_address, peer="master", name="trainer")
    snap = RpcClient(master_address, peer="master", name="trainer-s")
    sub = Subscriber(publish_address, topics=["trainer", "stop"], snapshot=snap,
                     resync_interval=0.2)
    publisher = WeightPublisher(config.run_dir)
    sender = WeightBroadcaster(timeout=BACKSTOP) if config.sync.method == "nccl" else None
    try:
        await rpc.call(Register(name="trainer", role="trainer"), timeout=BACKSTOP)
        while True:
            ev = (await sub.recv(BACKSTOP, what="trainer go")).body
            if not isinstance(ev, TrainerGo):
                return
            log.append(("go", ev.step))
            if before_done is not None:
                await before_done(ev.step)
            await rpc.call(TrainerStepDone(step=ev.step, version=ev.step + 1), timeout=BACKSTOP)
            if ev.publish is None:
                continue
            if sender is None:
                published = await asyncio.to_thread(
                    publisher.publish, ev.publish, trained.model.named_parameters())
                await rpc.call(WeightsPublished(version=ev.publish, method="checkpoint",
                                                path=str(published.path)), timeout=BACKSTOP)
            else:
                group = sender.open_group([engine_member(e) for e in ev.explorers])
                await rpc.call(WeightsPublished(version=ev.publish, method="nccl",
                                                rendezvous=group.model_dump()), timeout=BACKSTOP)
                await asyncio.to_thread(sender.broadcast, ev.publish,
                                        trained.model.named_parameters())
            log.append(("published", ev.publish))
    finally:
        if sender is not None:
            sender.close()
        await sub.close()
        await snap.close()
        await rpc.close()


class _TeardownProbe:
    """An engine whose close() only runs `on_close`: what was on disk when teardown began."""

    def __init__(self, on_close):
        self.on_close = on_close

    def close(self) -> None:
        self.on_close()


@pytest.mark.parametrize("method", ["checkpoint", "nccl"])
async def test_two_steps_with_a_sync_point_waiting_for_weights(tmp_path, tiny_model_path, method,
                                                               monkeypatch):
    config = make_config(tmp_path, tiny_model_path, f"sync.method={method}")
    master = Master(config)
    await master.start()
    # step 1's tasks are leased while its weights load (issue 27 item 2): the load of version
    # 1 goes on only once the master has journaled that lease, which a lease sent after the
    # load would never let happen
    leased: dict[int, asyncio.Event] = {0: asyncio.Event(), 1: asyncio.Event()}
    commit = master._commit

    def journaling(msg):
        if isinstance(msg, TasksLeased):
            leased[msg.step].set()
        return commit(msg)

    monkeypatch.setattr(master, "_commit", journaling)
    load = WeightLoader.load

    async def load_once_leased(self, version, *args, **kwargs):
        await asyncio.wait_for(leased[version].wait(), BACKSTOP)
        return await load(self, version, *args, **kwargs)

    monkeypatch.setattr(WeightLoader, "load", load_once_leased)
    buffer = Buffer(config)
    config.buffer.address = await buffer.start()
    config.master.address = master.address
    trained = TransformersEngine.from_pretrained(tiny_model_path)
    torch.manual_seed(9)
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    engine = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    explorer = Explorer(config, "explorer-0", engine=engine)
    explorer.tracer.flush_interval = 1e9  # nothing reaches the file before close() flushes it
    # the trainer reports step 0 only once the explorer waits at step 1's sync point
    waiting, told = asyncio.Event(), []
    next_barrier = explorer._next_barrier

    async def next_barrier_noted(busy=None):
        if explorer.steps_done == 1:
            waiting.set()
        return await next_barrier(busy=busy)

    async def explorer_waits(step):
        if step == 0:
            await asyncio.wait_for(waiting.wait(), BACKSTOP)
            told.append(time.time())

    explorer._next_barrier = next_barrier_noted
    trainer = asyncio.create_task(play_trainer(config, master.address, master.publish_address,
                                               trained, [], explorer_waits))
    try:
        await asyncio.wait_for(explorer.serve(), BACKSTOP)
        await asyncio.wait_for(trainer, BACKSTOP)
        async with RpcClient(config.buffer.address, peer="buffer") as client:
            sample = await client.call(SampleGroups(num_groups=4), timeout=BACKSTOP)
    finally:
        trainer.cancel()
        # the engine's teardown, which a supervisor may cut short with a SIGKILL (vLLM's takes
        # seconds), begins with the trace of the run already on disk
        on_disk_at_teardown: list = []
        explorer.engine = _TeardownProbe(lambda: on_disk_at_teardown.extend(
            read_trace(config.run_dir)))
        explorer._owns_engine = True
        await explorer.close()
        await buffer.close()
        await master.close()

    assert explorer.stop_reason and explorer.stop_reason.startswith("done")
    assert explorer.steps_done == 2 and engine.version == 1
    exps = sorted(sample.experiences, key=lambda e: (e.info["step"], e.task_id,
                                                    e.info["repeat_index"]))
    assert len(exps) == 2 * 2 * 2 and len(sample.group_ids) == 4
    assert [e.policy_version for e in exps] == [0] * 4 + [1] * 4
    assert [e.info["step"] for e in exps] == [0] * 4 + [1] * 4
    assert len({e.group_id for e in exps}) == 4 and all(e.info["group_size"] == 2 for e in exps)
    assert all(e.action_mask.sum() > 0 and np.all(e.logprobs[e.action_mask == 0] == 0)
               for e in exps)
    # the loaded weights are the trainer's: same greedy outputs
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    assert ([list(c.token_ids) for [c] in engine.generate_sync(["3+4="], 1, greedy)]
            == [list(c.token_ids) for [c] in trained.generate_sync(["3+4="], 1, greedy)])
    spans = read_trace(config.run_dir)
    mine = [s for s in spans if s["component"] == "explorer-0"]
    assert [s for s in on_disk_at_teardown if s["component"] == "explorer-0"] == mine
    kinds = [(s["kind"], s["step"]) for s in mine]
    assert ("rollout", 0) in kinds and ("rollout", 1) in kinds and ("sync", 1) in kinds
    [sync] = [s for s in mine if s["kind"] == "sync"]
    assert sync["version"] == 1 and sync["attrs"]["method"] == method
    # the explorer waited at the sync point of step 1 from before the trainer's report of step
    # 0 until version 1 was published
    waits = [s for s in mine if s["kind"] == "wait" and s["step"] == 1]
    assert waits and waits[0]["start"] <= told[0] <= waits[0]["end"]
    engine.close()
    trained.close()


async def test_two_explorers_with_their_own_engines_and_batch_sizes(tmp_path, tiny_model_path):
    # explorer-1 and explorer-10: a name that is a prefix of the other's
    config = make_config(
        tmp_path, tiny_model_path, "sync.preset=multi_explorer_async", "sync.method=checkpoint",
        "sync.offset=null", "master.total_steps=2", "explorers.0.name=explorer-1",
        "explorers.1.name=explorer-10", "explorers.1.batch_size=1", "explorers.1.repeat_times=3",
        "explorers.1.workflow=multi_turn", "explorers.1.workflow_args.env=guess_number",
        "explorers.1.workflow_args.max_turns=3", "explorers.1.sampling.max_tokens=5")
    master = Master(config)
    await master.start()
    buffer = Buffer(config)
    config.buffer.address = await buffer.start()
    config.master.address = master.address
    engines = [TransformersEngine.from_pretrained(tiny_model_path, max_batch=4) for _ in range(2)]
    explorers = [Explorer(config, name, engine=engine)
                 for name, engine in zip(("explorer-1", "explorer-10"), engines)]
    trained = TransformersEngine.from_pretrained(tiny_model_path)
    trainer = asyncio.create_task(play_trainer(config, master.address, master.publish_address,
                                               trained, []))
    try:
        await asyncio.wait_for(asyncio.gather(*(e.serve() for e in explorers)), BACKSTOP)
        await asyncio.wait_for(trainer, BACKSTOP)
        async with RpcClient(config.buffer.address, peer="buffer") as client:
            stats = await client.call(GetBufferStats(), timeout=BACKSTOP)
    finally:
        trainer.cancel()
        for e in explorers:
            await e.close()
        await buffer.close()
        await master.close()
        for e in engines + [trained]:
            e.close()
    # batches_per_step = 2 explorers: 4 batches in all, shared between them as they ask
    assert sum(e.steps_done for e in explorers) == 4
    assert all(e.steps_done >= 1 for e in explorers)
    assert all(e.stop_reason and e.stop_reason.startswith("done") for e in explorers)
    assert stats.groups_waiting == 0
    # each subscribes to its own barriers only (ZeroMQ topics are prefixes): explorer-1 never
    # receives, nor gets in its snapshots, the barriers of explorer-10 (or -1x, -1xx, ...)
    for e in explorers:
        others = [barrier_topic(o.name) for o in explorers if o is not e]
        assert barrier_topic(e.name) in e.subscriber.topics
        assert not [t for t in e.subscriber.topics for o in others if o.startswith(t)]


@pytest.mark.parametrize("drain", [BACKSTOP, 0.0])
async def test_stop_request_drains_the_running_step_or_abandons_it(tmp_path, tiny_model_path,
                                                                    drain):
    config = make_config(tmp_path, tiny_model_path, f"explorers.0.drain_seconds={drain}",
                         "explorers.0.sampling.max_tokens=40",
                         "explorers.0.workflow_args.max_turns=4")
    master = Master(config)
    await master.start()
    buffer = Buffer(config)
    config.buffer.address = await buffer.start()
    config.master.address = master.address
    engine = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    explorer = Explorer(config, "explorer-0", engine=engine)
    try:
        serving = asyncio.create_task(explorer.serve())
        while explorer._lease_id is None:  # the first step holds its tasks and is rolling out
            await asyncio.sleep(0.01)
        explorer.request_stop()
        await asyncio.wait_for(serving, BACKSTOP)
        async with RpcClient(config.buffer.address, peer="buffer") as client:
            stats = await client.call(GetBufferStats(), timeout=BACKSTOP)
        status = master.status()
    finally:
        await explorer.close()
        await buffer.close()
        await master.close()
        engine.close()
    if drain:
        # the step finished: stored, its lease completed, reported to the master
        assert explorer.steps_done == 1 and stats.groups_ready == 2
        assert status.counters.batches_done == 1 and not status.leases
    else:
        # abandoned at once: nothing stored, and the lease handed back to the master at once
        assert explorer.steps_done == 0 and stats.groups_ready == 0
        assert status.counters.batches_done == 0
        assert not status.leases and status.counters.leases_expired == 1


async def test_a_stalled_sync_point_fails_after_sync_timeout_naming_the_key(tmp_path,
                                                                            tiny_model_path):
    # No trainer: step 0 rolls out with the base weights, step 1 waits for version 1 in vain.
    config = make_config(tmp_path, tiny_model_path, "sync.timeout=1.5")
    master = Master(config)
    await master.start()
    buffer = Buffer(config)
    config.buffer.address = await buffer.start()
    config.master.address = master.address
    engine = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    explorer = Explorer(config, "explorer-0", engine=engine)
    try:
        with pytest.raises(WaitTimeout, match="sync.timeout") as info:
            await asyncio.wait_for(explorer.serve(), BACKSTOP)
    finally:
        await explorer.close()
        await buffer.close()
        await master.close()
        engine.close()
    assert explorer.steps_done == 1 and "after step 1" in str(info.value)


async def test_the_evaluating_explorer_scores_between_steps_and_at_the_end(tmp_path,
                                                                            tiny_model_path):
    heldout = write_tasks(tmp_path / "heldout.jsonl", 3)
    config = make_config(tmp_path, tiny_model_path, "eval.every=1", "eval.repeat_times=2",
                         "eval.answer_key=secret", "eval.final_wait=0")
    config.eval.tasksets = [{"name": "heldout", "path": str(heldout)}]
    config = type(config).model_validate(config.model_dump())  # the run-level checks again
    master = Master(config)
    await master.start()
    buffer = Buffer(config)
    config.buffer.address = await buffer.start()
    config.master.address = master.address
    trained = TransformersEngine.from_pretrained(tiny_model_path)
    engine = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    explorer = Explorer(config, "explorer-0", engine=engine)
    trainer = asyncio.create_task(play_trainer(config, master.address, master.publish_address,
                                               trained, []))
    try:
        await asyncio.wait_for(explorer.serve(), BACKSTOP)
        await asyncio.wait_for(trainer, BACKSTOP)
    finally:
        trainer.cancel()
        await explorer.close()
        await buffer.close()
        await master.close()
    engine.close()
    trained.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().split("\n")
            if line]
    # before step 0 (v0), before step 1 (v1, `every` 1 later), and the end (still v1: the
    # trainer's last version is never published, so those rows are repeated as final)
    assert [(r["version"], r["step"], r["final"]) for r in rows] == [
        (0, 0, False), (1, 1, False), (1, 2, True)]
    assert all(r["tasks"] == 3 and set(r["metrics"]) >= {"greedy/reward_mean",
                                                           "sampled/pass@2"} for r in rows)
    spans = [s for s in read_trace(config.run_dir) if s["kind"] == "eval"]
    assert [(s["component"], s["version"], s["attrs"]["final"]) for s in spans] == [
        ("explorer-0", 0, False), ("explorer-0", 1, False), ("explorer-0", 1, True)]
    assert explorer.steps_done == 2  # evaluations are no steps
