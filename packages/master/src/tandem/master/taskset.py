"""The taskset and its leases: tasks go out in batches, come back done, or expire and go again.

`load_rows` reads the taskset's rows with its reader (JSONL, Parquet or CSV files, a `datasets`
folder, a dataset by name, or a plugin's) and makes each a task with its format
(`tandem.common.tasks`, which the eval tasksets share), once, before the master serves: a bad
row stops the master at start. `TaskDispatcher` walks the tasks epoch by epoch in a seeded
order and hands them out as leases; a lease not completed before its deadline (the explorer
died) puts its tasks at the front of the queue, so the next explorer to ask gets them. Its
state changes only through `lease`, `complete` and `expire`, which the master journals, so
replaying the journal rebuilds the cursor after a restart.
"""

from __future__ import annotations

import random
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tandem.common.config import TasksetConfig
from tandem.common.messages import Task
from tandem.common.tasks import load_tasks


def load_rows(cfg: TasksetConfig, *, images: bool = True) -> list[dict[str, Any]]:
    """Every task of the training taskset, in file order: its rows as `cfg.reader` reads them,
    each made a task by `cfg.format` (`tandem.common.tasks.load_tasks`); `images=False`
    leaves the tasks' images unread (`tandem up`'s check before the master reads them)."""
    return load_tasks(cfg.path, cfg.split, key="master.taskset", reader=cfg.reader,
                      format=cfg.format, id_field=cfg.id_field, images=images)


@dataclass
class Lease:
    """Tasks out with one explorer until `deadline` (unix seconds)."""

    lease_id: str
    explorer: str
    step: int
    refs: list[tuple[int, int]]  # (epoch, row index)
    deadline: float
    granted_at: float

    def describe(self) -> dict[str, Any]:
        return dict(lease_id=self.lease_id, explorer=self.explorer, step=self.step,
                    tasks=len(self.refs), deadline=self.deadline, granted_at=self.granted_at)


@dataclass
class TaskDispatcher:
    """Seeded epoch order, a cursor, a queue of returned tasks, and the open leases."""

    rows: list[dict[str, Any]]
    cfg: TasksetConfig
    cursor: int = 0  # tasks handed out fresh so far, over all epochs
    returned: deque[tuple[int, int]] = field(default_factory=deque)
    leases: dict[str, Lease] = field(default_factory=dict)
    completed: int = 0
    expired: int = 0
    late: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # expired, by lease id
    done_ids: dict[str, None] = field(default_factory=dict)  # recently completed lease ids
    _orders: dict[int, list[int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.rows) * self.cfg.epochs

    @property
    def exhausted(self) -> bool:
        return self.cursor >= self.total and not self.returned

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.cfg.shuffle:
                random.Random(self.cfg.seed + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is enough
        return self._orders[epoch]

    def task(self, ref: tuple[int, int]) -> Task:
        epoch, index = ref
        row = self.rows[index]
        id_key = self.cfg.id_key
        tid = str(row[id_key]) if id_key else str(index)
        return Task(id=tid, payload=row, epoch=epoch)

    def plan_lease(self, count: int) -> list[tuple[int, int]]:
        """The tasks the next lease of `count` would hold (no state change)."""
        refs = list(self.returned)[:count]
        cursor = self.cursor
        while len(refs) < count and cursor < self.total:
            epoch, pos = divmod(cursor, len(self.rows))
            refs.append((epoch, self.order(epoch)[pos]))
            cursor += 1
        return refs

    def open_lease(self, explorer: str, step: int) -> Lease | None:
        for lease in self.leases.values():
            if lease.explorer == explorer and lease.step == step:
                return lease
        return None

    def apply_lease(self, lease_id: str, explorer: str, step: int, refs: list[tuple[int, int]],
                    deadline: float, granted_at: float) -> Lease:
        """Record a lease (also on journal replay): returned tasks first, then the cursor."""
        refs = [tuple(r) for r in refs]
        for ref in refs:
            if self.returned and self.returned[0] == ref:
                self.returned.popleft()
            elif ref in self.returned:
                self.returned.remove(ref)
            else:
                self.cursor += 1
        lease = Lease(lease_id, explorer, step, refs, deadline, granted_at)
        self.leases[lease_id] = lease
        return lease

    def new_lease_id(self) -> str:
        return uuid.uuid4().hex[:16]

    def apply_complete(self, lease_id: str) -> bool:
        """Done. An expired lease completed late takes back its tasks not yet handed out again."""
        if lease_id in self.done_ids:
            return True  # a repeat (the reply was lost, or the master restarted)
        lease = self.leases.pop(lease_id, None)
        refs = self.late.pop(lease_id, None)
        if lease is None and refs is None:
            return False
        self.done_ids[lease_id] = None
        while len(self.done_ids) > 4096:
            self.done_ids.pop(next(iter(self.done_ids)))
        if lease is not None:
            self.completed += len(lease.refs)
            return True
        for ref in refs:
            if ref in self.returned:
                self.returned.remove(ref)
                self.completed += 1
        return True

    def apply_expire(self, lease_id: str) -> Lease | None:
        """The lease's tasks go to the front of the queue for the next explorer."""
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.returned.extendleft(reversed(lease.refs))
            self.expired += 1
            self.late[lease_id] = lease.refs
            while len(self.late) > 1024:
                self.late.pop(next(iter(self.late)))
        return lease

    def due(self, now: float) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.deadline <= now]

    def held_by(self, explorer: str) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.explorer == explorer]

    def counters(self) -> dict[str, Any]:
        return dict(tasks_total=self.total, tasks_dispatched=self.cursor,
                    tasks_completed=self.completed, tasks_returned=len(self.returned),
                    leases_open=len(self.leases), leases_expired=self.expired,
                    epoch=min(self.cursor // max(1, len(self.rows)), self.cfg.epochs - 1))
