"""tools/bench_vision.py on the tiny Qwen2-VL: every row generates the tokens it was asked for,
for every image of the batch, and the storage table measures a database file per way of storing
the same experiences. Checks the accounting, never the timings."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_counts_images_and_tokens(tiny_vlm_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_vision", ROOT / "tools" / "bench_vision.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "vision.json"
    bench.main(["--model", str(tiny_vlm_dir), "--batches", "1,3", "--max-tokens", "2",
                "--repeats", "1", "--threads", "0", "--groups", "2", "--group-size", "2",
                "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [(r["row"], r["batch"], r["tokens"]) for r in results] == [
        ("bare generate", 1, 2), ("tandem engine", 1, 2),
        ("bare generate", 3, 6), ("tandem engine", 3, 6)]
    assert all(r["images_per_s"] > 0 for r in results)
    storage = {r["row"]: r for r in json.loads(out.read_text())["storage"]}
    assert list(storage) == ["text only", "tandem", "pixels per response"]
    assert all(r["experiences"] == 4 and r["file_bytes"] > 0 for r in storage.values())
    # 64 patches x 384 float32 per 64x64 image, in each of the 4 rows: far more than a PNG once
    assert storage["pixels per response"]["file_bytes"] > storage["tandem"]["file_bytes"] + 4 * 98_000
