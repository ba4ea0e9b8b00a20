"""The `logging` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class LoggingConfig(Section):
    """Structured logs: pretty on a terminal, JSON lines in files under the run dir."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    json_console: bool | None = Field(
        default=None, description="JSON lines on stderr; default: only when stderr is not a TTY")
    trace: bool = Field(default=True, description="write timed spans to run_dir/trace")
