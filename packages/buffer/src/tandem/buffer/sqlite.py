"""`SqliteStore`: the embedded default `ExperienceStore`, one SQLite file in WAL mode.

One thread owns the connection. Callers enqueue operations; the thread takes everything queued
(up to `commit_batch`), runs each inside its own savepoint of one transaction, commits once and
only then resolves every caller's future. Concurrent puts therefore share one fsync (group
commit), and every reply describes committed state. An operation that fails rolls back its own
savepoint and nothing else. Counters (unconsumed, dropped as stale, kept rows) live in a table,
so they commit and roll back with the rows they count.

Two kinds of upkeep stay off the request path: deleting the rows of consumed groups runs in
small transactions of its own once no request has come for 20 ms (or, in a store that is never
idle, in a larger one every 5 s), and WAL checkpoints (with their fsync of the database file)
run on a second connection in a second thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import os
import queue
import sqlite3
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgpack
import structlog

from tandem.common.config import BufferConfig
from tandem.common.errors import RequestFailed, TandemError
from tandem.common.messages import BufferStats, Experience

from .policy import group_priority
from .rows import from_row, to_row
from .store import (
    POLICIES, STATES, BadPut, BufferFull, ExperienceStore, Lease, NotEnoughExperiences,
    PutOutcome, UnknownLease,
)

log = structlog.get_logger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiences (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    group_id TEXT NOT NULL,
    meta BLOB NOT NULL,
    tokens BLOB NOT NULL,
    action_mask BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    nbytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS experiences_group ON experiences(group_id);
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY,
    group_id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    size INTEGER NOT NULL,
    count INTEGER NOT NULL,
    state TEXT NOT NULL,
    uses INTEGER NOT NULL DEFAULT 0,
    priority REAL NOT NULL DEFAULT 0,
    lease_id TEXT,
    nbytes INTEGER NOT NULL,
    done_seq INTEGER,
    pruned INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS groups_order ON groups(state, uses, version, seq);
CREATE INDEX IF NOT EXISTS groups_priority ON groups(state, uses, priority DESC, seq);
CREATE INDEX IF NOT EXISTS groups_version ON groups(state, version);
CREATE INDEX IF NOT EXISTS groups_lease ON groups(lease_id) WHERE lease_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS groups_done ON groups(done_seq)
    WHERE done_seq IS NOT NULL AND pruned = 0;
CREATE TABLE IF NOT EXISTS leases (lease_id TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters VALUES
    ('unconsumed', 0), ('dropped_stale', 0), ('kept_done', 0), ('done_seq', 0);
"""

_ORDER = {
    "fifo": "version ASC, seq ASC",
    "newest": "version DESC, seq DESC",
    "priority": "priority DESC, seq ASC",
}
_CHUNK = 500  # host parameters per IN (...) list
_PRUNE_STEP = 8  # finished groups whose rows one idle upkeep transaction deletes
_IDLE = 0.02  # seconds without requests before upkeep starts (an ack is often followed by a sample)
_PRUNE_AT_LEAST_EVERY = 5.0  # seconds; a store never idle still deletes (a larger step) this often
_CHECKPOINT_EVERY = 1.0  # seconds between passive WAL checkpoints
_STOP = object()


class StoreClosed(TandemError):
    """The store was closed; no more operations are accepted."""


@dataclass(slots=True)
class PreparedPut:
    """A put serialised off the writer thread; lists are per experience, repeats removed."""

    rows: list[tuple]
    sizes: list[int]
    versions: list[int]
    task_ids: list[str]
    rewards: list[float]
    infos: list[dict]
    given: int  # experiences in the request, repeats included


@dataclass(slots=True)
class _Op:
    fn: Callable[..., Any]
    args: tuple
    future: concurrent.futures.Future


def _chunks(items: list, size: int = _CHUNK):
    for i in range(0, len(items), size):
        yield items[i:i + size]


