"""`tandem-reward --config run.yaml [--set key=value ...]`: serve reward requests."""

from __future__ import annotations

import sys

import click

from tandem.common.cli import config_options, load_config_or_exit


@click.command()
@config_options("`reward` and `transport`", "reward.workers=4")
@click.option("--address", default=None, help="bind here instead of reward.address")
def main(config_path: str | None, overrides: tuple[str, ...], address: str | None) -> None:
    """Serve tandem reward functions (math, code, k12, vision, format, reward_model) over RPC."""
    import asyncio
    import signal

    from tandem.common.logging import configure_logging
    from tandem.common.sockets import install_uvloop

    config = load_config_or_exit("tandem-reward", config_path, overrides)
    configure_logging("reward", level=config.logging.level, run_dir=config.run_dir)

    from .service import RewardService

    async def run() -> None:
        service = RewardService(config, address=address)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.stop)
        try:
            await service.serve()
        finally:
            await service.close()

    install_uvloop()
    try:
        asyncio.run(run())
    except TandemError as exc:
        click.echo(f"tandem-reward: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
