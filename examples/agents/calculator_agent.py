"""Agents written against OpenAI's API, trained by tandem's `agent` workflow (docs/explorer.md).

Nothing here knows about tandem: each function takes a task (the dataset row) and an
`openai.AsyncOpenAI` client, talks to the model, and returns a reward. Run with this folder on
PYTHONPATH and `workflow_args: {fn: "calculator_agent:run"}`.
"""

from __future__ import annotations

import json

from tandem.explorer.environments.calculator import evaluate

MODEL = "policy"  # explorers[].openai.model
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "evaluate an arithmetic expression",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


def _number(text: str | None) -> float | None:
    try:
        return float((text or "").strip())
    except ValueError:
        return None


async def run(task: dict, client) -> dict:
    """Ask the question with the calculator as a tool; answer the tool's calls; score the final
    answer against the task's."""
    messages = [{"role": "user", "content": task["prompt"]}]
    tool_calls = 0
    for _ in range(task.get("max_turns", 3)):
        reply = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=[CALCULATOR],
            max_tokens=task.get("max_tokens", 48))
        message = reply.choices[0].message
        if not message.tool_calls:
            answer = _number(message.content)
            correct = answer is not None and abs(answer - float(task["answer"])) < 1e-6
            return {"reward": 1.0 if correct else 0.0, "tool_calls": float(tool_calls)}
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            tool_calls += 1
            try:
                result = str(evaluate(json.loads(call.function.arguments)["expression"]))
            except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"reward": 0.0, "tool_calls": float(tool_calls)}


async def two_turn(task: dict, client) -> float:
    """Ask, then ask again in the same conversation: a reward for a second answer that is
    shorter than the first (a toy objective the tiny model can move)."""
    messages = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model=MODEL, messages=messages,
                                                 max_tokens=task.get("max_tokens", 16))
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Shorter?"}]
    second = await client.chat.completions.create(model=MODEL, messages=messages,
                                                  max_tokens=task.get("max_tokens", 16))
    a, b = first.choices[0].message.content or "", second.choices[0].message.content or ""
    return 1.0 if len(b) < len(a) else 0.0
