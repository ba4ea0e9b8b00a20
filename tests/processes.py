"""The processes a test leaves behind: every descendant of pytest, orphans included."""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from backstop import BACKSTOP
from tandem.common.spawn import proc_stats, stat_fields

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> None:
    """Make this process the subreaper of everything it starts.

    A process whose parent dies (a torchrun rank after torchrun is killed) is then re-parented to
    this process instead of init, so `descendants()` still lists it, and it can be killed and
    reaped.
    """
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


# Every process this one started itself (subprocess, asyncio's subprocesses, multiprocessing):
# their waits belong to whoever started them. Any other child is an orphan re-parented here.
_spawned: set[int] = set()


def track_spawns() -> None:
    """Record the pid of each process this one starts through subprocess.Popen (asyncio's
    subprocesses use it too) or multiprocessing, for `reap_orphans`."""
    import multiprocessing.popen_fork
    import multiprocessing.popen_forkserver
    import multiprocessing.popen_spawn_posix

    def recording(launch):
        def launch_and_record(self, *args, **kwargs):
            try:
                return launch(self, *args, **kwargs)
            finally:
                if getattr(self, "pid", None):
                    _spawned.add(self.pid)
        return launch_and_record

    subprocess.Popen._execute_child = recording(subprocess.Popen._execute_child)
    for module in (multiprocessing.popen_fork, multiprocessing.popen_spawn_posix,
                   multiprocessing.popen_forkserver):
        module.Popen._launch = recording(module.Popen._launch)


def zombie_children() -> set[int]:
    """This process's children that exited and wait for its wait."""
    me = os.getpid()
    return {pid for pid, stat in proc_stats() if stat[0] == "Z" and int(stat[1]) == me}


def reap_orphans() -> list[int]:
    """Reap the exited orphans re-parented to this process (it is their subreaper): a process
    whose parent died before it (what a SIGKILL of `tandem up` leaves, or a sandbox whose
    namespace was torn down) stays a zombie here until waited for, and nobody else will. The
    children this process started itself are left to their own waits. Returns the pids reaped."""
    reaped = []
    for pid in sorted(zombie_children() - _spawned):
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped.append(pid)
        except ChildProcessError:
            pass
    return reaped


def descendants() -> dict[int, str]:
    """Every live (not zombie) process below this one: pid -> command line."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
        except OSError:
            continue  # exited while we looked
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if fields.get("State", "").startswith(("Z", "X")):
            continue
        parents[int(entry.name)] = int(fields.get("PPid", "0"))
        commands[int(entry.name)] = command.strip()[:200]
    found: dict[int, str] = {}
    frontier = [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = commands[pid]
                frontier.append(pid)
    return found


def vllm_processes() -> list[str]:
    """vLLM's engine cores and workers still running below this process (as a subreaper, orphans
    of the run count too); other sessions' vLLM on the machine does not."""
    return [f"{pid}: {cmd}" for pid, cmd in descendants().items() if cmd.startswith("VLLM::")]


