"""The reward worker pool forks its workers from one template process that imported and warmed
up the functions once: a worker, and a replacement for one killed for overrunning, costs a fork,
not an interpreter and its imports; and nothing of the pool outlives it, whichever of its
processes dies first."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap

import pytest

from backstop import BACKSTOP
from processes import cpu_seconds

from tandem.common import plugins
from tandem.common.config.reward import RewardConfig
from tandem.common.plugins import REWARDS, load_plugins
from tandem.common.registry import plugin_scope, reset_plugin_scope
from tandem.common.messages.reward import ScoreItem
from tandem.common.spawn import stat_fields
from tandem.reward import LocalScorer
from tandem.reward import pool as pool_module

EVIL = ScoreItem(response="\\boxed{" + "(" * 3000 + "}", truth="1")  # overruns any limit


def _alive(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] not in "ZX"
    except (OSError, IndexError):
        return False


async def test_a_replacement_worker_costs_a_fork_not_the_imports():
    # measured in the worker's own CPU seconds, which another load on the machine does not
    # stretch: a fresh interpreter importing math-verify and sympy spends over a second
    config = RewardConfig(functions={"math": 1.0}, workers=1, timeout=1.0)
    async with LocalScorer(config=config) as scorer:
        await scorer.start()
        pool = scorer._pool
        [first] = list(pool._all)
        [slow] = await scorer.score([EVIL])
        assert slow.reason == "timeout"
        [good] = await scorer.score([ScoreItem(response="\\boxed{1}", truth="1")])
        assert good.score == 1.0
        [second] = list(pool._all)
        assert second is not first and not _alive(first.proc.pid)
        assert cpu_seconds(second.proc.pid) < 0.3, cpu_seconds(second.proc.pid)
        template = pool._forker.proc.pid
        assert {int(stat_fields(w.proc.pid)[1]) for w in pool._all} == {template}


async def test_a_killed_template_takes_its_workers_and_is_started_again():
    config = RewardConfig(functions={"math": 1.0}, workers=2, timeout=BACKSTOP,
                          request_timeout=BACKSTOP)
    async with LocalScorer(config=config) as scorer:
        await scorer.start()
        pool = scorer._pool
        template = pool._forker.proc.pid
        workers = [w.proc.pid for w in pool._all]
        os.kill(template, signal.SIGKILL)
        await pool._forker.proc.wait()
        # the idle workers died with it (PR_SET_PDEATHSIG); the items that find them dead are
        # errors, and the pool forks fresh workers from a fresh template
        for _ in range(20):
            scores = await scorer.score([ScoreItem(response="\\boxed{1}", truth="1")] * 2)
            if all(s.score == 1.0 for s in scores):
                break
            assert all(s.score == 1.0 or "died with exit code -9" in s.reason for s in scores), \
                scores
        assert all(s.score == 1.0 for s in scores), scores
        assert not any(_alive(pid) for pid in workers)
        assert pool._forker.proc.pid != template
    assert not _alive(template)


async def test_closing_the_pool_leaves_no_process():
    config = RewardConfig(functions={"math": 1.0}, workers=3, timeout=BACKSTOP,
                          request_timeout=BACKSTOP)
    async with LocalScorer(config=config) as scorer:
        await scorer.start()
        pool = scorer._pool
        pids = [w.proc.pid for w in pool._all] + [pool._forker.proc.pid]
        assert all(_alive(pid) for pid in pids)
    assert not any(_alive(pid) for pid in pids)


def _slow_import_plugin(tmp_path, marks, seconds=1.5):
    """An isolated function whose first use costs `seconds` (as a lazy import of a parser
    would), paid by `warm_up`; each warm-up appends the pid that ran it to `marks`."""
    path = tmp_path / "pool_slow_import.py"
    path.write_text(textwrap.dedent(f"""
        import os, time
        from tandem.reward.base import PureReward, register, result

        @register("pool_slow_import")
        class SlowImport(PureReward):
            isolated = True
            ready = False

            def warm_up(self):
                if not SlowImport.ready:
                    time.sleep({seconds})
                    SlowImport.ready = True
                    with open({str(marks)!r}, "a") as f:
                        f.write(f"{{os.getpid()}}\\n")

            def score(self, item):
                self.warm_up()
                return result(1.0, "warm")
    """))
    return path


async def test_the_template_warms_only_the_functions_asked_for(tmp_path):
    # every isolated function warmed in every pool made each worker hold the math check's
    # sympy (38 MiB) in a run that scores with k12; another is warmed when an item asks for
    # it, in the template and outside the item's time limit, and the workers forked before
    # are forked again
    marks = tmp_path / "warmed"
    token = plugin_scope("pool_slow_import")
    try:
        load_plugins([str(_slow_import_plugin(tmp_path, marks))])
    finally:
        reset_plugin_scope(token)
    try:
        config = RewardConfig(functions={"k12": 1.0}, workers=2, timeout=1.0)
        async with LocalScorer(config=config) as scorer:
            await scorer.start()
            pool = scorer._pool
            assert pool._forker.asked == {"k12"}
            before = {w.proc.pid for w in pool._all}
            assert not marks.exists()
            item = ScoreItem(fn="pool_slow_import", response="x")
            scores = await scorer.score([item, item])
            assert [s.score for s in scores] == [1.0, 1.0], scores
            assert marks.read_text().split() == [str(pool._forker.proc.pid)]
            assert pool.killed == 0  # no item ran into its 1 s limit
            # each replacement is forked in the background; the pool is whole once they are in
            await asyncio.wait_for(asyncio.gather(*pool._spawning), BACKSTOP)
            after = {w.proc.pid for w in pool._all}
            assert not after & before and len(after) == 2
            [k12] = await scorer.score([ScoreItem(fn="k12", response="5", truth="5")])
            assert k12.score == 1.0
            assert marks.read_text().split() == [str(pool._forker.proc.pid)]
    finally:
        REWARDS.unregister("pool_slow_import")
        plugins._loaded.pop(str(tmp_path / "pool_slow_import.py"), None)


async def test_a_warm_up_that_overruns_takes_its_template_down(tmp_path, monkeypatch):
    # the template answers one request at a time; a warm-up whose answer was no longer awaited
    # came back as the answer to the next fork, whose own answer (a pid and its pidfd) then
    # answered the fork after: each later worker was another one's pid, and a kill for
    # overrunning hit a busy worker
    token = plugin_scope("pool_slow_import")
    try:
        load_plugins([str(_slow_import_plugin(tmp_path, tmp_path / "warmed", seconds=30))])
    finally:
        reset_plugin_scope(token)
    try:
        async with LocalScorer(config=RewardConfig(functions={"k12": 1.0}, workers=1)) as scorer:
            await scorer.start()
            template = scorer._pool._forker
            monkeypatch.setattr(pool_module, "STARTUP_TIMEOUT", 1.0)
            with pytest.raises(TimeoutError):
                await template.warm(["pool_slow_import"])
            assert template.dead
            assert await asyncio.wait_for(template.proc.wait(), BACKSTOP) == -signal.SIGKILL
            with pytest.raises(ConnectionError):
                await template.fork()
    finally:
        REWARDS.unregister("pool_slow_import")
        plugins._loaded.pop(str(tmp_path / "pool_slow_import.py"), None)
