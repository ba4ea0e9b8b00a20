"""Streaming and interruptible rollouts with the tiny model: groups stored while others still
generate, and weights switched at a token boundary with every token's version recorded."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from backstop import BACKSTOP
from processes import wait_for
from tandem.buffer import SqliteStore
from tandem.common.messages.experience import Task
from tandem.common.messages.reward import Score
from tandem.explorer.sampling import SamplingParams, policy_logprobs
from tandem.explorer.transformers_engine import TransformersEngine
from tandem.explorer.workflows import RolloutContext, create_workflow


class LengthScorer:
    async def score(self, items):
        return [Score(score=float(len(it.response))) for it in items]

    async def close(self):
        pass


def tasks(n):
    return [Task(id=f"t{i}", payload={"prompt": f"{i}+{i}="}) for i in range(n)]


def on_forward(model, call):
    """Run `call(kind, index)` before every forward of `model` on the engine thread: kind is
    "prefill" (several tokens per row) or "decode" (one), index counts that kind from 1."""
    counts = {"prefill": 0, "decode": 0}

    def hook(module, args, kwargs):
        kind = "decode" if kwargs["input_ids"].shape[1] == 1 else "prefill"
        counts[kind] += 1
        call(kind, counts[kind])

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def teacher_forced(model, prompt_ids, token_ids, params):
    ids = torch.tensor(list(prompt_ids) + list(token_ids))[None]
    with torch.no_grad():
        logits = model(ids).logits[0]
    p = len(prompt_ids)
    return policy_logprobs(logits[p - 1:-1], params).gather(-1, ids[0, p:, None]).squeeze(-1)


def interruptible(path, **kw):
    engine = TransformersEngine.from_pretrained(path, **kw)
    engine.interruptible = True  # as an explorer with on_new_weights: interrupt sets it
    return engine


def perturbed(path, seed):
    other = TransformersEngine.from_pretrained(path)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return other


def test_streamed_groups_reach_the_buffer_while_the_last_group_generates(tiny_model_path,
                                                                          tmp_path):
    # one task per engine batch (max_batch = repeat_times): three batches, one after the other
    engine = TransformersEngine.from_pretrained(tiny_model_path, max_batch=2)
    wf = create_workflow("single_turn", engine.tokenizer)
    sampling = SamplingParams(max_tokens=12, seed=5)

    def ctx(**kw):
        return RolloutContext(engine=engine, sampling=sampling, repeat_times=2, explorer="e",
                              run="r", scorer=LengthScorer(), **kw)

    whole = asyncio.run(wf.run(tasks(3), ctx()))  # not streamed: the reference

    store = SqliteStore(tmp_path / "buffer.sqlite")
    first_stored = threading.Event()
    waited: list[bool] = []
    ready_after_put: list[int] = []

    def hold_last_batch(kind, index):
        if kind == "prefill" and index == 3:  # the last task's batch starts generating
            waited.append(first_stored.wait(BACKSTOP))

    async def put_group(group):
        await store.put(group, [len(group)] * len(group))
        ready_after_put.append((await store.stats()).by_state.get("ready", 0))
        first_stored.set()

    handle = on_forward(engine.model, hold_last_batch)
    try:
        streamed = asyncio.run(wf.run(tasks(3), ctx(on_group=put_group)))
    finally:
        handle.remove()
        store.close_sync()
        engine.close()
    # the last batch began only after the first group was in the store (it waited for it)
    assert waited == [True]
    # ready experiences after each put: whole groups only, never fewer than before, all three
    # in the end (the puts of two groups may overlap, so a put can see the next one's group)
    assert len(ready_after_put) == 3 and ready_after_put == sorted(ready_after_put)
    assert all(n % 2 == 0 and n >= 2 * (i + 1) for i, n in enumerate(ready_after_put))
    assert ready_after_put[-1] == 6
    # streaming changes when groups leave, not what was sampled
    assert [e.id for e in streamed] == [e.id for e in whole]
    for a, b in zip(streamed, whole):
        assert a.tokens.tolist() == b.tokens.tolist() and a.reward == b.reward
        assert np.array_equal(a.logprobs, b.logprobs)


def test_interrupt_resumes_partial_responses_under_the_new_weights(tiny_model_path):
    engine = interruptible(tiny_model_path, max_batch=2)
    old = TransformersEngine.from_pretrained(tiny_model_path)  # the version-0 weights, kept
    new = perturbed(tiny_model_path, seed=7)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True, seed=11)
    wf = create_workflow("single_turn", engine.tokenizer)
    reached, queued = threading.Event(), threading.Event()

    def pause_at_token_six(kind, index):
        if kind == "decode" and index == 6:  # feeding the 6th sampled token of the 1st batch
            reached.set()
            assert queued.wait(BACKSTOP)

    async def go():
        ctx = RolloutContext(engine=engine, sampling=sampling, repeat_times=2, explorer="e",
                             run="r", scorer=LengthScorer())
        rollout = asyncio.create_task(wf.run(tasks(2), ctx))
        assert await asyncio.to_thread(reached.wait, BACKSTOP)
        load = asyncio.create_task(engine.update_weights(lambda: new.model.state_dict().items(),
                                                         version=1))
        while engine._loads.empty():  # queued for the next token boundary
            await asyncio.sleep(0.001)
        queued.set()
        return await rollout, await load

    handle = on_forward(engine.model, pause_at_token_six)
    try:
        experiences, loaded = asyncio.run(go())
    finally:
        handle.remove()
        engine.close()
    assert loaded == len(new.model.state_dict()) and engine.version == 1
    first, second = experiences[:2], experiences[2:]
    # task 0 was mid-generation: 7 tokens sampled under version 0 (the 7th from the logits of
    # the forward the test paused), the rest under version 1
    for e in first:
        assert e.policy_version == 0
        assert e.token_versions.tolist() == [0] * 7 + [1] * 33
    # task 1's batch started after the switch: all version 1, its group's version too
    for e in second:
        assert e.policy_version == 1 and e.token_versions is None
    for e in experiences:
        prompt, response = e.tokens[:e.prompt_len], e.tokens[e.prompt_len:]
        versions = e.versions_of_tokens()
        for model, v in ((old.model, 0), (new.model, 1)):
            if not (versions == v).any():
                continue
            expected = teacher_forced(model, prompt, response, sampling)[versions == v]
            got = torch.from_numpy(e.logprobs[versions == v])
            assert (expected - got).abs().max().item() < 1e-4, f"version {v} tokens of {e.id}"
    old.close()
    new.close()


def test_an_idle_interruptible_engine_loads_at_once(tiny_model_path):
    engine = interruptible(tiny_model_path)
    new = perturbed(tiny_model_path, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=8)

    async def go():
        await engine.update_weights(lambda: new.model.state_dict().items(), version=4)
        return await engine.generate(["1+2="], 1, params)

    [[after]] = asyncio.run(asyncio.wait_for(go(), BACKSTOP))
    [[expected]] = new.generate_sync(["1+2="], 1, params)
    engine.close()
    new.close()
    assert engine.version == 4 and after.token_versions.tolist() == [4] * len(after)
    assert after.token_ids.tolist() == expected.token_ids.tolist()


def test_a_failed_interrupting_load_fails_its_caller_not_the_generation(tiny_model_path):
    engine = interruptible(tiny_model_path)

    async def go():
        with pytest.raises(ValueError, match="not a parameter"):
            await engine.update_weights(lambda: [("nope", torch.zeros(1))], version=1)
        return await engine.generate(["1+2="], 1, SamplingParams(max_tokens=4, seed=0))

    [[c]] = asyncio.run(asyncio.wait_for(go(), BACKSTOP))
    engine.close()
    assert engine.version == 0 and c.token_versions.tolist() == [0] * len(c)


async def test_an_explorer_takes_weights_published_mid_step(tmp_path, tiny_model_path):
    """An asynchronous run with `on_new_weights: interrupt`: version 1 is published while step 1
    generates; the explorer loads it at once and step 1's responses switch mid-way."""
    import sys
    from pathlib import Path

    from tandem.buffer import Buffer
    from tandem.common.messages.buffer import SampleGroups
    from tandem.common.rpc import RpcClient
    from tandem.common.trace import read_trace
    from tandem.explorer.service import Explorer
    from tandem.master.service import Master

    sys.path.insert(0, str(Path(__file__).parent))
    from test_service import make_config, play_trainer

    config = make_config(
        tmp_path, tiny_model_path, "sync.preset=fully_async", "sync.method=checkpoint",
        "sync.offset=null", "explorers.0.on_new_weights=interrupt",
        "explorers.0.workflow_args.max_turns=1", "explorers.0.sampling.max_tokens=16")
    master = Master(config)
    await master.start()
    buffer = Buffer(config)
    config.buffer.address = await buffer.start()
    config.master.address = master.address
    engine = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    engine.eos_ids = {-1}  # every response runs all its tokens: some come after the switch
    trained = perturbed(tiny_model_path, seed=9)
    # one generation a step (one turn, one batch): the trainer reports step 0, and so publishes
    # version 1, once step 1 generates, and step 1's first decode waits until that load is
    # queued for a token boundary (or taken at the first)
    step_one = threading.Event()
    held: list[bool] = []

    def hold_step_one(kind, index):
        if kind == "prefill" and index == 2:
            step_one.set()
        elif kind == "decode" and step_one.is_set() and not held:
            held.append(wait_for(lambda: engine.version == 1 or not engine._loads.empty(),
                                 BACKSTOP, "version 1's load queued"))

    async def step_one_generates(step):
        if step == 0:
            assert await asyncio.to_thread(step_one.wait, BACKSTOP)

    handle = on_forward(engine.model, hold_step_one)
    explorer = Explorer(config, "explorer-0", engine=engine)
    trainer = asyncio.create_task(play_trainer(config, master.address, master.publish_address,
                                               trained, [], step_one_generates))
    try:
        await asyncio.wait_for(explorer.serve(), BACKSTOP)
        await asyncio.wait_for(trainer, BACKSTOP)
        async with RpcClient(config.buffer.address, peer="buffer") as client:
            sample = await client.call(SampleGroups(num_groups=4), timeout=BACKSTOP)
    finally:
        handle.remove()
        trainer.cancel()
        await explorer.close()
        await buffer.close()
        await master.close()
        engine.close()
        trained.close()
    assert explorer.steps_done == 2 and engine.version == 1
    by_step = {s: [e for e in sample.experiences if e.info["step"] == s] for s in (0, 1)}
    assert all(e.policy_version == 0 and e.token_versions is None for e in by_step[0])
    # step 1 began under version 0 and switched: each response is 0s then 1s, the same split
    # for every row of the batch (they shared the token boundary)
    splits = set()
    for e in by_step[1]:
        v = e.token_versions.tolist()
        k = v.count(0)
        assert e.policy_version == 0 and 0 < k < len(v) and v == [0] * k + [1] * (len(v) - k)
        splits.add(k)
    assert len(splits) == 1
    [sync] = [s for s in read_trace(config.run_dir)
              if s["component"] == "explorer-0" and s["kind"] == "sync"]
    assert sync["step"] == 1 and sync["version"] == 1 and sync["attrs"]["interrupt"] is True
    [rollout] = [s for s in read_trace(config.run_dir)
                 if s["component"] == "explorer-0" and s["kind"] == "rollout" and s["step"] == 1]
    assert rollout["start"] < sync["start"] and sync["end"] < rollout["end"]


@pytest.mark.parametrize("overrides, message", [
    ([], "on_new_weights: interrupt loads weights mid-step, which only an asynchronous preset"),
    (["sync.preset=fully_async", "explorers.0.engine.kind=remote",
      "explorers.0.engine.url=http://127.0.0.1:8000"],
     "on_new_weights: interrupt needs an engine that declares interrupt"),
])
def test_interrupt_is_refused_where_weights_cannot_change_mid_step(overrides, message):
    from tandem.common.config import load_config
    from tandem.common.errors import TandemError

    with pytest.raises(TandemError, match=message):
        load_config(None, ["explorers.0.on_new_weights=interrupt", *overrides])
    config = load_config(None, ["explorers.0.on_new_weights=interrupt", "sync.preset=fully_async"])
    assert config.explorers[0].on_new_weights == "interrupt"
