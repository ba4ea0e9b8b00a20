"""Agent episodes out of the explorer's process: each in its own sandboxed process.

The `agent` workflow hands each episode to `AgentSandbox.play`: the episode's process
(`agent_worker`, run by `tandem.common.sandbox`, the reward's code sandbox) holds the episode's
key, the task payload and the agent's code, nothing else. It sees the Python runtime and the
explorer's import path read-only, its own scratch folder and /tmp, and one unix socket that
this module bridges, for this episode alone, to the endpoint's TCP port: its network namespace
has no other way out. Its own PID namespace hides the explorer and every other episode, its
own uid (as root) keeps it from signalling or reading them, and its limits (CPU, memory,
processes, files) and wall clock are the episode's. Whatever it does, the explorer gets back a
`Played`: the agent's result or why it has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import structlog
from pydantic import BaseModel, ConfigDict, Field

from tandem.common.config.reward import CodeSandboxConfig
from tandem.common.sandbox import STARTED, Run, Sandbox

from . import agent_worker

log = structlog.get_logger(__name__)

KEY = "workflow_args.sandbox"
SOCKET = "/sandbox/endpoint.sock"  # where the episode's bridge appears inside the sandbox


class AgentSandboxArgs(BaseModel):
    """Limits of the process each agent episode runs in (`workflow_args.sandbox`)."""

    model_config = ConfigDict(extra="forbid")

    isolation: Literal["auto", "namespaces", "none"] = Field(
        default="auto",
        description="auto or namespaces: each episode in a bubblewrap sandbox (read-only "
                    "runtime and import path, fresh PID/network/IPC namespaces, its own uid "
                    "as root); refuses to start without bwrap. none: a plain child process "
                    "with rlimits, for trusted agents only")
    memory_mb: int = Field(default=1024, ge=128,
                           description="memory of the episode's processes (a cgroup, when "
                                       "writable) and address space per process, MiB")
    start_seconds: float = Field(
        default=60.0, gt=0,
        description="wall clock the episode's process may take to start (the sandbox, the "
                    "interpreter, the openai client, the agent's module) before the agent is "
                    "called; workflow_args.timeout counts from that call")
    cpu_seconds: float | None = Field(
        default=None, gt=0, description="CPU time of the episode's process from the agent's "
                                        "call, as its timeout; default: workflow_args.timeout")
    nproc: int = Field(default=64, ge=4, description="processes and threads (RLIMIT_NPROC)")
    open_files: int = Field(default=256, ge=32, description="file descriptors (RLIMIT_NOFILE)")
    file_size_mb: float = Field(default=64.0, gt=0,
                                description="largest file written (RLIMIT_FSIZE), MiB")
    uid_base: int = Field(
        default=62000, ge=1000,
        description="as root, each episode slot runs as a uid of its own, the first free "
                    "from uid_base up (claimed host-wide; apart from reward.code.uid_base, so "
                    "reward runs and agents never share a uid)")


@dataclass
class Played:
    """How one episode's process ended: the agent's `result`, or `reason` why there is none."""

    result: Any = None
    reason: str = "ok"


class AgentSandbox:
    """`start()` once, `play()` concurrently (at most `slots` at once), `close()` at the end."""

    def __init__(self, fn: str, args: AgentSandboxArgs, *, timeout: float, max_retries: int,
                 slots: int):
        self.fn, self.args = fn, args
        self.timeout, self.max_retries = timeout, max_retries
        self.path = [os.path.abspath(p) for p in sys.path if p and Path(p).exists()]
        self.cpu_seconds = args.cpu_seconds or timeout
        # the process's CPU limit covers its start too (at most start_seconds of it): the
        # episode lowers it to what it spent plus cpu_seconds when it calls the agent
        self.sandbox = Sandbox(CodeSandboxConfig(
            cpu_seconds=self.cpu_seconds + args.start_seconds, wall_seconds=timeout,
            memory_mb=args.memory_mb, nproc=args.nproc, open_files=args.open_files,
            file_size_mb=args.file_size_mb, isolation=args.isolation, uid_base=args.uid_base),
            slots=slots, readable=tuple(self.path), key=KEY)
        self._program = Path(agent_worker.__file__).read_text(encoding="utf-8")
        self._dir: Path | None = None

    async def start(self) -> None:
        if self._dir is None:
            await self.sandbox.start()
            self._dir = Path(tempfile.mkdtemp(prefix="tandem-agent-"))
            self._dir.chmod(0o711)

    async def close(self) -> None:
        await self.sandbox.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def play(self, key: str, endpoint_url: str, task: dict[str, Any]) -> Played:
        """Run the agent on `task` as the episode `key` in its own sandbox."""
        await self.start()
        bridge = await _Bridge.open(self._dir, endpoint_url)
        try:
            socket = SOCKET if self.sandbox.isolated else str(bridge.path)
            spec = {"path": self.path, "fn": self.fn, "task": task, "key": key,
                    "socket": socket, "timeout": self.timeout, "max_retries": self.max_retries,
                    "cpu_seconds": self.cpu_seconds, "started": STARTED.decode()}
            run = await self.sandbox.run(self._program, stdin=json.dumps(spec).encode() + b"\n",
                                         start_seconds=self.args.start_seconds,
                                         binds=((str(bridge.path), SOCKET),))
        finally:
            await bridge.close()
        return self._played(run)

    def _played(self, run: Run) -> Played:
        reply = None
        line = run.stdout.strip().splitlines()[-1:] if run.stdout.strip() else []
        with contextlib.suppress(ValueError):
            reply = json.loads(line[0]) if line else None
        if run.status == "ok" and isinstance(reply, dict):
            if "result" in reply:
                return Played(reply["result"])
            if "raised" in reply:
                return Played(reason=f"raised {reply['raised']}")
            if "garbage" in reply:
                return Played(reason=f"returned {reply['garbage']}, not a reward")
        cfg = self.sandbox.config
        detail = f": {run.detail}" if run.detail else ""
        if run.status == "timeout":
            return Played(reason=f"timeout: ran past workflow_args.timeout = {self.timeout:g}s")
        if run.status == "start_timeout":
            return Played(reason=f"start_timeout: the agent was not called within {KEY}."
                                 f"start_seconds = {self.args.start_seconds:g}s of the episode's "
                                 f"process starting{detail}")
        if run.status == "memory":
            return Played(reason=f"memory: ran out of {KEY}.memory_mb = {cfg.memory_mb} MiB")
        if run.status == "cpu":
            return Played(reason=f"cpu: ran past {KEY}.cpu_seconds = {self.cpu_seconds:g}s")
        if run.status == "output_limit":
            return Played(reason=f"output_limit: wrote over {cfg.max_output_bytes} bytes")
        if run.status == "ok":
            return Played(reason=f"crashed: exited 0 without a result{detail}")
        return Played(reason=f"crashed: {run.status} {run.exit_code}{detail}")


class _Bridge:
    """A unix socket, one episode's, whose connections are piped to the endpoint's TCP port."""

    def __init__(self, path: Path, server: asyncio.Server, pipes: set[asyncio.Task]):
        self.path, self.server, self.pipes = path, server, pipes

    @classmethod
    async def open(cls, folder: Path, url: str) -> _Bridge:
        where = urlsplit(url)
        host, port = where.hostname, where.port
        path = folder / f"bridge-{secrets.token_hex(8)}.sock"
        pipes: set[asyncio.Task] = set()

        async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            pipes.add(task)
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), 10.0)
            except (OSError, TimeoutError) as exc:
                log.warning("agent.bridge_refused", endpoint=url, error=repr(exc))
                writer.close()
                pipes.discard(task)
                return
            try:
                await asyncio.gather(agent_worker.pipe(reader, up_writer),
                                     agent_worker.pipe(up_reader, writer))
            finally:
                pipes.discard(task)

        server = await asyncio.start_unix_server(connect, path=str(path))
        path.chmod(0o666)  # the episode's uid connects to it
        return cls(path, server, pipes)

    async def close(self) -> None:
        self.server.close()
        for task in list(self.pipes):
            task.cancel()
        await asyncio.gather(*self.pipes, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.server.wait_closed(), 5.0)
        self.path.unlink(missing_ok=True)
