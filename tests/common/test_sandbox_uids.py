"""As root, a sandbox's slots run under uids it claims host-wide for as long as it lives
(`SlotUids`): never one another sandbox holds (tests/reward/test_code.py runs two at once), never
one some process still runs as, and none at all once the sandbox is closed: a closed sandbox
fails closed rather than hand out our own uid, which as root is 0."""

from __future__ import annotations

import os
import subprocess

import pytest
from backstop import BACKSTOP

from tandem.common.config.reward import CodeSandboxConfig
from tandem.common.errors import TandemError
from tandem.common.sandbox import Sandbox, SlotUids

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-slot uids are used as root")


def test_a_uid_some_process_still_runs_as_is_not_claimed():
    """A sandbox's leftover (a kill that gave up) would share the next one's process limit."""
    base = 63500  # apart from the defaults the other sandbox tests claim from
    squatter = subprocess.Popen(["sleep", "600"], user=base, group=base)
    try:
        uids = SlotUids(base, 2, "test")
        try:
            assert len(uids.uids) == 2 and base not in uids.uids, uids.uids
        finally:
            uids.release()
    finally:
        squatter.kill()
        squatter.wait(BACKSTOP)


async def test_a_closed_sandbox_hands_out_no_uid():
    box = Sandbox(CodeSandboxConfig(isolation="none"), slots=1)
    await box.start()
    try:
        assert 0 not in box.slot_uids(0)
    finally:
        await box.close()
    with pytest.raises(TandemError, match="closed"):
        box.slot_uids(0)
