"""Fixtures of the weight-sync tests: a tiny model that really trains, and receiver processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from weights_helpers import PEER


@pytest.fixture
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def spawn():
    """Start `weights_peer.py` receivers; each is stopped (SIGTERM, then kill) at teardown."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(PEER), *map(str, args)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
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
