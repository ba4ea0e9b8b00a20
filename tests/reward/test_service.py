"""The reward service over real loopback sockets: same scores as in-process, deadlines,
per-evaluation timeouts counted in metrics, errors, and the CLI as a real process."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import yaml
from backstop import BACKSTOP

from tandem.common.config import RunConfig
from tandem.common.config.reward import CodeSandboxConfig, RewardConfig
from tandem.common.errors import RequestFailed
from tandem.common.messages.reward import GetRewardStats, ScoreBatch, ScoreItem
from tandem.common.rpc import RpcClient
from tandem.reward import LocalScorer, RemoteScorer, RewardService, build_scorer
from tandem.reward.functions.code_tests import STARTUP_SECONDS
from tandem.common.sockets import free_port

ITEMS = [
    ScoreItem(response="<think>x</think><answer>B</answer>", truth="B",
              functions={"k12": 1.0, "format": 0.5}),
    ScoreItem(fn="code", response="```python\nprint(int(input()) * 2)\n```",
              truth={"tests": [{"input": "2", "output": "4"}, {"input": "3", "output": "7"}]}),
    ScoreItem(fn="vision", response="[0, 0, 10, 10]", truth={"box": [0, 0, 10, 20]}),
    ScoreItem(fn="no_such_function", response="x"),
]
SLEEPER = ScoreItem(fn="code", response="import time\ntime.sleep(60)",
                    truth={"tests": [{"input": "", "output": ""}]})
# math-verify evaluates the power tower and never returns: only killing its worker ends it
MATH_BOMB = ScoreItem(fn="math", response="\\boxed{9^{9^{9^{9}}}}", truth="1")


def _config(**reward) -> RunConfig:
    base = dict(functions={"format": 1.0}, workers=2, timeout=BACKSTOP, request_timeout=BACKSTOP,
                code=CodeSandboxConfig(cpu_seconds=BACKSTOP, wall_seconds=BACKSTOP, memory_mb=256))
    return RunConfig(reward=RewardConfig(**{**base, **reward}))


async def test_service_scores_like_the_in_process_scorer(zmq_sockets_closed):
    config = _config()
    service = RewardService(config, address="tcp://127.0.0.1:0")
    address = await service.start()
    try:
        async with RemoteScorer(address, timeout=BACKSTOP) as remote, \
                LocalScorer(config=config.reward) as local:
            assert isinstance(build_scorer(config.reward), LocalScorer)
            via_config = build_scorer(config.reward.model_copy(
                update={"service": True, "address": address}), config.transport)
            assert isinstance(via_config, RemoteScorer)
            try:
                assert len(await via_config.score(ITEMS[2:3])) == 1
            finally:
                await via_config.close()
            got = await remote.score(ITEMS)
            want = await local.score(ITEMS)
        assert [g.model_dump() for g in got] == [w.model_dump() for w in want]
        assert got[0].score == 1.5 and got[1].score == 0.5 and got[2].score == pytest.approx(0.5)
        assert got[3].reason.startswith("error: unknown reward function 'no_such_function'")
    finally:
        await service.close()


async def test_evaluation_timeout_scores_zero_and_is_counted(zmq_sockets_closed):
    service = RewardService(_config(timeout=0.5), address="tcp://127.0.0.1:0")
    address = await service.start()
    try:
        async with RemoteScorer(address, timeout=BACKSTOP) as remote:
            [slow, fast] = await remote.score([MATH_BOMB, ITEMS[2]])
        assert slow.score == 0.0 and slow.reason == "timeout"
        assert fast.score == pytest.approx(0.5)
        client = RpcClient(address, peer="reward")
        try:
            stats = await client.call(GetRewardStats(), timeout=BACKSTOP)
        finally:
            await client.close()
        assert stats.by_function["math"]["timeouts"] == 1
        assert stats.by_function["vision"]["timeouts"] == 0
        assert stats.requests == 1 and stats.items == 2 and stats.workers == 2
    finally:
        await service.close()


async def test_request_deadline_beats_the_evaluation_timeout(zmq_sockets_closed):
    service = RewardService(_config(), address="tcp://127.0.0.1:0")
    address = await service.start()
    client = RpcClient(address, peer="reward")
    try:
        # the service may spend 2 s on it (the request's time-to-live); this client waits on
        start = time.monotonic()
        reply = await client.call(ScoreBatch(items=[SLEEPER]), ttl=2.0, timeout=BACKSTOP,
                                  retries=0)
        elapsed = time.monotonic() - start
        # every other bound is BACKSTOP: only the deadline can have ended the evaluation. The
        # code reward stops itself before it (its test ran out of wall clock); should it not be
        # reaped in time on a busy machine, the scorer's own bound answers
        [score] = reply.scores
        assert score.score == 0.0, score
        assert "test 1: timeout" in score.reason or score.reason == "timeout", score.reason
        assert elapsed > 1.0
    finally:
        await client.close()
        await service.close()


async def test_oversized_request_is_refused_with_a_code(zmq_sockets_closed):
    service = RewardService(_config(max_batch=2), address="tcp://127.0.0.1:0")
    address = await service.start()
    client = RpcClient(address, peer="reward")
    try:
        with pytest.raises(RequestFailed) as info:
            await client.call(ScoreBatch(items=ITEMS[:3]), timeout=BACKSTOP)
        # refused at the door, before decoding, naming the key
        assert info.value.code == "too_large" and "reward.max_batch" in info.value.message
        assert "3 items" in info.value.message
        async with RemoteScorer(address, timeout=BACKSTOP, max_batch=2) as remote:
            assert len(await remote.score(ITEMS[:3])) == 3  # the client splits batches
    finally:
        await client.close()
        await service.close()


async def test_cli_serves_and_stops_on_sigterm(tmp_path, zmq_sockets_closed):
    port = free_port()
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"),
                                   "reward": {"functions": {"format": 1.0}, "workers": 1}}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.reward.cli", "--config", str(cfg),
         "--set", f"reward.address=tcp://127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with RemoteScorer(f"tcp://127.0.0.1:{port}", timeout=BACKSTOP) as remote:
            [score] = await remote.score([ScoreItem(response="\\boxed{1}",
                                                    args={"pattern": "boxed"})])
        assert score.score == 1.0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=BACKSTOP)
        assert proc.returncode == 0, out.decode()
        assert b"reward.stopped" in out
        assert (tmp_path / "run" / "logs" / "reward.jsonl").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_reports_a_bad_config_in_one_message(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"reward": {"workers": 0, "functions": {}}}))
    done = subprocess.run([sys.executable, "-m", "tandem.reward.cli", "--config", str(cfg)],
                          capture_output=True, timeout=BACKSTOP)
    assert done.returncode == 2
    err = done.stderr.decode()
    assert "Traceback" not in err and "reward.workers" in err


async def test_time_waiting_for_a_worker_does_not_count_against_the_evaluation():
    # one worker, six evaluations of over a second each: together past one evaluation's
    # budget (one test: wall_seconds + STARTUP_SECONDS), each within it
    config = RewardConfig(functions={"code": 1.0}, workers=1,
                          code=CodeSandboxConfig(wall_seconds=4.0))
    item = ScoreItem(response="import time\ntime.sleep(1.0)\nprint('done')",
                     truth={"tests": [{"input": "", "output": "done"}]})
    async with LocalScorer(config=config) as scorer:
        start = time.monotonic()
        scores = await scorer.score([item] * 6)
        assert time.monotonic() - start > config.code.wall_seconds + STARTUP_SECONDS
    assert [s.reason for s in scores] == ["1/1 tests passed"] * 6
