"""One worker's records as the agent publishes them: host-unique session ids, and a context
for every record even across a lost SessionRecord or an agent restart.

Exporters need each session's SessionRecord before its rounds, and a session id unique
across everything they see. Local ids (per worker process) are remapped to agent-wide ids.
When a record's session is unknown — its SessionRecord was read by a previous agent, or
overwritten — its context is rebuilt from the ring (the SessionRecords still below the
cursor, read once at attach) or from the writer's table of open sessions, and the
SessionRecord is replayed to the exporters first. When neither has it, a stand-in
SessionRecord (family ``unknown``, the ring's worker, no trace ids) goes first: metrics
still count the rounds, spans skip them; such records are counted as ``orphaned``.

Sessions that never end in the stream are closed with a synthesized SessionEndRecord
(``error`` = ``WorkerGone`` when the writer died, ``RingOverrun`` when the end record was
overwritten), so span trees close and exporter state does not leak.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from ..timeline import BurstRecord, Record, RoundRecord, SessionEndRecord, SessionRecord
from . import format as F
from .reader import RingReader

__all__ = ["RingStream"]

WORKER_GONE = "WorkerGone"
RING_OVERRUN = "RingOverrun"
#: ``family`` of a stand-in session (as the PrometheusExporter names orphaned rounds).
UNKNOWN_FAMILY = "unknown"
#: Sessions kept open per ring before the oldest is closed as lost.
MAX_OPEN = 65536


class _Open:
    __slots__ = ("bursts", "gid", "in_table", "last_ns", "orphan", "rounds", "sr_pos", "tokens")

    def __init__(self, gid: int, sr_pos: int, in_table: bool, last_ns: int) -> None:
        self.gid = gid
        self.sr_pos = sr_pos
        self.in_table = in_table
        self.last_ns = last_ns
        self.rounds = 0
        self.bursts = 0
        self.tokens = 0
        self.orphan = False


def _first_ns(rec: Any) -> int:
    if isinstance(rec, RoundRecord):
        return rec.t_ns_mono[0]
    if isinstance(rec, BurstRecord):
        return rec.start_ns_mono
    if isinstance(rec, SessionEndRecord):
        return rec.end_ns_mono
    return max((a for _, a, _ in rec.intervals), default=0)


class RingStream:
    """Reads one ring and turns its records into the exporters' stream."""

    def __init__(self, reader: RingReader, ids: Iterator[int] | None = None) -> None:
        self.reader = reader
        self.worker = reader.worker
        self._ids = ids if ids is not None else itertools.count(1)
        self._open: dict[int, _Open] = {}
        #: Context for sessions a previous agent started: SessionRecords below the cursor.
        self._before: dict[int, tuple[int, SessionRecord, bool]] | None = None
        if reader.pos > 0:
            self._before = reader.sessions_before(reader.pos)
        self._table: dict[int, tuple[int, SessionRecord, bool]] | None = None
        #: A check for end records lost to overwrite: (table snapshot, head before, head after).
        self._gc: tuple[set[int], int, int] | None = None
        self._gc_due = False
        self.published = 0
        self.orphaned = 0
        self.replayed = 0
        self.synthesized = 0
        #: Records the writer could not encode (from the ring header, as of the last poll).
        self.refused = 0

    @property
    def lost(self) -> int:
        """Records that will never reach the exporters: refused by the writer or lost in the
        ring. Plain ints only: a scrape thread reads this."""
        return self.refused + self.reader.lost

    @property
    def open_sessions(self) -> int:
        return len(self._open)

    def poll(self, out: list[Record], max_slots: int = 4096) -> int:
        """Append the next records (remapped) to ``out``; returns how many were appended."""
        reader = self.reader
        n0 = len(out)
        lost0 = reader.lost
        items = reader.poll(max_slots)
        self.refused = reader.writer_stats()[0]
        self._table = None
        for pos, kind, rec in items:
            if kind == F.KIND_SESSION:
                srec, in_table = rec
                self._start(srec, pos, in_table, out)
                continue
            sid = rec.session
            st = self._open.get(sid)
            if st is None:
                st = self._recover(sid, rec, pos, out)
            if st.orphan:
                self.orphaned += 1
            t = type(rec)
            if t is RoundRecord:
                st.rounds += 1
                st.last_ns = rec.t_ns_mono[5]
            elif t is BurstRecord:
                st.bursts += 1
                st.tokens += rec.tokens
                st.last_ns = max(st.last_ns, rec.end_ns_mono)
            elif t is SessionEndRecord:
                del self._open[sid]
            out.append(rec._replace(session=st.gid))
        if reader.lost > lost0:
            self._gc_due = True
        self._collect_lost_ends(out)
        if self._before is not None and reader.pos - reader.start_pos > reader.geo.slots:
            self._before = None  # every record of those sessions past the cursor is read by now
        n = len(out) - n0
        self.published += n
        return n

    def _start(self, srec: SessionRecord, pos: int, in_table: bool, out: list[Record]) -> None:
        if len(self._open) >= MAX_OPEN:  # ends lost without a trace: do not grow forever
            old = next(iter(self._open))
            self._end(old, self._open[old], RING_OVERRUN, out)
        gid = next(self._ids)
        self._open[srec.session] = _Open(gid, pos, in_table, srec.start_ns_mono)
        out.append(srec._replace(session=gid, worker=srec.worker or self.worker))

    def _recover(self, sid: int, rec: Any, pos: int, out: list[Record]) -> _Open:
        found = self._before.get(sid) if self._before is not None else None
        if found is None:
            if self._table is None:
                self._table = self.reader.open_sessions()
            found = self._table.get(sid)
        if found is not None:
            sr_pos, srec, in_table = found
            self.replayed += 1
            self._start(srec, sr_pos, in_table, out)
            return self._open[sid]
        t0 = _first_ns(rec)
        # Same host, same CLOCK_MONOTONIC: the agent's own anchor pair maps the stamps.
        stand_in = SessionRecord(
            sid, UNKNOWN_FAMILY, "", "", self.worker, t0, time.perf_counter_ns(), time.time_ns(),
            0, 0, 0, 0, False,
        )  # fmt: skip
        self.synthesized += 1
        self._start(stand_in, pos, False, out)
        st = self._open[sid]
        st.orphan = True
        return st

    def _collect_lost_ends(self, out: list[Record]) -> None:
        """After a loss: a session that has left the writer's table ended; once the reader
        has passed the head read after that snapshot, its end record was lost."""
        reader = self.reader
        if self._gc is None and self._gc_due:
            self._gc_due = False
            before = reader.head()[0]
            table = set(reader.open_sessions())
            self._gc = (table, before, reader.head()[0])
        if self._gc is None or reader.pos < self._gc[2]:
            return
        table, before, _ = self._gc
        self._gc = None
        for sid, st in list(self._open.items()):
            if st.in_table and st.sr_pos < before and sid not in table:
                self._end(sid, st, RING_OVERRUN, out)

    def _end(self, sid: int, st: _Open, error: str, out: list[Record]) -> None:
        del self._open[sid]
        self.synthesized += 1
        out.append(SessionEndRecord(st.gid, st.last_ns, st.rounds, st.bursts, st.tokens, error))

    def close_open(self, out: list[Record]) -> int:
        """The writer is gone and everything is read: end its sessions still open."""
        n = 0
        for sid, st in list(self._open.items()):
            self._end(sid, st, WORKER_GONE, out)
            n += 1
        self.published += n
        return n

    def stats(self) -> dict[str, Any]:
        r = self.reader
        refused, table_full, closed = r.writer_stats()
        return {
            "worker": self.worker,
            "path": r.path,
            "published": self.published,
            "overwritten": r.overwritten,
            "corrupt": r.corrupt,
            "orphaned": self.orphaned,
            "refused": refused,
            "table_full": table_full,
            "replayed": self.replayed,
            "synthesized": self.synthesized,
            "open_sessions": len(self._open),
            "gone": r.gone,
            "closed": closed,
        }
