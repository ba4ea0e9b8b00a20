"""`Pruner`: deletes the experience rows of finished groups, off the request path.

A consumed or stale group keeps its tombstone row in `groups` forever (a late duplicate put is
still recognised); its experience rows go, oldest finished first, while more than
`keep_consumed` finished experiences still have rows. Two kinds of rows are held back:

- rows of a group consumed by a trainer step at or after the newest checkpoint step the trainer
  reported (`checkpoint_step`): a trainer resuming from that checkpoint rewinds to it and needs
  them to train those groups again. Until the first report every group acked with a step is
  held; groups acked without a step cannot be rewound and are never held.
- nothing else: stale groups are never sampled again.

An image (table `images`) goes in the same transaction as the last experience row that names
it (`images.refs` counts them); one a kept row still names stays.

The writer runs `step` in a small transaction when it has been idle for a moment, and a larger
one at least every `AT_LEAST_EVERY` seconds when it never is.
"""

from __future__ import annotations

import sqlite3
import time
from collections import Counter

from .schema import bump, chunks, counter, image_refs, marks

IDLE_STEP = 8  # finished groups whose rows one idle upkeep transaction deletes
BUSY_STEP = 64  # ... and one overdue (or closing) transaction
AT_LEAST_EVERY = 5.0  # seconds; a store never idle still prunes (a larger step) this often


class Pruner:
    """The `Upkeep` of `SqliteStore`: row retention for finished groups (module docstring)."""

    def __init__(self, keep_consumed: int):
        self.keep_consumed = keep_consumed
        self.due: float | None = None  # monotonic time since which rows may be deletable

    def arm(self) -> None:
        """Something finished, or the hold moved: look for rows to delete soon."""
        if self.due is None:
            self.due = time.monotonic()

    def arm_if_needed(self, conn: sqlite3.Connection) -> None:
        if counter(conn, "kept_done") > self.keep_consumed:
            self.arm()

    def overdue(self, now: float) -> bool:
        return self.due is not None and now - self.due > AT_LEAST_EVERY

    def failed(self) -> None:
        self.due = None

    def step(self, conn: sqlite3.Connection, *, busy: bool) -> None:
        """Delete the rows of up to one step's worth of groups, inside the caller's transaction."""
        limit = BUSY_STEP if busy else IDLE_STEP
        kept = counter(conn, "kept_done")
        rows = conn.execute(
            "SELECT group_id, count FROM groups WHERE done_seq IS NOT NULL AND pruned = 0 "
            "AND (step IS NULL OR step < ?) ORDER BY done_seq LIMIT ?",
            (counter(conn, "checkpoint_step"), limit)).fetchall()
        freed = 0
        unnamed: Counter[str] = Counter()
        for group_id, count in rows:
            if kept - freed <= self.keep_consumed:
                break
            unnamed += image_refs(r[0] for r in conn.execute(
                "DELETE FROM experiences WHERE group_id = ? RETURNING images", (group_id,)))
            conn.execute("UPDATE groups SET pruned = 1 WHERE group_id = ?", (group_id,))
            freed += count
        if freed:
            bump(conn, "kept_done", -freed)
        if unnamed:  # an image goes with the last row that names it, in the same transaction
            conn.executemany("UPDATE images SET refs = refs - ? WHERE hash = ?",
                             [(n, h) for h, n in unnamed.items()])
            for chunk in chunks(sorted(unnamed)):
                conn.execute(f"DELETE FROM images WHERE hash IN ({marks(chunk)}) AND refs <= 0",
                             chunk)
        more = kept - freed > self.keep_consumed and len(rows) == limit
        self.due = time.monotonic() if more else None
