"""Fixtures of the deploy tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from deploy_config import run_config


@pytest.fixture
def write_config(tmp_path):
    def write(**sections):
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(run_config(**sections)))
        return path
    return write
