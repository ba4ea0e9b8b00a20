"""Reading a taskset: the user's rows, from files or a dataset, made into the tasks the
workflows read.

Two steps, each a registry that a plugin can add to (`tandem.common.plugins`):

1. A reader (`TASKSET_READERS`, named by `<taskset>.reader`) turns a path into rows:
   `reader(path, split, key) -> list[dict]`. tandem's own are registered here: `jsonl`,
   `parquet` and `csv` (a file, or each such file of a folder), `datasets` (a folder written by
   `save_to_disk`) and `hub` (a dataset name given to `datasets.load_dataset`). A reader that
   declares `suffixes` is picked by a file's suffix when no reader is named, and reads every
   file of a folder that has one of them.
2. A format (`TASKSET_FORMATS`, named by `<taskset>.format.name`) turns one row into one task:
   `format(row, format_config, index) -> dict`. tandem's own, `columns`, maps the user's
   columns onto the keys the workflows read (`TASK_KEYS`). Without a format, rows are tasks as
   they are.

One loader for every taskset of a run: the master's (`master.taskset`) and the explorers'
evaluation tasksets (`eval.tasksets`). Every problem is a one-line `ConfigError` naming the
config key the caller passes, and for a bad row the file, the row (counted from 1 in each
file, a CSV header not counted) and the column. pyarrow and `datasets` are imported only by
the readers that need them. The order of the tasks is the order of the files (sorted by name)
and of the rows in each, so the same config always gives the same taskset.

Images (docs/vision.md): a task's `images` (the format's `images` column) and the image parts
of its `messages` are read here, once, and checked and normalised (`tandem.common.images`):
the task then holds `images`, a list of normalised PNG bytes, and its messages hold
`{"type": "image"}` where each image was. A bad image skips its task, not the run: a one-line
warning names the file, row, task and column, and the caller gets the same line in `skipped`.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import structlog

from .errors import ConfigError
from .images import BadImage, image_parts, is_image_part, load_image, placeholder_messages
from .plugins import TASKSET_FORMATS, TASKSET_READERS
from .registry import plugin_scope, reset_plugin_scope

# The keys of a formatted task, as the `single_turn` workflow reads them by default.
TASK_KEYS = ("prompt", "messages", "system", "answer", "reward_args", "id", "images")

log = structlog.get_logger(__name__)

class BadRow(ValueError):
    """A row that cannot become a task: a format raises it naming the column and what is wrong
    (`field`: the format key that named the column, if any)."""

    def __init__(self, column: str, problem: str, *, field: str | None = None):
        self.column, self.problem, self.field = column, problem, field
        super().__init__(f"column {column!r} {problem}")


@dataclass(frozen=True)
class Source:
    """The rows read from one place (a file, a dataset's split), by name for error messages."""

    name: str
    rows: list[dict[str, Any]]
    folder: Path | None = None  # where relative image paths of its rows are found


# -- loading ----------------------------------------------------------------------------------

def load_rows(path: str, split: str | None = None, *, key: str = "master.taskset",
              reader: str | None = None) -> list[dict[str, Any]]:
    """Every row at `path`, in order, as read (no format); ConfigError naming `key`."""
    rows = [row for source in read_sources(path, split, key=key, reader=reader)
            for row in source.rows]
    if not rows:
        raise ConfigError([f"{key}.path: {path} holds no tasks"])
    return rows


def load_tasks(path: str, split: str | None = None, *, key: str = "master.taskset",
               reader: str | None = None, format: Any = None, id_field: str | None = None,
               skipped: list[str] | None = None, images: bool = True
               ) -> list[dict[str, Any]]:
    """Every task of a taskset, in order: the rows `reader` reads (by suffix or folder shape
    when None), each made a task by `format` (a `TasksetFormat`; None: the row as it is).

    A task's id is under `task_id_key(format, id_field)`; every task must carry one there,
    and no two the same. Any problem is a one-line ConfigError naming `key`, and for a bad
    row its file, row number and column. A task whose image is bad is left out, its one-line
    reason logged and appended to `skipped`; `images=False` leaves images unread (a check of
    the rows alone, before the process that uses the tasks reads them)."""
    formatter = None if format is None else TASKSET_FORMATS.get(format.name, f"{key}.format.name")
    sources = read_sources(path, split, key=key, reader=reader)
    id_key = task_id_key(format, id_field)
    id_at = f"{key}.format.id" if format is not None else f"{key}.id_field"
    tasks: list[dict[str, Any]] = []
    first_seen: dict[str, str] = {}
    for source in sources:
        for n, row in enumerate(source.rows, 1):
            where = f"{source.name} row {n}"
            task = row if formatter is None else _format(formatter, row, format, len(tasks),
                                                         key=key, where=where)
            try:
                if images:
                    task = _with_images(task, format, source.folder)
            except _TaskImageError as exc:
                tid = task.get(id_key) if id_key is not None else None
                line = (f"{key}: {where}{f' (task {str(tid)!r})' if tid is not None else ''}: "
                        f"column {exc.column!r} image {exc.index}: {exc.problem}; task skipped")
                log.warning("taskset.bad_image", error=line)
                if skipped is not None:
                    skipped.append(line)
                continue
            if id_key is not None:
                if task.get(id_key) is None:
                    raise ConfigError([f"{id_at}: {where}: no {id_key!r} (has {_columns(task)})"])
                tid = str(task[id_key])
                if tid in first_seen:
                    raise ConfigError([f"{id_at}: {where}: task id {tid!r} repeats "
                                       f"{first_seen[tid]}; task ids must be unique"])
                first_seen[tid] = where
            tasks.append(task)
    if not tasks:
        raise ConfigError([f"{key}.path: {path} holds no tasks"])
    return tasks


class _TaskImageError(Exception):
    def __init__(self, column: str, index: int, problem: str):
        self.column, self.index, self.problem = column, index, problem


def _with_images(task: dict[str, Any], fmt: Any, base: Path | None) -> dict[str, Any]:
    """The task with its images read and normalised (`images`: PNG bytes, in order: the
    `images` column's first, then the messages' parts); the task as it is without any."""
    given = task.get("images")
    messages = task.get("messages")
    parts = image_parts(messages) if isinstance(messages, list) else []
    if given is None and not parts:
        return task
    images_col = (fmt.images if fmt is not None and getattr(fmt, "images", None) else "images")
    messages_col = (fmt.messages if fmt is not None and getattr(fmt, "messages", None)
                    else "messages")
    values = [] if given is None else (list(given) if isinstance(given, (list, tuple))
                                       else [given])
    loaded = []
    for i, value in enumerate([*values, *parts], 1):
        column = images_col if i <= len(values) else messages_col
        number = i if i <= len(values) else i - len(values)
        try:
            loaded.append(load_image(value, base))
        except BadImage as exc:
            raise _TaskImageError(column, number, str(exc)) from None
    task = dict(task, images=loaded)
    if parts:
        task["messages"] = placeholder_messages(messages)
    return task


def task_has_images(task: dict[str, Any]) -> bool:
    """Whether a loaded task carries images."""
    return bool(task.get("images")) or any(
        is_image_part(p) for m in task.get("messages") or [] if isinstance(m, dict)
        for p in (m.get("content") if isinstance(m.get("content"), list) else []))


def task_id_key(format: Any, id_field: str | None) -> str | None:
    """The key of a loaded task that holds its id: `id` where a format maps an id column, the
    raw row's `id_field` without a format; None: tasks are named by their row index."""
    if format is not None:
        return "id" if format.id else None
    return id_field


def read_sources(path: str, split: str | None = None, *, key: str = "master.taskset",
                 reader: str | None = None) -> list[Source]:
    """The rows at `path`, one `Source` per file (or dataset) read, in order."""
    if reader is not None:
        suffixes = TASKSET_READERS.declares(reader, f"{key}.reader").get("suffixes", ())
        if suffixes and Path(path).is_dir():
            return [_read(reader, str(f), split, key) for f in _files(Path(path), suffixes, key)]
        return [_read(reader, path, split, key)]
    where = Path(path)
    if not path or not where.exists():
        raise ConfigError([f"{key}.path: {path!r} does not exist (a dataset on the Hugging Face "
                           f"hub: set {key}.reader: hub)"])
    if where.is_dir() and _is_saved_dataset(where):
        return [_read("datasets", path, split, key)]
    by_suffix = _readers_by_suffix()
    if where.is_file():
        if where.suffix not in by_suffix:
            raise ConfigError([f"{key}.path: {where} has no known suffix "
                               f"({', '.join(sorted(by_suffix))}); name its reader in "
                               f"{key}.reader"])
        return [_read(by_suffix[where.suffix], path, split, key)]
    return [_read(by_suffix[f.suffix], str(f), split, key)
            for f in _files(where, tuple(by_suffix), key)]


def _read(name: str, path: str, split: str | None, key: str) -> Source:
    read = TASKSET_READERS.get(name, f"{key}.reader")
    try:
        rows = read(path, split, key)
    except ConfigError:
        raise
    except Exception as exc:  # a reader's own failure: one line naming what it read
        raise ConfigError([f"{key}.path: {path}: the {name} reader failed: "
                           f"{_one_line(exc)}"]) from None
    if not isinstance(rows, list):
        raise ConfigError([f"{key}.reader: the {name} reader returned "
                           f"{type(rows).__name__}, not a list of rows"])
    label = f"{path} (split {split})" if split and name in ("datasets", "hub") else path
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise ConfigError([f"{key}.path: {label} row {n}: a task must be a mapping of "
                               f"column to value, got {type(row).__name__}"])
    where = Path(path)
    return Source(label, rows, where.parent if where.is_file() else
                  where if where.is_dir() else None)


def _files(folder: Path, suffixes: tuple[str, ...], key: str) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in suffixes)
    if not files:
        raise ConfigError([f"{key}.path: no {', '.join(sorted(suffixes))} files in {folder}"])
    return files


