"""Run by test_distributed under torchrun: two steps with DDP, then two with FSDP2 (gloo, CPU).

argv: model path, experiences JSON, output folder. Rank 0 writes the policy weights after
each mode's steps and a checkpoint of the FSDP2 run.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

from tandem.common.config import RunConfig
from tandem.common.messages.experience import Experience
from tandem.trainer import distributed
from tandem.trainer.learner import Learner

model_path, batch_file, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = json.loads(Path(batch_file).read_text())
batch = [Experience(**{**r, "tokens": np.array(r["tokens"], dtype=np.int32),
                       "action_mask": np.array(r["action_mask"], dtype=np.uint8),
                       "logprobs": np.array(r["logprobs"], dtype=np.float32)}) for r in rows]
info = distributed.from_env()
distributed.init(info, torch.device("cpu"), timeout=60)
for mode in ("ddp", "fsdp"):
    config = RunConfig.model_validate({
        "model": {"path": model_path},
        "trainer": {"parallel": mode, "micro_batch_tokens": 24, "lr": 1e-3, "tensorboard": False,
                    "off_policy": {"proximal": True}},
    })
    learner = Learner(config, dist_info=info)
    metrics = [learner.step(batch) for _ in range(2)]
    state = learner.policy_state_dict()
    if mode == "fsdp":
        learner.save_checkpoint(out / "checkpoints")
    if info.is_main:
        torch.save(state, out / f"{mode}.pt")
        (out / f"{mode}.json").write_text(json.dumps(metrics))
distributed.shutdown()
