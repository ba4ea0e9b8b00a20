"""What the explorer's engine and the trainer share about a vision-language model (docs/vision.md):
loading it, turning a prompt's images into the model's inputs, and its positions.

Both sides rebuild `pixel_values` and `image_grid_thw` from the images' normalised PNG bytes with
the model folder's own image processor, so the trainer sees exactly the inputs the engine
sampled with, and nothing but the bytes travels (stored once per image in the buffer). A
prompt's token ids hold one image placeholder per image as the chat template writes it;
`VisionInputs.expand` widens each to the number of tokens its image becomes, which is what the
experience records. Supported: the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL: multimodal rotary
positions from `get_rope_index`).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Sequence

import torch
from torch import Tensor


def is_vision_model(path: str | Path) -> bool:
    """Whether the model folder holds a vision-language model (its config has a vision tower)."""
    config = Path(path) / "config.json"
    try:
        return "vision_config" in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def load_model(path: str | Path, **kwargs: Any) -> Any:
    """A causal LM or, for a folder holding a vision-language model, its image-text-to-text
    class (transformers' `AutoModelForCausalLM` refuses those); `kwargs` go to
    `from_pretrained`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
    return cls.from_pretrained(str(path), **kwargs)


def _inner(model: Any) -> Any:
    """The family's inner model (vision tower, language model, rotary index) of a model for
    generation, or of a peft model around one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, "model", base)


def vision_tower(model: Any) -> torch.nn.Module | None:
    """The model's vision encoder (with its merger), or None for a text-only model."""
    return getattr(_inner(model), "visual", None)


def vision_prefix(model: Any) -> str | None:
    """The Hugging Face name prefix of the vision tower's weights (`model.visual.`), None for
    a text-only model: published weights leave a frozen tower out, and an engine then keeps
    its own."""
    tower = vision_tower(model)
    if tower is None:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return next(f"{name}." for name, module in base.named_modules() if module is tower)


@dataclass
class ImageInputs:
    """A prompt's images as the model takes them: patches and each image's (t, h, w) grid."""

    pixel_values: Tensor  # [patches, channels * temporal * patch * patch]
    grid_thw: Tensor      # [images, 3] long

    @staticmethod
    def cat(parts: Sequence[ImageInputs | None]) -> ImageInputs | None:
        """Rows' inputs in row order (the order the model consumes placeholders in)."""
        given = [p for p in parts if p is not None]
        if not given:
            return None
        return ImageInputs(torch.cat([p.pixel_values for p in given]),
                           torch.cat([p.grid_thw for p in given]))

    def to(self, device: Any) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.grid_thw.to(device))


class VisionInputs:
    """The image half of a model folder's processor, and its placeholder token."""

    def __init__(self, path: str | Path, model_config: Any):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(str(path), local_files_only=True)
        self.image_token_id = int(model_config.image_token_id)
        # placeholders stand for pixels, never for text: the engine never samples them and
        # the trainer scores the same restricted distribution (`unsampleable`)
        self.unsampleable = unsampleable_ids(model_config)
        self.merge = int(model_config.vision_config.spatial_merge_size)

    @classmethod
    def of(cls, path: str | Path, model: Any) -> VisionInputs | None:
        """The model's vision inputs, or None for a text-only model."""
        if vision_tower(model) is None:
            return None
        return cls(path, model.config)

    def process(self, images: Sequence[bytes]) -> ImageInputs:
        """The model inputs of these images (normalised PNG bytes), in order; deterministic.
        Nothing is cached: a prompt's images are processed once per call (its `n` samples
        share them), and a cache across calls would grow with the taskset (a 448 x 448 image is
        about 5 MB of pixel values)."""
        from PIL import Image

        parts = []
        for data in images:
            with Image.open(io.BytesIO(data)) as im:
                out = self.processor(images=[im.convert("RGB")], return_tensors="pt")
            parts.append(ImageInputs(out["pixel_values"].float(), out["image_grid_thw"].long()))
        if not parts:
            raise ValueError("no images to process")
        return ImageInputs.cat(parts)  # type: ignore[return-value]

    def tokens_per_image(self, inputs: ImageInputs) -> list[int]:
        return (inputs.grid_thw.prod(-1) // self.merge ** 2).tolist()

    def expand(self, ids: Sequence[int], inputs: ImageInputs) -> list[int]:
        """`ids` with each image placeholder widened to the tokens its image becomes; a count
        of placeholders other than the images' is a ValueError."""
        sizes = self.tokens_per_image(inputs)
        spots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(spots) != len(sizes):
            raise ValueError(f"the prompt has {len(spots)} image placeholders for {len(sizes)} "
                             "images; each image needs one (an image content part)")
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_token_id:
                out += [int(t)] * sizes[k]
                k += 1
            else:
                out.append(int(t))
        return out

    def check(self, tokens: Sequence[int], inputs: ImageInputs, where: str) -> None:
        """The placeholders in `tokens` match the images' token counts, else ValueError."""
        have = sum(1 for t in tokens if t == self.image_token_id)
        want = sum(self.tokens_per_image(inputs))
        if have != want:
            raise ValueError(f"{where}: {have} image placeholder tokens, its images make {want}; "
                             "were they rendered with another processor?")


# The logit given to placeholder tokens: its probability underflows to exactly 0 under any
# temperature, and unlike -inf it keeps entropy sums (0 * logit) finite.
UNSAMPLEABLE_LOGIT = -1e9


def restrict(logits: Tensor, unsampleable: Tensor | None) -> Tensor:
    """`logits` ([..., V]) with the unsampleable token ids at `UNSAMPLEABLE_LOGIT`."""
    if unsampleable is None or not unsampleable.numel():
        return logits
    return logits.index_fill(-1, unsampleable.to(logits.device), UNSAMPLEABLE_LOGIT)


def unsampleable_ids(model_config: Any) -> list[int]:
    """The placeholder token ids a vision-language model's responses never hold (image,
    video); empty for a text-only model."""
    return sorted({int(v) for v in (getattr(model_config, "image_token_id", None),
                                    getattr(model_config, "video_token_id", None))
                   if v is not None})


def rope_positions(model: Any, ids: Tensor, attention: Tensor, images: ImageInputs
                   ) -> tuple[Tensor, Tensor]:
    """([3, B, L] multimodal positions, [B, 1] delta) of a batch whose rows hold the images'
    placeholders in order; padding (attention 0) is skipped. A later token's position is its
    index among the row's real tokens plus the delta, in each of the three sections."""
    kinds = (ids == model.config.image_token_id).int()
    # by keyword: Qwen2.5-VL puts second_per_grid_ts where Qwen2-VL has attention_mask
    return _inner(model).get_rope_index(ids, kinds, image_grid_thw=images.grid_thw.to(ids.device),
                                        attention_mask=attention)


__all__ = [
    "UNSAMPLEABLE_LOGIT",
    "ImageInputs",
    "VisionInputs",
    "is_vision_model",
    "load_model",
    "restrict",
    "rope_positions",
    "unsampleable_ids",
    "vision_prefix",
    "vision_tower",
]
