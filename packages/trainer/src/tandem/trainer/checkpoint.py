"""Trainer checkpoints: everything needed to continue a run exactly.

    checkpoints/step_00000012/
        model/                    Hugging Face folder (save_pretrained, safetensors) + tokenizer
        adapter/                  instead of model/ with model.lora: the peft adapters only
        value_head.safetensors    PPO value head (gae only)
        optimizer.pt              AdamW state, keyed by parameter name (portable across ranks)
        scheduler.pt, rng.pt      LR schedule position; torch / numpy / python RNG states
        trainer_state.json        step, version and lineage (the trainer incarnation that wrote it)

A checkpoint is written into a hidden temporary folder and renamed into place, so a crash never
leaves a half-written `step_*`. A complete checkpoint is never overwritten: one already at the
same step (another lineage's) is moved aside to `superseded/step_N.<lineage>` first. Only files this trainer wrote are read back with `torch.load`,
and with `weights_only=True`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import structlog
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

if TYPE_CHECKING:
    from tandem.common.config import RunConfig

    from .distributed import DistInfo
    from .forward import Actor

log = structlog.get_logger(__name__)

# copied from model.path beside the weights, so a checkpoint's model folder loads on its own;
# a vision-language model's image processor too (docs/vision.md)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja", "added_tokens.json",
                   "processor_config.json", "preprocessor_config.json")


class TrainingState(Protocol):
    """What a checkpoint writes and restores, as a `Learner` holds it: the policy (and value
    head), optimiser and schedule, the step, and where the run's model came from."""

    @property
    def config(self) -> RunConfig: ...

    @property
    def dist(self) -> DistInfo: ...

    @property
    def actor(self) -> Actor: ...

    @property
    def mode(self) -> str: ...  # how `actor` is wrapped ("fsdp": sharded)

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler: ...

    @property
    def step_count(self) -> int: ...

    @property
    def version(self) -> int: ...


def import_state_dict_api():
    """torch.distributed.checkpoint's state-dict functions, imported when first used: the
    import costs about 2 s of CPU, a quarter of the trainer's start-up, and a single-process
    trainer never needs it."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _full():
    return import_state_dict_api().StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(actor: nn.Module, mode: str) -> dict[str, torch.Tensor]:
    """Unsharded parameters by name (gathered on every rank under FSDP)."""
    if mode == "fsdp":
        return import_state_dict_api().get_model_state_dict(actor, options=_full())
    return actor.state_dict()


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    root = Path(root)
    done = [p for p in root.glob("step_*") if (p / "trainer_state.json").exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1])) if done else None


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def lineage_of(path: Path) -> str:
    """The lineage id a checkpoint's trainer_state.json names ("unknown" for older ones)."""
    try:
        return str(json.loads((path / "trainer_state.json").read_text()).get("lineage")
                   or "unknown")
    except (OSError, ValueError):
        return "unknown"


def _move_aside(final: Path, lineage: str | None) -> None:
    """Keep a complete checkpoint that a save at the same step would replace."""
    if not (final / "trainer_state.json").exists():
        shutil.rmtree(final, ignore_errors=True)  # not a complete checkpoint
        return
    theirs = lineage_of(final)
    aside = final.parent / "superseded" / f"{final.name}.{theirs}.{int(time.time() * 1000)}"
    aside.parent.mkdir(exist_ok=True)
    os.replace(final, aside)
    log.warning("checkpoint.superseded", path=str(final), moved_to=str(aside), lineage=theirs,
                by=lineage)


def save(learner: TrainingState, root: Path, *, lineage: str | None = None) -> Path | None:
    """Collective: every rank gathers; rank 0 writes `root/step_N` and prunes old ones."""
    model_state = full_model_state(learner.actor, learner.mode)
    optim_state = import_state_dict_api().get_optimizer_state_dict(
        learner.actor, learner.optimizer, options=_full())
    final = None
    if learner.dist.is_main:
        start = time.perf_counter()
        root.mkdir(parents=True, exist_ok=True)
        step = learner.step_count
        final = root / f"step_{step:08d}"
        tmp = root / f".step_{step:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        policy = {k[len("model."):]: v for k, v in model_state.items() if k.startswith("model.")}
        # LoRA: the adapters only (peft's save_pretrained keeps the adapter entries of `policy`)
        folder = tmp / ("adapter" if learner.config.model.lora is not None else "model")
        learner.actor.model.save_pretrained(str(folder), state_dict=policy,
                                            safe_serialization=True)
        source = Path(learner.config.model.path)
        for name in TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, folder / name)
        value = {k[len("value_head."):]: v.contiguous() for k, v in model_state.items()
                 if k.startswith("value_head.")}
        if value:
            save_file(value, str(tmp / "value_head.safetensors"))
        torch.save(optim_state, tmp / "optimizer.pt")
        torch.save(learner.scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(_rng_state(), tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(
            {"step": step, "version": learner.version, "saved_at": time.time(),
             "lineage": lineage}))
        for path in tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        if final.exists():
            _move_aside(final, lineage)
        os.replace(tmp, final)
        done = sorted((p for p in root.glob("step_*") if p.is_dir()),
                      key=lambda p: int(p.name.split("_")[1]))
        for old in done[: -learner.config.trainer.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint.saved", path=str(final), step=step,
                 seconds=round(time.perf_counter() - start, 3))
    if learner.dist.enabled:
        dist.barrier()
    return final


def load_value_head(value_head: nn.Module, path: Path) -> None:
    value_head.load_state_dict(load_file(str(path / "value_head.safetensors")))


def load_training_state(learner: TrainingState, path: Path) -> dict[str, Any]:
    """Restore optimiser, scheduler and RNG (the model was built from `path/model`)."""
    state = json.loads((path / "trainer_state.json").read_text())
    optim_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    api = import_state_dict_api()
    api.set_optimizer_state_dict(learner.actor, learner.optimizer, optim_state_dict=optim_state,
                                 options=api.StateDictOptions(full_state_dict=True))
    learner.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return state
