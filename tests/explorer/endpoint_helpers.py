"""The OpenAI endpoint over an engine, as the endpoint tests build it (test_openai_agent,
test_openai_stream)."""

from __future__ import annotations

from backstop import BACKSTOP
from tandem.common.config.explorer import OpenAIConfig
from tandem.explorer.openai_server import OpenAIEndpoint
from tandem.explorer.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=96)


def endpoint(engine, sampling=GREEDY, **config) -> OpenAIEndpoint:
    return OpenAIEndpoint(OpenAIConfig(**config), engine, sampling=sampling, context=512)


def encode(engine, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)


def agent_args(fn: str, **args) -> dict:
    """`workflow_args` of the `agent` workflow playing `fn`, whose episodes end on their own:
    their wall clock (from the agent's call) and their process's start only bound a hang,
    unless `args` say otherwise."""
    sandbox = {"start_seconds": BACKSTOP, **args.pop("sandbox", {})}
    return {"fn": fn, "timeout": BACKSTOP, **args, "sandbox": sandbox}
