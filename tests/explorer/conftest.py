"""Fixtures for the explorer tests: one tiny model folder per session, engines loaded from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # endpoint_helpers


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture
def engine(tiny_model_path):
    from tandem.explorer.transformers_engine import TransformersEngine

    eng = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    yield eng
    eng.close()


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The tiny model gains nothing from intra-op threads, and on a shared 2-core machine
    spinning worker threads only slow every test down."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def agent_engine(agent_model_dir):
    """The calculator-agent model (tests/agent_model.py) in a transformers engine."""
    from tandem.explorer.transformers_engine import TransformersEngine

    engine = TransformersEngine.from_pretrained(agent_model_dir, max_batch=16)
    yield engine
    engine.close()
