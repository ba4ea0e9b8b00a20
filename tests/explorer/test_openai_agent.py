"""The OpenAI-compatible endpoint and the `agent` workflow, driven by the official `openai`
client against a tiny local model that has learnt to call a calculator tool."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest

from tandem.common.messages.experience import Task
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.workflows import RolloutContext, create_workflow
from tandem.explorer.workflows.agent import score_of

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "agents"))

from agent_model import QUESTION, TOOLS
from backstop import BACKSTOP
from endpoint_helpers import GREEDY, agent_args, encode, endpoint
from processes import wait_for



def ctx(engine, ep, repeat_times=2, sampling=GREEDY) -> RolloutContext:
    return RolloutContext(engine=engine, sampling=sampling, repeat_times=repeat_times,
                          explorer="explorer-0", run="test", endpoint=ep)


async def test_tool_calling_agent_becomes_one_experience_with_exact_masks(agent_engine):
    ep = endpoint(agent_engine)
    await ep.start()
    try:
        workflow = create_workflow("agent", agent_engine.tokenizer,
                                   agent_args("calculator_agent:run"))
        task = Task(id="t0", payload={"prompt": QUESTION, "answer": 84, "max_tokens": 90})
        experiences = await workflow.run([task], ctx(agent_engine, ep))
    finally:
        await ep.close()
    assert len(experiences) == 2  # repeat_times episodes, each chained into one experience
    tok = agent_engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tools=TOOLS,
                                     tokenize=False, add_generation_prompt=True)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    first = encode(agent_engine, call) + [tok.eos_token_id]  # the model's own eos ends its turn
    between = encode(agent_engine, "<|tool|>\n84</s><|assistant|>\n")  # the tool's result
    second = encode(agent_engine, "84") + [tok.eos_token_id]
    for exp in experiences:
        assert exp.reward == 1.0 and exp.rewards["tool_calls"] == 1.0
        assert exp.info["rule"] == "chained" and exp.info["calls"] == 2
        assert exp.info["finish_reasons"] == ["tool_calls", "stop"]
        assert exp.tokens[:exp.prompt_len].tolist() == encode(agent_engine, prompt)
        assert exp.tokens[exp.prompt_len:].tolist() == first + between + second
        assert exp.action_mask.tolist() == [1] * len(first) + [0] * len(between) + [1] * len(second)
        # behaviour logprobs are the engine's own for the same tokens
        prompt_ids = exp.tokens[:exp.prompt_len].tolist()
        [[direct]] = agent_engine.generate_sync([prompt_ids], 1, GREEDY)
        assert direct.token_ids.tolist() == first
        np.testing.assert_allclose(exp.logprobs[:len(first)], direct.logprobs, atol=1e-6)
        assert not exp.logprobs[len(first):len(first) + len(between)].any()


async def test_two_turn_agent_masks_what_the_agent_added(agent_engine):
    sampling = SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    ep = endpoint(agent_engine, sampling=sampling)
    await ep.start()
    try:
        workflow = create_workflow("agent", agent_engine.tokenizer,
                                   agent_args("calculator_agent:two_turn"))
        experiences = await workflow.run(
            [Task(id="a", payload={"prompt": "Hi"}), Task(id="b", payload={"prompt": "Why?"})],
            ctx(agent_engine, ep, repeat_times=3, sampling=sampling))
    finally:
        await ep.close()
    assert len(experiences) == 6 and len({e.group_id for e in experiences}) == 2
    eos = agent_engine.tokenizer.eos_token_id
    for exp in experiences:
        assert exp.info["rule"] == "chained" and exp.info["calls"] == 2
        mask = exp.action_mask.tolist()
        response = exp.tokens[exp.prompt_len:].tolist()
        # model tokens, then the agent's next user turn (mask 0), then model tokens again
        start = mask.index(0)
        end = len(mask) - mask[::-1].index(0)
        assert set(mask[:start]) == {1} and set(mask[start:end]) == {0} and set(mask[end:]) == {1}
        added = agent_engine.tokenizer.decode(response[start:end])
        closing = "" if response[start - 1] == eos else "</s>"
        assert added == closing + "<|user|>\nShorter?</s><|assistant|>\n"
        assert exp.reward in (0.0, 1.0)


async def test_chat_logprobs_streaming_completions_and_models(agent_engine):
    ep = endpoint(agent_engine)
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.url, api_key="no-episode", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    try:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, logprobs=True, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        [tool_call] = choice.message.tool_calls
        assert tool_call.function.name == "calculator"
        assert json.loads(tool_call.function.arguments) == {"expression": "12*7"}
        prompt_ids = encode(agent_engine, agent_engine.tokenizer.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=True))
        [[direct]] = agent_engine.generate_sync([prompt_ids], 1, GREEDY)
        np.testing.assert_allclose([t.logprob for t in choice.logprobs.content],
                                   direct.logprobs, atol=1e-6)
        assert reply.usage.prompt_tokens == len(prompt_ids)

        stream = await client.chat.completions.create(
            model="policy", messages=messages, temperature=0, stream=True, max_tokens=20)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        plain = await client.chat.completions.create(
            model="policy", messages=messages, temperature=0, max_tokens=20)
        assert text == plain.choices[0].message.content

        done = await client.completions.create(model="policy", prompt=["12*7=", "1+1="],
                                               max_tokens=5, n=2, logprobs=1, temperature=0.5)
        assert len(done.choices) == 4
        for c in done.choices:
            assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) >= 1
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
    finally:
        await client.close()
        await ep.close()
    assert ep.calls.unrecorded == 1 + 2 + 4  # no open episode: served, not recorded


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=BACKSTOP) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_bad_input_gets_openai_error_json(agent_engine):
    ep = endpoint(agent_engine, max_n=2, max_tokens=32)
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.url, api_key="x", max_retries=0)
    hi = [{"role": "user", "content": "Hi"}]
    try:
        status, body = await asyncio.to_thread(_post, ep.url + "/chat/completions", b"{not json")
        assert status == 400 and body["error"]["code"] == "invalid_json"
        status, body = await asyncio.to_thread(_post, ep.url + "/chat/completions", b"[1]")
        assert status == 400 and "JSON object" in body["error"]["message"]
        with pytest.raises(openai.NotFoundError) as err:
            await client.chat.completions.create(model="gpt-4o", messages=hi)
        assert err.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="policy", messages=hi, n=3)
        assert "openai.max_n" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="policy", messages=hi, max_tokens=33)
        assert "openai.max_tokens" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "9" * 500}], max_tokens=8)
        assert err.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="policy", messages=hi, temperature=-1)
        # NaN and Infinity are JSON to Python's parser: each numeric field refuses them by name
        for route, field, value in [("chat/completions", "temperature", "NaN"),
                                    ("chat/completions", "top_p", "Infinity"),
                                    ("completions", "temperature", "-Infinity")]:
            body_field = ('"messages": [{"role": "user", "content": "Hi"}]'
                          if route == "chat/completions" else '"prompt": "Hi"')
            payload = f'{{"model": "policy", "max_tokens": 4, "{field}": {value}, {body_field}}}'
            payload = payload.encode()
            status, body = await asyncio.to_thread(_post, f"{ep.url}/{route}", payload)
            assert status == 400, (route, field, body)
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["param"] == field and "finite" in body["error"]["message"]
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="policy", prompt=[[10**9]])
        # a client that goes away mid-stream: the endpoint carries on
        host, port = ep.url.removeprefix("http://").removesuffix("/v1").split(":")
        body = json.dumps({"model": "policy", "messages": hi, "stream": True, "max_tokens": 32,
                           "logprobs": True}).encode()

        def hang_up() -> bytes:
            with socket.create_connection((host, int(port)), timeout=BACKSTOP) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\nAuthorization: Bearer gone\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                return sock.recv(64)

        assert (await asyncio.to_thread(hang_up)).startswith(b"HTTP/1.1 200")
        ok = await client.chat.completions.create(model="policy", messages=hi, max_tokens=4)
        assert ok.choices[0].finish_reason in ("stop", "length")
    finally:
        await client.close()
        await ep.close()


async def test_excess_concurrent_calls_get_429(agent_engine):
    # one request at a time, and the one served is held in the engine until the others were
    # turned away
    ep = endpoint(agent_engine, max_concurrency=1)
    held: list[bool] = []

    def hold(module, args, output):
        if not held:
            held.append(wait_for(lambda: ep.rejected == 2, BACKSTOP, "two calls turned away"))

    handle = agent_engine.model.register_forward_hook(hold)
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.url, api_key="x", max_retries=0)
    try:
        results = await asyncio.gather(*(
            client.chat.completions.create(model="policy", max_tokens=2,
                                           messages=[{"role": "user", "content": "Hi"}])
            for _ in range(3)), return_exceptions=True)
    finally:
        handle.remove()
        await client.close()
        await ep.close()
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(refused) == 2 and ep.rejected == 2
    assert "openai.max_concurrency" in refused[0].message


async def test_failing_agents_score_zero_with_the_reason(agent_engine):
    ep = endpoint(agent_engine)
    await ep.start()
    tasks = [Task(id="t", payload={})]
    outcomes = {}
    try:
        for fn, timeout in [("raises", BACKSTOP), ("hangs", 0.3), ("garbage", BACKSTOP),
                            ("fresh_conversations", BACKSTOP)]:
            workflow = create_workflow("agent", agent_engine.tokenizer,
                                       agent_args(f"agent_model:{fn}", timeout=timeout))
            outcomes[fn] = await workflow.run(tasks, ctx(agent_engine, ep, repeat_times=2))
    finally:
        await ep.close()
    [a, _b] = outcomes["raises"]  # the call it made is still an experience, scored 0
    assert a.reward == 0 and a.info["reward_reason"] == "raised RuntimeError: the tool broke"
    assert outcomes["hangs"] == []  # no calls: nothing to train on
    assert outcomes["garbage"] == []
    per_call = outcomes["fresh_conversations"]
    assert len(per_call) == 4 and {e.info["rule"] for e in per_call} == {"per_call"}
    assert {e.info["group_size"] for e in per_call} == {4} and len({e.id for e in per_call}) == 4
    assert {e.reward for e in per_call} == {0.5}


def test_agent_results_and_bad_workflow_args():
    assert score_of(0.5) == (0.5, {"reward": 0.5}, "ok")
    assert score_of({"reward": 1, "turns": 3, "note": "x"}) == (1.0, {"reward": 1.0,
                                                                     "turns": 3.0}, "ok")
    assert score_of(float("nan"))[0] == 0 and "not a reward" in score_of(float("nan"))[2]
    assert score_of({"score": 1})[2].startswith("returned a dict without")
    assert score_of(True)[0] == 0
    with pytest.raises(ValueError, match="workflow_args.fn"):
        create_workflow("agent", None, {"fn": "no_colon"})
    with pytest.raises(ValueError, match="cannot import"):
        create_workflow("agent", None, {"fn": "no_such_module_x:run"})
    with pytest.raises(ValueError, match="async function"):
        create_workflow("agent", None, {"fn": "json:dumps"})
