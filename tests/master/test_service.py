"""The master on real loopback sockets: the protocol, leases, liveness, journal and restart."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from backstop import BACKSTOP
from tandem.common.errors import ConfigError, RequestFailed, WaitTimeout
from tandem.common.messages.base import Heartbeat
from tandem.common.messages.master import (
    CompleteTasks,
    ExplorerStepDone,
    GetStatus,
    LeaseTasks,
    ReleaseTasks,
    Register,
    TrainerCheckpointed,
    TrainerStepDone,
    WeightsPublished,
    barrier_topic,
)
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient
from tandem.master.cli import tandem
from tandem.master.journal import read_journal
from tandem.master.service import Master
from tandem.common.sockets import free_port

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from processes import until
from master_peers import (Peer, explorer_loop, make_config, master_client, trainer_loop,
                          write_tasks)


async def test_one_step_off_policy_run_end_to_end(tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=one_step_off_policy", "master.total_steps=5")
    master = Master(config)
    serving = asyncio.create_task(master.serve())
    await master.start()
    seen, trained = [], []
    try:
        await asyncio.wait_for(asyncio.gather(explorer_loop(master, "explorer-0", seen),
                                              trainer_loop(master, trained, "nccl")), BACKSTOP)
        await asyncio.wait_for(serving, BACKSTOP)  # the run is done: serve() returns on its own
    finally:
        await master.close()  # the caller closes
    assert [(s, v, w) for _, s, v, w, _ in seen] == [
        (0, 0, False), (1, 0, False), (2, 1, True), (3, 2, True), (4, 3, True)]
    # version 4 would first be used by step 5, past the run: not published
    assert [(t, p) for t, p, _ in trained] == [(0, 1), (1, 2), (2, 3), (3, None), (4, None)]
    # 5 steps x 4 tasks, all distinct, in the seeded shuffle order
    ids = [i for *_, batch in seen for i in batch]
    assert len(ids) == 20 and len(set(ids)) == 20
    records = read_journal(tmp_path / "run" / "master" / "journal.bin")
    kinds = [type(r).__name__ for r in records]
    assert kinds[0] == "RunStarted" and kinds.count("ExplorerStepDone") == 5
    assert kinds.count("TrainerStepDone") == 5 and kinds.count("TasksLeased") == 5


async def test_two_explorers_async_and_status(tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=multi_explorer_async", "master.total_steps=4",
                         "explorers.1.name=explorer-1", "explorers.1.batch_size=4")
    master = Master(config)
    await master.start()
    seen, trained = [], []
    try:
        await asyncio.wait_for(asyncio.gather(
            explorer_loop(master, "explorer-0", seen), explorer_loop(master, "explorer-1", seen),
            trainer_loop(master, trained)), BACKSTOP)
        status = master.status()
    finally:
        await master.close()
    assert len(seen) == 8 and {n for n, *_ in seen} == {"explorer-0", "explorer-1"}
    assert all(v >= s - 4 for _, s, v, _, _ in seen)
    assert [t for t, _, _ in trained] == [0, 1, 2, 3]
    assert [g for _, _, g in trained] == [8, 8, 8, 8]  # two batches of 4 tasks per step
    assert status.counters.stopped and status.counters.batches_done == 8
    assert {c.name for c in status.components} == {"explorer-0", "explorer-1", "trainer"}


async def test_lease_expires_and_goes_to_another_explorer(tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=2", "master.task_lease_seconds=0.3")
    master = Master(config)
    await master.start()
    client = master_client(master, "x")
    try:
        first = await client.call(LeaseTasks(explorer="a", count=3, step=0))
        await until(lambda: master.dispatcher.expired, "the lease's expiry")
        second = await client.call(LeaseTasks(explorer="b", count=4, step=0))
        got = [t.id for t in second.tasks]
        assert got[:3] == [t.id for t in first.tasks] and len(got) == 4
        # the late completion of the expired lease is accepted; an unknown lease is refused
        await client.call(CompleteTasks(lease_id=first.lease_id))
        with pytest.raises(RequestFailed, match="unknown_lease"):
            await client.call(CompleteTasks(lease_id="nope"))
        assert master.dispatcher.expired == 1
    finally:
        await client.close()
        await master.close()


async def test_released_lease_goes_to_the_next_explorer_at_once(tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=2")  # leases last 300 s
    master = Master(config)
    await master.start()
    client = master_client(master, "x")
    try:
        first = await client.call(LeaseTasks(explorer="a", count=3, step=0))
        again = await client.call(LeaseTasks(explorer="a", count=3, step=0))
        assert again.lease_id == first.lease_id  # asking twice for one step is one lease
        await client.call(ReleaseTasks(lease_id=first.lease_id, reason="stopping"))
        await client.call(ReleaseTasks(lease_id=first.lease_id))  # idempotent
        second = await client.call(LeaseTasks(explorer="b", count=3, step=0))
        assert [t.id for t in second.tasks] == [t.id for t in first.tasks]
        assert master.dispatcher.expired == 1
    finally:
        await client.close()
        await master.close()


async def test_silent_explorer_is_declared_dead_and_its_lease_returns(tmp_path,
                                                                      zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=3", "transport.liveness=1")
    master = Master(config)
    await master.start()
    a = master_client(master, "a")
    b = master_client(master, "b")
    try:
        await a.call(Register(name="explorer-0", role="explorer"))
        lease = await a.call(LeaseTasks(explorer="explorer-0", count=4, step=0))
        await b.call(Register(name="explorer-1", role="explorer"))
        deadline = time.monotonic() + BACKSTOP
        while master.registry["explorer-0"].alive:  # explorer-1 heartbeats, explorer-0 is silent
            assert time.monotonic() < deadline, "explorer-0 was never declared dead"
            await b.call(Heartbeat(name="explorer-1", role="explorer"))
            await asyncio.sleep(0.05)
        status = await b.call(GetStatus())
        alive = {c.name: c.alive for c in status.components}
        assert alive == {"explorer-0": False, "explorer-1": True}
        assert status.counters.batches_lost == 1 and status.leases == []
        taken = await b.call(LeaseTasks(explorer="explorer-1", count=4, step=0))
        assert [t.id for t in taken.tasks] == [t.id for t in lease.tasks]
        # the dead explorer wakes up: its report is refused until it registers again
        with pytest.raises(RequestFailed, match="declared dead.*register again"):
            await a.call(ExplorerStepDone(explorer="explorer-0", step=0, batch=0, version=0))
        await a.call(Register(name="explorer-0", role="explorer"))
        status = await b.call(GetStatus())
        assert {c.name: c.alive for c in status.components}["explorer-0"] is True
    finally:
        await a.close()
        await b.close()
        await master.close()


async def test_step_report_completes_its_lease_in_one_round_trip(tmp_path, zmq_sockets_closed):
    """ExplorerStepDone with `lease_id` completes the lease first, journaled as CompleteTasks
    (a restart replays what two messages left); a lease that is no longer open is warned of,
    and the report still counts."""
    config = make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=3")
    master = Master(config)
    await master.start()
    peer = Peer(master, "explorer-0", "explorer", [barrier_topic("explorer-0"), "stop"])
    await peer.start()
    trainer = master_client(master, "trainer")
    try:
        await peer.next("barrier")
        lease0 = await peer.rpc.call(LeaseTasks(explorer="explorer-0", count=4, step=0))
        await peer.rpc.call(ExplorerStepDone(explorer="explorer-0", step=0, batch=0, version=0,
                                             lease_id=lease0.lease_id))
        assert lease0.lease_id in master.dispatcher.done_ids
        assert master.clock.batches_done == 1
        records = [type(r).__name__ for r in read_journal(master.journal.path)]
        assert records[-2:] == ["CompleteTasks", "ExplorerStepDone"]
        assert all(getattr(r, "lease_id", None) is None for r in read_journal(master.journal.path)
                   if isinstance(r, ExplorerStepDone))
        await trainer.call(Register(name="trainer", role="trainer"))
        await trainer.call(TrainerStepDone(step=0, version=1))
        await trainer.call(WeightsPublished(version=1, method="nccl"))
        await peer.next("barrier")
        await peer.rpc.call(LeaseTasks(explorer="explorer-0", count=4, step=1))
        # not a lease of this run: warned of, and step 1 is counted all the same
        await peer.rpc.call(ExplorerStepDone(explorer="explorer-0", step=1, batch=1, version=1,
                                             lease_id="nope"))
        assert master.clock.batches_done == 2
    finally:
        await peer.close()
        await trainer.close()
        await master.close()
    master2 = Master(config.model_copy(deep=True))
    await master2.start()
    try:
        assert lease0.lease_id in master2.dispatcher.done_ids
    finally:
        await master2.close()


async def test_restarted_master_resumes_cursor_clock_and_sequence(tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=6")
    master = Master(config)
    await master.start()
    peer = Peer(master, "explorer-0", "explorer", [barrier_topic("explorer-0"), "stop"])
    await peer.start()
    await peer.next("barrier")
    lease0 = await peer.rpc.call(LeaseTasks(explorer="explorer-0", count=4, step=0))
    await peer.rpc.call(CompleteTasks(lease_id=lease0.lease_id))
    await peer.rpc.call(ExplorerStepDone(explorer="explorer-0", step=0, batch=0, version=0))
    trainer = master_client(master, "trainer")
    await trainer.call(Register(name="trainer", role="trainer"))
    await trainer.call(TrainerStepDone(step=0, version=1))
    await trainer.call(WeightsPublished(version=1, method="nccl"))
    b1 = await peer.next("barrier")
    assert (b1.step, b1.version, b1.wait) == (1, 1, True)
    run_id = master.run_id
    await master.close()
    await peer.close()
    await trainer.close()

    config2 = config.model_copy(deep=True)
    master2 = Master(config2)
    await master2.start()
    try:
        assert master2.resumed and master2.run_id == run_id
        assert master2.clock.trainer_done == 1 and master2.clock.newest == 1
        # a late joiner's snapshot has the barrier it was given, numbered after the old ones
        sub = Subscriber(master2.publish_address, topics=[barrier_topic("explorer-0")],
                         snapshot=RpcClient(master2.address, peer="master", name="s"))
        await sub.start()
        ev = await sub.recv(BACKSTOP)
        assert (ev.body.step, ev.body.batch) == (1, 1) and ev.seq > 2
        await sub.close()
        await sub.snapshot_client.close()
        # the cursor survived: the next lease holds tasks nobody got before
        client = master_client(master2, "c")
        lease1 = await client.call(LeaseTasks(explorer="explorer-0", count=4, step=1))
        assert not {t.id for t in lease1.tasks} & {t.id for t in lease0.tasks}
        await client.close()
    finally:
        await master2.close()


async def test_resuming_with_another_sync_plan_is_refused(tmp_path, zmq_sockets_closed):
    master = Master(make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=3"))
    await master.start()
    await master.close()
    other = Master(make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=3"))
    with pytest.raises(ConfigError, match="holds the journal of run .* new run_dir"):
        await other.start()
    await other.close()


async def test_reports_out_of_turn_are_refused(tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=3")
    master = Master(config)
    await master.start()
    client = master_client(master, "x")
    try:
        with pytest.raises(RequestFailed, match="unexpected_step.*not registered"):
            await client.call(ExplorerStepDone(explorer="ghost", step=0, version=0))
        await client.call(Register(name="explorer-0", role="explorer"))
        with pytest.raises(RequestFailed, match="granted step 0"):
            await client.call(ExplorerStepDone(explorer="explorer-0", step=2, version=0))
    finally:
        await client.close()
        await master.close()


async def test_tandem_status_cli(tmp_path, zmq_sockets_closed):
    config = make_config(tmp_path, "master.total_steps=3")
    master = Master(config)
    await master.start()
    client = master_client(master, "x")
    try:
        await client.call(Register(name="explorer-0", role="explorer"))
        runner = CliRunner()
        wait = ["--timeout", str(BACKSTOP)]
        result = await asyncio.to_thread(runner.invoke, tandem, ["status", "--master",
                                                                 master.address, *wait])
        assert result.exit_code == 0, result.output
        for text in ("explorer-0", "trainer step 0/3", "tasks 0/40"):
            assert text in result.output
        result = await asyncio.to_thread(runner.invoke, tandem, [
            "status", "--master", master.address, "--json", *wait])
        assert json.loads(result.output)["counters"]["total_steps"] == 3
    finally:
        await client.close()
        await master.close()


def test_tandem_status_without_a_master_is_a_one_line_error():
    result = CliRunner().invoke(tandem, ["status", "--master", "tcp://127.0.0.1:1",
                                         "--timeout", "0.2"])
    assert result.exit_code == 1
    assert "did not answer" in result.output and "Traceback" not in result.output


def test_tandem_master_process_exits_cleanly_on_sigterm(tmp_path):
    tasks = write_tasks(tmp_path / "tasks.jsonl", 8)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\nmaster:\n  address: tcp://127.0.0.1:0\n"
                   f"  publish_address: tcp://127.0.0.1:0\n  taskset:\n    path: {tasks}\n")
    exe = Path(sys.executable).with_name("tandem-master")
    proc = subprocess.Popen([str(exe), "--config", str(cfg), "--set", "logging.json_console=true"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + BACKSTOP
        journal = tmp_path / "run" / "master" / "journal.bin"
        while not journal.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert journal.exists(), proc.stderr.read() if proc.poll() is not None else "no journal"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=BACKSTOP) == 0
        assert "master.closed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tandem_master_bad_config_is_a_one_line_error(tmp_path):
    exe = Path(sys.executable).with_name("tandem-master")
    result = subprocess.run([str(exe), "--set", "master.task_lease_seconds=-1"],
                            capture_output=True, text=True, timeout=BACKSTOP)
    assert result.returncode == 2  # a bad config is exit 2 in every CLI (docs/design.md §8)
    assert "master.task_lease_seconds" in result.stderr and "Traceback" not in result.stderr


async def test_barrier_topics_do_not_leak_between_explorers(tmp_path, zmq_sockets_closed):
    names = [f"explorer-{i}" for i in (1, 10, 11)]
    config = make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=3",
                         *[f"explorers.{i}.name={n}" for i, n in enumerate(names)])
    master = Master(config)
    await master.start()
    peer = Peer(master, "explorer-1", "explorer", [barrier_topic("explorer-1")])
    others = master_client(master, "others")
    try:
        await others.call(Register(name="explorer-10", role="explorer"))
        await others.call(Register(name="explorer-11", role="explorer"))
        await peer.start()
        got = [await peer.sub.recv(BACKSTOP)]
        with pytest.raises(WaitTimeout):
            got.append(await peer.sub.recv(0.5))
        assert [e.body.explorer for e in got] == ["explorer-1"]
    finally:
        await others.close()
        await peer.close()
        await master.close()


async def test_run_stops_when_the_taskset_runs_dry(tmp_path, zmq_sockets_closed):
    # 10 tasks, batches of 4: two full steps, a third of 2 tasks, then nothing
    config = make_config(tmp_path, "master.total_steps=5", "sync.preset=one_step_off_policy",
                         tasks=10)
    master = Master(config)
    await master.start()
    seen, trained = [], []

    async def explorer():
        peer = Peer(master, "explorer-0", "explorer", [barrier_topic("explorer-0"), "stop"])
        await peer.start()
        try:
            while True:
                msg = await peer.next("barrier")
                if msg.TYPE == "master.stop":
                    return msg
                lease = await peer.rpc.call(LeaseTasks(explorer="explorer-0", count=4,
                                                       step=msg.step))
                if not lease.tasks:
                    assert lease.exhausted
                    continue  # a real explorer exits here; we wait to see the Stop
                seen.append(len(lease.tasks))
                await peer.rpc.call(CompleteTasks(lease_id=lease.lease_id))
                await peer.rpc.call(ExplorerStepDone(explorer="explorer-0", step=msg.step,
                                                     batch=msg.batch, version=msg.version))
        finally:
            await peer.close()

    try:
        stop, _ = await asyncio.wait_for(asyncio.gather(explorer(), trainer_loop(master, trained)),
                                         BACKSTOP)
    finally:
        await master.close()
    assert seen == [4, 4, 2]
    assert trained == [(0, 1, 4), (1, 2, 4), (2, 3, 2)]
    assert "taskset exhausted after 3 of 5" in stop.reason


async def test_killed_master_process_restarts_and_the_run_finishes(tmp_path, zmq_sockets_closed):
    """kill -9 the master mid-run; a new one on the same run dir resumes; peers reconnect."""
    tasks = write_tasks(tmp_path / "tasks.jsonl", 40)
    rpc, pub = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"run_dir: {tmp_path / 'run'}\nsync: {{preset: one_step_off_policy}}\n"
        f"master: {{address: '{rpc}', publish_address: '{pub}', total_steps: 6, "
        f"stop_grace: 0.5, taskset: {{path: '{tasks}', id_field: id}}}}\n"
        f"transport: {{liveness: {BACKSTOP}, heartbeat_interval: 0.2}}\n"
        "explorers: [{name: explorer-0, batch_size: 4}]\n"
        "logging: {level: warning}\n")
    exe = Path(sys.executable).with_name("tandem-master")
    start = lambda: subprocess.Popen([str(exe), "--config", str(cfg)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [start()]
    seen, trained, killed = [], [], asyncio.Event()

    class Addr:  # what the loops need of a master
        address, publish_address = rpc, pub

    async def call(client, msg):  # resent every 2 s, so that a restarted master gets it
        return await client.call(msg, timeout=2, retries=int(BACKSTOP / 2))

    async def explorer():
        peer = Peer(Addr, "explorer-0", "explorer", [barrier_topic("explorer-0"), "stop"])
        await call(peer.rpc, Register(name="explorer-0", role="explorer"))
        await peer.sub.start()
        last = -1
        try:
            while True:
                msg = await peer.next("barrier")
                if msg.TYPE == "master.stop":
                    return
                if msg.batch <= last:
                    continue
                last = msg.batch
                lease = await call(peer.rpc, LeaseTasks(explorer="explorer-0", count=4,
                                                        step=msg.step))
                await call(peer.rpc, CompleteTasks(lease_id=lease.lease_id))
                seen.append((msg.step, msg.version, [t.id for t in lease.tasks]))
                if msg.step == 2 and not killed.is_set():
                    procs[0].kill()  # mid-step: the report below goes to the next master
                    procs[0].wait()
                    killed.set()
                await call(peer.rpc, ExplorerStepDone(explorer="explorer-0", step=msg.step,
                                                      batch=msg.batch, version=msg.version))
        finally:
            await peer.close()

    async def trainer():
        peer = Peer(Addr, "trainer", "trainer", ["trainer", "stop"])
        await call(peer.rpc, Register(name="trainer", role="trainer"))
        await peer.sub.start()
        last = -1
        try:
            while True:
                msg = await peer.next("trainer")
                if msg.TYPE == "master.stop":  # its last checkpoint: the run is done
                    await call(peer.rpc, TrainerCheckpointed(step=last + 1))
                    return
                if msg.step <= last:
                    continue
                last = msg.step
                trained.append(msg.step)
                await call(peer.rpc, TrainerStepDone(step=msg.step, version=msg.step + 1))
                if msg.publish is not None:
                    await call(peer.rpc, WeightsPublished(version=msg.publish,
                                                          method="checkpoint"))
        finally:
            await peer.close()

    async def restart():
        await killed.wait()
        procs.append(start())

    try:
        await asyncio.wait_for(asyncio.gather(explorer(), trainer(), restart()), BACKSTOP)
        assert procs[1].wait(timeout=BACKSTOP) == 0  # it stops on its own once the run is done
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [(s, v) for s, v, _ in seen] == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3), (5, 4)]
    assert trained == [0, 1, 2, 3, 4, 5]
    ids = [i for *_, batch in seen for i in batch]
    assert len(ids) == len(set(ids)) == 24  # the cursor survived: no task handed out twice


async def test_a_component_that_disagrees_with_the_master_is_refused(tmp_path,
                                                                    zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=3",
                         "model.path=/models/a", "transport.liveness=7",
                         "transport.heartbeat_interval=0.5")
    trainer_config = make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=3",
                                 "model.path=/models/b", "sync.interval=2")
    master = Master(config)
    await master.start()
    client = master_client(master, "x")
    try:
        with pytest.raises(RequestFailed) as refused:
            await client.call(Register(name="trainer", role="trainer",
                                       terms=trainer_config.terms("trainer", "trainer")))
        assert refused.value.code == "config_mismatch"
        assert ("model.path: master has '/models/a', trainer trainer has '/models/b'; "
                "sync.interval: master has 1, trainer trainer has 2") in refused.value.message
        with pytest.raises(RequestFailed, match=r"explorers\[explorer-9\].batch_size: the "
                                                "master's config has no such key"):
            await client.call(Register(name="explorer-9", role="explorer", terms={
                "explorers[explorer-9].batch_size": 4}))
        assert master.registry == {}  # refused: not registered, not journaled
        assert [type(m).__name__ for m in read_journal(master.journal.path)] == ["RunStarted"]
        # the same terms as the master's: accepted, with the master's heartbeat timing
        registered = await client.call(Register(name="trainer", role="trainer",
                                                terms=config.terms("trainer", "trainer")))
        assert (registered.liveness, registered.heartbeat_interval) == (7.0, 0.5)
    finally:
        await client.close()
        await master.close()


async def test_an_explorer_process_with_another_sync_interval_exits_1_naming_it(
        tmp_path, tiny_model_dir, zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=synchronous", "master.total_steps=3",
                         f"model.path={tiny_model_dir}", "explorers.0.name=e0")
    master = Master(config)
    await master.start()
    try:
        run = config.model_dump(mode="json")
        run["master"]["address"] = master.address
        run["master"]["publish_address"] = master.publish_address
        run["sync"] = {"method": "nccl", "interval": 2, "offset": 0, "max_staleness": 0}
        # its own run dir, as on another host: on the master's, the explorer's CLI would refuse
        # the other config before it starts (tandem.common.runrecord)
        run["run_dir"] = str(tmp_path / "explorer-run")
        path = tmp_path / "explorer.yaml"
        path.write_text(json.dumps(run))  # JSON is YAML
        exe = Path(sys.executable).with_name("tandem-explorer")
        result = await asyncio.to_thread(
            subprocess.run, [str(exe), "--config", str(path), "--name", "e0",
                             "--set", "logging.level=warning"],
            capture_output=True, text=True, timeout=BACKSTOP)
    finally:
        await master.close()
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "config_mismatch" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "sync.interval: master has 1, explorer e0 has 2" in errors[0]


async def test_a_trainer_process_with_another_model_path_exits_1_naming_it(
        tmp_path, tiny_model_dir, zmq_sockets_closed):
    config = make_config(tmp_path, "sync.preset=fully_async", "master.total_steps=3",
                         f"model.path={tiny_model_dir}", "trainer.device=cpu")
    other = tmp_path / "same-model-elsewhere"
    other.symlink_to(tiny_model_dir, target_is_directory=True)
    master = Master(config)
    await master.start()
    try:
        run = config.model_dump(mode="json")
        run["master"]["address"] = master.address
        run["master"]["publish_address"] = master.publish_address
        run["model"]["path"] = str(other)
        run["run_dir"] = str(tmp_path / "trainer-run")  # as on another host (see above)
        path = tmp_path / "trainer.yaml"
        path.write_text(json.dumps(run))
        exe = Path(sys.executable).with_name("tandem-trainer")
        result = await asyncio.to_thread(
            subprocess.run, [str(exe), "--config", str(path), "--set", "logging.level=warning"],
            capture_output=True, text=True, timeout=BACKSTOP)
    finally:
        await master.close()
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "config_mismatch" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert f"model.path: master has '{tiny_model_dir}', trainer trainer has '{other}'" in errors[0]
