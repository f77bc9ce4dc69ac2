"""The agent's side of one ring: :class:`RingReader` checks the file and reads its records,
counting exactly what was lost; :class:`RingStream` turns them into the exporters' stream.

Through the descriptor, never a mapping: a mapped file that shrinks kills the reader with
SIGBUS, a short ``pread`` only drops the ring. No lock (one writer, x86-64 store order): the
writer stores ``head`` after a record's slots, so of slots copied below a head, a second read
``h`` of it keeps those at or above the floor ``h + MAXSPAN - N``. The directory may be
world-writable: a ring is believed only while it keeps the writer's rules (README, "What the
agent believes"); breaking one twice in a row (once may be a store in flight) is a FormatError."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..timeline import (
    BurstRecord,
    FirstTokenRecord,
    PriorRecord,
    Record,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)
from . import format as F

if TYPE_CHECKING:
    from ..records import SpecFirstTokenProf

__all__ = ["FormatError", "Item", "RingReader", "RingStream", "State"]

#: Every counter stays below this (9 years of a million slots a second): more is a lie.
LIMIT = 1 << 48
THIS_VERSION = (F.MAGIC, F.VERSION, F.SLOT, F.MAXSPAN, F.TABLE_ENTRY)
#: Sessions kept open per ring before the oldest is ended as lost.
MAX_OPEN = 65536
Sessions = dict[int, tuple[SessionRecord, bool, int]]  # session -> (record, in_table, position)


class Item(NamedTuple):
    """A record read: first slot's position, kind, record (``(SessionRecord, in_table)``)."""

    pos: int
    kind: int
    rec: Any


class State(NamedTuple):
    """The writer's counters (its line and stats in the header)."""

    head: int
    rec_next: int
    refused: int
    table_full: int
    closed: int
    dropped_rounds: int


class FormatError(ValueError):
    """Not a ring, or one that broke a rule."""


