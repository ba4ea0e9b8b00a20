"""The OpenAI endpoint over an engine, as the endpoint tests build it (test_openai_agent,
test_openai_stream)."""

from __future__ import annotations

from tandem.common.config.explorer import OpenAIConfig
from tandem.explorer.openai_server import OpenAIEndpoint
from tandem.explorer.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=96)


def endpoint(engine, sampling=GREEDY, **config) -> OpenAIEndpoint:
    return OpenAIEndpoint(OpenAIConfig(**config), engine, sampling=sampling, context=512)


def encode(engine, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)
