"""The import rules of docs/design.md §1, as `lint-imports` checks them with the contracts in the root
pyproject.toml: components are independent, tandem.common imports no component and not
tandem.weights, tandem.weights imports no component, the control plane needs no torch, and no
package has an import cycle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from backstop import BACKSTOP

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
                         cwd=ROOT, capture_output=True, text=True, timeout=BACKSTOP)
    assert run.returncode == 0, f"import contracts broken:\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout
