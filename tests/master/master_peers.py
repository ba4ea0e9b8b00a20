"""Peers that speak the master protocol over real sockets, shared by the master's tests."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from backstop import BACKSTOP, PATIENT
from tandem.common.config import load_config
from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerStepDone,
    Goodbye,
    LeaseTasks,
    Register,
    TrainerCheckpointed,
    TrainerStepDone,
    WeightsPublished,
    barrier_topic,
)
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient
from tandem.master.service import Master

# a call waits for its answer however slow the machine is; only a hang runs it out


def write_tasks(path: Path, n: int) -> Path:
    with open(path, "w") as f:
        f.writelines(json.dumps({"id": f"t{i}", "prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(n))
    return path


def make_config(tmp_path: Path, *overrides: str, tasks: int = 40):
    taskset = write_tasks(tmp_path / "tasks.jsonl", tasks)
    return load_config(None, [
        f"run_dir={tmp_path / 'run'}", "master.address=tcp://127.0.0.1:0",
        "master.publish_address=tcp://127.0.0.1:0", f"master.taskset.path={taskset}",
        "master.taskset.id_field=id", "master.stop_grace=0.2",
        # these peers send no heartbeats: none is declared dead unless a test lowers this
        f"transport.liveness={BACKSTOP}", "transport.heartbeat_interval=0.1",
        "explorers.0.batch_size=4", *overrides])


def master_client(master, name: str) -> RpcClient:
    """An RPC client of `master` (anything with its `address`) whose calls wait for their
    answer up to BACKSTOP."""
    return RpcClient(master.address, peer="master", name=name, transport=PATIENT)


class Peer:
    """A component speaking the master protocol over real sockets (as an explorer would)."""

    def __init__(self, master: Master, name: str, role: str, topics: list[str]):
        self.name, self.role = name, role
        self.rpc = master_client(master, name)
        self.sub = Subscriber(master.publish_address, topics=topics,
                              snapshot=RpcClient(master.address, peer="master", name=name + "-s"),
                              resync_interval=0.2)

    async def start(self):
        await self.sub.start()
        return await self.rpc.call(Register(name=self.name, role=self.role, pid=os.getpid()))

    async def next(self, kind: str, timeout: float = BACKSTOP):
        while True:
            ev = await self.sub.recv(timeout, what=kind)
            if ev.topic.startswith(kind) or ev.topic == "stop":
                return ev.body

    async def close(self, goodbye: bool = False):
        if goodbye:  # as a component's close() ends: leaving, after the Stop
            await self.rpc.call(Goodbye(name=self.name))
        await self.sub.close()
        await self.sub.snapshot_client.close()
        await self.rpc.close()


async def explorer_loop(master: Master, name: str, steps_seen: list, batch_size: int = 4,
                        goodbye: bool = False):
    peer = Peer(master, name, "explorer", [barrier_topic(name), "stop"])
    await peer.start()
    try:
        last = -1
        while True:
            msg = await peer.next("barrier")
            if msg.TYPE == "master.stop":
                return
            if msg.batch <= last:
                continue  # a repeat
            last = msg.batch
            lease = await peer.rpc.call(LeaseTasks(explorer=name, count=batch_size, step=msg.step))
            await asyncio.sleep(0.01)  # "roll out"
            await peer.rpc.call(CompleteTasks(lease_id=lease.lease_id))
            steps_seen.append((name, msg.step, msg.version, msg.wait,
                               [t.id for t in lease.tasks]))
            await peer.rpc.call(ExplorerStepDone(explorer=name, step=msg.step, batch=msg.batch,
                                                 version=msg.version))
    finally:
        await peer.close(goodbye)


async def trainer_loop(master: Master, trained: list, method: str = "checkpoint",
                       until: int | None = None, goodbye: bool = False):
    """Trains every step the master releases and "checkpoints" them on the Stop; with `until`,
    returns when step `until` is released, before training it: a trainer that died between
    two steps, with no report on its way to the master."""
    peer = Peer(master, "trainer", "trainer", ["trainer", "stop"])
    await peer.start()
    try:
        while True:
            msg = await peer.next("trainer")
            if msg.TYPE == "master.stop":
                if trained:
                    await peer.rpc.call(TrainerCheckpointed(step=trained[-1][0] + 1))
                return
            if until is not None and msg.step >= until:
                return
            await asyncio.sleep(0.01)  # "train"
            trained.append((msg.step, msg.publish, msg.groups))
            await peer.rpc.call(TrainerStepDone(step=msg.step, version=msg.step + 1))
            if msg.publish is not None:
                await peer.rpc.call(WeightsPublished(version=msg.publish, method=method,
                                                     path=f"weights/v{msg.publish}"))
    finally:
        await peer.close(goodbye)
