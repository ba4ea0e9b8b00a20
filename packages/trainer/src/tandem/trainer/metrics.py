"""Step metrics: accumulated over micro-batches and ranks, written to TensorBoard.

Reduction by name: `loss/*` terms are already divided by the whole step's denominators and
are summed; names ending in `_max` / `_min` take the max / min; everything else is a mean
weighted by each micro-batch's action tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor


def _kind(name: str) -> str:
    if name.startswith("loss/"):
        return "sum"
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


class MetricAccumulator:
    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}

    def add(self, metrics: dict[str, Tensor | float], weight: float) -> None:
        for name, value in metrics.items():
            v = float(value.detach()) if isinstance(value, Tensor) else float(value)
            slot = self._values.setdefault(name, [0.0, 0.0])
            kind = _kind(name)
            if kind == "sum":
                slot[0] += v
            elif kind == "max":
                slot[0] = v if slot[1] == 0 else max(slot[0], v)
                slot[1] = 1.0
            elif kind == "min":
                slot[0] = v if slot[1] == 0 else min(slot[0], v)
                slot[1] = 1.0
            else:
                slot[0] += v * weight
                slot[1] += weight

    def result(self, group_size: int = 1) -> dict[str, float]:
        """Final values; with several ranks every rank must call it (a collective)."""
        names = sorted(self._values)
        if group_size > 1:
            names = _common_names(names)
            for kind, op in (("sum", dist.ReduceOp.SUM), ("mean", dist.ReduceOp.SUM),
                             ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
                picked = [n for n in names if _kind(n) == kind]
                if not picked:
                    continue
                buf = torch.tensor([self._values.get(n, [0.0, 0.0]) for n in picked],
                                   dtype=torch.float64)
                if kind in ("max", "min"):  # ranks without a value must not win
                    fill = -torch.inf if kind == "max" else torch.inf
                    buf[:, 0] = torch.where(buf[:, 1] > 0, buf[:, 0],
                                            torch.full_like(buf[:, 0], fill))
                dist.all_reduce(buf, op=op)
                for n, row in zip(picked, buf.tolist()):
                    self._values[n] = row
        out = {}
        for name in names:
            total, weight = self._values[name]
            kind = _kind(name)
            out[name] = total / weight if kind == "mean" and weight > 0 else total
        return out


def _common_names(names: list[str]) -> list[str]:
    """The union of every rank's metric names, gathered as UTF-8 bytes (no pickling)."""
    data = torch.frombuffer(bytearray("\n".join(names).encode() or b"\n"), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()]))
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    parts = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(parts, padded)
    union = set()
    for part, size in zip(parts, sizes):
        union.update(n for n in bytes(part[: int(size)].tolist()).decode().split("\n") if n)
    return sorted(union)


class MetricsWriter:
    """TensorBoard scalars under run_dir/tensorboard (no-op when disabled)."""

    def __init__(self, run_dir: str | Path | None, enabled: bool = True):
        self._writer = None
        if enabled and run_dir is not None:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
