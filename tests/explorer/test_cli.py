"""`tandem-explorer`: arguments, config errors and failures end as one line and an exit code."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from backstop import BACKSTOP
from tandem.explorer.cli import main


def test_help_answers_without_importing_torch():
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from tandem.explorer.cli import main\n"
         "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
         "print('torch' in sys.modules, 'transformers' in sys.modules)"],
        capture_output=True, text=True, timeout=BACKSTOP)
    assert "--config" in out.stdout and "--name" in out.stdout
    assert out.stdout.strip().endswith("False False")


def test_bad_config_and_unknown_name_exit_2_with_one_message(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("master: {total_steps: 1}\nexplorers: [{name: a, batch_size: 0}]\n")
    result = CliRunner().invoke(main, ["--config", str(config), "--name", "a"])
    assert result.exit_code == 2 and "explorers[0].batch_size" in result.output
    config.write_text("master: {total_steps: 1}\nexplorers: [{name: a}]\n")
    result = CliRunner().invoke(main, ["--config", str(config), "--name", "b"])
    assert result.exit_code == 2 and "no explorer named 'b'" in result.output
    assert "Traceback" not in result.output


def test_a_missing_model_fails_with_exit_1_naming_the_key(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nmaster: {{total_steps: 1}}\n"
                      f"model: {{path: {tmp_path / 'nope'}}}\nlogging: {{trace: false}}\n")
    result = CliRunner().invoke(main, ["--config", str(config), "--name", "explorer-0"])
    assert result.exit_code == 1
    assert "model.path" in result.output and "Traceback" not in result.output
