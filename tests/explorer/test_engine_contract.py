"""The engine contract: the same tests against every engine kind, on the same tiny model.

`TransformersEngine` runs in `make test`. `VLLMEngine` (marked `vllm`) runs against real vLLM in
`make test-vllm` and skips where vLLM is not installed. One engine per kind is started for the
whole module (vLLM takes a minute or two to start on CPU), so the weight test puts the original
weights back before it ends.
"""

from __future__ import annotations

import pytest
import torch

from backstop import BACKSTOP
from tandem.explorer.sampling import SamplingParams, policy_logprobs
from tandem.explorer.weights import WeightLoader
from tandem.weights import WeightPublisher

PROMPTS = ["1+2=", "What is 7*6? ", "The quick brown fox"]
# Over two of vLLM's 32-token blocks: its prefix cache keeps this prompt's KV between calls.
LONG_PROMPT = "Once upon a time, in a land far away, there lived a tiny model that learnt to add."

# Worst |engine - teacher-forced| logprob per engine kind, in float32 on CPU: the transformers
# engine runs the trainer's own forward; vLLM's kernels differ in summation order.
TOLERANCE = {"transformers": 1e-4, "vllm": 2e-3}


@pytest.fixture(scope="module")
def contract_model(tmp_path_factory):
    """A tiny Qwen2 both engines can run (vLLM's CPU attention needs head_dim >= 32)."""
    from tandem.weights.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("contract-model")
    model, _ = build_tiny_model(path, hidden=128, heads=2, kv_heads=1)
    return path, model.eval()


@pytest.fixture(scope="module", params=[
    "transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request, contract_model):
    path, _ = contract_model
    if request.param == "vllm":
        pytest.importorskip("vllm")
        from tandem.explorer.vllm_engine import VLLMEngine

        # enforce_eager: no graph capture; a small KV cache (the CPU backend otherwise reserves
        # 90% of memory); 32-token blocks so that LONG_PROMPT is prefix-cached.
        eng = VLLMEngine.from_pretrained(path, dtype="float32", max_model_len=128,
                                         enforce_eager=True, kv_cache_memory_bytes=128 << 20,
                                         block_size=32, max_batch=16)
    else:
        from tandem.explorer.transformers_engine import TransformersEngine

        eng = TransformersEngine.from_pretrained(path, max_batch=16)
    eng.kind = request.param
    yield eng
    eng.close()


def teacher_forced(model, completion, params):
    """The trainer's view: logprobs of the sampled tokens from one forward over prompt+response,
    under the same sampling policy."""
    ids = torch.tensor(list(completion.prompt_ids) + list(completion.token_ids))[None]
    with torch.no_grad():
        logits = model(ids).logits[0]
    p = len(completion.prompt_ids)
    return policy_logprobs(logits[p - 1:-1], params).gather(-1, ids[0, p:, None]).squeeze(-1)


def worst_gap(model, groups, params) -> float:
    worst = 0.0
    for group in groups:
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) > 0
            expected = teacher_forced(model, c, params)
            worst = max(worst, (expected - torch.from_numpy(c.logprobs)).abs().max().item())
    return worst


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=16, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=16, seed=2),
    SamplingParams(temperature=0.0, max_tokens=12),
], ids=["t1", "t0.7-p0.9-k20", "greedy"])
async def test_logprobs_are_the_trainers_at_the_sampling_temperature(engine, contract_model,
                                                                     params):
    _, model = contract_model
    groups = await engine.generate(PROMPTS, 2, params)
    assert worst_gap(model, groups, params) < TOLERANCE[engine.kind]


async def test_n_samples_per_prompt_in_order_and_seeds_reproduce(engine):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=11)
    a = await engine.generate(PROMPTS + [PROMPTS[0]], 3, params)
    assert [len(g) for g in a] == [3, 3, 3, 3]
    tokenizer = engine.tokenizer
    for prompt, group in zip(PROMPTS, a):
        assert all(c.prompt_ids.tolist() == tokenizer(prompt).input_ids for c in group)
    samples = [tuple(c.token_ids.tolist()) for g in a for c in g]
    assert len(set(samples)) == len(samples)  # the n samples of a prompt, and equal prompts, differ
    b = await engine.generate(PROMPTS + [PROMPTS[0]], 3, params)
    assert [tuple(c.token_ids.tolist()) for g in b for c in g] == samples
    unseeded = SamplingParams(temperature=1.0, max_tokens=10)
    c1 = await engine.generate(PROMPTS, 2, unseeded)
    c2 = await engine.generate(PROMPTS, 2, unseeded)
    assert [c.token_ids.tolist() for g in c1 for c in g] != [c.token_ids.tolist() for g in c2
                                                             for c in g]