def _readers_by_suffix() -> dict[str, str]:
    """File suffix -> reader name, from what each reader declares (tandem's own first)."""
    out: dict[str, str] = {}
    for name in ("jsonl", "parquet", "csv", *TASKSET_READERS.names()):
        if name in TASKSET_READERS:
            for suffix in TASKSET_READERS.declares(name).get("suffixes", ()):
                out.setdefault(suffix, name)
    return out


def _is_saved_dataset(folder: Path) -> bool:
    return any((folder / marker).exists()
               for marker in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _format(formatter: Callable, row: dict[str, Any], fmt: Any, index: int, *, key: str,
            where: str) -> dict[str, Any]:
    try:
        task = formatter(row, fmt, index)
    except BadRow as exc:
        at = f"{key}.format.{exc.field}" if exc.field else f"{key}.format"
        raise ConfigError([f"{at}: {where}: {' '.join(str(exc).split())}"]) from None
    except KeyError as exc:  # a plugin's format reading a column the row lacks
        raise ConfigError([f"{key}.format: {where}: no column {exc.args[0]!r} "
                           f"(has {_columns(row)})"]) from None
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError([f"{key}.format.name: the {fmt.name} format failed on {where}: "
                           f"{_one_line(exc)}"]) from None
    if not isinstance(task, dict) or not all(isinstance(k, str) for k in task):
        raise ConfigError([f"{key}.format.name: the {fmt.name} format made "
                           f"{type(task).__name__} of {where}, not a mapping with text keys"])
    return task


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _columns(row: dict[str, Any], most: int = 12) -> str:
    names = sorted(map(str, row))
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "") or "no columns"


