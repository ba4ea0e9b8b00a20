"""Per-token versions (interruptible rollouts) through the store: stored as written, and a
database from before the column reads as every token at its experience's version."""

from __future__ import annotations

import asyncio
import sqlite3

import numpy as np
import pytest

from tandem.buffer import SqliteStore
from tandem.common.messages import Experience

from buffer_helpers import make_group


def mixed(exp: Experience, switch: int, new: int) -> Experience:
    """`exp` as if weights `new` arrived after its first `switch` response tokens."""
    versions = np.full(exp.response_len, new, dtype=np.int32)
    versions[:switch] = exp.policy_version
    return exp.model_copy(update={"token_versions": versions})


def test_token_versions_round_trip(open_store):
    store = open_store()
    plain, interrupted = make_group("t", 2, version=3, tokens=20, prompt_len=5)
    interrupted = mixed(interrupted, 6, 5)

    async def go():
        await store.put([plain, interrupted], [2, 2])
        return await store.sample(1)

    got = {e.id: e for e in asyncio.run(go()).experiences}
    back = got[interrupted.id].token_versions
    assert back.dtype == np.int32
    assert back.tolist() == [3] * 6 + [5] * 9
    assert got[plain.id].token_versions is None
    assert got[plain.id].versions_of_tokens().tolist() == [3] * 15


def test_a_database_from_before_the_column_reads_as_one_version(tmp_path, clock):
    path = tmp_path / "buffer.sqlite"
    store = SqliteStore(path, clock=clock)
    asyncio.run(store.put(make_group("old", 2, version=2), [2, 2]))
    store.close_sync()
    conn = sqlite3.connect(path)  # the file as an older buffer left it
    conn.execute("ALTER TABLE experiences DROP COLUMN token_versions")
    conn.commit()
    conn.close()

    store = SqliteStore(path, clock=clock)  # migrates: the column comes back, NULL
    lease = asyncio.run(store.sample(1))
    store.close_sync()
    assert [e.token_versions for e in lease.experiences] == [None, None]
    assert all((e.versions_of_tokens() == 2).all() for e in lease.experiences)


def test_policy_version_is_never_newer_than_a_token():
    exp = make_group("t", 1, version=4, tokens=10, prompt_len=4)[0]
    with pytest.raises(ValueError, match="newer than a token's"):
        Experience.model_validate({**exp.model_dump(), "token_versions": [3] + [5] * 5})
    # a response sampled after its group's first ones: all newer than the group's version
    assert Experience.model_validate({**exp.model_dump(), "token_versions": [5] * 6})
    with pytest.raises(ValueError, match="token_versions has 2 entries"):
        Experience.model_validate({**exp.model_dump(), "token_versions": [4, 4]})
