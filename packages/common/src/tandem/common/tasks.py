"""Reading a taskset's rows: JSONL or Parquet files (a file or a folder of them), or a
`datasets` dataset saved with `save_to_disk`.

One reader for every taskset of a run: the master's training taskset (`master.taskset`) and the
explorers' evaluation tasksets (`eval.tasksets`). Errors are `ConfigError`s naming the config
key the caller passes, so a bad path reads as the key to fix. pyarrow and `datasets` are
imported only for the formats that need them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ConfigError


def load_rows(path: str, split: str | None = None, *, key: str = "master.taskset"
              ) -> list[dict[str, Any]]:
    """Every row of the taskset at `path`, in file order; ConfigError naming `key` on any
    problem (`{key}.path`, `{key}.split`)."""
    where = Path(path)
    if not path or not where.exists():
        raise ConfigError([f"{key}.path: {path!r} does not exist"])
    if where.is_dir() and ((where / "dataset_info.json").exists()
                           or (where / "state.json").exists()
                           or (where / "dataset_dict.json").exists()):
        return _load_saved_dataset(where, split, key)
    files = [where] if where.is_file() else sorted(
        p for p in where.iterdir() if p.suffix in (".jsonl", ".parquet"))
    if not files:
        raise ConfigError([f"{key}.path: no .jsonl or .parquet files in {where}"])
    rows: list[dict[str, Any]] = []
    for file in files:
        if file.suffix == ".jsonl":
            rows.extend(_read_jsonl(file, key))
        elif file.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows.extend(pq.read_table(file).to_pylist())
        else:
            raise ConfigError([f"{key}.path: {file} is neither .jsonl nor .parquet"])
    if not rows:
        raise ConfigError([f"{key}.path: {where} holds no tasks"])
    return rows


def _read_jsonl(file: Path, key: str) -> list[dict[str, Any]]:
    rows = []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError([f"{key}.path: {file}:{lineno}: {exc.msg}"]) from None
            if not isinstance(row, dict):
                raise ConfigError([f"{key}.path: {file}:{lineno}: a task must be a "
                                   f"JSON object, got {type(row).__name__}"])
            rows.append(row)
    return rows


def _load_saved_dataset(path: Path, split: str | None, key: str) -> list[dict[str, Any]]:
    import datasets

    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split is None:
            if len(data) != 1:
                raise ConfigError([f"{key}.split: {path} has splits {sorted(data)}; name one"])
            split = next(iter(data))
        if split not in data:
            raise ConfigError([f"{key}.split: {split!r} not in {sorted(data)}"])
        data = data[split]
    return [dict(row) for row in data]
