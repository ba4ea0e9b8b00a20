"""The reward worker pool forks its workers from one template process that imported and warmed
up the functions once: a worker, and a replacement for one killed for overrunning, costs a fork,
not an interpreter and its imports; and nothing of the pool outlives it, whichever of its
processes dies first."""

from __future__ import annotations

import os
import signal

from backstop import BACKSTOP
from processes import cpu_seconds

from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.common.spawn import stat_fields
from tandem.reward import LocalScorer

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
