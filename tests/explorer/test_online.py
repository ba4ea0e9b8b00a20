"""The `online` workflow: an application's own conversations through the endpoint, opened by a
group key, rewarded later, grouped, expired when never rewarded. Driven by the official `openai`
client (the example application's helpers) against the tiny chat model of the agent tests."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tandem.common.messages.experience import Task
from tandem.common.trace import Tracer
from tandem.explorer.online import Online, read_slots
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.workflows import RolloutContext, create_workflow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from backstop import BACKSTOP
from endpoint_helpers import endpoint
from online_app import attach_reward, open_episode

SAMPLING = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
TTL = 100.0


class Clock:
    """The book's clock, moved by the test: expiry happens when the test says, not by sleep."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ctx(engine, ep, repeat_times=2) -> RolloutContext:
    return RolloutContext(engine=engine, sampling=SAMPLING, repeat_times=repeat_times,
                          explorer="explorer-0", run="test", endpoint=ep)


def slots(n: int) -> list[Task]:
    return [Task(id=row["id"], payload=row) for row in read_slots(str(n))]


async def two_turns(ep, episode: str, question: str) -> None:
    """A conversation of two turns, the assistant's first answer sent back as it came."""
    client = openai.AsyncOpenAI(base_url=ep.url, api_key=episode, max_retries=0,
                                timeout=BACKSTOP)
    try:
        messages = [{"role": "user", "content": question}]
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=8)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Shorter?"}]
        await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    finally:
        await client.close()


async def started(agent_engine, tmp_path, repeat_times=2):
    """(endpoint, workflow, clock, tracer, the application's client), the endpoint serving."""
    clock = Clock()
    ep = endpoint(agent_engine, sampling=SAMPLING)
    workflow = Online(agent_engine.tokenizer, {"episode_ttl": TTL, "wait_timeout": BACKSTOP},
                      clock=clock)
    tracer = Tracer(tmp_path, "explorer-0")
    workflow.attach(ep, repeat_times=repeat_times, tracer=tracer)
    await ep.start()
    app = openai.AsyncOpenAI(base_url=ep.url, api_key="app", max_retries=0, timeout=BACKSTOP)
    return ep, workflow, clock, tracer, app


async def stop(ep, tracer, app) -> None:
    await app.close()
    await ep.close()
    tracer.close()


def test_online_is_registered_with_the_endpoint():
    from tandem.explorer.workflows import workflow_needs

    assert workflow_needs("online").endpoint
    with pytest.raises(ValueError, match="episode_ttl"):
        create_workflow("online", None, {"episode_ttl": 0})


async def test_groups_by_key_and_rewards_attached_later(agent_engine, tmp_path):
    ep, workflow, clock, tracer, app = await started(agent_engine, tmp_path)
    try:
        # two keys, their episodes opened interleaved; all four talk before any reward
        opened = [(key, await open_episode(app, key)) for key in ("cats", "dogs", "cats", "dogs")]
        await asyncio.gather(*(two_turns(ep, episode, f"Tell me about {key}.")
                               for key, episode in opened))
        assert workflow.book.stats()["groups_ready"] == 0  # no reward yet: nothing to train
        clock.now += TTL / 2  # minutes later, within the TTL
        rewards = {episode: float(i) for i, (_, episode) in enumerate(opened)}
        for episode, reward in rewards.items():
            answer = await attach_reward(app, episode, reward, politeness=0.5)
            assert answer["status"] == "rewarded" and answer["calls"] == 2
        experiences = await workflow.run(slots(2), ctx(agent_engine, ep))
    finally:
        await stop(ep, tracer, app)
    assert len(experiences) == 4
    groups: dict[str, list] = {}
    for exp in experiences:
        groups.setdefault(exp.group_id, []).append(exp)
    assert sorted(sorted(e.info["group_key"] for e in g) for g in groups.values()) == [
        ["cats", "cats"], ["dogs", "dogs"]]
    for exp in experiences:
        key, episode = exp.info["group_key"], exp.info["online_episode"]
        assert (key, episode) in opened
        assert exp.reward == rewards[episode]
        assert exp.rewards == {"reward": rewards[episode], "politeness": 0.5}
        assert exp.info["group_size"] == 2 and exp.info["rule"] == "chained"
        assert exp.info["calls"] == 2 and "token_mismatch" not in exp.info
        assert exp.info["episode_s"] == TTL / 2
        assert exp.policy_version == agent_engine.version
        # both model turns are actions; the user's second turn between them is not
        mask = exp.action_mask.tolist()
        assert mask[0] == 1 and mask[-1] == 1 and 0 in mask
    assert ep.calls.mismatches == 0
    assert workflow.book.stats()["trained"] == 4


