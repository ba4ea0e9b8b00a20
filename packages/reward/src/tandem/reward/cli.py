"""`tandem-reward --config run.yaml [--set key=value ...]`: serve reward requests."""

from __future__ import annotations

import sys

import click

from tandem.common.cli import config_options, load_config_or_exit, run_component


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options("`reward` and `transport`", "reward.workers=4")
@click.option("--address", default=None, help="bind here instead of reward.address")
def main(config_path: str | None, overrides: tuple[str, ...], resume: bool,
         address: str | None) -> None:
    """Serve tandem reward functions (math, code, k12, vision, format, reward_model) over RPC."""
    config = load_config_or_exit("tandem-reward", config_path, overrides, resume=resume)

    def build():
        from .service import RewardService

        return RewardService(config, address=address)

    sys.exit(run_component("tandem-reward", config, "reward", build))


if __name__ == "__main__":
    main()
