"""The vision runs' synthetic tasks, drawn with Pillow: "how many circles?" and "which colour?".

Each task is one small PNG of 1 to `most` filled circles (one radius; random colour and place, no
two overlapping) on white, plus `distractors` filled squares that do not count.
The answer is the number of circles, graded by the `vision` reward's `{"count": n}` truth.

"Which colour?" (`colour_tasks`) is the easy one, for a run that must show learning in
seconds (tests/e2e/test_vision_up.py): a picture filled with a shade of one of three colours,
the answer the colour's letter (A red, B green, C blue), graded by the `k12` reward's choice letters.

`write_taskset(folder, ...)` writes the PNGs under `folder/images/` and a JSONL taskset per
split beside them; a row's chat `messages` carry the image as a content part whose path is
relative to the taskset (`{"type": "image", "image": "images/....png"}`: tandem.common.tasks
reads it), so the folder moves as a whole. Everything is a function of the seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUESTION = "How many circles?"
PALETTE = [(220, 40, 40), (40, 110, 220), (30, 160, 60), (230, 150, 20), (150, 60, 190),
           (20, 150, 160), (90, 90, 90)]


@dataclass(frozen=True)
class Shape:
    """A filled circle or square: its centre, radius (half the side) and colour."""

    kind: str
    x: int
    y: int
    r: int
    colour: tuple[int, int, int]

    def box(self) -> tuple[int, int, int, int]:
        return (self.x - self.r, self.y - self.r, self.x + self.r, self.y + self.r)


def scene(rng: random.Random, *, size: int, circles: int, distractors: int) -> list[Shape]:
    """`circles` circles of one radius and `distractors` squares at random, none touching
    another (a gap of two pixels) or the border. One radius keeps the task within reach of a
    one-block vision tower trained for a minute: a circle's area says how many there are."""
    radius = max(3, size // 7)
    shapes: list[Shape] = []
    kinds = ["circle"] * circles + ["square"] * distractors
    rng.shuffle(kinds)
    for kind in kinds:
        for _ in range(1000):
            r = radius if kind == "circle" else rng.randint(radius - 1, radius + 1)
            x, y = rng.randint(r + 1, size - r - 2), rng.randint(r + 1, size - r - 2)
            if all((x - s.x) ** 2 + (y - s.y) ** 2 > (r + s.r + 2) ** 2 * (2 if "square" in
                   (kind, s.kind) else 1) for s in shapes):
                shapes.append(Shape(kind, x, y, r, rng.choice(PALETTE)))
                break
        else:
            raise ValueError(f"vision_task: {circles} circles and {distractors} squares do not "
                             f"fit on a {size}x{size} image")
    return shapes


def draw(shapes: list[Shape], size: int, background: tuple[int, int, int] = (255, 255, 255)):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(image)
    for s in shapes:
        (pen.ellipse if s.kind == "circle" else pen.rectangle)(s.box(), fill=s.colour)
    return image


def counting_tasks(folder: Path, split: str, n: int, *, seed: int, size: int = 64,
                   most: int = 4, distractors: int = 0) -> list[dict[str, Any]]:
    """`n` tasks of the split, their images written to `folder/images/{split}-{i}.png`."""
    rng = random.Random(f"{seed}:{split}")
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        count = rng.randint(1, most)
        shapes = scene(rng, size=size, circles=count, distractors=rng.randint(0, distractors))
        name = f"images/{split}-{i:05d}.png"
        draw(shapes, size).save(folder / name, format="PNG")
        rows.append({
            "id": f"circles-{split}-{i}",
            "messages": [{"role": "user", "content": [
                {"type": "image", "image": name}, {"type": "text", "text": QUESTION}]}],
            "answer": str(count),
            "truth": {"count": count},
            "reward_args": {},
        })
    return rows


COLOUR_QUESTION = "Colour?"
COLOURS = {"A": (220, 40, 40), "B": (30, 170, 60), "C": (40, 90, 220)}


def colour_tasks(folder: Path, split: str, n: int, *, seed: int,
                 size: int = 32) -> list[dict[str, Any]]:
    """`n` "which colour?" tasks, their images written to `folder/images/{split}-{i}.png`: the
    whole picture a shade of one `COLOURS` entry (each channel moved by up to 30, so pictures
    differ and the held-out ones are new), the answer its letter. The colours take turns, so an
    unshuffled batch of a multiple of three tasks asks for each equally often: a step's
    advantages then favour no letter over the others, and the policy can only gain by looking. Every patch shows the answer, so
    a random tiny VLM reads it within about 20 supervised steps (a disc on white, a fifth of
    the picture: not within 30)."""
    from PIL import Image

    rng = random.Random(f"{seed}:colour:{split}")
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        letter = sorted(COLOURS)[i % len(COLOURS)]
        name = f"images/{split}-{i:05d}.png"
        shade = tuple(min(255, max(0, c + rng.randint(-30, 30))) for c in COLOURS[letter])
        Image.new("RGB", (size, size), shade).save(folder / name, format="PNG")
        rows.append({
            "id": f"colour-{split}-{i}",
            "messages": [{"role": "user", "content": [
                {"type": "image", "image": name}, {"type": "text", "text": COLOUR_QUESTION}]}],
            "answer": letter,
            "truth": {"answer": letter},
            "reward_args": {},
        })
    return rows


def write_taskset(folder: str | Path, *, seed: int = 0, train: int = 2000, heldout: int = 100,
                  size: int = 64, most: int = 4, distractors: int = 0) -> tuple[Path, Path]:
    """`folder/train.jsonl` and `folder/heldout.jsonl` with their images; returns both paths.
    The splits draw from separate random streams, so the held-out images are never trained on
    (a repeated scene is possible but as likely as any other)."""
    folder = Path(folder)
    paths = []
    for split, n in (("train", train), ("heldout", heldout)):
        rows = counting_tasks(folder, split, n, seed=seed, size=size, most=most,
                              distractors=distractors)
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]
