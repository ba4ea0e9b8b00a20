"""`tandem up CONFIG`: a whole run on this machine, one process per component.

The supervisor picks free loopback ports, writes the resolved config into the run dir, starts
master, buffer, reward service (when configured), trainer and explorers through their own CLIs
(never by importing them), shows live progress, and stops everything on Ctrl-C, SIGTERM, a
component's death (unless `up.restart: on-failure`) or the end of the run. Each child runs in
its own session so stopping it also stops whatever it started. Stopping goes in two stages: the
explorers and the trainer together (neither waits for the other once it has its SIGTERM: an
explorer drains its leased step, the trainer finishes its step and checkpoints, bounded by
`up.trainer_stop_timeout`), then the buffer, the reward service and the master, which answered
them until then. The stop is a `stop` span in `run_dir/trace/up.jsonl`, from the request to the
last exit. A restarted trainer gets the same argv: it always continues from its newest
checkpoint.
"""

from __future__ import annotations

import asyncio
import gc
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import structlog
import yaml

from tandem.common.config import RunConfig
from tandem.common.config.placement import machine_cores, resolve_placement
from tandem.common.config.transport import move_secrets_to_env
from tandem.common.errors import PeerDead, RequestFailed, TandemError
from tandem.common.messages.master import Status
from tandem.common.rundir import private_run_dir
from tandem.common.runrecord import newest_checkpoint
from tandem.common.sockets import free_port
from tandem.common.trace import JsonlTail, Tracer

from .startup import StartupClock
from .zygote import ForkedProcess, Zygote, ZygoteRefused, reap_orphans

log = structlog.get_logger(__name__)

LOOPBACK = ("tcp://127.0.0.1:", "tcp://localhost:")


def resolve_addresses(config: RunConfig) -> RunConfig:
    """Give every loopback address a free port, so runs never collide. A copy, not a dump
    validated again: that would mark every key as set, and `prepare` leaves the metrics ports
    free only where `logging.metrics.port` was not set."""
    updates: dict[str, dict[str, str]] = {}
    for section, key in (("master", "address"), ("master", "publish_address"),
                         ("buffer", "address"), ("reward", "address")):
        if getattr(getattr(config, section), key).startswith(LOOPBACK):
            updates.setdefault(section, {})[key] = f"tcp://127.0.0.1:{free_port()}"
    return config.model_copy(update={
        section: getattr(config, section).model_copy(update=values)
        for section, values in updates.items()})


