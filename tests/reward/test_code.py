"""code: real programs graded by tests, and adversarial ones that must end with score 0, a
reason naming the limit that ended them, and nothing left running."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import pytest
from backstop import BACKSTOP

from tandem.common.messages.reward import ScoreItem
from tandem.reward.functions.code_tests import CodeReward, extract_program, parse_tests, same_output

ADD_ONE = {"tests": [{"input": "1\n", "output": "2\n"}, {"input": "41", "output": "42"},
                     {"input": "-5", "output": "-4"}]}


@contextlib.asynccontextmanager
async def running(reward_config, processes_mentioning):
    reward = CodeReward(reward_config)
    await reward.start()
    base = str(reward.sandbox._base)
    try:
        yield reward
    finally:
        await reward.close()
    assert processes_mentioning(base) == [], "a sandboxed process outlived its run"


def with_limits(config, **limits):
    """`config` with these `code` limits (the one a test is about, set short)."""
    return config.model_copy(update={"code": config.code.model_copy(update=limits)})


@pytest.fixture
def score_code(reward_config, processes_mentioning):
    """`await score_code(response, truth, limits={...}, **args)` -> Score, checking for
    leftovers; `limits` sets fields of `code`."""

    async def run(response, truth, limits=None, **args):
        config = with_limits(reward_config, **(limits or {}))
        async with running(config, processes_mentioning) as reward:
            return await reward.score(ScoreItem(fn="code", response=response, truth=truth,
                                                args=args))

    return run


PASSING = [
    ("```python\nprint(int(input()) + 1)\n```", ADD_ONE, 1.0, "3/3 tests passed"),
    ("Here you go:\n```py\nimport sys\nfor line in sys.stdin:\n    print(int(line) + 1)\n```",
     ADD_ONE, 1.0, "3/3"),
    ("print(int(input()) + 1)", [{"input": "1", "output": "2"}], 1.0, "1/1"),
    ("```python\nn = int(input())\nprint(n + 1 if n > 0 else n)\n```", ADD_ONE, 2 / 3,
     "2/3 tests passed; test 3: wrong_answer"),
    ("```python\ndef add(a, b):\n    return a + b\n```",
     {"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]},
     2 / 3, "test 3: runtime_error (AssertionError)"),
    ("```python\ndef area(r):\n    return math.pi * r * r\n```",
     {"test_list": ["assert abs(area(1) - 3.14159) < 1e-4"], "setup": "import math"}, 1.0, "1/1"),
    ("```python\nprint(input()[::-1])\n```",
     {"inputs": ["héllo wörld", "日本語"], "outputs": ["dlröw olléh", "語本日"]},
     1.0, "2/2"),
    ("```python\nprint('1  2\\n3')\n```", {"tests": [{"input": "", "output": "1 2 3"}]}, 0.0,
     "wrong_answer"),
    ("```python\ndef f(:\n```", ADD_ONE, 0.0, "syntax_error"),
]


@pytest.mark.parametrize("response,truth,score,reason", PASSING)
async def test_code_table(score_code, response, truth, score, reason):
    got = await score_code(response, truth)
    assert got.score == pytest.approx(score), got.reason
    assert reason in got.reason
    assert got.components["total"] == len(parse_tests(truth)[1])


async def test_token_comparison_is_an_option(score_code):
    got = await score_code("print('1  2\\n3')",
                           {"tests": [{"input": "", "output": "1 2 3"}]}, compare="tokens")
    assert got.score == 1.0


ADVERSARIAL = [
    # (name, program, reason fragments one of which must appear, the time limit set short)
    ("infinite loop", "while True:\n    pass", ("cpu", "timeout"), {"cpu_seconds": 1}),
    ("sleeps forever", "import time\ntime.sleep(3600)", ("timeout",), {"wall_seconds": 2}),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", ("runtime_error",), {}),
    ("allocates 10 GB", "x = bytearray(10 * 2**30)\nprint(len(x))", ("memory",), {}),
    ("writes a huge file",
     "with open('big', 'wb') as f:\n    while True:\n        f.write(b'0' * 2**20)",
     ("file_size",), {}),
    ("floods stdout", "while True:\n    print('x' * 4096)", ("output_limit",), {}),
    ("exits before the asserts", "import sys\nsys.exit(0)", ("not_reached",), {}),
    ("os._exit before the asserts", "import os\nos._exit(0)", ("not_reached",), {}),
    ("escapes its process group",
     "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n"
     "def solve(x):\n    return x", ("AssertionError",), {}),
]


@pytest.mark.parametrize("name,program,reasons,limits", ADVERSARIAL,
                         ids=[a[0] for a in ADVERSARIAL])
async def test_adversarial_programs_score_zero_within_limits(score_code, name, program, reasons,
                                                             limits):
    truth = {"asserts": ["assert solve(1) == 2"]} if "assert" in name or "escapes" in name \
        else {"tests": [{"input": "1", "output": "2"}]}
    got = await score_code(program, truth, limits)
    assert got.score == 0.0
    assert any(r in got.reason for r in reasons), got.reason


async def test_environment_is_scrubbed(score_code, monkeypatch):
    monkeypatch.setenv("TANDEM_SECRET_TOKEN", "hunter2")
    program = "import os\nprint(os.environ.get('TANDEM_SECRET_TOKEN', 'missing'))"
    got = await score_code(program, {"tests": [{"input": "", "output": "hunter2"}]})
    assert got.score == 0.0 and "wrong_answer" in got.reason


async def test_cannot_reach_a_port_on_loopback(reward_config, processes_mentioning):
    async with running(reward_config, processes_mentioning) as code:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            port = listener.getsockname()[1]
            program = ("import socket\n"
                       f"s = socket.create_connection(('127.0.0.1', {port}), timeout={BACKSTOP})\n"
                       "print('connected')")
            truth = {"tests": [{"input": "", "output": "connected"}]}
            got = await code.score(ScoreItem(response=program, truth=truth))
        assert got.score == 0.0
        # its own network namespace has only its own loopback: nothing listens there
        assert "runtime_error" in got.reason and "refused" in got.reason.lower(), got.reason


async def test_working_directory_is_empty_and_private(reward_config, processes_mentioning):
    async with running(reward_config, processes_mentioning) as code:
        program = "import os\nprint(sorted(os.listdir('.')), os.getcwd() != '/')"
        got = await code.score(ScoreItem(response=program,
                                         truth={"tests": [{"input": "", "output": "[] True"}]}))
        assert got.score == 1.0, got.reason


async def test_runs_after_a_timeout_are_skipped(reward_config, processes_mentioning):
    async with running(with_limits(reward_config, wall_seconds=2), processes_mentioning) as code:
        tests = {"tests": [{"input": "", "output": "x"}] * 4}
        got = await code.score(ScoreItem(response="while True: pass", truth=tests))
        assert got.score == 0.0 and got.components["total"] == 4
        assert got.reason.startswith("0/4 tests passed; test 1:")


async def test_cancelling_an_evaluation_kills_the_run(reward_config, processes_mentioning):
    async with running(reward_config, processes_mentioning) as code:
        base = str(code.sandbox._base)
        sleeper = ScoreItem(response="import time\ntime.sleep(3600)",
                            truth={"tests": [{"input": "", "output": ""}]})
        task = asyncio.create_task(code.score(sleeper))
        while not processes_mentioning(base):
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the kernel ends a PID namespace's processes after its first one dies, not in the
        # same instant: the cancelled run returns once they have gone
        assert processes_mentioning(base) == []


async def test_a_cancel_while_the_process_starts_still_kills_it(reward_config,
                                                                processes_mentioning,
                                                                monkeypatch):
    """The cancel lands after the sandbox's process exists but before asyncio has connected its
    pipes (create_subprocess_exec has not returned): the process must not outlive it. The
    moment is held open by the test, not raced."""
    spawned, release = asyncio.Event(), asyncio.Event()
    real = asyncio.create_subprocess_exec

    async def held_open(*args, **kwargs):
        proc = await real(*args, **kwargs)
        spawned.set()
        await release.wait()
        return proc

    async with running(reward_config, processes_mentioning) as code:
        base = str(code.sandbox._base)
        monkeypatch.setattr(asyncio, "create_subprocess_exec", held_open)
        sleeper = ScoreItem(response="import time\ntime.sleep(3600)",
                            truth={"tests": [{"input": "", "output": ""}]})
        task = asyncio.create_task(code.score(sleeper))
        await asyncio.wait_for(spawned.wait(), BACKSTOP)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        monkeypatch.undo()
        assert processes_mentioning(base) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="per-slot uids are used when running as root")
async def test_runs_under_the_slot_uid(reward_config, processes_mentioning):
    async with running(reward_config, processes_mentioning) as code:
        program = "import os\nprint(os.getuid())"
        want = str(code.sandbox.slot_uids(0)[0])  # slot 0 is handed out first
        truth = {"tests": [{"input": "", "output": want}]}
        got = await code.score(ScoreItem(response=program, truth=truth))
        assert got.score == 1.0, got.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="per-slot uids are used when running as root")
async def test_two_sandboxes_at_once_never_share_a_uid(reward_config, processes_mentioning):
    """RLIMIT_NPROC counts a uid's processes host-wide: two sandboxes (two reward services,
    two test workers) whose slots shared `uid_base + k` shared one limit, so a fork bomb in one
    made a correct candidate of the other fail to fork (a suite under load scored the process
    group escape `failed to load`). Both run a program that prints its uid, with one slot
    each: the second sandbox's slot 0 runs under a uid the first does not hold."""
    config = reward_config.model_copy(update={"workers": 1})
    program = "import os\nprint(os.getuid(), os.getgid())"
    async with running(config, processes_mentioning) as one, \
            running(config, processes_mentioning) as two:
        seen = []
        for code in (one, two):
            run = await code.sandbox.run(program)
            assert run.status == "ok", run
            uid, gid = (int(v) for v in run.stdout.split())
            assert uid == gid
            seen.append(uid)
        assert seen[0] != seen[1]
        assert seen == [one.sandbox.slot_uids(0)[0], two.sandbox.slot_uids(0)[0]]
        held = set(one.sandbox.slot_uids(0)) | set(two.sandbox.slot_uids(0))
        assert len(held) == 4, held  # candidate and harness uids, none shared


