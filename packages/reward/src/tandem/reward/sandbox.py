"""Run one untrusted program once, inside limits, and say how it ended.

Each run gets:
- resource limits (CPU seconds, address space, processes, file size, open files), set by the
  runner on itself before the candidate starts;
- an empty temporary directory as its working directory, HOME and TMPDIR, removed afterwards
  (under a slot uid, so is whatever the run left in /tmp, /var/tmp and /dev/shm);
- a scrubbed environment (PATH, HOME, TMPDIR, LANG only);
- where the OS allows (`unshare`): a fresh network namespace (only a downed loopback: no
  network, none of the project's ports) and a fresh PID namespace whose first process is the
  runner, so when it exits, or is killed, the kernel kills everything the candidate started,
  even processes that left the process group;
- when the scorer runs as root, its own uid per slot (`reward.code.uid_base` + slot), because
  the kernel does not apply the process limit to root;
- a wall-clock limit after which the whole process tree is killed.

Output is read up to `max_output_bytes`; grading happens in the caller, outside the sandbox.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from tandem.common.config.reward import CodeSandboxConfig
from tandem.common.errors import TandemError

from . import sandbox_runner

log = structlog.get_logger(__name__)

_RESERVED = {
    sandbox_runner.RUNTIME_ERROR: "runtime_error",
    sandbox_runner.MEMORY_ERROR: "memory",
    sandbox_runner.SYNTAX_ERROR: "syntax_error",
    sandbox_runner.FILE_TOO_LARGE: "file_size",
    sandbox_runner.NOT_REACHED: "not_reached",
}


@dataclass(slots=True)
class Run:
    """How one run ended. `status`: ok, exit (nonzero code), runtime_error, memory,
    syntax_error, file_size, not_reached (assert mode: exited before the tests finished), cpu,
    signal, timeout (wall clock) or output_limit."""

    status: str
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    seconds: float

    @property
    def detail(self) -> str:
        """The last line of stderr, which usually names the exception."""
        lines = [ln for ln in self.stderr.decode(errors="replace").strip().splitlines()
                 if ln.strip() and not ln.startswith("unshare: ")]
        return lines[-1][:200] if lines else ""


def _status(code: int) -> str:
    if code == 0:
        return "ok"
    if code in _RESERVED:
        return _RESERVED[code]
    if code > 128 or code < 0:  # the runner's 128 + signal, or the launcher's own signal
        sig = code - 128 if code > 128 else -code
        return "cpu" if sig in (signal.SIGXCPU, signal.SIGKILL) else "signal"
    return "exit"


class Sandbox:
    """`start()` once (probes what isolation the OS allows), then `run()` concurrently."""

    def __init__(self, config: CodeSandboxConfig, *, slots: int):
        self.config = config
        self.slots = slots
        self.python = config.python or sys.executable
        self.namespaces = False
        self.per_slot_uid = os.geteuid() == 0
        self.probe_error = ""
        self._slot_queue: asyncio.Queue[int] | None = None
        self._base: Path | None = None
        self._runner: Path | None = None

    async def start(self) -> None:
        if self._base is not None:
            return
        self._base = Path(tempfile.mkdtemp(prefix="tandem-sandbox-"))
        self._base.chmod(0o755)
        self._runner = self._base / "runner.py"
        shutil.copyfile(sandbox_runner.__file__, self._runner)
        self._runner.chmod(0o644)
        self._slot_queue = asyncio.Queue()
        for slot in range(self.slots):
            self._slot_queue.put_nowait(slot)
        if self.config.isolation != "none":
            self.namespaces = await asyncio.to_thread(self._probe)
            if not self.namespaces and self.config.isolation == "namespaces":
                await self.close()
                raise TandemError(
                    "reward.code.isolation is 'namespaces' but `unshare` cannot create network "
                    "and PID namespaces here (needs root or unprivileged user namespaces; "
                    f"probe said: {self.probe_error or 'nothing'}); "
                    "set reward.code.isolation to auto or none")
        log.info("sandbox.ready", namespaces=self.namespaces, per_slot_uid=self.per_slot_uid,
                 slots=self.slots, python=self.python)
        if not self.namespaces:
            log.warning("sandbox.degraded", missing="network and PID namespaces",
                        consequence="candidates can reach the network and may outlive a run "
                                    "if they leave their process group",
                        probe_error=self.probe_error or None, key="reward.code.isolation")

    def _prefix(self, slot: int) -> list[str]:
        """The launcher commands in front of the runner for this slot."""
        cmd: list[str] = []
        if self.namespaces:
            cmd += ["unshare", "--net", "--pid", "--fork", "--kill-child"]
            if not self.per_slot_uid:
                cmd.insert(1, "--map-root-user")
        if self.per_slot_uid:
            uid = str(self.config.uid_base + slot)
            cmd += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                    "--pdeathsig=KILL"]
        return cmd

    def _probe(self) -> bool:
        saved = self.namespaces
        self.namespaces = True
        try:
            cmd = self._prefix(0) + [self.python, "-I", "-S", "-c", "pass"]
            done = subprocess.run(cmd, capture_output=True, timeout=30)
            self.probe_error = done.stderr.decode(errors="replace").strip()[-300:]
            return done.returncode == 0
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.probe_error = str(exc)
            return False
        finally:
            self.namespaces = saved

    async def run(self, program: str, *, stdin: bytes = b"", test: str | None = None) -> Run:
        """Run `program` (stdio mode), or `program` then `test` (assert mode)."""
        if self._slot_queue is None:
            await self.start()
        slot = await self._slot_queue.get()
        run_dir = self._base / f"run-{secrets.token_hex(8)}"
        try:
            return await self._run(slot, run_dir, program, stdin, test)
        finally:
            # Clean before the slot (and so its uid) is handed to the next run.
            uid = self.config.uid_base + slot if self.per_slot_uid else None
            await asyncio.shield(asyncio.to_thread(_clean, run_dir, uid))
            self._slot_queue.put_nowait(slot)

    async def _run(self, slot: int, run_dir: Path, program: str, stdin: bytes,
                   test: str | None) -> Run:
        cfg = self.config
        prog, work = run_dir / "prog", run_dir / "work"
        prog.mkdir(parents=True)
        work.mkdir()
        run_dir.chmod(0o755)
        prog.chmod(0o755)
        (prog / "solution.py").write_text(program, encoding="utf-8")
        marker = None
        args = ["stdio"]
        if test is not None:
            (prog / "test.py").write_text(test, encoding="utf-8")
            marker = secrets.token_hex(16)
            stdin = marker.encode() + b"\n"
            args = ["assert"]
        for path in prog.iterdir():
            path.chmod(0o644)
        if self.per_slot_uid:
            uid = cfg.uid_base + slot
            os.chown(work, uid, uid)
        work.chmod(0o700)
        args += [str(cfg.cpu_seconds), str(cfg.memory_mb << 20), str(cfg.nproc),
                 str(int(cfg.file_size_mb * (1 << 20))), str(cfg.open_files),
                 str(prog / "solution.py")]
        if test is not None:
            args.append(str(prog / "test.py"))
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work),
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
        cmd = self._prefix(slot) + [self.python, "-I", "-S", str(self._runner), *args]
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=str(work), env=env, start_new_session=True)
        out, err = bytearray(), bytearray()
        over = asyncio.Event()
        readers = [asyncio.create_task(self._read(proc.stdout, out, over)),
                   asyncio.create_task(self._read(proc.stderr, err, over))]
        feeder = asyncio.create_task(self._feed(proc, stdin))
        waiter = asyncio.create_task(proc.wait())
        limit = asyncio.create_task(over.wait())
        status = None
        try:
            done, _ = await asyncio.wait({waiter, limit}, timeout=cfg.wall_seconds,
                                         return_when=asyncio.FIRST_COMPLETED)
            if limit in done:
                status = "output_limit"
            elif not done:
                status = "timeout"
        finally:
            # Also on cancellation (the evaluation's own deadline): nothing may outlive the run.
            for task in (feeder, limit):
                task.cancel()
            await self._kill(proc)
            waiter.cancel()
            await self._drain(proc, readers)
        code = proc.returncode
        stdout = bytes(out)
        if status is None:
            status = _status(code)
            if marker is not None and status == "ok":
                tail = stdout.rstrip(b"\n").rsplit(b"\n", 1)
                if tail[-1] != marker.encode():
                    status = "not_reached"
                else:
                    stdout = tail[0] if len(tail) == 2 else b""
        return Run(status, code, stdout, bytes(err), time.monotonic() - start)

    @staticmethod
    async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
        try:
            if data:
                proc.stdin.write(data)
                await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the candidate did not read its input; its output says what it did

    async def _read(self, stream: asyncio.StreamReader, into: bytearray,
                    over: asyncio.Event) -> None:
        """Read to EOF, keeping at most max_output_bytes; more sets `over` (the run is killed)
        and is read and dropped, so the pipe drains and the process can be reaped."""
        cap = self.config.max_output_bytes
        while chunk := await stream.read(65536):
            if len(into) < cap:
                into += chunk[:cap - len(into)]
            elif not over.is_set():
                over.set()

    @staticmethod
    async def _drain(proc: asyncio.subprocess.Process, readers: list[asyncio.Task]) -> None:
        """Wait for the readers to see EOF; a writer that escaped the kill cannot hold us."""
        _, pending = await asyncio.wait(readers, timeout=1.0)
        if pending:
            for task in pending:
                task.cancel()
            proc._transport.close()  # no public way to drop a pipe a stray process holds open
            log.warning("sandbox.stray_writer", pid=proc.pid)
        await asyncio.gather(*readers, return_exceptions=True)

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        """Kill the tree: PID 1 of the namespace first (the kernel then kills the rest and the
        launcher reaps it), then the process group for whatever is left."""
        if proc.returncode is None:
            for pid in _children(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                await asyncio.wait_for(proc.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        if proc.returncode is None or not self.namespaces:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        await proc.wait()

    async def close(self) -> None:
        if self._base is not None:
            await asyncio.to_thread(shutil.rmtree, self._base, True)
            self._base = None
        self._slot_queue = None


SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")


def _clean(run_dir: Path, uid: int | None) -> None:
    """Remove the run's folder and, under a slot uid, whatever it left in the world-writable
    temporary folders (the candidate's own TMPDIR is inside its run folder)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    if uid is None:
        return
    for shared in SHARED_TMP:
        try:
            entries = list(os.scandir(shared))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]
