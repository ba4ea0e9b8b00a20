"""Fixtures for the explorer tests: one tiny model folder per session, engines loaded from it."""

from __future__ import annotations

import pytest

from tandem.common.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(path)
    return path


@pytest.fixture
def engine(tiny_model_path):
    from tandem.explorer.transformers_engine import TransformersEngine

    eng = TransformersEngine.from_pretrained(tiny_model_path, max_batch=8)
    yield eng
    eng.close()