class RingReader:
    """One ring file, checked at attach and at every read; ``uid``: its owner (default ours)."""

    def __init__(self, path: str, uid: int | None = None) -> None:
        self.path, self.writable, self.gone, self.trouble = path, True, False, False
        uid = os.geteuid() if uid is None else uid
        flags = os.O_NOFOLLOW | os.O_NONBLOCK  # a link or a FIFO is refused, never waited on
        try:
            self._fd = os.open(path, os.O_RDWR | flags)
        except PermissionError:  # not ours to write: the cursor then lives here only
            owner = os.lstat(path).st_uid
            if owner != uid:  # nor to read: "Permission denied", again at every scan
                raise FormatError(f"{path}: owned by uid {owner}, not by this agent's uid {uid}"
                                  " (run the workers and the agent as one uid)") from None  # fmt: skip
            self._fd, self.writable = os.open(path, os.O_RDONLY | flags), False
        try:
            self._attach(os.fstat(self._fd), uid)
        except BaseException:
            os.close(self._fd)
            raise

    def _attach(self, st: os.stat_result, uid: int) -> None:
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise FormatError(f"{self.path}: not a plain file with one name")
        if st.st_uid != uid or st.st_mode & 0o022:
            raise FormatError(f"{self.path}: owned by uid {st.st_uid}, mode {st.st_mode & 0o777:o}"
                              f", not by this agent's uid {uid} alone")  # fmt: skip
        magic, version, slot, slots, maxspan, entries, entry, data_off, _, _, n, label = (
            F.IDENT.unpack(self._pread(F.IDENT.size, 0)))  # fmt: skip
        if magic == F.MAGIC and version != F.VERSION:  # a rolling deploy: left for its agent
            raise FormatError(f"{self.path}: ring format v{version}, this agent reads "
                              f"v{F.VERSION}: run workers and agent of one memra-obs release")  # fmt: skip
        if (magic, version, slot, maxspan, entry) != THIS_VERSION:
            raise FormatError(f"{self.path}: not a memra-obs ring v{F.VERSION}")
        try:
            self.geo = F.Geometry(slots, entries)
        except ValueError as exc:
            raise FormatError(f"{self.path}: {exc}") from None
        if self.geo.data_off != data_off or self.geo.size != st.st_size or n > 63:
            raise FormatError(f"{self.path}: {st.st_size} bytes, its header says {self.geo.size}")
        self.worker = label[:n].decode("utf-8", "replace")
        self.pos, self.rec, _, _ = F.READER.unpack(self._pread(F.READER.size, F.OFF_READER))
        if not self.rec <= self.pos <= F.MAXSPAN * self.rec or self.pos >= LIMIT:
            raise FormatError(f"{self.path}: cursor {self.pos}/{self.rec} breaks the rules")
        #: Records read, and lost to overwrite, by this reader, from its first cursor.
        self.read, self.overwritten, self._rec0 = 0, 0, self.rec
        #: Sessions open below the cursor: what a previous agent published of each.
        self.prior: dict[int, _Prior] = {}
        self.last = State(self.pos, self.rec, 0, 0, 0, 0)  # as last read (the cursor bounds it)

    def _pread(self, n: int, off: int) -> bytes:
        b = os.pread(self._fd, n, off)
        if len(b) != n:
            raise FormatError(f"{self.path}: shrank under the reader")
        return b

    def state(self) -> State:
        """The writer's counters, read until two reads agree, checked against the rules."""
        b = self._pread(F.STATE.size, F.OFF_HEAD)
        for _ in range(16):
            a, b = b, self._pread(F.STATE.size, F.OFF_HEAD)
            if a == b:
                break
        else:
            raise FormatError(f"{self.path}: the writer's counters never hold still")
        s = State(*F.STATE.unpack(a))
        u, n = s.rec_next - self.rec, s.head - self.pos
        if not (0 <= u <= n <= F.MAXSPAN * u and max(s) < LIMIT and s.closed <= 1
                and all(x >= y for x, y in zip(s, self.last, strict=True))):  # fmt: skip
            raise FormatError(f"{self.path}: counters {s} after {self.last} (cursor {self.pos})")
        self.last = s
        return s

    @property
    def lost(self) -> int:
        """Records that will never be read: overwritten first, or refused by the writer."""
        return self.overwritten + self.last.refused

    @property
    def written(self) -> int:
        """Records the writer handed its ring since this reader's cursor (refused ones too)."""
        return self.last.rec_next - self._rec0 + self.last.refused

    def writer_gone(self) -> bool:
        """True once the writer no longer holds its lock (exited, killed, closed). Sticky."""
        if not self.gone:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.gone = True
        return self.gone

    def caught_up(self) -> bool:
        return self.pos >= self.last.head

    def _walk(self, start: int, stop: int, top: int) -> Iterator[tuple[int, int, int, int, bytes]]:
        """(position, span, record number, kind, payload) of each record starting in [start,
        stop), from a copy taken now of what lies below ``top``, up to one record past stop."""
        geo, x = self.geo, start & self.geo.mask
        end = min(top, stop + F.MAXSPAN)
        first = min(end - start, geo.slots - x)
        buf = self._pread(first * F.SLOT, geo.data_off + x * F.SLOT)
        if end - start > first:
            buf += self._pread((end - start - first) * F.SLOT, geo.data_off)
        s = self.state()  # closed cleanly: no record was in flight
        x = max(start, s.head - geo.slots + (0 if s.closed else F.MAXSPAN))
        self._intact = stop - x  # slots of the copy the writer cannot have overwritten
        while x < stop:
            i = (x - start) * F.SLOT
            seq, meta = F.SLOT_HEAD.unpack_from(buf, i)
            kind, span, rec = meta >> 8 & 0xFF, meta & 0xFF, meta >> 16
            if seq != x + 1:
                raise FormatError(f"{self.path}: the slot of position {x} holds {seq - 1}")
            if kind == F.KIND_CONT:
                x += 1
                continue
            # The continuation slots are read only once the span is known to fit the buffer.
            fits = kind <= F.KIND_SESSION_END and 1 <= span <= F.MAXSPAN and x + span <= end
            if not fits or [(x + k + 1, rec << 16 | k) for k in range(1, span)] != [
                F.SLOT_HEAD.unpack_from(buf, i + k * F.SLOT) for k in range(1, span)
            ]:
                raise FormatError(f"{self.path}: record {rec} at {x} is malformed")
            yield x, span, rec, kind, b"".join(
                buf[i + k * F.SLOT + F.SLOT_HDR : i + (k + 1) * F.SLOT] for k in range(span)
            )  # fmt: skip
            x += span

    def poll(self, max_slots: int = 4096) -> list[Item]:
        """Records published since the cursor (``max_slots`` slots' worth at most), in order;
        :meth:`commit` persists the cursor."""
        out: list[Item] = []
        try:
            if os.fstat(self._fd).st_size != self.geo.size:
                raise FormatError(f"{self.path}: resized under the reader")
            head, pos = self.state().head, self.pos
            start = max(pos, head - self.geo.slots)
            stop = min(head, start + max_slots)
            for x, span, rec, kind, payload in self._walk(start, stop, head):
                n = rec - self.rec  # records lost in between: they fill [pos, x) exactly
                if not 0 <= n <= x - self.pos <= F.MAXSPAN * n:
                    raise FormatError(f"{self.path}: record {rec} at {x} after {self.rec - 1}")
                try:
                    out.append(Item(x, kind, F.decode(kind, payload)))
                except Exception as exc:
                    raise FormatError(f"{self.path}: record {rec} at {x}: {exc!r}") from None
                self.overwritten, self.read = self.overwritten + n, self.read + 1
                self.pos, self.rec = x + span, rec + 1
            # any MAXSPAN intact slots hold a record's start (a copy the writer lapped meanwhile
            # holds none: read again from the new head next pass, the gap counted as lost)
            if self.pos == pos < head and self._intact >= F.MAXSPAN:
                raise FormatError(f"{self.path}: no record in [{start}, {stop}) below {head}")
            self.trouble = False
        except FormatError:
            if self.trouble and not out:
                raise
            self.trouble = True
        return out

    def cursor(self) -> tuple[int, int, int]:
        """Where reading stands now, for :meth:`commit` once what was read is delivered."""
        return self.pos, self.rec, self.lost

    def commit(self, cursor: tuple[int, int, int]) -> None:
        """Persist ``cursor``: a restarted agent resumes after what was delivered."""
        if self.writable:
            with contextlib.suppress(OSError):  # a read-only file system: it lives here only
                os.pwrite(self._fd, F.READER.pack(*cursor, os.getpid()), F.OFF_READER)

    def clear_table(self) -> None:
        """Empty a dead writer's table, its open sessions ended here: a ring kept (``--keep``)
        has each later agent end them again otherwise."""
        if self.writable and self.gone:
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, bytes(self.geo.table_entries * F.TABLE_ENTRY), F.HEADER)

    def open_sessions(self) -> Sessions:
        """The writer's table of open sessions (entries that change while read, or do not
        decode, are passed over)."""
        size, e, out = self.geo.table_entries * F.TABLE_ENTRY, F.TABLE_ENTRY, Sessions()
        a, b = (self._pread(size, F.HEADER) for _ in range(2))
        for off in range(0, size, e):
            seq, sid, n = F.TABLE_ENTRY_HEAD.unpack_from(a, off)
            if not seq or a[off : off + e] != b[off : off + e]:
                continue
            body = a[off + F.TABLE_HDR : off + min(e, F.TABLE_HDR + n)]
            with contextlib.suppress(Exception):  # a damaged entry is passed over too
                rec, in_table = F.decode(F.KIND_SESSION, body)
                if rec.session == sid:
                    out[sid] = (rec, in_table, seq - 1)
        return out

    def sessions_before(self, pos: int) -> Sessions:
        """SessionRecords still in the ring below ``pos`` (a previous agent read them), and in
        ``prior`` what it published of each session still open there."""
        out: Sessions = {}
        self.prior = {}
        for a in range(max(0, self.state().head - self.geo.slots), pos, 4096):
            for x, _, _, kind, payload in self._walk(a, min(pos, a + 4096), pos):
                if kind == F.KIND_SESSION:
                    rec, in_table = F.decode(kind, payload)
                    out[rec.session] = (rec, in_table, x)
                    self.prior[rec.session] = _Prior()
                    continue
                with contextlib.suppress(Exception):  # a record that does not decode: not counted
                    r = F.decode(kind, payload)
                    if type(r) is SessionEndRecord:
                        self.prior.pop(r.session, None)
                    elif r.session in self.prior:
                        self.prior[r.session].add(r)
        return out

    def close(self, unlink: bool = False) -> None:
        os.close(self._fd)
        self.writable = False  # a commit still pending must not reach a reused descriptor
        if unlink:
            with contextlib.suppress(OSError):  # gone already, or not ours to remove
                os.unlink(self.path)


