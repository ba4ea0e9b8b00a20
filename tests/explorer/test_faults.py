"""An explorer under faults, against a real master and buffer on loopback (issue 14).

- A live explorer is never declared dead while its subscription keeps the master's RPC socket
  busy with snapshot requests (item 4).
- An explorer declared dead right after the buffer acked its put registers again and carries
  on (item 6); the tasks of its batch are rolled out again under newer weights and store
  nothing new, so every task has exactly one group in the buffer (item 3). It registers again
  once, also when a heartbeat refused as dead is answered only after that registration (the
  order a loaded machine drew in issue 31's sixth run: it registered twice).
- An explorer that completed its lease but died before its step report has its batch counted
  once, not lost (item 3).
- A score request in flight when the reward service dies is resent (same id) and answered by
  the restarted service, well within reward.request_timeout (item 7).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from backstop import BACKSTOP
from tandem.buffer import Buffer
from tandem.common.config import RunConfig
from tandem.common.config.reward import RewardConfig
from tandem.common.errors import RequestFailed, WaitTimeout
from tandem.common.heartbeat import Heartbeater
from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerLeft,
    LeaseTasks,
    Register,
    barrier_topic,
)
from tandem.common.messages.reward import ScoreBatch, ScoreItem
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient, RpcServer
from tandem.explorer.rewards import create_scorer
from tandem.explorer.service import Explorer
from tandem.explorer.transformers_engine import TransformersEngine
from tandem.master.service import Master
from tandem.reward import RewardService, build_scorer
from tandem.common.sockets import free_port

sys.path.insert(0, str(Path(__file__).parent))
from test_service import make_config, play_trainer


async def declare_dead(master: Master, name: str) -> None:
    """What the master's liveness watch does when `name` is silent past transport.liveness."""
    async with master._lock:
        await master._emit(master._commit(ExplorerLeft(explorer=name)))


class HeartbeatCountingMaster(Master):
    """A master that counts the heartbeats it handles, per component."""

    def __init__(self, config):
        self.heartbeats: Counter = Counter()
        super().__init__(config)

    async def _on_heartbeat(self, msg, ctx):
        self.heartbeats[msg.name] += 1
        return await super()._on_heartbeat(msg, ctx)


class CountingSubscriber(Subscriber):
    """A subscriber that counts its snapshot requests (resyncs)."""

    resyncs = 0

    async def resync(self) -> None:
        await super().resync()
        self.resyncs += 1


async def test_a_live_explorer_whose_snapshot_requests_keep_the_socket_busy_keeps_beating(
        tmp_path, tiny_model_path):
    # The subscriber resyncs every 0.1 s on the same client as the heartbeats; the master counts
    # heartbeats (not snapshot requests) as life. Before the fix the heartbeater saw the
    # snapshot replies as "recently heard", never sent a heartbeat, and the master declared the
    # explorer dead after transport.liveness. The verdict is what reaches the master, counted,
    # not how long it stayed alive: heartbeats keep coming while snapshot replies keep the
    # client busy, at whatever pace this machine runs both (so no liveness runs out here).
    config = make_config(tmp_path, tiny_model_path, "transport.heartbeat_interval=0.2")
    master = HeartbeatCountingMaster(config)
    await master.start()
    client = RpcClient(master.address, peer="master", name="explorer-0")
    sub = CountingSubscriber(master.publish_address, topics=[barrier_topic("explorer-0")],
                             snapshot=client, resync_interval=0.1)
    beat = Heartbeater(client, name="explorer-0", role="explorer", interval=0.2,
                       liveness=BACKSTOP)

    async def listen_until(done, what: str) -> None:
        """Keep the subscription resyncing until `done()`; BACKSTOP only bounds a hang."""
        deadline = time.monotonic() + BACKSTOP
        while not done():
            assert time.monotonic() < deadline, (
                f"no {what} in {BACKSTOP:g} s: {sub.resyncs} resyncs, "
                f"{master.heartbeats['explorer-0']} heartbeats")
            try:
                await sub.recv(0.3, what="barrier")
            except WaitTimeout:
                pass

    try:
        await client.call(Register(name="explorer-0", role="explorer", pid=os.getpid()),
                          timeout=BACKSTOP)
        await sub.start()
        beat.start()
        await listen_until(lambda: sub.resyncs >= 10, "10 snapshot replies")
        resyncs, beats = sub.resyncs, master.heartbeats["explorer-0"]
        await listen_until(lambda: master.heartbeats["explorer-0"] >= beats + 3,
                           "3 heartbeats among the snapshot replies")
    finally:
        await beat.close()
        await sub.close()
        await client.close()
        await master.close()
    assert sub.resyncs > resyncs  # the replies went on arriving while the heartbeats did


