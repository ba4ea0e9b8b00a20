"""Fixtures for the explorer tests: one tiny model folder per session, engines loaded from it."""

from __future__ import annotations

import pytest


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
