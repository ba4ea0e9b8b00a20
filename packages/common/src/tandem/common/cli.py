"""What every component CLI shares: `--config` and `--set`, and a bad config as one line.

Imports nothing heavy, so a CLI's `--help` stays instant.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable

import click


def config_options(sections: str, example: str) -> Callable[[Callable], Callable]:
    """Add `--config PATH` and repeatable `--set KEY=VALUE` to a click command."""

    def decorate(fn: Callable) -> Callable:
        fn = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help=f"override a config value, e.g. --set {example}")(fn)
        return click.option("--config", "config_path", type=click.Path(dir_okay=False),
                            default=None,
                            help=f"run config YAML (the {sections} sections are used)")(fn)

    return decorate


def load_config_or_exit(prog: str, config_path: str | None, overrides: Iterable[str]) -> Any:
    """The validated run config, or every problem on stderr as `prog: ...` and exit code 2."""
    from .config import load_config
    from .errors import TandemError

    try:
        return load_config(config_path, overrides)
    except TandemError as exc:
        click.echo(f"{prog}: {exc}", err=True)
        sys.exit(2)
