"""`make test` on a fresh host installs bubblewrap (and `make test-slurm` Slurm) with apt-get.
Two runs that start at once must install it once, not fail on the lock the other holds: the
first's apt-get holds dpkg's lock, and a second apt-get fails at once on it.

The host's real apt-get cannot be run twice here (it would change the host, and bubblewrap is
installed already), so the boundary is a stand-in `apt-get` on PATH that behaves as dpkg's lock
makes the real one behave: it fails when another holds its lock, and otherwise installs the
command by writing it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backstop import BACKSTOP

REPO = Path(__file__).resolve().parents[1]

# fails as apt-get does when another apt-get holds dpkg's lock; else takes a second to install
FAKE_APT = """#!/bin/sh
echo "$$ $*" >> "{calls}"
case "$*" in *install*) ;; *) exit 0 ;; esac
exec 9>"{dpkg_lock}"
flock -n 9 || {{ echo "E: Could not get lock {dpkg_lock}" >&2; exit 100; }}
sleep 1
printf '#!/bin/sh\\nexit 0\\n' > "{bin}/tandem-test-sandbox"
chmod +x "{bin}/tandem-test-sandbox"
"""


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0 or not shutil.which("flock"),
                    reason="installs as root with flock, as CI does")
def test_two_make_bwrap_at_once_install_once_and_both_succeed(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    apt = bin_dir / "apt-get"
    apt.write_text(FAKE_APT.format(calls=calls, dpkg_lock=tmp_path / "dpkg.lock", bin=bin_dir))
    apt.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "TANDEM_APT_LOCK": str(tmp_path / "tandem-apt.lock"), "TANDEM_APT_WAIT": "60"}
    make = ["make", "-s", "-C", str(REPO), "bwrap", "BWRAP=tandem-test-sandbox"]
    runs = [subprocess.Popen(make, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for _ in range(2)]
    outs = [run.communicate(timeout=BACKSTOP)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outs
    installs = [line for line in calls.read_text().splitlines() if "install" in line]
    assert len(installs) == 1, installs  # the second found it installed, under the lock
    assert (bin_dir / "tandem-test-sandbox").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX sh")
def test_a_missing_command_without_root_or_apt_says_how(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "id", "flock"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    # no apt-get on PATH: the install cannot happen, and the message says what to run
    out = subprocess.run(["/bin/sh", str(REPO / "tools" / "apt_install.sh"), "the code sandbox",
                          "tandem-test-sandbox", "bubblewrap"], env={"PATH": str(bin_dir)},
                         capture_output=True, text=True, timeout=BACKSTOP)
    assert out.returncode == 1
    assert "the code sandbox needs bubblewrap: apt-get install bubblewrap (as root)" in out.stderr
