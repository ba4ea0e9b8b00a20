"""The `trainer` section: algorithm, off-policy corrections, optimiser, batches, checkpoints.

Algorithm names (`advantage`, `loss.name`) are names in the registries of `tandem.common.plugins`
(`ADVANTAGES`, `POLICY_LOSSES`), tandem's own or a plugin's. What a loss needs (a reference
model, pairs, a value head, advantages) and the model of its own parameters are its registered
`LossNeeds`; an advantage estimator that trains a value head declares `value_head=True`. The
rules below read those declarations, never a name. In a process where the trainer is not
installed the registries are empty and those checks are skipped: the trainer checks again when
it starts (`TrainerConfig.check_registered`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from ..errors import ConfigError
from ..plugins import ADVANTAGES, CORRECTIONS, POLICY_LOSSES, LossNeeds, load_installed
from ..registry import Registry
from .base import Section
from .explorer import EngineConfig

Aggregation = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]


class KLConfig(Section):
    """KL divergence to a frozen reference model (the initial policy unless `reference_path`)."""

    coef: float = Field(default=0.0, ge=0, description="0 disables the KL term and the reference")
    estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="k1 = log ratio, k2 = half squared log ratio, k3 = Schulman's")
    placement: Literal["loss", "reward"] = Field(
        default="loss", description="a loss term, or a per-token penalty folded into the reward")
    reference_path: str | None = Field(
        default=None, description="reference model folder; default: model.path")


class OffPolicyConfig(Section):
    """Corrections for samples drawn by an older or different policy (asynchronous presets).

    With `proximal`, the trainer recomputes log-probabilities of the batch with its current
    weights before the update and clips the ratio against them instead of the explorer's
    behaviour log-probabilities. With `behaviour_weight` each token's loss is also multiplied
    by exp(proximal - behaviour) (no gradient): together, the decoupled objective. `is_cap`
    truncates that weight (truncated importance sampling of the trainer/engine mismatch).
    """

    proximal: bool = Field(default=False, description="recompute proximal logprobs as clip anchor")
    behaviour_weight: bool = Field(
        default=False, description="weight tokens by exp(proximal - behaviour); needs proximal")
    is_cap: float | None = Field(
        default=None, gt=0, description="truncate the behaviour weight at this value")

    @model_validator(mode="after")
    def _consistent(self) -> OffPolicyConfig:
        if self.behaviour_weight and not self.proximal:
            raise ValueError("off_policy.behaviour_weight needs off_policy.proximal: true "
                             "(the weight is exp(proximal - behaviour))")
        if self.is_cap is not None and not self.behaviour_weight:
            raise ValueError("off_policy.is_cap truncates the behaviour weight; "
                             "set off_policy.behaviour_weight: true (and proximal: true)")
        return self


class DPOParams(Section):
    """The `dpo` loss's parameters: `trainer.loss: {name: dpo, beta: 0.1}`."""

    beta: float = Field(default=0.1, gt=0, description="DPO inverse temperature")


class CISPOParams(Section):
    """The `cispo_clip` loss's parameters: the IS weight is clip(r, 1 - eps_low, 1 + eps_high)."""

    eps_low: float | None = Field(
        default=None, ge=0, description="lower bound 1 - eps_low; null: none (MiniMax-M1)")
    eps_high: float = Field(default=0.28, gt=0, description="upper bound 1 + eps_high")


class CapParams(Section):
    """`truncated_is` and `seq_is`: the importance weight truncated at `cap`."""

    cap: float = Field(default=2.0, gt=0, description="largest importance weight kept")


class BandParams(Section):
    """`masked_is`, `seq_masked_is` and `icepop`: a ratio outside [lo, hi] is masked."""

    lo: float = Field(default=0.5, ge=0, description="smallest ratio kept")
    hi: float = Field(default=2.0, gt=0, description="largest ratio kept")

    @model_validator(mode="after")
    def _ordered(self) -> BandParams:
        if not self.lo < 1.0 < self.hi:
            raise ValueError(f"lo ({self.lo:g}) < 1 < hi ({self.hi:g}) is needed, or an "
                             "on-policy token would be masked")
        return self


