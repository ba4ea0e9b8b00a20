"""Fixtures for the buffer tests: a settable clock and stores on real SQLite files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from buffer_helpers import Clock

from tandem.buffer import SqliteStore

@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def open_store(tmp_path, clock):
    """Factory: a SqliteStore on tmp_path/buffer.sqlite (options as keywords); closed after."""
    stores: list[SqliteStore] = []

    def open_(**options) -> SqliteStore:
        options.setdefault("clock", clock)
        options.setdefault("synchronous", "normal")
        store = SqliteStore(tmp_path / "buffer.sqlite", **options)
        stores.append(store)
        return store

    yield open_
    for store in stores:
        store.close_sync()
