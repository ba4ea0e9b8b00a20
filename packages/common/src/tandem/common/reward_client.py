"""The reward service's client: `ScoreBatch` requests to a tandem-reward service, one `Score`
back per item, in order.

    async with RemoteScorer.from_config(config.reward, config.transport, name="explorer-0") as s:
        scores = await s.score([ScoreItem(response=text, truth="1/2")])

It lives in `tandem.common` because two components use it and neither may import the other:
the explorer scores through it when `reward.service` is set, and `tandem.reward` hands it out
(`build_scorer`) to programs that hold the reward package.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Self

from .config.reward import RewardConfig
from .config.transport import TransportConfig
from .errors import ProtocolError
from .messages.reward import Score, ScoreBatch, ScoreItem
from .rpc import RpcClient


class RemoteScorer:
    """Scores through a tandem-reward service at `address`, in requests of at most `max_batch`
    items (`reward.max_batch`).

    A request is resent with the same id every `resend` seconds (`reward.timeout`: one
    evaluation's bound) until `timeout` (`reward.request_timeout`): a service that is only busy
    answers it once, and one restarted after it was killed with the request in flight answers
    the resend."""

    def __init__(self, address: str, *, transport: TransportConfig | None = None,
                 timeout: float = 120.0, max_batch: int = 4096, name: str = "reward-client",
                 resend: float = 10.0):
        self.address = address
        self.timeout = timeout
        self.resend = resend
        self.max_batch = max_batch
        self._client = RpcClient(address, peer="reward", transport=transport, name=name)

    @classmethod
    def from_config(cls, reward: RewardConfig, transport: TransportConfig | None = None, *,
                    name: str = "reward-client") -> RemoteScorer:
        """The client of the service the `reward` section names."""
        return cls(reward.address, transport=transport, timeout=reward.request_timeout,
                   max_batch=reward.max_batch, name=name, resend=reward.timeout)

    async def score(self, items: list[ScoreItem], *, deadline: float | None = None) -> list[Score]:
        """One score per item; `deadline` (time.monotonic()) shortens the wait. RequestFailed
        when the service refuses, PeerDead when it does not answer, ProtocolError when it
        answers with another number of scores than items sent."""
        timeout = self.timeout
        if deadline is not None:
            timeout = max(0.001, min(timeout, deadline - time.monotonic()))
        chunks = [items[i:i + self.max_batch] for i in range(0, len(items), self.max_batch)]
        attempts = max(1, math.ceil(timeout / self.resend))
        replies = await asyncio.gather(*(
            self._client.call(ScoreBatch(items=chunk), timeout=timeout / attempts,
                              retries=attempts - 1, ttl=timeout,
                              timeout_key="reward.request_timeout")
            for chunk in chunks))
        for chunk, reply in zip(chunks, replies):
            if len(reply.scores) != len(chunk):
                raise ProtocolError(f"reward service at {self.address} returned "
                                    f"{len(reply.scores)} scores for {len(chunk)} items")
        return [score for reply in replies for score in reply.scores]

    async def close(self) -> None:
        await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
