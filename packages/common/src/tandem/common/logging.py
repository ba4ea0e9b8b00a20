"""structlog, configured once for every component: pretty on a terminal, JSON lines in files."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import structlog

_configured = False


def configure_logging(
    component: str,
    *,
    level: str = "info",
    run_dir: str | Path | None = None,
    json_console: bool | None = None,
) -> None:
    """Configure structlog and stdlib logging for this process.

    Console: pretty when stderr is a TTY, JSON lines otherwise (or as `json_console` says).
    File: JSON lines in `run_dir/logs/<component>.jsonl` when a run dir is given.
    """
    global _configured
    lvl = getattr(logging, level.upper())
    if json_console is None:
        json_console = not sys.stderr.isatty()
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_tandem", False):
            root.removeHandler(handler)
            handler.close()
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(structlog.stdlib.ProcessorFormatter(
        processor=structlog.processors.JSONRenderer() if json_console
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        foreign_pre_chain=shared,
    ))
    handlers = [console]
    if run_dir is not None:
        path = Path(run_dir) / "logs" / f"{component}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(path)
        file_handler.setFormatter(structlog.stdlib.ProcessorFormatter(
            processor=structlog.processors.JSONRenderer(), foreign_pre_chain=shared))
        handlers.append(file_handler)
    for handler in handlers:
        handler._tandem = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(lvl)
    structlog.configure(
        # filter_by_level first: a disabled debug event costs no rendering work
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component)
    _configured = True