class IcePopParams(BandParams):
    """`icepop`'s band, with the paper's defaults (alpha 0.5, beta 5)."""

    hi: float = Field(default=5.0, gt=0, description="largest ratio kept")


class M2POParams(Section):
    """`m2po`: the tokens with the largest squared log-ratio are masked until the mean squared
    log-ratio of those left is at most `bound`."""

    bound: float = Field(default=0.04, gt=0, description="second-moment bound tau (paper: 0.04)")


def _params_model(spec: Any, name: str, where: str = "trainer.loss",
                  kind: str = "policy loss") -> type[BaseModel] | None:
    """A loss's (or correction's) declared params model: the class, or its `module:attr`."""
    if isinstance(spec, str):
        module, _, attr = spec.partition(":")
        try:
            spec = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError([f"{where}: the params model {spec!r} of {kind} {name!r} "
                               f"cannot be loaded: {type(exc).__name__}: {exc}"]) from None
    if spec is not None and not (isinstance(spec, type) and issubclass(spec, BaseModel)):
        raise ConfigError([f"{where}: {kind} {name!r} declares params {spec!r}, "
                           "which is not a pydantic model"])
    return spec


class _RegisteredEntry(Section):
    """A registered name (`registry`) with its own parameters beside `name`, checked against
    the model it declares; a plain name is short for `{name: ...}` with the defaults."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, protected_namespaces=())
    registry: ClassVar[Registry]
    kind: ClassVar[str]  # in errors: "unknown {kind} 'x'"

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _registered(self) -> _RegisteredEntry:
        load_installed()
        if not len(self.registry):
            return self  # the trainer is not installed here; it checks when it starts
        if self.name not in self.registry:
            raise ValueError(f"unknown {self.kind} {self.name!r}; registered: "
                             f"{', '.join(self.registry.names())}")
        self.params  # noqa: B018  (validates them; errors name the parameter's key)
        return self


class LossConfig(_RegisteredEntry):
    """`trainer.loss`: a registered policy loss and its own parameters; the plain name
    (`trainer.loss: ppo_clip`) is short for `{name: ppo_clip}`."""

    registry = POLICY_LOSSES
    kind = "policy loss"

    name: str = Field(
        default="ppo_clip",
        description="ppo_clip, gspo, pg, sft, dpo (its parameter: beta, default 0.1), "
                    "cispo_clip (eps_low, eps_high), or a plugin's; the loss's own parameters "
                    "are keys beside name")

    @property
    def needs(self) -> LossNeeds:
        """What this loss declared it needs (a ConfigError if no such loss is registered)."""
        needs = POLICY_LOSSES.declares(self.name).get("needs", LossNeeds())
        if not isinstance(needs, LossNeeds):
            raise ConfigError([f"trainer.loss: policy loss {self.name!r} of plugin "
                               f"{POLICY_LOSSES.entry(self.name).plugin} declares needs="
                               f"{needs!r}, not a LossNeeds"])
        return needs

    @property
    def declared_needs(self) -> LossNeeds | None:
        """`needs`, or None in a process where no policy loss is registered."""
        return self.needs if len(POLICY_LOSSES) else None

    @property
    def params(self) -> BaseModel | None:
        """The loss's parameters validated by its declared model (None if it declares none).
        A bad or unknown parameter is a ValidationError located at the parameter's key."""
        model = _params_model(self.needs.params, self.name)
        return _declared_params(model, dict(self.model_extra or {}), "LossConfig",
                                f"policy loss {self.name}")


