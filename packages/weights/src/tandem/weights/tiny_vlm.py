"""Build a tiny vision-language model and its processor from nothing: no hub, no download.

A Qwen2-VL from a transformers config (a vision tower of `vision_layers` blocks over
`patch`-pixel patches, a text model shaped like `tandem.weights.tiny`'s), random weights. Its
processor is the family's own (`Qwen2VLProcessor`) around two things built here:

- the character tokenizer of `tandem.weights.tiny`, plus the family's special tokens
  (`<|im_start|>`, `<|im_end|>`, `<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>`,
  `<|video_pad|>`), each one token; `<|im_end|>` ends a turn and is the EOS token;
- the family's image processor with `min_pixels = max_pixels = image_size**2`, so a square image
  is resized to `image_size` x `image_size` and becomes `(image_size / patch)**2` patches, merged
  2 x 2 into `(image_size / patch / 2)**2` `<|image_pad|>` tokens (16 for the default 64 / 8);
  other shapes keep their aspect ratio at about as many pixels.

A chat template renders OpenAI-style content parts (`{"type": "text"}`, `{"type": "image"}`,
`{"type": "image_url"}`): each image part becomes `<|vision_start|><|image_pad|><|vision_end|>`,
which the processor expands to the image's placeholder tokens.

`save_pretrained` writes both to one folder, so `AutoProcessor.from_pretrained(path)` and
`AutoModelForImageTextToText.from_pretrained(path)` load them offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLProcessor

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VLM_SPECIAL = [IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}"
)


class TinyVLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor for images and text, without a video processor.

    transformers' video processors need torchvision, which tandem's venv does not carry, and
    `Qwen2VLProcessor` refuses to exist without one. Registered with `AutoProcessor` for the
    Qwen2-VL config when this module is imported, so `AutoProcessor.from_pretrained` finds it by
    the name saved in `processor_config.json`.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


AutoProcessor.register(Qwen2VLConfig, TinyVLProcessor, exist_ok=True)


def build_vlm_tokenizer(path: str | Path | None = None):
    """The character tokenizer with the Qwen2-VL special tokens and the chat template."""
    from tandem.weights.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VLM_SPECIAL})
    tok.eos_token = IM_END
    tok.chat_template = CHAT_TEMPLATE
    if path is not None:
        _save_tokenizer(tok, Path(path))
    return tok


def _save_tokenizer(tok, path: Path) -> None:
    tok.save_pretrained(str(path))
    # As in tiny.build_tokenizer: name the generic class, or transformers picks the family's
    # tokenizer, whose normaliser drops the whitespace this vocabulary treats as characters.
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2))


def build_tiny_vlm(path: str | Path, *, hidden: int = 192, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, intermediate: int = 576, max_positions: int = 256,
                   vision_layers: int = 1, vision_dim: int = 64, vision_heads: int = 4,
                   patch: int = 8, image_size: int = 64, seed: int = 0):
    """Write a random-init Qwen2-VL plus its processor to `path`; return (model, processor).

    `image_size` must be a multiple of `2 * patch` (the processor resizes to a multiple of the
    merged patch)."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    merge = 2
    if image_size % (patch * merge):
        raise ValueError(f"build_tiny_vlm: image_size {image_size} is not a multiple of "
                         f"2 * patch = {patch * merge}")
    head_dim = hidden // heads
    if head_dim % 2 or (head_dim // 2) % 3:
        raise ValueError(f"build_tiny_vlm: hidden/heads = {head_dim} must be even with half "
                         f"divisible by 3 (the multimodal rotary sections t, h, w)")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_vlm_tokenizer()
    images = Qwen2VLImageProcessorPil(
        min_pixels=image_size * image_size, max_pixels=image_size * image_size,
        patch_size=patch, temporal_patch_size=2, merge_size=merge)
    processor = TinyVLProcessor(image_processor=images, tokenizer=tok,
                                 chat_template=CHAT_TEMPLATE)
    section = head_dim // 2 // 3
    ids = {t: tok.convert_tokens_to_ids(t) for t in VLM_SPECIAL}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [section, section, section]},
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id),
        vision_config=dict(
            depth=vision_layers, embed_dim=vision_dim, hidden_size=hidden,
            num_heads=vision_heads, mlp_ratio=2, patch_size=patch, spatial_merge_size=merge,
            temporal_patch_size=2, in_channels=3),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    _save_tokenizer(tok, path)
    return model, processor
