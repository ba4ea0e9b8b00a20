"""The one shape of every component CLI: `--config`, `--set`, build, serve, close, exit code.

    config = load_config_or_exit(prog, config_path, overrides)      # exit 2 on a bad config
    sys.exit(run_component(prog, config, name, lambda: Component(config)))

`run_component` holds the run dir's lock for `name`, configures logging, builds the component
inside the event loop, lets SIGINT/SIGTERM only set its stop flag, awaits `serve()`, and closes
the component whatever happened. Exit codes, the same for every CLI: 0 done (or stopped by a
signal), 1 failed at run time, 2 bad config or usage. A domain error (`TandemError`) is one line
`prog: message` on stderr, never a traceback.

Imports nothing heavy, so a CLI's `--help` stays instant.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable, Iterable

import click

if TYPE_CHECKING:
    from .config import RunConfig

EXIT_DONE, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class Component(Protocol):
    """What every tandem component is: `Component(config)`, then these three."""

    async def serve(self) -> None:
        """Run until the work is done or `request_stop()`; never closes itself."""

    def request_stop(self) -> None:
        """Ask `serve()` to return soon; safe from a signal handler."""

    async def close(self) -> None:
        """Release sockets, files and workers; the caller calls it once `serve()` returned."""


def config_options(sections: str, example: str) -> Callable[[Callable], Callable]:
    """Add `--config PATH`, repeatable `--set KEY=VALUE` and `--resume` to a component's
    click command."""

    def decorate(fn: Callable) -> Callable:
        fn = click.option("--resume", is_flag=True,
                          help="continue the run in run_dir where the config changed a key "
                               "that may change on resume (master.total_steps, upward)")(fn)
        fn = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help=f"override a config value, e.g. --set {example}")(fn)
        return click.option("--config", "config_path", type=click.Path(dir_okay=False),
                            default=None,
                            help=f"run config YAML (the {sections} sections are used)")(fn)

    return decorate


def one_line(exc: BaseException) -> str:
    """An error as one line: a config error's problems joined by '; '."""
    from .errors import ConfigError

    if isinstance(exc, ConfigError):
        head = f"invalid config{f' {exc.source}' if exc.source else ''}"
        return f"{head}: " + "; ".join(exc.errors)
    return " ".join(str(exc).split("\n")).strip() or type(exc).__name__


class OneLineFailure(click.ClickException):
    """A click failure shown the tandem way: `prog: message` on one line, exit code 1."""

    def __init__(self, prog: str, message: str):
        super().__init__(" ".join(message.split("\n")).strip())
        self.prog = prog

    def show(self, file: Any = None) -> None:
        click.echo(f"{self.prog}: {self.message}", err=True)


def fail(prog: str, exc: BaseException, code: int) -> int:
    click.echo(f"{prog}: {one_line(exc)}", err=True)
    return code


def load_config_or_exit(prog: str, config_path: str | None, overrides: Iterable[str],
                        check: Callable[[RunConfig], Any] | None = None, *,
                        resume: bool | None = None) -> RunConfig:
    """The validated run config, or one line `prog: invalid config ...` and exit code 2.

    `check(config)` may add a CLI's own rule (an explorer name that must exist); a ConfigError
    or KeyError it raises is a usage error too.

    A CLI that joins the run in `run_dir` (each component, `tandem up`) passes `resume` (its
    `--resume` flag): the config is then compared with the run the journal records
    (`tandem.common.runrecord.join_run`) before anything starts. A config that may not join it
    is one line and exit code 2; a finished run is one line and exit code 0; a run that goes on
    is one line, "continuing run X in RUN_DIR at step N of M".
    """
    from .config import load_config
    from .errors import TandemError

    try:
        config = load_config(config_path, overrides)
        if check is not None:
            check(config)
        if resume is not None:
            _join_run_or_exit(prog, config, resume)
        return config
    except TandemError as exc:
        sys.exit(fail(prog, exc, EXIT_USAGE))
    except KeyError as exc:
        click.echo(f"{prog}: {exc.args[0]}", err=True)
        sys.exit(EXIT_USAGE)


def _join_run_or_exit(prog: str, config: RunConfig, resume: bool) -> None:
    from .runrecord import join_run

    joined = join_run(config, resume=resume)  # RunDirTaken is the caller's exit 2
    if joined is None:
        return
    click.echo(f"{prog}: {joined.line(config.run_dir)}")
    if joined.finished:
        sys.exit(EXIT_DONE)


def run_component(prog: str, config: RunConfig, name: str,
                  build: Callable[[], Component]) -> int:
    """Serve the component `build()` makes as the process `name`; returns the exit code."""
    import asyncio

    from .errors import ConfigError, TandemError
    from .logging import configure_logging
    from .runlock import RunDirLock
    from .sockets import install_uvloop

    try:
        with RunDirLock(config.run_dir, name):
            configure_logging(name, level=config.logging.level, run_dir=config.run_dir,
                              json_console=config.logging.json_console)
            threads = _apply_placement(config, name)
            install_uvloop()
            asyncio.run(_serve(build, threads))
    except ConfigError as exc:
        return fail(prog, exc, EXIT_USAGE)
    except TandemError as exc:
        return fail(prog, exc, EXIT_FAILED)
    finally:
        # The component is closed and the process exits next. Python's last full collection
        # walks every object of torch, transformers and the model, which took 2-10 s of a
        # stop on a loaded machine; frozen, it skips them (reference counts still free them).
        import gc

        gc.freeze()
    return EXIT_DONE


def _apply_placement(config: RunConfig, name: str) -> int | None:
    """This process's share of the machine (`placement`), before build() imports torch;
    returns the intra-op thread count it sets, if any."""
    import structlog

    from .config.placement import apply_placement

    assignment = apply_placement(config, name)
    structlog.get_logger(__name__).info(
        "placement.applied", role=assignment.role, threads=assignment.threads,
        devices=assignment.devices)
    return assignment.threads


def _torch_threads(threads: int | None) -> None:
    """Once build() loaded torch (common never imports it), hold it to the placement's count
    and say what torch reports."""
    import structlog

    torch = sys.modules.get("torch")
    if torch is None:
        return
    if threads:
        torch.set_num_threads(threads)
    structlog.get_logger(__name__).info("placement.torch", torch_threads=torch.get_num_threads())


async def _serve(build: Callable[[], Component], threads: int | None = None) -> None:
    import asyncio
    import signal

    import structlog

    loop = asyncio.get_running_loop()
    component: Component | None = None

    def on_signal(sig: signal.Signals) -> None:
        # A signal only sets a flag: serve() drains or aborts, then the close below runs. One
        # that comes while build() loads a model runs here once build() returned.
        structlog.get_logger(__name__).info("component.signal", signal=sig.name)
        if component is not None:
            component.request_stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        component = build()
        _torch_threads(threads)
        try:
            await component.serve()
        finally:
            await component.close()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
