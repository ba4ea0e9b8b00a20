"""A stateful hypothesis test: random put/sample/ack/release/expire/rewind sequences against
SqliteStore and a plain in-memory model of the buffer semantics (tandem.buffer.store's docstring).

The model is deliberately naive (dicts and sorted lists); every reply of the store and its
counts must agree with it after every step.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from buffer_helpers import Clock, make_experience
from tandem.buffer import (
    BadPut, BufferFull, NotEnoughExperiences, SqliteStore, UnknownLease, group_priority,
)

TASKS = {"a": 1, "b": 2, "c": 3, "d": 2}  # task -> group size
CAPACITY = 9
REUSE = 2
LEASE_SECONDS = 10.0
PRIORITY = "reward_variance"


def reward_of(task: str, index: int, version: int) -> float:
    return float((ord(task) * 7 + index * 3 + version) % 4)


@dataclass
class ModelGroup:
    task: str
    version: int
    size: int
    seq: int
    members: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    state: str = "waiting"
    uses: int = 0
    priority: float = 0.0
    use_steps: list[int] = field(default_factory=list)  # the trainer step of each use

    def order_key(self, policy: str) -> tuple:
        if policy == "fifo":
            return (self.uses, self.version, self.seq)
        if policy == "newest":
            return (self.uses, -self.version, -self.seq)
        return (self.uses, -self.priority, self.seq)


class BufferModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="buffer-model-"))
        self.clock = Clock()
        self.loop = asyncio.new_event_loop()
        self.store = SqliteStore(self.dir / "buffer.sqlite", capacity=CAPACITY, reuse=REUSE,
                                 lease_seconds=LEASE_SECONDS, priority=PRIORITY,
                                 synchronous="normal", clock=self.clock)
        self.groups: dict[str, ModelGroup] = {}
        self.leases: dict[str, tuple[float, list[str]]] = {}
        self.ended: list[str] = []
        self.dropped_stale = 0
        self.next_seq = 1
        self.step = 0  # the trainer step the next ack records

    def teardown(self):
        self.store.close_sync()
        self.loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    # ---- the model ----------------------------------------------------------------------

    def unconsumed(self) -> int:
        return sum(len(g.members) for g in self.groups.values()
                   if g.state in ("waiting", "ready", "leased"))

    def expire(self) -> None:
        for lease_id, (expires_at, gids) in list(self.leases.items()):
            if expires_at <= self.clock.now:
                for gid in gids:
                    self.groups[gid].state = "ready"
                del self.leases[lease_id]
                self.ended.append(lease_id)

    # ---- rules ----------------------------------------------------------------------------

    @rule(items=st.lists(st.tuples(st.sampled_from(sorted(TASKS)), st.integers(0, 2),
                                   st.integers(0, 3)), min_size=1, max_size=6))
    def put(self, items):
        experiences = [make_experience(t, i, v, reward=reward_of(t, i, v), seed=0)
                       for t, i, v in items]
        sizes = [TASKS[t] for t, _, _ in items]
        # expected outcome
        seen, order = set(), []
        for exp in experiences:
            if exp.id not in seen:
                seen.add(exp.id)
                order.append(exp)
        duplicates, dropped, new_per_group = len(experiences) - len(order), 0, {}
        for exp in order:
            group = self.groups.get(exp.group_id)
            finished = group is not None and group.state in ("consumed", "stale")
            if group is not None and exp.id in group.members and not finished:
                duplicates += 1
            else:
                new_per_group.setdefault(exp.group_id, []).append(exp)
        inserts = []
        expect_error = None
        for gid, members in new_per_group.items():
            group = self.groups.get(gid)
            size = TASKS[members[0].task_id]
            if group is not None and group.state == "consumed":
                duplicates += len(members)
                continue
            if group is not None and group.state == "stale":
                dropped += len(members)
                continue
            if (len(group.members) if group else 0) + len(members) > size:
                expect_error = expect_error or BadPut
                continue
            inserts.append((gid, members))
        total = sum(len(m) for _, m in inserts)
        if expect_error is None and self.unconsumed() + total > CAPACITY:
            expect_error = BufferFull
        try:
            outcome = self.run(self.store.put(experiences, sizes))
        except (BadPut, BufferFull) as exc:
            assert type(exc) is expect_error, (exc, expect_error)
            return
        assert expect_error is None, f"expected {expect_error.__name__}, got {outcome}"
        got = (outcome.stored, outcome.duplicates, outcome.dropped_stale)
        assert got == (total, duplicates, dropped)
        self.dropped_stale += dropped
        for gid, members in inserts:
            group = self.groups.get(gid)
            if group is None:
                first = members[0]
                group = self.groups[gid] = ModelGroup(first.task_id, first.policy_version,
                                                      TASKS[first.task_id], self.next_seq)
                self.next_seq += 1
            group.members.extend(e.id for e in members)
            group.rewards.extend(e.reward for e in members)
            if len(group.members) == group.size:
                group.state = "ready"
                group.priority = group_priority(PRIORITY, group.rewards, [{}] * group.size)

    @rule(num=st.integers(1, 3), policy=st.sampled_from(["fifo", "newest", "priority"]),
          min_version=st.none() | st.integers(0, 3), max_version=st.none() | st.integers(1, 3))
    def sample(self, num, policy, min_version, max_version):
        self.expire()
        if min_version is not None:
            for group in self.groups.values():
                if group.state in ("waiting", "ready") and group.version < min_version:
                    group.state = "stale"
                    self.dropped_stale += len(group.members)
        ready = [gid for gid, g in self.groups.items() if g.state == "ready"
                 and (min_version is None or g.version >= min_version)
                 and (max_version is None or g.version <= max_version)]
        try:
            lease = self.run(self.store.sample(num, policy=policy, min_version=min_version,
                                               max_version=max_version))
        except NotEnoughExperiences as exc:
            assert len(ready) < num and exc.have == len(ready), (exc, ready)
            return
        assert len(ready) >= num, f"store leased {lease.group_ids}, model has only {ready}"
        expected = sorted(ready, key=lambda gid: self.groups[gid].order_key(policy))[:num]
        assert lease.group_ids == expected
        assert [e.group_id for e in lease.experiences] == [
            gid for gid in expected for _ in range(self.groups[gid].size)]
        for gid in expected:
            self.groups[gid].state = "leased"
        self.leases[lease.lease_id] = (self.clock.now + LEASE_SECONDS, expected)

    def lease_ids(self) -> list[str]:
        return list(self.leases) + self.ended[-2:]  # in creation order: lease ids are random

    @precondition(lambda self: self.leases or self.ended)
    @rule(data=st.data(), ack=st.booleans())
    def finish(self, data, ack):
        lease_id = data.draw(st.sampled_from(self.lease_ids()))
        self.expire()
        call = self.store.ack if ack else self.store.release
        if lease_id not in self.leases:
            try:
                self.run(call(lease_id))
            except UnknownLease:
                return
            raise AssertionError(f"{'ack' if ack else 'release'} of ended lease {lease_id} passed")
        self.run(self.store.ack(lease_id, self.step) if ack else call(lease_id))
        for gid in self.leases.pop(lease_id)[1]:
            group = self.groups[gid]
            if ack:
                group.uses += 1
                group.use_steps.append(self.step)
            group.state = "consumed" if group.uses >= REUSE else "ready"
        self.step += ack
        self.ended.append(lease_id)

    @rule(data=st.data())
    def rewind(self, data):
        to = data.draw(st.integers(0, self.step))
        outcome = self.run(self.store.rewind(to))
        self.expire()
        assert outcome.leases_released == len(self.leases)
        for _, gids in self.leases.values():
            for gid in gids:
                self.groups[gid].state = "ready"
        self.ended.extend(self.leases)
        self.leases.clear()
        again = uses = 0
        for group in self.groups.values():
            undone = sum(step >= to for step in group.use_steps)
            if not undone:
                continue
            uses += undone
            group.use_steps = [step for step in group.use_steps if step < to]
            group.uses -= undone
            if group.state == "consumed":
                group.state = "ready"
                again += 1
        assert (outcome.groups, outcome.uses) == (again, uses)
        self.step = to

    @rule(seconds=st.sampled_from([1.0, 5.0, 10.0]))
    def wait(self, seconds):
        self.clock.now += seconds

    @invariant()
    def counts_agree(self):
        stats = self.run(self.store.stats())
        self.expire()
        by_state = dict.fromkeys(("waiting", "ready", "leased", "consumed", "stale"), 0)
        for group in self.groups.values():
            by_state[group.state] += len(group.members)
        assert stats.by_state == by_state
        assert stats.dropped_stale == self.dropped_stale
        assert stats.groups_ready == sum(g.state == "ready" for g in self.groups.values())
        assert stats.leases == len(self.leases)


BufferModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("BUFFER_MODEL_EXAMPLES", "60")), stateful_step_count=25,
    deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
test_buffer_matches_model = BufferModel.TestCase
