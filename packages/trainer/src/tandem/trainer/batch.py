"""From experiences to padded tensors, and from a batch to micro-batches under a token budget.

Token-level tensors are aligned to *targets*: column j is about token j+1, the token predicted
from position j. So `mask[b, j]` is 1 when tokens[b, j+1] is an action token and
`behaviour[b, j]` is the engine's log-probability of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from tandem.common.messages.experience import Experience
from tandem.weights.vision import ImageInputs


@dataclass
class RowImages:
    """Each row's images (content hashes, in the order of its placeholders) and the model
    inputs of every image, built once per step however many rows show it."""

    rows: list[list[str]]
    inputs: dict[str, ImageInputs]

    def select(self, index: Tensor) -> RowImages:
        return RowImages([self.rows[i] for i in index.tolist()], self.inputs)

    def batch_inputs(self) -> ImageInputs | None:
        """The rows' images concatenated in row order, as the model consumes placeholders."""
        return ImageInputs.cat([self.inputs[h] for row in self.rows for h in row])


@dataclass
class TrainBatch:
    tokens: Tensor          # [B, L] long, right-padded
    attention: Tensor       # [B, L] long
    mask: Tensor            # [B, L-1] float, 1 where the target is an action token
    behaviour: Tensor       # [B, L-1] float, engine logprobs of the targets
    rewards: Tensor         # [B]
    groups: Tensor          # [B] long, 0..G-1 in order of first appearance
    versions: Tensor        # [B] long, policy version that sampled the row
    lengths: Tensor         # [B] long, real tokens per row
    token_versions: Tensor  # [B, L-1] long, version that sampled each target (0 off the mask)
    top_k: Tensor           # [B] long, the sampler's top-k (0: off)
    top_p: Tensor           # [B] float, the sampler's top-p (1: off)
    truncated: Tensor       # [B] bool, the response was cut at its token cap (finish: length)
    # filled in by the learner before the update, all [B, L-1]
    advantages: Tensor | None = None
    proximal: Tensor | None = None
    reference: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    weights: Tensor | None = None
    images: RowImages | None = None  # a vision-language batch: what each row's prompt shows
    extra: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_groups(self) -> int:
        return int(self.groups.unique().numel())

    def select(self, rows: Sequence[int] | Tensor) -> TrainBatch:
        """These rows, with the padding trimmed to their longest."""
        index = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.lengths[index].max()) if index.numel() else 1
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                value = value[index]
                if value.dim() == 2:
                    value = value[:, : width if f.name in ("tokens", "attention") else width - 1]
            elif isinstance(value, RowImages):
                value = value.select(index)
            out[f.name] = value
        return replace(self, **out)

    def to(self, device: torch.device | str) -> TrainBatch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), Tensor)})


def build_batch(experiences: Sequence[Experience], pad_id: int = 0,
                sampling: tuple[int, float] = (0, 1.0),
                images: dict[str, ImageInputs] | None = None) -> TrainBatch:
    """Pad experiences into a `TrainBatch`; raises ValueError naming a malformed experience.

    Each row's top-k / top-p are those its explorer recorded (`info.sampling`), else
    `sampling`; a row is truncated when its `info.finish_reason` is `length`. `images`: the
    model inputs of the images the experiences show, by content hash (each one needed)."""
    if not experiences:
        raise ValueError("build_batch: no experiences")
    lengths = [int(e.tokens.shape[0]) for e in experiences]
    width = max(lengths)
    n = len(experiences)
    tokens = np.full((n, width), pad_id, dtype=np.int64)
    attention = np.zeros((n, width), dtype=np.int64)
    mask = np.zeros((n, width - 1), dtype=np.float32)
    behaviour = np.zeros((n, width - 1), dtype=np.float32)
    token_versions = np.zeros((n, width - 1), dtype=np.int64)
    group_index: dict[str, int] = {}
    groups = np.zeros(n, dtype=np.int64)
    for i, e in enumerate(experiences):
        length, p = lengths[i], e.prompt_len
        if p < 1:
            raise ValueError(f"experience {e.id}: prompt_len is 0; the first token has no "
                             f"context to be predicted from")
        if e.response_len < 1:
            raise ValueError(
                f"experience {e.id}: empty response (prompt_len {p} == {length} tokens)")
        tokens[i, :length] = e.tokens
        attention[i, :length] = 1
        mask[i, p - 1: length - 1] = e.action_mask
        behaviour[i, p - 1: length - 1] = e.logprobs
        token_versions[i, p - 1: length - 1] = e.versions_of_tokens()
        groups[i] = group_index.setdefault(e.group_id, len(group_index))
    shown = None
    if any(e.images for e in experiences):
        missing = sorted({h for e in experiences for h in e.images} - set(images or {}))
        if missing:
            raise ValueError(f"build_batch: image {missing[0]} of the batch did not arrive "
                             f"({len(missing)} missing); the buffer sends each with the sample")
        shown = RowImages([list(e.images) for e in experiences], dict(images or {}))
    return TrainBatch(
        images=shown,
        tokens=torch.from_numpy(tokens), attention=torch.from_numpy(attention),
        mask=torch.from_numpy(mask), behaviour=torch.from_numpy(behaviour),
        rewards=torch.tensor([e.reward for e in experiences], dtype=torch.float32),
        groups=torch.from_numpy(groups),
        versions=torch.tensor([e.policy_version for e in experiences], dtype=torch.long),
        lengths=torch.tensor(lengths, dtype=torch.long),
        token_versions=torch.from_numpy(token_versions),
        top_k=torch.tensor([int(e.info.get("sampling", {}).get("top_k", sampling[0]))
                            for e in experiences], dtype=torch.long),
        top_p=torch.tensor([float(e.info.get("sampling", {}).get("top_p", sampling[1]))
                            for e in experiences], dtype=torch.float32),
        truncated=torch.tensor([e.info.get("finish_reason") == "length" for e in experiences],
                               dtype=torch.bool))


