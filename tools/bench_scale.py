"""The control plane at cluster scale, by simulation: the real master and buffer against many
simulated explorers and a simulated trainer.

`tandem-master` and `tandem-buffer` run as their own processes on loopback TCP, from one run
config, exactly as `tandem up` starts them. The explorers (asyncio clients, in `--explorer-procs`
processes) and the trainer (in this process) speak the real protocol with the real clients
(`RpcClient`, `Subscriber`, `Heartbeater`, the messages of `tandem.common.messages`):

    explorer: Register, heartbeats -> Barrier -> LeaseTasks -> "roll out" for --rollout-seconds,
              putting each task's group (--repeat experiences of 1-4k tokens, logprobs, mask) as
              it is "scored", as streaming explorers do -> ExplorerStepDone (completing the
              task lease)
    trainer:  Register, ReleaseLeases, RewindTo(0), TrainerResumed(0), heartbeats -> TrainerGo
              -> its groups, asked for as the step before trained and leased in parts as they
              are put (SampleGroups with min_groups 1; --whole-sample: one SampleGroups after
              the TrainerGo) -> "train" for --train-seconds -> AckLease of every part beside
              TrainerStepDone (carrying WeightsPublished); every --checkpoint-every steps TrainerCheckpointed and the
              buffer's CheckpointSaved, which lets the buffer prune consumed rows

The plan is synchronous over files (`sync: {method: checkpoint, offset: 0}`): every step waits
for every explorer and the trainer, so everything the control plane does lies on the step's
critical path, the worst case for it (an asynchronous plan hides most of it under rollouts).
The reward service is not in the path of experiences (explorers send it texts to score and put
the scored experiences to the buffer themselves), so it is not simulated.

Measured per scale, over the steps after --warmup:
- control plane per step: wall-clock per step minus rollout and train seconds, its share of a
  --step-seconds step (30 s, a GPU step), and where it goes along the critical path;
- master and buffer CPU per step (/proc/<pid>/stat): the step's own work, plus --step-seconds
  of heartbeats and subscription snapshots, measured in two idle phases before the first step;
  resident memory of each process at the window's start and end;
- barrier latency (WeightsPublished sent -> each explorer's Barrier), TrainerGo latency (last
  ExplorerStepDone -> TrainerGo), lease, put, sample and ack round trips, p50/p99;
- buffer put and sample throughput, database size with pruning (peak and at the end);
- journal size and replay time (`Master._replay`, in this process), extrapolated linearly to
  --target-steps; and the replayed state against the live master's (accounting, not timing).
A last phase (--journal-explorers, --journal-steps: 1 explorer x 10,000 steps and 256 x 1,000)
writes journals through the master's own commit path (`Master._commit`: the apply methods and
the journal the handlers use, in this process, no sockets), twice from the same messages: with
compaction off (the journal as it grew before compaction) and with `master.journal_compact_bytes`
(default: the config's). Each is replayed in a fresh process (seconds, peak RSS, the state's
counters); with --before-src, the uncompacted one also by an older tandem checkout (the code
before compaction), side by side.

    .venv/bin/python tools/bench_scale.py [--explorers 16,64,256] [--steps 40,30,20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from tandem.common.errors import PeerDead, RequestFailed, WaitTimeout
from tandem.common.heartbeat import Heartbeater
from tandem.common.logging import configure_logging
from tandem.common.messages.buffer import (
    AckLease, CheckpointSaved, PutExperiences, ReleaseLeases, RewindTo, SampleGroups)
from tandem.common.messages.experience import Experience, repeat_id, task_group_id
from tandem.common.messages.master import (
    Barrier, CompleteTasks, ExplorerStepDone, GetStatus, LeaseTasks, Register, Stop,
    TrainerCheckpointed, TrainerGo, TrainerResumed, TrainerStepDone, WeightsPublished,
    barrier_topic)
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient
from tandem.common.sockets import free_port

BIN = Path(sys.executable).parent
# what a trainer's step report carries, by name (the values do not matter to the master)
TRAINER_METRICS = {k: 0.5 for k in (
    "loss", "pg_loss", "entropy", "kl", "clip_fraction", "grad_norm", "lr", "advantage_mean",
    "advantage_std", "reward_mean", "reward_std", "response_len_mean", "tokens", "train_s",
    "buffer/dropped_stale", "staleness_mean")}
TIMEOUT = 120.0  # any one wait of the simulation; a run that needs longer is broken, not slow


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    """Resident memory of a process, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def disk_bytes(path: Path) -> int:
    """A SQLite database with its -wal and -shm files."""
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal"),
                                          path.with_name(path.name + "-shm")) if p.exists())


# -- the run: config, processes ------------------------------------------------------------------

def write_run(root: Path, explorers: int, steps: int, args) -> Path:
    tasks = root / "tasks.jsonl"
    with open(tasks, "w") as f:
        f.writelines(json.dumps({"id": f"t{i}", "prompt": f"task {i}"}) + "\n"
                     for i in range(explorers * args.tasks_per_explorer * steps))
    names = "".join(f"  - {{name: explorer-{i}, batch_size: {args.tasks_per_explorer}, "
                    f"repeat_times: {args.repeat}}}\n" for i in range(explorers))
    config = root / "run.yaml"
    config.write_text(
        f"name: bench-scale\nrun_dir: {root / 'run'}\n"
        "sync: {method: checkpoint, interval: 1, offset: 0, max_staleness: 0}\n"
        f"master: {{address: 'tcp://127.0.0.1:{free_port()}', "
        f"publish_address: 'tcp://127.0.0.1:{free_port()}', total_steps: {steps}, "
        f"stop_grace: {TIMEOUT}, taskset: {{path: '{tasks}', id_field: id, shuffle: false, "
        "format: {prompt: prompt}}}\n"
        f"buffer: {{address: 'tcp://127.0.0.1:{free_port()}', keep_consumed: 0}}\n"
        "logging: {level: warning}\n"
        f"explorers:\n{names}")
    return config


