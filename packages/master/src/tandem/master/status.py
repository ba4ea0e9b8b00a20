"""`tandem status`: ask a master for its registry, counters, versions, staleness and leases."""

from __future__ import annotations

import asyncio
import time

from rich.console import Console
from rich.table import Table

from tandem.common.messages.master import GetStatus, Status
from tandem.common.rpc import RpcClient


def fetch_status(address: str | None, config_path: str | None, timeout: float) -> Status:
    """One GetStatus round trip; PeerDead names the address when nobody answers."""
    transport = None
    if address is None:
        from tandem.common.config import load_config

        config = load_config(config_path)
        address, transport = config.master.address, config.transport

    async def ask() -> Status:
        client = RpcClient(address, peer="master", transport=transport, name="tandem-status")
        try:
            return await client.call(GetStatus(), timeout=timeout, retries=0,
                                     timeout_key="tandem status --timeout")
        finally:
            await client.close()

    return asyncio.run(ask())


def print_status(status: Status, console: Console | None = None) -> None:
    console = console or Console(soft_wrap=True)
    c = status.counters
    plan = c.plan
    console.print(f"[bold]run[/] {status.run_id}   plan: {plan.method} "
                  f"interval={plan.interval} offset={plan.offset} "
                  f"max_staleness={plan.max_staleness}")
    console.print(f"trainer step {c.trainer_steps_done}/{c.total_steps}   "
                  f"newest version {c.newest_version}   batches done "
                  f"{c.batches_done} (lost {c.batches_lost})   "
                  + ("[bold red]stopped[/]" if c.stopped else "running"))
    if c.tasks_total is not None:
        console.print(f"tasks {c.tasks_completed}/{c.tasks_total} completed, "
                      f"{c.tasks_dispatched} dispatched, {c.tasks_returned} returned, "
                      f"{c.leases_open} leases open, {c.leases_expired} expired, "
                      f"epoch {c.epoch}")
    table = Table(title="components", title_justify="left")
    for col in ("name", "role", "alive", "pid", "silent (s)"):
        table.add_column(col)
    for comp in status.components:
        table.add_row(comp.name, comp.role, "[green]yes[/]" if comp.alive else "[red]dead[/]",
                      str(comp.pid), "-" if comp.silent_for is None else f"{comp.silent_for:.1f}")
    console.print(table)
    if status.explorers:
        table = Table(title="explorers", title_justify="left")
        for col in ("name", "alive", "steps done", "running step", "held version",
                    "staleness"):
            table.add_column(col)
        for ex in status.explorers:
            running = ex.running
            table.add_row(ex.name, "yes" if ex.alive else "no", str(ex.steps_done),
                          "-" if running is None else f"{running.step} (v{running.version})",
                          str(ex.held_version), str(ex.staleness))
        console.print(table)
    if status.leases:
        table = Table(title="leases", title_justify="left")
        for col in ("lease", "explorer", "step", "tasks", "expires in (s)"):
            table.add_column(col)
        now = time.time()
        for lease in status.leases:
            table.add_row(lease.lease_id, lease.explorer, str(lease.step), str(lease.tasks),
                          f"{lease.deadline - now:.0f}")
        console.print(table)