@dataclass(slots=True)
class _Prior:
    """What a previous agent published of a session: the per-request record's inputs."""

    ks: list[int] = field(default_factory=list)
    js: list[int] = field(default_factory=list)
    ph: list[int] = field(default_factory=lambda: [0] * 5)
    k: int = 0
    first_token: SpecFirstTokenProf | None = None

    def add(self, rec: Record) -> None:
        if isinstance(rec, RoundRecord):
            if rec.k > 0:
                self.ks.append(rec.k)
                self.js.append(rec.j)
            self.ph = [a + b for a, b in zip(self.ph, rec.phase_ns(), strict=True)]
        elif isinstance(rec, BurstRecord):
            self.k = max(self.k, rec.k)
        elif isinstance(rec, FirstTokenRecord):
            self.first_token = rec.prof

    def record(self, gid: int) -> PriorRecord:
        ph = self.ph
        return PriorRecord(gid, tuple(self.ks), tuple(self.js), (ph[0], ph[1], ph[2], ph[3], ph[4]),
                           self.k, self.first_token)  # fmt: skip


@dataclass(slots=True)
class _Open:
    gid: int
    sr_pos: int
    in_table: bool
    last_ns: int
    rounds: int = 0
    bursts: int = 0
    tokens: int = 0


class RingStream(RingReader):
    """One ring as exporters need it: agent-wide session ids, each record after its session's
    SessionRecord. An unknown session's comes from the ring below the cursor (a previous agent
    read it) or the writer's table, replayed; failing both, a stand-in (family ``unknown``, no
    trace ids) goes first: metrics count its rounds, spans skip them. Sessions whose end never
    comes are ended here: ``WorkerGone`` (the writer died), ``RingOverrun`` (overwritten)."""

    def __init__(self, path: str, ids: Iterator[int]) -> None:
        super().__init__(path)
        self._ids = ids
        self._open: dict[int, _Open] = {}
        try:
            self._before = self.sessions_before(self.pos) if self.pos else Sessions()
            #: Sessions open in the writer's table whose SessionRecord a previous agent read:
            #: if the writer dies before another of their records comes, they are ended here.
            self._carried = {s: found for s, found in self.open_sessions().items()
                             if found[2] < self.pos} if self.pos else {}  # fmt: skip
        except BaseException:  # a ring refused at attach keeps no descriptor
            self.close()
            raise
        self._table: Sessions | None = None  # the writer's, read once per publish at most
        #: After a loss: (sessions in the table, head before reading it, head after).
        self._gc: tuple[set[int], int, int] | None = None
        self.replayed = self.synthesized = 0
        #: What the agent's totals hold of this ring's (read, lost, written, dropped rounds).
        self.accounted = (0, 0, 0, 0)
        self.workers = {self.worker}  #: worker labels of its series (the records' own)

    def publish(self, out: list[Record], max_slots: int) -> bool:
        """Append the next records (remapped, context first) to ``out``; True once the writer
        is gone and all is read (its sessions still open are then ended, ``WorkerGone``)."""
        lost0, self._table = self.overwritten, None
        for pos, kind, rec in self.poll(max_slots):
            if kind == F.KIND_SESSION:
                self._start(rec[0], rec[1], pos, out)
                continue
            st = self._open.get(rec.session) or self._recover(rec, pos, out)
            if type(rec) is RoundRecord:
                st.rounds, st.last_ns = st.rounds + 1, rec.t_ns_mono[5]
            elif type(rec) is BurstRecord:
                st.bursts, st.tokens = st.bursts + 1, st.tokens + rec.tokens
                st.last_ns = max(st.last_ns, rec.end_ns_mono)
            elif type(rec) is SessionEndRecord:
                del self._open[rec.session]
            out.append(rec._replace(session=st.gid))
        if self._gc is None and self.overwritten > lost0:
            before, table = self.state().head, set(self.open_sessions())
            self._gc = (table, before, self.state().head)
        if self._gc is not None and self.pos >= self._gc[2]:
            (table, before, _), self._gc = self._gc, None
            for sid in [s for s, st in self._open.items() if st.in_table and st.sr_pos < before]:
                if sid not in table:  # it ended, and its end record lies below the cursor
                    self._end(sid, "RingOverrun", out)
            for sid in [s for s in self._carried if s not in table]:  # the same, none read
                self._replay(self._carried[sid], out)
                self._end(sid, "RingOverrun", out)
        if not (self.gone and self.caught_up() and not self.trouble):
            return False
        carried, self._carried = self._carried, {}
        if carried:  # still open when the writer died: context first, then the end
            held: Sessions | None = None
            with contextlib.suppress(FormatError):
                held = self.open_sessions()
            for sid, found in carried.items():
                self._replay(found, out)
                if held is not None and sid not in held:  # it ended: its end overwritten
                    self._end(sid, "RingOverrun", out)
        for sid in list(self._open):
            self._end(sid, "WorkerGone", out)
        return True

    def _start(self, srec: SessionRecord, in_table: bool, pos: int, out: list[Record]) -> _Open:
        if len(self._open) >= MAX_OPEN:  # ends lost without a trace: do not grow forever
            self._end(next(iter(self._open)), "RingOverrun", out)
        self._carried.pop(srec.session, None)
        st = self._open[srec.session] = _Open(next(self._ids), pos, in_table, srec.start_ns_mono)
        out.append(srec._replace(session=st.gid, worker=srec.worker or self.worker))
        self.workers.add(srec.worker or self.worker)
        return st

    def _replay(self, found: tuple[SessionRecord, bool, int], out: list[Record]) -> _Open:
        """A session's context again; then what a previous agent published of it, for its
        per-request record (which otherwise counted only the rounds from here on)."""
        self.replayed += 1
        st = self._start(*found, out)
        prior = self.prior.pop(found[0].session, None)
        if prior is not None:
            out.append(prior.record(st.gid))
        return st

    def _recover(self, rec: Any, pos: int, out: list[Record]) -> _Open:
        if self._table is None and rec.session not in self._before:
            self._table = {}  # unreadable (the ring shrank): a stand-in, and the batch stays whole
            with contextlib.suppress(FormatError):
                self._table = self.open_sessions()
        found = self._before.get(rec.session) or (self._table or {}).get(rec.session)
        if found is not None:
            return self._replay(found, out)
        # Same host, same CLOCK_MONOTONIC: the agent's own anchor pair maps the stamps.
        t0 = rec.t_ns_mono[0] if type(rec) is RoundRecord else getattr(rec, "start_ns_mono", 0)
        stand_in = SessionRecord(rec.session, "unknown", "", "", self.worker, t0,
                                 time.perf_counter_ns(), time.time_ns(), 0, 0, 0, 0, False)  # fmt: skip
        self.synthesized += 1
        return self._start(stand_in, False, pos, out)

    def _end(self, sid: int, error: str, out: list[Record]) -> None:
        st = self._open.pop(sid)
        self.synthesized += 1
        out.append(SessionEndRecord(st.gid, st.last_ns, st.rounds, st.bursts, st.tokens, error))

    def stats(self) -> dict[str, Any]:
        return {"worker": self.worker, "path": self.path, "read": self.read, "lost": self.lost,
                "replayed": self.replayed, "synthesized": self.synthesized,
                "open_sessions": len(self._open), "gone": self.gone}  # fmt: skip
