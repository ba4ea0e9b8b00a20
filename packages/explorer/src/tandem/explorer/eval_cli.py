"""`tandem eval CONFIG --checkpoint PATH` (run as `python -m tandem.explorer.eval_cli`):
evaluate a saved model on the run config's `eval` tasksets, alone, with the same code an
explorer runs between its steps (`tandem.explorer.evaluation`).

PATH is a Hugging Face model folder, or a trainer checkpoint (`checkpoints/step_N`, whose
`model/` is used and whose N is the version recorded). A LoRA checkpoint (`step_N/adapter/`, or
any peft adapter folder) is merged into the base model at `model.path` with the trainer's own
merge (`tandem.weights.lora`) and the merged model is evaluated. Rewards are scored in this
process.
Rows are appended to `--out` (default run_dir/eval.jsonl) and printed as a table. Exit codes
as every tandem CLI: 0 done, 1 failed at run time, 2 bad config or checkpoint.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click

from tandem.common.cli import EXIT_FAILED, EXIT_USAGE, fail, load_config_or_exit


def model_folder(checkpoint: Path) -> tuple[Path, int | None]:
    """The model (or adapter) folder a checkpoint path names, and the trainer step it holds."""
    folder = checkpoint
    for sub in ("model", "adapter"):
        if (checkpoint / sub / "config.json").is_file() or \
                (checkpoint / sub / "adapter_config.json").is_file():
            folder = checkpoint / sub
            break
    found = re.search(r"step_(\d+)", str(checkpoint.resolve()))
    return folder, int(found.group(1)) if found else None


def is_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()


def merged_model_folder(base: Path, adapter: Path, out: Path) -> Path:
    """Write the base model with the adapter merged in (and the base's tokenizer) to `out`."""
    import shutil

    from tandem.weights.lora import merge_adapter

    model = merge_adapter(base, adapter)
    model.save_pretrained(str(out), safe_serialization=True)
    for item in base.iterdir():  # the tokenizer and whatever else is not weights or config
        if item.is_file() and item.name != "config.json" and not item.name.endswith(
                (".safetensors", ".bin", ".index.json", ".pt")) and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)
    return out


@click.command("eval", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("config_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--checkpoint", required=True, type=click.Path(exists=True, file_okay=False),
              help="a Hugging Face model folder, a trainer checkpoint (step_N), or a LoRA "
              "adapter checkpoint (merged into model.path)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override a config key, e.g. --set eval.repeat_times=8 (repeatable)")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="eval.jsonl to append to (default RUN_DIR/eval.jsonl)")
@click.option("--version", "version", type=int, default=None,
              help="version to record (default: N of a step_N path)")
@click.option("--json", "as_json", is_flag=True, help="print the rows as JSON lines")
def main(config_path: str, checkpoint: str, overrides: tuple[str, ...], out: str | None,
         version: int | None, as_json: bool) -> None:
    """Evaluate a saved model on the config's `eval` tasksets."""
    config = load_config_or_exit("tandem eval", config_path, overrides)
    if not config.eval.enabled:
        click.echo("tandem eval: eval.tasksets is empty; name at least one taskset", err=True)
        sys.exit(EXIT_USAGE)
    folder, step = model_folder(Path(checkpoint))
    if not (folder / "config.json").is_file() and not is_adapter(folder):
        click.echo(f"tandem eval: --checkpoint {checkpoint} holds no Hugging Face model "
                   "(no config.json, nor model/config.json) and no LoRA adapter "
                   "(no adapter_config.json, nor adapter/adapter_config.json)", err=True)
        sys.exit(EXIT_USAGE)
    version = version if version is not None else step
    if not is_adapter(folder):
        rows = _run(_with_model(config, folder), folder, version, out)
    else:
        rows = _run_adapter(config, folder, version, out)
    for row in rows:
        if as_json:
            click.echo(json.dumps(row))
        else:
            metrics = "  ".join(f"{k} {v:.3f}" for k, v in row["metrics"].items())
            click.echo(f"{row['taskset']} ({row['tasks']} tasks, version {row['version']}): "
                       f"{metrics}")


def _with_model(config, folder: Path):
    return config.model_copy(update={"model": config.model.model_copy(
        update={"path": str(folder)})})


def _run_adapter(config, adapter: Path, version: int | None, out: str | None) -> list[dict]:
    """Merge the adapter into `model.path` in a temporary folder and evaluate that."""
    import tempfile

    base = Path(config.model.path)
    if not (base / "config.json").is_file():
        click.echo(f"tandem eval: --checkpoint {adapter} is a LoRA adapter, and model.path "
                   f"{base} (its base model) holds no Hugging Face model (no config.json)",
                   err=True)
        sys.exit(EXIT_USAGE)
    try:
        import peft  # noqa: F401
    except ImportError:
        click.echo(f"tandem eval: --checkpoint {adapter} is a LoRA adapter, which needs peft; "
                   "pip install peft", err=True)
        sys.exit(EXIT_USAGE)
    with tempfile.TemporaryDirectory(prefix="tandem-eval-merged-") as tmp:
        try:
            merged = merged_model_folder(base, adapter, Path(tmp))
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            sys.exit(fail("tandem eval", exc, EXIT_USAGE))
        return _run(_with_model(config, merged), adapter, version, out)


def _run(config, folder: Path, version: int | None, out: str | None) -> list[dict]:
    import asyncio

    from tandem.common.errors import ConfigError, TandemError
    from tandem.common.logging import configure_logging

    configure_logging("eval", level=config.logging.level)
    try:
        return asyncio.run(evaluate_model(config, version, out, checkpoint=str(folder)))
    except ConfigError as exc:
        sys.exit(fail("tandem eval", exc, EXIT_USAGE))
    except (TandemError, OSError, ValueError) as exc:
        sys.exit(fail("tandem eval", exc, EXIT_FAILED))


async def evaluate_model(config, version: int | None, out: str | None,
                         checkpoint: str | None = None) -> list[dict]:
    """Load `model.path` into the evaluating explorer's engine, evaluate, close; rows name
    `checkpoint` (default `model.path`)."""
    import asyncio

    from .engines import create_engine
    from .evaluation import Evaluator, append_rows
    from .rewards import InProcessScorer
    from .workflows import create_workflow

    name = config.evaluating_explorer
    evaluator = Evaluator(config, name)
    explorer = config.explorer(name)
    engine = await asyncio.to_thread(create_engine, explorer.engine, config.model)
    scorer = InProcessScorer(config.reward)
    try:
        workflow = create_workflow(explorer.workflow, engine.tokenizer, explorer.workflow_args)
        rows = await evaluator.evaluate(engine, workflow, scorer, version=version or 0,
                                        write=False,
                                        checkpoint=checkpoint or config.model.path)
        for row in rows:
            row["version"] = version
        append_rows(Path(out) if out else evaluator.path, rows)
        return rows
    finally:
        await scorer.close()
        engine.close()


if __name__ == "__main__":
    main(prog_name="tandem eval")  # what `tandem eval` runs; usage and help name it
