"""A tiny model for the agent tests: the tiny Qwen2 with a chat template that writes tools and
tool calls (Hermes-style `<tool_call>` blocks), trained for a few seconds to call the
calculator on one question and to answer with the tool's result.

Trained, not faked: the tool call the tests see is one the model samples, parsed by the
endpoint as it would parse any model's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from backstop import BACKSTOP

CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>\ntools:"
    "{%- for t in tools %} {{ t.function.name }}{%- endfor %}</s>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "</tool_call>{%- endfor %}</s>\n"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}")

QUESTION = "What is 12*7?"
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def conversation(tokenizer) -> str:
    """The episode the model is trained on: question, tool call, tool result, answer."""
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": TOOL_CALL},
                {"role": "tool", "content": "84"},
                {"role": "assistant", "content": "84"}]
    return tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)


def build_agent_model(source: Path, path: Path, steps: int = 120) -> Path:
    """Copy the tiny model at `source` to `path`, give it the chat template and teach it the
    calculator conversation (greedy decoding then reproduces it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.weights.hf import load_tokenizer

    shutil.copytree(source, path)
    tokenizer = load_tokenizer(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    ids = torch.tensor([tokenizer(conversation(tokenizer), add_special_tokens=False).input_ids])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(str(path))
    return path


# -- agents that misbehave, for the workflow's failure tests ------------------------------------

async def raises(task: dict, client) -> float:
    await client.chat.completions.create(model="policy", max_tokens=4,
                                         messages=[{"role": "user", "content": "Hi"}])
    raise RuntimeError("the tool broke")


async def hangs(task: dict, client) -> float:
    import asyncio

    await asyncio.sleep(60)
    return 1.0


async def garbage(task: dict, client) -> object:
    return "very good"


async def fresh_conversations(task: dict, client) -> float:
    """Two unrelated calls (the second does not extend the first): one experience per call."""
    for question in ("Hi", "What?"):
        await client.chat.completions.create(model="policy", max_tokens=4,
                                             messages=[{"role": "user", "content": question}])
    return 0.5


def train_through_up(run_dir: Path, model_dir: Path, *, name: str, steps: int, taskset: dict,
                     explorer: dict, buffer: dict | None = None) -> tuple[object, list[dict]]:
    """A short synchronous `tandem up` run of one endpoint-driven explorer (`explorer`: its
    workflow, workflow_args and sampling; `buffer`: the buffer section) on the agent model;
    asserts every step trained and every rollout put experiences, and returns the config and
    the rollout spans."""
    from tandem.common.config import RunConfig
    from tandem.common.trace import read_trace
    from tandem.master.up import run_up

    config = RunConfig.model_validate({
        "name": name, "run_dir": str(run_dir),
        "model": {"path": str(model_dir)},  # the session's: the run only reads it
        "sync": {"preset": "synchronous", "timeout": BACKSTOP},
        "master": {"total_steps": steps, "taskset": taskset},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "engine": {"options": {"threads": 1}}, **explorer}],
        "trainer": {"groups_per_step": 2, "lr": 1e-3},
        "transport": {"liveness": BACKSTOP},
        "logging": {"level": "warning", "metrics": {"enabled": False}},
        "up": {"run_timeout": BACKSTOP, "timeline": False},
        **({"buffer": buffer} if buffer else {}),
    })
    assert run_up(config, live=False) == 0
    spans = read_trace(config.run_dir)
    assert sorted(s["step"] for s in spans if s["kind"] == "train") == list(range(steps))
    rollouts = [s for s in spans if s["kind"] == "rollout"]
    assert rollouts and all((s.get("attrs") or {}).get("experiences", 0) > 0 for s in rollouts)
    return config, rollouts


# -- a streaming agent, for the token-true tests ------------------------------------------------

SEEN: dict[str, list[dict]] = {}  # task id -> each call as the client saw it (the stream)


def record_seen(app) -> None:
    """Add the route a `streaming_calculator` episode with `report: true` in its task posts
    each of its calls to (the episode runs in its own process), filling `SEEN`."""
    from starlette.responses import JSONResponse

    async def seen(request):
        body = await request.json()
        SEEN.setdefault(body["task"], []).append(body["call"])
        return JSONResponse({})

    app.router.add_route("/v1/seen", seen, methods=["POST"])


async def streaming_calculator(task: dict, client) -> float:
    """The calculator agent over `stream=True, logprobs=True`: each reply is assembled from its
    chunks (content, tool call deltas, the token ids and logprobs each chunk carried) and sent
    back as the next request's assistant message, as streaming agents do. With `report` in the
    task, every call is posted to the endpoint's test route (`record_seen`)."""
    import json

    import httpx

    from tandem.explorer.environments.calculator import evaluate

    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(task.get("max_turns", 3)):
        stream = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, stream=True, logprobs=True,
            max_tokens=task.get("max_tokens", 48), extra_body={"return_token_ids": True})
        call = {"prompt_ids": None, "ids": [], "logprobs": [], "content": "", "tool_calls": {},
                "finish_reason": None}
        async for chunk in stream:
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            extra = choice.model_extra or {}
            if extra.get("prompt_token_ids") is not None:
                call["prompt_ids"] = list(extra["prompt_token_ids"])
            call["ids"] += list(extra.get("token_ids") or [])
            if choice.logprobs is not None and choice.logprobs.content:
                call["logprobs"] += [e.logprob for e in choice.logprobs.content]
            delta = choice.delta
            call["content"] += delta.content or ""
            for tc in delta.tool_calls or []:
                slot = call["tool_calls"].setdefault(tc.index, {"id": None, "name": "",
                                                                "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            call["finish_reason"] = choice.finish_reason or call["finish_reason"]
        if task.get("report"):
            await client.post("/seen", cast_to=httpx.Response,
                              body={"task": task["id"], "call": call})
        calls = [call["tool_calls"][k] for k in sorted(call["tool_calls"])]
        message = {"role": "assistant", "content": call["content"]}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"],
                                                   "arguments": c["arguments"]}} for c in calls]
        messages.append(message)
        if not calls:
            return 1.0 if call["content"].strip() == str(task.get("answer")) else 0.0
        for c in calls:
            try:
                result = str(evaluate(json.loads(c["arguments"])["expression"]))
            except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
    return 0.0
