"""`SqliteStore`: the embedded default `ExperienceStore`, one SQLite file in WAL mode.

This module is the SQL of the store's operations. Each `_op_*` runs on the writer thread inside
its own savepoint (`writer.GroupCommitWriter`: group commit, fsync policy, the connection's
lifetime); row retention is the pruner's (`pruner.Pruner`); the schema and counters are in
`schema`. Serialising a put and deserialising a lease happen on the caller's thread.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import msgpack
import structlog

from tandem.common.config import BufferConfig
from tandem.common.images import image_hash
from tandem.common.messages import BufferStats, Experience

from . import schema
from .policy import group_priority
from .pruner import Pruner
from .rows import from_row, to_row
from .schema import bump, chunks, counter, image_refs, marks
from .store import (
    POLICIES, STATES, BadPut, BufferFull, ExperienceStore, Lease, NotEnoughExperiences,
    PutOutcome, RewindOutcome, RewindTooFar, UnknownLease,
)
from .writer import GroupCommitWriter

log = structlog.get_logger(__name__)

_ORDER = {
    "fifo": "version ASC, seq ASC",
    "newest": "version DESC, seq DESC",
    "priority": "priority DESC, seq ASC",
}


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
    images: dict[str, bytes] = field(default_factory=dict)  # checked against their hashes


class LeasedRows(NamedTuple):
    """A lease as the writer thread made it: experience rows still serialised."""

    lease_id: str
    expires_at: float
    group_ids: list[str]
    rows: list[tuple]
    dropped_stale: int
    holder: str | None
    images: dict[str, bytes]


class SqliteStore(ExperienceStore):
    """Experiences in one SQLite file (WAL), written by one `GroupCommitWriter` thread."""

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
        self.clock = clock
        self.leases_expired = 0  # a running total, for the buffer's /metrics
        self.pruner = Pruner(keep_consumed)
        self.writer = GroupCommitWriter(self.path, synchronous=synchronous,
                                        commit_batch=commit_batch, setup=self._setup,
                                        upkeep=self.pruner)

    @classmethod
    def from_config(cls, config: BufferConfig, run_dir: str | Path,
                    clock: Callable[[], float] = time.time) -> SqliteStore:
        """The store a run's `buffer` section describes; `buffer.db` is relative to `run_dir`."""
        return cls(Path(run_dir) / config.db, capacity=config.capacity,
                   retry_after=config.retry_after, policy=config.policy,
                   priority=config.priority, priority_key=config.priority_key,
                   lease_seconds=config.lease_seconds, reuse=config.reuse,
                   keep_consumed=config.keep_consumed, synchronous=config.synchronous,
                   commit_batch=config.commit_batch, clock=clock)

    def _setup(self, conn) -> None:
        schema.create(conn)
        self.pruner.arm_if_needed(conn)

    @property
    def commits(self) -> int:
        """Transactions committed, for tests and the benchmark."""
        return self.writer.commits

    # ---- the ExperienceStore interface ------------------------------------------------------

    async def put(self, experiences: list[Experience], group_sizes: list[int],
                  images: dict[str, bytes] | None = None) -> PutOutcome:
        # Only commits that store experiences need an fsync: a lease or ack lost to a power
        # failure re-serves a group once (at-least-once), while a lost put would lose data the
        # explorer was told is safe. A process crash loses neither (WAL, even unsynced).
        return await self.writer.call(
            self._op_put, self.prepare_put(experiences, group_sizes, images), durable=True)

    async def sample(self, num_groups: int, *, policy: str | None = None,
                     min_version: int | None = None, max_version: int | None = None,
                     lease_seconds: float | None = None, holder: str | None = None,
                     min_groups: int | None = None) -> Lease:
        if num_groups < 1:
            raise BadPut(f"num_groups must be at least 1, got {num_groups}")
        if min_groups is not None and not 1 <= min_groups <= num_groups:
            raise BadPut(f"min_groups must be between 1 and num_groups ({num_groups}), "
                         f"got {min_groups}")
        if policy is not None and policy not in POLICIES:
            raise BadPut(f"unknown sampling policy {policy!r}; choose one of {POLICIES}")
        leased = await self.writer.call(self._op_sample, num_groups, policy or self.policy,
                                        min_version, max_version, lease_seconds, holder,
                                        min_groups or num_groups)
        return self.lease_from(leased)

    @staticmethod
    def lease_from(leased: LeasedRows) -> Lease:
        """The lease, its experiences deserialised off the writer thread."""
        return Lease(lease_id=leased.lease_id, expires_at=leased.expires_at,
                     group_ids=leased.group_ids, dropped_stale=leased.dropped_stale,
                     experiences=[from_row(*row) for row in leased.rows], holder=leased.holder,
                     images=leased.images)

    async def ack(self, lease_id: str, step: int | None = None,
                  more: Sequence[str] = ()) -> None:
        await self.writer.call(self._op_ack, [lease_id, *more], step)

    async def release(self, lease_id: str) -> None:
        await self.writer.call(self._op_release, lease_id)

    async def release_holder(self, holder: str) -> int:
        return await self.writer.call(self._op_release_holder, holder)

    async def rewind(self, step: int) -> RewindOutcome:
        if step < 0:
            raise BadPut(f"rewind step must be at least 0, got {step}")
        return await self.writer.call(self._op_rewind, step, durable=True)

    async def checkpointed(self, step: int) -> None:
        if step < 0:
            raise BadPut(f"checkpoint step must be at least 0, got {step}")
        await self.writer.call(self._op_checkpointed, step, durable=True)

    async def ready_groups(self, min_version: int | None = None,
                           max_version: int | None = None) -> int:
        return await self.writer.call(self._op_ready, min_version, max_version)

    async def stats(self) -> BufferStats:
        return await self.writer.call(self._op_stats)

    def close_sync(self) -> None:
        """Finish queued operations, then close the connection; idempotent."""
        self.writer.close()

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)

    @staticmethod
    def prepare_put(experiences: list[Experience], group_sizes: list[int],
                    images: dict[str, bytes] | None = None) -> PreparedPut:
        """Serialise a put off the writer thread (the first of repeated ids wins); each image
        must be the bytes its content hash names (a wrong one would poison every experience
        that refers to it)."""
        if len(group_sizes) != len(experiences):
            raise ValueError(f"{len(experiences)} experiences but {len(group_sizes)} group sizes")
        put = PreparedPut([], [], [], [], [], [], len(experiences))
        for key, data in (images or {}).items():
            data = bytes(data)
            if image_hash(data) != key:
                raise BadPut(f"image {key}: its {len(data)} bytes hash to {image_hash(data)}; "
                             "an image is named by the hash of its normalised bytes")
            put.images[key] = data
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

    # ---- operations (writer thread, each in its own savepoint) ------------------------------

    @property
    def _conn(self):
        return self.writer.conn

    def _op_put(self, put: PreparedPut) -> PutOutcome:
        conn = self._conn
        rows, sizes, versions, task_ids = put.rows, put.sizes, put.versions, put.task_ids
        outcome = PutOutcome(duplicates=put.given - len(rows))  # repeats inside the batch
        existing: set[str] = set()
        for chunk in chunks([r[0] for r in rows]):
            existing.update(r[0] for r in conn.execute(
                f"SELECT id FROM experiences WHERE id IN ({marks(chunk)})", chunk))
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
                g_size, _g_count, g_state, g_version, g_task = group
                # a task rolled out again (its explorer died after the put) repeats the stored
                # ids under newer weights: a duplicate, whatever version it names
                repeat = g_state in ("consumed", "stale") or all(
                    rows[i][0] in existing for i in members)
                if (g_size, g_task) != (size, task_id) or (g_version != version and not repeat):
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
            held = group[1] if group is not None else 0
            if held + len(members) > size:
                if group is not None:
                    raise BadPut(f"group {group_id} would hold {held + len(members)} "
                                 f"experiences but its group_size is {size}")
                raise BadPut(f"group {group_id} would hold {len(members)} experiences but its "
                             f"group_size is {size}")
            plans.append((group_id, group, members))
            inserts.extend(rows[i] for i in members)
        self._store_images(inserts, put.images)
        unconsumed = counter(conn, "unconsumed")
        if unconsumed + len(inserts) > self.capacity:
            raise BufferFull(
                f"buffer full: {unconsumed} unconsumed experiences, {len(inserts)} more would "
                f"exceed buffer.capacity={self.capacity}; retry after {self.retry_after:g} s",
                retry_after=self.retry_after)
        conn.executemany(
            "INSERT INTO experiences (id, group_id, meta, tokens, action_mask, logprobs, nbytes, "
            "token_versions, images) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", inserts)
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
        bump(conn, "unconsumed", len(inserts))
        if outcome.dropped_stale:
            bump(conn, "dropped_stale", outcome.dropped_stale)
        outcome.stored = len(inserts)
        return outcome

    def _op_sample(self, num_groups: int, policy: str, min_version: int | None,
                   max_version: int | None, lease_seconds: float | None,
                   holder: str | None, min_groups: int) -> LeasedRows:
        conn = self._conn
        now = self.clock()
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
        if len(chosen) < min_groups:  # every admissible ready group was found: that is all
            raise NotEnoughExperiences(len(chosen), min_groups, dropped)  # the drop still commits
        lease_id = uuid.uuid4().hex
        expires_at = now + (lease_seconds or self.lease_seconds)
        conn.execute("INSERT INTO leases (lease_id, expires_at, holder) VALUES (?, ?, ?)",
                     (lease_id, expires_at, holder))
        rank = {g: i for i, g in enumerate(chosen)}
        rows = []
        for chunk in chunks(chosen):
            conn.execute(f"UPDATE groups SET state = 'leased', lease_id = ? "
                         f"WHERE group_id IN ({marks(chunk)})", (lease_id, *chunk))
            rows.extend(conn.execute(
                f"SELECT id, group_id, meta, tokens, action_mask, logprobs, token_versions, "
                f"images, seq FROM experiences "
                f"WHERE group_id IN ({marks(chunk)})", chunk))
        rows.sort(key=lambda r: (rank[r[1]], r[8]))
        return LeasedRows(lease_id, expires_at, chosen, [r[:8] for r in rows], dropped, holder,
                          self._images_of(rows))

    def _store_images(self, inserts: list[tuple], given: dict[str, bytes]) -> None:
        """Store the images the inserted rows refer to, once each; BadPut naming an image that
        is neither given nor stored."""
        wanted = {h: row[0] for row in inserts if row[8] for h in row[8].split()}
        if not wanted:
            return
        absent = [h for h in wanted if h not in given]
        for chunk in chunks(absent):
            stored = {r[0] for r in self._conn.execute(
                f"SELECT hash FROM images WHERE hash IN ({marks(chunk)})", chunk)}
            for h in chunk:
                if h not in stored:
                    raise BadPut(f"experience {wanted[h]} refers to image {h}, which the put "
                                 "does not carry and the buffer does not hold")
        self._conn.executemany("INSERT OR IGNORE INTO images (hash, data) VALUES (?, ?)",
                               [(h, given[h]) for h in wanted if h in given])
        self._conn.executemany("UPDATE images SET refs = refs + ? WHERE hash = ?",
                               [(n, h) for h, n in image_refs(r[8] for r in inserts).items()])

    def _images_of(self, rows: list[tuple]) -> dict[str, bytes]:
        hashes = sorted({h for r in rows if r[7] for h in r[7].split()})
        out: dict[str, bytes] = {}
        for chunk in chunks(hashes):
            out.update(self._conn.execute(
                f"SELECT hash, data FROM images WHERE hash IN ({marks(chunk)})", chunk))
        return out

    def _op_ack(self, lease_ids: list[str], step: int | None) -> None:
        """Every lease in `lease_ids`, or (an unknown one raises, and the op's savepoint rolls
        back) none."""
        self._expire(self.clock())
        for lease_id in lease_ids:
            self._ack_one(lease_id, step)

    def _ack_one(self, lease_id: str, step: int | None) -> None:
        conn = self._conn
        if not self._lease_exists(lease_id):
            raise UnknownLease(lease_id)
        groups = conn.execute(
            "SELECT group_id, uses FROM groups WHERE lease_id = ?", (lease_id,)).fetchall()
        for group_id, uses in groups:
            if step is not None:
                conn.execute("INSERT INTO uses (group_id, step) VALUES (?, ?)", (group_id, step))
            if uses + 1 >= self.reuse:
                conn.execute("UPDATE groups SET uses = ?, step = ? WHERE group_id = ?",
                             (uses + 1, step, group_id))
                self._finish_group(group_id, "consumed")
            else:
                conn.execute("UPDATE groups SET uses = ?, state = 'ready', lease_id = NULL "
                             "WHERE group_id = ?", (uses + 1, group_id))
        conn.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,))

    def _op_release(self, lease_id: str) -> None:
        self._expire(self.clock())
        if not self._lease_exists(lease_id):
            raise UnknownLease(lease_id)
        self._return_leases([lease_id])

    def _op_release_holder(self, holder: str) -> int:
        self._expire(self.clock())
        leases = [r[0] for r in self._conn.execute(
            "SELECT lease_id FROM leases WHERE holder = ?", (holder,))]
        self._return_leases(leases)
        if leases:
            log.info("buffer.leases_released", holder=holder, leases=len(leases))
        return len(leases)

    def _op_rewind(self, step: int) -> RewindOutcome:
        conn = self._conn
        self._expire(self.clock())
        leases = [r[0] for r in conn.execute("SELECT lease_id FROM leases")]
        self._return_leases(leases)
        undone = conn.execute(
            "SELECT u.group_id, count(*), g.state, g.pruned, g.count FROM uses u "
            "JOIN groups g ON g.group_id = u.group_id WHERE u.step >= ? GROUP BY u.group_id",
            (step,)).fetchall()
        gone = sum(1 for _, _, state, pruned, _ in undone if pruned and state == "consumed")
        if gone:
            raise RewindTooFar(step, gone, counter(conn, "checkpoint_step"))
        outcome = RewindOutcome(leases_released=len(leases))
        for group_id, n, state, _, count in undone:
            outcome.uses += n
            if state == "consumed":
                conn.execute("UPDATE groups SET uses = uses - ?, state = 'ready', step = NULL, "
                             "done_seq = NULL WHERE group_id = ?", (n, group_id))
                bump(conn, "unconsumed", count)
                bump(conn, "kept_done", -count)
                outcome.groups += 1
            else:  # ready with uses left (replay), or stale: only the count of uses changes
                conn.execute("UPDATE groups SET uses = uses - ? WHERE group_id = ?",
                             (n, group_id))
        conn.execute("DELETE FROM uses WHERE step >= ?", (step,))
        schema.set_counter(conn, "checkpoint_step", min(step, counter(conn, "checkpoint_step")))
        log.info("buffer.rewound", step=step, groups=outcome.groups, uses=outcome.uses,
                 leases_released=outcome.leases_released)
        return outcome

    def _op_checkpointed(self, step: int) -> None:
        schema.set_counter(self._conn, "checkpoint_step", step)
        self.pruner.arm_if_needed(self._conn)

    def _op_ready(self, min_version: int | None, max_version: int | None) -> int:
        self._expire(self.clock())
        clause, params = self._version_filter(min_version, max_version)
        return self._conn.execute(
            f"SELECT count(*) FROM groups WHERE state = 'ready'{clause}", params).fetchone()[0]

    def _op_stats(self) -> BufferStats:
        conn = self._conn
        self._expire(self.clock())
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
        db_bytes = sum(p.stat().st_size for p in (self.path, Path(f"{self.path}-wal"))
                       if p.exists())
        return BufferStats(
            by_state=by_state, by_version=by_version,
            oldest_version=min(by_version) if by_version else None,
            newest_version=max(by_version) if by_version else None,
            bytes=stored_bytes, groups_waiting=groups_by_state["waiting"],
            groups_ready=groups_by_state["ready"], dropped_stale=counter(conn, "dropped_stale"),
            capacity=self.capacity,
            leases=conn.execute("SELECT count(*) FROM leases").fetchone()[0], db_bytes=db_bytes)

    # ---- helpers (writer thread) --------------------------------------------------------------

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

    def _finish_group(self, group_id: str, state: str) -> None:
        """Mark a group consumed or stale: it stops counting as unconsumed, its rows may go."""
        conn = self._conn
        done = bump(conn, "done_seq", 1)
        count = conn.execute(
            "UPDATE groups SET state = ?, lease_id = NULL, done_seq = ? WHERE group_id = ? "
            "RETURNING count", (state, done, group_id)).fetchone()[0]
        bump(conn, "unconsumed", -count)
        bump(conn, "kept_done", count)
        self.pruner.arm()

    def _return_leases(self, lease_ids: list[str]) -> None:
        """Put the leases' groups back to ready without a use and forget the leases."""
        for chunk in chunks(lease_ids):
            self._conn.execute("UPDATE groups SET state = 'ready', lease_id = NULL "
                               f"WHERE lease_id IN ({marks(chunk)})", chunk)
            self._conn.execute(f"DELETE FROM leases WHERE lease_id IN ({marks(chunk)})", chunk)

    def _expire(self, now: float) -> None:
        expired = [r[0] for r in self._conn.execute(
            "SELECT lease_id FROM leases WHERE expires_at <= ?", (now,))]
        self._return_leases(expired)
        if expired:
            self.leases_expired += len(expired)
            log.warning("buffer.leases_expired", leases=len(expired))

    def _drop_stale(self, min_version: int) -> int:
        rows = self._conn.execute(
            "SELECT group_id, count FROM groups "
            "WHERE state IN ('waiting', 'ready') AND version < ?", (min_version,)).fetchall()
        for group_id, _ in rows:
            self._finish_group(group_id, "stale")
        dropped = sum(count for _, count in rows)
        if dropped:
            bump(self._conn, "dropped_stale", dropped)
            log.info("buffer.dropped_stale", experiences=dropped, groups=len(rows),
                     min_version=min_version)
        return dropped

    def _lease_exists(self, lease_id: str) -> bool:
        return self._conn.execute(
            "SELECT 1 FROM leases WHERE lease_id = ?", (lease_id,)).fetchone() is not None

    @staticmethod
    def _version_filter(min_version: int | None, max_version: int | None) -> tuple[str, tuple]:
        clause, params = "", ()
        if min_version is not None:
            clause, params = clause + " AND version >= ?", params + (min_version,)
        if max_version is not None:
            clause, params = clause + " AND version <= ?", params + (max_version,)
        return clause, params
