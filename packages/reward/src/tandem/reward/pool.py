"""Worker processes that run pure reward functions under a time limit that really holds.

A thread cannot be stopped and math-verify's own limit (SIGALRM) works on the main thread
only, so an evaluation that must be bounded runs in a worker process; when it overruns, the
worker is killed (SIGKILL) and a fresh one started in the background, and the evaluation
scores 0 with reason `timeout`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import structlog

from tandem.common.config.reward import RewardConfig
from tandem.common.plugins import loaded_plugins
from tandem.common.errors import TandemError
from tandem.common.messages.reward import Score, ScoreItem
from tandem.common.spawn import kill, spawn

from .frames import HEADER, pack, unpack

log = structlog.get_logger(__name__)

STARTUP_TIMEOUT = 120.0


class EvaluationTimeout(Exception):
    """The evaluation overran its limit; the worker that ran it was killed."""


class WorkerDied(Exception):
    """The worker process ended while it held an evaluation; a fresh one replaces it."""


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def send(self, obj: object) -> None:
        self.proc.stdin.write(pack(obj))
        await self.proc.stdin.drain()

    async def recv(self) -> dict:
        head = await self.proc.stdout.readexactly(HEADER.size)
        (size,) = HEADER.unpack(head)
        return unpack(await self.proc.stdout.readexactly(size))

    async def kill(self) -> None:
        await kill(self.proc)


class WorkerPool:
    """`size` worker processes; `evaluate(fn, item, timeout)` runs on the first idle one."""

    def __init__(self, config: RewardConfig, *, size: int | None = None):
        self.config = config
        self.size = size or config.workers
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._spawning: set[asyncio.Task] = set()
        self._starting: asyncio.Future | None = None
        self._closed = False
        self.killed = 0

    async def start(self) -> None:
        """Start the workers and wait until they are ready (their imports take a second).
        Concurrent callers share one start; a failed start fails every caller alike."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start_all())
        await asyncio.shield(self._starting)

    async def _start_all(self) -> None:
        results = await asyncio.gather(*(self._spawn() for _ in range(self.size)),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for worker in results:
            if not isinstance(worker, BaseException):
                self._idle.put_nowait(worker)
        if failed:
            raise failed[0]
        log.info("reward.pool_ready", workers=self.size)

    async def _spawn(self) -> _Worker:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        proc = await spawn(
            sys.executable, "-m", "tandem.reward.worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env, on_cancel=kill)
        worker = _Worker(proc)
        self._all.add(worker)
        try:
            # the worker imports the plugins this process imported, so a plugin's isolated
            # reward function is found there too (docs/extending.md)
            await worker.send({"reward": self.config.model_dump(mode="json"),
                               "plugins": loaded_plugins()})
            hello = await asyncio.wait_for(worker.recv(), STARTUP_TIMEOUT)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
            await worker.kill()
            self._all.discard(worker)
            raise TandemError(f"reward worker (pid {proc.pid}) did not start within "
                              f"{STARTUP_TIMEOUT:g}s: {type(exc).__name__}") from exc
        if not hello.get("ready"):
            raise TandemError(f"reward worker sent {hello!r} instead of ready")
        return worker

    def _replace(self, worker: _Worker) -> None:
        self._all.discard(worker)
        if self._closed:
            return

        async def respawn() -> None:
            while not self._closed:
                try:
                    self._idle.put_nowait(await self._spawn())
                    return
                except TandemError as exc:
                    log.error("reward.worker_start_failed", error=str(exc))
                    await asyncio.sleep(1.0)

        task = asyncio.create_task(respawn())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def evaluate(self, fn: str, item: ScoreItem, timeout: float, *,
                       deadline: float | None = None) -> Score:
        """Score `item` with `fn` in a worker; EvaluationTimeout after `timeout` seconds of
        running or at `deadline` (time.monotonic()), whichever is first. The wait for a free
        worker counts against the deadline only (without one: STARTUP_TIMEOUT at most)."""
        await self.start()
        wait = STARTUP_TIMEOUT if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            worker = await asyncio.wait_for(self._idle.get(), wait)
        except TimeoutError:
            raise EvaluationTimeout() from None
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout <= 0:
                self._idle.put_nowait(worker)
                raise EvaluationTimeout()
        start = time.monotonic()
        try:
            await worker.send({"fn": fn, "item": item.model_dump(mode="json")})
            reply = await asyncio.wait_for(worker.recv(), timeout)
        except TimeoutError:
            self.killed += 1
            log.warning("reward.evaluation_killed", fn=fn, limit=timeout, key="reward.timeout",
                        seconds=round(time.monotonic() - start, 3))
            await worker.kill()
            self._replace(worker)
            raise EvaluationTimeout() from None
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            await worker.kill()
            self._replace(worker)
            raise WorkerDied(f"reward worker (pid {worker.proc.pid}) died with exit code "
                             f"{worker.proc.returncode} while scoring with {fn}") from exc
        except BaseException:
            # Cancelled mid-evaluation: the worker's state is unknown, replace it.
            await asyncio.shield(worker.kill())
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        if "error" in reply:
            raise ValueError(reply["error"])
        return Score.model_validate(reply)

    async def close(self) -> None:
        self._closed = True
        if self._starting is not None:
            self._starting.cancel()
            await asyncio.gather(self._starting, return_exceptions=True)
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*self._spawning, return_exceptions=True)
        for worker in list(self._all):
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()
        await asyncio.gather(*(w.kill() for w in self._all), return_exceptions=True)
        self._all.clear()
