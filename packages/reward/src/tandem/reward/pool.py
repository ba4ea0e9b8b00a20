"""Worker processes that run pure reward functions under a time limit that really holds.

A thread cannot be stopped and math-verify's own limit (SIGALRM) works on the main thread
only, so an evaluation that must be bounded runs in a worker process; when it overruns, the
worker is killed (SIGKILL) and a fresh one started in the background, and the evaluation
scores 0 with reason `timeout`. Workers are forked from one template process that imported
and warmed up the functions once (`worker`), so starting or replacing one costs a fork. The
template warms the run's `reward.functions` as it starts; an item that asks for another isolated
function has it warmed there first (outside the item's time limit), and the idle workers forked
before that are forked again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time

import structlog

from tandem.common.config.reward import RewardConfig
from tandem.common.plugins import loaded_plugins
from tandem.common.errors import TandemError
from tandem.common.messages.reward import Score, ScoreItem
from tandem.common.spawn import kill, spawn

from .frames import HEADER, encode, pack, unpack

log = structlog.get_logger(__name__)

STARTUP_TIMEOUT = 120.0
KILL_WAIT = 10.0  # seconds a SIGKILLed worker has to be reported gone by the template


class EvaluationTimeout(Exception):
    """The evaluation overran its limit; the worker that ran it was killed."""


class WorkerDied(Exception):
    """The worker process ended while it held an evaluation; a fresh one replaces it."""


class _Forked:
    """A worker forked by the template, seen as `asyncio.subprocess.Process` shows a child:
    `pid`, `returncode` (None while it runs), `stdin`/`stdout` streams, `wait()`, `kill()`.
    Signalled through a pidfd, so a pid the kernel reused is never hit."""

    def __init__(self, pid: int, pidfd: int, stdin: asyncio.StreamWriter,
                 stdout: asyncio.StreamReader, warm: frozenset[str]):
        self.pid, self.pidfd, self.stdin, self.stdout = pid, pidfd, stdin, stdout
        self.warm = warm  # the functions its template had been asked to warm when it forked
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    def exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set()
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.stdin.close()

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    async def wait(self) -> int:
        await self._exited.wait()
        return self.returncode


class _Template:
    """The process the workers are forked from (`worker.template`): started, imported and
    warmed up once; `fork()` returns a `_Forked` worker, `warm(names)` warms more functions
    for the workers forked after it. Its exit ends every worker (they die with it) and fails
    what waits on it."""

    def __init__(self, proc: asyncio.subprocess.Process, control: socket.socket,
                 warm: list[str]):
        self.proc, self.control = proc, control
        self.asked = frozenset(warm)  # the functions it was asked to warm (warmed or failed)
        self.workers: dict[int, _Forked] = {}
        self._early: dict[int, int] = {}  # exits read before fork() registered the worker
        self._replies: asyncio.Queue[tuple[dict, list[int]]] = asyncio.Queue()
        self._lock = asyncio.Lock()
        self.dead = False
        asyncio.get_running_loop().add_reader(control.fileno(), self._readable)

    @classmethod
    async def start(cls, config: RewardConfig, warm: list[str]) -> _Template:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await spawn(
                sys.executable, "-m", "tandem.reward.worker", str(theirs.fileno()),
                stdin=asyncio.subprocess.PIPE, env=env, pass_fds=(theirs.fileno(),),
                on_cancel=kill)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        template = cls(proc, ours, warm)
        try:
            # the template imports the plugins this process imported, so a plugin's isolated
            # reward function is found there too (docs/extending.md)
            proc.stdin.write(pack({"reward": config.model_dump(mode="json"),
                                   "plugins": loaded_plugins(), "warm": warm}))
            await proc.stdin.drain()
            proc.stdin.close()
            hello, _ = await asyncio.wait_for(template._replies.get(), STARTUP_TIMEOUT)
            if not hello.get("ready"):
                raise TandemError(f"reward worker template sent {hello!r} instead of ready")
        except (TimeoutError, ConnectionError) as exc:
            await template.close()
            raise TandemError(f"reward worker template (pid {proc.pid}) did not start within "
                              f"{STARTUP_TIMEOUT:g}s: {type(exc).__name__}") from exc
        except BaseException:
            await template.close()
            raise
        return template

    def _readable(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.control, 1 << 16, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        if not data:
            self._gone()
            return
        reply = unpack(data)
        if "exited" in reply:
            worker = self.workers.pop(reply["exited"], None)
            if worker is not None:
                worker.exited(reply["code"])
            else:
                self._early[reply["exited"]] = reply["code"]
            for fd in fds:
                os.close(fd)
            return
        self._replies.put_nowait((reply, fds))

    def _gone(self) -> None:
        """The template exited: its workers died with it (PR_SET_PDEATHSIG)."""
        if self.dead:
            return
        self.dead = True
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.control.fileno())
        for worker in self.workers.values():
            worker.exited(-signal.SIGKILL)
        self.workers.clear()
        self._replies.put_nowait(({"gone": True}, []))

    async def _reply(self) -> tuple[dict, list[int]]:
        """The template's answer to the request just sent. One not read (a timeout, a cancelled
        caller) would be taken as the answer to the next request: the template is then killed,
        and started again by the pool, rather than paired wrongly."""
        try:
            return await asyncio.wait_for(self._replies.get(), STARTUP_TIMEOUT)
        except BaseException:
            if not self.dead:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self._gone()
            raise

    async def warm(self, names: list[str]) -> None:
        """Warm `names` in the template (imports and `warm_up` there, once); every worker forked
        after this has them."""
        async with self._lock:
            if self.dead:
                raise ConnectionError("the reward worker template exited")
            socket.send_fds(self.control, [encode({"warm": names})], [])
            reply, fds = await self._reply()
            for fd in fds:
                os.close(fd)
            if "warmed" not in reply:
                raise ConnectionError(f"the reward worker template answered {reply!r}")
            self.asked |= frozenset(names)

    async def fork(self) -> _Forked:
        loop = asyncio.get_running_loop()
        async with self._lock:
            if self.dead:
                raise ConnectionError("the reward worker template exited")
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            try:
                socket.send_fds(self.control, [encode({"fork": True})], [in_r, out_w])
            finally:
                os.close(in_r)
                os.close(out_w)
            try:
                reply, fds = await self._reply()
            except BaseException:
                os.close(in_w)
                os.close(out_r)
                raise
            if "forked" not in reply or len(fds) != 1:
                os.close(in_w)
                os.close(out_r)
                for fd in fds:
                    os.close(fd)
                raise ConnectionError(f"the reward worker template answered {reply!r}")
            warm = self.asked  # what it had warmed when it forked this one
        reader = asyncio.StreamReader(loop=loop)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                     os.fdopen(out_r, "rb", buffering=0))
        transport, protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(in_w, "wb", buffering=0))
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        worker = _Forked(reply["forked"], fds[0], writer, reader, warm)
        if self.dead:
            worker.exited(-signal.SIGKILL)
        elif worker.pid in self._early:
            worker.exited(self._early.pop(worker.pid))
        else:
            self.workers[worker.pid] = worker
        return worker

    async def close(self) -> None:
        """Close the socket and kill the template; a worker still running dies with it."""
        if not self.dead:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.control.fileno())
        self.control.close()
        await kill(self.proc)
        self._gone()


class _Worker:
    def __init__(self, proc: _Forked):
        self.proc = proc

    async def send(self, obj: object) -> None:
        self.proc.stdin.write(pack(obj))
        await self.proc.stdin.drain()

    async def recv(self) -> dict:
        head = await self.proc.stdout.readexactly(HEADER.size)
        (size,) = HEADER.unpack(head)
        return unpack(await self.proc.stdout.readexactly(size))

    async def kill(self) -> None:
        self.proc.kill()
        try:
            await asyncio.wait_for(self.proc.wait(), KILL_WAIT)
        except TimeoutError:
            log.warning("reward.worker_slow_exit", pid=self.proc.pid, seconds=KILL_WAIT)


class WorkerPool:
    """`size` worker processes; `evaluate(fn, item, timeout)` runs on the first idle one."""

    def __init__(self, config: RewardConfig, *, size: int | None = None):
        self.config = config
        self.size = size or config.workers
        self._warming: dict[str, asyncio.Future] = {}  # functions warmed since, by name
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._spawning: set[asyncio.Task] = set()
        self._starting: asyncio.Future | None = None
        self._forker: _Template | None = None
        self._template_lock = asyncio.Lock()
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

    async def _template(self) -> _Template:
        """The template the workers are forked from; started again if it exited."""
        async with self._template_lock:
            if self._closed:
                raise TandemError("the reward worker pool is closed")
            if self._forker is None or self._forker.dead:
                if self._forker is not None:
                    await self._forker.close()
                # `reward.functions`, and every other function an item has asked for
                self._forker = await _Template.start(self.config,
                                                     [*self.config.functions, *self._warming])
            return self._forker

    async def _spawn(self) -> _Worker:
        template = await self._template()
        try:
            proc = await template.fork()
        except (TimeoutError, ConnectionError) as exc:
            raise TandemError(f"reward worker template (pid {template.proc.pid}) did not fork "
                              f"a worker within {STARTUP_TIMEOUT:g}s: {exc}") from exc
        worker = _Worker(proc)
        self._all.add(worker)
        try:
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
        await self._warm(fn, deadline)
        while True:
            wait = (STARTUP_TIMEOUT if deadline is None
                    else max(0.0, deadline - time.monotonic()))
            try:
                worker = await asyncio.wait_for(self._idle.get(), wait)
            except TimeoutError:
                raise EvaluationTimeout() from None
            if fn in worker.proc.warm or self._forker is None or fn not in self._forker.asked:
                break
            # forked before its template warmed `fn`: a fresh fork has it (milliseconds)
            try:
                await asyncio.shield(worker.kill())
            finally:
                self._replace(worker)
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

    async def _warm(self, fn: str, deadline: float | None) -> None:
        """`fn` warmed in the template before its first item is handed to a worker, so the
        item's time limit does not pay for its imports; bounded by `deadline` like the wait
        for a free worker. Asked once per function; a template started later warms it too."""
        warming = self._warming.get(fn)
        if warming is None:
            if fn in self.config.functions:
                return  # warmed as the template started
            warming = self._warming[fn] = asyncio.ensure_future(self._warm_in_template(fn))
        if warming.done():
            return
        wait = STARTUP_TIMEOUT if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(asyncio.shield(warming), wait)
        except TimeoutError:
            raise EvaluationTimeout() from None

    async def _warm_in_template(self, fn: str) -> None:
        try:
            template = await self._template()
            if fn not in template.asked:  # a template started since was asked at its start
                await template.warm([fn])
        except (TimeoutError, ConnectionError, TandemError) as exc:  # its first item builds it
            if not self._closed:
                log.warning("reward.warm_up_failed", fn=fn,
                            error=f"{type(exc).__name__}: {exc}")

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
        if self._forker is not None:
            await self._forker.close()
            self._forker = None
        # a warm-up under way ends with the template (ConnectionError) or finds the pool closed
        await asyncio.gather(*self._warming.values(), return_exceptions=True)
