"""A sandboxed program's wall clock counts from when it says its own work begins (the `STARTED`
line), not from the launch: bubblewrap, the interpreter and the program's imports, which a
loaded machine stretches, are bounded apart by `start_seconds`."""

from __future__ import annotations

from backstop import BACKSTOP
from tandem.common.config.reward import CodeSandboxConfig
from tandem.common.sandbox import STARTED, Run, Sandbox

# starts slowly (2 s, standing for imports on a loaded machine), writes the start line in two
# pieces, then does its 0.1 s of work: well inside a 1 s wall clock that counts from the line
SLOW_START = f"""
import os, time
time.sleep(2.0)
os.write(1, {STARTED[:7]!r})
time.sleep(0.2)
os.write(1, {STARTED[7:]!r})
time.sleep(0.1)
print("done")
"""


async def run_once(program: str, start_seconds: float | None = None) -> Run:
    box = Sandbox(CodeSandboxConfig(wall_seconds=1.0, isolation="none"), slots=1)
    try:
        return await box.run(program, start_seconds=start_seconds)
    finally:
        await box.close()


async def test_the_wall_clock_counts_from_the_programs_start_line():
    run = await run_once(SLOW_START, start_seconds=BACKSTOP)
    assert (run.status, run.stdout) == ("ok", b"done\n")
    assert run.seconds > 2.0  # the start took longer than the wall clock, and was not charged


async def test_without_start_seconds_the_launch_counts():
    run = await run_once(SLOW_START)
    assert run.status == "timeout"


async def test_a_start_past_start_seconds_is_its_own_status():
    run = await run_once("import time\ntime.sleep(60)\n", start_seconds=1.0)
    assert run.status == "start_timeout" and run.exit_code != 0  # killed, not left to its end


async def test_work_past_the_wall_clock_after_the_start_line_times_out():
    program = f"import os, time\nos.write(1, {STARTED!r})\ntime.sleep(60)\n"
    run = await run_once(program, start_seconds=BACKSTOP)
    assert run.status == "timeout" and run.exit_code != 0  # killed, not left to its end


async def test_output_without_the_start_line_is_kept():
    run = await run_once("print('#tandem')\n", start_seconds=BACKSTOP)
    assert (run.status, run.stdout) == ("ok", b"#tandem\n")
