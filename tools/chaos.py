"""Kill and pause components of a live `tandem up` run at chosen moments; account for the data.

    .venv/bin/python tools/chaos.py [--preset fully_async|one_step_off_policy|both]
        [--transport shared_fs|shared_memory]
        [--kills "trainer:mid-train,explorer:after-put,reward:mid-score:pause=5,..."
         | --kills-per-component N [--pauses-per-component M --pause-seconds S]
         | --stalls [--pause-seconds 50]]
        [--steps 40] [--seed 0] [--out .bench/chaos.json]

Starts `tandem up` (restarts on: `up.restart: on-failure`) on the quickstart task (reverse the
digits of a number, a tiny Qwen2 built locally, the reward service on) and, while it trains,
strikes one component at a time at one moment:

| moment        | when it strikes                                                               |
|---------------|-------------------------------------------------------------------------------|
| mid-rollout   | the target is frozen the moment an explorer lease is journaled, and struck    |
|               | while that lease is still open                                                |
| after-put     | the buffer acked a put the explorer has not acted on. For the explorer this is|
|               | exact: it stops itself at failpoint `explorer.put_acked` (tandem.common.      |
|               | failpoints), armed for this strike, and dies there                            |
| mid-train     | the trainer stops itself at failpoint `trainer.leased`: it holds its step's   |
|               | groups, leased and read, neither trained nor acked; the target is struck there|
| mid-score     | the reward service is frozen until a score request waits in a connection to it|
|               | from the explorer, then the target is struck                                  |
| mid-broadcast | the master journaled a `WeightsPublished` (with nccl the broadcast follows)   |

A strike is `kill` (SIGKILL, the default) or `pause=SECONDS` (SIGSTOP, then SIGCONT). `--stalls`
is the scenario of issue 32: the trainer, the buffer and the master each SIGSTOPped for
`--pause-seconds` (50) in one run with `sync.timeout: 30` and `transport.liveness: 10`, so each
pause outlasts the explorer's barrier wait (it exits and is restarted) and the master's
liveness (it declares the silent ones dead). Component
processes are the `tandem up` process's children (/proc), so a restarted component is found by
its new PID; every strike waits until all components are up again and the trainer moved on.

Afterwards it accounts, reading the run dir only (the buffer database opened read-only, the
master's journal decoded with the project codec, the trace, the checkpoints and logs), for:
acked vs stored vs trained experiences; tasks dispatched vs consumed; tasks lost, rolled out twice (more than one group for one task in
one epoch) and trained twice (consumed more than once in the final lineage); learner vs master
steps and the trainer's step mismatches; the final checkpoint step and overwritten checkpoints;
the longest pause between trainer steps; every component's RSS; processes left behind; the
run's weight segments left in /dev/shm (`--transport shared_memory`: versions move through shared
memory, checkpoint presets only); and the run's result. Prints a table per run and writes JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import msgpack
import yaml

from tandem.common import failpoints

TANDEM = str(Path(sys.executable).parent / "tandem")
COMPONENTS = ("explorer", "buffer", "trainer", "master", "reward")
MOMENTS = ("mid-rollout", "after-put", "mid-train", "mid-score", "mid-broadcast")
PRESETS = ("fully_async", "one_step_off_policy")
# The moments that mean something for each component, in the order --kills-per-component
# cycles through them.
MOMENTS_FOR = {
    "explorer": ("after-put", "mid-rollout", "mid-broadcast", "mid-score"),
    "trainer": ("mid-train", "mid-broadcast", "after-put"),
    "buffer": ("after-put", "mid-train", "mid-rollout"),
    "master": ("after-put", "mid-train", "mid-broadcast", "mid-rollout"),
    "reward": ("mid-score", "mid-rollout", "after-put"),
}
# --stalls: each pause outlasts sync.timeout and transport.liveness (issue 32 items 2 and 3)
STALLS = "trainer:mid-train:pause={s:g},buffer:mid-train:pause={s:g},master:mid-rollout:pause={s:g}"
STALL_KNOBS = {"sync_timeout": 30.0, "liveness": 10.0}
_HEAD = struct.Struct(">II")  # a journal record: payload length, crc32 (see journal.py)
POLL = 0.02


@dataclass
class Strike:
    """One planned kill or pause, and what happened to it."""

    component: str
    moment: str
    pause: float | None = None  # None: SIGKILL
    # filled in when it runs
    status: str = "planned"  # done | missed (its moment never came) | skipped (run ended)
    at_step: int | None = None  # master's trainer steps done when it struck
    pid: int | None = None
    evidence: str = ""
    seconds_to_moment: float | None = None

    @property
    def label(self) -> str:
        how = f"pause={self.pause:g}" if self.pause is not None else "kill"
        return f"{self.component}:{self.moment}:{how}"


def parse_strikes(text: str) -> list[Strike]:
    """`component:moment[:pause=SECONDS]`, comma separated; every bad part named."""
    strikes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        bits = part.split(":")
        if len(bits) not in (2, 3):
            raise SystemExit(f"--kills: {part!r} is not component:moment[:pause=SECONDS]")
        component, moment = bits[0], bits[1]
        if component not in COMPONENTS:
            raise SystemExit(f"--kills: {part!r}: component must be one of {COMPONENTS}")
        if moment not in MOMENTS:
            raise SystemExit(f"--kills: {part!r}: moment must be one of {MOMENTS}")
        pause = None
        if len(bits) == 3:
            m = re.fullmatch(r"pause=(\d+(?:\.\d*)?)", bits[2])
            if not m:
                raise SystemExit(f"--kills: {part!r}: the third part must be pause=SECONDS")
            pause = float(m.group(1))
        strikes.append(Strike(component, moment, pause))
    if not strikes:
        raise SystemExit("--kills: no strike given")
    return strikes


def planned_strikes(per_component: int, seed: int, *, pauses: int = 0,
                    pause_seconds: float = 15.0) -> list[Strike]:
    """`per_component` kills and `pauses` pauses of every component, cycling through its
    moments, in seeded order."""
    strikes = [Strike(c, MOMENTS_FOR[c][i % len(MOMENTS_FOR[c])],
                      pause_seconds if i >= per_component else None)
               for c in COMPONENTS for i in range(per_component + pauses)]
    random.Random(seed).shuffle(strikes)
    return strikes


# -- the run ----------------------------------------------------------------------------------


def write_config(workdir: Path, model_dir: Path, *, preset: str, steps: int, seed: int,
                 restarts: int, batch_size: int, repeat: int, run_timeout: float,
                 sync_timeout: float = 60.0, liveness: float | None = None,
                 transport: str = "shared_fs") -> Path:
    """The quickstart task through the full system, reward service on, restarts on."""
    from tandem.master.quickstart import reversal_tasks, write_jsonl

    train, _ = reversal_tasks(seed)
    config = {
        "name": f"chaos-{preset}", "run_dir": str(workdir / "run"), "seed": seed,
        "model": {"path": str(model_dir)},
        "sync": {"preset": preset, "timeout": sync_timeout},
        "master": {"total_steps": steps, "taskset": {
            "path": str(write_jsonl(train[:64], workdir / "train.jsonl")), "seed": seed,
            "epochs": 100}},
        "explorers": [{"name": "explorer-0", "batch_size": batch_size, "repeat_times": repeat,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}}],
        "trainer": {"groups_per_step": batch_size, "lr": 1e-4},
        "reward": {"functions": {"k12": 1.0}, "service": True},
        # finished groups keep their rows so every group's epoch can be read afterwards
        "buffer": {"keep_consumed": 10**9},
        "weights": {"transport": transport},
        # debug: the buffer's put/sample/ack lines are the moments this tool strikes at
        "logging": {"level": "debug"},
        "up": {"restart": "on-failure", "max_restarts": restarts, "run_timeout": run_timeout,
               "timeline": False},
    }
    if liveness is not None:
        config["transport"] = {"liveness": liveness}
    from tandem.common.config.logs import LoggingConfig

    if "metrics" in LoggingConfig.model_fields:  # other runs may share this machine: free ports
        config["logging"]["metrics"] = {"port": 0}
    path = workdir / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")  # not Path.glob: see tests/processes.py
    except OSError:
        return []  # gone (reaped) while we looked
    found = []
    for task in tasks:
        try:
            found += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def component_pids(up_pid: int) -> dict[str, int]:
    """Component name (master, buffer, reward, trainer, explorer-0, ...) -> PID."""
    out = {}
    for pid in children(up_pid):
        argv = cmdline(pid)
        script = next((Path(a).name for a in argv if Path(a).name.startswith("tandem-")), None)
        if script is None:
            continue
        name = script.removeprefix("tandem-")
        if name == "explorer" and "--name" in argv:
            name = argv[argv.index("--name") + 1]
        out[name] = pid
    return out


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def tcp_table() -> list[tuple[int, int, int, str]]:
    """(local port, remote port, rx queue bytes, inode) of every TCP socket."""
    rows = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, remote, queues, inode = f[1], f[2], f[4], f[9]
            rows.append((int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16),
                         int(queues.split(":")[1], 16), inode))
    return rows


def connections(server_port: int) -> set[int]:
    """The client ports of the server's connections open now."""
    return {rp for lp, rp, _, _ in tcp_table() if lp == server_port and rp}


