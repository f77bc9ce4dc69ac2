"""The agent's side of one ring: :class:`RingReader` checks the file and reads its records,
counting exactly what was lost; :class:`RingStream` turns them into the exporters' stream.

Why read through the descriptor (``pread``), not a mapping: a mapped file that shrinks kills
the reader with SIGBUS; a short read is only a ring to drop.

Why a batch copy needs no lock (one writer, x86-64 store order): the writer publishes
``head`` after a record's slots and writes a slot only while writing a position >= head.
After copying positions below the ``head`` read before, a second read ``h2`` bounds what the
writer may have touched meanwhile: positions below ``h2 + MAXSPAN``, i.e. the slots of
positions below ``h2 + MAXSPAN - N``. Everything at or above that floor is intact. The
writer's counters are read until two reads agree, so a store in flight is never half-seen.

Why every rule: the directory may be world-writable (a k8s ``emptyDir``). A ring is believed
only when its owner is the agent's uid, its size matches its geometry and every counter
follows the writer's laws: positions and records only move forward, each record takes 1 to
MAXSPAN slots (so ``u <= s <= MAXSPAN*u`` between any two points, ``u`` records over ``s``
slots), every slot at or above the floor holds its own position. A ring that breaks a rule
twice in a row (once could be a write in flight) raises :class:`FormatError`.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..timeline import BurstRecord, Record, RoundRecord, SessionEndRecord, SessionRecord
from . import format as F

__all__ = ["FormatError", "Item", "RingReader", "RingStream"]

#: Every counter stays below this (~9 years of a million slots a second): more is a lie.
LIMIT = 1 << 48
WORKER_GONE, RING_OVERRUN, UNKNOWN_FAMILY = "WorkerGone", "RingOverrun", "unknown"
#: Sessions kept open per ring before the oldest is closed as lost.
MAX_OPEN = 65536


class FormatError(ValueError):
    """Not a ring, or one that broke a rule: nothing more is read from it."""


class Item(NamedTuple):
    """One record read: its first slot's position, kind, and the decoded record
    (``(SessionRecord, in_table)`` for a session)."""

    pos: int
    kind: int
    rec: Any


class RingReader:
    """One ring file, checked at attach and at every read. ``uid``: the owner it must have
    (default: this process's). Not thread-safe; one agent per directory."""

    def __init__(self, path: str, uid: int | None = None) -> None:
        self.path, self.writable, self.gone = path, True, False
        flags = os.O_NOFOLLOW | os.O_NONBLOCK  # a link or a FIFO is refused, never waited on
        try:
            self._fd = os.open(path, os.O_RDWR | flags)
        except PermissionError:  # not ours to write: read, but keep the cursor here only
            self._fd, self.writable = os.open(path, os.O_RDONLY | flags), False
        try:
            self._attach(os.geteuid() if uid is None else uid)
        except BaseException:
            os.close(self._fd)
            raise

    def _attach(self, uid: int) -> None:
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise FormatError(f"{self.path}: not a plain file with one name")
        if st.st_uid != uid or st.st_mode & 0o022:
            raise FormatError(f"{self.path}: owned by uid {st.st_uid} (mode {st.st_mode & 0o777:o}), "
                              f"not by this agent's uid {uid} alone")  # fmt: skip
        (magic, version, slot, slots, maxspan, entries, entry, data_off, self.pid, self.created_ns,
         n, label) = F.IDENT.unpack(self._pread(F.IDENT.size, 0))  # fmt: skip
        if (magic, version, slot, maxspan, entry) != (
            F.MAGIC,
            F.VERSION,
            F.SLOT,
            F.MAXSPAN,
            F.TABLE_ENTRY,
        ):
            raise FormatError(f"{self.path}: not a memra-obs ring v{F.VERSION}")
        try:
            self.geo = F.Geometry(slots, entries)
        except ValueError as exc:
            raise FormatError(f"{self.path}: {exc}") from None
        if self.geo.data_off != data_off or self.geo.size != st.st_size or n > 63:
            raise FormatError(f"{self.path}: {st.st_size} bytes, header says {self.geo.size}")
        self.worker = label[:n].decode("utf-8", "replace")
        self.pos, self.rec, _, _ = F.READER.unpack(self._pread(F.READER.size, F.OFF_READER))
        if not self.rec <= self.pos <= F.MAXSPAN * self.rec or self.pos >= LIMIT:
            raise FormatError(f"{self.path}: cursor {self.pos}/{self.rec} breaks the rules")
        self.start_pos, self._rec0 = self.pos, self.rec
        #: Records read, and lost to overwrite, by this reader.
        self.read = self.overwritten = 0
        #: The writer's counters as last seen (the cursor is a bound they cannot be below).
        self._last = (self.pos, self.rec, 0, 0, 0)
        #: The last read broke a rule: once may be a write in flight, twice is a broken ring.
        self.trouble = False

    def _pread(self, n: int, off: int) -> bytes:
        b = os.pread(self._fd, n, off)
        if len(b) != n:
            raise FormatError(f"{self.path}: shrank under the reader")
        return b

    def _state(self) -> tuple[int, int, int, int, int]:
        """head, rec_next, refused, table_full, closed, read until two reads agree, checked."""
        a = self._pread(F.STATE.size, F.OFF_HEAD)
        for _ in range(16):
            b = self._pread(F.STATE.size, F.OFF_HEAD)
            if a == b:
                break
            a = b
        else:
            raise FormatError(f"{self.path}: the writer's counters never hold still")
        s = F.STATE.unpack(a)
        u, n = s[1] - self.rec, s[0] - self.pos
        if not (0 <= u <= n <= F.MAXSPAN * u and max(s) < LIMIT and s[4] <= 1
                and all(x >= y for x, y in zip(s, self._last, strict=True))):  # fmt: skip
            raise FormatError(
                f"{self.path}: writer counters {s} after {self._last}, cursor {self.pos}/{self.rec}"
            )
        self._last = s
        return s

    # -- what the agent asks --------------------------------------------------------------

    def head(self) -> tuple[int, int]:
        """(positions published, records published), checked."""
        s = self._state()
        return s[0], s[1]

    def writer_stats(self) -> tuple[int, int, bool]:
        """(records refused by the writer, sessions not in its table, closed cleanly)."""
        s = self._state()
        return s[2], s[3], bool(s[4])

    @property
    def lost(self) -> int:
        """Records that will never be read: overwritten first, or refused by the writer."""
        return self.overwritten + self._last[2]

    @property
    def written(self) -> int:
        """Records the writer handed its ring since this reader's cursor (refused ones too)."""
        return self._last[1] - self._rec0 + self._last[2]

    def writer_gone(self) -> bool:
        """True once the writer no longer holds its lock (exited, killed, closed). Sticky."""
        if not self.gone:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.gone = True
        return True

    def caught_up(self) -> bool:
        """Nothing published is left unread, as of the last look at ``head``."""
        return self.pos >= self._last[0]

    # -- reading -------------------------------------------------------------------------

    def _walk(self, start: int, stop: int, end: int) -> Iterator[tuple[int, int, int, int, bytes]]:
        """(position, span, record number, kind, payload) of each record that starts in
        [start, stop), from a copy of [start, end) taken now (``end`` is ``head``, or far
        enough past ``stop`` for any record); positions the writer may have rewritten
        meanwhile are passed over."""
        geo = self.geo
        a, n = start & geo.mask, end - start
        first = min(n, geo.slots - a)
        buf = self._pread(first * F.SLOT, geo.data_off + a * F.SLOT)
        if n > first:
            buf += self._pread((n - first) * F.SLOT, geo.data_off)
        head, _, _, _, closed = self._state()  # closed cleanly: no record was in flight
        x = max(start, head - geo.slots + (0 if closed else F.MAXSPAN))
        while x < stop:
            i = (x - start) << F.SLOT_SHIFT
            seq, meta = F.SLOT_HEAD.unpack_from(buf, i)
            kind, span, rec = meta >> 8 & 0xFF, meta & 0xFF, meta >> 16
            if seq != x + 1:
                raise FormatError(f"{self.path}: slot of position {x} holds position {seq - 1}")
            if kind == F.KIND_CONT:
                x += 1
                continue
            tails = [F.SLOT_HEAD.unpack_from(buf, i + k * F.SLOT) for k in range(1, span)]
            if (
                kind not in F.DECODERS
                or not 1 <= span <= F.MAXSPAN
                or x + span > end
                or tails != [(x + k + 1, rec << 16 | k) for k in range(1, span)]
            ):
                raise FormatError(f"{self.path}: record {rec} at {x} is malformed")
            yield (
                x,
                span,
                rec,
                kind,
                b"".join(
                    buf[i + k * F.SLOT + F.SLOT_HDR : i + (k + 1) * F.SLOT] for k in range(span)
                ),
            )
            x += span

    def poll(self, max_slots: int = 4096) -> list[Item]:
        """Records published since the cursor (at most ``max_slots`` slots' worth), in order;
        :meth:`commit` persists the cursor. Raises :class:`FormatError` on a broken ring."""
        out: list[Item] = []
        try:
            self._read(out, max_slots)
        except FormatError:
            if self.trouble and not out:
                raise
            self.trouble = True
            return out
        self.trouble = False
        return out

    def _read(self, out: list[Item], max_slots: int) -> None:
        if os.fstat(self._fd).st_size != self.geo.size:
            raise FormatError(f"{self.path}: resized under the reader")
        head, pos = self._state()[0], self.pos
        if head <= pos:
            return
        start = max(pos, head - self.geo.slots)
        stop = min(head, start + max_slots)
        for x, span, rec, kind, payload in self._walk(start, stop, min(head, stop + F.MAXSPAN)):
            n = rec - self.rec  # records lost in between: they fill [pos, x) exactly
            if not 0 <= n <= x - self.pos <= F.MAXSPAN * n:
                raise FormatError(
                    f"{self.path}: record {rec} at {x} after record {self.rec - 1} at {self.pos}"
                )
            try:
                item = Item(x, kind, F.decode(kind, payload))
            except Exception as exc:
                raise FormatError(f"{self.path}: record {rec} at {x}: {exc!r}") from None
            self.overwritten += n
            self.read += 1
            self.pos, self.rec = x + span, rec + 1
            out.append(item)
        if self.pos == pos:  # any 16 intact slots hold a record's start
            raise FormatError(f"{self.path}: no record in [{start}, {stop}) below head {head}")

    def commit(self) -> None:
        """Persist the cursor: a restarted agent resumes after what was published."""
        if self.writable:
            try:
                os.pwrite(
                    self._fd,
                    F.READER.pack(self.pos, self.rec, self.lost, os.getpid()),
                    F.OFF_READER,
                )
            except OSError:
                self.writable = False

    def open_sessions(self) -> dict[int, tuple[int, SessionRecord, bool]]:
        """The writer's table: session -> (position of its SessionRecord, record, in_table);
        entries that change while read are passed over."""
        size = self.geo.table_entries * F.TABLE_ENTRY
        a, b = (self._pread(size, self.geo.table_off) for _ in range(2))
        out: dict[int, tuple[int, SessionRecord, bool]] = {}
        for off in range(0, size, F.TABLE_ENTRY):
            entry = a[off : off + F.TABLE_ENTRY]
            seq, sid, n = F.TABLE_ENTRY_HEAD.unpack_from(entry)
            if seq and entry == b[off : off + F.TABLE_ENTRY]:
                try:
                    rec, in_table = F.decode(F.KIND_SESSION, entry[F.TABLE_HDR : F.TABLE_HDR + n])
                except Exception:
                    continue
                if rec.session == sid:
                    out[sid] = (seq - 1, rec, in_table)
        return out

    def sessions_before(self, pos: int) -> dict[int, tuple[int, SessionRecord, bool]]:
        """SessionRecords still in the ring below ``pos`` (read by a previous agent)."""
        out: dict[int, tuple[int, SessionRecord, bool]] = {}
        for a in range(max(0, self._last[0] - self.geo.slots), pos, 4096):
            stop = min(pos, a + 4096)
            for x, _, _, kind, payload in self._walk(a, stop, min(pos, stop + F.MAXSPAN)):
                if kind == F.KIND_SESSION:
                    rec, in_table = F.decode(kind, payload)
                    out[rec.session] = (x, rec, in_table)
        return out

    def close(self, unlink: bool = False) -> None:
        os.close(self._fd)
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:  # gone already, or not ours to remove
                pass


@dataclass(slots=True)
class _Open:
    gid: int
    sr_pos: int
    in_table: bool
    last_ns: int
    rounds: int = 0
    bursts: int = 0
    tokens: int = 0
    orphan: bool = False


def _first_ns(rec: Any) -> int:
    if type(rec) is RoundRecord:
        return rec.t_ns_mono[0]
    if type(rec) is BurstRecord:
        return rec.start_ns_mono
    if type(rec) is SessionEndRecord:
        return rec.end_ns_mono
    return max((a for _, a, _ in rec.intervals), default=0)


class RingStream(RingReader):
    """One ring as exporters need it: agent-wide session ids, and every record after its
    session's SessionRecord even across a lost one or an agent restart.

    An unknown session's context comes from the ring below the cursor (what a previous agent
    read) or the writer's table, replayed first; failing both, a stand-in (family
    ``unknown``, the ring's worker, no trace ids) goes first: metrics still count the
    rounds, spans skip them. Sessions whose end never comes are ended here: ``WorkerGone``
    when the writer died, ``RingOverrun`` when the end record was overwritten.
    """

    def __init__(self, path: str, ids: Iterator[int], uid: int | None = None) -> None:
        super().__init__(path, uid)
        self._ids = ids
        self._open: dict[int, _Open] = {}
        self._before: dict[int, tuple[int, SessionRecord, bool]] | None = None
        self._table: dict[int, tuple[int, SessionRecord, bool]] | None = None
        #: After a loss: (sessions in the table, head before reading it, head after).
        self._gc: tuple[set[int], int, int] | None = None
        self.orphaned = self.replayed = self.synthesized = 0
        #: What the agent's totals already hold of (read, lost, written).
        self.accounted = (0, 0, 0)

    def publish(self, out: list[Record], max_slots: int = 4096) -> None:
        """Append the next records (remapped, context first) to ``out``."""
        if self._before is None and self.pos > 0:
            self.head()
            self._before = self.sessions_before(self.pos)
        lost0, self._table = self.overwritten, None
        for pos, kind, rec in self.poll(max_slots):
            if kind == F.KIND_SESSION:
                self._start(rec[0], rec[1], pos, out)
                continue
            st = self._open.get(rec.session) or self._recover(rec, pos, out)
            self.orphaned += st.orphan
            t = type(rec)
            if t is RoundRecord:
                st.rounds += 1
                st.last_ns = rec.t_ns_mono[5]
            elif t is BurstRecord:
                st.bursts += 1
                st.tokens += rec.tokens
                st.last_ns = max(st.last_ns, rec.end_ns_mono)
            elif t is SessionEndRecord:
                del self._open[rec.session]
            out.append(rec._replace(session=st.gid))
        if self.pos - self.start_pos > self.geo.slots:
            self._before = {}  # every record of those sessions past the cursor is read by now
        self._end_lost(out, self.overwritten > lost0)

    def _start(self, srec: SessionRecord, in_table: bool, pos: int, out: list[Record]) -> _Open:
        if len(self._open) >= MAX_OPEN:  # ends lost without a trace: do not grow forever
            self._end(next(iter(self._open)), RING_OVERRUN, out)
        st = self._open[srec.session] = _Open(next(self._ids), pos, in_table, srec.start_ns_mono)
        out.append(srec._replace(session=st.gid, worker=srec.worker or self.worker))
        return st

    def _recover(self, rec: Any, pos: int, out: list[Record]) -> _Open:
        found = (self._before or {}).get(rec.session)
        if found is None:
            self._table = self.open_sessions() if self._table is None else self._table
            found = self._table.get(rec.session)
        if found is not None:
            self.replayed += 1
            return self._start(found[1], found[2], found[0], out)
        # Same host, same CLOCK_MONOTONIC: the agent's own anchor pair maps the stamps.
        stand_in = SessionRecord(rec.session, UNKNOWN_FAMILY, "", "", self.worker, _first_ns(rec),
                                 time.perf_counter_ns(), time.time_ns(), 0, 0, 0, 0, False)  # fmt: skip
        self.synthesized += 1
        st = self._start(stand_in, False, pos, out)
        st.orphan = True
        return st

    def _end_lost(self, out: list[Record], lost: bool) -> None:
        """After a loss: a session that has left the writer's table has ended; once the cursor
        is past the head read after that look, its end record was lost too."""
        if self._gc is None and lost:
            before = self.head()[0]
            table = set(self.open_sessions())
            self._gc = (table, before, self.head()[0])
        if self._gc is not None and self.pos >= self._gc[2]:
            table, before, _ = self._gc
            self._gc = None
            for sid, st in list(self._open.items()):
                if st.in_table and st.sr_pos < before and sid not in table:
                    self._end(sid, RING_OVERRUN, out)

    def _end(self, sid: int, error: str, out: list[Record]) -> None:
        st = self._open.pop(sid)
        self.synthesized += 1
        out.append(SessionEndRecord(st.gid, st.last_ns, st.rounds, st.bursts, st.tokens, error))

    def close_open(self, out: list[Record]) -> None:
        """The writer is gone and everything is read: end its sessions still open."""
        for sid in list(self._open):
            self._end(sid, WORKER_GONE, out)

    def stats(self) -> dict[str, Any]:
        return {"worker": self.worker, "path": self.path, "read": self.read, "lost": self.lost,
                "written": self.written, "orphaned": self.orphaned, "replayed": self.replayed,
                "synthesized": self.synthesized, "open_sessions": len(self._open), "gone": self.gone}  # fmt: skip
