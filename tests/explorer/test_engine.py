"""TransformersEngine: logprob fidelity, finish reasons, batching, weights, and the event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from backstop import BACKSTOP
from tandem.explorer.sampling import SamplingParams, policy_logprobs
from tandem.explorer.transformers_engine import TransformersEngine

PROMPTS = ["1+2=", "What is 7*6? ", "x", "The quick brown fox"]


def teacher_forced(model, completion, params):
    """Log-probs of the completion's tokens from one forward pass over prompt + response."""
    ids = torch.tensor(list(completion.prompt_ids) + list(completion.token_ids))[None]
    with torch.no_grad():
        logits = model(ids).logits[0]
    p = len(completion.prompt_ids)
    return policy_logprobs(logits[p - 1:-1], params).gather(-1, ids[0, p:, None]).squeeze(-1)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=24, seed=1),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=24, seed=2),
    SamplingParams(temperature=1.3, top_k=5, max_tokens=24, seed=3),
    SamplingParams(temperature=0.0, max_tokens=12),
], ids=["t1", "t0.7-p0.9-k20", "t1.3-k5", "greedy"])
def test_logprobs_match_a_teacher_forced_pass(engine, params):
    # Left padding, a shared prefill per prompt, and rows dropped from the KV cache as they
    # finish must not change a single logprob beyond fp32 noise.
    results = engine.generate_sync(PROMPTS, 3, params)
    worst = 0.0
    for group in results:
        for c in group:
            assert len(c.token_ids) == len(c.logprobs)
            assert len(c) == params.max_tokens or c.finish_reason != "length"
            expected = teacher_forced(engine.model, c, params)
            worst = max(worst, (expected - torch.from_numpy(c.logprobs)).abs().max().item())
            assert torch.isfinite(torch.from_numpy(c.logprobs)).all()
    assert worst < 1e-4


def test_top_k_one_is_greedy_with_logprob_zero(engine):
    [[c]] = engine.generate_sync(["1+2="], 1,
                                 SamplingParams(temperature=1.0, top_k=1, max_tokens=8))
    [[g]] = engine.generate_sync(["1+2="], 1, SamplingParams(temperature=0.0, max_tokens=8))
    assert list(c.token_ids) == list(g.token_ids)
    assert abs(c.logprobs).max() == 0.0


def test_seed_reproduces_and_calls_differ(engine):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7)
    a = engine.generate_sync(PROMPTS, 2, params)
    b = engine.generate_sync(PROMPTS, 2, params)
    assert [list(c.token_ids) for g in a for c in g] == [list(c.token_ids) for g in b for c in g]
    unseeded = SamplingParams(temperature=1.0, max_tokens=16)
    c1 = engine.generate_sync(PROMPTS, 2, unseeded)
    c2 = engine.generate_sync(PROMPTS, 2, unseeded)
    assert [list(c.token_ids) for g in c1 for c in g] != [list(c.token_ids) for g in c2 for c in g]


def test_stop_string_ends_a_response_and_is_kept(engine):
    [[greedy]] = engine.generate_sync(["1+2="], 1, SamplingParams(temperature=0.0, max_tokens=12))
    text = greedy.text
    stop = text[2:4]  # a string the greedy response is known to produce
    [[c]] = engine.generate_sync(["1+2="], 1,
                                 SamplingParams(temperature=0.0, max_tokens=12, stop=(stop, "@@@")))
    assert c.finish_reason == "stop" and c.stop == stop
    assert c.text.endswith(stop) and text.startswith(c.text)
    assert text.index(stop) + len(stop) == len(c.text)


def test_eos_ends_a_response_and_length_caps_it(engine):
    [[greedy]] = engine.generate_sync(["1+2="], 1, SamplingParams(temperature=0.0, max_tokens=6))
    assert greedy.finish_reason == "length" and len(greedy) == 6
    engine.eos_ids = {int(greedy.token_ids[2])}
    [[c]] = engine.generate_sync(["1+2="], 1, SamplingParams(temperature=0.0, max_tokens=6))
    first = list(greedy.token_ids).index(int(greedy.token_ids[2]))
    assert c.finish_reason == "eos" and list(c.token_ids) == list(greedy.token_ids[:first + 1])


def test_batches_larger_than_max_batch_are_chunked_with_the_same_results(tiny_model_path):
    params = SamplingParams(temperature=0.0, max_tokens=10)
    small = TransformersEngine.from_pretrained(tiny_model_path, max_batch=3)
    large = TransformersEngine.from_pretrained(tiny_model_path, max_batch=64)
    try:
        a = small.generate_sync(PROMPTS, 2, params)
        b = large.generate_sync(PROMPTS, 2, params)
        assert ([list(c.token_ids) for g in a for c in g]
                == [list(c.token_ids) for g in b for c in g])
        assert {c.timings["batch"] for g in a for c in g} == {3.0, 2.0}
    finally:
        small.close()
        large.close()


def test_token_id_prompts_equal_text_prompts(engine):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    ids = engine.tokenizer("1+2=").input_ids
    [[a]] = engine.generate_sync(["1+2="], 1, params)
    [[b]] = engine.generate_sync([ids], 1, params)
    assert list(a.token_ids) == list(b.token_ids) and list(a.prompt_ids) == ids


def test_load_weights_changes_outputs_and_version(engine, tiny_model_path):
    params = SamplingParams(temperature=0.0, max_tokens=10)
    [[before]] = engine.generate_sync(["1+2="], 1, params)
    other = TransformersEngine.from_pretrained(tiny_model_path)
    torch.manual_seed(123)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    [[expected]] = other.generate_sync(["1+2="], 1, params)
    loaded = engine.load_weights(other.model.state_dict().items(), version=3)
    [[after]] = engine.generate_sync(["1+2="], 1, params)
    other.close()
    assert engine.version == 3 and loaded == len(other.model.state_dict())
    assert list(after.token_ids) == list(expected.token_ids) != list(before.token_ids)


def test_load_weights_rejects_foreign_and_incomplete_weights(engine):
    state = engine.model.state_dict()
    with pytest.raises(ValueError, match="not a parameter"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))], version=1)
    name, tensor = next(iter(state.items()))
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([(name, torch.zeros(tensor.shape[0] + 1))], version=1)
    with pytest.raises(ValueError, match="were not sent"):
        engine.load_weights([(name, tensor)], version=1)
    assert engine.version == 0


def test_generate_runs_off_the_event_loop(engine):
    # The first forward pass waits until the event loop has run a callback it scheduled: had
    # generation run on the loop, the loop would be held and the wait in vain.
    turned = threading.Event()
    waited: list[bool] = []

    async def main():
        loop = asyncio.get_running_loop()

        def wait_for_the_loop(module, args, output):
            if not waited:
                loop.call_soon_threadsafe(turned.set)
                waited.append(turned.wait(BACKSTOP))

        handle = engine.model.register_forward_hook(wait_for_the_loop)
        try:
            return await engine.generate(PROMPTS, 2, SamplingParams(max_tokens=8, seed=0))
        finally:
            handle.remove()

    groups = asyncio.run(main())
    assert waited == [True] and len(groups) == len(PROMPTS)
