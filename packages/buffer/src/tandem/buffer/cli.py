"""`tandem-buffer --config run.yaml [--set key=value ...] [--address ...]`: serve the buffer."""

from __future__ import annotations

import sys

import click

from tandem.common.cli import config_options, load_config_or_exit, run_component


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options("`buffer`, `explorers`, `transport`", "buffer.capacity=100000")
@click.option("--address", default=None, help="bind here instead of buffer.address")
def main(config_path: str | None, overrides: tuple[str, ...], resume: bool,
         address: str | None) -> None:
    """Serve tandem's durable experience buffer (put, sample, ack, release, stats) over RPC."""
    config = load_config_or_exit("tandem-buffer", config_path, overrides, resume=resume)

    def build():
        from .service import Buffer

        return Buffer(config, address=address)

    sys.exit(run_component("tandem-buffer", config, "buffer", build))


if __name__ == "__main__":
    main()
