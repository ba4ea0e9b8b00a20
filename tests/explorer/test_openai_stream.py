"""The endpoint's streaming and token-true conversations, driven by the official `openai` client
against the tiny calculator-agent model (tests/agent_model.py): streamed answers leave as tokens
are sampled, carry no special-token text, and a streaming agent's stored experiences are exactly
the model's own token stream; every numeric field refuses NaN and infinities by name."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
from agent_model import QUESTION, SEEN, TOOLS, record_seen
from backstop import BACKSTOP
from endpoint_helpers import GREEDY, agent_args, encode, endpoint

from tandem.common.messages.experience import Task
from tandem.explorer.openai_calls import CallRecord, token_mismatch
from tandem.explorer.openai_stream import AnswerText
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.workflows import RolloutContext, create_workflow

HI = [{"role": "user", "content": "Hi"}]


async def test_streamed_tool_calling_conversations_are_the_models_own_tokens(agent_engine):
    # greedy episodes make the trained tool call; sampled ones write whatever the tiny model
    # samples (text whose re-tokenization is not its tokens), and each is sent back as streamed
    sampled = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    tok = agent_engine.tokenizer
    eos = tok.eos_token_id
    SEEN.clear()
    for sampling, tasks in [
        (GREEDY, [Task(id="g0", payload={"id": "g0", "prompt": QUESTION, "answer": 84,
                                         "max_tokens": 90, "report": True})]),
        (sampled, [Task(id=f"s{i}", payload={"id": f"s{i}", "prompt": QUESTION, "answer": 84,
                                             "max_tokens": 24, "max_turns": 3, "report": True})
                   for i in range(3)])]:
        ep = endpoint(agent_engine, sampling=sampling)
        record_seen(ep.app)  # each episode runs in its own process: it reports its calls here
        await ep.start()
        try:
            workflow = create_workflow("agent", tok,
                                       agent_args("agent_model:streaming_calculator"))
            experiences = await workflow.run(tasks, RolloutContext(
                engine=agent_engine, sampling=sampling, repeat_times=2, explorer="explorer-0",
                run="test", endpoint=ep))
        finally:
            await ep.close()
        assert ep.calls.mismatches == 0
        by_task = {t.id: [e for e in experiences if e.task_id == t.id] for t in tasks}
        for task_id, exps in by_task.items():
            seen = SEEN[task_id]  # the calls of both episodes, as the client streamed them
            assert len(exps) == 2 and sum(e.info["calls"] for e in exps) == len(seen)
            assert all(c["prompt_ids"] and c["ids"] for c in seen)
            for exp in exps:
                assert "token_mismatch" not in exp.info
                assert exp.info["rule"] == "chained", exp.info
                tokens = exp.tokens.tolist()
                mask = [0] * exp.prompt_len + exp.action_mask.tolist()
                # (episodes that sampled alike made the same calls: each counts once)
                mine = list({(tuple(c["prompt_ids"]), tuple(c["ids"])): c for c in seen
                             if tokens[:len(c["prompt_ids"]) + len(c["ids"])]
                             == c["prompt_ids"] + c["ids"]}.values())
                mine.sort(key=lambda c: len(c["prompt_ids"]))
                # every call of the episode is in it: its prompt as the model saw it, then the
                # ids the model streamed, as actions with the logprobs the client was shown
                assert len(mine) == exp.info["calls"]
                assert tokens == mine[-1]["prompt_ids"] + mine[-1]["ids"]
                actions = []
                for c in mine:
                    start = len(c["prompt_ids"])
                    assert mask[start:start + len(c["ids"])] == [1] * len(c["ids"])
                    np.testing.assert_allclose(
                        exp.logprobs[start - exp.prompt_len:start - exp.prompt_len
                                     + len(c["ids"])], c["logprobs"], atol=1e-6)
                    actions += c["ids"]
                    # content is text, never a special token's or a parsed tool call's (a
                    # block cut at max_tokens, never closed, stays text)
                    assert tok.eos_token not in c["content"]
                    assert not c["tool_calls"] or "<tool_call>" not in c["content"]
                assert sum(mask) == len(actions)
                for prev, c in itertools.pairwise(mine):
                    end = len(prev["prompt_ids"]) + len(prev["ids"])
                    if prev["ids"][-1] == eos:  # the model closed its turn: not closed twice
                        assert tokens[end] != eos, tok.decode(tokens[end - 3:end + 3])
    # greedy: both episodes call the tool, then answer with its result
    greedy = sorted({len(c["prompt_ids"]): c for c in SEEN["g0"]}.items())
    assert [c["finish_reason"] for _, c in greedy] == ["tool_calls", "stop"]
    assert greedy[1][1]["content"] == "84"


async def test_streamed_answer_equals_the_whole_one_with_top_logprobs(agent_engine):
    ep = endpoint(agent_engine)
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": QUESTION}]
    try:
        for tools in (TOOLS, None):
            args = {"model": "policy", "messages": messages, "logprobs": True, "top_logprobs": 3,
                    "max_tokens": 90, **({"tools": tools} if tools else {})}
            whole = (await client.chat.completions.create(**args)).choices[0]
            content, calls, entries, finish = "", {}, [], None
            async for chunk in await client.chat.completions.create(stream=True, **args):
                if not chunk.choices:
                    continue
                c = chunk.choices[0]
                content += c.delta.content or ""
                entries += c.logprobs.content if c.logprobs and c.logprobs.content else []
                for tc in c.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "args": ""})
                    slot["name"] += tc.function.name or ""
                    slot["args"] += tc.function.arguments or ""
                finish = c.finish_reason or finish
            assert finish == whole.finish_reason
            assert content == (whole.message.content or "")
            if tools:  # the trained tool call, in OpenAI's streaming form
                [call] = calls.values()
                assert call["id"].startswith("call_") and call["name"] == "calculator"
                assert json.loads(call["args"]) == {"expression": "12*7"}
                assert json.loads(whole.message.tool_calls[0].function.arguments) == \
                    {"expression": "12*7"}
            assert [e.model_dump() for e in entries] == \
                [e.model_dump() for e in whole.logprobs.content]
            for e in entries:  # greedy: the sampled token is the most likely one
                assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
                assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
                values = [a.logprob for a in e.top_logprobs]
                assert values == sorted(values, reverse=True)
        done = await client.completions.create(model="policy", prompt="12*7=", max_tokens=6,
                                               logprobs=2, temperature=0)
        lp = done.choices[0].logprobs
        assert len(lp.top_logprobs) == len(lp.tokens) and all(len(t) <= 2
                                                              for t in lp.top_logprobs)
        text = "".join([c.choices[0].text async for c in await client.completions.create(
            model="policy", prompt="12*7=", max_tokens=6, temperature=0, stream=True)
            if c.choices])
        assert text == done.choices[0].text
    finally:
        await client.close()
        await ep.close()


async def test_chunks_leave_while_the_engine_still_samples(agent_engine):
    # the engine's second forward pass waits until the client holds a chunk of the first token:
    # a stream sent after generation would never get there
    got_chunk = threading.Event()
    passes = []

    def hold(module, args, output):
        passes.append(got_chunk.wait(timeout=BACKSTOP) if len(passes) == 1 else True)

    handle = agent_engine.model.register_forward_hook(hold)
    ep = endpoint(agent_engine)
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.url, api_key="none", max_retries=0)
    try:
        stream = await client.chat.completions.create(model="policy", messages=HI,
                                                      max_tokens=8, stream=True, logprobs=True,
                                                      extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                tokens += len(chunk.choices[0].logprobs.content)
                got_chunk.set()
    finally:
        handle.remove()
        await client.close()
        await ep.close()
    assert tokens == 8
    assert passes[1] is True  # the first token reached the client before the second was sampled


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=BACKSTOP) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


NUMERIC = {
    "chat/completions": ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens",
                         "n", "seed", "presence_penalty", "frequency_penalty",
                         "repetition_penalty", "top_logprobs", "logit_bias.50256", "min_p"],
    "completions": ["temperature", "top_p", "top_k", "max_tokens", "n", "seed",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                    "best_of", "logit_bias.50256", "min_p"],
}


async def test_every_numeric_field_refuses_nan_and_infinity_by_name(agent_engine):
    ep = endpoint(agent_engine)
    await ep.start()
    try:
        for route, fields in NUMERIC.items():
            base = ('"messages": [{"role": "user", "content": "Hi"}], "logprobs": true'
                    if route == "chat/completions" else '"prompt": "Hi"')
            for name in fields:
                for value in ("NaN", "Infinity", "-Infinity"):
                    head, _, key = name.rpartition(".")
                    field = f'"{head}": {{"{key}": {value}}}' if head else f'"{name}": {value}'
                    payload = f'{{"model": "policy", "max_tokens": 4, {base}, {field}}}'
                    if name == "max_tokens":
                        payload = payload.replace('"max_tokens": 4, ', "")
                    status, body = await asyncio.to_thread(_post, f"{ep.url}/{route}",
                                                           payload.encode())
                    assert status == 400, (route, name, value, body)
                    err = body["error"]
                    assert err["type"] == "invalid_request_error" and err["param"] == name, err
                    assert "finite" in err["message"] and name in err["message"], err
        # the wrong type, out of range, or not served: 400 naming the field, the server serves on
        for field, value, words in [("n", "1.5", "integer"), ("top_p", "0", "greater than"),
                                    ("temperature", '"hot"', "number"),
                                    ("presence_penalty", "0.5", "not served"),
                                    ("top_logprobs", "21", "less than"),
                                    ("stream", "1", "boolean")]:
            payload = (f'{{"model": "policy", "messages": [{{"role": "user", "content": "Hi"}}],'
                       f' "logprobs": true, "{field}": {value}}}')
            status, body = await asyncio.to_thread(_post, f"{ep.url}/chat/completions",
                                                   payload.encode())
            assert status == 400 and body["error"]["param"] == field, body
            assert words in body["error"]["message"], body
        status, body = await asyncio.to_thread(
            _post, f"{ep.url}/chat/completions",
            b'{"model": "policy", "max_tokens": 2, "messages": [{"role": "user", '
            b'"content": "Hi"}], "presence_penalty": 0, "temperature": 0}')
        assert status == 200, body
        # a client that sends every field, null where unset, is served with the defaults
        nulls = ", ".join(f'"{f}": null' for f in NUMERIC["chat/completions"] + [
            "stream", "stop", "logprobs", "tools", "ignore_eos", "skip_special_tokens"]
            if "." not in f and f != "max_tokens")
        status, body = await asyncio.to_thread(
            _post, f"{ep.url}/chat/completions",
            ('{"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": '
             f'"Hi"}}], {nulls}}}').encode())
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
    finally:
        await ep.close()


def test_answer_text_releases_only_what_cannot_change(agent_engine):
    tok = agent_engine.tokenizer
    ids = encode(agent_engine, 'ok <tool_call>{"name": "calculator", "arguments": {"expression":'
                 ' "1+1"}}</tool_call> done') + [tok.eos_token_id]
    answer = AnswerText(tok, tools=True)
    shown, calls = "", []
    for t in ids:  # one token at a time, as a stream
        text, new = answer.push([t])
        shown += text
        calls += new
        assert "<" not in shown  # nothing of the block's text, even half of its opening tag
    text, new = answer.finish("eos", None)
    shown += text
    calls += new
    assert shown == "ok  done" and answer.message == ("ok  done", calls)
    assert [c["function"]["name"] for c in calls] == ["calculator"]
    # a block that does not parse stays text; a stop string is never shown, even in part
    answer = AnswerText(tok, tools=True, stops=["STOP"])
    shown = "".join(answer.push([t])[0] for t in encode(agent_engine, "a <tool_call>oops"
                                                                       "</tool_call> bST"))
    assert shown == "a <tool_call>oops</tool_call> b"
    answer.push(encode(agent_engine, "OP"))
    assert answer.finish("stop", "STOP") == ("", [])
    # token by token, the text is the whole answer's, whatever the tokens (a few at a time
    # decoded, half characters held): random ids from the whole vocabulary
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, len(tok), size=40).tolist()
        whole, streamed = AnswerText(tok), AnswerText(tok)
        whole.push(ids)
        whole.finish("length", None)
        for t in ids:
            streamed.push([t])
        streamed.finish("length", None)
        assert "".join(streamed.content) == "".join(whole.content) == tok.decode(
            ids, skip_special_tokens=True)
    keep = AnswerText(tok, skip_special=False)
    keep.push(encode(agent_engine, "84") + [tok.eos_token_id])
    keep.finish("eos", None)
    assert keep.message == (f"84{tok.eos_token}", [])


def test_a_stored_experience_that_is_not_the_engines_is_caught():
    rec = [CallRecord("e", "chat", [1, 2], [3, 4], [-0.5, -0.25], 0, "stop"),
           CallRecord("e", "chat", [1, 2, 3, 4, 9], [5], [-1.0], 0, "stop")]
    good = ([1, 2, 3, 4, 9, 5], 2, [1, 1, 0, 1], [-0.5, -0.25, 0.0, -1.0])
    assert token_mismatch(*good, rec) is None
    tokens, plen, mask, lps = good
    assert "leave the prompt" in token_mismatch([1, 2, 3, 4, 4, 9, 5], plen, mask + [0], lps
                                                + [0.0], rec)
    assert "not the engine's response" in token_mismatch([1, 2, 3, 7, 9, 5], plen, mask, lps,
                                                         rec)
    assert "action mask 0" in token_mismatch(tokens, plen, [1, 0, 0, 1], lps, rec)
    assert "logprobs" in token_mismatch(tokens, plen, mask, [-0.5, -0.2, 0.0, -1.0], rec)
    assert "no call produced" in token_mismatch(tokens, plen, [1, 1, 1, 1], lps, rec)


async def test_special_tokens_text_on_request_still_splices_the_models_ids(agent_engine):
    # skip_special_tokens: false puts the eos's text in content; sent back, the message is
    # still the model's own ids, its turn closed once
    ep = endpoint(agent_engine)
    await ep.start()
    tok = agent_engine.tokenizer
    client = openai.AsyncOpenAI(base_url=ep.url, api_key=ep.calls.open(), max_retries=0)
    extra = {"skip_special_tokens": False, "return_token_ids": True}
    messages = [{"role": "user", "content": QUESTION}]
    try:
        first = (await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=90,
            extra_body=extra)).choices[0]
        [call] = first.message.tool_calls
        messages += [first.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "84"}]
        second = (await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=90,
            extra_body=extra)).choices[0]
        assert second.message.content == "84" + tok.eos_token
        messages += [{"role": "assistant", "content": second.message.content},
                     {"role": "user", "content": "Thanks"}]
        third = (await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=4,
            extra_body=extra)).choices[0]
    finally:
        await client.close()
        await ep.close()
    done = second.model_extra["prompt_token_ids"] + second.model_extra["token_ids"]
    assert done[-1] == tok.eos_token_id
    prompt = third.model_extra["prompt_token_ids"]
    assert prompt[:len(done)] == done and prompt[len(done)] != tok.eos_token_id
