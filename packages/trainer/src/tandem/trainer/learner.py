"""The learner: model, reference, optimiser and one training step, with no sockets.

`Learner.step(experiences)` is a whole trainer step: build the batch, drop uninformative groups,
recompute what the update needs (proximal logprobs, reference logprobs, values), compute
advantages, then for each of `ppo_epochs` epochs shuffle the batch into `mini_batches` parts and
take one optimiser update per part (forward/backward over micro-batches, clip, step).
Under torchrun every rank calls it with the same experiences and trains its own share.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from pathlib import Path
from collections.abc import Mapping, Sequence

import numpy as np
import structlog
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tandem.common.config import RunConfig
from tandem.common.errors import ConfigError
from tandem.common.messages.experience import Experience
from tandem.weights.lora import adapter_state, merged_state
from tandem.weights.vision import (
    ImageInputs, VisionInputs, load_model, restrict, unsampleable_ids, vision_prefix,
    vision_tower)

from . import checkpoint as ckpt
from .algorithms import (
    ADVANTAGES, CORRECTIONS, POLICY_LOSSES, AdvantageInputs, Aggregator, PolicyInputs, ValueHead,
    behaviour_weights, informative_rows, kl_estimate, mismatch_metrics, value_loss)
from .algorithms.corrections import CorrectionInputs, apply_corrections
from .algorithms.distill import teacher_metrics
from .algorithms.length import length_shaping
from .algorithms.masked import masked_mean
from .batch import (
    TrainBatch, build_batch, mini_batch_rows, plan_micro_batches, preference_pairs, shard_rows,
    staleness_metrics)
from .distributed import DistInfo, gradient_sync, resolve_device, wrap
from .forward import Actor, Truncation, token_logprobs, vision_logits
from .lora import add_adapters
from .metrics import MetricAccumulator, combine_updates
from .teacher import Teacher

log = structlog.get_logger(__name__)


def lr_multiplier(step: int, warmup: int, schedule: str, total: int | None,
                  min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then constant or cosine down to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total is None:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Learner:
    """Owns the policy, the optional value head and reference, the optimiser and the schedule."""

    def __init__(self, config: RunConfig, *, dist_info: DistInfo | None = None,
                 resume_from: str | Path | None = None):
        self.config = config
        tc = self.tc = config.trainer
        self.dist = dist_info or DistInfo()
        self.device = resolve_device(tc.device, self.dist)
        tc.check_registered()  # a config validated where the trainer is not installed skipped it
        self.advantage_fn = ADVANTAGES.get(tc.advantage)
        self.loss_fn = POLICY_LOSSES.get(tc.loss.name)
        self.corrections = [(c.name, CORRECTIONS.get(c.name), c.params) for c in tc.corrections]
        # what the loss declared, the only thing the step knows of it
        self.needs = tc.loss.needs
        if not config.model.path:
            raise ConfigError(["model.path: the trainer needs a Hugging Face model folder"])
        seed = tc.seed if tc.seed is not None else config.seed
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        temperature = tc.temperature
        if temperature is None:
            temperature = config.rollout_explorers[0].sampling.temperature
        self.temperature = temperature if temperature > 0 else 1.0
        rollout = config.rollout_explorers[0].sampling
        # what a row's own info.sampling does not say (an experience from elsewhere)
        self.sampling = (rollout.top_k, rollout.top_p)
        self.max_tokens = tc.length.max_tokens or rollout.max_tokens
        self.resume_from = Path(resume_from) if resume_from is not None else None

        lora = self.lora = config.model.lora
        if lora is not None:
            # the base is always model.path; a checkpoint holds the adapters only
            model = load_model(config.model.path, dtype=torch.float32)
            if vision_tower(model) is not None and not tc.freeze_vision:
                raise ConfigError(["trainer.freeze_vision: model.lora adapts the language model "
                                   "only; set trainer.freeze_vision: true to train it on a "
                                   "vision-language model (docs/vision.md)"])
            model = add_adapters(model, lora, config.model.path,
                                 self.resume_from / "adapter" if self.resume_from else None)
        else:
            model_path = self.resume_from / "model" if self.resume_from else Path(config.model.path)
            model = load_model(model_path, dtype=torch.float32)
        # a vision-language model: the images' inputs rebuilt from their bytes, as the engine
        # built them (docs/vision.md)
        self.vision = VisionInputs.of(config.model.path, model)
        if self.vision is not None and tc.freeze_vision:
            vision_tower(model).requires_grad_(False)
        self._unsampleable = (torch.tensor(unsampleable_ids(model.config))
                              if self.vision is not None else None)
        text = model.config.get_text_config()  # a vision-language model's language half
        pad = getattr(text, "pad_token_id", None)
        self.pad_id = pad if pad is not None else 0
        if tc.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        value_head = None
        if tc.needs_value_head:
            value_head = ValueHead(text.hidden_size)
            if self.resume_from:
                ckpt.load_value_head(value_head, self.resume_from)
        self.actor = Actor(model, value_head, fp32_logits=tc.fp32_logits).to(self.device)
        self.wrapped, self.mode = wrap(self.actor, self.dist, self.device, tc.parallel)

        self.reference: nn.Module | None = None
        if tc.needs_reference:
            ref_path = tc.kl.reference_path or config.model.path
            ref_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
            self.reference = load_model(ref_path, dtype=ref_dtype)
            self.reference.to(self.device).eval().requires_grad_(False)
        self.teacher: Teacher | None = None
        if tc.teacher is not None:
            self.teacher = Teacher(tc.teacher, config.model.path,
                                   model.get_output_embeddings().weight.shape[0], self.device,
                                   self.dist)

        # with LoRA only the adapters (and a value head) train: the optimiser holds just them
        self.optimizer = torch.optim.AdamW(
            [p for p in self.wrapped.parameters() if p.requires_grad], lr=tc.lr,
            betas=tc.betas, eps=tc.adam_eps, weight_decay=tc.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_multiplier(s, tc.warmup_steps, tc.schedule,
                                                    tc.total_steps, tc.min_lr_ratio))
        self.step_count = 0
        if self.resume_from:
            state = ckpt.load_training_state(self, self.resume_from)
            self.step_count = state["step"]
            log.info("trainer.resumed", path=str(self.resume_from), step=self.step_count)

    # -- the step ------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Weights version: the number of optimiser steps folded into the current weights."""
        return self.step_count

    def step(self, experiences: Sequence[Experience],
             images: Mapping[str, bytes] | None = None) -> dict[str, float]:
        """One trainer step on these experiences (whole groups); returns its metrics.
        `images`: the normalised bytes of the images they show, by content hash (the
        buffer's sample carries them)."""
        if self.mode == "released":
            raise RuntimeError("Learner.step after release(): this learner has left training")
        tc = self.tc
        start = time.perf_counter()
        batch = build_batch(experiences, self.pad_id, self.sampling,
                            self._image_inputs(experiences, images or {}))
        if self.dist.enabled:  # experience info does not travel to the other ranks: rank 0's
            rows = torch.stack([batch.top_k.double(), batch.top_p.double(),
                                batch.truncated.double()])
            dist.broadcast(rows, src=0)
            batch.top_k, batch.top_p = rows[0].long(), rows[1].float()
            batch.truncated = rows[2] > 0
        pairs = self.needs.pairs
        sampled = batch.num_groups if pairs else batch.size  # a pairs loss splits by pair
        if tc.mini_batches > sampled:
            what = "pairs" if pairs else "sequences"
            raise ConfigError([
                f"trainer.mini_batches: {tc.mini_batches} mini-batches, but step "
                f"{self.step_count} has only {sampled} {what}; lower trainer.mini_batches"])
        metrics = self._batch_metrics(batch)
        if tc.length.shapes_reward or tc.length.filter_truncated:
            batch, shaped = length_shaping(batch, tc.length, self.max_tokens)
            metrics.update(shaped)
        if tc.dynamic_sampling:
            keep, dropped = informative_rows(batch.rewards, batch.groups)
            metrics["dynamic_sampling/dropped_groups"] = float(dropped)
            metrics["dynamic_sampling/informative_groups"] = float(batch.num_groups - dropped)
            batch = batch.select(keep.nonzero().flatten())
        unit = 1
        if pairs:
            batch, dropped = preference_pairs(batch)
            metrics["pairs/dropped_groups"] = float(dropped)
            unit = 2
        if batch.size == 0:
            # The step still counts (the master and the schedule count it), with no update.
            metrics["train/skipped"] = 1.0
            log.warning("train.skipped", reason="no informative groups", step=self.step_count)
            self.scheduler.step()
            self.step_count += 1
            return metrics

        lengths = batch.lengths.tolist()
        shards = shard_rows(lengths, self.dist.world_size, unit)
        plans = [[[shard[i] for i in mb] for mb in
                  plan_micro_batches([lengths[r] for r in shard], tc.micro_batch_tokens, unit)]
                 for shard in shards]
        mine = plans[self.dist.rank]
        n_micro = max(len(p) for p in plans)

        prox_free = not tc.off_policy.proximal
        prep_start = time.perf_counter()
        acc = MetricAccumulator()
        self._prepare(batch, mine, n_micro, acc)
        metrics["time/prepare_s"] = time.perf_counter() - prep_start
        metrics.update(acc.result(self.dist.world_size))

        # The PPO inner loop: every update clips against the same anchor (the batch's behaviour
        # or proximal logprobs), so the ratio leaves 1 only from the second update on.
        n_mini = min(tc.mini_batches, batch.size // unit)  # dynamic sampling may drop groups
        seed = tc.seed if tc.seed is not None else self.config.seed
        updates = []
        for epoch in range(tc.ppo_epochs):
            for rows in mini_batch_rows(batch.size, n_mini, unit, (seed, self.step_count, epoch)):
                mb = batch if len(rows) == batch.size else batch.select(rows)
                # without a proximal pre-pass the first update's forward is the step's first
                # look at the batch: the trainer/engine mismatch is measured there, pre-update
                updates.append(self._update(mb, unit, mismatch=not updates and prox_free))
        self.scheduler.step()
        self.step_count += 1

        metrics.update(combine_updates(updates))
        skipped = sum(u.get("train/skipped_nonfinite", 0.0) for u in updates)
        if skipped:
            metrics["train/skipped_nonfinite"] = skipped
        if len(updates) > 1:
            metrics["train/updates"] = float(len(updates))
            metrics["batch/mini_batches"] = float(n_mini)
        elapsed = time.perf_counter() - start
        metrics["time/step_s"] = elapsed
        metrics["throughput/tokens_per_s"] = float(batch.lengths.sum()) / elapsed
        return metrics

    def _image_inputs(self, experiences: Sequence[Experience], images: Mapping[str, bytes]
                      ) -> dict[str, ImageInputs] | None:
        """The model inputs of each image the experiences show, built once per step from its
        bytes; each row's placeholders checked against its images."""
        shown = sorted({h for e in experiences for h in e.images})
        if self.vision is not None:
            for e in experiences:
                if not e.images and self.vision.image_token_id in e.tokens[:e.prompt_len]:
                    raise ValueError(f"experience {e.id} holds image placeholder tokens but "
                                     "names no images (its workflow does not carry images: "
                                     "docs/vision.md)")
        if not shown:
            return None
        if self.vision is None:
            raise ValueError(f"experience {next(e.id for e in experiences if e.images)} shows "
                             f"images, but model.path {self.config.model.path} has no vision "
                             "tower")
        missing = [h for h in shown if h not in images]
        if missing:
            raise ValueError(f"image {missing[0]} ({len(missing)} of {len(shown)}) of the "
                             "step's experiences did not arrive with the sample")
        inputs = {h: self.vision.process([images[h]]) for h in shown}
        for e in experiences:
            if e.images:
                self.vision.check(e.tokens[:e.prompt_len].tolist(),
                                  ImageInputs.cat([inputs[h] for h in e.images]),
                                  f"experience {e.id}")
        return inputs

    def _update(self, batch: TrainBatch, unit: int, mismatch: bool = False) -> dict[str, float]:
        """One optimiser update on `batch` (the step's batch or one mini-batch of it): forward
        and backward over micro-batches, each rank its own share, clip, optimiser step.
        `mismatch`: also report the trainer/engine mismatch of the forward's logprobs."""
        tc = self.tc
        lengths = batch.lengths.tolist()
        shards = shard_rows(lengths, self.dist.world_size, unit)
        plans = [[[shard[i] for i in mb] for mb in
                  plan_micro_batches([lengths[r] for r in shard], tc.micro_batch_tokens, unit)]
                 for shard in shards]
        mine = plans[self.dist.rank]
        n_micro = max(len(p) for p in plans)
        acc = MetricAccumulator()
        metrics: dict[str, float] = {}

        agg = Aggregator(tc.aggregation, total_tokens=float(batch.mask.sum().clamp(min=1)),
                         total_seqs=float(batch.size))
        self.wrapped.train()
        for i in range(n_micro):
            last = i == n_micro - 1
            # the gradient all-reduce runs in the last micro-batch's backward only
            with gradient_sync(self.wrapped, self.mode, last):
                with self._autocast():
                    if i < len(mine):
                        mb = batch.select(mine[i]).to(self.device)
                        loss, m = self._micro_loss(mb, agg, mismatch)
                        acc.add(m, weight=float(mb.mask.sum()))
                    else:  # this rank has fewer micro-batches: keep collectives in step
                        loss = self._dummy_loss()
                # data parallelism averages gradients; the loss is already a share of the sum
                (loss * self.dist.world_size).backward()

        grad_norm = torch.nn.utils.clip_grad_norm_(self.wrapped.parameters(), tc.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        metrics["optim/lr"] = self.scheduler.get_last_lr()[0]
        metrics["optim/grad_norm"] = grad_norm
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            metrics["train/skipped_nonfinite"] = 1.0
            log.warning("train.nonfinite_grad", step=self.step_count, grad_norm=grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(acc.result(self.dist.world_size))
        metrics["batch/micro_batches"] = float(n_micro)
        return metrics

    def _batch_metrics(self, batch: TrainBatch) -> dict[str, float]:
        response = batch.mask.sum(-1)
        metrics = {
            "reward/mean": float(batch.rewards.mean()),
            "reward/std": float(batch.rewards.std()) if batch.size > 1 else 0.0,
            **staleness_metrics(batch, self.version),
            "batch/sequences": float(batch.size),
            "batch/groups": float(batch.num_groups),
            "batch/tokens": float(batch.lengths.sum()),
            "batch/response_len_mean": float(response.mean()),
        }
        if batch.images is not None:
            # the distinct images whose model inputs this step rebuilt from their bytes: what
            # says, from the run dir, that the images reached the trainer
            metrics["batch/images"] = float(len(batch.images.inputs))
        return metrics

    def _autocast(self):
        tc = self.tc
        if self.device.type == "cuda" and tc.precision in ("auto", "bf16"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        if tc.precision == "bf16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return nullcontext()

    @torch.no_grad()
    def _prepare(self, batch: TrainBatch, mine: list[list[int]], n_micro: int,
                 acc: MetricAccumulator) -> None:
        """Fill proximal / reference / value / teacher tensors and the advantages of the whole
        batch.

        Each rank computes its own rows; a sum over ranks assembles the whole batch (every row
        belongs to exactly one rank), so advantages that normalise over groups or the batch see
        every row on every rank.
        """
        tc = self.tc
        shape = batch.mask.shape
        need_prox, need_values = tc.off_policy.proximal, self.actor.value_head is not None
        prox = torch.zeros(shape) if need_prox else None
        values = torch.zeros(shape) if need_values else None
        ref = torch.zeros(shape) if self.reference is not None else None
        teacher = torch.zeros(shape) if self.teacher is not None else None
        if need_prox or need_values:
            self.wrapped.eval()
            for i in range(n_micro):
                with self._autocast():
                    if i >= len(mine):
                        self._dummy_forward()
                        continue
                    mb = batch.select(mine[i]).to(self.device)
                    out = self.wrapped(mb.tokens, mb.attention, self.temperature, None,
                                       self._truncation(mb), _images(mb))
                width = mb.mask.shape[1]
                if prox is not None:
                    prox[mine[i], :width] = out.logprobs.float().cpu()
                if values is not None:
                    values[mine[i], :width] = out.values.float().cpu()
        if ref is not None:
            for rows in mine:
                mb = batch.select(rows).to(self.device)
                with self._autocast():
                    if mb.images is not None:
                        logits, _ = vision_logits(self.reference, mb.tokens, mb.attention,
                                                  _images(mb))
                    else:
                        logits = self.reference(input_ids=mb.tokens, attention_mask=mb.attention,
                                                use_cache=False).logits
                    logits = restrict(logits, self._unsampleable)
                logp, _ = token_logprobs(logits[:, :-1], mb.tokens[:, 1:], self.temperature,
                                         truncation=self._truncation(mb))
                ref[rows, : mb.mask.shape[1]] = logp.float().cpu()
        if teacher is not None:
            for rows in mine:
                mb = batch.select(rows).to(self.device)
                logp = self.teacher.score(mb.tokens, mb.attention, self.temperature,
                                          self._truncation(mb))
                teacher[rows, : mb.mask.shape[1]] = logp.cpu()
        if self.dist.enabled:
            for tensor in (prox, values, ref, teacher):
                if tensor is not None:
                    dist.all_reduce(tensor)
        mask = batch.mask
        for tensor in (prox, values, ref, teacher):
            if tensor is not None:
                tensor.mul_(mask)
        batch.proximal, batch.old_values, batch.reference = prox, values, ref

        # the student's logprobs of its samples: those the update anchors to
        anchor = prox if prox is not None else batch.behaviour
        if teacher is not None:
            acc.add(teacher_metrics(anchor, teacher, mask) if self.dist.is_main else {},
                    weight=float(mask.sum()))
        if self.needs.advantages:
            token_rewards = None
            if ref is not None and tc.kl.coef > 0 and tc.kl.placement == "reward":
                token_rewards = -tc.kl.coef * kl_estimate(anchor, ref, tc.kl.estimator) * mask
            adv = self.advantage_fn(
                AdvantageInputs(batch.rewards, batch.groups, mask, token_rewards, values,
                                anchor if teacher is not None else None, teacher), tc)
            batch.advantages, batch.returns = adv.advantages, adv.returns
            adv_mean = {"advantage/mean": masked_mean(batch.advantages, mask)}
            acc.add(adv_mean if self.dist.is_main else {}, weight=float(mask.sum()))
        if prox is not None:
            if self.corrections:
                batch.weights, m = apply_corrections(
                    self.corrections, CorrectionInputs(prox, batch.behaviour, mask))
                acc.add(m if self.dist.is_main else {}, weight=float(mask.sum()))
            elif tc.off_policy.behaviour_weight:
                batch.weights = behaviour_weights(prox, batch.behaviour, mask,
                                                  tc.off_policy.is_cap)
            m = mismatch_metrics(prox, batch.behaviour, mask, tc.off_policy.is_cap)
            # whole-batch values, identical on every rank: added once, on rank 0
            acc.add(m if self.dist.is_main else {}, weight=float(mask.sum()))

    def _micro_loss(self, mb: TrainBatch, agg: Aggregator, mismatch: bool = False
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        tc = self.tc
        entropy = "loss" if tc.entropy_coef > 0 else ("metric" if tc.entropy_metric else None)
        out = self.wrapped(mb.tokens, mb.attention, self.temperature, entropy,
                           self._truncation(mb), _images(mb))
        anchor = mb.proximal if mb.proximal is not None else mb.behaviour
        needs = self.needs
        # the loss gets what it declared and nothing else (a KL term's reference is not its)
        inp = PolicyInputs(out.logprobs, anchor, mb.advantages if needs.advantages else None,
                           mb.mask, mb.weights, mb.reference if needs.reference else None,
                           out.values if needs.value_head else None)
        loss, metrics = self.loss_fn(inp, tc, agg)
        if mismatch:
            metrics.update(mismatch_metrics(out.logprobs, mb.behaviour, mb.mask,
                                            tc.off_policy.is_cap))
        metrics["loss/policy"] = loss.detach()
        if mb.reference is not None:
            kl = kl_estimate(out.logprobs, mb.reference, tc.kl.estimator)
            metrics["kl/reference"] = masked_mean(kl.detach(), mb.mask)
            if tc.kl.coef > 0 and tc.kl.placement == "loss":
                kl_loss = agg(kl, mb.mask)
                loss = loss + tc.kl.coef * kl_loss
                metrics["loss/kl"] = kl_loss.detach()
        if out.entropy is not None:
            metrics["policy/entropy"] = masked_mean(out.entropy.detach(), mb.mask)
            if tc.entropy_coef > 0:
                ent_loss = agg(out.entropy, mb.mask)
                loss = loss - tc.entropy_coef * ent_loss
                metrics["loss/entropy"] = ent_loss.detach()
        if out.values is not None and mb.returns is not None:  # value targets (gae's returns)
            vl, clipped = value_loss(out.values, mb.old_values, mb.returns, tc.value_clip)
            v = agg(vl, mb.mask)
            loss = loss + tc.value_coef * v
            metrics["loss/value"] = v.detach()
            metrics["value/clip_frac"] = masked_mean(clipped.float(), mb.mask)
        metrics["loss/total"] = loss.detach()
        return loss, metrics

    def _truncation(self, mb: TrainBatch) -> Truncation | None:
        return Truncation(mb.top_k, mb.top_p) if self.tc.sampler_truncation else None

    def _dummy_forward(self):
        tokens = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        return self.wrapped(tokens, torch.ones_like(tokens), self.temperature)

    def _dummy_loss(self) -> Tensor:
        out = self._dummy_forward()
        loss = out.logprobs.sum() * 0.0
        if out.values is not None:
            loss = loss + out.values.sum() * 0.0
        return loss

    # -- weights and checkpoints ---------------------------------------------------------------

    def policy_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The policy's weights with Hugging Face names, on CPU (a collective under FSDP); with
        LoRA, the base weights with the adapters merged in.

        On CPU without FSDP these are the live parameters, not copies: use them before the next
        step (publishing does) or clone them.
        """
        full = ckpt.full_model_state(self.actor, self.mode)
        policy = {name[len("model."):]: tensor.detach().to("cpu") for name, tensor in full.items()
                  if name.startswith("model.")}
        if self.lora is not None:  # W + (alpha / r) B A: full weights for every engine
            policy = merged_state(policy, self.lora.alpha / self.lora.r)
        return {name: t.to(dtype) if dtype is not None else t for name, t in policy.items()}

    def frozen_prefix(self) -> str | None:
        """The name prefix of the weights no step changes (`trainer.freeze_vision`: the vision
        tower), which publishing leaves out; None when every weight trains."""
        if self.vision is None or not self.tc.freeze_vision:
            return None
        return vision_prefix(self.actor.model)

    def adapter_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """With LoRA, only the adapters, named as a peft adapter folder names them (what
        `weights.lora_transfer: adapter` publishes), on CPU; a collective under FSDP."""
        full = ckpt.full_model_state(self.actor, self.mode)
        policy = {name[len("model."):]: tensor.detach().to("cpu") for name, tensor in full.items()
                  if name.startswith("model.")}
        return {name: t.to(dtype) if dtype is not None else t
                for name, t in adapter_state(policy).items()}

    def save_checkpoint(self, root: str | Path) -> Path | None:
        """Write checkpoints/step_N (every rank must call it; rank 0 writes)."""
        return ckpt.save(self, Path(root))

    def release(self) -> None:
        """Drop the data-parallel wrapper and the gradients; the learner trains no more.

        DDP's reducer holds the process group; dropped here, before `distributed.shutdown`, it
        cannot free the group later from a finaliser (see there). Idempotent.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if self.mode == "ddp":
            self.wrapped = self.actor
            self.mode = "released"


def _images(mb: TrainBatch) -> ImageInputs | None:
    """The images a micro-batch's rows show, in row order (None: text only)."""
    return mb.images.batch_inputs() if mb.images is not None else None