def script(name: str) -> str:
    """The console script installed next to this interpreter (the same venv)."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    raise click.ClickException(f"{name} is not installed next to {sys.executable}; "
                               "install the tandem packages into this environment")


class MasterFailedToStart(TandemError):
    """The master process exited before it answered; `code` is its exit code."""

    def __init__(self, code: int, message: str):
        self.code = code
        super().__init__(message)


@dataclass
class Child:
    """One component process under supervision."""

    name: str
    role: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | ForkedProcess | None = None
    restarts: int = 0
    finished: bool = False
    env: dict[str, str] = field(default_factory=dict)  # secrets kept out of the config file
    zygote: Zygote | None = None  # forks it when set (up.launch: fork), else exec
    pidfd: int | None = None  # readable once the process exits (Linux >= 5.3), else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.close_pidfd()
        if self.zygote is not None:
            try:
                self.proc = self.zygote.fork(self.argv, env, self.log_path)
                self._open_pidfd()
                return
            except ZygoteRefused as exc:
                log.warning("up.exec_instead_of_fork", component=self.name, reason=str(exc))
        out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        out.close()
        self._open_pidfd()

    def _open_pidfd(self) -> None:
        try:  # not yet reaped (only poll() reaps it), so the pid is still this process
            self.pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # not Linux, or a kernel before 5.3: polled instead
            self.pidfd = None

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def wait_for_exit(children: list[Child], timeout: float) -> None:
    """Block until one of the running `children` exits, or `timeout`: on their pidfds, so an
    exit is seen when it happens; every 50 ms where one has none."""
    running = [c for c in children if c.proc is not None and c.returncode is None]
    fds = [c.pidfd for c in running if c.pidfd is not None]
    if len(fds) < len(running):
        timeout = min(timeout, 0.05)
    if fds:
        select.select(fds, [], [], timeout)
    else:
        time.sleep(timeout)


async def until_exit(children: list[Child], timeout: float) -> None:
    """`wait_for_exit` for the event loop: returns when one of the running `children` exits
    (its pidfd turns readable), or after `timeout` (at most 0.5 s where one has no pidfd)."""
    running = [c for c in children if c.proc is not None and c.returncode is None]
    fds = [c.pidfd for c in running if c.pidfd is not None]
    if len(fds) < len(running):
        timeout = min(timeout, 0.5)
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    for fd in fds:
        loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        await asyncio.wait([exited], timeout=timeout)
    finally:
        for fd in fds:
            loop.remove_reader(fd)
        exited.cancel()


@dataclass
class Progress:
    """What the live display and the final summary show."""

    started: float = field(default_factory=time.monotonic)
    status: Status | None = None
    rewards: list[tuple[int, float]] = field(default_factory=list)  # (explorer step, mean)
    tokens: int = 0
    evals: list[dict] = field(default_factory=list)  # rows of run_dir/eval.jsonl, in order

    _tail: JsonlTail = field(default_factory=JsonlTail)

    def update_from_trace(self, run_dir: Path) -> None:
        """Read only what the explorers' traces gained since the last call (whole lines)."""
        for path in sorted((run_dir / "trace").glob("*.jsonl")):
            for span in self._tail.new_objects(path):
                if span.get("kind") != "rollout":
                    continue
                attrs = span.get("attrs") or {}
                if "reward_mean" in attrs:
                    self.rewards.append((span.get("step") or 0, float(attrs["reward_mean"])))
                self.tokens += int(attrs.get("tokens", 0))

    def update_from_evals(self, run_dir: Path) -> None:
        """Read the rows run_dir/eval.jsonl gained since the last call (whole lines)."""
        for row in self._tail.new_objects(run_dir / "eval.jsonl"):
            if isinstance(row.get("metrics"), dict):
                self.evals.append(row)

    def eval_text(self) -> str:
        """The newest evaluation of each taskset, in a line: accuracy per mode, best pass@k."""
        newest: dict[str, dict] = {}
        for row in self.evals:
            newest[row["taskset"]] = row
        return "; ".join(f"{name} v{row['version']}: {headline(row['metrics'])}"
                         for name, row in newest.items())


def headline(metrics: dict[str, float]) -> str:
    """The figures of an eval row worth a glance: accuracy per mode and the largest pass@k."""
    shown = {k: v for k, v in metrics.items() if k.endswith("/accuracy")}
    passes = sorted((int(k.rsplit("@", 1)[1]), k) for k in metrics if "/pass@" in k)
    if passes:
        shown[passes[-1][1]] = metrics[passes[-1][1]]
    return ", ".join(f"{k.replace('/accuracy', ' acc')} {v:.2f}" for k, v in shown.items())


def checkpoint_short(status: Status | None, checkpoints: Path) -> str | None:
    """Why a run whose master ended is not done though its counter may say so: the trainer's
    newest checkpoint holds fewer steps than the master counted (the steps after it would be
    lost on the next resume). None when it holds them all."""
    if status is None:
        return None
    counted = status.counters.trainer_steps_done
    step, folder = newest_checkpoint(checkpoints)
    if step >= counted:
        return None
    return (f"the master counted {counted} trainer steps but the newest checkpoint holds "
            f"{step} ({folder or f'none in {checkpoints}'}); `tandem up --resume` retrains "
            f"steps {step}..{counted - 1}")


