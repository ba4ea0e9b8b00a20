"""The reward service's /metrics: requests, items, scoring per function, RPC errors by code."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from backstop import BACKSTOP

from tandem.common.config import RunConfig
from tandem.common.errors import RequestFailed
from tandem.common.messages.reward import ScoreBatch, ScoreItem
from tandem.common.rpc import RpcClient
from tandem.reward import RewardService

ITEM = ScoreItem(response="<think>x</think><answer>B</answer>", truth="B",
                 functions={"k12": 1.0})


async def test_reward_service_serves_its_metrics(tmp_path, zmq_sockets_closed):
    config = RunConfig.model_validate({
        "run_dir": str(tmp_path), "logging": {"metrics": {"enabled": True, "port": 0}},
        "reward": {"functions": {"k12": 1.0}, "workers": 1, "max_batch": 2}})
    service = RewardService(config, address="tcp://127.0.0.1:0")
    client = RpcClient(await service.start(), peer="reward", transport=config.transport)
    try:
        await client.call(ScoreBatch(items=[ITEM, ITEM]), timeout=BACKSTOP)
        with pytest.raises(RequestFailed) as refused:
            await client.call(ScoreBatch(items=[ITEM] * 3), timeout=BACKSTOP)
        url = (tmp_path / "metrics" / "reward.url").read_text().strip()
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(url, timeout=BACKSTOP).read().decode())
    finally:
        await client.close()
        await service.close()
    assert "tandem_reward_requests 1.0" in text and "tandem_reward_items 2.0" in text
    assert 'tandem_reward_scoring{function="k12",stat="evaluated"} 2.0' in text
    assert 'tandem_reward_scoring{function="k12",stat="timeouts"} 0.0' in text
    assert f'tandem_reward_rpc_errors{{code="{refused.value.code}"}} 1.0' in text