def waiting_bytes(server_port: int, client_pid: int | None = None,
                  among: set[int] | None = None) -> int:
    """Bytes sent to the server's port and not read by it yet: what a frozen server has been
    asked. Only from `client_pid`'s sockets, if given, and only on the connections `among`
    (made before the freeze: a new one's bytes are its ZMTP greeting, not a request)."""
    table = tcp_table()
    clients = among
    if client_pid is not None:
        mine = socket_inodes(client_pid)
        clients = {lp for lp, rp, _, inode in table if inode in mine and rp == server_port}
        if among is not None:
            clients &= among
    return sum(rx for lp, rp, rx, _ in table
               if lp == server_port and (clients is None or rp in clients))


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class RunWatch:
    """What a live run has written so far: log events and journal records, read incrementally."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.events: list[dict[str, Any]] = []  # every log line, with "_file" (component)
        self.records: list[Any] = []  # journal messages, in order
        from tandem.common.trace import JsonlTail

        self._tail = JsonlTail()
        self._journal_pos = 0

    def poll(self) -> None:
        for path in sorted((self.run_dir / "logs").glob("*.jsonl")):
            for event in self._tail.new_objects(path):
                event["_file"] = path.stem
                event["_seen"] = time.monotonic()
                self.events.append(event)
        self._poll_journal()

    def _poll_journal(self) -> None:
        from tandem.common.codec import decode

        path = self.run_dir / "master" / "journal.bin"
        try:
            with open(path, "rb") as f:
                f.seek(self._journal_pos)
                data = f.read()
        except OSError:
            return
        pos = 0
        while len(data) - pos >= _HEAD.size:
            length, _ = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if end > len(data):
                break  # still being written
            try:
                self.records.append(decode([data[pos + _HEAD.size:end]]).body)
            except Exception:  # a torn record of a killed master: the restart cuts it off
                break
            pos = end
        self._journal_pos += pos

    def master_steps(self) -> int:
        return len({r.step for r in self.records if type(r).__name__ == "TrainerStepDone"})

    def since(self, mark: int, event: str | None = None, file: str | None = None):
        return [e for e in self.events[mark:]
                if (event is None or e.get("event") == event)
                and (file is None or e.get("_file") == file)]


class Chaos:
    """Runs one `tandem up` and strikes as planned."""

    def __init__(self, workdir: Path, config_path: Path, strikes: list[Strike], *, seed: int,
                 moment_timeout: float, log: Callable[[str], None]):
        self.workdir = workdir
        self.config_path = config_path
        self.config = yaml.safe_load(config_path.read_text())
        self.run_dir = Path(self.config["run_dir"])
        self.strikes = strikes
        self.rng = random.Random(seed)
        self.moment_timeout = moment_timeout
        self.log = log
        self.watch = RunWatch(self.run_dir)
        self.failpoints = workdir / "failpoints"  # armed one strike at a time
        self.proc: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}
        self.rss: dict[str, dict[str, Any]] = {}
        self.started = 0.0

    # -- helpers ------------------------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        return component_pids(self.proc.pid) if self.proc and self.proc.poll() is None else {}

    def target_name(self, component: str) -> str:
        return "explorer-0" if component == "explorer" else component

    def sample_rss(self) -> None:
        """Each component's RSS: its newest incarnation's first reading once it has taken part
        in a trainer step (after its imports and warm-up), its last, and its peak."""
        steps = self.watch.master_steps()
        for name, pid in self.pids().items():
            kib = rss_kib(pid)
            if kib is None:
                continue
            row = self.rss.setdefault(name, {"pid": None})
            if row["pid"] != pid:  # a new incarnation
                row.clear()
                row.update(pid=pid, since_step=steps)
            if "first_kib" not in row:
                if steps <= row["since_step"]:
                    continue
                row.update(first_kib=kib, peak_kib=kib)
            row["last_kib"] = kib
            row["peak_kib"] = max(row["peak_kib"], kib)

    def tick(self) -> None:
        self.watch.poll()
        self.sample_rss()

    def wait(self, predicate: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        last_rss = 0.0
        while time.monotonic() < deadline:
            self.watch.poll()
            if time.monotonic() - last_rss > 1.0:
                self.sample_rss()
                last_rss = time.monotonic()
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                return None
            time.sleep(POLL)
        return None

    def ready(self, expected: set[str], after: dict[str, int]) -> bool:
        """Every component runs, and the one struck last is a new incarnation when killed."""
        pids = self.pids()
        if not expected <= set(pids):
            return False
        return all(pids.get(name) != pid for name, pid in after.items())

    # -- a run --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.started = time.time()
        t0 = time.monotonic()
        self.proc = subprocess.Popen([TANDEM, "up", str(self.config_path), "--plain"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, **{failpoints.ENV: str(self.failpoints)}))
        output: list[str] = []
        import threading

        reader = threading.Thread(target=lambda: output.extend(self.proc.stdout), daemon=True)
        reader.start()
        try:
            self._strike_all()
            timeout = float(self.config["up"]["run_timeout"]) + 60
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                self.tick()
                time.sleep(0.5)
            if self.proc.poll() is None:
                self.log("tandem up did not exit in time: SIGTERM")
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            reader.join(5)
        self.watch.poll()
        return {"exit_code": self.proc.returncode, "seconds": round(time.monotonic() - t0, 1),
                "output": "".join(output)}

    def _strike_all(self) -> None:
        steps = int(self.config["master"]["total_steps"])
        expected = {"master", "buffer", "trainer", "explorer-0"}
        if self.config["reward"].get("service"):
            expected.add("reward")
        if not self.wait(lambda: self.ready(expected, {}), 180):
            for strike in self.strikes:
                strike.status = "skipped"
                strike.evidence = (f"the components never ran together (seen: "
                                   f"{sorted(self.pids())}, expected {sorted(expected)})")
            self.log(f"  no strike: {self.strikes[0].evidence}")
            return
        resolved = yaml.safe_load((self.run_dir / "config.yaml").read_text())
        self.ports = {"buffer": port_of(resolved["buffer"]["address"]),
                      "reward": port_of(resolved["reward"]["address"]),
                      "master": port_of(resolved["master"]["address"])}
        n = len(self.strikes)
        after: dict[str, int] = {}
        for i, strike in enumerate(self.strikes):
            # spread the strikes over the run; each waits for the last one's restart and for
            # at least one trainer step after it
            floor = min(2 + i * (steps - 4) // max(n, 1), steps - 2)  # past the warm-up
            start_steps = self.watch.master_steps()
            ok = self.wait(lambda: self.ready(expected, after) and (
                self.watch.master_steps() >= max(floor, start_steps + (1 if i else 0))), 240)
            if not ok or self.watch.master_steps() >= steps:
                strike.status = "skipped"
                strike.evidence = "the run ended (or stalled) before this strike's turn"
                continue
            after = {}
            pid = self._strike(strike)
            if strike.status == "done" and strike.pause is None and pid is not None:
                after[self.target_name(strike.component)] = pid
            self.log(f"  {strike.label:34s} {strike.status:7s} step {strike.at_step} "
                     f"{strike.evidence}")

    # -- the moments ----------------------------------------------------------------------------

    def _strike(self, strike: Strike) -> int | None:
        name = self.target_name(strike.component)
        t0 = time.monotonic()
        moment = getattr(self, "_at_" + strike.moment.replace("-", "_"))
        pid = moment(strike, name)
        if strike.status == "planned":
            strike.status = "missed"
            strike.evidence = strike.evidence or "its moment did not come in time"
        strike.seconds_to_moment = round(time.monotonic() - t0, 3)
        strike.at_step = self.watch.master_steps()
        return pid

    def _hit(self, strike: Strike, pid: int, evidence: str, stopped: bool = False) -> int:
        """Kill, or pause then resume, `pid` (already SIGSTOPped when `stopped`)."""
        strike.pid, strike.evidence, strike.status = pid, evidence, "done"
        try:
            if strike.pause is None:
                os.kill(pid, signal.SIGKILL)
            else:
                if not stopped:
                    os.kill(pid, signal.SIGSTOP)
                time.sleep(strike.pause)
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            strike.status, strike.evidence = "missed", "the process was gone when struck"
        return pid

    def _freeze(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:  # it died meanwhile (a restart): the strike tries again
            pass

    def _thaw(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def _open_lease(self, mark: int) -> Any:
        """The newest explorer lease journaled since record `mark` and not completed yet."""
        records = self.watch.records
        done = {r.lease_id for r in records
                if type(r).__name__ in ("CompleteTasks", "ReleaseTasks", "LeaseExpired")}
        for r in reversed(records[mark:]):
            if type(r).__name__ == "TasksLeased" and r.lease_id not in done:
                return r
        return None

    def _lease_done(self, lease_id: str) -> bool:
        return any(getattr(r, "lease_id", None) == lease_id
                   and type(r).__name__ in ("CompleteTasks", "ReleaseTasks", "LeaseExpired")
                   for r in self.watch.records)

    def _at_mid_rollout(self, strike: Strike, name: str) -> int | None:
        """Freeze the target as soon as an explorer lease is journaled; strike if the lease is
        still open then (rollouts of a tiny model take tens of milliseconds)."""
        deadline = time.monotonic() + self.moment_timeout
        while time.monotonic() < deadline:
            mark = len(self.watch.records)
            lease = self.wait(lambda: self._open_lease(mark), deadline - time.monotonic())
            pid = self.pids().get(name)
            if lease is None or pid is None:
                return None
            self._freeze(pid)
            self.watch.poll()
            if not self._lease_done(lease.lease_id):
                return self._hit(strike, pid, f"lease {lease.lease_id} of {lease.explorer} "
                                              f"step {lease.step} open", stopped=True)
            self._thaw(pid)
        return None

    def _at_after_put(self, strike: Strike, name: str) -> int | None:
        if name.startswith("explorer"):
            return self._explorer_after_put(strike, name)
        mark = len(self.watch.events)
        put = self.wait(lambda: next((e for e in self.watch.since(mark, "buffer.put", "buffer")
                                      if e.get("stored") and str(e.get("peer", "")).startswith(
                                          "explorer")), None), self.moment_timeout)
        pid = self.pids().get(name)
        if put is None or pid is None:
            return None
        return self._hit(strike, pid, f"buffer logged a put of {put['stored']} experiences")

    def _stopped_at(self, failpoint: str, prefix: str) -> tuple[str, int] | None:
        """Arm `failpoint` (tandem.common.failpoints) and wait until a component whose name
        starts with `prefix` stopped itself there: its name and PID. Bounded by the strike's
        deadline only: the failpoint is on the path of every step, so it is reached unless the
        run ends first (then None, the failpoint disarmed)."""
        path = failpoints.arm(self.failpoints, failpoint)

        def stopped_there() -> tuple[str, int] | None:
            if path.exists():  # not taken yet
                return None
            return next(((n, p) for n, p in self.pids().items()
                         if n.startswith(prefix) and failpoints.stopped(p)), None)

        found = self.wait(stopped_there, self.moment_timeout)
        if found is None and not failpoints.disarm(self.failpoints, failpoint):
            # taken as the wait ended: the taker stops itself next (or died, or the run ended);
            # nothing may stay stopped behind the accounting
            taker = self.wait(stopped_there, self.moment_timeout)
            if taker is not None:
                self._thaw(taker[1])
        return found

    def _explorer_after_put(self, strike: Strike, name: str) -> int | None:
        """The explorer stops itself at failpoint `explorer.put_acked`, right after the buffer
        acked its put and before it reports anything to the master; it dies there."""
        found = self._stopped_at("explorer.put_acked", "explorer")
        if found is None:
            return None
        explorer, pid = found
        lease = self._open_lease(0)
        return self._hit(strike, pid, f"{explorer}'s put acked, not acted on (stopped at "
                                      f"explorer.put_acked); open lease "
                                      f"{lease.lease_id if lease else 'none'}", stopped=True)

    def _at_mid_train(self, strike: Strike, name: str) -> int | None:
        """Strike while the trainer holds its step's groups, leased and not acked: it stops
        itself at failpoint `trainer.leased` (a tiny model trains a step in milliseconds,
        quicker than any log can be read); the target is struck there, and a trainer that is
        not the target resumes after."""
        found = self._stopped_at("trainer.leased", "trainer")
        if found is None:
            return None
        _, trainer = found
        self.watch.poll()
        sample = next((e for e in reversed(self.watch.events) if e.get("event") == "buffer.sample"
                       and f"-{trainer}-" in str(e.get("peer"))), None)
        evidence = (f"trainer leased {sample['groups']} groups (lease {sample['lease'][:8]}), "
                    "not trained nor acked" if sample else
                    "trainer stopped at trainer.leased (its sample not logged yet)")
        if name == "trainer":
            return self._hit(strike, trainer, evidence, stopped=True)
        pid = self.pids().get(name)
        try:
            return None if pid is None else self._hit(strike, pid, evidence)
        finally:
            self._thaw(trainer)

    def _at_mid_score(self, strike: Strike, name: str) -> int | None:
        pids = self.pids()
        reward, pid = pids.get("reward"), pids.get(name)
        if reward is None or pid is None:
            return None
        port = self.ports["reward"]
        explorer = self.pids().get("explorer-0")
        if explorer is None:
            return None
        before = connections(port)
        self._freeze(reward)
        arrived = self.wait(lambda: waiting_bytes(port, explorer, before) > 0,
                            self.moment_timeout)
        if not arrived:
            self._thaw(reward)
            return None
        time.sleep(0.05)  # the rest of a multi-frame request
        evidence = (f"{waiting_bytes(port, explorer, before)} bytes of a score request unread "
                    f"by the reward service")
        if name == "reward":
            return self._hit(strike, reward, evidence, stopped=True)
        try:
            return self._hit(strike, pid, evidence)
        finally:
            self._thaw(reward)

    def _at_mid_broadcast(self, strike: Strike, name: str) -> int | None:
        mark = len(self.watch.records)
        published = self.wait(lambda: next((r for r in self.watch.records[mark:]
                                            if type(r).__name__ == "WeightsPublished"), None),
                              self.moment_timeout)
        pid = self.pids().get(name)
        if published is None or pid is None:
            return None
        loaded = [e for e in self.watch.events if e.get("event") in (
            "weights.broadcast", "weights.loaded") and e.get("version") == published.version]
        state = "not yet loaded anywhere" if not loaded else f"{len(loaded)} load(s) logged"
        return self._hit(strike, pid, f"version {published.version} published by "
                                      f"{published.method} ({state})")


# -- accounting -----------------------------------------------------------------------------


def read_only(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True)


def account(run_dir: Path, config: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the report, from the run dir alone."""
    from tandem.common.trace import read_trace

    report: dict[str, Any] = {"exit_code": result.get("exit_code"),
                              "result": "finished" if result.get("exit_code") == 0 else
                              f"failed ({result.get('exit_code')})"}
    groups_per_step = int(config["trainer"]["groups_per_step"])

    # -- the master's journal: dispatch order, what it counted --------------------------------
    records, undecodable = read_records(run_dir / "master" / "journal.bin")
    report["journal_records"], report["journal_undecodable"] = len(records), undecodable
    rows = [json.loads(line) for line in Path(config["master"]["taskset"]["path"]).read_text()
            .splitlines() if line.strip()]
    id_field = config["master"]["taskset"].get("id_field")  # None: tasks are row indices
    dispatch: dict[tuple[int, str], int] = {}  # (epoch, task id) -> first dispatch position
    last_lease: dict[tuple[int, str], str] = {}
    completed: set[str] = set()
    master_steps: set[int] = set()
    expected, out_of_order = 0, 0  # the learner's count as the master saw it, step by step
    for r in records:
        kind = type(r).__name__
        if kind == "TrainerResumed":
            expected = r.step
        elif kind == "TrainerStepDone":
            out_of_order += r.step != expected
            expected = r.step + 1
        if kind == "TasksLeased":
            for epoch, index in r.refs:
                key = (epoch, str(rows[index][id_field]) if id_field else str(index))
                dispatch.setdefault(key, len(dispatch))
                last_lease[key] = r.lease_id
        elif kind == "CompleteTasks":
            completed.add(r.lease_id)
        elif kind == "TrainerStepDone":
            master_steps.add(r.step)
    report["master_steps"] = len(master_steps)
    report["steps_reported_out_of_order"] = out_of_order
    report["master_last_step"] = max(master_steps) + 1 if master_steps else 0

    # -- the buffer database --------------------------------------------------------------------
    db = run_dir / config.get("buffer", {}).get("db", "buffer.sqlite")
    conn = read_only(db)
    try:
        report["db_integrity"] = conn.execute("PRAGMA integrity_check").fetchone()[0]
        groups = conn.execute("SELECT group_id, task_id, version, size, count, state, uses, "
                              "pruned FROM groups").fetchall()
        epochs: dict[str, int] = {}
        for group_id, meta in conn.execute(
                "SELECT group_id, meta FROM experiences WHERE seq IN "
                "(SELECT min(seq) FROM experiences GROUP BY group_id)"):
            info = msgpack.unpackb(meta, raw=False, strict_map_key=False).get("info") or {}
            if "epoch" in info:
                epochs[group_id] = int(info["epoch"])
        uses = conn.execute("SELECT group_id, step FROM uses").fetchall()
        duplicate_ids = conn.execute(
            "SELECT count(*) - count(DISTINCT id) FROM experiences").fetchone()[0]
    finally:
        conn.close()
    stored = sum(g[4] for g in groups)

    # acked: every experience the buffer logged as newly stored (it logs after the commit)
    events = log_events(run_dir)
    acked = sum(int(e.get("stored") or 0) for e in events
                if e.get("event") == "buffer.put" and e.get("_file") == "buffer")
    report["experiences_acked"] = acked
    report["experiences_stored"] = stored
    report["experiences_lost"] = max(0, acked - stored)
    report["experiences_stored_twice"] = duplicate_ids
    report["groups_without_epoch"] = sum(1 for g in groups if g[0] not in epochs)

    per_task: dict[tuple[int, str], list] = defaultdict(list)
    for g in groups:
        epoch = epochs.get(g[0], -1)
        per_task[(epoch, g[1])].append(g)
    # trained: experiences of the groups the final lineage consumed (acked by the trainer)
    report["experiences_trained"] = sum(g[4] for g in groups if g[6])
    report["experiences_acked_not_trained"] = max(0, acked - report["experiences_trained"])
    rolled_twice = {k: len(v) for k, v in per_task.items() if len(v) > 1}
    trained = {k: sum(g[6] for g in v) for k, v in per_task.items()}
    trained_twice = {k: n for k, n in trained.items() if n > 1}
    # pending: could still be trained if the run went on (a group not consumed, or a lease
    # never completed); every untrained task dispatched before the first pending one is lost
    pending = {k for k, v in per_task.items()
               if any(g[5] in ("waiting", "ready", "leased") for g in v)}
    pending |= {k for k, lease in last_lease.items() if lease not in completed}
    frontier = min((dispatch.get(k, 10**12) for k in pending), default=10**12)
    lost = sorted(k for k, pos in dispatch.items()
                  if pos < frontier and not trained.get(k))
    stale_untrained = sorted(k for k, v in per_task.items()
                             if not trained.get(k) and any(g[5] == "stale" for g in v))
    lost = sorted(set(lost) | set(stale_untrained))
    report["tasks_dispatched"] = len(dispatch)
    report["tasks_trained"] = sum(1 for n in trained.values() if n)
    # dispatched = consumed: every task the master leased out was trained on (a step rolled
    # out twice with new tasks leaves tasks dispatched and never consumed)
    report["tasks_dispatched_not_consumed"] = sum(1 for k in dispatch if not trained.get(k))
    report["tasks_lost"] = len(lost)
    report["tasks_rolled_out_twice"] = len(rolled_twice)
    report["tasks_trained_twice"] = len(trained_twice)
    report["examples"] = {
        "lost": [f"{t}@epoch{e}" for e, t in lost[:5]],
        "rolled_out_twice": [f"{t}@epoch{e}: {n} groups" for (e, t), n in
                             list(rolled_twice.items())[:5]],
        "trained_twice": [f"{t}@epoch{e}: {n} uses" for (e, t), n in
                          list(trained_twice.items())[:5]],
    }
    per_step = Counter(step for _, step in uses)
    report["steps_with_wrong_group_count"] = sum(
        1 for s in range(report["master_last_step"]) if per_step.get(s, 0) != groups_per_step
    ) if uses else None

    # -- the trainer: checkpoints, mismatches, pauses ------------------------------------------
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    final = None
    if checkpoints:
        try:
            final = json.loads((checkpoints[-1] / "trainer_state.json").read_text())["step"]
        except (OSError, ValueError, KeyError):
            final = None
    report["final_checkpoint_step"] = final
    report["learner_steps"] = final
    saved = Counter(e.get("path") for e in events
                    if e.get("event") == "checkpoint.saved" and e.get("_file") == "trainer")
    # a save at a step already on disk is an overwrite unless the old one was moved aside
    aside = Counter(e.get("path") for e in events
                    if e.get("event") == "checkpoint.superseded" and e.get("_file") == "trainer")
    report["checkpoints_overwritten"] = sum(max(0, n - 1 - aside[p]) for p, n in saved.items())
    report["checkpoints_superseded"] = sum(aside.values())
    mismatch_events = sum(1 for e in events if e.get("event") == "trainer.step_mismatch")
    report["step_mismatches"] = (mismatch_events + out_of_order
                                 + (final != report["master_steps"])
                                 + (report["steps_with_wrong_group_count"] or 0))
    trains = sorted((s for s in read_trace(run_dir) if s.get("kind") == "train"),
                    key=lambda s: s["end"])
    report["train_spans"] = len(trains)
    report["steps_trained_again"] = len(trains) - len({s["step"] for s in trains})
    pause, between = 0.0, None
    for a, b in itertools.pairwise(trains):
        if b["end"] - a["end"] > pause:
            pause, between = b["end"] - a["end"], (a["step"], b["step"])
    report["longest_pause_s"] = round(pause, 2)
    report["longest_pause_between_steps"] = between
    return report


