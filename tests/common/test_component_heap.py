"""A component's long-lived objects (its imports, what build() made) are in the garbage
collector's permanent generation once it serves: a full collection then neither scans them
(0.2 s a time in a trainer or an explorer, torch and transformers imported) nor, in a process
forked from a warm one, writes to the pages it shares with it (tests/master/test_zygote.py)."""

from __future__ import annotations

import asyncio
import gc

from tandem.common.cli import _serve


class _Component:
    def __init__(self) -> None:
        self.heap = [[n] for n in range(10_000)]  # what the imports and the build made
        self.frozen_at_serve = 0

    async def serve(self) -> None:
        self.frozen_at_serve = gc.get_freeze_count()

    async def close(self) -> None:
        pass

    def request_stop(self) -> None:
        pass


def test_what_the_build_made_is_frozen_before_the_component_serves():
    built: list[_Component] = []

    def build() -> _Component:
        built.append(_Component())
        return built[0]

    frozen = gc.get_freeze_count()
    try:
        asyncio.run(_serve(build))
        assert built[0].frozen_at_serve >= frozen + 10_000
    finally:
        gc.unfreeze()  # this test process goes on collecting as before