class DeclaredDeadAfterPut(Explorer):
    """An explorer the master declares dead right after the buffer acked its second batch
    (and once the trainer published a newer version, so the redo rolls out with it)."""

    def __init__(self, *args, master: Master, **kwargs):
        super().__init__(*args, **kwargs)
        self.master_service = master
        self.puts = 0

    async def _put(self, experiences, barrier, images):
        await super()._put(experiences, barrier, images)
        self.puts += 1
        if self.puts == 2:
            deadline = time.monotonic() + BACKSTOP
            while self.master_service.clock.newest < 1:
                assert time.monotonic() < deadline, "the trainer published no version 1"
                await asyncio.sleep(0.05)
            await declare_dead(self.master_service, self.name)
            if isinstance(self.master_service, StaleHeartbeatRefusalMaster):
                # a heartbeat is refused (and held) before the explorer learns it is dead
                await asyncio.wait_for(self.master_service.refusal_held.wait(), BACKSTOP)


class StaleHeartbeatRefusalMaster(Master):
    """A master that answers the first heartbeat it refuses as `declared_dead` only after it
    answered the explorer's next Register: the interleaving a loaded machine can draw, where a
    heartbeat sent before the explorer registered again is refused after it did. That refusal
    speaks of the registration that ended; the explorer must not register a third time."""

    def __init__(self, config):
        super().__init__(config)
        self.registered = asyncio.Event()
        self.refusal_held = asyncio.Event()
        self.held_refusals = 0

    async def _on_register(self, msg, ctx):
        reply = await super()._on_register(msg, ctx)
        if self.held_refusals:
            self.registered.set()
        return reply

    async def _on_heartbeat(self, msg, ctx):
        try:
            return await super()._on_heartbeat(msg, ctx)
        except RequestFailed as exc:
            if exc.code == "declared_dead" and not self.held_refusals:
                self.held_refusals += 1
                self.refusal_held.set()
                await asyncio.wait_for(self.registered.wait(), BACKSTOP)
            raise


def groups_per_task(config) -> tuple[Counter, int]:
    db = sqlite3.connect(f"file:{config.run_dir}/{config.buffer.db}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT group_id, task_id FROM groups").fetchall()
        stored = db.execute("SELECT count(*) FROM experiences").fetchone()[0]
    finally:
        db.close()
    return Counter(task for _, task in rows), stored


@pytest.mark.parametrize("master_type", [Master, StaleHeartbeatRefusalMaster],
                         ids=["refusals_in_order", "a_refusal_answered_after_it_registered"])
async def test_an_explorer_declared_dead_after_its_put_registers_again_and_stores_nothing_twice(
        tmp_path, tiny_model_path, master_type):
    # Declared dead once, it registers again once, whichever order the master answers its
    # requests in: with StaleHeartbeatRefusalMaster a heartbeat refused as dead reaches it
    # only after its new registration was answered (before the fix it registered again)
    config = make_config(tmp_path, tiny_model_path, "sync.preset=fully_async",
                         "sync.method=checkpoint", "sync.offset=null", "master.total_steps=3")
    master = master_type(config)
    await master.start()
    buffer = Buffer(config)
    config.buffer.address = await buffer.start()
    config.master.address = master.address
    engine = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    trained = TransformersEngine.from_pretrained(tiny_model_path)
    explorer = DeclaredDeadAfterPut(config, "explorer-0", engine=engine, master=master)
    trainer = asyncio.create_task(play_trainer(config, master.address, master.publish_address,
                                               trained, []))
    try:
        await asyncio.wait_for(explorer.serve(), BACKSTOP)
        await asyncio.wait_for(trainer, BACKSTOP)
        status = master.status()
    finally:
        trainer.cancel()
        await explorer.close()
        await buffer.close()
        await master.close()
        engine.close()
        trained.close()
    assert explorer.rejoins == 1 and explorer.stop_reason.startswith("done")
    if master_type is StaleHeartbeatRefusalMaster:
        assert master.held_refusals == 1 and master.registered.is_set()
    assert status.counters.batches_lost == 1 and status.counters.batches_done == 3
    # 3 batches of 2 tasks counted, and the lost batch's 2 tasks rolled out again with
    # version 1: each task has one group of repeat_times=2 experiences, nothing stored twice
    per_task, stored = groups_per_task(config)
    assert len(per_task) == 6 and set(per_task.values()) == {1}
    assert stored == 6 * 2
    assert status.counters.tasks_completed == 6