def read_records(path: Path) -> tuple[list[Any], int]:
    """The journal's messages, decoded with the project codec, and how many records did not
    decode (a type this tool's tandem does not know, or a torn last record): skipped and
    counted, where the master itself would stop."""
    from tandem.common.codec import decode

    data = path.read_bytes() if path.exists() else b""
    records, bad, pos = [], 0, 0
    while len(data) - pos >= _HEAD.size:
        length, _ = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if end > len(data):
            bad += 1
            break
        try:
            records.append(decode([data[pos + _HEAD.size:end]]).body)
        except Exception:
            bad += 1
        pos = end
    return records, bad


def log_events(run_dir: Path) -> list[dict[str, Any]]:
    from tandem.common.trace import read_logs

    return read_logs(run_dir)


def restarts(output: str) -> dict[str, int]:
    counts: Counter = Counter()
    for m in re.finditer(r"restarting (\S+) \(\d+/\d+\)", output):
        counts[m.group(1)] += 1
    return dict(counts)


def leftovers(run_dir: Path) -> list[int]:
    """Processes still running whose command line names this run (a component's children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if (entry.name.isdigit() and int(entry.name) != os.getpid()
                and any(str(run_dir) in a for a in cmdline(int(entry.name)))):
            found.append(int(entry.name))
    return found


def leftover_segments(run_dir: Path) -> list[str]:
    """The run's weight segments still in /dev/shm (weights.transport: shared_memory); after a
    run, killed trainers included, there must be none."""
    from tandem.weights.shm import SHM_ROOT, run_key

    if not SHM_ROOT.is_dir():
        return []
    return sorted(p.name for p in SHM_ROOT.iterdir()
                  if p.name.startswith(f"tandem-{run_key(run_dir)}-"))


ZERO = ("experiences_lost", "experiences_stored_twice", "experiences_acked_not_trained",
        "tasks_lost", "tasks_dispatched_not_consumed", "tasks_rolled_out_twice",
        "tasks_trained_twice", "step_mismatches", "checkpoints_overwritten", "leftover_processes",
        "leftover_segments")


def clean(report: dict[str, Any]) -> bool:
    """The run finished and every count that must be zero is zero."""
    return (report["exit_code"] == 0 and report["db_integrity"] == "ok"
            and all(report.get(k) == 0 for k in ZERO)
            and report["learner_steps"] == report["master_steps"] == report["total_steps"])


def run_one(workdir: Path, model_dir: Path, preset: str, strikes: list[Strike], *, steps: int,
            seed: int, batch_size: int = 2, repeat: int = 2, run_timeout: float = 600,
            moment_timeout: float = 30.0, sync_timeout: float = 60.0,
            liveness: float | None = None, transport: str = "shared_fs",
            log: Callable[[str], None] = print) -> dict[str, Any]:
    """One preset under `strikes`; the report (also what tests assert on)."""
    workdir.mkdir(parents=True, exist_ok=True)
    per = Counter(s.component for s in strikes if s.pause is None)
    # a pause longer than sync.timeout may end an explorer (or a trainer) that is restarted
    pauses = sum(1 for s in strikes if s.pause is not None)
    config_path = write_config(workdir, model_dir, preset=preset, steps=steps, seed=seed,
                               restarts=max(per.values(), default=0) + pauses + 2,
                               batch_size=batch_size, repeat=repeat, run_timeout=run_timeout,
                               sync_timeout=sync_timeout, liveness=liveness,
                               transport=transport)
    chaos = Chaos(workdir, config_path, strikes, seed=seed, moment_timeout=moment_timeout,
                  log=log)
    log(f"{preset}: {len(strikes)} strikes, {steps} steps, run dir {chaos.run_dir}")
    result = chaos.run()
    start = time.monotonic()  # a grace period, as for any stop; longer for the timeline
    while (left := leftovers(chaos.run_dir)) and time.monotonic() - start < (
            60.0 if all(" timeline " in " ".join(cmdline(p)) for p in left) else 5.0):
        time.sleep(0.1)  # `tandem up` draws timeline.png in a detached process that ends itself
    left_cmds = [" ".join(cmdline(pid))[:200] for pid in left]
    for pid in left:  # ours: started under the run we started
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        report = account(chaos.run_dir, chaos.config, result)
    except (OSError, sqlite3.Error) as exc:
        report = {"exit_code": result["exit_code"], "result": f"unaccountable: {exc}",
                  "db_integrity": "unreadable"}
    segments = leftover_segments(chaos.run_dir)
    report.update(preset=preset, transport=transport, total_steps=steps,
                  seconds=result["seconds"], leftover_segments=len(segments),
                  leftover_segment_names=segments,
                  restarts=restarts(result["output"]), leftover_processes=len(left),
                  leftover_commands=left_cmds,
                  strikes=[asdict(s) | {"label": s.label} for s in strikes],
                  rss_mib={name: {k.removesuffix("_kib"): round(row[k] / 1024, 1)
                                  for k in ("first_kib", "last_kib", "peak_kib") if k in row}
                           for name, row in sorted(chaos.rss.items())},
                  run_dir=str(chaos.run_dir))
    report["clean"] = clean(report) if "experiences_lost" in report else False
    if report["exit_code"] != 0:
        report["output_tail"] = result["output"][-4000:]
    return report


def survived(reports: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Strikes done per component and moment, in runs that ended clean."""
    table: dict[str, Counter] = defaultdict(Counter)
    for report in reports:
        for s in report.get("strikes", []):
            if s["status"] == "done":
                key = "survived" if report["clean"] else "not survived"
                table[f"{s['component']}:{s['moment']}"][key] += 1
    return {k: dict(v) for k, v in sorted(table.items())}


