"""The reward service's one client (`tandem.common.reward_client.RemoteScorer`) against a scripted
service on loopback: order kept across split requests, the config's limits, and a reply with
another number of scores than items refused."""

from __future__ import annotations

import pytest

from backstop import BACKSTOP
from tandem.common.config import TransportConfig
from tandem.common.config.reward import RewardConfig
from tandem.common.errors import ProtocolError
from tandem.common.messages.reward import Score, ScoreBatch, Scores, ScoreItem
from tandem.common.reward_client import RemoteScorer
from tandem.common.rpc import RpcServer

FAST = TransportConfig(rpc_timeout=2.0, rpc_retries=0)


async def scripted_service(answer) -> tuple[RpcServer, str]:
    """A reward service whose reply to each request is `answer(items)`."""
    server = RpcServer("tcp://127.0.0.1:0", name="reward", transport=FAST)

    async def on_score(msg: ScoreBatch, ctx) -> Scores:
        return Scores(scores=answer(msg.items))

    server.register(ScoreBatch, on_score)
    return server, await server.start()


def items(n: int) -> list[ScoreItem]:
    return [ScoreItem(response=str(i)) for i in range(n)]


def echo(batch: list[ScoreItem]) -> list[Score]:
    return [Score(score=float(item.response)) for item in batch]


async def test_scores_come_back_in_order_across_split_requests(zmq_sockets_closed):
    requests: list[int] = []

    def counted(batch):
        requests.append(len(batch))
        return echo(batch)

    server, address = await scripted_service(counted)
    try:
        async with RemoteScorer(address, transport=FAST, timeout=BACKSTOP, max_batch=3) as scorer:
            scores = await scorer.score(items(7))
            assert await scorer.score([]) == []
    finally:
        await server.close()
    assert [s.score for s in scores] == [float(i) for i in range(7)]
    assert sorted(requests) == [1, 3, 3]


@pytest.mark.parametrize("answer,max_batch,n,message", [
    (lambda batch: echo(batch)[:-1], 3, 3, "returned 2 scores for 3 items"),
    (lambda batch: echo(batch) + echo(batch[:1]), 3, 3, "returned 4 scores for 3 items"),
    # one request a score short and the other one over: the total matches, the pairing not
    (lambda batch: echo(batch)[:-1] if batch[0].response == "0"
     else echo(batch) + echo(batch[:1]), 2, 4, "returned 1 scores for 2 items"),
])
async def test_a_reply_with_another_number_of_scores_is_refused(answer, max_batch, n, message,
                                                                zmq_sockets_closed):
    server, address = await scripted_service(answer)
    try:
        async with RemoteScorer(address, transport=FAST, timeout=BACKSTOP,
                                max_batch=max_batch) as scorer:
            with pytest.raises(ProtocolError, match=message) as err:
                await scorer.score(items(n))
    finally:
        await server.close()
    assert address in str(err.value)


async def test_from_config_takes_the_reward_sections_limits(zmq_sockets_closed):
    reward = RewardConfig(functions={"format": 1.0}, service=True,
                          address="tcp://127.0.0.1:1", timeout=4.0, request_timeout=40.0,
                          max_batch=16)
    async with RemoteScorer.from_config(reward, FAST, name="explorer-0") as scorer:
        assert (scorer.address, scorer.timeout, scorer.resend, scorer.max_batch) == (
            "tcp://127.0.0.1:1", 40.0, 4.0, 16)