class Component:
    """A real component process (`tandem-master`, `tandem-buffer`) on the run config."""

    def __init__(self, exe: str, config: Path, log: Path):
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([str(BIN / exe), "--config", str(config)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.name = exe

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def answering(address: str, peer: str, proc: subprocess.Popen) -> None:
    """Returns once the process at `address` answers a request (it may still be importing)."""
    client = RpcClient(address, peer=peer, name="bench-probe")
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{peer} exited with {proc.returncode} before answering")
            try:
                from tandem.common.messages.base import Heartbeat
                await client.call(Heartbeat(name="bench-probe", role="tool"), timeout=0.5,
                                  retries=0)
                return
            except PeerDead:
                continue
        raise RuntimeError(f"{peer} at {address} did not answer within {TIMEOUT:g}s")
    finally:
        await client.close()


# -- simulated explorers -------------------------------------------------------------------------

def synthetic_group(explorer: str, run: str, task, repeat: int, version: int,
                    pool: list[tuple]) -> list[Experience]:
    """One task's group: `repeat` responses built on pre-made arrays of realistic sizes."""
    group = task_group_id(run, task.epoch, task.id)
    return [Experience.model_construct(
        id=repeat_id(group, i), task_id=task.id, group_id=group, tokens=tokens,
        prompt_len=prompt_len, action_mask=mask, logprobs=logprobs, reward=float(i % 2),
        rewards={}, policy_version=version, token_versions=None, explorer=explorer,
        created_at=time.time(), info={}) for i, (tokens, prompt_len, mask, logprobs)
        in enumerate(pool[:repeat])]


def array_pool(seed: int, size: int, low: int, high: int) -> list[tuple]:
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(size):
        n = int(rng.integers(low, high + 1))
        prompt = max(1, n // 4)
        pool.append((rng.integers(0, 150_000, n, dtype=np.int32), prompt,
                     np.ones(n - prompt, np.uint8),
                     -rng.random(n - prompt, dtype=np.float32)))
    return pool


async def explorer(name: str, cfg: dict, waiting, start, stats: dict) -> None:
    master = RpcClient(cfg["master"], peer="master", name=name)
    # the topics and the snapshot client of tandem.explorer.service
    sub = Subscriber(cfg["publish"], topics=[barrier_topic(name), "weights", "trainer", "stop"],
                     snapshot=master)
    buffer = RpcClient(cfg["buffer"], peer="buffer", name=name)
    pool = array_pool(hash(name) % 2**32, cfg["repeat"], cfg["tokens_low"], cfg["tokens_high"])
    heart = None
    try:
        await sub.start()
        reg = await master.call(Register(name=name, role="explorer", pid=os.getpid()),
                                timeout=TIMEOUT)
        heart = Heartbeater(master, name=name, role="explorer",
                            interval=reg.heartbeat_interval, liveness=reg.liveness)
        heart.start()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, waiting.wait, TIMEOUT)
        # idle, as between its steps: waiting on a silent topic, so its subscriber asks the
        # master for a snapshot every second besides the heartbeats
        idle = Subscriber(cfg["publish"], topics=[f"idle.{name}."], snapshot=sub.snapshot_client)
        try:
            while not start.is_set():
                try:
                    await idle.recv(1.0, what="nothing")
                except WaitTimeout:
                    pass
        finally:
            await idle.close()
        last = -1
        while True:
            event = await sub.recv(TIMEOUT, what="barrier")
            if isinstance(event.body, Stop):
                return
            barrier = event.body
            if not isinstance(barrier, Barrier) or barrier.explorer != name \
                    or barrier.batch <= last:
                continue  # another's, or a repeat (a snapshot after a gap)
            last = barrier.batch
            stats["barriers"].append((barrier.step, barrier.version, time.time()))
            t0 = time.time()
            lease = await master.call(LeaseTasks(explorer=name, count=cfg["tasks_per_explorer"],
                                                 step=barrier.step, batch=barrier.batch),
                                      timeout=TIMEOUT)
            stats["lease"].append(time.time() - t0)
            if not lease.tasks:
                return

            async def put(group: list[Experience]) -> None:
                began = time.time()
                result = await buffer.call(PutExperiences(experiences=group,
                                                          group_size=cfg["repeat"]),
                                           timeout=TIMEOUT)
                stats["put"].append((began, time.time(), len(group)))
                stats["stored"] += result.stored
                stats["duplicates"] += result.duplicates
                stats["groups_put"].append(group[0].group_id)

            # each task's group is put as soon as it is "scored", while the rest "generate"
            puts = []
            for task in lease.tasks:
                await asyncio.sleep(cfg["rollout_seconds"] / len(lease.tasks))
                group = synthetic_group(name, reg.run_id, task, cfg["repeat"], barrier.version,
                                        pool)
                puts.append(asyncio.create_task(put(group)))
            await asyncio.gather(*puts)
            stats["reports"].append((barrier.step, time.time()))
            # the report's metrics as `step_metrics` makes them (the journal records them); it
            # completes the step's task lease, as the explorer's report does
            metrics = dict(reward_mean=0.5, response_len_mean=1875.0, generated_tokens=30000.0,
                           rollout_s=cfg["rollout_seconds"], tokens_per_s=15000.0)
            await master.call(ExplorerStepDone(explorer=name, step=barrier.step,
                                               version=barrier.version, batch=barrier.batch,
                                               experiences=len(lease.tasks) * cfg["repeat"],
                                               informative=len(lease.tasks), metrics=metrics,
                                               lease_id=lease.lease_id),
                              timeout=TIMEOUT)
    finally:
        if heart is not None:
            await heart.close()
        await sub.close()
        await buffer.close()
        await master.close()


def explorer_host(names: list[str], cfg: dict, waiting, start, results) -> None:
    """One process hosting many simulated explorers; sends their measurements back."""
    stats = {"barriers": [], "lease": [], "put": [], "reports": [], "groups_put": [],
             "stored": 0, "duplicates": 0, "error": None}

    async def run() -> None:
        # each explorer holds 4 sockets; a real one is a process of its own
        zmq.asyncio.Context.instance().set(zmq.MAX_SOCKETS, 8 * len(names) + 64)
        await asyncio.gather(*(explorer(n, cfg, waiting, start, stats) for n in names))

    try:
        asyncio.run(run())
    except Exception as exc:  # reported to the parent, which fails the run naming it
        stats["error"] = f"{type(exc).__name__}: {exc}"
    stats["cpu"] = sum(os.times()[:2])
    results.put(stats)


# -- the simulated trainer, and the measurement ----------------------------------------------

async def trainer(cfg: dict, pids: dict[str, int], waiting, start, args, db: Path) -> dict:
    master = RpcClient(cfg["master"], peer="master", name="trainer")
    buffer = RpcClient(cfg["buffer"], peer="buffer", name="trainer")
    sub = Subscriber(cfg["publish"], topics=["trainer", "stop"], snapshot=master)
    out = {"go": [], "sample": [], "parts": [], "ack": [], "published": {}, "trained": [],
           "groups": [],
           "sampled_bytes": 0, "db_peak": 0}
    heart = None
    try:
        reg = await master.call(Register(name="trainer", role="trainer", pid=os.getpid()),
                                timeout=TIMEOUT)
        await buffer.call(ReleaseLeases(holder="trainer"), timeout=TIMEOUT)
        await buffer.call(RewindTo(step=0), timeout=TIMEOUT)
        await master.call(TrainerResumed(step=0), timeout=TIMEOUT)
        await sub.start()
        heart = Heartbeater(master, name="trainer", role="trainer",
                            interval=reg.heartbeat_interval, liveness=reg.liveness)
        heart.start()
        # idle, before the first step: every explorer heartbeating (all registered once the
        # master counts them alive), then also waiting on its subscription as between steps
        deadline = time.monotonic() + TIMEOUT
        while (await master.call(GetStatus(), timeout=TIMEOUT)).counters.explorers_alive < \
                args.explorers_now:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the explorers did not all register within {TIMEOUT:g}s")
            await asyncio.sleep(0.1)
        for phase, event in (("heartbeats", waiting), ("waiting", start)):
            cpu0, t0 = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
            await asyncio.sleep(args.idle_seconds / 2)
            out[f"idle_{phase}_cpu_per_s"] = {
                k: (cpu_seconds(p) - cpu0[k]) / (time.monotonic() - t0) for k, p in pids.items()}
            event.set()
        async def gather(groups: int) -> list:
            """A step's groups: in parts as they are put (SampleGroups with min_groups 1), as
            the trainer gathers them under fifo with sync points; or (--whole-sample) in one
            lease once all are there."""
            parts: list = []
            while (have := sum(len(p.group_ids) for p in parts)) < groups:
                try:
                    parts.append(await buffer.call(SampleGroups(
                        num_groups=groups - have, min_groups=None if args.whole_sample else 1,
                        wait=10, holder="trainer", lease_seconds=TIMEOUT * 10),
                        timeout=TIMEOUT))
                except RequestFailed as exc:
                    if exc.code != "not_enough":
                        raise
            return parts

        done = 0
        ahead = None
        while True:
            event = await sub.recv(TIMEOUT, what="TrainerGo")
            if isinstance(event.body, Stop):
                out["stop"] = event.body.model_dump()
                break
            go = event.body
            if not isinstance(go, TrainerGo) or go.step < done:
                continue
            arrived = time.time()
            out["go"].append((go.step, arrived))
            # the window: from step `warmup`'s TrainerGo to the last step's, whole steps
            if go.step in (args.warmup, args.steps_now - 1):
                edge = "0" if go.step == args.warmup else "1"
                out["window_cpu" + edge] = {k: cpu_seconds(p) for k, p in pids.items()}
                out["window_t" + edge] = arrived
                out["rss" + edge] = {k: rss_mb(p) for k, p in pids.items()}
            began = time.time()
            if ahead is not None and ahead[:2] == (go.step, go.groups):
                parts = await ahead[2]
            else:
                parts = await gather(go.groups)
            ahead = None
            experiences = [e for p in parts for e in p.experiences]
            out["sample"].append((began, time.time(), len(experiences)))
            out["parts"].append(len(parts))
            out["sampled_bytes"] += sum(e.nbytes for e in experiences)
            out["groups"] += [g for p in parts for g in p.group_ids]
            await asyncio.sleep(args.train_seconds)
            if not args.whole_sample and go.step + 1 < args.steps_now:
                # as the trainer does: the next step's groups asked for once this one trained
                ahead = (go.step + 1, go.groups, asyncio.create_task(gather(go.groups)))

            async def ack() -> None:
                began = time.time()
                await buffer.call(AckLease(lease_id=parts[0].lease_id,
                                           more=[p.lease_id for p in parts[1:]], step=go.step),
                                  timeout=TIMEOUT)
                out["ack"].append(time.time() - began)

            # as the trainer does in a synchronous plan over files: the ack and the count at
            # once, the count carrying the version's announcement
            published = None
            if go.publish is not None:
                out["published"][go.publish] = time.time()
                published = WeightsPublished(version=go.publish, method="checkpoint",
                                             path=f"weights/v{go.publish}")
            await asyncio.gather(ack(), master.call(
                TrainerStepDone(step=go.step, version=go.step + 1, metrics=TRAINER_METRICS,
                                published=published), timeout=TIMEOUT))
            out["trained"].append(go.step)
            done = go.step + 1
            if done % args.checkpoint_every == 0 or done == args.steps_now:
                await master.call(TrainerCheckpointed(step=done, checkpoint=f"step_{done}"),
                                  timeout=TIMEOUT)
                await buffer.call(CheckpointSaved(step=done), timeout=TIMEOUT)
                out["db_peak"] = max(out["db_peak"], disk_bytes(db))
        status = await master.call(GetStatus(), timeout=TIMEOUT)
        out["live_counters"] = status.counters.model_dump()
    finally:
        if heart is not None:
            await heart.close()
        await sub.close()
        await buffer.close()
        await master.close()
    return out


async def replay(config: Path) -> tuple[float, dict, int]:
    """Seconds to replay the journal through the master's own apply methods, the state it
    replays to, and its records."""
    from tandem.common.config import load_config
    from tandem.master.service import Master

    master = Master(load_config(str(config), []))
    try:
        began = time.perf_counter()
        master._replay()
        seconds = time.perf_counter() - began
        return seconds, master.status().counters.model_dump(), master.journal.records
    finally:
        await master.close()


async def simulate(n: int, steps: int, args, root: Path) -> dict:
    root.mkdir(parents=True)
    args.steps_now, args.explorers_now = steps, n
    config = write_run(root, n, steps, args)
    from tandem.common.config import load_config

    run = load_config(str(config), [])
    cfg = dict(master=run.master.address, publish=run.master.publish_address,
               buffer=run.buffer.address, repeat=args.repeat,
               tasks_per_explorer=args.tasks_per_explorer, rollout_seconds=args.rollout_seconds,
               tokens_low=args.tokens[0], tokens_high=args.tokens[1])
    comps = [Component("tandem-master", config, root / "master.log"),
             Component("tandem-buffer", config, root / "buffer.log")]
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    waiting = ctx.Event()
    hosts, hosts_done = [], None
    try:
        await answering(cfg["master"], "master", comps[0].proc)
        await answering(cfg["buffer"], "buffer", comps[1].proc)
        names = [f"explorer-{i}" for i in range(n)]
        procs = min(args.explorer_procs, n)
        hosts = [ctx.Process(target=explorer_host, daemon=True,
                             args=(names[i::procs], cfg, waiting, start, results))
                 for i in range(procs)]
        for h in hosts:
            h.start()
        pids = {"master": comps[0].proc.pid, "buffer": comps[1].proc.pid}
        for i, h in enumerate(hosts):
            pids[f"explorers{i}"] = h.pid
        loop = asyncio.get_running_loop()
        # a component that exits mid-run fails the run at once, naming it
        sim = asyncio.ensure_future(trainer(cfg, pids, waiting, start, args,
                                            Path(run.run_dir) / run.buffer.db))
        exits = [asyncio.ensure_future(asyncio.to_thread(c.proc.wait)) for c in comps]
        hosts_done = asyncio.ensure_future(loop.run_in_executor(None, results.get, True,
                                                                TIMEOUT * 10))
        await asyncio.wait([sim, hosts_done, *exits], return_when=asyncio.FIRST_COMPLETED)
        if hosts_done.done() and not hosts_done.result()["error"] and not sim.done():
            await asyncio.wait([sim, *exits], return_when=asyncio.FIRST_COMPLETED)  # ended well
        if not sim.done():
            sim.cancel()
            await asyncio.gather(sim, return_exceptions=True)
            if hosts_done.done():
                raise RuntimeError(f"simulated explorers failed at {n} explorers: "
                                   f"{hosts_done.result()['error']}")
            dead = next(c for c in comps if c.proc.poll() is not None)
            raise RuntimeError(f"{dead.name} exited with {dead.proc.returncode} during the "
                               f"simulation of {n} explorers; its output: {dead.log.name}")
        trained = sim.result()
        stats = [await hosts_done] + [await loop.run_in_executor(None, results.get, True,
                                                                  TIMEOUT) for _ in hosts[1:]]
        for h in hosts:
            h.join(TIMEOUT)
    finally:
        waiting.set()
        start.set()
        if hosts_done is not None and not hosts_done.done():
            results.put({"error": "stopped"})  # ends the wait for a host that never reports
        for h in hosts:
            if h.is_alive():
                h.terminate()
                h.join(10)
        for comp in comps:
            comp.stop()
    errors = [s["error"] for s in stats if s["error"]]
    if errors:
        raise RuntimeError(f"simulated explorers failed at {n} explorers: {errors[0]}")
    replayed = await replay(config)
    return summarise(n, steps, args, run, trained, stats, replayed)


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds in which at least one of the spans was under way."""
    total, reach = 0.0, float("-inf")
    for began, ended in sorted(spans):
        if ended > reach:
            total += ended - max(began, reach)
            reach = ended
    return total


def ms(values: list[float]) -> dict:
    return dict(p50=pct(values, .5) * 1e3, p99=pct(values, .99) * 1e3)


def summarise(n: int, steps: int, args, run, tr: dict, stats: list[dict], replayed) -> dict:
    merged = {k: [x for s in stats for x in s[k]] for k in
              ("barriers", "lease", "put", "reports", "groups_put")}
    measured = steps - 1 - args.warmup
    window = tr["window_t1"] - tr["window_t0"]
    step_wall = window / measured
    control = step_wall - args.rollout_seconds - args.train_seconds
    cpu = {k: tr["window_cpu1"][k] - tr["window_cpu0"][k] for k in tr["window_cpu0"]}
    beats, idle = tr["idle_heartbeats_cpu_per_s"], tr["idle_waiting_cpu_per_s"]
    # per step of --step-seconds: the step's own work (the window's, less the heartbeats of
    # its compressed steps), plus --step-seconds of everyone heartbeating and waiting on its
    # subscription (an upper bound: explorers do not wait while they roll out)
    at_step = {k: (cpu[k] - beats[k] * window) / measured + idle[k] * args.step_seconds
               for k in ("master", "buffer")}
    # barrier: the version step s waits for is published -> each explorer's Barrier for s
    barrier = [t - tr["published"][v] for s, v, t in merged["barriers"]
               if s >= args.warmup and v in tr["published"]]
    last_report: dict[int, float] = {}
    for s, t in merged["reports"]:
        last_report[s] = max(last_report.get(s, 0.0), t)
    go = [t - last_report[s] for s, t in tr["go"] if s >= args.warmup and s in last_report]
    # the critical path of step s+1, from the trainer's sample for step s, in means over the
    # window's steps: sample -> (train) -> ack and report -> barrier fan-out to the last explorer
    # -> (roll out) -> the last explorer's lease, last put, complete -> its report -> TrainerGo
    go_at = dict(tr["go"])
    first_barrier: dict[int, float] = {}
    last_barrier: dict[int, float] = {}
    for st, _, t in merged["barriers"]:
        first_barrier[st] = min(first_barrier.get(st, t), t)
        last_barrier[st] = max(last_barrier.get(st, 0.0), t)
    path = {k: [] for k in ("sample", "ack_and_report", "barrier_fanout",
                            "lease_put_complete", "report_to_go")}
    for st in range(args.warmup, steps - 1):
        _, sampled, _ = tr["sample"][st]
        published = tr["published"][st + 1]
        path["sample"].append(sampled - go_at[st])
        path["ack_and_report"].append(published - sampled - args.train_seconds)
        path["barrier_fanout"].append(last_barrier[st + 1] - published)
        path["lease_put_complete"].append(last_report[st + 1] - last_barrier[st + 1]
                                          - args.rollout_seconds)
        path["report_to_go"].append(go_at[st + 1] - last_report[st + 1])
    critical = {k: statistics.fmean(v) for k, v in path.items()}
    inside = [(b, e, k) for b, e, k in merged["put"] if tr["window_t0"] <= b < tr["window_t1"]]
    puts, put_exps = [(b, e) for b, e, _ in inside], sum(k for *_, k in inside)
    samples = tr["sample"][args.warmup:-1]
    replay_s, replayed_counters, records = replayed
    journal = Path(run.run_dir) / run.master.journal
    return dict(
        explorers=n, steps=steps, measured_steps=measured,
        experiences_per_step=n * args.tasks_per_explorer * args.repeat,
        step_wall_s=step_wall, control_plane_s=control, critical_path_s=critical,
        control_plane_share=control / args.step_seconds,
        cpu_per_step_s=at_step, cpu_busy={k: v / window for k, v in cpu.items()},
        idle_cpu_per_s=dict(heartbeats=beats, waiting=idle),
        rss_mb=dict(start=tr["rss0"], end=tr["rss1"]),
        barrier_ms=ms(barrier), trainer_go_ms=ms(go), lease_ms=ms(merged["lease"]),
        put_ms=ms([e - b for b, e in puts]), sample_ms=ms([e - b for b, e, _ in samples]),
        ack_ms=ms(tr["ack"][args.warmup:-1]),
        put_exp_per_s=put_exps / busy_seconds(puts) if puts else 0.0,
        sample_exp_per_s=(sum(k for *_, k in samples)
                          / busy_seconds([(b, e) for b, e, _ in samples])) if samples else 0.0,
        sampled_mb_per_step=tr["sampled_bytes"] / steps / 1e6,
        sample_parts=statistics.fmean(tr["parts"][args.warmup:-1]),
        db_peak_mb=tr["db_peak"] / 1e6, db_end_mb=disk_bytes(Path(run.run_dir) / run.buffer.db) / 1e6,
        journal_bytes=journal.stat().st_size, journal_records=records, replay_s=replay_s,
        accounting=dict(
            steps_trained_once=tr["trained"] == list(range(steps)),
            groups_trained_once=len(tr["groups"]) == len(set(tr["groups"])),
            groups_put_all_trained=sorted(set(merged["groups_put"])) == sorted(tr["groups"]),
            groups_trained=len(tr["groups"]),
            experiences_stored=sum(s["stored"] for s in stats),
            duplicates=sum(s["duplicates"] for s in stats),
            replay_matches_live=replayed_counters == tr["live_counters"],
            live_counters=tr["live_counters"]),
        explorer_hosts_cpu_s=sum(s["cpu"] for s in stats))


# -- the journal: compacted, against one that only grows ----------------------------------------

REPLAY = """
import json, resource, sys, time
from tandem.common.config import load_config
from tandem.common.logging import configure_logging
from tandem.master.service import Master
configure_logging("bench-scale-replay", level="error")
master = Master(load_config(sys.argv[1], sys.argv[2:]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
began = time.perf_counter()
master._replay()
seconds = time.perf_counter() - began
print(json.dumps(dict(seconds=seconds, records=master.journal.records,
                      counters=master.status().counters.model_dump(),
                      rss_before_mb=base / 1024,
                      peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


def replay_in_process(config: Path, overrides: list[str], src: Path | None = None) -> dict:
    """Replay a journal in a fresh process: with `src`, an older tandem checkout's packages."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in sorted(src.glob("packages/*/src")))
    out = subprocess.run([sys.executable, "-c", REPLAY, str(config), *overrides], env=env,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"replay ({src or 'this tree'}) failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def write_journals(root: Path, n: int, steps: int, args) -> dict:
    """The same run journaled twice through `Master._commit`, without and with compaction: a
    synchronous run of `n` explorers and `steps` steps, records as the live master's."""
    from tandem.common.config import load_config
    from tandem.common.messages.master import PlanKnobs, RunStarted, TasksLeased
    from tandem.master.service import Master

    root.mkdir(parents=True)
    config = write_run(root, n, 10, args)  # 10 steps of tasks, over steps / 10 epochs
    common = [f"master.total_steps={steps}", f"master.taskset.epochs={max(1, steps // 10)}"]
    plain = common + [f"run_dir={root / 'plain'}", "master.journal_compact_bytes=0"]
    compacted = common + [f"run_dir={root / 'compacted'}"]
    if args.journal_compact_bytes is not None:
        compacted.append(f"master.journal_compact_bytes={args.journal_compact_bytes}")
    masters = [Master(load_config(str(config), o)) for o in (plain, compacted)]
    spent, snapshots, compaction_s = [0.0, 0.0], [], []
    for m in masters:
        m._replay()
        m.journal.open()
        m._commit(RunStarted(run_id="bench-journal", total_steps=steps,
                             plan=PlanKnobs(**m.plan.describe())))
    masters[1].journal.on_compaction_step = (
        lambda step: step == "dir_synced" and snapshots.append(masters[1].journal._bytes))
    barriers, goes = [], []

    def commit(msg) -> None:
        for i, m in enumerate(masters):
            before, began = len(snapshots), time.perf_counter()
            decisions = m._commit(msg)
            spent[i] += time.perf_counter() - began
            if len(snapshots) > before:  # this commit compacted: capture, write, 2 fsyncs
                compaction_s.append(time.perf_counter() - began)
        for topic, d in decisions:
            (barriers if topic.startswith("barrier.") else goes if topic == "trainer"
             else []).append(d)

    commit(Register(name="trainer", role="trainer"))
    for i in range(n):
        commit(Register(name=f"explorer-{i}", role="explorer"))
    metrics = dict(reward_mean=0.5, response_len_mean=1875.0, generated_tokens=30000.0,
                   rollout_s=args.rollout_seconds, tokens_per_s=15000.0)
    dispatcher = masters[0].dispatcher
    while barriers or goes:
        while barriers:
            b = barriers.pop(0)
            lease = dispatcher.new_lease_id()
            commit(TasksLeased(lease_id=lease, explorer=b.explorer, step=b.step,
                               refs=dispatcher.plan_lease(args.tasks_per_explorer),
                               deadline=time.time() + 300, granted_at=time.time()))
            commit(CompleteTasks(lease_id=lease))
            commit(ExplorerStepDone(explorer=b.explorer, step=b.step, version=b.version,
                                    batch=b.batch, informative=args.tasks_per_explorer,
                                    experiences=args.tasks_per_explorer * args.repeat,
                                    metrics=metrics))
        if goes:
            go = goes.pop(0)
            commit(TrainerStepDone(step=go.step, version=go.step + 1, metrics=TRAINER_METRICS))
            if go.publish is not None:
                commit(WeightsPublished(version=go.publish, method="checkpoint",
                                        path=f"weights/v{go.publish}"))
            if (go.step + 1) % args.checkpoint_every == 0:
                commit(TrainerCheckpointed(step=go.step + 1))
    assert all(m.clock.stopped and m.clock.trainer_done == steps for m in masters)
    paths = [m.journal.path for m in masters]
    for m in masters:
        m.journal.close()
    return dict(config=config, overrides=(plain, compacted), bytes=[p.stat().st_size for p in paths],
                records=masters[0].journal.records, commit_s=spent, snapshots=len(snapshots),
                compaction_ms=1e3 * statistics.fmean(compaction_s) if compaction_s else 0.0,
                snapshot_bytes=snapshots[-1] if snapshots else 0,
                compact_bytes=masters[1].journal.compact_bytes)


def journal_phase(root: Path, n: int, steps: int, args) -> dict:
    j = write_journals(root, n, steps, args)
    # replay compacts nothing (only a commit does), and an older tandem has no such key
    plain, compacted = ([o for o in os_ if "journal_compact_bytes" not in o]
                        for os_ in j.pop("overrides"))
    config = j.pop("config")
    j["replay"] = {"this tree, uncompacted": replay_in_process(config, plain),
                   "this tree, compacted": replay_in_process(config, compacted)}
    if args.before_src:
        j["replay"]["before, uncompacted"] = replay_in_process(config, plain,
                                                               Path(args.before_src))
    counters = [r["counters"] for r in j["replay"].values()]
    j.update(explorers=n, steps=steps,
             replay_matches=all(c == counters[0] for c in counters))
    return j


def clock_memory(n: int, steps: int, preset: str, keep_checkpoints: int) -> dict:
    """Bytes `RunClock` holds after a run of `n` explorers and `steps` steps with a checkpoint
    every 10 (tracemalloc), with the trainer keeping `keep_checkpoints` of them."""
    import tracemalloc
    from dataclasses import replace

    from tandem.common.sync import SyncPlan
    from tandem.master.clock import RunClock

    tracemalloc.start()
    try:
        clock = RunClock(replace(SyncPlan.preset(preset), batches_per_step=n), steps,
                         keep_checkpoints=keep_checkpoints)
        barriers, goes = [], []

        def take(decisions) -> None:
            for topic, d in decisions:
                (barriers if topic.startswith("barrier.") else goes if topic == "trainer"
                 else []).append(d)

        for i in range(n):
            take(clock.join(f"explorer-{i}"))
        while barriers or goes:
            if barriers:
                b = barriers.pop(0)
                take(clock.explorer_draining(b.explorer, b.step, b.batch))
                take(clock.explorer_done(b.explorer, b.step, b.batch, b.version, groups=2,
                                         informative=2))
            if goes:
                go = goes.pop(0)
                take(clock.trainer_step_done(go.step))
                if go.publish is not None:
                    take(clock.published(go.publish))
                if (go.step + 1) % 10 == 0:
                    clock.checkpointed(go.step + 1)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return dict(explorers=n, steps=steps, preset=preset, keep_checkpoints=keep_checkpoints,
                bytes=held, reported=len(clock.reported))


def journal_table(journals: list[dict]) -> None:
    print(f"journal: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'expl':>5} {'steps':>6} {'records':>9} {'replayed by':<24} {'on disk MB':>10} "
          f"{'replay s':>9} {'peak RSS MB':>11} {'snapshots':>9} {'ms each':>7} "
          f"{'snapshot KB':>11}")
    for j in journals:
        for label, r in j["replay"].items():
            compacted = label.endswith(", compacted")
            print(f"{j['explorers']:>5} {j['steps']:>6} {j['records']:>9} {label:<24} "
                  f"{j['bytes'][compacted] / 1e6:>10.2f} {r['seconds']:>9.2f} "
                  f"{r['peak_rss_mb']:>11.1f} {j['snapshots'] if compacted else '-':>9} "
                  f"{j['compaction_ms'] if compacted else 0:>7.1f} "
                  f"{j['snapshot_bytes'] / 1e3 if compacted else 0:>11.1f}")
        print(f"      (every replay to the same counters: {j['replay_matches']}; compaction "
              f"every {j['compact_bytes'] / 2**20:g} MiB)")


def table(rows: list[dict], args) -> None:
    print(f"control plane, synchronous plan over files, {args.tasks_per_explorer} tasks x "
          f"{args.repeat} responses of {args.tokens[0]}-{args.tokens[1]} tokens per explorer "
          f"and step, rollout {args.rollout_seconds:g}s + train {args.train_seconds:g}s "
          f"simulated, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    head = (f"{'expl':>5} {'steps':>5} {'exp/step':>8} {'cp s/step':>9} {'of ' + str(int(args.step_seconds)) + 's':>6} "
            f"{'mCPU/step':>9} {'bCPU/step':>9} {'m busy':>6} {'b busy':>6} "
            f"{'barrier p50/p99 ms':>18} {'go p50/p99':>12} {'lease p50/p99':>14} "
            f"{'put exp/s':>9} {'sample exp/s':>12} {'db peak MB':>10} {'journal B/step':>14} "
            f"{'replay s/10k':>12}")
    print(head)
    for r in rows:
        per_step = r["journal_bytes"] / r["steps"]
        replay_10k = r["replay_s"] / r["steps"] * args.target_steps
        print(f"{r['explorers']:>5} {r['steps']:>5} {r['experiences_per_step']:>8} "
              f"{r['control_plane_s']:>9.3f} {r['control_plane_share'] * 100:>5.2f}% "
              f"{r['cpu_per_step_s']['master']:>9.3f} {r['cpu_per_step_s']['buffer']:>9.3f} "
              f"{r['cpu_busy']['master'] * 100:>5.0f}% {r['cpu_busy']['buffer'] * 100:>5.0f}% "
              f"{r['barrier_ms']['p50']:>8.1f}/{r['barrier_ms']['p99']:<9.1f} "
              f"{r['trainer_go_ms']['p50']:>5.1f}/{r['trainer_go_ms']['p99']:<6.1f} "
              f"{r['lease_ms']['p50']:>6.1f}/{r['lease_ms']['p99']:<7.1f} "
              f"{r['put_exp_per_s']:>9.0f} {r['sample_exp_per_s']:>12.0f} "
              f"{r['db_peak_mb']:>10.1f} {per_step:>14.0f} {replay_10k:>12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explorers", default="16,64,256",
                        help="scales, comma-separated (\"\": only the journal phase)")
    parser.add_argument("--steps", default="40,30,20",
                        help="steps per scale (one value, or one per scale)")
    parser.add_argument("--warmup", type=int, default=3, help="steps not measured, per scale")
    parser.add_argument("--tasks-per-explorer", type=int, default=2,
                        help="tasks (groups) per explorer and step")
    parser.add_argument("--repeat", type=int, default=8, help="responses per task")
    parser.add_argument("--tokens", default="1000-4000",
                        help="tokens per experience, prompt and response, low-high")
    parser.add_argument("--rollout-seconds", type=float, default=2.0)
    parser.add_argument("--train-seconds", type=float, default=0.5)
    parser.add_argument("--idle-seconds", type=float, default=10.0,
                        help="heartbeats only, before the first step: their CPU per second")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--whole-sample", action="store_true",
                        help="the trainer leases each step's groups whole after its TrainerGo "
                             "(before issue 27 item 5), not in parts ahead of it")
    parser.add_argument("--explorer-procs", type=int, default=1,
                        help="processes hosting the simulated explorers")
    parser.add_argument("--step-seconds", type=float, default=30.0,
                        help="the real step the control plane's share is taken of")
    parser.add_argument("--target-steps", type=int, default=10_000,
                        help="run length the journal figures are extrapolated to")
    parser.add_argument("--journal-explorers", default="1,256",
                        help="explorers of each journal written and replayed (comma-separated)")
    parser.add_argument("--journal-steps", default="10000,1000",
                        help="steps of each journal (one value, or one per --journal-explorers;"
                             " 0: skip the phase)")
    parser.add_argument("--journal-compact-bytes", type=int, default=None,
                        help="master.journal_compact_bytes of the compacted journal (default: "
                             "the config's)")
    parser.add_argument("--before-src", default=None,
                        help="a checkout of an older tandem (e.g. a git worktree) whose master "
                             "also replays the uncompacted journal, for a before/after")
    parser.add_argument("--clock-steps", default="1500",
                        help="run lengths at which RunClock's memory is measured, 8 explorers, "
                             "with and without forgetting (\"\": skip)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, seconds: checks the tool, measures nothing")
    parser.add_argument("--out", default=".bench/scale.json")
    args = parser.parse_args()
    # SIGTERM (and Ctrl-C, also where a shell started it in the background, ignoring SIGINT)
    # unwinds like KeyboardInterrupt: the simulation's finally stops every process it started
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    configure_logging("bench-scale", level="warning")  # the journal replay runs a Master here
    if args.quick:
        args.explorers, args.steps, args.warmup, args.tokens = "3", "6", 1, "16-64"
        args.tasks_per_explorer, args.repeat = 2, 2
        args.rollout_seconds, args.train_seconds, args.idle_seconds = 0.05, 0.02, 0.3
        args.checkpoint_every = 2
        args.journal_explorers, args.journal_steps, args.journal_compact_bytes = "2", "20", 3000
        args.clock_steps = "40"
    args.tokens = tuple(int(x) for x in args.tokens.split("-"))
    scales = [int(x) for x in args.explorers.split(",") if x]  # "": the journal phase only
    steps = [int(x) for x in args.steps.split(",")]
    steps = steps * len(scales) if len(steps) == 1 else steps[:len(scales)]
    if scales and (len(steps) != len(scales) or min(steps) < args.warmup + 2):
        parser.error("--steps: one value, or one per scale, each at least --warmup + 2")
    journal_scales = [int(x) for x in args.journal_explorers.split(",")]
    journal_steps = [int(x) for x in args.journal_steps.split(",")]
    journal_steps = (journal_steps * len(journal_scales) if len(journal_steps) == 1
                     else journal_steps)
    if len(journal_steps) != len(journal_scales):
        parser.error("--journal-steps: one value, or one per --journal-explorers")
    if not any(journal_steps):
        journal_scales = journal_steps = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for n, k in zip(scales, steps):
            rows.append(asyncio.run(simulate(n, k, args, Path(tmp) / f"n{n}")))
            print(f"{n} explorers: {rows[-1]['step_wall_s']:.3f} s/step", flush=True)
        journals = []
        for n, k in zip(journal_scales, journal_steps):
            journals.append(journal_phase(Path(tmp) / f"journal-{n}", n, k, args))
            print(f"journal of {n} explorers x {k} steps: done", flush=True)
    clocks = [clock_memory(8, int(k), preset, keep) for k in args.clock_steps.split(",") if k
              for preset in ("synchronous", "fully_async") for keep in (10**9, 2)]
    if rows:
        table(rows, args)
    for c in clocks:
        kept = "every step" if c["keep_checkpoints"] > 10**6 else (
            f"steps after the oldest of {c['keep_checkpoints']} checkpoints")
        print(f"RunClock, {c['explorers']} explorers, {c['preset']}, {c['steps']} steps, "
              f"keeping {kept}: {c['bytes'] / 1e3:.0f} KB ({c['reported']} batches reported)")
    if journals:
        journal_table(journals)
    bad = [(r["explorers"], k) for r in rows for k, v in r["accounting"].items()
           if v is False] + [(j["explorers"], "journal replay_matches") for j in journals
                             if not j["replay_matches"]]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(benchmark="control_plane_scale", date=time.strftime("%Y-%m-%d"),
                                   argv=sys.argv[1:], quick=args.quick, results=rows,
                                   journals=journals, clock_memory=clocks,
                                   accounting_failures=bad), indent=2))
    print(f"wrote {out}")
    if bad:
        sys.exit(f"bench_scale: accounting failed: {bad}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("bench_scale: interrupted; the processes it started are stopped")
