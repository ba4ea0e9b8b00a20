"""The first process of a code sandbox; standard library only, started as `python -I -S`.

It sets the resource limits on itself, forks the candidate, waits for it, and exits with the
candidate's exit code (128 + signal when a signal ended it). Staying alive as the parent lets it
be PID 1 of a fresh PID namespace: when it exits the kernel kills whatever the candidate left
behind. It never grades anything; the scorer outside compares the output.

Usage: sandbox_runner.py MODE CPU_S AS_BYTES NPROC FSIZE_BYTES NOFILE PROGRAM [TEST]
MODE is `stdio` (the program reads stdin, writes stdout) or `assert` (the program, then the test
code; stdin's first line is a marker the runner prints after the test code finished, so a
program that exits early cannot pass).
"""

import errno
import os
import resource
import sys

RUNTIME_ERROR, MEMORY_ERROR, SYNTAX_ERROR, FILE_TOO_LARGE, NOT_REACHED = 101, 102, 103, 104, 105


def _print_exc(**kwargs) -> None:
    import traceback  # only on failure: importing it costs more than starting the interpreter

    traceback.print_exc(**kwargs)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def candidate(mode: str, program_path: str, test_path: str | None) -> int:
    with open(program_path, encoding="utf-8") as f:
        source = f.read()
    test = marker = None
    if mode == "assert":
        marker = sys.stdin.readline().strip()  # read before any candidate code runs
        with open(test_path, encoding="utf-8") as f:
            test = f.read()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    try:
        program_code = compile(source, "solution.py", "exec")
        test_code = compile(test, "test.py", "exec") if test is not None else None
    except (SyntaxError, ValueError):
        _print_exc(limit=0)
        return SYNTAX_ERROR
    scope = {"__name__": "__main__" if mode == "stdio" else "solution",
             "__builtins__": __builtins__}
    try:
        exec(program_code, scope)
        if test_code is not None:
            exec(test_code, scope)
            sys.stdout.flush()
            os.write(1, b"\n" + marker.encode() + b"\n")
    except SystemExit as exc:
        if test_code is not None:
            return NOT_REACHED
        _flush()
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except MemoryError:
        os.write(2, b"MemoryError\n")
        return MEMORY_ERROR
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            os.write(2, b"File too large\n")
            return FILE_TOO_LARGE
        _print_exc()
        return RUNTIME_ERROR
    except BaseException:
        try:
            _print_exc()
        except MemoryError:
            os.write(2, b"MemoryError\n")
            return MEMORY_ERROR
        return RUNTIME_ERROR
    _flush()
    return 0


def main() -> None:
    mode, cpu, mem, nproc, fsize, nofile, program = sys.argv[1:8]
    test = sys.argv[8] if len(sys.argv) > 8 else None
    cpu_s = max(1, -int(-float(cpu) // 1))  # ceil, without importing math
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (int(mem), int(mem)))
    resource.setrlimit(resource.RLIMIT_NPROC, (int(nproc), int(nproc)))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize), int(fsize)))
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile), int(nofile)))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    pid = os.fork()
    if pid == 0:
        code = RUNTIME_ERROR
        try:
            code = candidate(mode, program, test)
        finally:
            os._exit(code if 0 <= code < 256 else 1)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


if __name__ == "__main__":
    main()
