"""`GroupCommitWriter`: one thread owns one SQLite connection and commits queued work in batches.

Callers enqueue operations (plain functions of the connection's state, run on this thread).
The thread takes everything queued (up to `commit_batch`), runs each inside its own savepoint of
one transaction, commits once and only then resolves every caller's future. Concurrent puts
therefore share one fsync (group commit), and every reply describes committed state.

- An operation that raises rolls back its own savepoint and nothing else; its caller gets the
  exception. An exception whose class sets `keeps_changes = True` is raised to the caller after
  its savepoint is kept (a sample that dropped stale groups before finding too few).
- Only batches holding a `durable` operation are fsynced (`synchronous: full`); the rest commit
  with `synchronous=NORMAL`, which a process crash cannot undo either (WAL).
- When no request has come for `IDLE` seconds, or the upkeep is overdue, the writer gives the
  `Upkeep` (the pruner) a small transaction of its own.
- WAL checkpoints, with their fsync of the database file, run on a second connection in a
  second thread, so they never sit inside a request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable

import structlog

from tandem.common.errors import TandemError

from .schema import open_database

log = structlog.get_logger(__name__)

IDLE = 0.02  # seconds without requests before upkeep runs (an ack is often followed by a sample)
CHECKPOINT_EVERY = 1.0  # seconds between passive WAL checkpoints
_STOP = object()


class StoreClosed(TandemError):
    """The store was closed; no more operations are accepted."""


class Upkeep(Protocol):
    """Work the writer runs in its own transactions when idle (or overdue)."""

    due: float | None  # time.monotonic() since which work is waiting, or None

    def overdue(self, now: float) -> bool: ...
    def step(self, conn: sqlite3.Connection, *, busy: bool) -> None: ...
    def failed(self) -> None: ...


@dataclass(slots=True)
class _Op:
    fn: Callable[..., Any]
    args: tuple
    durable: bool
    future: concurrent.futures.Future


class GroupCommitWriter:
    """The thread that owns the store's connection (module docstring)."""

    def __init__(self, path: Path, *, synchronous: str, commit_batch: int,
                 setup: Callable[[sqlite3.Connection], None], upkeep: Upkeep):
        self.path = path
        self.synchronous = synchronous
        self.commit_batch = commit_batch
        self.upkeep = upkeep
        self.commits = 0  # transactions committed, for tests and the benchmark
        self.conn: sqlite3.Connection | None = None
        self._setup = setup
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._synced = False  # whether the connection is at synchronous=FULL now
        self._stopping = threading.Event()
        opened: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(opened,), name=f"sqlite-store:{path.name}", daemon=True)
        self._thread.start()
        opened.result()  # re-raises a failure to open or migrate the database

    def submit(self, fn: Callable[..., Any], *args: Any,
               durable: bool = False) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._close_lock:
            if self._closed:
                raise StoreClosed(f"buffer store {self.path} is closed")
            self._queue.put(_Op(fn, args, durable, future))
        return future

    async def call(self, fn: Callable[..., Any], *args: Any, durable: bool = False) -> Any:
        return await asyncio.wrap_future(self.submit(fn, *args, durable=durable))

    def close(self) -> None:
        """Finish queued operations and upkeep, then close the connection; idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()

    # ---- the thread -------------------------------------------------------------------------

    def _open(self) -> None:
        self.conn, self._lock = open_database(self.path, self.synchronous)
        self._synced = self.synchronous == "full"
        self._setup(self.conn)

    def _run(self, opened: concurrent.futures.Future) -> None:
        try:
            self._open()
        except Exception as exc:
            if not isinstance(exc, TandemError):
                exc = TandemError(f"cannot open the buffer database {self.path} (buffer.db): {exc}")
            opened.set_exception(exc)
            return
        checkpointer = threading.Thread(
            target=self._checkpoint_loop, name=f"sqlite-checkpoint:{self.path.name}", daemon=True)
        checkpointer.start()
        opened.set_result(None)
        stop = False
        while not stop:
            if self.upkeep.overdue(time.monotonic()):
                self._upkeep(busy=True)  # busy without pause: catch up anyway
            try:
                batch = [self._queue.get(timeout=None if self.upkeep.due is None else IDLE)]
            except queue.Empty:
                self._upkeep(busy=False)
                continue
            while len(batch) < self.commit_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is _STOP for item in batch)
            ops = [item for item in batch if item is not _STOP]
            if ops:
                try:
                    self._execute(ops)
                except Exception as exc:  # never leave a caller waiting on a dead thread
                    log.exception("buffer.store_failed", db=str(self.path))
                    for op in ops:
                        if not op.future.done():
                            op.future.set_exception(TandemError(
                                f"buffer database {self.path}: {type(exc).__name__}: {exc}"))
        while True:  # anything enqueued after the stop marker
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item.future.set_exception(StoreClosed(f"buffer store {self.path} is closed"))
        while self.upkeep.due is not None:
            self._upkeep(busy=True)
        self._stopping.set()
        checkpointer.join()
        try:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:  # the WAL stays; the next open recovers from it
            log.warning("buffer.checkpoint_failed", db=str(self.path), error=str(exc))
        self.conn.close()
        self._lock.close()

    def _checkpoint_loop(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            while not self._stopping.wait(CHECKPOINT_EVERY):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:
                    log.warning("buffer.checkpoint_failed", db=str(self.path), error=str(exc))
        finally:
            conn.close()

    def _sync(self, durable: bool) -> None:
        if durable != self._synced:
            self.conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._synced = durable

    def _upkeep(self, *, busy: bool) -> None:
        conn = self.conn
        try:
            self._sync(False)
            conn.execute("BEGIN IMMEDIATE")
            self.upkeep.step(conn, busy=busy)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            log.warning("buffer.upkeep_failed", db=str(self.path), error=str(exc))
            self.upkeep.failed()  # tried again when there is new work for it

    def _execute(self, ops: list[_Op]) -> None:
        conn = self.conn
        results: list[tuple[concurrent.futures.Future, Any, bool]] = []
        try:
            self._sync(self.synchronous == "full" and any(op.durable for op in ops))
            conn.execute("BEGIN IMMEDIATE")
            for op in ops:
                if not op.future.set_running_or_notify_cancel():
                    continue  # the caller gave up before we started; a put is simply not done
                conn.execute("SAVEPOINT op")
                try:
                    results.append((op.future, op.fn(*op.args), False))
                except Exception as exc:
                    if not getattr(exc, "keeps_changes", False):
                        conn.execute("ROLLBACK TO op")
                    results.append((op.future, exc, True))
                conn.execute("RELEASE op")
            conn.execute("COMMIT")
            self.commits += 1
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            log.error("buffer.commit_failed", db=str(self.path), error=str(exc), ops=len(ops))
            failure = TandemError(f"buffer database {self.path} failed to commit: {exc}")
            for op in ops:
                future = op.future
                if future.done():
                    continue
                if future.running() or future.set_running_or_notify_cancel():
                    future.set_exception(failure)
            return
        for future, value, failed in results:
            if failed:
                future.set_exception(value)
            else:
                future.set_result(value)
