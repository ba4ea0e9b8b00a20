"""Two DDP ranks against one process on the same batch (corrections_dist_worker.py under
torchrun): the parameters after two steps and each step's metrics agree."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from batch_json import write_batch
from test_distributed import torchrun

from tandem.trainer.learner import Learner

WORKER = os.path.join(os.path.dirname(__file__), "corrections_dist_worker.py")


def assert_two_ranks_match_one(model_path: Path, trainer: dict, batch, make_config,
                               tmp_path: Path, keys: tuple[str, ...]) -> None:
    """Two steps of `batch` under `trainer` by 2 ranks and by one process: every parameter
    within 1e-4 and each of `keys` of both steps' metrics within 1e-4 relative."""
    (tmp_path / "trainer.json").write_text(json.dumps(trainer))
    torchrun(WORKER, model_path, write_batch(batch, tmp_path), tmp_path)
    single = Learner(make_config(model_path, **trainer))
    expected = [single.step(batch) for _ in range(2)]
    got = torch.load(tmp_path / "ddp.pt", weights_only=True)
    reference = single.policy_state_dict()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)
    metrics = json.loads((tmp_path / "ddp.json").read_text())
    for step in (0, 1):
        for key in keys:
            assert metrics[step][key] == pytest.approx(expected[step][key], rel=1e-4,
                                                       abs=1e-6), (step, key)
