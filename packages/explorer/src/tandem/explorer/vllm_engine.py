"""`VLLMEngine`: rollouts on vLLM, coded against its documented offline API.

`vllm.LLM` with `SamplingParams(n, temperature, top_p, top_k, max_tokens, stop, logprobs=0)`
returns each sampled token's log-probability; `logprobs_mode="processed_logprobs"` makes that
the probability *after* temperature and top-k/top-p, which is tandem's definition (see
`tandem.explorer.sampling`), so the trainer's importance ratios start at 1.

New weights never pass through this process: vLLM's own workers fetch them through tandem's
worker extension (`tandem.explorer.vllm_worker`), called with `LLM.collective_rpc`: from the
run dir for checkpoint syncs, or by joining the trainer's broadcast group. vLLM cannot run on
the development machine (no GPU); `tests/explorer/test_vllm_engine.py` checks this module
against a stand-in for the `vllm` package and runs the real thing where vLLM and CUDA exist.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .engine import Completion, Prompt, WorkerFetchEngine
from .sampling import SamplingParams


class VLLMEngine(WorkerFetchEngine):
    """An engine over `vllm.LLM` whose workers fetch weights; generation and weight loads run
    one at a time."""

    def __init__(self, llm: Any, *, workers: int = 1):
        self.llm = llm
        self.workers = workers
        self.version = 0
        self._lock = threading.Lock()  # one generate or weight load at a time

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "bfloat16", seed: int = 0,
                        **options: Any) -> "VLLMEngine":
        """Load a Hugging Face folder from disk; `options` go to `vllm.LLM` as they are
        (tensor_parallel_size, gpu_memory_utilization, max_model_len, enforce_eager...)."""
        try:
            import vllm
        except ImportError:
            raise RuntimeError("engine.kind: vllm needs vLLM installed (pip install vllm) and a "
                               "GPU; use engine.kind: transformers otherwise") from None
        from .vllm_worker import vllm_engine_kwargs

        llm = vllm.LLM(model=str(path), tokenizer=str(path), dtype=dtype, seed=seed,
                       logprobs_mode="processed_logprobs", **vllm_engine_kwargs(), **options)
        return cls(llm, workers=int(options.get("tensor_parallel_size", 1)))

    @property
    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    async def generate(self, prompts: Sequence[Prompt], n: int,
                       sampling: SamplingParams) -> list[list[Completion]]:
        return await asyncio.to_thread(self._generate, list(prompts), n, sampling)

    def _generate(self, prompts: list[Prompt], n: int,
                  sampling: SamplingParams) -> list[list[Completion]]:
        import vllm

        params = vllm.SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None, include_stop_str_in_output=True,
            ignore_eos=sampling.ignore_eos, logprobs=0, seed=sampling.seed)
        inputs = [p if isinstance(p, str) else {"prompt_token_ids": [int(t) for t in p]}
                  for p in prompts]
        start = time.perf_counter()
        with self._lock:
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return [[self._completion(out, sample, seconds) for sample in out.outputs]
                for out in outputs]

    def _completion(self, out: Any, sample: Any, seconds: float) -> Completion:
        tokens = np.asarray(sample.token_ids, dtype=np.int32)
        if sample.logprobs is None or len(sample.logprobs) != len(tokens):
            raise RuntimeError("vLLM returned no logprob for some sampled tokens; "
                               "SamplingParams(logprobs=0) must be honoured")
        logprobs = np.asarray([step[int(t)].logprob for step, t in zip(sample.logprobs, tokens)],
                              dtype=np.float32)
        if sample.finish_reason == "length":
            reason, stop = "length", None
        elif isinstance(sample.stop_reason, str):
            reason, stop = "stop", sample.stop_reason
        else:
            reason, stop = "eos", None  # an eos (or stop) token ended it
        return Completion(prompt_ids=np.asarray(out.prompt_token_ids, dtype=np.int32),
                          token_ids=tokens, logprobs=logprobs, text=sample.text,
                          finish_reason=reason, stop=stop,
                          timings={"generate_s": seconds})

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        with self._lock:
            return self.llm.collective_rpc(method, args=args)

    async def fetch_checkpoint(self, run_dir: str | Path, version: int) -> int:
        counts = await asyncio.to_thread(self._rpc, "tandem_load_checkpoint", str(run_dir),
                                         version)
        self.version = version
        return int(counts[0])

    async def join_group(self, rendezvous: dict[str, Any], explorer: str, timeout: float) -> None:
        await asyncio.to_thread(self._rpc, "tandem_join", rendezvous, explorer, timeout)

    async def fetch_broadcast(self, version: int) -> int:
        counts = await asyncio.to_thread(self._rpc, "tandem_receive", version)
        self.version = version
        return int(counts[0])

    def close(self) -> None:
        try:
            self._rpc("tandem_leave")
        except Exception:  # the engine may already be gone; closing must not fail
            pass
