"""Images + generated tokens per second of a vision-language model (issue 26 item 6).

One row per way of generating, side by side in one run on the same model, images and sampling:

- `bare generate`: the reference, `model.generate` with the model folder's processor (chat
  template, image processor, left padding), one call per batch, no tandem code in the loop.
- `tandem engine`: the explorer's `TransformersEngine` on the prompts the `single_turn` workflow
  renders from the same rows loaded as a taskset (images read and normalised once, outside the
  timing): per call the image processor, the placeholders widened, the engine's own decode
  loop at the model's multimodal positions (docs/vision.md).

Every response is exactly `--max-tokens` long (temperature 1, `min_new_tokens`), so each row
generates the same number of tokens; `--repeats` rounds, medians reported.

    .venv/bin/python tools/bench_vision.py [--batches 1,16,64] [--max-tokens 16] [--threads 1]
                                           [--repeats 5] [--model DIR] [--out PATH]

A second table is storage: the bytes per experience of the buffer's own database file
(`SqliteStore`, closed, so its WAL is folded in) for `--groups` groups of `--group-size`
responses sampled by the engine, each group sharing its task's image, stored three ways:
`text only` (the same experiences without their images: the floor), `tandem` (each image once
by content hash, the experiences naming it: docs/vision.md) and `pixels per response` (each
experience carrying the processor's outputs the trainer needs, float32 `pixel_values` and
`image_grid_thw`, in its own row, as a design that ships them with every response would).

    .venv/bin/python tools/bench_vision.py --storage-only [--groups 16] [--group-size 8]

Without `--model` it builds the tiny Qwen2-VL (tandem.weights.tiny_vlm) in a temporary folder;
the images are the vision quickstart's circles (tandem.master.vision_task), 64x64 PNGs.
A new row is a function `(model_dir, rows, folder, max_tokens) -> generated tokens`, named in
`ROWS`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def bare_generate(model_dir: Path, rows: list[dict], folder: Path, max_tokens: int) -> Callable:
    """A callable generating for `rows` with `model.generate` and the processor; it returns the
    number of tokens generated."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import tandem.weights.tiny_vlm  # noqa: F401  (registers the tiny VLM's processor class)
    from tandem.master.vision_quickstart import prompt_text, task_image

    processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), local_files_only=True,
                                                        dtype=torch.float32).eval()
    texts = [prompt_text(processor, r) for r in rows]
    images = [task_image(r, folder) for r in rows]

    def run() -> int:
        # The processor's work (resize, normalise, patchify) is part of what a caller pays.
        enc = processor(text=texts, images=images, padding=True, padding_side="left",
                        return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens)
        return int((out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0])

    return run


def tandem_engine(model_dir: Path, rows: list[dict], folder: Path, max_tokens: int) -> Callable:
    """A callable generating for `rows` with tandem's transformers engine; it returns the number
    of tokens generated."""
    from tandem.common.config.master import TasksetFormat
    from tandem.common.messages import Task
    from tandem.common.tasks import load_tasks
    from tandem.explorer.sampling import SamplingParams
    from tandem.explorer.transformers_engine import TransformersEngine
    from tandem.explorer.workflows.single_turn import SingleTurn

    tasks = load_tasks(str(folder / "train.jsonl"),
                       format=TasksetFormat(messages="messages"))[:len(rows)]
    engine = TransformersEngine.from_pretrained(model_dir, max_batch=max(64, len(rows)))
    workflow = SingleTurn(engine.tokenizer)
    prompts = [workflow.render(Task(id=str(i), payload=t)) for i, t in enumerate(tasks)]
    # every response max_tokens long, as the bare row's min_new_tokens makes them
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)

    def run() -> int:
        return sum(len(c) for [c] in engine.generate_sync(prompts, 1, sampling))

    return run


ROWS: dict[str, Callable[..., Callable[[], int]]] = {"bare generate": bare_generate,
                                                      "tandem engine": tandem_engine}