def staleness_metrics(batch: TrainBatch, version: int) -> dict[str, float]:
    """How many versions behind `version` the batch was sampled: per sequence (by its oldest
    token, `policy_version`) and per action token (a response whose weights changed
    mid-generation counts each token at the version that produced it)."""
    sequences = (version - batch.versions).float()
    mask = batch.mask > 0
    tokens = (version - batch.token_versions[mask]).float()
    return {
        "staleness/mean": float(sequences.mean()),
        "staleness/max": float(sequences.max()),
        "staleness/token_mean": float(tokens.mean()) if tokens.numel() else 0.0,
        "staleness/token_max": float(tokens.max()) if tokens.numel() else 0.0,
    }


def preference_pairs(batch: TrainBatch) -> tuple[TrainBatch, int]:
    """Reorder into (chosen, rejected) pairs, for a loss that declares `pairs`: per group the
    best and the worst reward.

    Groups without a preference (all rewards equal) are dropped; returns the pairs and how many
    groups were dropped.
    """
    rows: list[int] = []
    dropped = 0
    for g in batch.groups.unique(sorted=True).tolist():
        members = (batch.groups == g).nonzero().flatten()
        r = batch.rewards[members]
        best, worst = members[int(r.argmax())], members[int(r.argmin())]
        if batch.rewards[best] <= batch.rewards[worst]:
            dropped += 1
            continue
        rows += [int(best), int(worst)]
    return batch.select(rows), dropped


def plan_micro_batches(lengths: Sequence[int], budget: int, unit: int = 1) -> list[list[int]]:
    """Split rows into micro-batches of at most `budget` padded tokens (rows x longest row).

    Rows go in units of `unit` consecutive rows (2 keeps a pairs loss's pairs together), longest first so
    each micro-batch pads little; a unit longer than the budget goes alone.
    """
    units = [list(range(i, min(i + unit, len(lengths)))) for i in range(0, len(lengths), unit)]
    units.sort(key=lambda u: -max(lengths[r] for r in u))
    plan: list[list[int]] = []
    current: list[int] = []
    width = 0
    for u in units:
        w = max(width, max(lengths[r] for r in u))
        if current and (len(current) + len(u)) * w > budget:
            plan.append(current)
            current, w = [], max(lengths[r] for r in u)
        current += u
        width = w
    if current:
        plan.append(current)
    return plan


def shard_rows(lengths: Sequence[int], world_size: int, unit: int = 1) -> list[list[int]]:
    """Deal units of rows to ranks, longest first to the rank with the fewest tokens so far.

    Every rank computes the same plan from the same batch, so no communication is needed.
    """
    units = [list(range(i, min(i + unit, len(lengths)))) for i in range(0, len(lengths), unit)]
    units.sort(key=lambda u: -sum(lengths[r] for r in u))
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for u in units:
        rank = min(range(world_size), key=lambda k: (load[k], k))
        shards[rank] += u
        load[rank] += sum(lengths[r] for r in u)
    return [sorted(s) for s in shards]


def mini_batch_rows(n_rows: int, mini_batches: int, unit: int = 1,
                    seed: Sequence[int] = (0,)) -> list[list[int]]:
    """Shuffle rows (in units of `unit`, so pairs stay together) and deal them into
    `mini_batches` parts of near-equal size, each part's rows in ascending order.

    The shuffle is a pure function of `seed`, so every rank of a torchrun job computes the same
    split with no communication. One part is the whole batch in its own order, unshuffled: one
    mini-batch is exactly the step without mini-batches.
    """
    n_units = n_rows // unit
    if mini_batches < 1 or mini_batches > n_units:
        raise ValueError(f"{mini_batches} mini-batches from {n_units} sequences")
    if mini_batches == 1:
        return [list(range(n_rows))]
    order = np.random.default_rng(list(seed)).permutation(n_units)
    parts = np.array_split(order, mini_batches)
    return [sorted(int(u) * unit + k for u in part for k in range(unit)) for part in parts]