# -- tandem's readers -------------------------------------------------------------------------

def read_jsonl(path: str, split: str | None, key: str) -> list[dict[str, Any]]:
    """A JSON Lines file: one JSON object per line, blank lines skipped."""
    rows = []
    with open(_existing(path, key), encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError([f"{key}.path: {path}:{lineno}: {exc.msg}"]) from None
            if not isinstance(row, dict):
                raise ConfigError([f"{key}.path: {path}:{lineno}: a task must be a "
                                   f"JSON object, got {type(row).__name__}"])
            rows.append(row)
    return rows


def read_parquet(path: str, split: str | None, key: str) -> list[dict[str, Any]]:
    """A Parquet file, by pyarrow: lists and structs become lists and dicts."""
    import pyarrow.parquet as pq

    return pq.read_table(_existing(path, key)).to_pylist()


def read_csv(path: str, split: str | None, key: str) -> list[dict[str, Any]]:
    """A CSV file with a header row; every value is text (a list or mapping column holds it
    as JSON text, which the `columns` format parses). Blank lines are skipped."""
    rows: list[dict[str, Any]] = []
    with open(_existing(path, key), newline="", encoding="utf-8-sig") as f:
        cells_of = csv.reader(f)
        try:
            header = next(cells_of, None)
            if header is None:
                return rows
            repeated = sorted({c for c in header if header.count(c) > 1})
            if repeated:
                raise ConfigError([f"{key}.path: {path}: the header repeats column "
                                   f"{repeated[0]!r}"])
            for cells in cells_of:
                if not cells:
                    continue
                if len(cells) != len(header):
                    raise ConfigError([f"{key}.path: {path} row {len(rows) + 1} (line "
                                       f"{cells_of.line_num}): {len(cells)} cells, the header "
                                       f"has {len(header)}"])
                rows.append(dict(zip(header, cells)))
        except csv.Error as exc:
            raise ConfigError([f"{key}.path: {path}:{cells_of.line_num}: {exc}"]) from None
    return rows


def read_saved_dataset(path: str, split: str | None, key: str) -> list[dict[str, Any]]:
    """A `datasets` Dataset or DatasetDict written by `save_to_disk`."""
    import datasets

    return _rows_of_split(datasets.load_from_disk(str(_existing(path, key))), split, path, key)


def read_hub(path: str, split: str | None, key: str) -> list[dict[str, Any]]:
    """A dataset `datasets.load_dataset` finds by name: `owner/name` on the Hugging Face hub
    (`owner/name:config` picks a configuration), or a local folder of data files."""
    import datasets

    name, config = path, None
    head, sep, tail = path.rpartition(":")
    if sep and head and tail and "/" not in tail:
        name, config = head, tail
    try:
        data = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # not found, offline, a bad split or config: the library says which
        raise ConfigError([f"{key}.path: datasets.load_dataset({name!r}"
                           f"{f', {config!r}' if config else ''}, split={split!r}) failed: "
                           f"{_one_line(exc)}"]) from None
    return _rows_of_split(data, split, path, key)


def _rows_of_split(data: Any, split: str | None, path: str, key: str) -> list[dict[str, Any]]:
    import datasets

    if isinstance(data, datasets.DatasetDict):
        if split is None:
            if len(data) != 1:
                raise ConfigError([f"{key}.split: {path} has splits {sorted(data)}; name one"])
            split = next(iter(data))
        if split not in data:
            raise ConfigError([f"{key}.split: {split!r} not in {sorted(data)}"])
        data = data[split]
    return data.to_list()


def _existing(path: str, key: str) -> Path:
    where = Path(path)
    if not path or not where.exists():
        raise ConfigError([f"{key}.path: {path!r} does not exist"])
    return where


# -- tandem's format --------------------------------------------------------------------------

def columns_format(row: dict[str, Any], fmt: Any, index: int) -> dict[str, Any]:
    """The user's columns mapped onto the task keys the workflows read: `prompt` (text) or
    `messages` (a list of {role, content}), `system` (with `messages`: a leading system
    message, unless the row's messages start with one), `answer`, `reward_args`, `id`, and
    the `keep` columns as they are."""
    task: dict[str, Any] = {}
    if fmt.prompt:
        task["prompt"] = _text(row, fmt.prompt, "prompt")
    else:
        task["messages"] = _messages(row, fmt.messages)
    system = fmt.system
    if fmt.system_column:
        system = _value(row, fmt.system_column, "system_column", null=True)
        if system is not None and not isinstance(system, str):
            raise BadRow(fmt.system_column, f"must be text, got {type(system).__name__}",
                         field="system_column")
    if system:
        if "prompt" in task:
            task["system"] = system
        elif task["messages"][0]["role"] != "system":
            task["messages"].insert(0, {"role": "system", "content": system})
    if getattr(fmt, "images", None):
        value = _value(row, fmt.images, "images", null=True)
        if value is not None:
            task["images"] = _json_text(value, list)
    if fmt.answer:
        task["answer"] = _value(row, fmt.answer, "answer")
    if fmt.args is not None:
        task["reward_args"] = _reward_args(row, fmt.args)
    if fmt.id:
        tid = _value(row, fmt.id, "id")
        if isinstance(tid, bool) or not isinstance(tid, (str, int)) or tid == "":
            raise BadRow(fmt.id, f"must be non-empty text or an integer, got {tid!r}", field="id")
        task["id"] = str(tid)
    for column in fmt.keep:
        task[column] = _value(row, column, "keep", null=True)
    return task


def _value(row: dict[str, Any], column: str, field: str, *, null: bool = False) -> Any:
    if column not in row:
        raise BadRow(column, f"is missing (the row has {_columns(row)})", field=field)
    value = row[column]
    if value is None and not null:
        raise BadRow(column, "is empty (null)", field=field)
    return value


def _text(row: dict[str, Any], column: str, field: str) -> str:
    value = _value(row, column, field)
    if not isinstance(value, str):
        raise BadRow(column, f"must be text, got {type(value).__name__}", field=field)
    if not value.strip():
        raise BadRow(column, "is empty", field=field)
    return value


def _json_text(value: Any, kind: type) -> Any:
    """A list or mapping held as JSON text (a CSV cell), parsed; anything else as it is."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        if isinstance(parsed, kind):
            return parsed
    return value


def _messages(row: dict[str, Any], column: str) -> list[dict[str, Any]]:
    value = _json_text(_value(row, column, "messages"), list)
    shape = "must be a list of {role, content} messages"

    def bad(problem: str) -> BadRow:
        return BadRow(column, problem, field="messages")

    if not isinstance(value, list):
        raise bad(f"{shape}, got {type(value).__name__}")
    if not value:
        raise bad(f"{shape}, got an empty list")
    messages = []
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict):
            raise bad(f"{shape}; message {i} is {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise bad(f"{shape}; message {i} has no role" if m.get("role") is None else
                      f"{shape}; message {i}'s role must be text, got {m['role']!r}")
        content = m.get("content")
        if content is None:
            raise bad(f"{shape}; message {i} has no content")
        if not isinstance(content, (str, list)) or (
                isinstance(content, list) and not all(isinstance(p, dict) for p in content)):
            raise bad(f"{shape}; message {i}'s content must be text or a list of parts, got "
                      f"{type(content).__name__}")
        messages.append(dict(m))
    if messages[-1]["role"] == "assistant":
        raise bad("ends with an assistant message, the turn the model is to write; drop it "
                  "from the data (its text can be the answer column)")
    return messages


def _reward_args(row: dict[str, Any], spec: str | dict[str, str]) -> dict[str, Any]:
    if isinstance(spec, dict):
        return {arg: _value(row, column, "args", null=True) for arg, column in spec.items()}
    value = _json_text(_value(row, spec, "args", null=True), dict)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadRow(spec, "must be a mapping of reward argument to value (or JSON text of "
                           f"one), got {type(value).__name__}", field="args")
    return value


def _register() -> None:
    token = plugin_scope("common (tandem.common.tasks)")
    try:
        TASKSET_READERS.register("jsonl", read_jsonl, suffixes=(".jsonl",))
        TASKSET_READERS.register("parquet", read_parquet, suffixes=(".parquet",))
        TASKSET_READERS.register("csv", read_csv, suffixes=(".csv",))
        TASKSET_READERS.register("datasets", read_saved_dataset)
        TASKSET_READERS.register("hub", read_hub)
        TASKSET_FORMATS.register("columns", columns_format)
    finally:
        reset_plugin_scope(token)


_register()

__all__ = [
    "TASK_KEYS",
    "BadRow",
    "Source",
    "columns_format",
    "load_rows",
    "load_tasks",
    "read_csv",
    "read_hub",
    "read_jsonl",
    "read_parquet",
    "read_saved_dataset",
    "read_sources",
    "task_has_images",
    "task_id_key",
]
