"""The OpenAI endpoint's batching: concurrent requests that sample the same way share one engine
call (`openai.batch_window`), as a workflow's rollouts do; a streamed request's tokens are handed
to it as the engine samples them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from .engine import Completion, Engine, TokenSink
from .openai_requests import APIError
from .sampling import SamplingParams


@dataclass
class _Pending:
    prompt: list[int]
    n: int
    future: asyncio.Future
    # streaming: `sink(k, ids, logprobs, top)` with sample k's tokens as they are sampled
    sink: TokenSink | None = None


class EngineBatcher:
    """Collects concurrent requests that sample the same way into one `engine.generate` call."""

    def __init__(self, engine: Engine, window: float):
        self.engine = engine
        self.window = window
        self.max_rows = int(getattr(engine, "max_batch", 0) or 256)
        self._queues: dict[SamplingParams, list[_Pending]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def generate(self, prompt: list[int], n: int, sampling: SamplingParams,
                       sink: TokenSink | None = None) -> list[Completion]:
        """`n` completions of `prompt`; `sink` streams their tokens as they are sampled."""
        future = asyncio.get_running_loop().create_future()
        self._queues.setdefault(sampling, []).append(_Pending(prompt, n, future, sink))
        self._wake.set()
        return await future

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            if self.window:
                # a burst of requests trickles in: wait while more keep arriving (up to 8
                # windows, or a full batch), so one burst is one engine call
                seen = -1
                for _ in range(8):
                    count = sum(len(q) for q in self._queues.values())
                    if count == seen or count >= self.max_rows:
                        break
                    seen = count
                    await asyncio.sleep(self.window)
            self._wake.clear()
            for sampling in list(self._queues):
                pending = [p for p in self._queues.pop(sampling) if not p.future.done()]
                # at most one engine batch per call: the rest waits its turn in the queue, and
                # requests keep being parsed while the engine samples
                take, rows = [], 0
                while pending and (not take or rows + pending[0].n <= self.max_rows):
                    rows += pending[0].n
                    take.append(pending.pop(0))
                if pending:
                    self._queues[sampling] = pending + self._queues.get(sampling, [])
                    self._wake.set()
                if take:
                    await self._run(sampling, take)

    async def _run(self, sampling: SamplingParams, pending: list[_Pending]) -> None:
        # each of a request's n samples is its own row: one call serves mixed n
        rows = [p.prompt for p in pending for _ in range(p.n)]
        owners = [(p, k) for p in pending for k in range(p.n)]

        def on_tokens(row: int, ids: list[int], logprobs: list[float], top: Any) -> None:
            p, k = owners[row]
            if p.sink is not None and not p.future.done():
                p.sink(k, ids, logprobs, top)

        try:
            if any(p.sink is not None for p in pending):
                flat = await self.engine.generate_stream(rows, sampling, on_tokens)
            else:
                flat = [choices[0] for choices in await self.engine.generate(rows, 1, sampling)]
        except Exception as exc:
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        self.batches += 1
        start = 0
        for p in pending:
            if not p.future.done():
                p.future.set_result(flat[start:start + p.n])
            start += p.n

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for pending in self._queues.values():
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(APIError(503, "the endpoint is shutting down",
                                                    type="server_error", code="shutting_down"))
