"""Agents out of the explorer's process (issue 30 item 4): each `agent` episode runs in its own
sandbox, so a hostile agent cannot write into another episode, and one that crashes, hangs or
exhausts its memory costs its own episode alone."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from backstop import BACKSTOP
from endpoint_helpers import GREEDY, agent_args, encode, endpoint
from prometheus_client import generate_latest

from tandem.common.config.logs import MetricsConfig
from tandem.common.messages.experience import Task
from tandem.common.metrics import MetricsEndpoint
from tandem.explorer.workflows import RolloutContext, create_workflow
from tandem.explorer.workflows.agent_sandbox import AgentSandbox, AgentSandboxArgs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox tests run as root")


def ctx(engine, ep, repeat_times=2) -> RolloutContext:
    return RolloutContext(engine=engine, sampling=GREEDY, repeat_times=repeat_times,
                          explorer="explorer-0", run="test", endpoint=ep)


def gates(ep, victims: int, thieves: int) -> None:
    """Routes the test's agents wait on: a thief starts once every victim has made its call and
    waits with its episode open; the victims finish once every thief has finished."""
    waiting, done = asyncio.Event(), asyncio.Event()
    count = {"victim": 0, "thief_done": 0}

    @ep.app.get("/v1/gate/{name}")
    async def gate(name: str) -> dict:
        if name == "victim":
            count["victim"] += 1
            if count["victim"] == victims:
                waiting.set()
            await asyncio.wait_for(done.wait(), BACKSTOP)
        elif name == "thief":
            await asyncio.wait_for(waiting.wait(), BACKSTOP)
        elif name == "thief_done":
            count["thief_done"] += 1
            if count["thief_done"] == thieves:
                done.set()
        return {}


async def test_hostile_agent_cannot_write_into_another_episode(agent_engine):
    ep = endpoint(agent_engine)
    gates(ep, victims=2, thieves=2)
    await ep.start()
    port = int(ep.url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as master:  # a control-plane port on the explorer's host
        master.bind(("127.0.0.1", 0))
        master.listen()
        tasks = [Task(id="victims", payload={"role": "victim", "prompt": "What is 12*7?"}),
                 Task(id="thieves", payload={"role": "thief",
                                             "ports": [port, master.getsockname()[1]]})]
        try:
            workflow = create_workflow("agent", agent_engine.tokenizer,
                                       agent_args("hostile_agents:party"))
            experiences = await workflow.run(tasks, ctx(agent_engine, ep))
        finally:
            await ep.close()
    victims = [e for e in experiences if e.task_id == "victims"]
    thieves = [e for e in experiences if e.task_id == "thieves"]
    # the victims' experiences are their own one call each, untouched
    prompt = agent_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12*7?"}], tokenize=False,
        add_generation_prompt=True)
    assert len(victims) == 2
    for v in victims:
        assert v.reward == 1.0 and v.info["calls"] == 1 and v.info["rule"] == "chained"
        assert v.tokens[:v.prompt_len].tolist() == encode(agent_engine, prompt)
        assert "token_mismatch" not in v.info
    assert len(thieves) == 2
    for thief in thieves:
        assert thief.info["reward_reason"] == "ok" and thief.info["calls"] == 1
        assert thief.rewards["foreign_keys"] == 0 and thief.rewards["stolen_calls"] == 0
        assert thief.rewards["ports_reached"] == 0
        assert thief.rewards["processes_seen"] <= 3  # its sandbox's init, runner and itself
    assert ep.calls.mismatches == 0


@pytest.mark.parametrize(("fn", "args", "reason"), [
    ("crashes", {}, "crashed: exit 3"),
    ("segfaults", {}, "crashed: signal 139"),
    ("eats_memory", {"sandbox": {"memory_mb": 512}}, "memory: ran out of "
                                                     "workflow_args.sandbox.memory_mb = 512 MiB"),
    ("hangs_after_a_call", {"timeout": 8}, "timeout: ran past workflow_args.timeout = 8s"),
])
async def test_a_failing_agent_costs_its_own_episode(agent_engine, fn, args, reason):
    ep = endpoint(agent_engine)
    metrics = MetricsEndpoint(MetricsConfig(enabled=True, port=0), "explorer", "explorer-0")
    workflow = create_workflow("agent", agent_engine.tokenizer,
                               agent_args(f"hostile_agents:{fn}", **args))
    workflow.attach(ep, repeat_times=2, metrics=metrics)
    await ep.start()
    try:
        failed = await workflow.run([Task(id="t", payload={})], ctx(agent_engine, ep))
        # the explorer and its endpoint carry on: the next step's agents play as usual
        after = create_workflow("agent", agent_engine.tokenizer,
                                agent_args("hostile_agents:polite"))
        fine = await after.run([Task(id="u", payload={})], ctx(agent_engine, ep))
    finally:
        await ep.close()
    assert len(failed) == 2  # the call each made before failing is kept, scored 0
    for e in failed:
        assert e.reward == 0 and e.info["reward_reason"].startswith(reason), e.info
    kind = reason.split(":")[0]
    assert f'tandem_explorer_agent_failures{{kind="{kind}"}} 2.0' in \
        generate_latest(metrics.registry).decode()
    assert len(fine) == 2 and {e.info["reward_reason"] for e in fine} == {"ok"}


async def test_sandbox_refuses_without_bwrap_and_names_the_key(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox = AgentSandbox("hostile_agents:crashes", AgentSandboxArgs(), timeout=5,
                           max_retries=0, slots=1)
    with pytest.raises(Exception, match="workflow_args.sandbox: the sandbox needs bubblewrap"):
        await sandbox.start()
    await sandbox.close()


async def test_the_episode_timeout_counts_from_the_agents_call_not_its_process_start():
    # the agent's module takes 3 s to import, its episode 2 s: the start is not the agent's time
    sandbox = AgentSandbox("slow_import_agent:instant", AgentSandboxArgs(start_seconds=BACKSTOP),
                           timeout=2, max_retries=0, slots=1)
    try:
        played = await sandbox.play("ep-0", "http://127.0.0.1:9/v1", {})
    finally:
        await sandbox.close()
    assert (played.reason, played.result) == ("ok", 1.0)


async def test_the_episode_cpu_limit_counts_from_the_agents_call():
    # 2.5 s of CPU while the module imports, a 2 s CPU budget: the start is not the agent's
    args = AgentSandboxArgs(cpu_seconds=2, start_seconds=BACKSTOP)
    sandbox = AgentSandbox("cpu_import_agent:instant", args, timeout=BACKSTOP, max_retries=0,
                           slots=1)
    spinner = AgentSandbox("cpu_import_agent:spins", args, timeout=BACKSTOP, max_retries=0,
                           slots=1)
    try:
        played = await sandbox.play("ep-0", "http://127.0.0.1:9/v1", {})
        spun = await spinner.play("ep-1", "http://127.0.0.1:9/v1", {})
    finally:
        await sandbox.close()
        await spinner.close()
    assert (played.reason, played.result) == ("ok", 1.0)
    # and what the agent itself spends is bounded by it
    assert spun.reason == "cpu: ran past workflow_args.sandbox.cpu_seconds = 2s", spun.reason


async def test_an_agent_that_never_starts_is_bounded_by_start_seconds():
    sandbox = AgentSandbox("stuck_import_agent:never", AgentSandboxArgs(start_seconds=1),
                           timeout=60, max_retries=0, slots=1)
    try:
        played = await sandbox.play("ep-0", "http://127.0.0.1:9/v1", {})
    finally:
        await sandbox.close()
    assert played.reason.startswith("start_timeout: the agent was not called within "
                                    "workflow_args.sandbox.start_seconds = 1s"), played.reason


def test_agent_must_be_importable_by_its_episode():
    with pytest.raises(ValueError, match="module-level function"):
        create_workflow("agent", None, {"fn": "hostile_agents:local_agent"})


def _sandboxes() -> set[int]:
    """This process's live children that are episode sandboxes (bubblewrap, also while its
    shell joins the slot's cgroup)."""
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids |= {int(p) for p in f.read().split()}
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"bwrap" in f.read():
                    out.add(pid)
        except OSError:
            pass  # gone
    return out


async def test_a_cancelled_rollout_leaves_no_agent_process(agent_engine):
    # the explorer stopping mid-step cancels its rollout: every episode's process tree goes
    ep = endpoint(agent_engine)
    await ep.start()
    called = asyncio.Event()
    add, calls = ep.calls.add, []

    def recorded(records):
        add(records)
        calls.extend(records)
        if len(calls) == 2:
            called.set()

    ep.calls.add = recorded
    before = _sandboxes()
    workflow = create_workflow("agent", agent_engine.tokenizer,
                               agent_args("hostile_agents:hangs_after_a_call"))
    run = asyncio.create_task(workflow.run([Task(id="t", payload={})], ctx(agent_engine, ep)))
    try:
        await asyncio.wait_for(called.wait(), BACKSTOP)  # both episodes made their call and hang
        assert len(_sandboxes() - before) == 2
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    finally:
        await ep.close()
    assert _sandboxes() - before == set()