async def test_a_batch_completed_before_its_explorer_died_counts_once(tmp_path,
                                                                     tiny_model_path):
    # Put and CompleteTasks went through; the explorer died before ExplorerStepDone. Its tasks
    # are not leased again, so the batch must count as done (not lost, which left its groups
    # in the buffer untrained and a batch of new tasks rolled out in its place).
    config = make_config(tmp_path, tiny_model_path, "sync.preset=fully_async",
                         "sync.method=checkpoint", "sync.offset=null", "master.total_steps=2")
    master = Master(config)
    await master.start()
    client = RpcClient(master.address, peer="master", name="explorer-0")
    sub = Subscriber(master.publish_address, topics=[barrier_topic("explorer-0")],
                     snapshot=client, resync_interval=0.2)
    try:
        await client.call(Register(name="explorer-0", role="explorer", pid=os.getpid()),
                          timeout=BACKSTOP)
        barrier = (await sub.recv(BACKSTOP, what="barrier")).body
        lease = await client.call(LeaseTasks(explorer="explorer-0", count=2, step=barrier.step),
                                  timeout=BACKSTOP)
        await client.call(CompleteTasks(lease_id=lease.lease_id), timeout=BACKSTOP)
        await declare_dead(master, "explorer-0")
        status = master.status()
        # its restart registers and is granted the next batch, with new tasks
        await client.call(Register(name="explorer-0", role="explorer", pid=os.getpid()),
                          timeout=BACKSTOP)
        again = None
        while again is None or again.batch == barrier.batch:
            again = (await sub.recv(BACKSTOP, what="barrier")).body
        lease2 = await client.call(LeaseTasks(explorer="explorer-0", count=2, step=again.step),
                                   timeout=BACKSTOP)
    finally:
        await sub.close()
        await client.close()
        await master.close()
    assert status.counters.batches_done == 1 and status.counters.batches_lost == 0
    assert status.counters.tasks_returned == 0
    assert master.clock.last_go is not None and master.clock.last_go.groups == 2
    assert {t.id for t in lease2.tasks}.isdisjoint({t.id for t in lease.tasks})


@pytest.mark.parametrize("client", ["explorer", "reward"])
async def test_a_score_request_in_flight_when_the_reward_service_dies_is_answered_by_its_restart(
        client, zmq_sockets_closed):
    # The first service takes the request and dies with it (closes without answering); a new
    # service on the same address must get the request again, resent every reward.timeout.
    # Before the fix it was never resent: the explorer waited the whole request_timeout and
    # exited. The request_timeout is twice BACKSTOP: a request never resent outlasts the wait.
    address = f"tcp://127.0.0.1:{free_port()}"
    reward = RewardConfig(functions={"format": 1.0}, workers=1, service=True, address=address,
                          timeout=0.5, request_timeout=2 * BACKSTOP)
    config = RunConfig(reward=reward)
    took = asyncio.Event()
    budget: list[float] = []

    async def swallow(msg, ctx):
        budget.append(ctx.remaining())
        took.set()
        await asyncio.Event().wait()  # killed before it answers

    doomed = RpcServer(address, name="reward")
    doomed.register(ScoreBatch, swallow)
    await doomed.start()
    scorer = (create_scorer(reward, config.transport, name="explorer-0") if client == "explorer"
              else build_scorer(reward, config.transport))
    restarted = None
    try:
        scoring = asyncio.create_task(scorer.score([ScoreItem(response="<think>x</think><answer>1</answer>")]))
        await asyncio.wait_for(took.wait(), BACKSTOP)
        await doomed.close()
        restarted = RewardService(config, address=address)
        await restarted.start()
        # Never resent, the request would wait out reward.request_timeout; resent, the
        # restarted service answers it, however long its start took
        [score] = await asyncio.wait_for(scoring, BACKSTOP)
        assert restarted.requests >= 1 and score.score == 1.0
        # resent every reward.timeout, but the service may spend the whole request_timeout:
        # more than BACKSTOP of it is left (a resend's budget, or a default's, is less)
        assert budget[0] > BACKSTOP
    finally:
        await scorer.close()
        if restarted is not None:
            await restarted.close()
