"""A batch of experiences through a JSON file: how the torchrun workers get the test's batch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tandem.common.messages.experience import Experience

ARRAYS = {"tokens": np.int32, "action_mask": np.uint8, "logprobs": np.float32}


def write_batch(batch: list[Experience], folder: Path) -> Path:
    rows = [{**e.model_dump(), **{k: getattr(e, k).tolist() for k in ARRAYS}} for e in batch]
    path = folder / "batch.json"
    path.write_text(json.dumps(rows))
    return path


def read_batch(path: str | Path) -> list[Experience]:
    rows = json.loads(Path(path).read_text())
    return [Experience(**{**r, **{k: np.array(r[k], dtype=t) for k, t in ARRAYS.items()}})
            for r in rows]
