"""`reward_model`: a Hugging Face sequence-classification model scores (prompt, response).

The model (`reward.reward_model.path`) is loaded once, on first use, with
AutoModelForSequenceClassification. Concurrent items are gathered into batches of up to
`batch_size` (waiting at most `linger` seconds for a batch to fill), tokenised as
prompt + response (truncated from the left to `max_length`, so the response end survives),
and the logit `label` is the score (`normalize: sigmoid` maps it into (0, 1)). The forward
pass runs in a thread; a timed-out item scores 0 while its batch finishes.
"""

from __future__ import annotations

import asyncio
import math

import structlog

from tandem.common.messages.reward import Score, ScoreItem

from ..base import AsyncReward, register, result

log = structlog.get_logger(__name__)


@register("reward_model")
class RewardModelReward(AsyncReward):
    """The model's logit for the pair (optionally through a sigmoid)."""

    def __init__(self, config):
        super().__init__(config)
        self.settings = config.reward_model
        self._queue: asyncio.Queue | None = None
        self._batcher: asyncio.Task | None = None
        self.model = self.tokenizer = None
        self.batches = 0

    async def start(self) -> None:
        if self.model is not None:
            return
        if not self.settings.path:
            raise ValueError("reward_model needs reward.reward_model.path, a model folder")
        await asyncio.to_thread(self._load)
        self._queue = asyncio.Queue()
        self._batcher = asyncio.create_task(self._run_batches(), name="reward-model-batcher")

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from tandem.weights.hf import load_tokenizer

        tokenizer = load_tokenizer(self.settings.path)
        tokenizer.truncation_side = "left"
        tokenizer.padding_side = "right"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(
            self.settings.path, dtype=torch.float32, local_files_only=True)
        model = model.to(self.settings.device).eval()
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        if self.settings.label >= model.config.num_labels:
            raise ValueError(f"reward.reward_model.label is {self.settings.label} but the model "
                             f"has {model.config.num_labels} labels")
        self.model, self.tokenizer = model, tokenizer
        log.info("reward_model.loaded", path=self.settings.path, labels=model.config.num_labels)

    async def score(self, item: ScoreItem) -> Score:
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item.prompt + item.response, future))
        return await future

    async def _run_batches(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = asyncio.get_running_loop().time() + self.settings.linger
            while len(batch) < self.settings.batch_size:
                wait = deadline - asyncio.get_running_loop().time()
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), max(wait, 0)))
                except TimeoutError:
                    break
            batch = [(text, fut) for text, fut in batch if not fut.done()]
            if not batch:
                continue
            try:
                logits = await asyncio.to_thread(self._forward, [text for text, _ in batch])
            except Exception as exc:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            for (_, fut), logit in zip(batch, logits):
                if not fut.done():
                    value = logit
                    if self.settings.normalize == "sigmoid":
                        value = 1 / (1 + math.exp(-logit))
                    fut.set_result(result(value, f"logit {logit:.4f}", logit=logit))

    def _forward(self, texts: list[str]) -> list[float]:
        import torch

        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                             max_length=self.settings.max_length)
        with torch.inference_mode():
            out = self.model(**{k: v.to(self.settings.device) for k, v in enc.items()})
        return out.logits[:, self.settings.label].float().tolist()

    async def close(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
            self._batcher = None
        self.model = self.tokenizer = None
