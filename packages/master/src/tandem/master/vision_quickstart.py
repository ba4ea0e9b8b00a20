"""`tandem quickstart --vision`'s first steps: a tiny VLM that learns to count circles on CPU.

1. Build a tiny Qwen2-VL and its processor (`tandem.weights.tiny_vlm`, no download).
2. Draw the task with Pillow (`vision_task`): "How many circles?" over a 64x64 PNG, answer a
   digit, graded by the `vision` reward's count truth.
3. Warm-start it with a short SFT on the training images, brief so the policy knows the format
   and is better than chance but often wrong: room for RL.

`greedy_answers` is the bare evaluation: `model.generate` with the processor, no engine, the
yardstick the benchmarks and tests hold the multi-process run against.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any
from collections.abc import Callable

from .vision_task import write_taskset

VLM = dict(hidden=192, layers=2, heads=4, kv_heads=2, intermediate=576, max_positions=128,
           vision_layers=1, vision_dim=64, vision_heads=4, patch=8, image_size=64)


def read_rows(taskset: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(taskset).read_text().splitlines() if line]


def task_image(row: dict[str, Any], folder: Path):
    """The row's image (its first image part, a path relative to `folder`), as RGB."""
    from PIL import Image

    part = next(p for m in row["messages"] for p in m["content"] if p["type"] == "image")
    with Image.open(folder / part["image"]) as image:
        return image.convert("RGB")


def prompt_text(processor, row: dict[str, Any]) -> str:
    """The row's chat through the processor's template, ready for the assistant's answer."""
    return processor.apply_chat_template(row["messages"], add_generation_prompt=True,
                                         tokenize=False)


def warm_start_vlm(model_dir: Path, out_dir: Path, taskset: Path, *, steps: int,
                   lr: float = 1e-3, batch: int = 32, seed: int = 0) -> float:
    """Supervised fine-tuning on image + question -> the answer; returns the last loss.
    The loss covers the answer and the turn's end only, not the prompt or its image tokens."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from tandem.weights.tiny_vlm import build_vlm_tokenizer  # also registers the processor class

    torch.manual_seed(seed)
    rng = random.Random(seed)
    processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), local_files_only=True,
                                                        dtype=torch.float32)
    rows = read_rows(taskset)
    images = [task_image(r, taskset.parent) for r in rows]
    tok = processor.tokenizer
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    model.train()
    for _ in range(steps):
        chosen = rng.sample(range(len(rows)), batch)
        texts = [prompt_text(processor, rows[i]) + rows[i]["answer"] + tok.eos_token
                 for i in chosen]
        answer_len = [len(tok(rows[i]["answer"] + tok.eos_token,
                              add_special_tokens=False).input_ids) for i in chosen]
        enc = processor(text=texts, images=[images[i] for i in chosen], padding=True,
                        padding_side="left", return_tensors="pt")
        labels = torch.full_like(enc["input_ids"], -100)
        for j, n in enumerate(answer_len):
            labels[j, -n:] = enc["input_ids"][j, -n:]
        loss = model(**enc, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    build_vlm_tokenizer(out_dir)  # the tokenizer saved as built: its generic class named
    return float(loss.detach())


def greedy_answers(model_dir: Path, taskset: Path, *, max_new_tokens: int = 3,
                   batch: int = 50) -> list[str]:
    """Each task's greedy answer from bare `model.generate` with the processor, in order."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import tandem.weights.tiny_vlm  # noqa: F401  (registers the processor class)

    processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), local_files_only=True,
                                                        dtype=torch.float32).eval()
    rows = read_rows(taskset)
    answers: list[str] = []
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        enc = processor(text=[prompt_text(processor, r) for r in chunk],
                        images=[task_image(r, taskset.parent) for r in chunk], padding=True,
                        padding_side="left", return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        answers += processor.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                          skip_special_tokens=True)
    return answers


def prepare_vision(root: Path, *, seed: int = 0, sft_steps: int = 150, train: int = 2000,
                   heldout: int = 100, say: Callable[[str], None] = lambda _: None
                   ) -> tuple[int, float]:
    """The vision quickstart's data (`data/train.jsonl`, `data/heldout.jsonl` and their
    `data/images/`), `model-init` (a tiny Qwen2-VL and its processor) and `model-sft` (it after
    `sft_steps` of SFT) under `root`. Returns the parameter count and the last SFT loss."""
    from tandem.weights.tiny_vlm import build_tiny_vlm

    train_set, _ = write_taskset(root / "data", seed=seed, train=train, heldout=heldout)
    say(f"1/4 building a tiny Qwen2-VL and its processor in {root / 'model-init'}")
    model, _ = build_tiny_vlm(root / "model-init", seed=seed, **VLM)
    params = sum(p.numel() for p in model.parameters())
    say(f"    {params / 1e6:.2f}M parameters; task: how many circles ({train} training images, "
        f"{heldout} held out)")
    say(f"2/4 SFT warm start, {sft_steps} steps")
    loss = warm_start_vlm(root / "model-init", root / "model-sft", train_set, steps=sft_steps,
                          seed=seed)
    say(f"    loss {loss:.3f}")
    return params, loss
