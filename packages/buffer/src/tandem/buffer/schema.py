"""The database file of `SqliteStore`: opening it (one store per file, pragmas), its schema and
migrations, and the counters kept as rows.

Counters (unconsumed, dropped as stale, kept rows, the reported checkpoint step) live in a
table, so they commit and roll back with the rows they count.
"""

from __future__ import annotations

import fcntl
import sqlite3
from pathlib import Path
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import IO

from tandem.common.errors import TandemError

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiences (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    group_id TEXT NOT NULL,
    meta BLOB NOT NULL,
    tokens BLOB NOT NULL,
    action_mask BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    nbytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS experiences_group ON experiences(group_id);
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY,
    group_id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    size INTEGER NOT NULL,
    count INTEGER NOT NULL,
    state TEXT NOT NULL,
    uses INTEGER NOT NULL DEFAULT 0,
    priority REAL NOT NULL DEFAULT 0,
    lease_id TEXT,
    nbytes INTEGER NOT NULL,
    done_seq INTEGER,
    pruned INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS groups_order ON groups(state, uses, version, seq);
CREATE INDEX IF NOT EXISTS groups_priority ON groups(state, uses, priority DESC, seq);
CREATE INDEX IF NOT EXISTS groups_version ON groups(state, version);
CREATE INDEX IF NOT EXISTS groups_lease ON groups(lease_id) WHERE lease_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS groups_done ON groups(done_seq)
    WHERE done_seq IS NOT NULL AND pruned = 0;
CREATE TABLE IF NOT EXISTS leases (lease_id TEXT PRIMARY KEY, expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS uses (group_id TEXT NOT NULL, step INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS uses_step ON uses(step);
-- refs: how many experience rows name the image; the pruner deletes it with the last of them
CREATE TABLE IF NOT EXISTS images (hash TEXT PRIMARY KEY, data BLOB NOT NULL,
                                   refs INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO counters VALUES
    ('unconsumed', 0), ('dropped_stale', 0), ('kept_done', 0), ('done_seq', 0),
    ('checkpoint_step', 0);
"""

# Columns added after the first release: (table, column, declaration). A database written by an
# older buffer gains them on open; their NULL means what the older buffer meant.
_ADDED = (
    ("groups", "step", "INTEGER"),  # the trainer step whose ack consumed the group
    ("leases", "holder", "TEXT"),  # the consumer the lease was handed to
    # int32 per response token; NULL: every token at the experience's policy_version
    ("experiences", "token_versions", "BLOB"),
    # the content hashes of the prompt's images (table images), space-separated; NULL: none
    ("experiences", "images", "TEXT"),
    # experience rows naming the image; an older database's are counted when it gains the column
    ("images", "refs", "INTEGER NOT NULL DEFAULT 0"),
)
_AFTER = "CREATE INDEX IF NOT EXISTS leases_holder ON leases(holder) WHERE holder IS NOT NULL;"

CHUNK = 500  # host parameters per IN (...) list


def open_database(path: Path, synchronous: str) -> tuple[sqlite3.Connection, IO]:
    """A connection in WAL mode, and the held lock file that makes it the file's only store."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # One store per database: a second buffer on the same file would only fail later, one
    # "database is locked" at a time. The kernel drops the lock when the process dies.
    lock = open(f"{path}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise TandemError(f"another buffer is using {path} (it holds {path}.lock); "
                          "stop it, or point buffer.db or run_dir elsewhere") from None
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
        conn.execute("PRAGMA foreign_keys=OFF")
        conn.execute("PRAGMA cache_size=-65536")  # 64 MiB of page cache
        conn.execute("PRAGMA wal_autocheckpoint=0")  # the writer's checkpointer thread does it
        conn.execute("PRAGMA journal_size_limit=67108864")
    except BaseException:
        lock.close()
        raise
    return conn, lock


def create(conn: sqlite3.Connection) -> None:
    """Create or migrate the schema (idempotent)."""
    conn.executescript(SCHEMA)
    for table, column, decl in _ADDED:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            if (table, column) == ("images", "refs"):
                count_image_refs(conn)
    conn.executescript(_AFTER)


def image_refs(names: Iterable[str | None]) -> Counter[str]:
    """How many times each image is named by rows whose `experiences.images` are `names`."""
    return Counter(h for joined in names if joined for h in joined.split())


def count_image_refs(conn: sqlite3.Connection) -> None:
    """Set every image's `refs` from the experience rows (a database older than the column),
    and delete the images an older buffer's retention left without any."""
    refs = image_refs(row[0] for row in conn.execute(
        "SELECT images FROM experiences WHERE images IS NOT NULL"))
    conn.executemany("UPDATE images SET refs = ? WHERE hash = ?",
                     [(n, h) for h, n in refs.items()])
    conn.execute("DELETE FROM images WHERE refs <= 0")


def counter(conn: sqlite3.Connection, name: str) -> int:
    return conn.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()[0]


def bump(conn: sqlite3.Connection, name: str, delta: int) -> int:
    return conn.execute("UPDATE counters SET value = value + ? WHERE name = ? RETURNING value",
                        (delta, name)).fetchone()[0]


def set_counter(conn: sqlite3.Connection, name: str, value: int) -> None:
    conn.execute("UPDATE counters SET value = ? WHERE name = ?", (value, name))


def chunks(items: list, size: int = CHUNK) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def marks(items: list) -> str:
    return ",".join("?" * len(items))
