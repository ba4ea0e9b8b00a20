"""The master's run journal: the messages that changed the run, appended, replayed on restart.

A record is one message (an accepted request such as `Register` or `TrainerStepDone`, or one of
the master's own decisions such as `TasksLeased`), encoded by `tandem.common.codec` exactly as it
would travel on a socket, so the journal has no record format of its own. On disk each record is
a frame:

    length   4 bytes, big-endian: bytes of the payload
    crc32    4 bytes, big-endian: zlib.crc32 of the payload
    payload  the codec's frame 0 (a msgpack map: v, type, id = record number, body)

Records are written and flushed to the OS before the decision they cause goes out, so a master
that is killed loses nothing another process saw; `fsync` runs in the background at most every
`sync_interval` seconds, which bounds what a machine crash can lose. Only the last record may be
torn (cut short, or failing its checksum: a crash mid-write); it is cut off when the journal is
opened again. Anything else that does not read back as a known, valid message stops the master
with a `JournalError` naming the file and the record: nothing is skipped.

Compaction (`compact`): once the records since the file's start pass `compact_bytes`, the master
writes its state as one `JournalSnapshot` record to `<journal>.compacting`, fsyncs it, renames it
over the journal and fsyncs the directory; appends then go to the new file. The old file is
replaced only by the rename, after the snapshot that covers it is durable, so a crash at any
point leaves either the old journal (and a stray `.compacting`, removed at the next `open`) or
the new one, and both replay to the same state. A snapshot is only ever the first record; the
record numbers go on from the `records` it stands for. Replay reads one record at a time.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path
from collections.abc import Callable, Iterator

import structlog

from tandem.common.codec import decode, encode_request
from tandem.common.errors import ProtocolError, TandemError
from tandem.common.messages.base import Message
from tandem.common.messages.master import JournalSnapshot

log = structlog.get_logger(__name__)

_HEAD = struct.Struct(">II")
MAX_RECORD_BYTES = 64 * 2**20  # a record holds one control message; anything larger is damage
_NO_SPLIT = 2**62  # every array inline: one record is one frame


class JournalError(TandemError):
    """The journal cannot be replayed as written; names the file and the record."""


class Journal:
    """Append-only file of the messages that changed the master's state."""

    def __init__(self, path: str | Path, *, sync_interval: float = 1.0, compact_bytes: int = 0):
        self.path = Path(path)
        self.sync_interval = sync_interval
        self.compact_bytes = compact_bytes  # 0: never compact
        self.records = 0  # complete records in the file, or stood for by its snapshot
        # called with each compaction step's name once it is done: where tests crash it
        self.on_compaction_step: Callable[[str], None] | None = None
        self._file = None
        self._dirty = False
        self._last_sync = time.monotonic()
        self._valid_bytes: int | None = None
        self._bytes = 0  # bytes in the file
        self._snapshot_bytes = 0  # ... of them the snapshot heading it

    @property
    def compacting_path(self) -> Path:
        return self.path.with_name(self.path.name + ".compacting")

    @property
    def compaction_due(self) -> bool:
        """The records appended after the file's snapshot (or start) reached `compact_bytes`."""
        return 0 < self.compact_bytes <= self._bytes - self._snapshot_bytes

    def replay(self) -> Iterator[tuple[int, Message]]:
        """(record number from 1, message) for every complete record, in order; a snapshot
        heading the file comes as (the records it stands for, the `JournalSnapshot`). Reads
        one record at a time: memory does not grow with the file."""
        self.records = 0
        self._valid_bytes = self._snapshot_bytes = 0
        try:
            file = open(self.path, "rb")
        except FileNotFoundError:
            return
        with file:
            size = os.fstat(file.fileno()).st_size
            pos = 0
            while pos < size:
                number = self.records + 1
                where = f"{self.path} record {number}"
                head = file.read(_HEAD.size)
                if len(head) < _HEAD.size:
                    self._torn(where, "cut inside its header")
                    break
                length, crc = _HEAD.unpack(head)
                if length > MAX_RECORD_BYTES:
                    raise JournalError(f"{where} at byte {pos}: claims {length} bytes, more "
                                       f"than any record ({MAX_RECORD_BYTES}); the journal is "
                                       "damaged")
                end = pos + _HEAD.size + length
                payload = file.read(length)
                if len(payload) < length:
                    self._torn(where, f"cut at {len(payload)} of {length} bytes")
                    break
                if zlib.crc32(payload) != crc:
                    if end == size:
                        self._torn(where, "fails its checksum")
                        break
                    raise JournalError(f"{where} at byte {pos}: fails its checksum and records "
                                       "follow it; the journal is damaged")
                try:
                    envelope = decode([payload], max_message_bytes=MAX_RECORD_BYTES)
                except ProtocolError as exc:
                    raise JournalError(f"{where}: {exc}") from None
                if envelope.body is None or envelope.type == "reply":
                    raise JournalError(f"{where}: a {envelope.type!r} envelope is not a record")
                if isinstance(envelope.body, JournalSnapshot):
                    if pos:
                        raise JournalError(f"{where} at byte {pos}: a snapshot that is not the "
                                           "first record; the journal is damaged")
                    number = envelope.body.records
                    self._snapshot_bytes = end
                pos = end
                self.records = number
                self._valid_bytes = pos
                yield number, envelope.body

    def _torn(self, where: str, why: str) -> None:
        log.warning("journal.torn_record", record=where, why=why, action="cut off")

    def open(self) -> None:
        """Open for appending, after `replay()` (a torn last record is cut off first, and a
        compaction a crash cut short is removed)."""
        if self._valid_bytes is None:
            for _ in self.replay():
                pass
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.compacting_path.unlink(missing_ok=True)  # never renamed: it covers nothing
        if self.path.exists() and self.path.stat().st_size > self._valid_bytes:
            with open(self.path, "rb+") as f:
                f.truncate(self._valid_bytes)
        self._file = _append_only(self.path, truncate=False)
        self._bytes = self._valid_bytes

    def _frame(self, msg: Message, number: int) -> bytes:
        payload = bytes(encode_request(msg.on_disk(), str(number),
                                       inline_threshold=_NO_SPLIT)[0])
        return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload

    def append(self, msg: Message) -> int:
        """Write one record (`msg.on_disk()`: no secret reaches the file) and flush it to the OS;
        returns its record number."""
        self.records += 1
        frame = self._frame(msg, self.records)
        self._file.write(frame)
        self._file.flush()
        self._bytes += len(frame)
        self._dirty = True
        return self.records

    def compact(self, snapshot: JournalSnapshot) -> bool:
        """Replace the journal by `snapshot` (the state after its last record), durably; the
        next records are appended after it. False (logged) when the disk refused: the journal
        goes on as it was."""
        if snapshot.records != self.records:
            raise ValueError(f"a snapshot of {snapshot.records} records for a journal of "
                             f"{self.records}")
        frame = self._frame(snapshot, snapshot.records)
        tmp = self.compacting_path
        new = None
        try:
            new = _append_only(tmp, truncate=True)
            new.write(frame)
            new.flush()
            self._step("written")
            os.fsync(new.fileno())
            self._step("synced")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("journal.compaction_failed", path=str(tmp), error=str(exc),
                        action="the journal goes on uncompacted")
            if new is not None:
                new.close()
            tmp.unlink(missing_ok=True)
            return False
        # the old file is gone from the directory: every append goes to the new one from here
        old, self._file = self._file, new
        old.close()
        before, self._bytes = self._bytes, len(frame)
        self._snapshot_bytes, self._dirty = len(frame), False
        self._step("renamed")
        try:  # the rename itself survives a machine crash only once the directory is synced
            _fsync_dir(self.path.parent)
        except OSError as exc:
            log.warning("journal.dir_sync_failed", path=str(self.path.parent), error=str(exc))
        self._step("dir_synced")
        log.info("journal.compacted", records=snapshot.records, bytes_before=before,
                 bytes_after=len(frame))
        return True

    def _step(self, name: str) -> None:
        if self.on_compaction_step is not None:
            self.on_compaction_step(name)

    def maybe_sync(self) -> None:
        """fsync if something was appended since the last one, at most every `sync_interval`
        seconds; safe to call from a worker thread while the loop keeps appending."""
        file = self._file
        if file is not None and self._dirty and (
                time.monotonic() - self._last_sync >= self.sync_interval):
            self._dirty = False
            self._last_sync = time.monotonic()
            try:
                os.fsync(file.fileno())
            except (OSError, ValueError):  # closed meanwhile: close() synced it
                pass

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def _append_only(path: Path, *, truncate: bool):
    # 0600 as well as under the private run dir: the journal is the run's state
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    return os.fdopen(os.open(path, flags, 0o600), "ab")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_journal(path: str | Path) -> list[Message]:
    """Every record of a journal file, for tools and tests (a compacted one's snapshot first)."""
    return [msg for _, msg in Journal(path).replay()]


def final_status_path(journal: Path) -> Path:
    """Where a master writes its `Status` as it closes: beside its journal (`tandem up` reads
    the run's outcome there)."""
    return journal.with_name("status.json")


__all__ = ["MAX_RECORD_BYTES", "Journal", "JournalError", "final_status_path", "read_journal"]
