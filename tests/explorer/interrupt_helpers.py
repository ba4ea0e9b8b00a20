"""Loading weights into an interruptible engine mid-generation, at a moment chosen from the
engine's own output (test_vllm_interrupt, test_vllm_lora)."""

from __future__ import annotations

import asyncio


def stream_until_every_sample_has_tokens(engine, prompts, n, params):
    """`n` samples of each prompt, streamed (the groups come back as `generate` returns them),
    and an event set once every sample has streamed its first tokens: the moment a test loads
    weights mid-generation, chosen from the engine's own output rather than a sleep."""
    flat = [p for p in prompts for _ in range(n)]
    seen: set[int] = set()
    sampled = asyncio.Event()

    def on_tokens(index, ids, logprobs, top) -> None:
        if ids:
            seen.add(index)
        if len(seen) == len(flat):
            sampled.set()

    async def groups():
        out = await engine.generate_stream(flat, params, on_tokens)
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    return asyncio.ensure_future(groups()), sampled
