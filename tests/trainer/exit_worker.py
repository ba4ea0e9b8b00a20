"""Run by test_distributed under torchrun: a DDP `Trainer` on 2 gloo ranks that trains one step
and exits the way `tandem-trainer` does (close, then `distributed.shutdown`).

The main thread keeps the GIL for 30 s at a stretch (`sys.setswitchinterval`), so a gloo worker
that needs the GIL to free a tensor while the group is destroyed hangs the rank far more often
than once in a while (issue 14 item 8). argv: model path, experiences JSON, output folder; every
rank writes rank{N}.json: how many of the group's threads are still alive after `shutdown`.
"""

import asyncio
import json
import os
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
config = RunConfig.model_validate({
    "model": {"path": model_path}, "run_dir": str(out / "run"),
    "trainer": {"parallel": "ddp", "micro_batch_tokens": 24, "tensorboard": False},
})


def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


sys.setswitchinterval(30.0)
before = threads()
distributed.init(info, torch.device("cpu"), timeout=BACKSTOP)
group_threads = threads() - before  # gloo's workers and its transport loop
trainer = Trainer(config, dist_info=info)
if info.is_main:
    trainer.train_step(batch)
else:
    trainer.follow()
asyncio.run(trainer.close())
distributed.shutdown(BACKSTOP)
left = len(group_threads & threads())
(out / f"rank{info.rank}.json").write_text(json.dumps({"group_threads": len(group_threads),
                                                       "left": left}))
