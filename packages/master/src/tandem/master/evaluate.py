"""`tandem eval CONFIG --checkpoint PATH`: evaluate a saved model on the config's `eval`
tasksets. The evaluation is the explorer's own code (`tandem.explorer.evaluation`, the one an
explorer runs between its steps), started as a process through its CLI,
`python -m tandem.explorer.eval_cli`, since the master never imports a component.

The arguments go to that CLI unparsed, so its options (and `--help`) live in one place."""

from __future__ import annotations

import subprocess
import sys

import click


@click.command("eval", add_help_option=False, context_settings={
    "ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def evaluate(args: tuple[str, ...]) -> None:
    """Evaluate a saved model on the config's `eval` tasksets (pass@k, mean reward);
    `tandem eval --help` lists the options."""
    try:
        code = subprocess.call([sys.executable, "-m", "tandem.explorer.eval_cli", *args])
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
