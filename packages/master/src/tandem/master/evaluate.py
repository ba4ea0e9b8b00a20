"""`tandem eval CONFIG --checkpoint PATH`: evaluate a saved model on the config's `eval`
tasksets. The evaluation is the explorer's own code (`tandem.explorer.evaluation`, the one an
explorer runs between its steps), started as a process through its CLI,
`python -m tandem.explorer.eval_cli`, since the master never imports a component."""

from __future__ import annotations

import subprocess
import sys

import click


@click.command("eval", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False),
              help="a Hugging Face model folder or a trainer checkpoint (step_N)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config key, e.g. --set eval.repeat_times=8 (repeatable)")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="eval.jsonl to append to (default RUN_DIR/eval.jsonl)")
@click.option("--version", "version", type=int, default=None,
              help="version to record (default: N of a step_N path)")
@click.option("--json", "as_json", is_flag=True, help="print the rows as JSON lines")
def evaluate(config_path: str, checkpoint: str, overrides: tuple[str, ...], out: str | None,
             version: int | None, as_json: bool) -> None:
    """Evaluate a saved model on the config's `eval` tasksets (pass@k, mean reward)."""
    argv = [sys.executable, "-m", "tandem.explorer.eval_cli", config_path,
            "--checkpoint", checkpoint]
    for item in overrides:
        argv += ["--set", item]
    if out:
        argv += ["--out", out]
    if version is not None:
        argv += ["--version", str(version)]
    if as_json:
        argv.append("--json")
    try:
        code = subprocess.call(argv)
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