def kill_and_reap(pids) -> None:
    """SIGKILL these processes and reap those that are this process's children (orphans that
    were re-parented here included); waits at most 5 s for them to go."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child (its parent reaps it) or reaped already
                done = pid if not Path(f"/proc/{pid}").exists() else 0
            if done:
                waiting.discard(pid)
        time.sleep(0.02)


def thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each thread of `pid` (R, S, D, T, t, Z, ...); [] once it
    is gone."""
    try:
        # os.listdir, not Path.glob: glob checks the folder is there, then lists it, and a
        # process reaped in between made it raise FileNotFoundError
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # gone (reaped) while we looked
    states = []
    for task in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
            states.append(stat.rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # that thread exited while we looked
    return states


def catches(pid: int, sig: int) -> bool:
    """Whether `pid` has a handler of its own installed for `sig` (/proc: SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((line.split()[1] for line in status.splitlines()
                   if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) >> (sig - 1) & 1)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """`predicate()`'s first true value, polled every `interval` seconds; `timeout` only bounds
    a hang (a verdict never rests on it: the moment waited for is the system's own event)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({timeout:g}s)")
        time.sleep(interval)
    return value


async def until(check, what: str, interval: float = 0.01) -> None:
    """`wait_for` in an event loop: until `check()` (or the awaitable it returns) is true, the
    loop serving meanwhile; BACKSTOP only bounds a hang."""
    deadline = time.monotonic() + BACKSTOP
    while not ((await value) if inspect.isawaitable(value := check()) else value):
        assert time.monotonic() < deadline, f"no {what} within {BACKSTOP:g}s"
        await asyncio.sleep(interval)


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, exited and not yet reaped, does not)."""
    return any(state not in "ZX" for state in thread_states(pid))


def freeze(pid: int, timeout: float = BACKSTOP) -> None:
    """SIGSTOP `pid` and return once every one of its threads has stopped.

    `kill()` returns before the signal has reached a thread that is running on another core or
    sits in a system call (a rename, an fsync), so a process is only frozen once /proc says so;
    from then on nothing it does can change what a test reads of it (its files, its journal
    records, its logs), and a SIGKILL sent now lands exactly on what was read.
    `timeout` only bounds a hang (a thread stuck in the kernel); ProcessLookupError if `pid`
    is gone."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = [state for state in thread_states(pid) if state not in "ZX"]  # live threads
        if not states:
            raise ProcessLookupError(f"process {pid} exited before it could be frozen")
        if all(state in "tT" for state in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not stop within {timeout:g}s of SIGSTOP: "
                                 f"its threads are {states}")
        time.sleep(0.005)


def run_group(argv: list[str], timeout: float, *, stall: float | None = None,
              **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True)` in a session of its own: past
    `timeout`, the whole group (a `tandem up` and the components it started) gets SIGTERM, then
    SIGKILL 20 s later, before TimeoutExpired is raised, so nothing it started is left behind.

    With `stall`, a run is also hung when the processes below this one (its own and the
    components it started, whatever their session) spend less than 1% of a core (`stall` / 100
    CPU seconds) in `stall` seconds of wall-clock: a run that computes (a quickstart's SFT and
    GRPO) gets its share of a loaded machine's cores (a load of 13 on 2 cores leaves each
    process 15%) and goes on, however long that takes up to `timeout`, while a deadlock, whose
    processes only wait, is caught after `stall` seconds."""
    # the run's processes are those below this one that were not there before it started:
    # `tandem up` starts each component in a session of its own, and a zygote's forks are
    # re-parented here once it exits, so neither the leader's group nor its session holds them all
    before = set(descendants()) if stall is not None else set()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    deadline = time.monotonic() + timeout
    growth = CpuGrowth(stall / 100 if stall is not None else 0.0)
    while True:
        try:
            out, err = proc.communicate(timeout=timeout if stall is None else 5.0)
            return subprocess.CompletedProcess(argv, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if stall is not None:
                growth.look((set(descendants()) - before) | {proc.pid})
            if now > deadline or (stall is not None and now - growth.moved > stall):
                break
    out = err = ""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            out, err = proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; the rest of its group got the same signal and may still be
        # on its way out (longer on a loaded machine): gone too before this returns
        wait_until = time.monotonic() + wait
        while _group(proc.pid) and time.monotonic() < wait_until:
            time.sleep(0.02)
        if not _group(proc.pid):
            break
    raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err) from None


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has spent itself."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuGrowth:
    """CPU seconds a changing set of processes spent between two looks, and when they last
    spent `threshold` (`moved`, time.monotonic()).

    Each process (a pid and its start time, so a reused pid is a new one) is counted by its own
    growth, its CPU and that of the children it reaped: a total summed over the set drops by
    what a process that exits had spent, and hid the others' progress behind it (a run
    computing a tenth of the time looked hung while an unrelated process exited)."""

    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold = threshold
        self.moved = time.monotonic()
        self._since = 0.0  # seconds spent since `moved`
        self._ticks: dict[tuple[int, int], int] = {}

    def look(self, pids) -> float:
        """Count what `pids` spent since the last look; returns `moved`."""
        self._since += self.spent(pids)
        if self._since >= self.threshold:
            self.moved, self._since = time.monotonic(), 0.0
        return self.moved

    def spent(self, pids) -> float:
        """Seconds spent by `pids` since the last call (for a process first seen: all of its)."""
        pids = set(pids)
        spent, now = 0, {}
        for pid, f in proc_stats():
            if pid in pids:
                key, ticks = (pid, int(f[19])), sum(int(t) for t in f[11:15])
                spent += ticks - self._ticks.get(key, 0)
                now[key] = ticks
        self._ticks = now
        return spent / os.sysconf("SC_CLK_TCK")


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    return [pid for pid, fields in proc_stats() if int(fields[2]) == pgid and fields[0] not in "ZX"]
