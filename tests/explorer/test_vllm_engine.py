"""VLLMEngine against a stand-in for the `vllm` package (vLLM needs a GPU, absent here), and
against real vLLM where it and CUDA exist.

The stand-in (`StandInLLM`) answers `generate` and `collective_rpc` the way vLLM's documented
offline API does: RequestOutput-like objects with per-token logprob dicts, and one result per
worker. It checks what tandem asks of vLLM and what tandem makes of the answers.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from tandem.common.messages.weights import GroupRendezvous
from tandem.explorer.sampling import SamplingParams
from tandem.explorer.vllm_engine import VLLMEngine
from tandem.explorer.weights import WeightLoader


class StandInLLM:
    """Stand-in for `vllm.LLM` (not vLLM): records calls, returns vLLM-shaped outputs."""

    def __init__(self):
        self.calls: list[tuple] = []

    def generate(self, inputs, params, use_tqdm=False):
        self.calls.append(("generate", inputs, params))
        out = []
        for i, _ in enumerate(inputs):
            samples = []
            for k in range(params.n):
                ids = [10 + k, 11, 12][: 2 + k]
                logprobs = [{t: SimpleNamespace(logprob=-0.5 * (j + 1)), 99: SimpleNamespace(
                    logprob=-9.0)} for j, t in enumerate(ids)]
                finish, stop = [("stop", None), ("stop", "##"), ("length", None)][k % 3]
                samples.append(SimpleNamespace(token_ids=ids, logprobs=logprobs, text=f"t{k}",
                                               finish_reason=finish, stop_reason=stop))
            out.append(SimpleNamespace(prompt_token_ids=[1, 2, i], outputs=samples))
        return out

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method, args))
        return [7]  # one worker, 7 tensors

    def get_tokenizer(self):
        return "tokenizer"


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """`import vllm` gives a module with the real SamplingParams' signature recorded."""
    module = types.ModuleType("vllm")
    module.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


async def test_generate_maps_vllm_outputs_to_completions(stand_in_vllm):
    llm = StandInLLM()
    engine = VLLMEngine(llm)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=5, stop=("##",),
                              seed=3)
    got = await engine.generate(["abc", [4, 5]], 3, sampling)
    _, inputs, params = llm.calls[0]
    assert inputs == ["abc", {"prompt_token_ids": [4, 5]}]
    assert (params.n, params.temperature, params.top_p, params.top_k, params.max_tokens,
            params.stop, params.logprobs, params.seed, params.include_stop_str_in_output) == (
        3, 0.7, 0.9, -1, 5, ["##"], 0, 3, True)
    assert [len(g) for g in got] == [3, 3]
    first, second, third = got[1]
    assert first.token_ids.dtype == np.int32 and first.token_ids.tolist() == [10, 11]
    # the sampled token's logprob is picked from each step's dict, not the other entries
    assert first.logprobs.tolist() == [-0.5, -1.0] and first.logprobs.dtype == np.float32
    assert first.prompt_ids.tolist() == [1, 2, 1]
    assert [c.finish_reason for c in got[1]] == ["eos", "stop", "length"]
    assert second.stop == "##" and third.stop is None
    assert engine.tokenizer == "tokenizer"


async def test_missing_logprobs_are_an_error(stand_in_vllm):
    llm = StandInLLM()
    original = llm.generate

    def without_logprobs(inputs, params, use_tqdm=False):
        out = original(inputs, params)
        out[0].outputs[0].logprobs = None
        return out

    llm.generate = without_logprobs
    with pytest.raises(RuntimeError, match="logprobs=0"):
        await VLLMEngine(llm).generate(["x"], 1, SamplingParams())


async def test_weight_loader_lets_vllm_workers_fetch_weights(tmp_path):
    llm = StandInLLM()
    engine = VLLMEngine(llm)
    loader = WeightLoader(engine, run_dir=tmp_path, explorer="explorer-0", timeout=5.0)
    stats = await loader.load(3, "checkpoint")
    assert stats["tensors"] == 7 and engine.version == 3
    assert llm.calls[-1] == ("rpc", "tandem_load_checkpoint", (str(tmp_path), 3))
    rendezvous = GroupRendezvous(session="s1", epoch=1, members=["explorer-0/w0"],
                                 host="127.0.0.1", port=1)
    stats = await loader.load(4, "nccl", rendezvous)
    assert stats["tensors"] == 7 and engine.version == 4
    assert [c[1] for c in llm.calls[-2:]] == ["tandem_join", "tandem_receive"]
    # a plain map crosses into vLLM's worker processes
    assert llm.calls[-2][2] == (rendezvous.model_dump(), "explorer-0", 5.0)
    await loader.load(5, "nccl", rendezvous)  # same group: no second join
    assert [c[1] for c in llm.calls[-2:]] == ["tandem_receive", "tandem_receive"]
    await loader.close()
    engine.close()
    assert llm.calls[-1][1] == "tandem_leave"


@pytest.mark.vllm
@pytest.mark.gpu
async def test_real_vllm_generates_with_logprobs(tiny_model_path):
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA device")
    engine = VLLMEngine.from_pretrained(tiny_model_path, dtype="float32",
                                        gpu_memory_utilization=0.2, enforce_eager=True)
    try:
        got = await engine.generate(["12+3="], 2, SamplingParams(max_tokens=4, seed=0))
        assert len(got[0]) == 2 and all(len(c.logprobs) == len(c.token_ids) for c in got[0])
        assert all(np.all(c.logprobs <= 0) for c in got[0])
    finally:
        engine.close()
