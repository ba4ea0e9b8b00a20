"""Load a run config: YAML, `--set a.b=c` overrides, `${env:VAR}` interpolation, validation.

Every problem is reported at once, each with its field path and the offending value.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Iterable

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import ConfigError

M = TypeVar("M", bound=BaseModel)

_ENV = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")


def _path_str(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<root>"


def interpolate_env(data: Any, path: tuple = (), errors: list[str] | None = None) -> Any:
    """Replace `${env:VAR}` and `${env:VAR,default}` in every string of the parsed `data`.

    Substitution happens on the parsed tree, so a variable's value is inserted as a string and
    never read as YAML."""
    errors = [] if errors is None else errors
    if isinstance(data, dict):
        return {k: interpolate_env(v, path + (k,), errors) for k, v in data.items()}
    if isinstance(data, list):
        return [interpolate_env(v, path + (i,), errors) for i, v in enumerate(data)]
    if not isinstance(data, str) or "${env:" not in data:
        return data

    def sub(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        errors.append(f"{_path_str(path)}: environment variable {name} is not set")
        return ""

    # The value of a variable is text, never YAML: a Z85 key may hold any of `:#{}[]&*!|>'"%@`
    # and must arrive unchanged. Fields that are numbers or booleans convert the text when the
    # config is validated, as they do for `--set`.
    return _ENV.sub(sub, data)


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` (list items by index: `explorers.0.batch_size=8`)."""
    if "=" not in assignment:
        raise ConfigError([f"--set {assignment!r}: expected key=value"])
    key, raw = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError([f"--set {assignment!r}: empty key"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError([f"--set {key}: value {raw!r} is not valid YAML ({exc})"]) from None
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not part.isdigit() or int(part) > len(node):
                raise ConfigError([f"--set {key}: {part!r} is not an index of {_path_str(parts[:i])}"])
            if int(part) == len(node):  # one past the end appends a new item
                node.append([] if nxt.isdigit() else {})
            node = node[int(part)]
            continue
        if part not in node or node[part] is None:
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) > len(node):
            raise ConfigError([f"--set {key}: {last!r} is not an index of {_path_str(parts[:-1])}"])
        if int(last) == len(node):
            node.append(value)
        else:
            node[int(last)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise ConfigError([f"--set {key}: {_path_str(parts[:-1])} is not a mapping"])


def format_validation_error(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        loc = _path_str(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        value = err.get("input")
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        msg = err["msg"].removeprefix("Value error, ")
        if loc == "<root>":  # a whole-config rule: its message names the keys itself, one
            out.extend(msg.split("\n"))  # problem a line
        elif err["type"] == "missing":
            out.append(f"{loc}: {msg}")
        else:
            out.extend(f"{loc}: {line} (got {shown})" for line in msg.split("\n"))
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read {path}: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {exc}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping, got {type(data).__name__}"])
    return data


def validate(model: type[M], data: dict, overrides: Iterable[str] = (), source: str | None = None) -> M:
    """Apply overrides and env interpolation to `data`, then validate it as `model`."""
    for assignment in overrides:
        apply_override(data, assignment)
    errors: list[str] = []
    data = interpolate_env(data, errors=errors)
    if errors:
        raise ConfigError(errors, source)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc), source) from None


def load(model: type[M], path: str | Path | None = None, overrides: Iterable[str] = ()) -> M:
    """Read YAML at `path` (or start empty), apply `--set` overrides, validate as `model`."""
    data = read_yaml(path) if path is not None else {}
    return validate(model, data, overrides, source=str(path) if path else None)
