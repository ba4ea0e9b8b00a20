"""The distillation teacher served in the trainer's process: a frozen causal LM that scores the
student's sampled tokens (teacher-forced logprobs of each target), on the embedded engine's
device. Under torchrun each rank loads its own copy and scores its own rows, as the KL
reference does."""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
from torch import Tensor

from tandem.common.config.trainer import TeacherConfig, teacher_vocab_problem
from tandem.common.errors import ConfigError

from .distributed import DistInfo, resolve_device
from .forward import Truncation, token_logprobs

log = structlog.get_logger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Teacher:
    """Teacher-forced logprobs of a batch's targets under the teacher model."""

    def __init__(self, config: TeacherConfig, policy_path: str, policy_vocab: int,
                 trainer_device: torch.device, dist_info: DistInfo):
        from transformers import AutoModelForCausalLM

        if not (Path(config.path) / "config.json").is_file():
            raise ConfigError([f"trainer.teacher.path: no Hugging Face model folder at "
                               f"{config.path} (config.json missing)"])
        problem = teacher_vocab_problem(policy_path, config.path)
        if problem:
            raise ConfigError([problem])
        device = config.engine.device
        self.device = resolve_device(device, dist_info) if device else trainer_device
        self.model = AutoModelForCausalLM.from_pretrained(config.path,
                                                          dtype=DTYPES[config.dtype])
        vocab = self.model.get_output_embeddings().weight.shape[0]
        if vocab != policy_vocab:
            raise ConfigError([f"trainer.teacher.path: the teacher at {config.path} has "
                               f"{vocab} output tokens, the policy {policy_vocab}; use a "
                               "teacher with the policy's tokenizer"])
        self.model.to(self.device).eval().requires_grad_(False)
        log.info("teacher.loaded", path=config.path, device=str(self.device), dtype=config.dtype)

    @torch.no_grad()
    def score(self, tokens: Tensor, attention: Tensor, temperature: float,
              truncation: Truncation | None) -> Tensor:
        """[B, L-1] logprob of each tokens[:, 1:] given its prefix, on the caller's device,
        under the same temperature (and sampler truncation) as the student's logprobs."""
        device = tokens.device
        logits = self.model(input_ids=tokens.to(self.device),
                            attention_mask=attention.to(self.device), use_cache=False).logits
        trunc = truncation.to(self.device) if truncation is not None else None
        logp, _ = token_logprobs(logits[:, :-1], tokens[:, 1:].to(self.device), temperature,
                                 truncation=trunc)
        return logp.float().to(device)
