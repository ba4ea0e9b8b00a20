"""`tandem-explorer --config run.yaml --name NAME [--set key=value ...]`: one explorer process.

Parses and validates first; torch and transformers are imported only after that, so `--help`
and config errors answer at once. Domain errors end as one line and an exit code:
2 for a bad config or name, 1 for a run that failed, 0 for a clean stop (done or SIGTERM).
"""

from __future__ import annotations

import asyncio
import signal
import sys

import click

from tandem.common.errors import ConfigError, TandemError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False),
              help="the run's YAML file")
@click.option("--name", required=True, help="which of `explorers` this process is")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config value, e.g. explorers.0.batch_size=4 (repeatable)")
def main(config_path: str, name: str, overrides: tuple[str, ...]) -> None:
    """Run one explorer: roll out tasks from the master into the buffer."""
    from tandem.common.config import load_config

    try:
        config = load_config(config_path, overrides)
        config.explorer(name)
    except ConfigError as exc:
        click.echo(f"tandem-explorer: {exc}", err=True)
        sys.exit(2)
    except KeyError as exc:
        click.echo(f"tandem-explorer: {exc.args[0]}", err=True)
        sys.exit(2)
    sys.exit(run_explorer(config, name))


def run_explorer(config, name: str) -> int:
    """Serve one explorer until the run stops or SIGTERM/SIGINT; returns an exit code."""
    from tandem.common.logging import configure_logging
    from tandem.common.sockets import install_uvloop

    configure_logging(name, level=config.logging.level, run_dir=config.run_dir,
                      json_console=config.logging.json_console)
    install_uvloop()

    async def serve() -> None:
        from .service import Explorer

        explorer = Explorer(config, name)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # a signal only sets a flag: the running step drains, then sockets close
            loop.add_signal_handler(sig, explorer.request_stop)
        await explorer.serve()

    try:
        asyncio.run(serve())
    except (TandemError, FileNotFoundError, ValueError, RuntimeError) as exc:
        click.echo(f"tandem-explorer {name}: {exc}", err=True)
        return 1
    return 0


if __name__ == "__main__":
    main()