class Supervisor:
    """Starts, watches and stops a run's processes."""

    def __init__(self, config: RunConfig, *, resume: bool = False, live: bool | None = None):
        self.config = resolve_addresses(config)
        self.run_dir = Path(self.config.run_dir)
        self.resume = resume
        self.live = sys.stdout.isatty() if live is None else live
        self.children: list[Child] = []
        self.placement = resolve_placement(self.config)
        self.startup = StartupClock()
        self.progress = Progress()
        self._stop_reason: str | None = None
        self._stop_requested_at: float | None = None  # time.time() of the signal
        self.zygote: Zygote | None = None

    # -- set-up ------------------------------------------------------------------------------

    def prepare(self) -> Path:
        private_run_dir(self.run_dir)
        # an earlier invocation's last status (a resume): never this run's outcome
        self._final_status_path().unlink(missing_ok=True)
        path = self.run_dir / "config.yaml"
        data = self.config.model_dump(mode="json")
        metrics = data["logging"]["metrics"]
        if metrics["enabled"] is None:  # on under `tandem up` unless set, on free loopback
            metrics["enabled"] = True   # ports unless one is given: runs on one host never clash
            if "port" not in self.config.logging.metrics.model_fields_set:
                metrics["port"] = 0
        secrets = move_secrets_to_env(data)  # children get them in their environment
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(yaml.safe_dump(data, sort_keys=False))
        # with --resume every child may join the run under a config whose resumable keys
        # changed (tandem.common.runrecord), whichever of them reads the journal first
        cfg = ["--config", str(path), *(["--resume"] if self.resume else [])]
        logs = self.run_dir / "logs"

        self.placement = resolve_placement(self.config)

        def child(name: str, role: str, argv: list[str]) -> Child:
            # each child's share of the machine (`placement`) travels in its environment too
            return Child(name, role, argv, logs / f"{name}.out",
                         env={**secrets, **self.placement[name].env()})

        self.children = [child("master", "master", [script("tandem-master"), *cfg]),
                         child("buffer", "buffer", [script("tandem-buffer"), *cfg])]
        reward_service = self.config.up.reward_service
        if reward_service if reward_service is not None else self.config.reward.service:
            self.children.append(child("reward", "reward", [script("tandem-reward"), *cfg]))
        nproc = self.placement["trainer"].nproc
        launcher = [script("tandem-torchrun"), "--standalone", f"--nproc-per-node={nproc}"] \
            if nproc > 1 else []
        self.children.append(child("trainer", "trainer", [
            *launcher, script("tandem-trainer"), *cfg]))
        for explorer in self.config.explorers:
            self.children.append(child(explorer.name, "explorer", [
                script("tandem-explorer"), *cfg, "--name", explorer.name]))
        return path

    # -- the run -----------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason
            self._stop_requested_at = time.time()

    async def run(self) -> int:
        from tandem.common.messages.master import GetStatus
        from tandem.common.rpc import RpcClient

        self.prepare()
        master = self.children[0]
        self._start_zygote()
        # all at once: the others' imports and model loads overlap the master's start, and
        # their Register waits in the socket's queue until the master binds
        for child in self.children:
            self.startup.process_started(child.name)
            if child.zygote is None:
                child.start()
        client = RpcClient(self.config.master.address, peer="master",
                           transport=self.config.transport, name="up")
        probes = self._probe_startup(client, GetStatus)
        forks = asyncio.ensure_future(self._fork_children()) if self.zygote else None
        try:
            await self._wait_for_master(client, master)
            self.startup.mark_ready("master")
            if forks is not None:
                await forks
            log.info("up.started", run_dir=str(self.run_dir),
                     components=[c.name for c in self.children])
            return await self._watch(client, GetStatus)
        finally:
            for task in [*probes, *([forks] if forks else [])]:
                task.cancel()
            await asyncio.gather(*probes, *([forks] if forks else []), return_exceptions=True)
            await client.close()
            self._stop_all()
            for child in self.children:
                child.close_pidfd()
            if self.zygote is not None:
                self.zygote.close()
                self._reap_orphans()

    def _start_zygote(self) -> None:
        """With up.launch: fork, the warm process the trainer and the explorers are forked
        from; not for a trainer under torchrun (its ranks are torchrun's children)."""
        forked = [c for c in self.children if c.role in ("trainer", "explorer")
                  and Path(c.argv[0]).name in ("tandem-trainer", "tandem-explorer")]
        if self.config.up.launch != "fork" or not forked:
            return
        try:
            self.zygote = Zygote(self.run_dir / "logs" / "zygote.out",
                                 self.config.up.start_timeout, [c.argv for c in forked])
        except OSError as exc:  # no PR_SET_CHILD_SUBREAPER (not Linux)
            log.warning("up.exec_instead_of_fork", reason=str(exc))
            return
        for child in forked:
            child.zygote = self.zygote

    async def _fork_children(self) -> None:
        """Fork the zygote's children once its imports are done; meanwhile the loop answers
        (the master's start, the probes, a stop)."""
        await asyncio.to_thread(self.zygote.wait_ready)
        for child in self.children:
            if child.zygote is not None and not self._stop_reason:
                child.start()
        if self.config.up.restart == "never":  # nothing will be forked again: free its pages
            # on a thread, not awaited: its exit takes seconds under load, and the run is
            # watched meanwhile (the close at the run's end waits for this one)
            threading.Thread(target=self.zygote.close, name="zygote-close", daemon=True).start()

    def _reap_orphans(self) -> None:
        known = {c.proc.pid for c in self.children if c.proc is not None}
        if self.zygote is not None:
            known.add(self.zygote.proc.pid)
        reap_orphans(known)

    def _probe_startup(self, master, GetStatus) -> list[asyncio.Task]:
        """Background tasks that time each component's start-up (`StartupClock`)."""
        from tandem.common.messages.buffer import GetBufferStats
        from tandem.common.messages.reward import GetRewardStats

        deadline = time.monotonic() + self.config.up.start_timeout
        tasks = [asyncio.ensure_future(self.startup.watch_registry(master, GetStatus(),
                                                                   deadline))]
        for child in self.children:
            if child.name in ("buffer", "reward"):
                section, request = ((self.config.buffer, GetBufferStats()) if child.name == "buffer"
                                    else (self.config.reward, GetRewardStats()))
                tasks.append(asyncio.ensure_future(self._probe(child.name, section.address,
                                                               request, deadline)))
        return tasks

    async def _probe(self, name: str, address: str, request, deadline: float) -> None:
        from tandem.common.rpc import RpcClient

        client = RpcClient(address, peer=name, transport=self.config.transport, name="up")
        try:
            await self.startup.probe(name, client, request, deadline)
        finally:
            await client.close()

    async def _wait_for_master(self, client, master: Child) -> None:
        from tandem.common.messages.master import GetStatus

        deadline = time.monotonic() + self.config.up.start_timeout
        while time.monotonic() < deadline:
            if master.returncode is not None:
                raise MasterFailedToStart(
                    master.returncode, f"master exited with code {master.returncode} while "
                    f"starting: {master.tail(1)} (its log: {master.log_path})")
            if self._stop_reason:
                raise click.Abort()
            try:
                self.progress.status = await client.call(GetStatus(), timeout=1.0, retries=0)
                return
            except PeerDead:
                continue
        raise TandemError(
            f"master did not answer within {self.config.up.start_timeout:g}s; raise "
            f"up.start_timeout if it is only slow (its log: {master.log_path})")

    async def _watch(self, client, GetStatus) -> int:
        display = _Display(self) if self.live else None
        last_line = 0.0
        deadline = (time.monotonic() + self.config.up.run_timeout
                    if self.config.up.run_timeout else None)
        try:
            while True:
                if self._stop_reason:
                    log.warning("up.stopping", reason=self._stop_reason)
                    return 130
                if deadline and time.monotonic() > deadline:
                    click.echo(f"run exceeded up.run_timeout={self.config.up.run_timeout:g}s",
                               err=True)
                    return 1
                if self._clean_exit_unexplained():
                    # A component that saw the master's Stop may exit 0 before this loop's
                    # next status poll sees it: ask now, not after judging the exit a failure.
                    await self._poll_status(client, GetStatus)
                outcome = self._check_children()
                if outcome is not None:
                    return outcome
                await self._poll_status(client, GetStatus)
                if self.zygote is not None:
                    self._reap_orphans()
                self.progress.update_from_trace(self.run_dir)
                self.progress.update_from_evals(self.run_dir)
                if display is not None:
                    display.refresh()
                elif time.monotonic() - last_line > 5.0:
                    click.echo(self.status_line())
                    last_line = time.monotonic()
                # woken by a child's exit at once (the master's at the end of the run)
                await until_exit(self.children, 0.5)
        finally:
            if display is not None:
                display.close()

    async def _poll_status(self, client, GetStatus) -> None:
        """The master's status, unless it exits first: once every component said Goodbye it
        does not wait to be asked, and leaves its last status on disk (`_read_final_status`)."""
        master = self.children[0]
        call = asyncio.ensure_future(client.call(GetStatus(), timeout=2.0, retries=0))
        try:
            while not call.done() and master.returncode is None:
                # until_exit returns on the master's exit, or after a slice without one
                exit_seen = asyncio.ensure_future(until_exit([master], 2.0))
                await asyncio.wait([call, exit_seen], return_when=asyncio.FIRST_COMPLETED)
                exit_seen.cancel()
                await asyncio.gather(exit_seen, return_exceptions=True)
            if call.done() and call.exception() is None:
                self.progress.status = call.result()
            elif call.done() and not isinstance(call.exception(), (PeerDead, RequestFailed)):
                call.result()
        finally:
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)

    def _read_final_status(self) -> None:
        """The status the master wrote as it closed (newer than any it answered)."""
        path = self._final_status_path()
        try:
            self.progress.status = Status.model_validate_json(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("up.final_status_unread", path=str(path), error=str(exc))

    def _final_status_path(self) -> Path:
        from .journal import final_status_path

        return final_status_path(self.run_dir / self.config.master.journal)

    def _clean_exit_unexplained(self) -> bool:
        return not self._stopped() and self.children[0].returncode is None and any(
            c.returncode == 0 and not c.finished for c in self.children[1:])

    def _check_children(self) -> int | None:
        """None while the run goes on; an exit code once it is over."""
        master = self.children[0]
        for child in self.children:
            code = child.returncode
            if code is None or child.finished:
                continue
            if child is master and code == 0:
                # The master exits 0 on its own only when every step is done.
                self._read_final_status()
                return self._finish()
            if code == 0 and self._stopped():
                child.finished = True
                continue
            click.echo(f"\n{child.name} exited with code {code}; last lines of {child.log_path}:\n"
                       f"{child.tail()}\n", err=True)
            if self.config.up.restart == "on-failure" and child.restarts < self.config.up.max_restarts:
                child.restarts += 1
                click.echo(f"restarting {child.name} ({child.restarts}/"
                           f"{self.config.up.max_restarts})", err=True)
                child.start()
                continue
            return 1
        return None

    def _finish(self) -> int:
        # After the master's Stop the explorers (an evaluating one scores the last weights
        # first) and the trainer end on their own; the buffer and the reward service are
        # servers, which never do: waiting for them was up.stop_timeout of dead time at the end
        # of every run. Whoever is still running is then stopped in order by _stop_all (the
        # trainer, writing its last checkpoint, gets up.trainer_stop_timeout there).
        ending = [c for c in self.children if c.role in ("explorer", "trainer")]
        deadline = time.monotonic() + max(
            (self._stop_bound(c) for c in ending if c.role != "trainer"), default=0.0)
        while time.monotonic() < deadline and any(c.returncode is None for c in ending):
            wait_for_exit(ending, deadline - time.monotonic())
        failed = [c for c in self.children if c.returncode not in (None, 0)]
        for c in failed:
            click.echo(f"{c.name} exited with code {c.returncode}:\n{c.tail()}", err=True)
        status = self.progress.status
        done = status is not None and (
            status.counters.trainer_steps_done == status.counters.total_steps)
        short = checkpoint_short(status, self.run_dir / "checkpoints") if done else None
        if short is not None:  # the run is done only once its last checkpoint is on disk
            click.echo(f"run not done: {short}", err=True)
        return 0 if done and short is None and not failed else 1

    def _stopped(self) -> bool:
        return self.progress.status is not None and self.progress.status.counters.stopped

    def _stop_bound(self, child: Child) -> float:
        up = self.config.up
        if child.role == "explorer" and self.config.eval.enabled and self.config.eval.at_end:
            # the evaluating explorer scores the last weights after the run's Stop
            return max(up.stop_timeout, self.config.eval.final_wait)
        return up.trainer_stop_timeout if child.role == "trainer" else up.stop_timeout

    def _stop_all(self) -> None:
        """A stop is never a loss, and never waits on a peer that is stopping too: first the
        explorers and the trainer, together (an explorer hands back or finishes its leased
        step, the trainer finishes or abandons its step, skips a broadcast to explorers that
        are leaving and writes its exit checkpoint), while the buffer and the master still
        answer them; then the rest. Each child is SIGKILLed after its bound
        (`_stop_bound`). The stop is traced as one `stop` span: from the request (the signal,
        or this call) to the last exit, with each child's exit code and seconds."""
        started_at = self._stop_requested_at or time.time()
        started = [c for c in self.children if c.proc is not None]  # a failed start starts few
        workers = [c for c in started if c.role in ("explorer", "trainer")]
        last = [c for c in reversed(started) if c.role not in ("explorer", "trainer")]
        exits: dict[str, dict[str, float | int | None]] = {}
        killed: list[str] = []
        for stage in (workers, last):
            for child in stage:
                child.signal(signal.SIGTERM)
            start = time.monotonic()
            while any(c.returncode is None and time.monotonic() - start < self._stop_bound(c)
                      for c in stage):
                self._note_exits(stage, exits, started_at)
                left = [start + self._stop_bound(c) - time.monotonic() for c in stage
                        if c.returncode is None]
                wait_for_exit(stage, max(0.0, min(left, default=0.0)))
            for child in stage:
                if child.returncode is None:
                    log.warning("up.kill", component=child.name,
                                after=f"{self._stop_bound(child):g}s")
                    child.signal(signal.SIGKILL)
                    child.proc.wait(5)
                    killed.append(child.name)
            self._note_exits(stage, exits, started_at)
        tracer = Tracer(self.run_dir if self.config.logging.trace else None, "up")
        tracer.record("stop", started_at, max([started_at, *(e["at"] for e in exits.values())]),
                      reason=self._stop_reason or "end of run", exits=exits, killed=killed)
        tracer.close()

    @staticmethod
    def _note_exits(stage: list[Child], exits: dict, started_at: float) -> None:
        """Each child's exit, the first time it is seen: its code and when (unix seconds)."""
        for child in stage:
            code = child.returncode
            if code is not None and child.name not in exits:
                exits[child.name] = {"code": code, "at": round(time.time(), 6),
                                     "after": round(time.time() - started_at, 3)}

    # -- what the user sees ------------------------------------------------------------------

    def status_line(self) -> str:
        status = self.progress.status
        elapsed = time.monotonic() - self.progress.started
        reward = self.progress.rewards[-1][1] if self.progress.rewards else float("nan")
        if status is None:
            return f"[{elapsed:6.1f}s] waiting for the master's status"
        c = status.counters
        explorers = ", ".join(f"{e.name}: step {e.steps_done} v{e.held_version}"
                              for e in status.explorers)
        evals = self.progress.eval_text()
        return (f"[{elapsed:6.1f}s] trainer {c.trainer_steps_done}/{c.total_steps} "
                f"v{c.newest_version} | reward {reward:.3f} | {explorers}"
                + (f" | eval {evals}" if evals else ""))

    def eval_rows(self) -> list[tuple[str, str]]:
        """Per eval taskset: each metric from the first evaluation to the last (eval.jsonl,
        which the explorer may have finished writing after the last look)."""
        self.progress.update_from_evals(self.run_dir)
        by_set: dict[str, list[dict]] = {}
        for row in self.progress.evals:
            by_set.setdefault(row["taskset"], []).append(row)
        out = []
        for name, evals in by_set.items():
            first, last = evals[0], evals[-1]
            out.append((f"eval {name} v{first['version']} -> v{last['version']}",
                        ", ".join(f"{k} {first['metrics'].get(k, float('nan')):.2f} -> {v:.2f}"
                                  for k, v in last["metrics"].items())))
        if by_set:
            out.append(("eval results", str(self.run_dir / "eval.jsonl")))
        return out

    def placement_rows(self) -> list[tuple[str, str]]:
        p = self.config.placement
        cores = p.cores or machine_cores()
        rows = [("placement", f"{p.policy} over {cores} cores")]
        for child in self.children:
            if child.name in self.placement:
                rows.append((f"  {child.name}", self.placement[child.name].describe()))
        return rows

    def summary(self, code: int, *, png_in_background: bool = False) -> list[tuple[str, str]]:
        """The closing table; `png_in_background` leaves drawing timeline.png to a detached
        `tandem timeline` so the exit code does not wait for matplotlib."""
        from .timeline import load_timeline, render_png, summary_rows

        result = ("finished" if code == 0 else f"stopped by {self._stop_reason} ({code})"
                  if code == 130 and self._stop_reason else f"failed ({code})")
        rows: list[tuple[str, str]] = [("result", result)]
        rewards = [r for _, r in sorted(self.progress.rewards)]
        if rewards:
            last = rewards[-10:]
            rows += [("reward first step / last 10 / best",
                      f"{rewards[0]:.3f} / {sum(last) / len(last):.3f} / {max(rewards):.3f}")]
        rows += self.eval_rows()
        run_seconds = None
        try:
            tl = load_timeline(self.run_dir)
            run_seconds = tl.makespan
            rows += summary_rows(tl)
            png = self.run_dir / "timeline.png"
            if not self.config.up.timeline:
                rows.append(("timeline", f"not drawn (up.timeline: false); tandem timeline "
                                         f"{self.run_dir} draws it"))
            elif png_in_background:
                subprocess.Popen([script("tandem"), "timeline", str(self.run_dir), "-o", str(png)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
                rows.append(("timeline", f"{png} (drawing in the background)"))
            else:
                rows.append(("timeline", str(render_png(tl, png))))
        except click.ClickException:
            rows.append(("timeline", "no trace written"))
        rows += self.placement_rows()
        if self.zygote is not None and self.zygote.preforked:
            # forked from `tandem warm` (tandem.master.warm), whose pid is this process's parent
            rows.append(("launch", f"forked from the warm process {os.getppid()} (tandem warm)"))
        rows += self.startup.rows(run_seconds)
        if self.config.logging.metrics.enabled is not False:
            from tandem.common.metrics import served_endpoints

            served = served_endpoints(self.run_dir)
            if served:
                rows += [("metrics", "Prometheus /metrics each component served")]
                rows += [(f"  {name}", url) for name, url in served]
        checkpoints = self.run_dir / "checkpoints"
        if checkpoints.exists():
            rows.append(("checkpoints", str(checkpoints)))
        rows.append(("logs", str(self.run_dir / "logs")))
        return rows


class _Display:
    """A rich live panel refreshed from the master's status."""

    def __init__(self, sup: Supervisor):
        from rich.console import Console
        from rich.live import Live

        self.sup = sup
        self.live = Live(console=Console(), refresh_per_second=4, transient=False)
        self.live.start()

    def refresh(self) -> None:
        from rich.table import Table

        sup, p = self.sup, self.sup.progress
        status = p.status
        elapsed = time.monotonic() - p.started
        done, total, newest = ((status.counters.trainer_steps_done, status.counters.total_steps,
                                status.counters.newest_version) if status else (0, 0, 0))
        remaining = elapsed / done * (total - done) if done else float("nan")
        table = Table(title=f"tandem up - {sup.run_dir}", title_justify="left")
        for col in ("lane", "step", "version", "staleness", "detail"):
            table.add_column(col)
        for e in status.explorers if status else []:
            table.add_row(e.name, str(e.steps_done), str(e.held_version), str(e.staleness),
                          f"rolling out step {e.running.step}" if e.running else "waiting")
        reward = f"{p.rewards[-1][1]:.3f}" if p.rewards else "-"
        table.add_row("trainer", f"{done}/{total}", str(newest), "",
                      f"reward mean {reward}")
        if p.evals:
            table.add_row("eval", "", str(p.evals[-1]["version"]), "", p.eval_text())
        table.caption = (f"elapsed {elapsed:.0f}s, remaining ~{remaining:.0f}s, "
                         f"{p.tokens / max(elapsed, 1e-9):.0f} generated tokens/s")
        self.live.update(table)

    def close(self) -> None:
        self.live.stop()


def run_up(config: RunConfig, *, resume: bool = False, live: bool | None = None,
           prog: str = "tandem up", png_in_background: bool = False) -> int:
    """Run `config` to the end under a Supervisor; returns the exit code (a domain error that
    stops it before the run begins is one line on stderr and exit code 1)."""
    from tandem.common.cli import EXIT_FAILED, EXIT_USAGE, fail
    from tandem.common.runlock import RunDirLock

    sup = Supervisor(config, resume=resume, live=live)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            # a signal only sets a flag; the watch loop stops the children
            loop.add_signal_handler(sig, sup.request_stop, sig.name)
        return await sup.run()

    try:
        with RunDirLock(config.run_dir, "up"):  # one supervisor per run dir
            code = asyncio.run(main())
    except MasterFailedToStart as exc:  # its config was refused (2) or its start failed (1)
        return fail(prog, exc, EXIT_USAGE if exc.code == EXIT_USAGE else EXIT_FAILED)
    except TandemError as exc:
        return fail(prog, exc, EXIT_FAILED)
    for name, value in sup.summary(code, png_in_background=png_in_background):
        click.echo(f"{name:>28}: {value}")
    return code


@click.command("up")
@click.argument("config_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config key, e.g. --set trainer.lr=1e-5 (repeatable)")
@click.option("--resume", is_flag=True,
              help="continue the run in run_dir where the config changed a key that may change "
                   "on resume (master.total_steps, upward); a run with an unchanged config "
                   "continues without it")
@click.option("--plain", is_flag=True, help="print progress lines instead of a live panel")
def up(config_path: str, overrides: tuple[str, ...], resume: bool, plain: bool) -> None:
    """Start a whole run on this machine as separate processes."""
    from tandem.common.cli import load_config_or_exit

    from .taskset import load_rows

    def tasks_readable(config: RunConfig) -> None:
        # every row is read and formatted before any component starts: a bad row is exit 2
        # naming the file, the row and the column, not a master that dies while starting.
        # Images are the master's to read (once): a bad one skips its task, it stops nothing
        if config.master.taskset.path:
            load_rows(config.master.taskset, images=False)

    # the run dir's run is checked before anything starts: another config is exit 2, a
    # finished run exit 0 (tandem.common.runrecord)
    config = load_config_or_exit("tandem up", config_path, overrides, check=tasks_readable,
                                 resume=resume)
    code = run_up(config, resume=resume, live=False if plain else None, png_in_background=True)
    # as each component does (tandem.common.cli.run_component): the interpreter's last full
    # collection walked every object this process holds, 0.6-0.9 s of each invocation's end on
    # a loaded machine; frozen, it skips them (reference counts still free them)
    gc.freeze()
    sys.exit(code)
