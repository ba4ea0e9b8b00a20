"""`tandem-trainer --config run.yaml [--set key=value ...] [--resume]`: the trainer process.

Under torchrun every rank runs this same command; rank 0 talks to the master, the buffer and the
weight path, the other ranks follow it (see docs/trainer.md).
"""

from __future__ import annotations

import sys

import click


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="run config YAML (model, trainer, sync, weights, master, buffer sections)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config value, e.g. --set trainer.lr=1e-6 (repeatable)")
@click.option("--resume", is_flag=True,
              help="continue from the newest checkpoint in run_dir/checkpoints (exactly)")
def main(config_path: str | None, overrides: tuple[str, ...], resume: bool) -> None:
    """Train the policy on experiences from the buffer, on the master's schedule."""
    import asyncio
    import signal

    from tandem.common.config import load_config
    from tandem.common.errors import TandemError
    from tandem.common.logging import configure_logging

    try:
        config = load_config(config_path, overrides)
    except TandemError as exc:
        click.echo(f"tandem-trainer: {exc}", err=True)
        sys.exit(2)

    from . import distributed as dd

    info = dd.from_env()
    component = "trainer" if info.rank == 0 else f"trainer-rank{info.rank}"
    configure_logging(component, level=config.logging.level, run_dir=config.run_dir,
                      json_console=config.logging.json_console)

    import transformers

    from tandem.common.sockets import install_uvloop

    from .trainer import Trainer

    transformers.utils.logging.disable_progress_bar()
    trainer = None
    try:
        device = dd.resolve_device(config.trainer.device, info)
        # a collective may wait out a whole publication (sync.timeout) or a training step
        dd.init(info, device, timeout=config.sync.timeout + 600.0)
        trainer = Trainer(config, resume=resume, dist_info=info)
        if not info.is_main:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 decides when the group stops
            trainer.follow()
            return

        async def run() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, trainer.request_stop)
            await trainer.run()

        install_uvloop()
        asyncio.run(run())
    except TandemError as exc:
        click.echo(f"tandem-trainer: {exc}", err=True)
        sys.exit(1)
    finally:
        if trainer is not None:
            trainer.close()
        dd.shutdown()


if __name__ == "__main__":
    main()
