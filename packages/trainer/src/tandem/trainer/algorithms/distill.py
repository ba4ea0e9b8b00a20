"""On-policy distillation's advantage: the per-token reverse KL to a teacher.

For a response y sampled from the student, the reverse KL KL(student || teacher) is estimated
token by token as log pi_student(y_t) - log pi_teacher(y_t); its negative, teacher minus
student, is each token's advantage (Agarwal et al. 2024, GKD; Thinking Machines' on-policy
distillation). A token the teacher finds likelier than the student is pushed up, one it finds
unlikely is pushed down, with dense per-token signal instead of one outcome per sequence.
`trainer.teacher.task_weight` adds the task reward's own advantage (`task_advantage`, grpo by
default) to it.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from tandem.common.config import TrainerConfig
from tandem.common.plugins import ADVANTAGES

from .advantages import AdvantageInputs, Advantages
from .masked import masked_mean


def reverse_kl(student: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
    """Per-token reverse KL estimate student - teacher logprob ([B, T], zero off the mask)."""
    return (student.double() - teacher.double()) * mask.double()


def distill(inp: AdvantageInputs, cfg: TrainerConfig) -> Advantages:
    """coef * (teacher - student) per token, plus task_weight * the task advantage."""
    if inp.teacher is None or inp.logprobs is None:
        raise ValueError("distill needs the teacher's and the student's logprobs of the "
                         "sampled tokens (trainer.teacher)")
    teacher = cfg.teacher
    if teacher is None:
        raise ValueError("distill needs trainer.teacher")
    adv = -teacher.coef * reverse_kl(inp.logprobs, inp.teacher, inp.mask)
    if teacher.task_weight > 0:
        task = ADVANTAGES.get(teacher.task_advantage, "trainer.teacher.task_advantage")
        adv = adv + teacher.task_weight * task(replace(inp, teacher=None), cfg).advantages.double()
    return Advantages(adv.to(inp.mask.dtype))


def teacher_metrics(student: Tensor, teacher: Tensor, mask: Tensor) -> dict[str, float]:
    """The batch's teacher/student reverse KL (mean over action tokens, and its largest
    sequence mean): what distillation drives down."""
    kl = reverse_kl(student, teacher, mask)
    per_seq = kl.sum(-1) / mask.double().sum(-1).clamp(min=1)
    return {"teacher/reverse_kl": float(masked_mean(kl, mask.double())),
            "teacher/reverse_kl_seq_max": float(per_seq.max()) if per_seq.numel() else 0.0}