class SqliteStore(ExperienceStore):
    """Experiences in one SQLite file (WAL); see the module docstring for the threading model."""

    def __init__(self, path: str | Path, *, capacity: int = 1_000_000, retry_after: float = 0.5,
                 policy: str = "fifo", priority: str = "reward_variance",
                 priority_key: str | None = None, lease_seconds: float = 120.0, reuse: int = 1,
                 keep_consumed: int = 0, synchronous: str = "full", commit_batch: int = 256,
                 clock: Callable[[], float] = time.time):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
        self.path = Path(path)
        self.capacity = capacity
        self.retry_after = retry_after
        self.policy = policy
        self.priority = priority
        self.priority_key = priority_key
        self.lease_seconds = lease_seconds
        self.reuse = reuse
        self.keep_consumed = keep_consumed
        self.synchronous = synchronous
        self.commit_batch = commit_batch
        self.clock = clock
        self.commits = 0  # transactions committed, for tests and the benchmark
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._synced = False  # whether the connection is at synchronous=FULL now
        # monotonic time since which finished groups have rows beyond keep_consumed, or None
        self._prune_due: float | None = None
        self._stopping = threading.Event()
        self._checkpointer: threading.Thread | None = None
        opened: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(opened,), name=f"sqlite-store:{self.path.name}", daemon=True)
        self._thread.start()
        opened.result()  # re-raises a failure to open or migrate the database

    @classmethod
    def from_config(cls, config: BufferConfig, run_dir: str | Path,
                    clock: Callable[[], float] = time.time) -> "SqliteStore":
        """The store a run's `buffer` section describes; `buffer.db` is relative to `run_dir`."""
        return cls(Path(run_dir) / config.db, capacity=config.capacity,
                   retry_after=config.retry_after, policy=config.policy,
                   priority=config.priority, priority_key=config.priority_key,
                   lease_seconds=config.lease_seconds, reuse=config.reuse,
                   keep_consumed=config.keep_consumed, synchronous=config.synchronous,
                   commit_batch=config.commit_batch, clock=clock)

    # ---- the writer thread ----------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One store per database: a second buffer on the same file would only fail later, one
        # "database is locked" at a time. The kernel drops the lock when the process dies.
        self._lock = open(f"{self.path}.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise TandemError(f"another buffer is using {self.path} (it holds {self.path}.lock); "
                              "stop it, or point buffer.db or run_dir elsewhere") from None
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.synchronous.upper()}")
        self._synced = self.synchronous == "full"
        conn.execute("PRAGMA foreign_keys=OFF")
        conn.execute("PRAGMA cache_size=-65536")  # 64 MiB of page cache
        conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it
        conn.execute("PRAGMA journal_size_limit=67108864")
        conn.executescript(SCHEMA)
        self._conn = conn
        if self._counter("kept_done") > self.keep_consumed:
            self._prune_due = time.monotonic()
        return conn

    def _checkpoint_loop(self) -> None:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            while not self._stopping.wait(_CHECKPOINT_EVERY):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:
                    log.warning("buffer.checkpoint_failed", db=str(self.path), error=str(exc))
        finally:
            conn.close()

    def _run(self, opened: concurrent.futures.Future) -> None:
        try:
            self._open()
        except Exception as exc:
            if not isinstance(exc, TandemError):
                exc = TandemError(f"cannot open the buffer database {self.path} (buffer.db): {exc}")
            opened.set_exception(exc)
            return
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, name=f"sqlite-checkpoint:{self.path.name}", daemon=True)
        self._checkpointer.start()
        opened.set_result(None)
        stop = False
        while not stop:
            due = self._prune_due
            if due is not None and time.monotonic() - due > _PRUNE_AT_LEAST_EVERY:
                self._prune_step(8 * _PRUNE_STEP)  # busy without pause: catch up anyway
            try:
                batch = [self._queue.get(timeout=None if due is None else _IDLE)]
            except queue.Empty:  # idle: delete some consumed rows, then look again
                self._prune_step(_PRUNE_STEP)
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
        while self._prune_due is not None:
            self._prune_step(8 * _PRUNE_STEP)
        self._stopping.set()
        self._checkpointer.join()
        try:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:  # the WAL stays; the next open recovers from it
            log.warning("buffer.checkpoint_failed", db=str(self.path), error=str(exc))
        self._conn.close()
        self._lock.close()

    def _prune_step(self, max_groups: int) -> None:
        conn = self._conn
        try:
            if self._synced:
                conn.execute("PRAGMA synchronous=NORMAL")
                self._synced = False
            conn.execute("BEGIN IMMEDIATE")
            more = self._prune(max_groups)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            log.warning("buffer.prune_failed", db=str(self.path), error=str(exc))
            more = False  # tried again when the next group finishes
        self._prune_due = time.monotonic() if more else None

    def _execute(self, ops: list[_Op]) -> None:
        conn = self._conn
        now = self.clock()
        results: list[tuple[concurrent.futures.Future, Any]] = []
        # Only commits that store experiences need an fsync: a lease or ack lost to a power
        # failure re-serves a group once (at-least-once), while a lost put would lose data the
        # explorer was told is safe. A process crash loses neither (WAL, even unsynced).
        durable = self.synchronous == "full" and any(op.fn == self._op_put for op in ops)
        try:
            if durable != self._synced:
                conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
                self._synced = durable
            conn.execute("BEGIN IMMEDIATE")
            for op in ops:
                if not op.future.set_running_or_notify_cancel():
                    continue  # the caller gave up before we started; a put is simply not done
                conn.execute("SAVEPOINT op")
                try:
                    value = op.fn(now, *op.args)
                except Exception as exc:
                    conn.execute("ROLLBACK TO op")
                    value = exc
                conn.execute("RELEASE op")
                results.append((op.future, value))
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
        for future, value in results:
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._close_lock:
            if self._closed:
                raise StoreClosed(f"buffer store {self.path} is closed")
            self._queue.put(_Op(fn, args, future))
        return future

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._submit(fn, *args))

    # ---- counters and small helpers (writer thread only) ----------------------------------

    def _counter(self, name: str) -> int:
        row = self._conn.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return row[0]

    def _bump(self, name: str, delta: int) -> int:
        row = self._conn.execute(
            "UPDATE counters SET value = value + ? WHERE name = ? RETURNING value",
            (delta, name)).fetchone()
        return row[0]

    def _finish_group(self, group_id: str, state: str) -> None:
        """Mark a group consumed or stale: it stops counting as unconsumed, its rows may go."""
        done = self._bump("done_seq", 1)
        row = self._conn.execute(
            "UPDATE groups SET state = ?, lease_id = NULL, done_seq = ? WHERE group_id = ? "
            "RETURNING count", (state, done, group_id)).fetchone()
        self._bump("unconsumed", -row[0])
        self._bump("kept_done", row[0])
        if self._prune_due is None:
            self._prune_due = time.monotonic()

    def _prune(self, max_groups: int) -> bool:
        """Delete rows of finished groups, oldest first, while more than `keep_consumed`
        experiences' rows are kept; at most `max_groups` groups. Returns whether more remain."""
        kept = self._counter("kept_done")
        rows = self._conn.execute(
            "SELECT group_id, count FROM groups WHERE done_seq IS NOT NULL AND pruned = 0 "
            "ORDER BY done_seq LIMIT ?", (max_groups,)).fetchall()
        freed = 0
        for group_id, count in rows:
            if kept - freed <= self.keep_consumed:
                break
            self._conn.execute("DELETE FROM experiences WHERE group_id = ?", (group_id,))
            self._conn.execute("UPDATE groups SET pruned = 1 WHERE group_id = ?", (group_id,))
            freed += count
        self._bump("kept_done", -freed)
        return kept - freed > self.keep_consumed

    def _expire(self, now: float) -> None:
        expired = [r[0] for r in self._conn.execute(
            "SELECT lease_id FROM leases WHERE expires_at <= ?", (now,))]
        for lease_id in expired:
            self._conn.execute(
                "UPDATE groups SET state = 'ready', lease_id = NULL WHERE lease_id = ?",
                (lease_id,))
            self._conn.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,))
        if expired:
            log.warning("buffer.leases_expired", leases=len(expired))

    def _drop_stale(self, min_version: int) -> int:
        rows = self._conn.execute(
            "SELECT group_id, count FROM groups "
            "WHERE state IN ('waiting', 'ready') AND version < ?", (min_version,)).fetchall()
        for group_id, _ in rows:
            self._finish_group(group_id, "stale")
        dropped = sum(count for _, count in rows)
        if dropped:
            self._bump("dropped_stale", dropped)
            log.info("buffer.dropped_stale", experiences=dropped, groups=len(rows),
                     min_version=min_version)
        return dropped

    def _lease_exists(self, lease_id: str) -> bool:
        return self._conn.execute(
            "SELECT 1 FROM leases WHERE lease_id = ?", (lease_id,)).fetchone() is not None

    def _version_filter(self, min_version: int | None, max_version: int | None
                        ) -> tuple[str, tuple]:
        clause, params = "", ()
        if min_version is not None:
            clause, params = clause + " AND version >= ?", params + (min_version,)
        if max_version is not None:
            clause, params = clause + " AND version <= ?", params + (max_version,)
        return clause, params

    def _count_ready(self, min_version: int | None, max_version: int | None) -> int:
        clause, params = self._version_filter(min_version, max_version)
        return self._conn.execute(
            f"SELECT count(*) FROM groups WHERE state = 'ready'{clause}", params).fetchone()[0]

    # ---- operations (writer thread; `now` is the transaction's clock) ---------------------

    def _op_put(self, now: float, put: PreparedPut) -> PutOutcome:
        conn = self._conn
        rows, sizes, versions, task_ids = put.rows, put.sizes, put.versions, put.task_ids
        outcome = PutOutcome(duplicates=put.given - len(rows))  # repeats inside the batch
        existing: set[str] = set()
        ids = [r[0] for r in rows]
        for chunk in _chunks(ids):
            marks = ",".join("?" * len(chunk))
            existing.update(r[0] for r in conn.execute(
                f"SELECT id FROM experiences WHERE id IN ({marks})", chunk))
        per_group: dict[str, list[int]] = defaultdict(list)
        for i, row in enumerate(rows):
            per_group[row[1]].append(i)
        inserts: list[tuple] = []
        plans: list[tuple[str, Any, list[int]]] = []
        for group_id, members in per_group.items():
            first = members[0]
            size, version, task_id = sizes[first], versions[first], task_ids[first]
            for i in members:
                if (sizes[i], versions[i], task_ids[i]) != (size, version, task_id):
                    raise BadPut(
                        f"group {group_id}: its experiences disagree on group size, policy "
                        f"version or task (group_size {sizes[i]} vs {size}, version "
                        f"{versions[i]} vs {version}, task {task_ids[i]!r} vs {task_id!r})")
            group = conn.execute(
                "SELECT size, count, state, version, task_id FROM groups WHERE group_id = ?",
                (group_id,)).fetchone()
            if group is not None:
                g_size, g_count, g_state, g_version, g_task = group
                if (g_size, g_version, g_task) != (size, version, task_id):
                    raise BadPut(
                        f"group {group_id} holds group_size {g_size}, version {g_version}, task "
                        f"{g_task!r}; this put says group_size {size}, version {version}, task "
                        f"{task_id!r}")
                # Whether a finished group's rows are still kept must not change the answer.
                if g_state == "consumed":
                    outcome.duplicates += len(members)  # a consumed group was complete: a retry
                    continue
                if g_state == "stale":
                    outcome.dropped_stale += len(members)
                    continue
            outcome.duplicates += sum(rows[i][0] in existing for i in members)
            members = [i for i in members if rows[i][0] not in existing]
            if not members:
                continue
            if group is not None:
                if g_count + len(members) > size:
                    raise BadPut(f"group {group_id} would hold {g_count + len(members)} "
                                 f"experiences but its group_size is {size}")
            elif len(members) > size:
                raise BadPut(f"group {group_id} would hold {len(members)} experiences but its "
                             f"group_size is {size}")
            plans.append((group_id, group, members))
            inserts.extend(rows[i] for i in members)
        unconsumed = self._counter("unconsumed")
        if unconsumed + len(inserts) > self.capacity:
            raise BufferFull(
                f"buffer full: {unconsumed} unconsumed experiences, {len(inserts)} more would "
                f"exceed buffer.capacity={self.capacity}; retry after {self.retry_after:g} s",
                retry_after=self.retry_after)
        conn.executemany(
            "INSERT INTO experiences (id, group_id, meta, tokens, action_mask, logprobs, nbytes) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)", inserts)
        for group_id, group, members in plans:
            added = len(members)
            nbytes = sum(rows[i][6] for i in members)
            first = members[0]
            if group is None:
                conn.execute(
                    "INSERT INTO groups (group_id, task_id, version, size, count, state, nbytes) "
                    "VALUES (?, ?, ?, ?, ?, 'waiting', ?)",
                    (group_id, task_ids[first], versions[first], sizes[first], added, nbytes))
                count, size = added, sizes[first]
            else:
                size, count = group[0], group[1] + added
                conn.execute("UPDATE groups SET count = ?, nbytes = nbytes + ? WHERE group_id = ?",
                             (count, nbytes, group_id))
            if count == size and group is None:  # whole group in this put: scores at hand
                self._complete(group_id, [put.rewards[i] for i in members],
                               [put.infos[i] for i in members])
            elif count == size:
                self._complete(group_id)
        self._bump("unconsumed", len(inserts))
        if outcome.dropped_stale:
            self._bump("dropped_stale", outcome.dropped_stale)
        outcome.stored = len(inserts)
        return outcome

    def _complete(self, group_id: str, rewards: list[float] | None = None,
                  infos: list[dict] | None = None) -> None:
        """The group holds `size` experiences: ready, with its priority."""
        if rewards is None or infos is None:
            rewards, infos = [], []
            for (meta,) in self._conn.execute(
                    "SELECT meta FROM experiences WHERE group_id = ? ORDER BY seq", (group_id,)):
                fields = msgpack.unpackb(meta, raw=False, strict_map_key=False)
                rewards.append(fields["reward"])
                infos.append(fields["info"])
        priority = group_priority(self.priority, rewards, infos, self.priority_key)
        self._conn.execute("UPDATE groups SET state = 'ready', priority = ? WHERE group_id = ?",
                           (priority, group_id))

    def _op_sample(self, now: float, num_groups: int, policy: str | None,
                   min_version: int | None, max_version: int | None,
                   lease_seconds: float | None) -> tuple | NotEnoughExperiences:
        conn = self._conn
        policy = policy or self.policy
        if policy not in POLICIES:
            raise BadPut(f"unknown sampling policy {policy!r}; choose one of {POLICIES}")
        self._expire(now)
        dropped = self._drop_stale(min_version) if min_version is not None else 0
        clause, params = self._version_filter(min_version, max_version)
        chosen: list[str] = []
        # Groups used fewer times first; each level is one index range, found by min() (a
        # DISTINCT over all ready groups would cost time linear in the store's size).
        uses = conn.execute("SELECT min(uses) FROM groups WHERE state = 'ready'").fetchone()[0]
        while uses is not None and len(chosen) < num_groups:
            chosen.extend(r[0] for r in conn.execute(
                f"SELECT group_id FROM groups WHERE state = 'ready' AND uses = ?{clause} "
                f"ORDER BY {_ORDER[policy]} LIMIT ?", (uses, *params, num_groups - len(chosen))))
            uses = conn.execute("SELECT min(uses) FROM groups WHERE state = 'ready' AND uses > ?",
                                (uses,)).fetchone()[0]
        if len(chosen) < num_groups:  # every admissible ready group was found: that is all
            # returned, not raised: the stale drop above must commit
            return NotEnoughExperiences(len(chosen), num_groups, dropped)
        lease_id = uuid.uuid4().hex
        expires_at = now + (lease_seconds or self.lease_seconds)
        conn.execute("INSERT INTO leases (lease_id, expires_at) VALUES (?, ?)",
                     (lease_id, expires_at))
        rank = {g: i for i, g in enumerate(chosen)}
        rows = []
        for chunk in _chunks(chosen):
            marks = ",".join("?" * len(chunk))
            conn.execute(f"UPDATE groups SET state = 'leased', lease_id = ? "
                         f"WHERE group_id IN ({marks})", (lease_id, *chunk))
            rows.extend(conn.execute(
                f"SELECT id, group_id, meta, tokens, action_mask, logprobs, seq FROM experiences "
                f"WHERE group_id IN ({marks})", chunk))
        rows.sort(key=lambda r: (rank[r[1]], r[6]))
        return lease_id, expires_at, chosen, [r[:6] for r in rows], dropped

    def _op_ack(self, now: float, lease_id: str) -> None | UnknownLease:
        self._expire(now)
        if not self._lease_exists(lease_id):
            return UnknownLease(lease_id)
        groups = self._conn.execute(
            "SELECT group_id, uses FROM groups WHERE lease_id = ?", (lease_id,)).fetchall()
        for group_id, uses in groups:
            if uses + 1 >= self.reuse:
                self._conn.execute("UPDATE groups SET uses = ? WHERE group_id = ?",
                                   (uses + 1, group_id))
                self._finish_group(group_id, "consumed")
            else:
                self._conn.execute(
                    "UPDATE groups SET uses = ?, state = 'ready', lease_id = NULL "
                    "WHERE group_id = ?", (uses + 1, group_id))
        self._conn.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,))
        return None

    def _op_release(self, now: float, lease_id: str) -> None | UnknownLease:
        self._expire(now)
        if not self._lease_exists(lease_id):
            return UnknownLease(lease_id)
        self._conn.execute("UPDATE groups SET state = 'ready', lease_id = NULL WHERE lease_id = ?",
                           (lease_id,))
        self._conn.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,))
        return None

    def _op_ready(self, now: float, min_version: int | None, max_version: int | None) -> int:
        self._expire(now)
        return self._count_ready(min_version, max_version)

    def _op_stats(self, now: float) -> BufferStats:
        conn = self._conn
        self._expire(now)
        by_state = dict.fromkeys(STATES, 0)
        groups_by_state = dict.fromkeys(STATES, 0)
        for state, experiences, groups in conn.execute(
                "SELECT state, sum(count), count(*) FROM groups GROUP BY state"):
            by_state[state] = experiences
            groups_by_state[state] = groups
        by_version = {version: n for version, n in conn.execute(
            "SELECT version, sum(count) FROM groups WHERE state IN ('waiting', 'ready', 'leased') "
            "GROUP BY version ORDER BY version")}
        stored_bytes = conn.execute(
            "SELECT coalesce(sum(nbytes), 0) FROM groups WHERE pruned = 0").fetchone()[0]
        db_bytes = sum(os.path.getsize(p) for p in (self.path, Path(f"{self.path}-wal"))
                       if os.path.exists(p))
        return BufferStats(
            by_state=by_state, by_version=by_version,
            oldest_version=min(by_version) if by_version else None,
            newest_version=max(by_version) if by_version else None,
            bytes=stored_bytes, groups_waiting=groups_by_state["waiting"],
            groups_ready=groups_by_state["ready"], dropped_stale=self._counter("dropped_stale"),
            capacity=self.capacity,
            leases=conn.execute("SELECT count(*) FROM leases").fetchone()[0], db_bytes=db_bytes)

    # ---- the ExperienceStore interface ------------------------------------------------------

    @staticmethod
    def prepare_put(experiences: list[Experience], group_sizes: list[int]) -> PreparedPut:
        """Serialise a put off the writer thread (the first of repeated ids wins)."""
        if len(group_sizes) != len(experiences):
            raise ValueError(f"{len(experiences)} experiences but {len(group_sizes)} group sizes")
        put = PreparedPut([], [], [], [], [], [], len(experiences))
        seen: set[str] = set()
        for exp, size in zip(experiences, group_sizes):
            if exp.id in seen:
                continue
            seen.add(exp.id)
            put.rows.append(to_row(exp))
            put.sizes.append(size)
            put.versions.append(exp.policy_version)
            put.task_ids.append(exp.task_id)
            put.rewards.append(exp.reward)
            put.infos.append(exp.info)
        return put

    async def put(self, experiences: list[Experience], group_sizes: list[int]) -> PutOutcome:
        return await self._call(self._op_put, self.prepare_put(experiences, group_sizes))

    async def sample(self, num_groups: int, *, policy: str | None = None,
                     min_version: int | None = None, max_version: int | None = None,
                     lease_seconds: float | None = None) -> Lease:
        if num_groups < 1:
            raise BadPut(f"num_groups must be at least 1, got {num_groups}")
        result = await self._call(self._op_sample, num_groups, policy, min_version, max_version,
                                  lease_seconds)
        return self.lease_from(result)

    @staticmethod
    def lease_from(result: tuple | RequestFailed) -> Lease:
        """Build the lease (deserialising experiences off the writer thread) or raise."""
        if isinstance(result, RequestFailed):
            raise result
        lease_id, expires_at, group_ids, rows, dropped = result
        return Lease(lease_id=lease_id, expires_at=expires_at, group_ids=group_ids,
                     experiences=[from_row(*row) for row in rows], dropped_stale=dropped)

    async def ack(self, lease_id: str) -> None:
        failure = await self._call(self._op_ack, lease_id)
        if failure is not None:
            raise failure

    async def release(self, lease_id: str) -> None:
        failure = await self._call(self._op_release, lease_id)
        if failure is not None:
            raise failure

    async def ready_groups(self, min_version: int | None = None,
                           max_version: int | None = None) -> int:
        return await self._call(self._op_ready, min_version, max_version)

    async def stats(self) -> BufferStats:
        return await self._call(self._op_stats)

    def close_sync(self) -> None:
        """Finish queued operations, then close the connection; idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)
