"""Run by test_corrections_learner under torchrun: a `Learner` on 2 gloo ranks (DDP) with the
test's trainer section (corrections, cispo_clip, length shaping), two steps on the same batch.
argv: model path, experiences JSON, output folder (holding trainer.json); rank 0 writes the
weights and each step's metrics."""

import json
import sys
from pathlib import Path

import torch

from tandem.common.config import RunConfig
from tandem.trainer import distributed
from tandem.trainer.learner import Learner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from backstop import BACKSTOP
from batch_json import read_batch  # this folder is sys.path[0] under torchrun

model_path, batch_file, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
batch = read_batch(batch_file)
info = distributed.from_env()
distributed.init(info, torch.device("cpu"), timeout=BACKSTOP)
trainer = json.loads((out / "trainer.json").read_text())
config = RunConfig.model_validate({
    "model": {"path": model_path}, "run_dir": str(out / "run"),
    "trainer": {"parallel": "ddp", "lr": 1e-3, "tensorboard": False, **trainer}})
learner = Learner(config, dist_info=info)
metrics = [learner.step(batch) for _ in range(2)]
weights = learner.policy_state_dict()
if info.is_main:
    torch.save({k: v.clone() for k, v in weights.items()}, out / "ddp.pt")
    (out / "ddp.json").write_text(json.dumps(metrics))
learner.release()
distributed.shutdown(BACKSTOP)
