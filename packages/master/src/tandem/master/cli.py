"""The umbrella `tandem` command and `tandem-master`.

Subcommands that live in other modules (`up`, `timeline`, `quickstart`) are imported only when
they are invoked, so `tandem --help` stays instant and a module that is not written yet does not
break the others. Add one by naming it in `LAZY_COMMANDS`: "name": ("module", "attribute").
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import click

from tandem.common.cli import (
    EXIT_FAILED, OneLineFailure, config_options, fail, load_config_or_exit, run_component)
from tandem.common.errors import TandemError
from tandem.common.sync import PRESET_EXPLORERS, PRESETS, preset_explorers

LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    # name: (module, click command attribute, one-line help shown by `tandem --help`)
    "up": ("tandem.master.up", "up", "Start a whole run on this machine as separate processes."),
    "timeline": ("tandem.master.timeline", "timeline", "Draw a run's trace as a timeline."),
    "quickstart": ("tandem.master.quickstart", "quickstart",
                   "Run a tiny end-to-end example on CPU."),
    "eval": ("tandem.master.evaluate", "evaluate",
             "Evaluate a saved model on the config's eval tasksets."),
    "plugins": ("tandem.master.plugins_cmd", "plugins",
                "List every registered plugin item (rewards, workflows, engines, ...)."),
    "warm": ("tandem.master.warm", "warm",
             "Keep torch and tandem up imported; each `tandem up` forks from it."),
    "deploy": ("tandem.master.deploy.cli", "deploy",
               "Render a run for Kubernetes (manifests) or Slurm (an sbatch script)."),
}


class LazyGroup(click.Group):
    """A click group whose `LAZY_COMMANDS` are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(LAZY_COMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None or name not in LAZY_COMMANDS:
            return command
        module_name, attr, help_text = LAZY_COMMANDS[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            return _unavailable(name, module_name, help_text)
        return getattr(module, attr)

    def invoke(self, ctx: click.Context) -> Any:
        # a subcommand's failure reads like every tandem CLI's: `tandem NAME: message`
        try:
            return super().invoke(ctx)
        except (click.UsageError, OneLineFailure):
            raise
        except click.ClickException as exc:
            raise OneLineFailure(f"tandem {ctx.invoked_subcommand}", exc.format_message()
                                 ) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # `tandem --help` lists the lazy commands by their help line, without importing them
        limit = formatter.width - 6 - max(len(n) for n in self.list_commands(ctx))
        rows = []
        for name in self.list_commands(ctx):
            command = self.commands.get(name)
            rows.append((name, command.get_short_help_str(limit) if command is not None
                         else LAZY_COMMANDS[name][2]))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str, module_name: str, help_text: str) -> click.Command:
    def fail() -> None:
        raise click.ClickException(f"`tandem {name}` is not available: {module_name} is missing")
    return click.Command(name, callback=fail, help=help_text, short_help=help_text)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def tandem() -> None:
    """tandem: reinforcement fine-tuning with rollout and training as separate processes."""


def _offset(value: str | None) -> int | None | str:
    if value is None:
        return "unset"
    if value.strip().lower() in ("null", "none", "async"):
        return None
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(f"expected an integer or null, got {value!r}") from None


def _times(value: str) -> list[float]:
    try:
        out = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected seconds, or a comma-separated list, got {value!r}")
    if not out:
        raise click.BadParameter("expected at least one duration")
    return out


@tandem.command()
@click.option("--preset", default="synchronous", show_default=True,
              type=click.Choice(list(PRESETS)), help="starting point for the knobs")
@click.option("--interval", type=int, help="sync.interval (overrides the preset)")
@click.option("--offset", help="sync.offset, an integer or null for asynchronous")
@click.option("--max-staleness", type=int, help="sync.max_staleness")
@click.option("--method", type=click.Choice(["nccl", "checkpoint"]), help="sync.method")
@click.option("--explorers", type=int, help="number of explorers (default: one per rollout time; "
              + "".join(f"{n} for {name}, " for name, n in PRESET_EXPLORERS.items())
              + "else 1)")
@click.option("--steps", type=int, default=8, show_default=True, help="trainer steps to replay")
@click.option("--rollout-time", default="1.0", show_default=True,
              help="seconds per explorer step; a comma list gives each explorer its own")
@click.option("--train-time", type=float, default=1.0, show_default=True,
              help="seconds per trainer step")
@click.option("--sync-time", type=float, default=0.1, show_default=True,
              help="seconds per weight sync (broadcast, or checkpoint write / load)")
@click.option("--gap", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="seconds each block starts after what it waits for (sample and ack, barrier, "
                   "publish, load: plan --from measures each kind)")
@click.option("--threads", default="1,1", show_default=True,
              help="threads of the trainer and of each explorer, for --cores")
@click.option("--json", "as_json", is_flag=True, help="print the timeline as JSON")
@click.option("--png", type=click.Path(dir_okay=False), help="also draw it to this PNG file")
@click.option("--width", type=int, default=96, show_default=True, help="terminal columns")
@click.option("--from", "from_dir", type=click.Path(exists=True, file_okay=False),
              help="take the durations from this run dir's trace and replay every preset and "
                   "your knobs (the run's, or the ones given here) over them")
@click.option("--advise", is_flag=True, help="with --from: recommend the knobs with the most "
              "throughput whose staleness stays within --max-staleness")
@click.option("--cores", type=click.IntRange(min=1), help="the cores the sides share: a side "
              "is stretched while both run on too few (default: as many as they need; with "
              "--from: the run's)")
@click.option("--stretch-from", "stretch_dir", type=click.Path(exists=True, file_okay=False),
              help="with --from: fit how the sides slow each other on shared cores to this "
                   "run's trace (one whose sides overlapped, on the same machine)")
def plan(preset: str, interval: int | None, offset: str | None, max_staleness: int | None,
         method: str | None, explorers: int | None, steps: int, rollout_time: str,
         train_time: float, sync_time: float, gap: float, threads: str, as_json: bool,
         png: str | None,
         width: int, from_dir: str | None, advise: bool, cores: int | None,
         stretch_dir: str | None) -> None:
    """Replay a sync plan over assumed durations and draw the timeline."""
    from tandem.common.sync import SyncPlan

    if advise and (from_dir is None or max_staleness is None):
        raise click.UsageError("--advise needs --from RUN_DIR and --max-staleness K")
    if from_dir is None and stretch_dir is not None:
        raise click.UsageError("--stretch-from needs --from RUN_DIR")
    if from_dir is not None:
        ctx = click.get_current_context()
        given = {k for k in ("preset", "steps")
                 if ctx.get_parameter_source(k) is not click.core.ParameterSource.DEFAULT}
        knobs = {k: v for k, v in dict(interval=interval, method=method).items() if v is not None}
        if max_staleness is not None and not advise:
            knobs["max_staleness"] = max_staleness
        if _offset(offset) != "unset":
            knobs["offset"] = _offset(offset)
        _plan_from(from_dir, preset if "preset" in given else None, knobs,
                   steps if "steps" in given else None, max_staleness if advise else None,
                   as_json, cores, stretch_dir)
        return

    from .plan_from import replay_assumed
    from .render import render_png, render_terminal

    times = _times(rollout_time)
    if explorers is None:
        explorers = len(times) if len(times) > 1 else preset_explorers(preset)
    if explorers < 1:
        raise click.BadParameter("must be >= 1", param_hint="--explorers")
    if len(times) == 1:
        times = times * explorers
    elif len(times) != explorers:
        raise click.BadParameter(f"{len(times)} rollout times for {explorers} explorers",
                                 param_hint="--rollout-time")
    knobs = {k: v for k, v in dict(interval=interval, max_staleness=max_staleness,
                                   method=method).items() if v is not None}
    parsed_offset = _offset(offset)
    if parsed_offset != "unset":
        knobs["offset"] = parsed_offset
    try:
        sync_plan = SyncPlan.preset(preset, batches_per_step=explorers, **knobs)
        side_threads = [int(x) for x in threads.split(",")]
        if len(side_threads) != 2 or min(side_threads) < 1:
            raise ValueError(f"--threads: expected TRAINER,EXPLORER threads >= 1, got {threads!r}")
        timeline = replay_assumed(sync_plan, steps=steps, rollout_times=times,
                                  train_time=train_time, sync_time=sync_time, gap=gap,
                                  cores=cores, threads=(side_threads[0], side_threads[1]))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo(json.dumps(timeline.to_json(), indent=None))
    else:
        render_terminal(timeline, width=width)
    if png:
        path = render_png(timeline, png)
        if not as_json:
            click.echo(f"wrote {path}")


def _plan_from(run_dir: str, preset: str | None, knobs: dict[str, Any], steps: int | None,
               bound: int | None, as_json: bool, cores: int | None = None,
               stretch_dir: str | None = None) -> None:
    """`tandem plan --from`: see `tandem.master.plan_from`."""
    from pathlib import Path

    from tandem.common.config import load_config
    from tandem.common.sync import SyncPlan

    from . import plan_from

    durations = plan_from.measure(run_dir, cores, stretch_from=stretch_dir)
    n = len(durations.rollout)
    try:
        if preset is not None:
            own_plan = SyncPlan.preset(preset, batches_per_step=n, **knobs)
        else:
            config_path = Path(run_dir) / "config.yaml"
            if not config_path.is_file():
                raise click.UsageError(f"{run_dir} has no config.yaml; name --preset")
            sync = load_config(config_path).sync
            base = SyncPlan.from_config(sync, batches_per_step=n).describe()
            base.update(knobs)
            own_plan = SyncPlan(**base)
        predictions = plan_from.replay_all(durations, own_plan, steps)
    except (ValueError, TandemError) as exc:
        raise click.UsageError(str(exc)) from None
    own = predictions[0]
    ranked = plan_from.rank(durations, bound, steps) if bound is not None else []
    advice = ranked[0] if ranked else None
    for i, p in enumerate(ranked[1:3], start=2):
        p.name = f"advised #{i}"
    if as_json:
        click.echo(json.dumps({
            "measured": durations.to_json(), "predictions": [p.to_json() for p in predictions],
            "advice": None if advice is None else {
                **advice.to_json(), "max_staleness_bound": bound,
                "gain": round(own.step_time / advice.step_time, 4)},
            "ranked": [p.to_json() for p in ranked[:5]]}))
    else:
        plan_from.print_report(durations, predictions, advice, own, bound, ranked[1:3])


@tandem.command()
@click.option("--master", "address", help="master RPC address (default: from --config, else "
              "the config default)")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="run config to read master.address from")
