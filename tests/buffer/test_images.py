"""Image experiences through a served buffer (docs/vision.md): an image is stored once by its
content hash however many experiences and puts refer to it, a re-put stores nothing new, a
restarted buffer still holds it, and a sample carries each image once, as raw bytes."""

from __future__ import annotations

import asyncio
import sqlite3

import numpy as np
import pytest
from vision_helpers import picture

from tandem.common.errors import RequestFailed
from tandem.common.images import image_hash, normalise
from tandem.common.messages import PutExperiences, SampleGroups

from buffer_helpers import Running, config_for, make_group


def with_images(group, *hashes):
    return [e.model_copy(update={"images": list(hashes)}) for e in group]


def stored_images(tmp_path) -> list[tuple[str, int]]:
    conn = sqlite3.connect(tmp_path / "buffer.sqlite")
    try:
        return conn.execute("SELECT hash, length(data) FROM images ORDER BY hash").fetchall()
    finally:
        conn.close()


def test_an_image_is_stored_once_and_sampled_once(tmp_path):
    red, blue = normalise(picture((255, 0, 0), (16, 16))), normalise(picture((0, 0, 255), (16, 16)))
    r, b = image_hash(red), image_hash(blue)
    g1 = with_images(make_group("t1", 4), r)
    g2 = with_images(make_group("t2", 4), r, b)
    images = {r: np.frombuffer(red, np.uint8), b: np.frombuffer(blue, np.uint8)}

    async def go():
        async with Running(config_for(tmp_path)) as buf:
            first = await buf.call(PutExperiences(experiences=g1, group_size=4,
                                                  images={r: images[r]}))
            again = await buf.call(PutExperiences(experiences=g1, group_size=4,
                                                  images={r: images[r]}))
            # the red picture is held already: a put need not carry it again
            second = await buf.call(PutExperiences(experiences=g2, group_size=4,
                                                   images={b: images[b]}))
            return first, again, second

    first, again, second = asyncio.run(go())
    assert (first.stored, again.stored, again.duplicates, second.stored) == (4, 0, 4, 4)
    assert stored_images(tmp_path) == sorted([(r, len(red)), (b, len(blue))])

    async def sample():  # a fresh buffer process's view: the file is all there is
        async with Running(config_for(tmp_path)) as buf:
            return await buf.call(SampleGroups(num_groups=2))

    lease = asyncio.run(sample())
    assert sorted(lease.images) == sorted([r, b])
    assert all(v.dtype == np.uint8 for v in lease.images.values())
    assert lease.images[r].tobytes() == red and lease.images[b].tobytes() == blue
    assert {tuple(e.images) for e in lease.experiences} == {(r,), (r, b)}


@pytest.mark.parametrize("case", ["unknown", "wrong_hash"])
def test_a_put_with_a_missing_or_false_image_is_refused_whole(tmp_path, case):
    red = normalise(picture((255, 0, 0), (16, 16)))
    group = with_images(make_group("t", 2), image_hash(red))
    images = {} if case == "unknown" else {image_hash(red): np.frombuffer(b"other", np.uint8)}

    async def go():
        async with Running(config_for(tmp_path)) as buf:
            with pytest.raises(RequestFailed) as err:
                await buf.call(PutExperiences(experiences=group, group_size=2, images=images))
            return err.value

    err = asyncio.run(go())
    assert err.code == "bad_request"
    assert ("does not carry" in str(err)) if case == "unknown" else ("hash to" in str(err))
    assert stored_images(tmp_path) == []


def test_an_image_goes_with_the_last_experience_that_names_it(open_store, tmp_path):
    """Retention prunes images with the rows: consumed groups' rows go (keep_consumed=0), and
    with them every image no kept row names; an image a waiting group still names stays, and
    goes when that group's rows go. A retried put of a pruned group stores nothing again."""
    red, blue = normalise(picture((255, 0, 0), (16, 16))), normalise(picture((0, 0, 255), (16, 16)))
    r, b = image_hash(red), image_hash(blue)
    store = open_store(keep_consumed=0)
    given = {r: red, b: blue}

    async def consume(n):
        lease = await store.sample(n)
        await store.ack(lease.lease_id)  # no step: nothing holds the rows for a rewind

    async def first():
        for group in (with_images(make_group("t1", 2), r), with_images(make_group("t2", 2), r, b),
                      with_images(make_group("t3", 2), r)):
            await store.put(group, [2, 2], given)
        await consume(2)  # t1 and t2, the oldest

    asyncio.run(first())
    store.close_sync()  # finishes the pruner's work
    assert stored_images(tmp_path) == [(r, len(red))]  # t3 still names the red one

    store = open_store(keep_consumed=0)

    async def second():
        await consume(1)
        return await store.put(with_images(make_group("t1", 2), r), [2, 2], given)

    again = asyncio.run(second())
    store.close_sync()
    assert again.duplicates == 2
    assert stored_images(tmp_path) == []


def test_a_database_older_than_image_refs_counts_them_on_open(open_store, tmp_path):
    red = normalise(picture((255, 0, 0), (16, 16)))
    r = image_hash(red)
    store = open_store(keep_consumed=0)
    asyncio.run(store.put(with_images(make_group("t1", 2), r), [2, 2], {r: red}))
    store.close_sync()
    conn = sqlite3.connect(tmp_path / "buffer.sqlite")
    conn.execute("ALTER TABLE images DROP COLUMN refs")  # as an older buffer wrote it
    conn.close()
    store = open_store(keep_consumed=0)

    async def consume():
        lease = await store.sample(1)
        await store.ack(lease.lease_id)

    asyncio.run(consume())
    store.close_sync()
    assert stored_images(tmp_path) == []
