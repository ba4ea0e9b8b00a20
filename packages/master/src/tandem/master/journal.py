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
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path
from collections.abc import Iterator

import structlog

from tandem.common.codec import decode, encode_request
from tandem.common.errors import ProtocolError, TandemError
from tandem.common.messages.base import Message

log = structlog.get_logger(__name__)

_HEAD = struct.Struct(">II")
MAX_RECORD_BYTES = 64 * 2**20  # a record holds one control message; anything larger is damage
_NO_SPLIT = 2**62  # every array inline: one record is one frame


class JournalError(TandemError):
    """The journal cannot be replayed as written; names the file and the record."""


class Journal:
    """Append-only file of the messages that changed the master's state."""

    def __init__(self, path: str | Path, *, sync_interval: float = 1.0):
        self.path = Path(path)
        self.sync_interval = sync_interval
        self.records = 0  # complete records in the file (read or written)
        self._file = None
        self._dirty = False
        self._last_sync = time.monotonic()
        self._valid_bytes: int | None = None

    def replay(self) -> Iterator[tuple[int, Message]]:
        """(record number from 1, message) for every complete record, in order."""
        self.records = 0
        if not self.path.exists():
            self._valid_bytes = 0
            return
        data = self.path.read_bytes()
        pos = 0
        while pos < len(data):
            number = self.records + 1
            where = f"{self.path} record {number}"
            if len(data) - pos < _HEAD.size:
                self._torn(where, "cut inside its header")
                break
            length, crc = _HEAD.unpack_from(data, pos)
            if length > MAX_RECORD_BYTES:
                raise JournalError(f"{where} at byte {pos}: claims {length} bytes, more than "
                                   f"any record ({MAX_RECORD_BYTES}); the journal is damaged")
            end = pos + _HEAD.size + length
            payload = data[pos + _HEAD.size:end]
            if end > len(data):
                self._torn(where, f"cut at {len(payload)} of {length} bytes")
                break
            if zlib.crc32(payload) != crc:
                if end == len(data):
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
            pos = end
            self.records = number
            yield number, envelope.body
        self._valid_bytes = pos

    def _torn(self, where: str, why: str) -> None:
        log.warning("journal.torn_record", record=where, why=why, action="cut off")

    def open(self) -> None:
        """Open for appending, after `replay()` (a torn last record is cut off first)."""
        if self._valid_bytes is None:
            for _ in self.replay():
                pass
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > self._valid_bytes:
            with open(self.path, "rb+") as f:
                f.truncate(self._valid_bytes)
        # 0600 as well as under the private run dir: the journal is the run's state
        self._file = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600),
                               "ab")

    def append(self, msg: Message) -> int:
        """Write one record (`msg.on_disk()`: no secret reaches the file) and flush it to the OS;
        returns its record number."""
        self.records += 1
        payload = bytes(encode_request(msg.on_disk(), str(self.records),
                                       inline_threshold=_NO_SPLIT)[0])
        self._file.write(_HEAD.pack(len(payload), zlib.crc32(payload)) + payload)
        self._file.flush()
        self._dirty = True
        return self.records

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


def read_journal(path: str | Path) -> list[Message]:
    """Every record of a journal file, for tools and tests."""
    return [msg for _, msg in Journal(path).replay()]


__all__ = ["MAX_RECORD_BYTES", "Journal", "JournalError", "read_journal"]
