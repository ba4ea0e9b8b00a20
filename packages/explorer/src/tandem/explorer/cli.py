"""`tandem-explorer --config run.yaml --name NAME [--set key=value ...]`: one explorer process.

Parses and validates first; torch and transformers are imported only after that, so `--help`
and config errors answer at once. Exit codes as every tandem CLI: 0 done or stopped by
SIGTERM/SIGINT, 1 failed at run time, 2 bad config or explorer name; a domain error is one line.
"""

from __future__ import annotations

import sys

import click

from tandem.common.cli import config_options, load_config_or_exit, run_component


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options("`explorers`, `model`, `sync`, `master`, `buffer`, `reward`",
                "explorers.0.batch_size=4")
@click.option("--name", required=True, help="which of `explorers` this process is")
def main(config_path: str | None, overrides: tuple[str, ...], resume: bool, name: str) -> None:
    """Run one explorer: roll out tasks from the master into the buffer."""
    config = load_config_or_exit("tandem-explorer", config_path, overrides,
                                 check=lambda c: c.explorer(name), resume=resume)

    def build():
        from .service import Explorer

        return Explorer(config, name)

    sys.exit(run_component("tandem-explorer", config, name, build))


if __name__ == "__main__":
    main()
