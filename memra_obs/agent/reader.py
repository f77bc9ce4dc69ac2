"""The agent's side of one ring: copy slots out in batches, keep only what provably did not
change while it was copied, and count exactly what was lost.

Why a batch copy is safe without any lock (single writer, x86-64 store order): the writer
publishes ``head`` after a record's slots are complete, and stores to a slot only while
writing position ``p >= head``. So after copying positions ``[a, b)`` (all ``< head`` read
before the copy), reading ``head`` again as ``h2`` bounds what the writer may have touched
meanwhile: positions below ``h2 + MAXSPAN``. A copied position ``x`` shares its slot with
``x + N``; it is intact iff ``x + N >= h2 + MAXSPAN`` and its copied ``seq`` is ``x + 1``.
Lost records are counted from the record numbers in the slots, so a record of 10 slots lost
counts once, exactly.

The cursor (next position, next record) lives in the ring's reader-owned header line and is
written by :meth:`RingReader.commit` after the agent has published what it read: a new agent
resumes there.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..timeline import SessionRecord
from . import format as F

__all__ = ["FormatError", "Item", "RingReader"]


class FormatError(ValueError):
    """The file is not a ring this version can read."""


class Item(NamedTuple):
    """One record read: its first slot's position, its kind, and the decoded record
    (``(SessionRecord, in_table)`` for a session)."""

    pos: int
    kind: int
    rec: Any


class RingReader:
    """Attach to one ring file. Not thread-safe; one agent per directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        #: False when the file is not ours to write (another uid): the cursor then lives
        #: only in this process, and a restarted agent starts over from the ring's oldest.
        self.writable = True
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError:
            fd = os.open(path, os.O_RDONLY)
            self.writable = False
        try:
            size = os.fstat(fd).st_size
            if size < F.HEADER:
                raise FormatError(f"{path}: {size} bytes is shorter than a ring header")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._mm = mm
        try:
            self._check(mm, size)
        except BaseException:
            self.close()
            raise
        pos, rec, lost, _ = F.READER.unpack_from(mm, F.OFF_READER)
        self.pos = pos
        self.rec = rec
        #: Where this reader started (persisted cursor of a previous agent, or 0).
        self.start_pos = pos
        #: Records lost, as counted in the ring across agents (persisted) ...
        self.lost_persisted = lost
        #: ... and by this reader: overwritten before it could copy them, and unreadable.
        self.overwritten = 0
        self.corrupt = 0
        self.gone = False

    def _check(self, mm: mmap.mmap, size: int) -> None:
        (magic, version, slot, slots, maxspan, entries, entry, data_off, pid, created, n,
         label) = F.IDENT.unpack_from(mm, 0)  # fmt: skip
        if magic != F.MAGIC or version != F.VERSION:
            raise FormatError(
                f"{self.path}: not a memra-obs ring v{F.VERSION} (magic {magic!r}, v{version})"
            )
        if slot != F.SLOT or maxspan != F.MAXSPAN or entry != F.TABLE_ENTRY:
            raise FormatError(
                f"{self.path}: slot geometry {slot}/{maxspan}/{entry} is not this version's"
            )
        try:
            geo = F.Geometry(slots, entries)
        except ValueError as exc:
            raise FormatError(f"{self.path}: {exc}") from None
        if geo.data_off != data_off or geo.size > size:
            raise FormatError(f"{self.path}: header says {geo.size} bytes, file has {size}")
        self.geo = geo
        self.pid = pid
        self.created_ns_epoch = created
        self.worker = label[:n].decode("utf-8", "replace")

    # -- writer state --------------------------------------------------------------------

    def head(self) -> tuple[int, int]:
        """(positions published, records published) as the writer last stored them."""
        return F.HEAD.unpack_from(self._mm, F.OFF_HEAD)

    def writer_stats(self) -> tuple[int, int, bool]:
        """(records refused by the writer, sessions not in the table, closed cleanly)."""
        refused, table_full, closed = F.WSTAT.unpack_from(self._mm, F.OFF_WSTAT)
        return refused, table_full, bool(closed)

    def writer_gone(self) -> bool:
        """True once the writer process no longer holds its lock (exited, killed, closed).
        Sticky: the ring cannot grow afterwards."""
        if not self.gone:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.gone = True
        return True

    @property
    def lost(self) -> int:
        """Records this reader lost (overwritten before read, or unreadable)."""
        return self.overwritten + self.corrupt

    def caught_up(self) -> bool:
        return self.pos >= self.head()[0]

    # -- reading -------------------------------------------------------------------------

    def _copy(self, start: int, end: int) -> bytes:
        geo = self.geo
        a = start & geo.mask
        n = end - start
        base = geo.data_off
        mm = self._mm
        if a + n <= geo.slots:
            return mm[base + a * F.SLOT : base + (a + n) * F.SLOT]
        first = geo.slots - a
        return (
            mm[base + a * F.SLOT : base + geo.slots * F.SLOT]
            + mm[base : base + (n - first) * F.SLOT]
        )

    def _slots(self, start: int, end: int) -> Iterator[tuple[int, int, int, int, bytes, int]]:
        """Intact records whose slots all lie in [start, end): (pos, rec, kind, span, buf, i).
        Stops early at a record the range cuts (yields nothing for it)."""
        buf = self._copy(start, end)
        h2 = F.U64.unpack_from(self._mm, F.OFF_HEAD)[0]
        floor = h2 - self.geo.slots + (0 if self.gone else F.MAXSPAN)
        head_unpack = F.SLOT_HEAD.unpack_from
        x = max(start, floor)
        while x < end:
            i = (x - start) * F.SLOT
            seq, meta = head_unpack(buf, i)
            kind = (meta >> 8) & 0xFF
            span = meta & 0xFF
            if seq != x + 1 or kind == F.KIND_CONT or not 1 <= span <= F.MAXSPAN:
                x += 1
                continue
            rec = meta >> 16
            if x + span > end:
                self._cut = x
                return
            ok = True
            for k in range(1, span):
                s2, m2 = head_unpack(buf, i + k * F.SLOT)
                if s2 != x + k + 1 or m2 != (rec << 16) | k:
                    ok = False
                    break
            if not ok:
                x += 1
                continue
            yield x, rec, kind, span, buf, i
            x += span
        self._cut = end

    def poll(self, max_slots: int = 4096) -> list[Item]:
        """Records published since the cursor (at most ``max_slots`` slots' worth), in order.
        Advances the in-memory cursor; :meth:`commit` persists it."""
        head = F.U64.unpack_from(self._mm, F.OFF_HEAD)[0]
        pos = self.pos
        if head <= pos:
            return []
        start = max(pos, head - self.geo.slots)
        end = min(head, start + max_slots)
        out: list[Item] = []
        expect = self.rec
        decode = F.decode
        for x, rec, kind, span, buf, i in self._slots(start, end):
            if rec < expect:
                continue  # cannot happen with one writer; never deliver twice
            self.overwritten += rec - expect
            expect = rec + 1
            if span == 1:
                payload: Any = memoryview(buf)[i + F.SLOT_HDR : i + F.SLOT]
            else:
                payload = b"".join(
                    buf[i + k * F.SLOT + F.SLOT_HDR : i + (k + 1) * F.SLOT] for k in range(span)
                )
            try:
                out.append(Item(x, kind, decode(kind, payload)))
            except Exception:
                self.corrupt += 1
        self.pos = self._cut
        self.rec = expect
        return out

    def finish(self) -> int:
        """After the writer is gone and everything is read: records it published that this
        reader never saw (the tail was overwritten) are lost too. Returns that count."""
        _, rec_next = self.head()
        tail = max(0, rec_next - self.rec)
        self.overwritten += tail
        self.rec = max(self.rec, rec_next)
        return tail

    def commit(self) -> None:
        """Persist the cursor: a restarted agent resumes after what was published."""
        if not self.writable:
            return
        F.READER.pack_into(
            self._mm, F.OFF_READER, self.pos, self.rec, self.lost_persisted + self.lost, os.getpid()
        )

    # -- sessions ------------------------------------------------------------------------

    def open_sessions(self) -> dict[int, tuple[int, SessionRecord, bool]]:
        """The writer's table of open sessions: local id -> (position of its SessionRecord,
        record, in_table). Entries being rewritten while read are skipped."""
        mm = self._mm
        geo = self.geo
        out: dict[int, tuple[int, SessionRecord, bool]] = {}
        cap = F.TABLE_ENTRY - F.TABLE_HDR
        for e in range(geo.table_entries):
            off = geo.table_off + e * F.TABLE_ENTRY
            if not F.U64.unpack_from(mm, off)[0]:
                continue
            seq, sid, n = F.TABLE_ENTRY_HEAD.unpack_from(mm, off)
            payload = mm[off + F.TABLE_HDR : off + F.TABLE_HDR + min(n, cap)]
            if seq == 0 or F.U64.unpack_from(mm, off)[0] != seq:
                continue
            try:
                rec, in_table = F.decode_session(payload)
            except Exception:
                continue
            if rec.session == sid:
                out[sid] = (seq - 1, rec, in_table)
        return out

    def sessions_before(self, pos: int) -> dict[int, tuple[int, SessionRecord, bool]]:
        """SessionRecords still in the ring below ``pos`` (what a previous agent read): the
        context of sessions whose later records lie past the cursor."""
        head = self.head()[0]
        lo = max(0, head - self.geo.slots)
        out: dict[int, tuple[int, SessionRecord, bool]] = {}
        step = 4096
        a = lo
        while a < pos:
            b = min(pos, a + step)
            nxt = b
            for x, _rec, kind, span, buf, i in self._slots(a, b):
                if kind == F.KIND_SESSION:
                    payload = b"".join(
                        buf[i + k * F.SLOT + F.SLOT_HDR : i + (k + 1) * F.SLOT] for k in range(span)
                    )
                    try:
                        rec, in_table = F.decode_session(payload)
                    except Exception:
                        continue
                    out[rec.session] = (x, rec, in_table)
            nxt = self._cut if self._cut > a else b
            a = nxt
        return out

    # -- end -----------------------------------------------------------------------------

    def close(self, unlink: bool = False) -> None:
        try:
            self._mm.close()
        except Exception:
            pass
        try:
            os.close(self._fd)
        except OSError:
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:  # gone already, or not ours to remove: the agent skips it
                pass
