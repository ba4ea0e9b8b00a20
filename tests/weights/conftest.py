"""Fixtures of the weight-sync tests: a tiny model that really trains, and receiver processes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from backstop import BACKSTOP
from weights_helpers import PEER


@pytest.fixture
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))


# modes whose peer joins a weight group: it says "ready" once its imports and its engine are
# done, just before it joins (torch, and transformers with a model: 30 s and more at load 8,
# which a test's sync.timeout must not have to cover)
JOINING = ("broadcast", "stall", "fake-vllm")


@pytest.fixture
def spawn():
    """Start `weights_peer.py` receivers; each is stopped (SIGTERM, then kill) at teardown.
    A joining peer is returned once it said "ready": the sender's join timeout then times the
    join, as an explorer's does (its engine is loaded before it asks for a rendezvous), not a
    process starting on a busy machine."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(PEER), *map(str, args)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        if args[0] in JOINING:
            ready, _, _ = select.select([proc.stdout], [], [], BACKSTOP)
            line = proc.stdout.readline() if ready else ""
            if line.strip() != "ready":
                proc.kill()
                _, err = proc.communicate()
                pytest.fail(f"weights peer {args[0]} exited {proc.returncode} or hung before "
                            f"it was ready:\n{err[-3000:]}")
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
