"""The tiny Qwen2-VL (tandem.weights.tiny_vlm) loads offline through the Auto classes, and its
processor and model agree on the image placeholders."""

from __future__ import annotations

import pytest

pytest.importorskip("PIL")


def _inputs(path, colours=("red",), sizes=((56, 56),)):
    from PIL import Image
    from transformers import AutoProcessor

    import tandem.weights.tiny_vlm  # noqa: F401  (registers the processor class)

    processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    images = [Image.new("RGB", size, c) for c, size in zip(colours, sizes * len(colours))]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor, processor(text=[text] * len(images), images=images, padding=True,
                                return_tensors="pt")


def test_chat_template_renders_image_parts(tiny_vlm_dir):
    processor, _ = _inputs(tiny_vlm_dir)
    for part in ({"type": "image"}, {"type": "image_url", "image_url": {"url": "a.png"}}):
        text = processor.apply_chat_template(
            [{"role": "user", "content": [part, {"type": "text", "text": "how many?"}]}],
            add_generation_prompt=True, tokenize=False)
        assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>how many?"
                        "<|im_end|>\n<|im_start|>assistant\n")


def test_placeholders_match_the_image_grid(tiny_vlm_dir):
    from tandem.weights.tiny_vlm import IMAGE_PAD

    processor, batch = _inputs(tiny_vlm_dir, colours=("red", "blue"), sizes=((56, 56), (80, 40)))
    merge = processor.image_processor.merge_size
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    per_row = (batch["input_ids"] == image_id).sum(dim=1).tolist()
    expected = (batch["image_grid_thw"].prod(dim=1) // merge ** 2).tolist()
    assert per_row == expected
    assert expected[0] == 16  # a square image: 64 x 64 pixels, 8 x 8 patches, merged 2 x 2
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(dim=1).sum())


def test_generate_and_forward_on_cpu(tiny_vlm_dir):
    import torch
    from transformers import AutoModelForImageTextToText

    processor, batch = _inputs(tiny_vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_dir), local_files_only=True)
    assert model.config.image_token_id == processor.image_token_id
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert batch["input_ids"].shape[1] < out.shape[1] <= batch["input_ids"].shape[1] + 4
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()


def test_the_image_changes_the_logits(tiny_vlm_dir):
    """The vision tower is wired in: two images, same text, different next-token logits."""
    import torch
    from transformers import AutoModelForImageTextToText

    _, batch = _inputs(tiny_vlm_dir, colours=("red", "blue"))
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm_dir), local_files_only=True)
    with torch.no_grad():
        logits = model(**batch).logits[:, -1]
    assert not torch.allclose(logits[0], logits[1])
