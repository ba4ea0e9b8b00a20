"""tools/gpu/run.sh: every command it would run on a GPU, and in its dry run, names a tool and
flags that exist (each tool's own --help), without running any of them. The dry run itself,
which runs them all on CPU (about 5 minutes), is `tools/gpu/run.sh --dry-run`."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from backstop import BACKSTOP

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "run.sh"
BIN = Path(sys.executable).parent


def commands(*flags: str) -> list[list[str]]:
    out = subprocess.run([str(SCRIPT), "--list", *flags], cwd=ROOT, capture_output=True,
                         text=True, timeout=BACKSTOP)
    assert out.returncode == 0, out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines()]


def tool_and_flags(argv: list[str]) -> tuple[tuple[str, ...], set[str]]:
    """(the command that --help answers, the flags the line passes it)."""
    head = argv[0].replace("$PY", sys.executable).replace("$BIN", str(BIN))
    if argv[1:2] == ["-m"]:
        return (head, "-m", argv[2]), set()
    words = [a for a in argv[1:] if not a.startswith("-")]
    # the script (or the CLI) and, for checks.py and tandem, the subcommand
    tool = (head, *words[:2]) if words and words[0].endswith("checks.py") else (head, *words[:1])
    return tool, {a.split("=")[0] for a in argv if a.startswith("--")}


def test_every_command_of_the_gpu_run_and_the_dry_run_names_flags_its_tool_has():
    lines = commands() + commands("--dry-run")
    wanted: dict[tuple[str, ...], set[str]] = {}
    for argv in lines:
        if argv[0] == "cp":
            continue
        tool, flags = tool_and_flags(argv)
        wanted.setdefault(tool, set()).update(flags)
    assert any("--device" in f for f in wanted.values())
    helps = {tool: subprocess.Popen([*tool, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for tool in wanted if tool[1:2] != ("-m",)}
    for tool, proc in helps.items():
        text, _ = proc.communicate(timeout=BACKSTOP)
        assert proc.returncode == 0, (tool, text)
        for flag in wanted[tool]:
            assert re.search(rf"{re.escape(flag)}\b", text), f"{' '.join(tool)}: no {flag}"
    # the GPU run asks for cuda everywhere it names a device, the dry run for cpu
    assert {a[a.index("--device") + 1] for a in commands() if "--device" in a} == {"cuda"}
    assert {a[a.index("--device") + 1] for a in commands("--dry-run") if "--device" in a} == {"cpu"}


def test_unknown_check_or_option_is_one_line_and_exit_2():
    for arg, words in (("bench-nothing", "unknown check bench-nothing"),
                       ("--fast", "unknown option --fast")):
        out = subprocess.run([str(SCRIPT), arg], cwd=ROOT, capture_output=True, text=True,
                             timeout=BACKSTOP)
        assert out.returncode == 2 and words in out.stderr and len(out.stderr.splitlines()) == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_quickstart_device_places_the_trainer_and_every_engine(device, tmp_path):
    from tandem.master.quickstart import quickstart_config

    config = quickstart_config(tmp_path / "run", tmp_path / "model", tmp_path / "t.jsonl",
                               preset="synchronous", steps=2, seed=0, explorers=2, device=device)
    assert config.trainer.device == device
    assert {e.engine.device for e in config.explorers} == {device}
