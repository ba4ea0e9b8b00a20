"""tools/reward_hacks.py in make test: every known hack is caught by every reward function it
applies to, and every honest control still scores 1."""

from __future__ import annotations

import json


import reward_hacks


async def test_every_hack_is_caught_and_every_honest_answer_passes(tmp_path):
    out = tmp_path / "hacks.json"
    assert await reward_hacks.run(out) == 0
    report = json.loads(out.read_text())
    assert report["failed"] == [] and report["caught"] == report["attempts"] >= 25
    functions_tried = {fn for row in report["results"].values() for fn in row}
    assert functions_tried == set(reward_hacks.FUNCTIONS)