def print_table(reports: list[dict[str, Any]]) -> None:
    rows = [("result", "result"), ("steps: master / learner / final ckpt", None),
            ("experiences acked / stored / trained", None),
            ("experiences lost", "experiences_lost"),
            ("experiences acked, not trained", "experiences_acked_not_trained"),
            ("tasks dispatched / trained", None), ("tasks lost", "tasks_lost"),
            ("tasks dispatched, not consumed", "tasks_dispatched_not_consumed"),
            ("tasks rolled out twice", "tasks_rolled_out_twice"),
            ("tasks trained twice", "tasks_trained_twice"),
            ("step mismatches", "step_mismatches"),
            ("checkpoints overwritten", "checkpoints_overwritten"),
            ("longest pause between steps (s)", "longest_pause_s"),
            ("strikes done / missed / skipped", None), ("restarts", None),
            ("leftover processes", "leftover_processes"),
            ("leftover /dev/shm segments", "leftover_segments"), ("db integrity", "db_integrity"),
            ("seconds", "seconds"), ("clean", "clean")]
    head = f"{'':34s}" + "".join(f"{r['preset']:>30s}" for r in reports)
    print(head)
    for title, key in rows:
        cells = []
        for r in reports:
            if key is not None:
                cells.append(str(r.get(key)))
            elif title.startswith("steps"):
                cells.append(f"{r.get('master_steps')} / {r.get('learner_steps')} / "
                             f"{r.get('final_checkpoint_step')}")
            elif title.startswith("experiences"):
                cells.append(f"{r.get('experiences_acked')} / {r.get('experiences_stored')} / "
                             f"{r.get('experiences_trained')}")
            elif title.startswith("tasks dispatched"):
                cells.append(f"{r.get('tasks_dispatched')} / {r.get('tasks_trained')}")
            elif title.startswith("strikes"):
                st = Counter(s["status"] for s in r.get("strikes", []))
                cells.append(f"{st['done']} / {st['missed']} / {st['skipped']}")
            else:
                cells.append(" ".join(f"{k.removesuffix('-0')[:3]}={v}" for k, v in
                                      r.get("restarts", {}).items()) or "0")
        print(f"{title:34s}" + "".join(f"{c:>30s}" for c in cells))
    print("\nRSS MiB (newest incarnation: after its first step -> at the end, peak):")
    for r in reports:
        print(f"  {r['preset']:20s} " + ", ".join(
            f"{name} {row.get('first')}->{row.get('last')} ({row.get('peak')})"
            for name, row in r.get("rss_mib", {}).items()))
    print("\nstrikes per component and moment:")
    for key, counts in survived(reports).items():
        print(f"  {key:28s} " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="both", choices=(*PRESETS, "both"))
    parser.add_argument("--kills", help="component:moment[:pause=SECONDS], comma separated")
    parser.add_argument("--kills-per-component", type=int, default=None, metavar="N",
                        help="N kills of every component, cycling through its moments "
                             "(default 3 when --kills is not given)")
    parser.add_argument("--pauses-per-component", type=int, default=0, metavar="N",
                        help="with --kills-per-component: also N pauses of every component")
    parser.add_argument("--pause-seconds", type=float, default=None,
                        help="how long a planned pause lasts (SIGSTOP to SIGCONT; default 15, "
                             "50 with --stalls)")
    parser.add_argument("--stalls", action="store_true",
                        help="SIGSTOP the trainer, the buffer and the master in turn, each "
                             "longer than sync.timeout (30) and transport.liveness (10)")
    parser.add_argument("--transport", default="shared_fs", choices=("shared_fs", "shared_memory"),
                        help="weights.transport; shared_memory runs the presets whose "
                             "sync.method is checkpoint")
    parser.add_argument("--steps", type=int, default=40, help="trainer steps per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=2, help="tasks per explorer step "
                                                                   "(= groups per trainer step)")
    parser.add_argument("--repeat", type=int, default=2, help="responses per task")
    parser.add_argument("--moment-timeout", type=float, default=60.0,
                        help="seconds to wait for a strike's moment before calling it missed")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="up.run_timeout")
    parser.add_argument("--model", type=Path, help="a model dir (default: a tiny Qwen2 built "
                                                   "in the work dir)")
    parser.add_argument("--workdir", type=Path, help="where runs go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path(".bench/chaos.json"))
    args = parser.parse_args(argv)
    if sum((bool(args.kills), args.kills_per_component is not None, args.stalls)) > 1:
        parser.error("give one of --kills, --kills-per-component, --stalls")
    pause_seconds = args.pause_seconds or (50.0 if args.stalls else 15.0)
    if args.stalls:
        args.kills = STALLS.format(s=pause_seconds)
    if args.steps < 4:
        parser.error("--steps must be at least 4")

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    model = args.model
    if model is None:
        from tandem.weights.tiny import build_tiny_model

        model = workdir / "model"
        if not (model / "config.json").exists():
            build_tiny_model(model, seed=args.seed)
    presets = PRESETS if args.preset == "both" else (args.preset,)
    if args.transport == "shared_memory":
        from tandem.common.sync import PRESETS as PLANS

        presets = tuple(p for p in presets if PLANS[p]["method"] == "checkpoint")
        if not presets:
            parser.error(f"--transport shared_memory needs a preset with sync.method "
                         f"checkpoint (e.g. fully_async), not {args.preset}")
    reports = []
    for preset in presets:
        strikes = (parse_strikes(args.kills) if args.kills else
                   planned_strikes(3 if args.kills_per_component is None
                                   else args.kills_per_component, args.seed,
                                   pauses=args.pauses_per_component,
                                   pause_seconds=pause_seconds))
        knobs = STALL_KNOBS if args.stalls else {}
        reports.append(run_one(workdir / preset, model, preset, strikes, steps=args.steps,
                               seed=args.seed, batch_size=args.batch_size, repeat=args.repeat,
                               run_timeout=args.run_timeout, moment_timeout=args.moment_timeout,
                               transport=args.transport, **knobs))
    print_table(reports)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": reports,
                                    "survived": survived(reports)}, indent=2, default=str))
    print(f"\nwrote {args.out}")
    return 0 if all(r["clean"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