@click.option("--timeout", type=float, default=5.0, show_default=True,
              help="seconds to wait for the master")
@click.option("--json", "as_json", is_flag=True, help="print the raw status as JSON")
def status(address: str | None, config_path: str | None, timeout: float, as_json: bool) -> None:
    """Print the master's registry, counters, versions, staleness and leases."""
    from .status import fetch_status, print_status

    try:
        reply = fetch_status(address, config_path, timeout)
    except TandemError as exc:
        sys.exit(fail("tandem status", exc, EXIT_FAILED))
    if as_json:
        click.echo(json.dumps(reply.model_dump(), default=str))
    else:
        print_status(reply)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options("`master`, `sync`, `explorers`, `transport`", "master.address=tcp://0.0.0.0:5550")
def master_main_command(config_path: str | None, overrides: tuple[str, ...],
                        resume: bool) -> None:
    """Run the master: the run's clock (registry, task leases, barriers, journal)."""
    config = load_config_or_exit("tandem-master", config_path, overrides, resume=resume)

    def build():
        from .service import Master

        return Master(config)

    sys.exit(run_component("tandem-master", config, "master", build))


def main() -> None:
    warm = os.environ.get("TANDEM_WARM")
    if warm and sys.argv[1:2] == ["up"]:  # forked from the warm process (tandem warm)
        from .warm_client import run_warm, socket_path

        code = run_warm(socket_path(warm), sys.argv)
        if code is not None:
            sys.exit(code)
    tandem(prog_name="tandem")


def master_main() -> None:
    master_main_command(prog_name="tandem-master")


if __name__ == "__main__":
    main()
