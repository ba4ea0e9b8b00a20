"""Fixtures shared by the whole suite."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # shared test helpers, e.g. component_process


def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests in a fresh event loop (no plugin needed)."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        sig = inspect.signature(pyfuncitem.obj)
        kwargs = {name: pyfuncitem.funcargs[name] for name in sig.parameters}
        asyncio.run(pyfuncitem.obj(**kwargs))
        return True
    return None


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("PPid:") and line.split()[1] == me:
                if "State:\tZ" not in status:
                    found.add(int(entry.name))
                break
    return found


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves child processes running (after a short grace period)."""
    before = _children() if Path("/proc").exists() else set()
    yield
    if not Path("/proc").exists():
        return
    deadline = time.monotonic() + 5.0
    while (left := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"test left child processes running: {sorted(left)}"


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
    from tandem.common.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path)
    return path