def _declared_params(model: type[BaseModel] | None, given: dict[str, Any], title: str,
                     what: str) -> BaseModel | None:
    """`given` validated by `model`; unknown keys a ValidationError located at each key."""
    known = set() if model is None else {
        key for name, f in model.model_fields.items() for key in (name, f.alias) if key}
    unknown = [k for k in given if k not in known]
    if unknown:
        message = ("not a parameter of {what}; its parameters: {takes}" if known
                   else "{what} takes no parameters")
        error = PydanticCustomError("parameter", message,
                                    {"what": what, "takes": ", ".join(sorted(known))})
        raise ValidationError.from_exception_data(title, [
            InitErrorDetails(type=error, loc=(key,), input=given[key]) for key in unknown])
    return None if model is None else model.model_validate(given)


class CorrectionConfig(_RegisteredEntry):
    """One entry of `trainer.corrections`: a registered off-policy correction and its own
    parameters beside `name` (`{name: masked_is, lo: 0.5, hi: 2.0}`); a plain name is short
    for `{name: ...}` with the defaults."""

    registry = CORRECTIONS
    kind = "off-policy correction"

    name: str = Field(description="truncated_is, masked_is, seq_is, seq_masked_is, icepop, m2po, "
                                  "or a plugin's (docs/trainer.md \"Off-policy corrections\")")

    @property
    def params(self) -> BaseModel | None:
        """The parameters validated by the model the correction declares (`params=`)."""
        model = _params_model(CORRECTIONS.declares(self.name).get("params"), self.name,
                              "trainer.corrections", "off-policy correction")
        return _declared_params(model, dict(self.model_extra or {}), "CorrectionConfig",
                                f"off-policy correction {self.name}")


class LengthShapingConfig(Section):
    """Length shaping of each sequence's reward before the advantages (DAPO's overlong reward
    shaping and a linear length penalty), and DAPO's overlong filtering. The length |y| is the
    response's action tokens."""

    max_tokens: int | None = Field(
        default=None, ge=1,
        description="the cap L_max; default the first rollout explorer's sampling.max_tokens")
    overlong_buffer: int = Field(
        default=0, ge=0,
        description="L_cache: over the last this many tokens before the cap the penalty rises "
                    "linearly from 0 to overlong_penalty; 0: off")
    overlong_penalty: float = Field(
        default=1.0, ge=0, description="the overlong penalty at and beyond the cap")
    penalty: float = Field(
        default=0.0, ge=0, description="length penalty: reward -= penalty * |y| / max_tokens")
    filter_truncated: bool = Field(
        default=False,
        description="a response cut at the cap (finish_reason length) trains with its loss "
                    "masked; its reward still counts in its group")

    @model_validator(mode="after")
    def _fits(self) -> LengthShapingConfig:
        if self.max_tokens is not None and self.overlong_buffer > self.max_tokens:
            raise ValueError(f"trainer.length.overlong_buffer ({self.overlong_buffer}) exceeds "
                             f"trainer.length.max_tokens ({self.max_tokens}); lower it")
        return self

    @property
    def shapes_reward(self) -> bool:
        return self.overlong_buffer > 0 or self.penalty > 0


class TeacherEngineConfig(EngineConfig):
    """The teacher's engine: an explorer's engine section, on the trainer's device unless
    told otherwise."""

    device: str | None = Field(
        default=None, description="cpu, cuda, cuda:1 ...; null: the trainer's device (under "
                                  "torchrun cuda is each rank's own)")


