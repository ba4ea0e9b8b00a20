"""Reward worker processes for pure reward functions: `python -m tandem.reward.worker`.

The pool (`pool.WorkerPool`) starts one *template* process, which imports the reward functions
(and the plugins the pool's process imported), builds and warms up the isolated ones the pool
names (`warm`: the run's `reward.functions`, then any other an item asks for), and then forks
each worker: a worker costs a fork, not an interpreter and its imports, so a pool of four starts
for the price of one and a worker killed for overrunning is replaced in milliseconds. Started
from a process of its own, not forked from the pool's, so no thread or socket of that process
(ZeroMQ, asyncio) is carried into a worker. A function no item asks for is never imported: the
math check's sympy and math-verify are 38 MiB of every worker's memory (issue 27 item 1).

Template protocol: on stdin one frame (a 4-byte big-endian length and a msgpack map)
`{"reward": the reward section, "plugins": [what the parent imported], "warm": [names]}`; then,
on the unix SEQPACKET socket whose fd is its argument, one msgpack message each way: template ->
parent `{"ready": true}` once warmed up; parent -> template `{"fork": true}` carrying two fds
(the worker's stdin and stdout), answered by `{"forked": pid}` carrying a pidfd of the worker;
parent -> template `{"warm": [names]}`, answered by `{"warmed": [every name warm now]}` (the
workers forked after it have them); and `{"exited": pid, "code": returncode}` when a worker ends
(negative: the signal). It exits when the parent closes the socket, killing its workers, and
with its parent (PR_SET_PDEATHSIG).

Worker protocol on its stdin/stdout, frames as above: parent -> worker `{"fn": name, "item":
{...}}` per evaluation; worker -> parent `{"ready": true}` first, then one `{"score",
"components", "reason"}` or `{"error": "..."}` per evaluation. The worker runs each function on
its main thread, so it needs no time limit of its own: the parent kills it when an evaluation
overruns. It exits on EOF, and with the template.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import selectors
import signal
import socket
import sys

from .frames import HEADER, encode, pack, unpack


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


def warm(config, names, instances: dict) -> None:
    """The isolated pure functions among `names`, built and warmed up (`PureReward.warm_up`)
    into `instances` before the template forks a worker that may be asked for them: the
    parent's time limit starts when it hands over an item, and a worker's first item must not
    pay for imports. A function that fails here is left to fail on its first item, where the
    error is reported; a name that is not an isolated function is skipped."""
    from tandem.common.plugins import load_installed

    from .base import PureReward
    from .functions import lookup

    load_installed()
    for name in names:
        if name in instances:
            continue
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
        instances[name] = fn


def serve(stdin, stdout, instances: dict, config) -> None:
    """Answer evaluations on `stdin`/`stdout` until EOF."""
    from tandem.common.messages.reward import ScoreItem

    from .functions import lookup

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


def _worker(template_pid: int, stdin_fd: int, stdout_fd: int, keep_out: list[int],
            instances: dict, config) -> None:
    """The forked worker's life; never returns into the template's loop."""
    code = 1
    try:
        _die_with_parent()  # the template; PR_SET_PDEATHSIG is not inherited across fork
        if os.getppid() != template_pid:  # it died before the line above: nobody to serve
            return
        for fd in keep_out:
            os.close(fd)
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.close(stdin_fd)
        os.close(stdout_fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        serve(os.fdopen(0, "rb"), os.fdopen(1, "wb"), instances, config)
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def template(control_fd: int) -> None:
    from tandem.common.config.reward import RewardConfig
    from tandem.common.plugins import load_plugins

    first = read_frame(sys.stdin.buffer)
    load_plugins(first["plugins"])
    config = RewardConfig.model_validate(first["reward"])
    instances: dict = {}
    warm(config, first["warm"], instances)
    control = socket.socket(fileno=control_fd)
    control.sendall(encode({"ready": True}))
    workers: dict[int, int] = {}  # pidfd -> pid
    me = os.getpid()
    with selectors.DefaultSelector() as sel:
        sel.register(control, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj is control:
                    data, fds, _, _ = socket.recv_fds(control, 1 << 16, 2)
                    if not data:  # the pool closed: its workers go with it
                        for pid in workers.values():
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except ProcessLookupError:
                                pass
                        return
                    request = unpack(data)
                    if "warm" in request:
                        for fd in fds:
                            os.close(fd)
                        warm(config, request["warm"], instances)
                        control.sendall(encode({"warmed": sorted(instances)}))
                        continue
                    if len(fds) != 2:
                        for fd in fds:
                            os.close(fd)
                        control.sendall(encode({"error": "fork needs two fds"}))
                        continue
                    keep_out = [control.fileno(), sel.fileno(), *workers]
                    # a collection in the worker leaves the template's objects, and so the
                    # pages they share with it, untouched (tandem.master.zygote does the same)
                    gc.freeze()
                    pid = os.fork()
                    if pid == 0:
                        _worker(me, fds[0], fds[1], keep_out, instances, config)
                    for fd in fds:
                        os.close(fd)
                    pidfd = os.pidfd_open(pid)
                    workers[pidfd] = pid
                    sel.register(pidfd, selectors.EVENT_READ)
                    socket.send_fds(control, [encode({"forked": pid})], [pidfd])
                else:  # a worker's pidfd: it ended
                    pidfd = key.fd
                    sel.unregister(pidfd)
                    pid = workers.pop(pidfd)
                    _, status = os.waitpid(pid, 0)
                    os.close(pidfd)
                    control.sendall(encode({"exited": pid,
                                             "code": os.waitstatus_to_exitcode(status)}))


def main() -> None:
    _die_with_parent()
    # Ctrl-C, and a supervisor's SIGTERM to the parent's process group, are the parent's: it
    # may still drain a step that needs us, then stops us itself (or we die with it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stdout = sys.stderr  # a stray print in a function must not corrupt the protocol
    # math-verify logs every parse failure with the whole input; the reason says enough.
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    template(int(sys.argv[1]))


if __name__ == "__main__":
    main()
