"""A worker process for pure reward functions: `python -m tandem.reward.worker`.

Protocol on stdin/stdout, each frame a 4-byte big-endian length and a msgpack map:
parent -> worker: first `{"reward": the reward section, "plugins": [what the parent imported]}`,
then `{"fn": name, "item": {...}}` per evaluation; worker -> parent: `{"ready": true}` once the
isolated functions are built and warmed up (`warm`), then one
`{"score", "components", "reason"}` or `{"error": "..."}` per evaluation. The worker runs each
function on its main thread, so it needs no time limit of its own: the parent kills it when an
evaluation overruns. It exits on EOF, and with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys

from .frames import HEADER, pack, unpack


def read_frame(stream) -> object | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    return unpack(stream.read(size))


def write_frame(stream, obj: object) -> None:
    stream.write(pack(obj))
    stream.flush()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: EOF on stdin still ends the worker


def instance(cls, config):
    fn = cls(config)
    fn.in_worker = True
    return fn


def warm(config) -> dict:
    """Every isolated pure function this worker may be asked for, built and warmed up
    (`PureReward.warm_up`) before the worker says ready: the parent's time limit starts when
    it hands over an item, and a replacement worker's first item must not pay for imports. A
    function that fails here is left to fail on its first item, where the error is reported."""
    from tandem.common.plugins import REWARDS, load_installed

    from .base import PureReward
    from .functions import lookup

    load_installed()
    out = {}
    for name in REWARDS.names():
        try:
            cls = lookup(name)
            if not (issubclass(cls, PureReward) and cls.isolated):
                continue
            fn = instance(cls, config)
            fn.warm_up()
        except Exception as exc:
            print(f"reward worker: {name} not warmed up ({type(exc).__name__}: {exc}); its "
                  "first item builds it", file=sys.stderr)
            continue
        out[name] = fn
    return out


def main() -> None:
    _die_with_parent()
    # Ctrl-C, and a supervisor's SIGTERM to the parent's process group, are the parent's: it
    # may still drain a step that needs us, then stops us itself (or we die with it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print in a function must not corrupt the protocol
    # math-verify logs every parse failure with the whole input; the reason says enough.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    from tandem.common.config.reward import RewardConfig
    from tandem.common.messages.reward import ScoreItem
    from tandem.common.plugins import load_plugins

    from .functions import lookup

    first = read_frame(stdin)
    load_plugins(first["plugins"])
    config = RewardConfig.model_validate(first["reward"])
    instances = warm(config)
    write_frame(stdout, {"ready": True})
    while (request := read_frame(stdin)) is not None:
        try:
            name = request["fn"]
            if name not in instances:
                instances[name] = instance(lookup(name), config)
            score = instances[name].score(ScoreItem.model_validate(request["item"]))
            write_frame(stdout, score.model_dump())
        except Exception as exc:
            write_frame(stdout, {"error": f"{type(exc).__name__}: {exc}"[:500]})


if __name__ == "__main__":
    main()