class TeacherConfig(Section):
    """On-policy distillation's teacher: a model folder and the engine that serves it, the
    shape of an explorer's model and engine. It scores the student's sampled tokens
    (teacher-forced logprobs of each response token); `trainer.advantage: distill` turns
    teacher minus student into each token's advantage (docs/trainer.md "On-policy
    distillation"). With any other advantage the teacher only measures the reverse KL."""

    path: str = Field(min_length=1, description="the teacher's Hugging Face model folder; its "
                                                "vocabulary must be the policy's")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="the teacher's weights dtype")
    engine: TeacherEngineConfig = Field(
        default_factory=TeacherEngineConfig,
        description="kind transformers: the teacher runs in the trainer's process, each rank "
                    "scoring its own rows")
    coef: float = Field(default=1.0, gt=0,
                        description="distill: weight of teacher - student logprob per token")
    task_advantage: str = Field(
        default="grpo", description="distill: the estimator of the task reward's advantage")
    task_weight: float = Field(
        default=0.0, ge=0,
        description="distill: weight of the task advantage added to the teacher's; 0: the "
                    "teacher alone")

    @model_validator(mode="after")
    def _in_process(self) -> TeacherConfig:
        if self.engine.kind != "transformers":
            raise ValueError(f"trainer.teacher.engine.kind: {self.engine.kind} cannot score "
                             "tokens for the trainer; the teacher runs in the trainer's process "
                             "on the embedded engine: use kind: transformers")
        return self


def _token_table(folder: Path) -> tuple[int | None, Any]:
    """A model folder's vocab_size (config.json) and its tokenizer.json's vocabulary and added
    tokens, each None when the file is not there (another host: the trainer checks)."""
    size = table = None
    config, tokenizer = folder / "config.json", folder / "tokenizer.json"
    if config.is_file():
        size = json.loads(config.read_text()).get("vocab_size")
    if tokenizer.is_file():
        data = json.loads(tokenizer.read_text())
        table = (data.get("model", {}).get("vocab"),
                 sorted((t["id"], t["content"]) for t in data.get("added_tokens") or []))
    return size, table


def teacher_vocab_problem(model_path: str, teacher_path: str) -> str | None:
    """Why the teacher at `teacher_path` cannot score the policy's tokens (a vocabulary of
    another size or other tokens), or None; checks only what both folders show here."""
    model_size, model_table = _token_table(Path(model_path))
    size, table = _token_table(Path(teacher_path))
    if model_size is not None and size is not None and size != model_size:
        return (f"trainer.teacher.path: the teacher at {teacher_path} has vocab_size {size}, "
                f"the policy at {model_path} {model_size}; distillation compares the two "
                "models' logprobs of the same token ids: use a teacher with the policy's "
                "tokenizer")
    if model_table is not None and table is not None and table != model_table:
        return (f"trainer.teacher.path: the teacher at {teacher_path} has another tokenizer "
                f"than the policy at {model_path} (tokenizer.json vocabularies differ); "
                "distillation compares logprobs of the same token ids: use a teacher with the "
                "policy's tokenizer")
    return None