async def test_episodes_never_rewarded_expire_uncounted_in_training(agent_engine, tmp_path):
    ep, workflow, clock, tracer, app = await started(agent_engine, tmp_path)
    try:
        kept = await open_episode(app, "q1")
        lost = await open_episode(app, "q1")
        await asyncio.gather(two_turns(ep, kept, "Hi"), two_turns(ep, lost, "Hi"))
        await attach_reward(app, kept, 1.0)
        assert workflow.book.stats()["groups_ready"] == 0  # `lost` may still be rewarded
        clock.now += TTL  # `lost` is past its TTL: the next look at the book expires it
        step = asyncio.create_task(workflow.run(slots(1), ctx(agent_engine, ep)))
        experiences = await step
        with pytest.raises(openai.APIStatusError) as late:
            await attach_reward(app, lost, 1.0)
        # its calls after the expiry are served and not recorded
        await two_turns(ep, lost, "Still there?")
    finally:
        await stop(ep, tracer, app)
    assert [e.info["online_episode"] for e in experiences] == [kept]
    assert experiences[0].info["group_size"] == 1
    assert late.value.status_code == 410 and "expired" in late.value.message
    stats = workflow.book.stats()
    assert stats["expired"] == 1 and stats["trained"] == 1 and stats["open"] == 0
    events = [json.loads(line) for line in
              (tmp_path / "trace" / "explorer-0.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["attrs"]["episode"]) for e in events] == [("online_expired", lost)]
    assert ep.calls.unrecorded == 2


async def test_a_group_of_expired_episodes_is_dropped_and_the_key_starts_anew(agent_engine,
                                                                             tmp_path):
    ep, workflow, clock, tracer, app = await started(agent_engine, tmp_path)
    try:
        first = await open_episode(app, "k")
        await two_turns(ep, first, "Hi")
        clock.now += TTL  # the group never filled and its one episode was never rewarded
        again = [await open_episode(app, "k") for _ in range(2)]
        await asyncio.gather(*(two_turns(ep, e, "Hi") for e in again))
        for e in again:
            await attach_reward(app, e, 0.5)
        experiences = await workflow.run(slots(1), ctx(agent_engine, ep))
    finally:
        await stop(ep, tracer, app)
    assert sorted(e.info["online_episode"] for e in experiences) == sorted(again)
    stats = workflow.book.stats()
    assert stats["expired"] == 1 and stats["groups_dropped"] == 1


async def test_a_step_waits_for_its_groups_within_wait_timeout(agent_engine, tmp_path):
    ep, workflow, _, tracer, app = await started(agent_engine, tmp_path)
    workflow.args.wait_timeout = 0.2
    try:
        with pytest.raises(TimeoutError, match="0 of 1 groups.*workflow_args.wait_timeout"):
            await workflow.run(slots(1), ctx(agent_engine, ep))
    finally:
        await stop(ep, tracer, app)


async def test_bad_episode_calls_get_a_4xx_naming_what_is_wrong(agent_engine, tmp_path):
    ep, _, _, tracer, app = await started(agent_engine, tmp_path)

    async def refused(path: str, body: object) -> tuple[int, dict]:
        # as JSON text: Python's encoder writes NaN, which the openai client refuses to send
        async with httpx.AsyncClient(timeout=BACKSTOP) as http:
            answer = await http.post(ep.url + path, content=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return answer.status_code, answer.json()["error"]

    try:
        episode = await open_episode(app, "g")
        assert await refused("/episodes", {}) == (400, {
            "message": "group: field required", "type": "invalid_request_error",
            "param": "group", "code": None})
        status, body = await refused("/episodes", {"group": 7})
        assert status == 400 and body["param"] == "group" and "string" in body["message"]
        status, body = await refused(f"/episodes/{episode}/reward", {"reward": 1.0})
        assert status == 400 and body["code"] == "episode_empty" and episode in body["message"]
        await two_turns(ep, episode, "Hi")
        for bad, param, says in (({}, "reward", "field required"),
                                 ({"reward": "1"}, "reward", "valid number"),
                                 ({"reward": float("nan")}, "reward", "finite"),
                                 ({"reward": 1, "rewrad": 2}, "rewrad", "extra"),
                                 ({"reward": 1, "components": {"a": "x"}}, "components",
                                  "valid number")):
            status, body = await refused(f"/episodes/{episode}/reward", bad)
            assert status == 400 and body["param"] == param, (bad, body)
            assert says in body["message"].lower(), (bad, body)
        status, body = await refused("/episodes/ep-nobody/reward", {"reward": 1.0})
        assert status == 404 and body["code"] == "episode_not_found"
        assert "'ep-nobody'" in body["message"] and "POST /v1/episodes" in body["message"]
        await attach_reward(app, episode, 1.0)
        status, body = await refused(f"/episodes/{episode}/reward", {"reward": 0.0})
        assert status == 409 and body["code"] == "episode_closed" and "1" in body["message"]
        async with httpx.AsyncClient(timeout=BACKSTOP) as http:
            answer = await http.post(f"{ep.url}/episodes", content=b"{group")
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
    finally:
        await stop(ep, tracer, app)
