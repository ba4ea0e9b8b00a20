"""One hostile response never stalls the reward service: under concurrent clients, a batch
holding a response that never finishes and responses built to make parsers quadratic is
answered, its ordinary items scored right, and the other clients' requests too."""

from __future__ import annotations

import asyncio

from backstop import BACKSTOP

from tandem.common.config import RunConfig
from tandem.common.config.reward import RewardConfig
from tandem.common.messages.reward import ScoreItem
from tandem.reward import RemoteScorer, RewardService

ORDINARY = [  # (item, score)
    (ScoreItem(fn="k12", response="The answer is **B**.", truth="B"), 1.0),
    (ScoreItem(fn="k12", response="\\boxed{\\frac{3}{4}}", truth="0.75"), 1.0),
    (ScoreItem(fn="k12", response="(B) or (C)", truth="B"), 0.0),
    (ScoreItem(fn="format", response="<think>a</think><answer>b</answer>"), 1.0),
    (ScoreItem(fn="format", response="\\boxed{}", args={"pattern": "boxed"}), 0.0),
    (ScoreItem(fn="vision", response="1,000", truth={"count": 1000}), 1.0),
    (ScoreItem(fn="vision", response="[0, 0, 10, 10]", truth={"box": [0, 0, 10, 10]}), 1.0),
    (ScoreItem(fn="math", response="\\boxed{\\frac{1}{2}}", truth="0.5"), 1.0),
]
HOSTILE = [
    ScoreItem(fn="k12", response="\\boxed{" * 25000, truth="7"),
    ScoreItem(fn="k12", response="1" + " " * 100000 + "x", truth="7"),
    ScoreItem(fn="format", response="<answer>" * 20000, args={"pattern": "answer"}),
    ScoreItem(fn="vision", response="(" * 50000, truth={"box": [0, 0, 1, 1]}),
]
# never returns: math-verify evaluates the tower; only killing its worker ends it
NEVER = ScoreItem(fn="math", response="\\boxed{9^{9^{9^{9}}}}", truth="1")


async def test_hostile_batch_and_concurrent_clients_are_answered_on_time(zmq_sockets_closed):
    # reward.timeout ends the item that never finishes; the ordinary items it bounds too are
    # a few milliseconds of CPU each in an already started worker
    config = RunConfig(reward=RewardConfig(functions={"k12": 1.0}, workers=2, timeout=1.0))
    service = RewardService(config, address="tcp://127.0.0.1:0")
    address = await service.start()
    try:
        items = [NEVER, *HOSTILE, *(item for item, _ in ORDINARY)]

        async def hostile_client():
            async with RemoteScorer(address, timeout=BACKSTOP) as remote:
                return await remote.score(items)

        async def ordinary_client(n: int):
            # a PeerDead here means the service stalled: it did not answer at all
            async with RemoteScorer(address, timeout=BACKSTOP, name=f"client-{n}") as remote:
                got = []
                for _ in range(3):
                    got.append(await remote.score([item for item, _ in ORDINARY]))
                return got

        hostile, *others = await asyncio.gather(hostile_client(), ordinary_client(1),
                                                ordinary_client(2))
        assert hostile[0].score == 0.0 and hostile[0].reason == "timeout"
        for score in hostile[1:1 + len(HOSTILE)]:
            assert score.score == 0.0
        wants = [want for _, want in ORDINARY]
        assert [s.score for s in hostile[1 + len(HOSTILE):]] == wants, \
            [s.reason for s in hostile[1 + len(HOSTILE):]]
        for rounds in others:
            for scores in rounds:
                assert [s.score for s in scores] == wants, [s.reason for s in scores]
        assert service.scorer.stats["math"]["timeouts"] == 1
    finally:
        await service.close()