def storage(model_dir: Path, folder: Path, groups: int, group_size: int, max_tokens: int,
            work: Path) -> list[dict[str, Any]]:
    """Bytes per experience of the buffer's database file, stored the three ways of the module
    docstring, for the same sampled experiences."""
    import asyncio

    import numpy as np

    from tandem.buffer import SqliteStore
    from tandem.common.config.master import TasksetFormat
    from tandem.common.images import image_hash
    from tandem.common.messages import Task
    from tandem.common.tasks import load_tasks
    from tandem.explorer.sampling import SamplingParams
    from tandem.explorer.transformers_engine import TransformersEngine
    from tandem.explorer.workflows.base import RolloutContext, Trajectory, make_experience
    from tandem.explorer.workflows.single_turn import SingleTurn

    tasks = [Task(id=str(i), payload=t) for i, t in enumerate(load_tasks(
        str(folder / "train.jsonl"), format=TasksetFormat(messages="messages"))[:groups])]
    engine = TransformersEngine.from_pretrained(model_dir, max_batch=max(64, groups))
    try:
        workflow = SingleTurn(engine.tokenizer)
        prompts = [workflow.render(t) for t in tasks]
        sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
        ctx = RolloutContext(engine=engine, sampling=sampling, repeat_times=group_size,
                             explorer="bench", run="bench")
        experiences, pixels = [], []
        for task, prompt, group in zip(tasks, prompts,
                                       engine.generate_sync(prompts, group_size, sampling)):
            inputs = engine.vision.process(prompt.images)
            pixels.append((inputs.pixel_values.numpy().astype(np.float32).tobytes(),
                           inputs.grid_thw.numpy().astype(np.int64).tobytes()))
            for k, c in enumerate(group):
                traj = Trajectory(c.prompt_ids.tolist(), images=list(prompt.hashes))
                traj.add(c.token_ids, c.logprobs, action=True)
                experiences.append(make_experience(task, k, traj, ctx, reward=0.0,
                                                   rewards={"reward": 0.0}, info={}))
    finally:
        engine.close()
    images = {image_hash(b): b for t in tasks for b in t.payload["images"]}

    def stored(name: str, rows: list, with_images: bool) -> int:
        path = work / f"{name}.sqlite"
        store = SqliteStore(path, synchronous="normal")
        asyncio.run(store.put(rows, [group_size] * len(rows), images if with_images else None))
        store.close_sync()
        return path.stat().st_size

    plain = [e.model_copy(update={"images": []}) for e in experiences]
    per_response = [e.model_copy(update={"images": [], "info": {
        "pixel_values": pixels[i // group_size][0], "image_grid_thw": pixels[i // group_size][1]}})
        for i, e in enumerate(experiences)]
    sizes = {"text only": stored("text", plain, False),
             "tandem": stored("tandem", experiences, True),
             "pixels per response": stored("pixels", per_response, False)}
    n = len(experiences)
    return [{"row": name, "experiences": n, "file_bytes": size, "bytes_per_experience": size / n}
            for name, size in sizes.items()]


def measure(model_dir: Path, data: Path, batches: list[int], max_tokens: int,
            repeats: int) -> list[dict[str, Any]]:
    from tandem.master.vision_quickstart import read_rows

    all_rows = read_rows(data / "train.jsonl")
    results = []
    for batch in batches:
        rows = all_rows[:batch]
        for name, make in ROWS.items():
            run = make(model_dir, rows, data, max_tokens)
            run()  # warm-up: first-call allocations and lazy imports
            seconds, tokens = [], 0
            for _ in range(repeats):
                t0 = time.perf_counter()
                tokens = run()
                seconds.append(time.perf_counter() - t0)
            s = statistics.median(seconds)
            results.append({"row": name, "batch": batch, "seconds": s, "tokens": tokens,
                            "images_per_s": batch / s, "tokens_per_s": tokens / s})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (0: leave torch's setting)")
    parser.add_argument("--model", type=Path, help="a VLM folder (default: build the tiny one)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--groups", type=int, default=16, help="storage: groups (images)")
    parser.add_argument("--group-size", type=int, default=8, help="storage: responses per image")
    parser.add_argument("--storage-only", action="store_true", help="skip the throughput table")
    args = parser.parse_args(argv)

    import torch

    from tandem.master.vision_task import write_taskset

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as tmp:
        data = Path(tmp) / "data"
        write_taskset(data, seed=0, train=max(batches + [args.groups]), heldout=0)
        model_dir = args.model
        if model_dir is None:
            from tandem.weights.tiny_vlm import build_tiny_vlm

            model_dir = Path(tmp) / "model"
            build_tiny_vlm(model_dir)
        results = ([] if args.storage_only
                   else measure(model_dir, data, batches, args.max_tokens, args.repeats))
        sizes = storage(model_dir, data, args.groups, args.group_size, args.max_tokens,
                        Path(tmp))
    if results:
        print(f"{'row':<16}{'batch':>6}{'images/s':>11}{'tokens/s':>11}{'s/batch':>9}")
        for r in results:
            print(f"{r['row']:<16}{r['batch']:>6}{r['images_per_s']:>11.1f}"
                  f"{r['tokens_per_s']:>11.1f}{r['seconds']:>9.3f}")
        print(f"max_tokens={args.max_tokens} threads={args.threads} repeats={args.repeats} "
              f"({platform.processor() or platform.machine()})")
    print(f"{'storage':<22}{'experiences':>12}{'file bytes':>12}{'bytes/exp':>11}")
    for r in sizes:
        print(f"{r['row']:<22}{r['experiences']:>12}{r['file_bytes']:>12}"
              f"{r['bytes_per_experience']:>11.0f}")
    print(f"{args.groups} groups x {args.group_size} responses, one image per group")
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results, "storage": sizes}, indent=2))


if __name__ == "__main__":
    main()
