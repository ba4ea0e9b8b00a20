"""`tandem-trainer --config run.yaml [--set key=value ...] [--resume]`: the trainer process.

Under torchrun every rank runs this same command; rank 0 talks to the master, the buffer and the
weight path, the other ranks follow it (see docs/trainer.md). Exit codes as every tandem CLI:
0 done or stopped, 1 failed at run time, 2 bad config; a domain error is one line.
"""

from __future__ import annotations

import os
import sys

import click

from tandem.common.cli import config_options, load_config_or_exit, run_component


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options("`model`, `trainer`, `sync`, `weights`, `master`, `buffer`", "trainer.lr=1e-6")
def main(config_path: str | None, overrides: tuple[str, ...], resume: bool) -> None:
    """Train the policy on experiences from the buffer, on the master's schedule."""
    config = load_config_or_exit("tandem-trainer", config_path, overrides, resume=resume)
    # torchrun's RANK names the process; torch loads in build(), once the run dir's lock is
    # held and the placement applied (a second trainer on a held run dir then exits before
    # it imports torch, and the first holds the lock seconds sooner)
    rank = int(os.environ.get("RANK", "0"))

    def build():
        import transformers

        from tandem.common.errors import TandemError

        from . import distributed as dd
        from .trainer import Trainer

        info = dd.from_env()

        transformers.utils.logging.disable_progress_bar()
        device = dd.resolve_device(config.trainer.device, info)
        # a collective may wait out a whole publication (sync.timeout) or a training step
        dd.init(info, device, timeout=config.sync.timeout + 600.0)
        try:
            return Trainer(config, dist_info=info)
        except OSError as exc:  # no model folder, an unreadable checkpoint
            raise TandemError(f"trainer cannot load its model (model.path "
                              f"{config.model.path}): {exc}") from None

    name = "trainer" if rank == 0 else f"trainer-rank{rank}"
    try:
        code = run_component("tandem-trainer", config, name, build)
    finally:
        dd = sys.modules.get("tandem.trainer.distributed")
        if dd is not None:  # the process group, if build() got as far as joining it
            dd.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()
