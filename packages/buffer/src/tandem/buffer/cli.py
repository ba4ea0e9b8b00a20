"""`tandem-buffer --config run.yaml [--set key=value ...] [--address ...]`: serve the buffer."""

from __future__ import annotations

import sys

import click

from tandem.common.cli import config_options, load_config_or_exit


@click.command()
@config_options("`buffer`, `explorers`, `transport`", "buffer.capacity=100000")
@click.option("--address", default=None, help="bind here instead of buffer.address")
def main(config_path: str | None, overrides: tuple[str, ...], address: str | None) -> None:
    """Serve tandem's durable experience buffer (put, sample, ack, release, stats) over RPC."""
    import asyncio
    import signal

    from tandem.common.logging import configure_logging
    from tandem.common.sockets import install_uvloop

    config = load_config_or_exit("tandem-buffer", config_path, overrides)
    configure_logging("buffer", level=config.logging.level, run_dir=config.run_dir,
                      json_console=config.logging.json_console)

    from .service import Buffer

    async def run() -> None:
        buffer = Buffer(config, address=address)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, buffer.stop)
        try:
            await buffer.serve()
        finally:
            await buffer.close()

    install_uvloop()
    try:
        asyncio.run(run())
    except TandemError as exc:
        click.echo(f"tandem-buffer: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
