"""`tandem-torchrun`: torchrun for the trainer's ranks, with a stop that is not a failure.

torchrun answers SIGTERM (or SIGINT) by passing it to its workers, waiting for them (up to its own
30 s, then SIGKILL) and re-raising the signal as an exception: exit 1 and a traceback, although
each rank wrote its checkpoint and left cleanly (docs/reliability.md, "Stop order"). A supervisor
(`tandem up`, Slurm, Kubernetes) reads that as a crash. This launcher runs torchrun unchanged and
turns that one exception into exit 0 after saying what happened; any other failure stays one.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as exc:
        if exc.sigval not in (signal.SIGTERM, signal.SIGINT):
            raise
        print(f"tandem-torchrun: {exc.sigval.name} passed to the trainer's ranks, which have "
              "stopped", file=sys.stderr)
        sys.exit(0)


if __name__ == "__main__":
    main()
