"""The run config: one YAML file, one pydantic model per section, every error by its path."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Iterable

from pydantic import Field, model_validator

from ..errors import ConfigError
from ..plugins import absolute, load_plugins
from ..tasks import load_rows
from .base import Section
from .buffer import BufferConfig
from .eval import EvalConfig, EvalTasksetConfig
from .explorer import EngineConfig, ExplorerConfig, SamplingConfig
from .loader import apply_override, interpolate_env, load, read_yaml, validate
from .logs import LoggingConfig
from .master import MasterConfig, TasksetConfig
from .model import LoraConfig, ModelConfig
from .placement import PlacementConfig
from .registered import check_names
from .reward import RewardConfig
from .sync import PRESETS, SyncConfig
from .trainer import TrainerConfig, teacher_vocab_problem
from .transport import CurveConfig, TransportConfig
from .up import UpConfig
from .weights import WeightsConfig


class RunConfig(Section):
    """A whole run."""

    name: str = Field(default="tandem", description="run name, used in logs and the run id")
    plugins: list[str] = Field(
        default_factory=list,
        description="modules (my_task.plugin) or .py files whose registrations the run uses: "
                    "reward functions, workflows, environments, agents, taskset readers and "
                    "formats, advantages, losses, engines (docs/extending.md); installed "
                    "packages' `tandem.plugins` entry points are always loaded")
    run_dir: str = Field(default="runs/latest", description=(
        "folder every component writes into; it holds one run: a config that changes the run "
        "is refused there (docs/master.md#one-run-per-run-dir)"))
    seed: int = Field(default=0, description="seed for task shuffling, sampling and init")
    model: ModelConfig = Field(default_factory=ModelConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    master: MasterConfig = Field(default_factory=MasterConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    explorers: list[ExplorerConfig] = Field(default_factory=lambda: [ExplorerConfig()])
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    up: UpConfig = Field(default_factory=UpConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _explorers_consistent(self) -> RunConfig:
        if not self.explorers:
            raise ValueError("explorers: at least one explorer is needed")
        names = [e.name for e in self.explorers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"explorers: names must be unique, {dup} repeat; give each a name")
        return self

    @model_validator(mode="after")
    def _eval_role_consistent(self) -> RunConfig:
        evals = [e.name for e in self.explorers if e.role == "eval"]
        if not evals:
            return self
        if len(evals) == len(self.explorers):
            raise ValueError("explorers[*].role: every explorer has role eval; at least one "
                             "must be role: rollout (an eval explorer rolls out nothing to train)")
        if len(evals) > 1:
            raise ValueError(f"explorers[{evals[1]}].role: eval, but {evals[0]} already is; "
                             "one explorer evaluates a run")
        if not self.eval.enabled:
            raise ValueError(f"explorers[{evals[0]}].role: eval needs an eval section with "
                             "tasksets (eval.tasksets); add one or use role: rollout")
        if self.eval.explorer not in (None, evals[0]):
            raise ValueError(f"eval.explorer: {self.eval.explorer} is a rollout explorer but "
                             f"{evals[0]} has role: eval; name {evals[0]} or leave it unset")
        if self.sync.method == "nccl":
            raise ValueError(f"explorers[{evals[0]}].role: eval loads published checkpoints, "
                             "which sync.method: nccl does not write; use sync.method: "
                             "checkpoint or role: rollout")
        return self

    @model_validator(mode="after")
    def _names_registered(self) -> RunConfig:
        """Every name the config uses is registered, by tandem or a plugin, and each engine
        can do what the run asks of it (its declared capabilities)."""
        problems = check_names(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _interrupts_are_asynchronous(self) -> RunConfig:
        for e in self.explorers:
            if e.on_new_weights == "interrupt" and (not self.sync.asynchronous
                                                   or self.sync.method != "checkpoint"):
                raise ValueError(
                    f"explorers[{e.name}].on_new_weights: interrupt loads weights mid-step, "
                    "which only an asynchronous preset with sync.method: checkpoint allows "
                    "(sync.offset: null); use on_new_weights: finish")
        return self

    @model_validator(mode="after")
    def _mini_batches_fit(self) -> RunConfig:
        tc = self.trainer
        needs = tc.loss.declared_needs  # None where no loss is registered: the trainer checks
        if needs is not None and needs.pairs:
            have, what = tc.groups_per_step, "pairs (trainer.groups_per_step)"
        else:
            repeat = min(e.repeat_times for e in self.rollout_explorers)
            have = tc.groups_per_step * repeat
            what = "sequences (trainer.groups_per_step x explorers' repeat_times)"
        if tc.mini_batches > have:
            raise ValueError(f"trainer.mini_batches: {tc.mini_batches} exceeds the {have} {what} "
                             f"of a step; lower trainer.mini_batches")
        return self

    @model_validator(mode="after")
    def _teacher_shares_the_vocabulary(self) -> RunConfig:
        teacher = self.trainer.teacher
        if teacher is not None and self.model.path:
            problem = teacher_vocab_problem(self.model.path, teacher.path)
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _lora_adapters_loadable(self) -> RunConfig:
        """`lora_transfer: adapter` publishes peft adapter folders as checkpoint versions, which
        only vLLM's LoRA API loads."""
        if self.weights.lora_transfer != "adapter":
            return self
        key = "weights.lora_transfer: adapter"
        if self.model.lora is None:
            raise ValueError(f"{key} sends LoRA adapters, and model.lora is not set; set "
                             "model.lora or use weights.lora_transfer: merged")
        if self.sync.method != "checkpoint":
            raise ValueError(f"sync.method: {self.sync.method} broadcasts full weights; {key} "
                             "publishes adapter folders through sync.method: checkpoint")
        if self.weights.transport != "shared_fs":
            raise ValueError(f"weights.transport: {self.weights.transport} copies a version's "
                             f"shards only, not its adapter_config.json; {key} needs "
                             "weights.transport: shared_fs")
        return self

    @model_validator(mode="after")
    def _shared_memory_replaces_files(self) -> RunConfig:
        """shared_memory carries the versions checkpoint files would: it is a transport of
        sync.method checkpoint (a broadcast needs no transport of its own)."""
        if self.weights.transport == "shared_memory" and self.sync.method != "checkpoint":
            raise ValueError(f"weights.transport: shared_memory moves the versions of "
                             f"sync.method: checkpoint; sync.method: {self.sync.method} "
                             "broadcasts them instead: use sync.method: checkpoint (e.g. "
                             "sync.preset: fully_async) or weights.transport: shared_fs")
        return self

    @model_validator(mode="after")
    def _colocation_possible(self) -> RunConfig:
        """placement.colocate: rules across placement, sync, weights and explorers."""
        from .placement import check_colocation

        if problems := check_colocation(self):
            raise ValueError("\n".join(problems))
        return self

    @model_validator(mode="after")
    def _eval_tasksets_answerable(self) -> RunConfig:
        """Every eval task carries the prompt and the answer the evaluating explorer's
        workflow and reward read; checked here so a missing column fails at load, not mid-run."""
        ev = self.eval
        if not ev.enabled:
            return self
        name = self.evaluating_explorer
        if name not in [e.name for e in self.explorers]:
            raise ValueError(f"eval.explorer: no explorer named {name!r} "
                             f"(have {[e.name for e in self.explorers]})")
        args = self.explorer(name).workflow_args
        single = self.explorer(name).workflow == "single_turn"
        answer = ev.answer_key or args.get("answer_key", "answer" if single else None)
        needed = [("eval.answer_key", answer)] if answer else []
        if single:
            needed.append((f"explorers[{name}].workflow_args.prompt_key",
                           args.get("prompt_key", "prompt")))
        for i, ts in enumerate(ev.tasksets):
            key = f"eval.tasksets[{i}]"
            try:
                rows = load_rows(ts.path, ts.split, key=key)
            except ConfigError as exc:
                raise ValueError("; ".join(exc.errors)) from None
            messages = args.get("messages_key", "messages")
            for where, field in needed:
                # single_turn reads a chat's `messages` where a task has no prompt
                missing = next((n for n, row in enumerate(rows) if field not in row and not (
                    where.endswith("prompt_key") and isinstance(row.get(messages), list))), None)
                if missing is not None:
                    raise ValueError(
                        f"{key}: row {missing} of {ts.path} has no {field!r} field (has "
                        f"{sorted(rows[missing])}); the reward needs it: add the column or "
                        f"set {where}")
        return self

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    def terms(self, role: str, name: str) -> dict[str, Any]:
        """What a component named `name` with `role` must agree on with the master, keyed by
        config path: the knobs that change the run (sync plan, model, group and batch sizes).
        A component sends its own in `Register.terms`; the master refuses one that differs."""
        s = self.sync
        out: dict[str, Any] = {"sync.method": s.method, "sync.interval": s.interval,
                               "sync.offset": s.offset, "sync.max_staleness": s.max_staleness}
        if role in ("explorer", "evaluator", "trainer"):
            out["model.path"] = self.model.path
        if role == "explorer":
            for e in self.explorers:
                if e.name == name:
                    out[f"explorers[{name}].batch_size"] = e.batch_size
                    out[f"explorers[{name}].repeat_times"] = e.repeat_times
        if role == "trainer":
            out["trainer.groups_per_step"] = self.trainer.groups_per_step
            out["explorers"] = ",".join(e.name for e in self.rollout_explorers)
        return out

    @property
    def rollout_explorers(self) -> list[ExplorerConfig]:
        """The explorers that roll out steps for the trainer: the ones the sync plan counts."""
        return [e for e in self.explorers if e.role == "rollout"]

    @property
    def evaluating_explorer(self) -> str:
        """The explorer that evaluates (`eval`): `eval.explorer`, else the one with role eval,
        else the first."""
        evals = [e.name for e in self.explorers if e.role == "eval"]
        return self.eval.explorer or (evals[0] if evals else self.explorers[0].name)

    def explorer(self, name: str) -> ExplorerConfig:
        for e in self.explorers:
            if e.name == name:
                return e
        raise KeyError(f"no explorer named {name!r} in explorers (have {[e.name for e in self.explorers]})")


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Load and validate a run config; raises ConfigError listing every bad field.

    The config's `plugins` (and every installed `tandem.plugins` entry point) are imported
    first, so the names they register validate; a relative `.py` plugin path is made absolute
    (against the working directory, else the config file's folder), so every process that
    reads the resolved config finds the same file."""
    data = read_yaml(path) if path is not None else {}
    for assignment in overrides:
        apply_override(data, assignment)
    specs = data.get("plugins") or []
    if not (isinstance(specs, list) and all(isinstance(s, str) for s in specs)):
        specs = []  # not a list of names: validation below reports it by its path
    elif specs:
        where = Path(path).resolve().parent if path is not None else None
        data["plugins"] = specs = [absolute(s, where) for s in specs]
    try:
        load_plugins(specs)
    except ConfigError as exc:
        exc.source = str(path) if path else None
        raise
    return validate(RunConfig, data, source=str(path) if path else None)


__all__ = [
    "PRESETS",
    "BufferConfig",
    "CurveConfig",
    "EngineConfig",
    "EvalConfig",
    "EvalTasksetConfig",
    "ExplorerConfig",
    "LoggingConfig",
    "LoraConfig",
    "MasterConfig",
    "ModelConfig",
    "PlacementConfig",
    "RewardConfig",
    "RunConfig",
    "SamplingConfig",
    "Section",
    "SyncConfig",
    "TasksetConfig",
    "TrainerConfig",
    "TransportConfig",
    "UpConfig",
    "WeightsConfig",
    "apply_override",
    "interpolate_env",
    "load",
    "load_config",
    "read_yaml",
    "validate",
]
