"""Run by test_lora_distributed under torchrun: a LoRA `Trainer` on 2 gloo ranks, DDP then FSDP2.

Rank 0 drives (train_step twice, policy_weights, save_checkpoint, close); rank 1 follows its
commands. Every rank then writes what it holds: its trainable parameters by name, and the
parameters its optimiser holds state for. argv: model path, experiences JSON, output folder.
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

LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}

model_path, batch_file, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
batch = read_batch(batch_file)
info = distributed.from_env()
distributed.init(info, torch.device("cpu"), timeout=BACKSTOP)
for mode in ("ddp", "fsdp"):
    config = RunConfig.model_validate({
        "model": {"path": model_path, "lora": LORA}, "run_dir": str(out / mode),
        "trainer": {"parallel": mode, "micro_batch_tokens": 24, "lr": 2e-2,
                    "tensorboard": False, "off_policy": {"proximal": True}},
    })
    trainer = Trainer(config, dist_info=info)
    if info.is_main:
        metrics = [trainer.train_step(batch) for _ in range(2)]
        weights = dict(trainer.policy_weights())
        trainer.save_checkpoint()
    else:
        trainer.follow()
    asyncio.run(trainer.close())  # releases rank 1 from `follow`: both gather below
    learner = trainer.learner
    named = dict(learner.actor.named_parameters())
    ids = {id(p): n for n, p in named.items()}
    held = {
        # under FSDP2 a parameter is a DTensor shard: its full value, gathered on every rank
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in named.items() if p.requires_grad}
    optimised = sorted(ids[id(p)] for p in learner.optimizer.state)
    torch.save(held, out / f"{mode}-rank{info.rank}.pt")
    (out / f"{mode}-rank{info.rank}.json").write_text(json.dumps({"optimised": optimised}))
    if info.is_main:
        torch.save(weights, out / f"{mode}.pt")
        (out / f"{mode}.json").write_text(json.dumps({"metrics": metrics}))
distributed.shutdown(BACKSTOP)