class TrainerConfig(Section):
    """The optimisation loop."""

    device: str = Field(
        default="cpu", description="cpu, cuda, cuda:1 ... (torchrun: cuda = local rank)")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto", description="auto: bf16 autocast on CUDA, fp32 on CPU")
    gradient_checkpointing: bool = Field(default=False, description="recompute activations")
    freeze_vision: bool = Field(
        default=False, description="a vision-language model: train the language model only, "
                                   "its vision tower fixed (needed with model.lora, which "
                                   "adapts the language model only; docs/vision.md)")
    parallel: Literal["auto", "fsdp", "ddp"] = Field(
        default="auto", description="under torchrun: auto = FSDP2 on CUDA, DDP on CPU")
    seed: int | None = Field(default=None, description="default: the run's seed")

    # algorithm
    advantage: str = Field(default="grpo",
                           description="grpo, dr_grpo, rloo, reinforce_pp, gae, distill")
    loss: LossConfig = Field(
        default_factory=LossConfig,
        description="the policy loss: a name, or {name: dpo, beta: 0.1} with its parameters")
    aggregation: Aggregation = Field(
        default="token_mean", description="how token losses become one number")
    clip_low: float = Field(default=0.2, ge=0, description="ratio lower bound is 1 - clip_low")
    clip_high: float = Field(default=0.2, ge=0, description="ratio upper bound is 1 + clip_high")
    dual_clip: float | None = Field(
        default=None, gt=1, description="dual-clip bound c for negative advantages (e.g. 3)")
    entropy_coef: float = Field(default=0.0, ge=0, description="entropy bonus coefficient")
    entropy_metric: bool = Field(default=True, description="report entropy even without a bonus")
    std_eps: float = Field(default=1e-6, gt=0, description="added to std in advantage scaling")
    gamma: float = Field(default=1.0, ge=0, le=1, description="discount (gae, reinforce_pp)")
    lam: float = Field(default=1.0, ge=0, le=1, description="GAE lambda")
    value_coef: float = Field(default=0.5, ge=0, description="value loss coefficient (gae)")
    value_clip: float | None = Field(default=0.2, gt=0, description="value clipping (gae)")
    temperature: float | None = Field(
        default=None, ge=0,
        description="sampling temperature logprobs are computed at; default the first rollout "
                    "explorer's")
    dynamic_sampling: bool = Field(
        default=False,
        description="drop groups whose rewards are all equal (DAPO); the master also gives a "
                    "step extra batches until it has groups_per_step informative groups")
    max_oversample: int = Field(
        default=2, ge=0,
        description="dynamic_sampling: extra explorer batches the master may lease for one step "
                    "(0: only drop, never top up)")
    kl: KLConfig = Field(default_factory=KLConfig)
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    corrections: list[CorrectionConfig] = Field(
        default_factory=list,
        description="off-policy corrections of the proximal/behaviour ratio, composed in order "
                    "(weights multiply, masks add up): [masked_is, {name: icepop, hi: 5}]; "
                    "needs off_policy.proximal")
    sampler_truncation: bool = Field(
        default=False,
        description="apply the explorer's top-k / top-p (recorded with each experience) to the "
                    "trainer's logits before its logprobs, so both policies share a support")
    fp32_logits: bool = Field(
        default=False, description="lm_head and the logits in fp32 under bf16 autocast")
    length: LengthShapingConfig = Field(default_factory=LengthShapingConfig)
    teacher: TeacherConfig | None = Field(
        default=None, description="on-policy distillation's teacher (advantage: distill)")

    # optimiser and schedule
    lr: float = Field(default=1e-5, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = Field(default=(0.9, 0.999))
    adam_eps: float = Field(default=1e-8, gt=0)
    warmup_steps: int = Field(default=0, ge=0)
    schedule: Literal["constant", "cosine"] = Field(
        default="constant", description="after warmup; cosine decays to min_lr_ratio * lr")
    total_steps: int | None = Field(
        default=None, ge=1, description="trainer steps in the run; the cosine horizon")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    max_grad_norm: float = Field(default=1.0, gt=0)

    # batches
    groups_per_step: int = Field(default=8, ge=1, description="groups sampled per trainer step")
    micro_batch_tokens: int = Field(
        default=8192, ge=1, description="padded tokens per micro-batch (gradient accumulation)")
    ppo_epochs: int = Field(
        default=1, ge=1, description="passes over each step's batch, one update per mini-batch")
    mini_batches: int = Field(
        default=1, ge=1,
        description="optimiser updates per epoch: the batch is shuffled and split by sequence")
    drop_older_than: int | None = Field(
        default=None, ge=0,
        description="sample only experiences at most this many versions older than the weights")
    sample_wait: float = Field(
        default=5.0, gt=0, description="seconds one buffer.sample request waits for groups "
                                       "(at most half transport.rpc_timeout, so the wait counts "
                                       "against that bound)")
    idle_timeout: float = Field(
        default=600.0, gt=0, description="seconds without a trainable batch before giving up")

    # outputs
    checkpoint_every: int = Field(default=0, ge=0, description="steps between checkpoints; 0 = end")
    keep_checkpoints: int = Field(default=2, ge=1, description="checkpoint folders kept")
    tensorboard: bool = Field(default=True, description="write metrics to run_dir/tensorboard")

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        if self.schedule == "cosine" and self.total_steps is None:
            raise ValueError("trainer.schedule: cosine needs trainer.total_steps (the horizon)")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise ValueError("trainer.warmup_steps exceeds trainer.total_steps; lower warmup_steps")
        if self.corrections and not self.off_policy.proximal:
            raise ValueError("trainer.corrections weigh the ratio of the proximal and behaviour "
                             "policies; set trainer.off_policy.proximal: true")
        if self.corrections and self.off_policy.behaviour_weight:
            raise ValueError("trainer.off_policy.behaviour_weight and trainer.corrections both "
                             "weight tokens; write the weight as a correction instead: "
                             "corrections: [{name: truncated_is, cap: ...}]")
        self._teacher_consistent()
        needs = self.loss.declared_needs
        if needs is None or needs.advantages:
            return self
        loss = f"trainer.loss: {self.loss.name}"
        if self.advantage in ADVANTAGES and self.advantage_trains_value_head:
            raise ValueError(f"trainer.advantage: {self.advantage} trains a value head for "
                             f"advantages, which {loss} does not use; pick an advantage "
                             "without one (grpo)")
        if self.kl.placement == "reward":
            raise ValueError(f"trainer.kl.placement: reward folds the KL penalty into the "
                             f"advantages, which {loss} does not use; use kl.placement: loss")
        return self

    def _teacher_consistent(self) -> None:
        if not len(ADVANTAGES) or self.advantage not in ADVANTAGES:
            return  # checked where the trainer is installed (check_registered)
        if self.advantage_needs_teacher and self.teacher is None:
            raise ValueError(f"trainer.advantage: {self.advantage} scores the samples with a "
                             "teacher; set trainer.teacher.path to the teacher's model folder")
        teacher = self.teacher
        if teacher is None or not self.advantage_needs_teacher or teacher.task_weight == 0:
            return
        task = teacher.task_advantage
        if task not in ADVANTAGES:
            raise ValueError(ADVANTAGES.unknown(task, "trainer.teacher.task_advantage"))
        declared = ADVANTAGES.declares(task)
        if declared.get("teacher") or declared.get("value_head"):
            raise ValueError(f"trainer.teacher.task_advantage: {task} needs a "
                             f"{'teacher' if declared.get('teacher') else 'value head'} of "
                             "its own; use an outcome estimator (grpo, dr_grpo, rloo)")

    @property
    def advantage_needs_teacher(self) -> bool:
        """The advantage estimator declared `teacher=True` (it reads the teacher's logprobs)."""
        return bool(ADVANTAGES.declares(self.advantage, "trainer.advantage").get("teacher"))

    @property
    def advantage_trains_value_head(self) -> bool:
        """The advantage estimator declared `value_head=True` (it reads a value head's
        predictions and returns value targets)."""
        return bool(ADVANTAGES.declares(self.advantage, "trainer.advantage").get("value_head"))

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model is loaded for a KL term and for a loss that declares one."""
        return self.kl.coef > 0 or self.loss.needs.reference

    @property
    def needs_value_head(self) -> bool:
        """A value head trains beside the policy for the advantage or for the loss."""
        return self.advantage_trains_value_head or self.loss.needs.value_head

    def check_registered(self) -> None:
        """Run the loss and advantage checks again with the registries loaded (config
        validation skips them where the trainer is not installed); ConfigError if one fails."""
        from .loader import format_validation_error

        load_installed()
        ADVANTAGES.check(self.advantage, "trainer.advantage")
        POLICY_LOSSES.check(self.loss.name)
        for i, correction in enumerate(self.corrections):
            CORRECTIONS.check(correction.name, f"trainer.corrections[{i}].name")
            try:
                correction.params  # noqa: B018
            except ValidationError as exc:
                raise ConfigError([f"trainer.corrections[{i}].{e}"
                                   for e in format_validation_error(exc)]) from None
        try:
            self.loss.params  # noqa: B018
            self._consistent()
        except ValidationError as exc:
            raise ConfigError([f"trainer.loss.{e}" for e in format_validation_error(exc)]) from None
        except ValueError as exc:
            raise ConfigError([str(exc)]) from None
