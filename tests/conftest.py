"""Fixtures shared by the whole suite."""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # shared test helpers, e.g. component_process
# the tools the tests drive or share code with (resume_check, chaos, bench_online, ...)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from backstop import BACKSTOP
from processes import (CpuGrowth, become_subreaper, descendants, kill_and_reap, reap_orphans,
                       track_spawns)

QUIET_SECONDS = 5.0  # a leftover that spends under 1% of a core this long only waits
QUIET_CPU = QUIET_SECONDS / 100


def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests in a fresh event loop (no plugin needed)."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        sig = inspect.signature(pyfuncitem.obj)
        kwargs = {name: pyfuncitem.funcargs[name] for name in sig.parameters}
        asyncio.run(pyfuncitem.obj(**kwargs))
        return True
    return None


def pytest_configure(config):
    become_subreaper()  # orphans (a torchrun rank whose torchrun died) come back to pytest
    track_spawns()  # ... and once exited, reap_orphans tells them from pytest's own children


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves processes running anywhere below pytest (children, their
    children, and orphans re-parented to pytest); what is left is killed so that it cannot
    disturb the tests after this one. A process that only waits (a server nobody stopped) is
    left once it has spent under 1% of a core for 5 s; one still spending CPU is on its way out
    (an interpreter holding torch exits for seconds on a loaded machine) and is waited for, up
    to BACKSTOP."""
    if not Path("/proc").exists():
        yield
        return
    before = set(descendants())
    yield
    reap_orphans()
    start = time.monotonic()
    growth = CpuGrowth(QUIET_CPU)
    growth.spent(descendants())  # from now on
    while True:
        left = {pid: cmd for pid, cmd in descendants().items() if pid not in before}
        if not left:
            break
        # `tandem up` draws timeline.png in a detached `tandem timeline` that ends on its own
        # (seconds, more on a loaded machine): wait for it rather than kill it. A process whose
        # command line reads empty is past its exit (its memory is gone, it is not yet a
        # zombie), which a large one takes a while to reach on a loaded machine: wait for it too
        ending = all(" timeline " in cmd or not cmd for cmd in left.values())
        now = time.monotonic()
        if now - growth.look(left) > (60.0 if ending else QUIET_SECONDS) or now - start > BACKSTOP:
            break
        time.sleep(0.05)
    if left:
        kill_and_reap(left)
        listing = "; ".join(f"{pid}: {cmd}" for pid, cmd in sorted(left.items()))
        pytest.fail(f"test left processes running (killed now): {listing}", pytrace=False)


@pytest.fixture
def zmq_sockets_closed():
    """Fail a test that leaves ZeroMQ sockets of the shared context open."""
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    before = {id(s) for s in getattr(ctx, "_sockets", ()) if not s.closed}
    yield
    left = [s for s in getattr(ctx, "_sockets", ()) if not s.closed and id(s) not in before]
    assert not left, f"test left {len(left)} ZeroMQ sockets open"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 + character tokenizer, built once per test session."""
    from tandem.weights.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path)
    return path


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2-VL + its processor (tandem.weights.tiny_vlm), built once per session."""
    from tandem.weights.tiny_vlm import build_tiny_vlm

    path = tmp_path_factory.mktemp("tiny-vlm")
    build_tiny_vlm(path)
    return path


@pytest.fixture(scope="session")
def agent_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model taught the calculator conversation (tests/agent_model.py), trained once per
    session for the endpoint tests and the agent run through `tandem up` alike: they only read
    it."""
    from agent_model import build_agent_model

    return build_agent_model(tiny_model_dir, tmp_path_factory.mktemp("agent") / "model")
