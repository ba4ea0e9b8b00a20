"""`tandem plugins`: every registered item by kind, with the plugin that registered it and
what it declares; with `--config`, the run's own plugins loaded first."""

from __future__ import annotations

import click

from tandem.common.cli import config_options, load_config_or_exit


@click.command("plugins")
@config_options("plugins", "plugins=[my_task.plugin]")
def plugins(config_path: str | None, overrides: tuple[str, ...]) -> None:
    """List the registered reward functions, workflows, environments, agents, taskset readers
    and formats, advantages, losses and engines."""
    from tandem.common.plugins import REGISTRIES, load_installed

    if config_path is not None or overrides:
        load_config_or_exit("tandem plugins", config_path, overrides)
    load_installed()
    for kind, registry in REGISTRIES.items():
        click.echo(f"{kind} ({registry.config_key})")
        for name, entry in registry.items():
            declares = ", ".join(f"{k}={v}" for k, v in entry.declares.items())
            click.echo(f"  {name:<18} {entry.plugin}" + (f"  [{declares}]" if declares else ""))