def test_extract_program_prefers_the_last_python_block():
    text = "```text\nnot code\n```\n```python\nprint(1)\n```\n```python\nprint(2)\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"


def test_dataset_shapes_of_stdio_tests():
    want = ("stdio", [("1", "2"), ("3", "4")], "")
    assert parse_tests({"inputs": ["1", "3"], "outputs": ["2", "4"]}) == want
    assert parse_tests('{"inputs": ["1", "3"], "outputs": ["2", "4"]}') == want
    assert parse_tests({"input": ["1", "3"], "output": ["2", "4"]}) == want
    assert parse_tests([{"input": "1", "output": "2"}, {"input": "3", "output": "4"}]) == want


def test_bad_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_tests({"inputs": ["1", "2"], "outputs": ["1"]})
    with pytest.raises(ValueError, match="needs tests"):
        parse_tests({"cases": []})
    with pytest.raises(ValueError, match="not JSON"):
        parse_tests("print(1)")
    with pytest.raises(ValueError, match="give those tests as asserts"):
        parse_tests({"fn_name": "solve", "inputs": [[1]], "outputs": [2]})


def test_output_comparison():
    assert same_output("1 \n2\n\n", "1\n2")
    assert same_output("a\r\nb", "a\nb")
    assert not same_output("1\n 2", "1\n2")
    assert same_output("1\n 2", "1 2", "tokens")


async def test_without_namespaces_the_limits_still_hold(reward_config, processes_mentioning):
    config = reward_config.model_copy(update={
        "code": reward_config.code.model_copy(update={"isolation": "none"})})
    async with running(config, processes_mentioning) as code:
        assert code.sandbox.isolated is False
        ok = await code.score(ScoreItem(response="print(int(input()) + 1)", truth=ADD_ONE))
        hog = await code.score(ScoreItem(response="x = bytearray(10 * 2**30)", truth=ADD_ONE))
    assert ok.score == 1.0, ok.reason
    assert hog.score == 0.0 and "memory" in hog.reason


@pytest.mark.skipif(os.geteuid() != 0, reason="the sweep needs the per-slot uid used as root")
async def test_files_left_in_shared_tmp_are_removed(reward_config, processes_mentioning):
    name = f"/tmp/tandem-leak-{os.getpid()}"
    program = f"open('{name}', 'w').write('x')\nprint('wrote')"
    async with running(reward_config, processes_mentioning) as code:
        got = await code.score(ScoreItem(response=program,
                                         truth={"tests": [{"input": "", "output": "wrote"}]}))
    assert got.score == 1.0, got.reason
    assert not os.path.exists(name)
