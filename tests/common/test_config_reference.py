"""The generated configuration reference is current, and every example config parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.common.config import load_config
from tandem.common.config.reference import markdown, reference_yaml, walk
from tandem.common.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def test_docs_and_reference_config_are_generated_from_the_models():
    assert (ROOT / "docs" / "configuration.md").read_text() == markdown(), \
        "run `python -m tandem.common.config.reference` to regenerate"
    assert (ROOT / "examples" / "reference.yaml").read_text() == reference_yaml()


def test_every_leaf_key_is_documented():
    text = markdown()
    leaves = [key for key, field, _ in walk(RunConfig)
              if not any(hasattr(t, "model_fields") for t in (field.annotation,
                         *getattr(field.annotation, "__args__", ())))]
    missing = [key for key in leaves if f"`{key}`" not in text]
    assert not missing and "`explorers[].sampling.temperature`" in text


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_parse(path):
    load_config(path)
