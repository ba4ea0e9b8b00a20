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
    plan = c.get("plan", {})
    console.print(f"[bold]run[/] {status.run_id}   plan: {plan.get('method')} "
                  f"interval={plan.get('interval')} offset={plan.get('offset')} "
                  f"max_staleness={plan.get('max_staleness')}")
    console.print(f"trainer step {c.get('trainer_steps_done')}/{c.get('total_steps')}   "
                  f"newest version {c.get('newest_version')}   batches done "
                  f"{c.get('batches_done')} (lost {c.get('batches_lost')})   "
                  + ("[bold red]stopped[/]" if c.get("stopped") else "running"))
    if "tasks_total" in c:
        console.print(f"tasks {c['tasks_completed']}/{c['tasks_total']} completed, "
                      f"{c['tasks_dispatched']} dispatched, {c['tasks_returned']} returned, "
                      f"{c['leases_open']} leases open, {c['leases_expired']} expired, "
                      f"epoch {c['epoch']}")
    table = Table(title="components", title_justify="left")
    for col in ("name", "role", "alive", "pid", "silent (s)"):
        table.add_column(col)
    for comp in status.components:
        table.add_row(comp["name"], comp["role"],
                      "[green]yes[/]" if comp["alive"] else "[red]dead[/]", str(comp.get("pid")),
                      "-" if comp.get("silent_for") is None else f"{comp['silent_for']:.1f}")
    console.print(table)
    if status.explorers:
        table = Table(title="explorers", title_justify="left")
        for col in ("name", "alive", "steps done", "running step", "held version",
                    "staleness"):
            table.add_column(col)
        for ex in status.explorers:
            running = ex.get("running")
            table.add_row(ex["name"], "yes" if ex["alive"] else "no", str(ex["steps_done"]),
                          "-" if not running else f"{running['step']} (v{running['version']})",
                          str(ex.get("held_version")), str(ex.get("staleness")))
        console.print(table)
    if status.leases:
        table = Table(title="leases", title_justify="left")
        for col in ("lease", "explorer", "step", "tasks", "expires in (s)"):
            table.add_column(col)
        now = time.time()
        for lease in status.leases:
            table.add_row(lease["lease_id"], lease["explorer"], str(lease["step"]),
                          str(lease["tasks"]), f"{lease['deadline'] - now:.0f}")
        console.print(table)
