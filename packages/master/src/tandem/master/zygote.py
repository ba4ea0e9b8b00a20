"""The warm process of `tandem up` (`up.launch: fork`): imports torch and transformers once and
forks the trainer and the explorers from it, so two or more processes do not each spend seconds
of CPU importing the same libraries at the same moment, and share those pages afterwards.

A fork is sound only before any thread exists: the zygote imports, checks that it still has
one thread and no CUDA context, and refuses every request otherwise (`tandem up` then starts
that component by exec). Everything a component creates (torch's intra-op pool, its zmq
context, its asyncio loop) comes after the fork, in the component. Each component is forked
twice, so that it is not the zygote's child but `tandem up`'s: `tandem up` is a child
subreaper (PR_SET_CHILD_SUBREAPER), the middle process exits at once, and the component is
re-parented to `tandem up`, which then waits for it, signals its session and restarts it exactly
as one it had started by exec.

The protocol, one JSON line each way on the zygote's stdin and stdout:
  up -> zygote  {"argv": [script, *args], "env": {...}, "log": path, "cwd": dir}
  zygote -> up  {"ready": seconds} once, after the imports; then per request
                {"pid": n} or {"error": "one line"}.
The zygote exits when its stdin closes (`tandem up` ended, however it ended).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

# What the trainer and the explorers import before they can register, but not their own
# packages (a component's code stays its own); model classes load through
# transformers.modeling_utils. What is left for each to import after the fork was ~0.1-0.4 s.
PRELOAD = ("torch", "transformers", "transformers.modeling_utils",
           "transformers.generation.utils", "tandem.common.config", "tandem.common.messages",
           "tandem.common.rpc")

# Environment read when a process starts (the dynamic loader, the interpreter, glibc's malloc),
# which a fork would not honour: a component whose environment changes one of these is started
# by exec. MALLOC_MMAP_THRESHOLD_ (placement.colocate) is honoured through mallopt instead.
EXEC_ONLY_PREFIXES = ("LD_", "PYTHON", "MALLOC_", "GLIBC_TUNABLES")
HONOURED = {"PYTHONUNBUFFERED", "MALLOC_MMAP_THRESHOLD_"}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter behind MALLOC_MMAP_THRESHOLD_
PR_SET_NAME = 15


def needs_exec(env: dict[str, str], base: dict[str, str] | None = None) -> str | None:
    """The first variable of `env` that only an exec would apply (it differs from the
    zygote's environment, `base`), or None when a fork starts the component as exec would."""
    base = os.environ if base is None else base
    for key in sorted(set(env) | set(base)):
        if key in HONOURED or not key.startswith(EXEC_ONLY_PREFIXES):
            continue
        if env.get(key) != base.get(key):
            return key
    return None


def unsound() -> str | None:
    """Why forking this process now would not be sound, or None."""
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        return f"the zygote has {len(threads)} threads after its imports"
    # A CUDA context does not survive a fork. The driver library is loaded on its first use
    # (cuInit), not when torch is imported: while it is not mapped, no context exists.
    with open("/proc/self/maps") as f:
        if "libcuda.so" in f.read():
            return "the zygote's imports loaded the CUDA driver"
    return None


def answer(out: int, **message) -> None:
    os.write(out, (json.dumps(message) + "\n").encode())


def fork_component(request: dict) -> int:
    """Fork the component of `request` twice and return its pid. In the component itself this
    does not return: it raises `_Become` for main() to run the component."""
    sys.stdout.flush()  # nothing buffered here may be written twice
    sys.stderr.flush()
    # The imported modules' objects move to the collector's permanent generation, which it
    # never scans: a collection in the component then writes to none of them, and the pages
    # they fill stay shared with the zygote's other components instead of being copied into
    # each (the trainer's and the explorer's private memory: 359 -> 240 MiB, issue 27 item 1)
    gc.freeze()
    reader, writer = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(reader)
        try:
            pid = os.fork()
        except BaseException:
            os._exit(1)
        if pid == 0:
            os.close(writer)
            raise _Become(request)
        try:
            os.write(writer, str(pid).encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as r:
        data = r.read()
    os.waitpid(middle, 0)  # once the middle process is gone, the component is up's child
    if not data:
        raise OSError("the component's fork failed")
    return int(data)


class _Become(BaseException):
    """Raised in a freshly forked component, to unwind the zygote's loop and run it."""

    def __init__(self, request: dict):
        self.request = request


def become(request: dict) -> None:
    """Turn this fork into the component the request names, as exec would have started it."""
    os.setsid()  # its own session, as `tandem up` starts every child
    os.chdir(request.get("cwd") or os.getcwd())
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    # PYTHONUNBUFFERED, as exec'd children get it: a log line is on disk when it is written
    sys.stdout, sys.stderr = unbuffered(1), unbuffered(2)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    if "MALLOC_MMAP_THRESHOLD_" in env:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(env["MALLOC_MMAP_THRESHOLD_"]))
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS"):
        # OpenMP read the zygote's environment when torch loaded
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # its global generator would be the zygote's in every child
        numpy.random.seed()
    sys.argv = list(request["argv"])
    set_cmdline(sys.argv)


def set_cmdline(argv: list[str]) -> None:
    """Show the component's `argv` in /proc/self/cmdline after the interpreter, as the kernel
    runs a script's #! line (ps, pgrep -f, tools that find a component by its script and
    --name), and its script's name in /proc/self/comm: written over the zygote's own argv,
    which `tandem up` made long enough (`room`)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
    data = "\0".join([sys.executable, *argv]).encode()[:end - start - 1]
    ctypes.memmove(start, data.ljust(end - start, b"\0"), end - start)
    ctypes.CDLL(None).prctl(PR_SET_NAME, Path(argv[0]).name.encode()[:15], 0, 0, 0)


def room(argvs: list[list[str]]) -> str:
    """A blank argument that makes the zygote's argv as long as the longest component argv
    (the interpreter's path, which both begin with, aside)."""
    return " " * max(len("\0".join(a).encode()) for a in argvs)


def unbuffered(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(open(fd, "wb", buffering=0, closefd=False), encoding="utf-8",
                            errors="backslashreplace", line_buffering=True, write_through=True)


def console_script(path: str):
    """The function behind the console script at `path` (e.g. .../bin/tandem-trainer)."""
    name = Path(path).name
    found = entry_points(group="console_scripts", name=name)
    if not found:
        raise LookupError(f"no console script named {name} in this environment")
    return next(iter(found)).load()


def serve(inp, out: int) -> None:
    """Answer requests until stdin closes; returns only in a forked component (via _Become)."""
    started = time.monotonic()
    refused = None
    # numpy's OpenBLAS starts its thread pool when it loads, unless told one thread: a fork
    # must come before any thread exists. A component's BLAS then has one thread (what
    # placement's OMP_NUM_THREADS gives it anyway); one that sets OPENBLAS_NUM_THREADS itself
    # leaves the zygote with threads, and so is started by exec.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except ImportError as exc:  # a control-plane-only install: nothing to share
        refused = f"cannot import {exc.name}"
    refused = refused or unsound()
    answer(out, ready=round(time.monotonic() - started, 3), refused=refused)
    for line in inp:
        request = json.loads(line)
        if "argv" not in request and "log" in request:  # a preforked zygote learns its log
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(log, 2)
            os.close(log)
            continue
        if refused:
            answer(out, error=refused)
            continue
        try:
            console_script(request["argv"][0])  # resolved here, so a bad name is an answer
            answer(out, pid=fork_component(request))
        except (OSError, LookupError) as exc:
            answer(out, error=f"{type(exc).__name__}: {exc}")


def main() -> None:
    out = os.dup(1)  # answers go here; the forked components get their own stdout
    inp = os.fdopen(os.dup(0), "r")
    try:
        serve(inp, out)
    except _Become as b:
        inp.close()
        os.close(out)
        request = b.request
        become(request)
        entry = console_script(request["argv"][0])
        sys.exit(entry())
    # stdin closed: nothing of the zygote's is left to finish, and an interpreter holding
    # torch took 0.6-0.7 s of CPU to tear itself down, while its pages, which the components
    # copied on write as they started, still counted in the run's memory (issue 27 item 1)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()


# -- tandem up's end -------------------------------------------------------------------------

PR_SET_CHILD_SUBREAPER = 36


class ZygoteRefused(Exception):
    """The zygote cannot fork this component; `tandem up` starts it by exec instead."""


class ForkedProcess:
    """A component the zygote forked, re-parented to this process: the part of
    subprocess.Popen that `tandem up` uses (pid, poll, wait)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


class PreforkedProcess(ForkedProcess):
    """A zygote forked from this process (`prefork`): the part of subprocess.Popen that
    `Zygote` uses, over the two pipes of the zygote's protocol."""

    def __init__(self, pid: int, stdin: io.BufferedWriter, stdout: io.BufferedReader):
        super().__init__(pid)
        self.stdin = stdin
        self.stdout = stdout

    def terminate(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)


_preforked: PreforkedProcess | None = None


def prefork() -> None:
    """Fork this process's zygote now, for the next `Zygote` to take: in a `tandem up` forked
    from the warm process (`tandem.master.warm`), which imported what the zygote would, and
    before the run has a thread, a socket or an event loop. The zygote is this process's child
    in a session of its own, as an exec'd one is; its stderr goes to the log `Zygote` names."""
    global _preforked
    to_zygote, requests = os.pipe()
    answers, from_zygote = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.close(requests)
            os.close(answers)
            os.dup2(to_zygote, 0)
            os.dup2(from_zygote, 1)
            os.close(to_zygote)
            os.close(from_zygote)
        except OSError:  # never back into the caller's code: that is `tandem up`'s
            os._exit(1)
        # the zygote's SystemExit, and each forked component's, ends this interpreter as an
        # exec'd one's would: it unwinds through the caller's frames, which leave it be
        main()
    os.close(to_zygote)
    os.close(from_zygote)
    _preforked = PreforkedProcess(pid, os.fdopen(requests, "wb"), os.fdopen(answers, "rb"))


def drop_prefork() -> None:
    """End a preforked zygote no `Zygote` took (the run started its components by exec)."""
    global _preforked
    proc, _preforked = _preforked, None
    if proc is not None:
        proc.stdin.close()  # it exits when its stdin closes
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()


class Zygote:
    """`tandem up`'s handle on the warm process: started at once, so its imports overlap the
    master's and the buffer's start; `fork` waits for them (bounded by `timeout`, the run's
    up.start_timeout) and returns the component as a ForkedProcess."""

    def __init__(self, log_path: Path, timeout: float, argvs: list[list[str]]):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
        self.timeout = timeout
        self.log_path = log_path
        self.refused: str | None = None
        self.ready_after: float | None = None
        self._buffer = b""
        self._env = dict(os.environ)
        self._closing = threading.Lock()  # close() runs once; a second caller waits for it
        log_path.parent.mkdir(parents=True, exist_ok=True)
        global _preforked
        self.preforked = _preforked is not None
        if self.preforked:  # forked from the warm process: nothing left to import
            self.proc, _preforked = _preforked, None
            self.proc.stdin.write((json.dumps({"log": str(log_path)}) + "\n").encode())
            self.proc.stdin.flush()
        else:
            self._exec(argvs)
        self._deadline = time.monotonic() + timeout

    def _exec(self, argvs: list[list[str]]) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.master.zygote", room(argvs)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, start_new_session=True, env=self._env)

    def _line(self) -> dict:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = self._deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.close(kill=True)  # it does not answer: nothing to wait for
                raise ZygoteRefused(f"the zygote did not answer within {self.timeout:g}s "
                                    f"(up.start_timeout; its log: {self.log_path})")
            chunk = os.read(fd, 65536)
            if not chunk:
                self.refused = f"the zygote exited (its log: {self.log_path})"
                raise ZygoteRefused(self.refused)
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def wait_ready(self) -> None:
        """Wait for the zygote's imports (bounded by up.start_timeout from its start)."""
        if self.ready_after is None and self.refused is None:
            try:
                ready = self._line()
            except ZygoteRefused as exc:
                self.refused = str(exc)
                return
            self.ready_after = ready["ready"]
            self.refused = ready.get("refused")

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> ForkedProcess:
        reason = needs_exec(env, self._env)
        if reason:
            raise ZygoteRefused(f"{reason} in its environment takes effect only at exec")
        self.wait_ready()
        if self.refused:
            raise ZygoteRefused(self.refused)
        self._deadline = time.monotonic() + self.timeout
        # The log exists when fork returns, as exec's does (up opens it before Popen): the
        # component opens it itself, but only once it runs, which on a busy machine is after
        # the zygote has answered, and a reader looking at once found no file.
        os.close(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "log": str(log),
                                               "cwd": os.getcwd()}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.refused = f"the zygote exited (its log: {self.log_path})"
            raise ZygoteRefused(self.refused) from None
        reply = self._line()
        if "error" in reply:
            raise ZygoteRefused(reply["error"])
        return ForkedProcess(reply["pid"])

    def close(self, *, kill: bool = False) -> None:
        """End the zygote and wait for it: one that answered exits when its stdin closes, one
        still importing is terminated (SIGTERM's default action), a stuck one (or, with
        `kill`, one that stopped answering) killed. The wait is bounded by up.start_timeout, as
        its start was: an interpreter holding torch takes seconds to exit on a loaded machine,
        and a fixed 5 s turned that exit into a SIGKILL. Idempotent and thread-safe: `tandem
        up` closes it on a thread once the children are forked, and again when the run ends."""
        with self._closing:
            if self.proc.stdout.closed:
                return
            importing = self.ready_after is None and self.refused is None
            self.refused = self.refused or "the zygote was closed"
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            if kill and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            elif importing and self.proc.poll() is None:
                self.proc.terminate()
            try:
                self.proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            self.proc.stdout.close()


def reap_orphans(known: set[int]) -> None:
    """Wait for exited processes re-parented to this subreaper that nobody else waits for (a
    component's own children, when the component died before them); `known` are the pids whose
    owners wait for them."""
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in pids:
            if pid not in known:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