async def test_finish_reasons_and_stop_strings(engine):
    [[free]] = await engine.generate(["1+2="], 1, SamplingParams(temperature=0.0, max_tokens=10,
                                                                 ignore_eos=True))
    assert free.finish_reason == "length" and len(free) == 10
    stop = free.text[3:5]  # a string the greedy response is known to produce
    [[c]] = await engine.generate(["1+2="], 1, SamplingParams(
        temperature=0.0, max_tokens=10, stop=(stop, "@@@"), ignore_eos=True))
    assert (c.finish_reason, c.stop) == ("stop", stop)
    # the stop string is kept, and the response is the greedy one cut right after it
    assert c.text.endswith(stop) and free.text.startswith(c.text)
    assert free.text.index(stop) + len(stop) == len(c.text)
    assert c.token_ids.tolist() == free.token_ids[:len(c)].tolist()


@pytest.mark.parametrize("transport", ["shared_fs", "shared_memory"])
async def test_a_weight_load_sets_version_and_the_next_call_samples_the_new_weights(
        engine, contract_model, tmp_path, transport):
    from tandem.common.config.registered import engine_capabilities
    from tandem.weights import SharedMemoryPublisher

    if transport not in ("shared_fs", *engine_capabilities(engine.kind).weights):
        pytest.skip(f"{engine.kind} does not declare the {transport} weight path")
    _, model = contract_model
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    changed = {n: p + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
               for i, (n, p) in enumerate(original.items())}
    in_memory = transport == "shared_memory"
    publisher = (SharedMemoryPublisher if in_memory else WeightPublisher)(tmp_path)
    publisher.publish(1, changed.items())
    publisher.publish(2, original.items())
    loader = WeightLoader(engine, run_dir=tmp_path, explorer="explorer-0", timeout=BACKSTOP,
                          shared_memory=in_memory)
    try:
        before = await engine.generate([LONG_PROMPT], 1, greedy)  # caches LONG_PROMPT's prefix
        assert worst_gap(model, before, greedy) < TOLERANCE[engine.kind]
        stats = await loader.load(1, "checkpoint")
        assert engine.version == 1 and stats["tensors"] == len(changed)
        after = await engine.generate([LONG_PROMPT], 1, greedy)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(changed[name])
        try:
            # the prompt's cached KV was computed under the old weights: a stale cache shows here
            assert worst_gap(model, after, greedy) < TOLERANCE[engine.kind]
            assert abs(after[0][0].logprobs - before[0][0].logprobs).max() > 1e-3
        finally:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(original[name])
    finally:
        await loader.load(2, "checkpoint")
        await loader.close()
        publisher.close()
        if in_memory:
            # the publisher started this process's resource tracker (a trainer's ends with it)
            from multiprocessing import resource_tracker

            resource_tracker._resource_tracker._stop()
    assert engine.version == 2
    again = await engine.generate([LONG_PROMPT], 1, greedy)
    assert again[0][0].token_ids.tolist() == before[0][0].token_ids.tolist()


async def test_generate_stream_hands_over_tokens_as_sampled_with_top_logprobs(engine,
                                                                              contract_model):
    # the OpenAI endpoint's streaming: every token reaches the sink, in order, on the caller's
    # loop, in more than one batch (not once at the end), and equals the completion's; the top
    # alternatives are the policy's most likely tokens, the sampled one first when greedy
    _, model = contract_model
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, top_logprobs=3)
    got: dict[int, list] = {0: [], 1: []}
    calls = []

    def sink(row, ids, logprobs, top):
        calls.append(row)
        got[row] += list(zip(ids, logprobs, top))

    out = await engine.generate_stream(PROMPTS[:2], params, sink)
    assert len(out) == 2 and len(calls) > 2
    for row, c in enumerate(out):
        assert [t for t, _, _ in got[row]] == c.token_ids.tolist()
        assert [lp for _, lp, _ in got[row]] == pytest.approx(c.logprobs.tolist(), abs=1e-6)
        assert [top for _, _, top in got[row]] == c.top_logprobs
        expected = torch.topk(policy_logprobs(_step_logits(model, c), params), 3, dim=-1)
        for k, top in enumerate(c.top_logprobs):
            assert top[0][0] == c.token_ids[k]
            assert [t for t, _ in top] == expected.indices[k].tolist()
            assert [lp for _, lp in top] == pytest.approx(expected.values[k].tolist(),
                                                          abs=TOLERANCE[engine.kind])


def _step_logits(model, completion):
    ids = torch.tensor(list(completion.prompt_ids) + list(completion.token_ids))[None]
    with torch.no_grad():
        logits = model(ids).logits[0]
    return logits[len(completion.prompt_ids) - 1:-1]
