"""Run by test_distributed under torchrun: a `Trainer` on 2 gloo ranks, DDP then FSDP2.

Rank 0 drives (train_step twice, policy_weights, save_checkpoint for FSDP2, close); rank 1
follows its commands, receiving each batch as tensors. Then a third step by a trainer resumed
from the FSDP2 checkpoint, and two DDP steps of two PPO epochs of two mini-batches each (every
rank must split the batch alike). argv: model path, experiences JSON, output folder; rank 0
writes the published weights and the metrics of each run.
"""

import asyncio
import json
import sys
from pathlib import Path

import torch

from tandem.common.config import RunConfig
from tandem.trainer import distributed
from tandem.trainer.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from backstop import BACKSTOP
from batch_json import read_batch

model_path, batch_file, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
batch = read_batch(batch_file)
info = distributed.from_env()
distributed.init(info, torch.device("cpu"), timeout=BACKSTOP)
for mode in ("ddp", "fsdp", "fsdp-resumed", "ddp-ppo"):
    resume = mode == "fsdp-resumed"
    config = RunConfig.model_validate({
        "model": {"path": model_path}, "run_dir": str(out / ("fsdp" if resume else mode)),
        "trainer": {"parallel": mode.split("-")[0], "micro_batch_tokens": 24, "lr": 1e-3,
                    "tensorboard": False, "off_policy": {"proximal": True},
                    **({"ppo_epochs": 2, "mini_batches": 2} if mode == "ddp-ppo" else {})},
    })
    trainer = Trainer(config, dist_info=info, resume=resume)
    reduces = []
    if mode == "ddp":  # count gradient all-reduces: one per bucket per step, not per micro-batch
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(state, bucket, reduces=reduces):
            reduces.append(1)
            return allreduce_hook(state, bucket)

        trainer.learner.wrapped.register_comm_hook(None, counting_hook)
    if not info.is_main:
        trainer.follow()
        asyncio.run(trainer.close())
        continue
    metrics = [trainer.train_step(batch) for _ in range(1 if resume else 2)]
    weights = dict(trainer.policy_weights())
    if mode.startswith("fsdp"):
        trainer.save_checkpoint()
    asyncio.run(trainer.close())
    torch.save(weights, out / f"{mode}.pt")
    (out / f"{mode}.json").write_text(json.dumps({"metrics": metrics, "reduces": len(reduces)}))
distributed.shutdown(BACKSTOP)
