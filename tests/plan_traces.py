"""Hand-written traces in the trace format for `tandem plan --from`'s tests
(tests/master/test_plan_from.py, test_plan_accuracy.py): a synchronous run with known durations
and gaps, and a run whose sides share two cores with a known stretch."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tandem.common.config import RunConfig

ROLLOUT, TRAIN, SYNC, STEPS = 1.0, 2.0, 0.1, 6
T0 = 1_800_000_000.0


def span(component: str, kind: str, start: float, end: float, step: int | None,
         version: int | None, **attrs) -> str:
    return json.dumps({"component": component, "kind": kind, "step": step, "version": version,
                       "start": T0 + start, "end": T0 + end, "pid": 1, "attrs": attrs})


def write_sync_run(run_dir: Path, preset: str = "synchronous", sample: float = 0.0,
                   publish: float = 0.0, load: float = 0.0, rollout_gap: float = 0.0) -> Path:
    """A synchronous run; the gaps: rollout end -> train start (`sample`), train end -> the
    trainer's broadcast (`publish`), the trainer's broadcast -> the explorer's (`load`), the
    explorer's broadcast end -> its rollout (`rollout_gap`)."""
    explorer, trainer = [], []
    t = 0.0
    for e in range(STEPS):
        if e:
            t += publish
            trainer.append(span("trainer", "sync", t, t + load + SYNC, e - 1, e, method="nccl"))
            t += load
            explorer.append(span("explorer-0", "sync", t, t + SYNC, e, e, method="nccl"))
            t += SYNC + rollout_gap
        rollout = ROLLOUT + (3.0 if e == 0 else 0.0)  # the first step warms up
        explorer.append(span("explorer-0", "rollout", t, t + rollout, e, e, groups=2))
        t += rollout + sample
        train = TRAIN + (5.0 if e == 0 else 0.0)
        trainer.append(span("trainer", "train", t, t + train, e, e + 1))
        t += train
    (run_dir / "trace").mkdir(parents=True)
    (run_dir / "trace" / "explorer-0.jsonl").write_text("\n".join(explorer) + "\n")
    (run_dir / "trace" / "trainer.jsonl").write_text("\n".join(trainer) + "\n")
    # one thread a side on two cores: overlapping sides do not slow each other
    config = RunConfig.model_validate({
        "run_dir": str(run_dir), "sync": {"preset": preset},
        "placement": {"cores": 2, "trainer": {"threads": 1}, "explorers": {"threads": 1}}})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return run_dir


def write_shared_run(run_dir: Path, stretch: float, rounds: int = 6) -> Path:
    """One thread a side on two cores, stretched by `stretch` while both run: each round a
    rollout alone, a train step alone, then a rollout and a train step together (equal work,
    so both take WORK * stretch)."""
    work = 1.0
    explorer, trainer = [], []
    t = 0.0
    for r in range(rounds):
        explorer.append(span("explorer-0", "rollout", t, t + work, 2 * r, 0))
        t += work
        trainer.append(span("trainer", "train", t, t + work, 2 * r, 2 * r + 1))
        t += work
        explorer.append(span("explorer-0", "rollout", t, t + work * stretch, 2 * r + 1, 0))
        trainer.append(span("trainer", "train", t, t + work * stretch, 2 * r + 1, 2 * r + 2))
        t += work * stretch
    (run_dir / "trace").mkdir(parents=True)
    (run_dir / "trace" / "explorer-0.jsonl").write_text("\n".join(explorer) + "\n")
    (run_dir / "trace" / "trainer.jsonl").write_text("\n".join(trainer) + "\n")
    config = RunConfig.model_validate({
        "run_dir": str(run_dir), "sync": {"preset": "fully_async"},
        "placement": {"cores": 2, "trainer": {"threads": 1}, "explorers": {"threads": 1}}})
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return run_dir
