"""Legacy lines back into the observer's records: what the lines say, laid out in time.

The lines carry no session ids and no timestamps, so the :class:`Rebuilder` derives only what
they support (the README's tail section has the full table):

* **Bursts** come from phase lines (``[tag] rounds=n k=k ...``): n rounds whose phase times
  are the burst's per-round *means*, known to the tighter of the line's two printed
  precisions (totals at 0.01 ms, per-round at 0.001 ms). The level-2 line that follows its
  phase line gives each of those rounds the burst's mean verify split.
* **Rounds** with a ``[spec-prof-rounds]`` row (the first 64 of a session) are exact: wall,
  draft, verify, accept, k, j, ctx, seq_rows; only ``rest_ms`` (rollback + maint) is split in
  the burst's rollback:maint ratio. Round 0 of a profiled session is exact to the ns from
  the ``[spec-prof]`` line (f64 buckets). Rounds without a row carry ``k = j = -1``: unknown
  (the lines say nothing of their drafts; acceptance is never invented), and
  ``ctx = seq_rows = 0``; exporters leave them out of every token count.
* **Sessions** start at a ``[spec-prof]`` line (the session's first burst is the phase line
  just before it) and end at a ``[spec-prof-summary]`` of fewer than 64 rounds, at the next
  session's start, after ``session_gap_ns`` without a line, or (without the profile, when
  nothing marks requests) after ``max_bursts`` bursts.
* **Time**: a burst ends when its phase line arrived (or, when lines arrive faster than the
  bursts could have run — a backlog, a replayed file — right after the previous burst), and
  everything else is laid out backwards from there: rounds back to back from the burst's
  start, the first-token buckets back to back before the first burst.

Records come out in the contract's order (session, its rounds, burst, first-token, ...,
session end) through :meth:`Rebuilder.take`. Nothing here reads the clock: every method
takes the line's arrival stamp (``time.perf_counter_ns``, the package's monotonic clock).

``compact=True`` (what the tail picks when every exporter it feeds takes
:class:`~memra_obs.prom.RoundBlock` items, i.e. only the Prometheus exporter) hands each
burst's rounds over as one ``RoundBlock`` instead of one ``RoundRecord`` per round, and no
``BurstRecord`` (which that exporter does not use): the same metrics, for much less work.

Rows travel inside the rebuilder already in integer ns, each ``round(f32_ms * 1e6)``: one
row as ``(row, wall, draft, verify, accept, rest, (k, j, ctx, seq_rows))`` (:meth:`row`),
runs of rows as :data:`RowColumns` (:meth:`rows`), and a burst keeps its rows as columns;
phase and level-2 lines keep their values as scanned (str from the tail's Python fast path,
float from its C scanner and from ``scan_line``) and are converted only where a value is used.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from itertools import repeat
from operator import itemgetter, mul, sub
from typing import Any

from ..events import (
    BurstRecord,
    FirstTokenRecord,
    Record,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)
from ..legacy import OVERRIDE, PHASE, PROF, PROF_ROUNDS, PROF_SUMMARY, VERIFY
from ..prom.exporter import RoundBlock
from ..records import SPEC_PROF_ROUNDS, SpecFirstTokenProf, SpecPhaseNs

__all__ = [
    "MAX_BURST_ROUNDS",
    "UNKNOWN_FAMILY",
    "Rebuilder",
    "RecordBatch",
    "RowColumns",
    "family_of",
]

#: Rows as columns: row indices; wall, draft, verify, accept, rest ns; (k, j, ctx, seq_rows).
RowColumns = tuple[
    list[int], list[int], list[int], list[int], list[int], list[int],
    list[tuple[int, int, int, int]],
]  # fmt: skip

#: ``family`` (and empty tag) of sessions whose lines never named one (profile-only streams).
UNKNOWN_FAMILY = "unknown"

#: Session-creation buckets of the first-token profile, in the loop's order (they precede
#: the first burst); ``draft_prime`` and the ``first_*`` buckets sit inside round 0.
_CREATION = ("cache_alloc", "sink_alloc", "prime", "capture", "anchor", "draft_alloc")
_ROUND0 = ("first_draft", "first_verify", "first_accept", "first_roll", "first_maint")
_ROUND0_MS = ("draft_prime_ms", *(f + "_ms" for f in _ROUND0))
#: A burst (with its session's creation) longer than this (~13 days) is a garbled line.
_MAX_NS = 1 << 50
#: Rounds one burst may claim; a line claiming more is refused rather than expanded into
#: that many records (a real burst returns to its caller every few rounds).
MAX_BURST_ROUNDS = 1 << 16

_tuple_new = tuple.__new__  # a NamedTuple without its Python-level __new__ (same object)
_new = object.__new__
_j_of = itemgetter(1)

#: Session ids are unique per process, whichever rebuilder made them (exporters key on them).
_session_ids = itertools.count(1)


class RecordBatch(list):  # type: ignore[type-arg]
    """What :meth:`Rebuilder.take` returns: the records, in order, and ``records``: how many
    records they stand for (a :class:`RoundBlock` stands for its rounds)."""

    __slots__ = ("records",)


def family_of(tag: str) -> str:
    """``glm5-phase`` -> ``glm5``: the family a caller's tag names (the observer's default
    tag is ``{family}-phase``); any other tag is its own family."""
    if tag.endswith("-phase") and len(tag) > 6:
        return tag[:-6]
    return tag or UNKNOWN_FAMILY


class _Burst:
    """A burst being assembled: its phase line, then its level-2 line, its first-token
    profile (a session's first burst) and its rows, until the next burst or a timeout."""

    __slots__ = (
        "arrival",
        "k",
        "last",
        "left",
        "nxt",
        "phase",
        "prof",
        "rounds",
        "rows",
        "tag",
        "tag_v",
        "verify",
    )

    def __init__(
        self, tag: str, rounds: int | None, k: int, phase: tuple[Any, ...] | None, t: int
    ) -> None:
        self.tag = tag
        #: None: as many rounds as rows arrive (a burst seen only through its rows).
        self.rounds = rounds
        self.k = k
        self.phase = phase
        self.verify: tuple[Any, ...] | None = None
        self.tag_v = ""
        self.prof: SpecFirstTokenProf | None = None
        #: None until a row is in, then the rows as columns: wall, draft, verify, accept,
        #: rest (ns), (k, j, ctx, seq_rows).
        self.rows: list[list[Any]] | None = None
        self.arrival = t
        self.last = t
        #: Once a row is in: the index the next row must have, and how many more fit.
        self.nxt = 0
        self.left = 0


class _Session:
    __slots__ = (
        "bursts",
        "id",
        "last_end",
        "last_line",
        "prof",
        "rec",
        "rounds",
        "summarized",
        "tag",
        "tokens",
    )

    def __init__(self, sid: int, tag: str, prof: bool) -> None:
        self.id = sid
        self.tag = tag
        self.prof = prof
        self.rec: SessionRecord | None = None
        self.rounds = 0
        self.bursts = 0
        self.tokens = 0
        self.last_end = 0
        self.last_line = 0
        self.summarized = False


class Rebuilder:
    """Feeds on scanned legacy lines (:func:`memra_obs.legacy.scan_line`), hands out records.

    One rebuilder per stream (one worker's stderr): it assumes the stream's sessions run one
    after another, as a worker with one loop thread prints them. Lines of concurrent
    sessions interleave without ids; they are attributed by adjacency, and whatever does not
    fit is reported back as an orphan (the caller counts it) rather than guessed.
    """

    def __init__(
        self,
        worker: str = "",
        *,
        linger_ns: int = 500_000_000,
        session_gap_ns: int = 1_000_000_000,
        max_bursts: int = 64,
        rng: random.Random | None = None,
        epoch_ns: Callable[[], int] = time.time_ns,
        mono_ns: Callable[[], int] = time.perf_counter_ns,
        compact: bool = False,
    ) -> None:
        self.worker = worker
        #: RoundBlocks instead of RoundRecords, and no BurstRecords (see the module doc).
        self.compact = compact
        self._extra = 0  # records the blocks in _out stand for, beyond one each
        self.linger_ns = linger_ns
        self.session_gap_ns = session_gap_ns
        self.max_bursts = max_bursts
        self._rng = rng or random.Random()
        self._epoch = epoch_ns
        self._mono = mono_ns
        self._out: list[Record] = []
        self._pending: _Burst | None = None
        self._session: _Session | None = None
        self._last_kind = ""
        self._last_end = 0  # end of the latest burst laid out, over all sessions
        self._seen_phase = False
        self._roll_share = 0.5  # rollback's share of rest_ms, from the latest phase line
        #: Rounds published with a row's exact values / with the burst's per-round means.
        self.rounds_from_rows = 0
        self.rounds_from_means = 0
        self.sessions = 0
        #: Bursts refused while being laid out (values no clock produces), with why; the
        #: caller drains ``problems`` to report them.
        self.bursts_dropped = 0
        self.problems: list[str] = []

    # -- input ---------------------------------------------------------------------------

    def feed(self, kind: str, tag: str, v: tuple[Any, ...], t: int) -> str | None:
        """One scanned line (:func:`memra_obs.legacy.scan_line`) that arrived at ``t`` (ns,
        monotonic). Returns why the line could not be placed (it is then ignored), else
        None."""
        why: str | None = None
        if kind is PROF_ROUNDS:
            return self.row(
                (
                    v[0],
                    round(v[1] * 1e6),
                    round(v[2] * 1e6),
                    round(v[3] * 1e6),
                    round(v[4] * 1e6),
                    round(v[5] * 1e6),
                    (v[6], v[7], v[8], v[9]),
                ),
                t,
            )
        if kind is PHASE:
            return self.phase(tag, v, t)
        if kind is VERIFY:
            return self.verify(tag, v, t)
        if kind is PROF:
            why = self._prof(v[0], t)
        elif kind is PROF_SUMMARY:
            why = self._summary(v, t)
        elif kind is not OVERRIDE:
            why = f"unknown kind {kind!r}"
        self._last_kind = kind
        return why

    def tick(self, now: int) -> None:
        """Time passed without lines: settle a burst whose lines stopped ``linger_ns`` ago,
        end a session idle for ``session_gap_ns``."""
        b = self._pending
        if b is not None and now - b.last >= self.linger_ns:
            self._finish(b)
        s = self._session
        if (
            s is not None
            and self._pending is None
            and (not s.prof or s.summarized)
            and now - s.last_line >= self.session_gap_ns
        ):
            self._end(s)

    def close(self) -> None:
        """End of input: settle everything still open."""
        if self._pending is not None:
            self._finish(self._pending)
        if self._session is not None:
            self._end(self._session)

    def take(self) -> RecordBatch:
        """The records completed since the last call, in order (with ``compact``, a
        RoundBlock for each burst's rounds)."""
        out = RecordBatch(self._out)
        out.records = len(out) + self._extra
        self._out = []
        self._extra = 0
        return out

    @property
    def busy(self) -> bool:
        """Something is still open (a burst being assembled, or a session)."""
        return self._pending is not None or self._session is not None

    # -- per kind --------------------------------------------------------------------------

    def phase(self, tag: str, v: tuple[Any, ...], t: int) -> str | None:
        """A phase line: ``v`` is ``(rounds, k, total, draft, ..., per-round total)``, the
        counts as ints, the ms as float or str (converted where used)."""
        self._last_kind = PHASE
        self._seen_phase = True
        if self._pending is not None:
            self._finish(self._pending)
        if v[0] > MAX_BURST_ROUNDS:
            return f"rounds={v[0]} is past any plausible burst (> {MAX_BURST_ROUNDS})"
        self._pending = _Burst(tag, v[0], v[1], v, t)
        return None

    def verify(self, tag: str, v: tuple[Any, ...], t: int) -> str | None:
        """A level-2 line: ``v`` is ``(rounds, k, vkda, scan, vmla, vrest, vffn)`` (ms as
        float or str)."""
        why = self._verify(tag, v, t)
        self._last_kind = VERIFY
        return why

    def _verify(self, tag: str, v: tuple[Any, ...], t: int) -> str | None:
        b = self._pending
        if (
            b is None
            or b.phase is None
            or b.verify is not None
            or self._last_kind is not PHASE
            or b.rounds != v[0]
            or b.k != v[1]
        ):
            return "level-2 line without its phase line just before it"
        b.verify = v
        b.tag_v = tag
        b.last = t
        return None

    def _prof(self, prof: SpecFirstTokenProf, t: int) -> str | None:
        b = self._pending
        n = prof.first_burst_rounds
        if n > MAX_BURST_ROUNDS:
            return f"first_burst_rounds={n} is past any plausible burst (> {MAX_BURST_ROUNDS})"
        if (
            b is not None
            and b.prof is None
            and b.rows is None
            and b.phase is not None
            and b.rounds == n
        ):
            b.prof = prof  # the session's first burst: the phase line just before
            b.last = t
            return None
        if b is not None:
            self._finish(b)
        # No phase line for it (profile-only stream, or lost): the burst is what the
        # profile and the rows that follow say.
        b = self._pending = _Burst("", n, 0, None, t)
        b.prof = prof
        if n == 0:
            self._finish(b)
        return "[spec-prof] without its first burst's phase line" if self._seen_phase else None

    def row(self, v: tuple[Any, ...], t: int) -> str | None:
        """A ``[spec-prof-rounds]`` row, in ns: ``(row, wall, draft, verify, accept, rest,
        (k, j, ctx, seq_rows))`` with each ns ``round(f32_ms * 1e6)``."""
        self._last_kind = PROF_ROUNDS
        b = self._pending
        if (
            b is not None
            and (b.rows is not None or self._place(b, v[0]))
            and b.left > 0
            and v[0] == b.nxt  # the burst's next row
        ):
            _put_row(b.rows, v)  # type: ignore[arg-type]
            b.nxt += 1
            b.left -= 1
            b.last = t
            return None
        return self._row_other(b, v, t)

    def rows(self, cols: RowColumns, a: int, z: int, t: int) -> list[tuple[int, str]] | None:
        """Rows ``a:z`` of ``cols``, in order: the same as one :meth:`row` each, with the
        run that continues the pending burst taken in one step. Returns (offset from
        ``a``, why) for each row that could not be placed, or None."""
        b = self._pending
        idx = cols[0]
        a0 = a
        if b is not None and (b.rows is not None or self._place(b, idx[a])):
            m = z - a
            if m > b.left:
                m = b.left
            nxt = b.nxt
            if m > 0 and idx[a] == nxt and (m == 1 or idx[a : a + m] == list(range(nxt, nxt + m))):
                e = a + m
                rows = b.rows
                srcs: tuple[list[Any], ...] = cols[1:]
                if rows is not None and rows[0]:
                    for col, src in zip(rows, srcs, strict=True):
                        col.extend(src[a:e])
                else:  # the burst's first rows (the usual case: all of them)
                    b.rows = [src[a:e] for src in srcs]
                b.nxt = nxt + m
                b.left -= m
                b.last = t
                self._last_kind = PROF_ROUNDS
                if e == z:
                    return None
                a = e
        bad = None
        row = self.row
        for i in range(a, z):
            why = row((idx[i], *(col[i] for col in cols[1:])), t)
            if why is not None:
                if bad is None:
                    bad = []
                bad.append((i - a0, why))
        return bad

    def _place(self, b: _Burst, idx: int) -> bool:
        """Whether a first row ``idx`` starts ``b``'s rows: its index must be the burst's
        base (0 for a session's first burst, else the rounds the session has run); at most
        ``SPEC_PROF_ROUNDS`` rows a session, ``rounds`` a burst. If so, ``b.rows`` opens
        with ``nxt`` = the base and ``left`` = how many fit. Once a row is in, ``b.prof``
        cannot change (a ``[spec-prof]`` only joins a burst without rows) and the session
        stays the same while ``b`` is pending, so the base is fixed."""
        s = self._session
        base = 0 if b.prof is not None else (s.rounds if s is not None else 0)
        limit = SPEC_PROF_ROUNDS - base  # the log keeps no more: nor do we
        if b.rounds is not None and b.rounds < limit:
            limit = b.rounds
        if limit > 0 and idx == base:
            b.rows = [[], [], [], [], [], []]
            b.nxt = base
            b.left = limit
            return True
        return False

    def _row_other(self, b: _Burst | None, v: tuple[Any, ...], t: int) -> str | None:
        """A row its burst does not expect: in a profile-only stream, the start of a burst
        of rows; anywhere else, an orphan."""
        idx = v[0]
        s = self._session
        if not self._seen_phase:
            # Profile-only stream: rows past the known burst form a burst of their own.
            nxt = s.rounds if s is not None else 0
            if b is not None:
                nxt = (0 if b.prof is not None else nxt) + (
                    b.rounds if b.rounds is not None else _nrows(b)
                )
                self._finish(b)
            if idx == nxt and self._session is not None:
                s = self._session
                b = self._pending = _Burst(s.tag, None, 0, None, t)
                b.rows = [[], [], [], [], [], []]
                _put_row(b.rows, v)
                base = s.rounds
                b.nxt = base + 1
                b.left = SPEC_PROF_ROUNDS - base - 1
                return None
        return f"row={idx} out of sequence (no burst of this session expects it)"

    def _summary(self, v: tuple[Any, ...], t: int) -> str | None:
        if self._pending is not None:
            self._finish(self._pending)
        s = self._session
        if s is None:
            if v[0] == 0:  # a session that ran no round at all: no other line marked it
                s = self._open("", False, t, t)
                self._end(s)
                return None
            return "[spec-prof-summary] with no session open"
        s.last_line = t
        if v[0] < SPEC_PROF_ROUNDS:
            self._end(s)
        else:
            s.summarized = True  # the log is full; the session may go on
        return None

    # -- sessions --------------------------------------------------------------------------

    def _open(self, tag: str, prof: bool, start: int, t: int, b: _Burst | None = None) -> _Session:
        s = self._session = _Session(next(_session_ids), tag, prof)
        s.last_line = t
        s.last_end = start
        rng = self._rng
        mono = self._mono()
        epoch = self._epoch()
        level = 0 if b is None or b.phase is None else (2 if b.verify is not None else 1)
        s.rec = SessionRecord(
            session=s.id,
            family=family_of(tag),
            tag=tag,
            tag_v=(b.tag_v if b is not None and b.tag_v else (f"{tag}-v" if tag else "")),
            worker=self.worker,
            start_ns_mono=start,
            anchor_ns_mono=mono,
            anchor_ns_epoch=epoch,
            trace_id=rng.getrandbits(128) or 1,
            span_id=rng.getrandbits(64) or 1,
            parent_span_id=0,
            level=level,
            prof=prof,
        )
        self._out.append(s.rec)
        self.sessions += 1
        return s

    def _end(self, s: _Session) -> None:
        self._session = None
        self._out.append(SessionEndRecord(s.id, s.last_end, s.rounds, s.bursts, s.tokens, ""))

    # -- bursts ----------------------------------------------------------------------------

    def _drop(self, b: _Burst, why: str) -> None:
        self.bursts_dropped += 1
        self.problems.append(why)

    def _finish(self, b: _Burst) -> None:
        """Lay the burst out in time and emit its session (when new), rounds and burst."""
        self._pending = None
        s = self._session
        prof = b.prof
        if s is not None and (
            prof is not None
            or (b.tag and s.tag and b.tag != s.tag)
            or ((not s.prof or s.summarized) and b.arrival - s.last_line > self.session_gap_ns)
            or (not s.prof and s.bursts >= self.max_bursts)
        ):
            self._end(s)
            s = None
        creation: list[tuple[str, int]] = []
        round0: tuple[int, ...] = ()
        hook = lead = 0
        split: tuple[int, int, int, int] | None = None
        try:  # every ms -> ns conversion of the lines happens here: past any clock is refused
            cols, counts, wall = self._round_phases(b)
            vv = b.verify
            if vv is not None:
                split = (
                    round(float(vv[2]) * 1e6),
                    round(float(vv[3]) * 1e6),
                    round(float(vv[4]) * 1e6),
                    round(float(vv[6]) * 1e6),
                )
            if prof is not None:
                wall = max(wall, round(prof.first_burst_ms * 1e6))
                hook = round(prof.first_burst_hook_ms * 1e6)
                round0 = tuple(round(getattr(prof, f) * 1e6) for f in _ROUND0_MS)
                for name in _CREATION:
                    ns = round(getattr(prof, name + "_ms") * 1e6)
                    if ns > 0:
                        creation.append((name, ns))
                lead = sum(ns for _, ns in creation)
        except (ArithmeticError, ValueError) as exc:
            self._drop(b, f"burst dropped: {exc}")
            return
        check = wall + lead + hook + (max(split) if split is not None else 0)
        if (check + sum(round0) if round0 else check) > _MAX_NS:
            self._drop(b, "burst dropped: durations past any plausible clock (> 2**50 ns)")
            return
        end = b.arrival
        if self._last_end + lead + wall > end:
            end = self._last_end + lead + wall
        start = end - wall
        self._last_end = end
        if s is None:
            s = self._open(b.tag, prof is not None, start - lead, b.arrival, b)
        sid = s.id
        bidx = s.bursts
        first_round = s.rounds
        n = len(cols[0])
        nrows = len(counts)
        # j + 1 tokens a round with a row, 1 a round without (its counts unknown: k = j = -1)
        tokens = prof.first_burst_tokens if prof is not None else sum(map(_j_of, counts)) + n
        self.rounds_from_rows += nrows
        self.rounds_from_means += n - nrows
        out = self._out
        if self.compact:
            if n:
                out.append(
                    _tuple_new(RoundBlock, (sid, bidx, first_round, start, cols, counts, split))
                )
                self._extra += n - 1
        else:
            self._records(out, b, sid, bidx, first_round, start, end, cols, counts, split,
                          tokens, hook)  # fmt: skip
        if prof is not None:
            out.append(FirstTokenRecord(sid, prof, _intervals(creation, round0, start, end)))
        s.rounds = first_round + n
        s.bursts = bidx + 1
        s.tokens += tokens
        s.last_end = end
        if b.last > s.last_line:
            s.last_line = b.last

    def _records(
        self,
        out: list[Record],
        b: _Burst,
        sid: int,
        bidx: int,
        first_round: int,
        start: int,
        end: int,
        cols: list[list[int]],
        counts: list[tuple[int, int, int, int]],
        split: tuple[int, int, int, int] | None,
        tokens: int,
        hook: int,
    ) -> None:
        """The burst as the observer records it: a RoundRecord per round, its BurstRecord."""
        append = out.append
        n = len(cols[0])
        nrows = len(counts)
        t0 = start
        idx = first_round
        for i, (d0, d1, d2, d3, d4) in enumerate(zip(*cols, strict=True)):
            t1 = t0 + d0
            t2 = t1 + d1
            t3 = t2 + d2
            t4 = t3 + d3
            t5 = t4 + d4
            if i < nrows:
                k, j, ctx, seq = counts[i]
            else:  # no row: the counts are unknown
                k, j, ctx, seq = -1, -1, 0, 0
            append(
                _tuple_new(
                    RoundRecord, (sid, bidx, idx, (t0, t1, t2, t3, t4, t5), k, j, ctx, seq, split)
                )
            )
            idx += 1
            t0 = t5
        phases = _new(SpecPhaseNs)  # the sums are valid u64 counts: skip the checks
        phases.draft, phases.verify, phases.accept = sum(cols[0]), sum(cols[1]), sum(cols[2])
        phases.roll, phases.maint, phases.rounds = sum(cols[3]), sum(cols[4]), n
        append(
            _tuple_new(
                BurstRecord,
                (
                    sid,
                    bidx,
                    b.k
                    if b.phase is not None or b.rows is None
                    else max((c[0] for c in b.rows[5]), default=0),
                    start,
                    end,
                    phases,
                    None
                    if split is None
                    else (split[0] * n, split[1] * n, split[2] * n, split[3] * n),
                    tokens,
                    hook,
                    first_round,
                ),
            )
        )

    def _round_phases(
        self, b: _Burst
    ) -> tuple[list[list[int]], list[tuple[int, int, int, int]], int]:
        """Each round's five phase durations (ns), as five columns: round 0 from the
        profile, the rows' own, then the burst's means for rounds without a row; the
        (k, j, ctx, seq_rows) of each round with a row, in order; and the sum of every
        duration (the burst's wall).

        A row has rollback + maint only as ``rest_ms``: when rows cover the whole burst the
        rollback share is chosen so the burst's rollback and maint sums match the phase
        line's totals; otherwise it is the line's rollback:maint ratio (the stream's latest
        one, for a burst without a line)."""
        rows = b.rows
        ph = b.phase
        prof = b.prof
        if ph is None or prof is not None:
            return self._round_phases_profiled(b)
        # A phase line and no profile: the rows' rounds, then the means (most bursts).
        n = ph[0]
        nr = 0
        if rows is not None:
            nr = len(rows[0])
            if nr > n:
                rows = [col[:n] for col in rows]
                nr = n
        roll_t = _burst_total_ns(float(ph[6]), float(ph[11]), n)
        maint_t = _burst_total_ns(float(ph[7]), float(ph[12]), n)
        share = self._roll_share
        if roll_t + maint_t > 0:
            share = self._roll_share = roll_t / (roll_t + maint_t)
        wall = 0
        counts: list[tuple[int, int, int, int]] = []
        if nr:
            W, D, V, A, R, counts = rows  # type: ignore[misc]
            if nr == n:
                rest = sum(R)
                if rest > 0:
                    x = roll_t / rest  # >= 0: min(max(x, 0.0), 1.0)
                    share = x if x <= 1.0 else 1.0
            roll, maint, short = _rest_split(W, D, V, A, R, share)
            cols = [D, V, A, roll, maint]
            wall = sum(W) + short
        else:
            cols = [[], [], [], [], []]
        m = n - nr
        if m > 0:
            totals = (
                _burst_total_ns(float(ph[3]), float(ph[8]), n),
                _burst_total_ns(float(ph[4]), float(ph[9]), n),
                _burst_total_ns(float(ph[5]), float(ph[10]), n),
                roll_t,
                maint_t,
            )
            wall += self._means(cols, totals, m)
        return cols, counts, wall

    @staticmethod
    def _means(cols: list[list[int]], totals: tuple[int, ...], m: int) -> int:
        """Each phase's total over the ``m`` rounds without a row (less what the rounds
        before them took), as evenly as integers allow: the first (total mod m) rounds carry
        one ns more, so the sums come back exact. Returns the sum of what was added."""
        added = 0
        for col, t in zip(cols, totals, strict=True):
            if col:
                t = max(t - sum(col), 0)
            q, e = divmod(t, m)
            if e:
                col.extend([q + 1] * e)
            col.extend([q] * (m - e))
            added += t
        return added

    def _round_phases_profiled(
        self, b: _Burst
    ) -> tuple[list[list[int]], list[tuple[int, int, int, int]], int]:
        """:meth:`_round_phases` for a burst with a profile (round 0 from it) or without a
        phase line (a profile-only stream)."""
        rows = b.rows
        ph = b.phase
        prof = b.prof
        nr = _nrows(b)
        n = b.rounds if (b.rounds is not None and ph is not None) else nr
        if prof is not None and n == 0 and b.rounds:
            n = 1  # no phase line and no rows: round 0 is still known from the profile
        if nr > n:
            rows = [col[:n] for col in rows]  # type: ignore[union-attr]
            nr = n
        r0: tuple[int, int, int, int, int] | None = None
        if prof is not None and n:
            dp, fd, fv, fa, fr, fm = (round(getattr(prof, f) * 1e6) for f in _ROUND0_MS)
            r0 = (dp + fd, fv, fa, fr, fm)
        counts: list[tuple[int, int, int, int]] = []
        if nr:
            W, D, V, A, R, counts = rows  # type: ignore[misc]
        share = self._roll_share
        if ph is not None:
            rounds = ph[0]
            roll_t = _burst_total_ns(float(ph[6]), float(ph[11]), rounds)
            maint_t = _burst_total_ns(float(ph[7]), float(ph[12]), rounds)
            if roll_t + maint_t > 0:
                share = self._roll_share = roll_t / (roll_t + maint_t)
            if nr and nr == n:
                rest = sum(R) - (R[0] if r0 is not None else 0)
                if rest > 0:
                    roll_left = roll_t - (r0[3] if r0 is not None else 0)
                    share = min(max(roll_left / rest, 0.0), 1.0)
        if nr:
            roll, maint, _ = _rest_split(W, D, V, A, R, share)
            cols = [list(D), list(V), list(A), roll, maint]
            if r0 is not None:
                for col, x in zip(cols, r0, strict=True):
                    col[0] = x
        elif r0 is not None:
            cols = [[x] for x in r0]
        else:
            cols = [[], [], [], [], []]
        m = n - len(cols[0])
        if m > 0 and ph is not None:
            totals = (
                _burst_total_ns(float(ph[3]), float(ph[8]), rounds),
                _burst_total_ns(float(ph[4]), float(ph[9]), rounds),
                _burst_total_ns(float(ph[5]), float(ph[10]), rounds),
                roll_t,
                maint_t,
            )
            self._means(cols, totals, m)
        return cols, counts, sum(map(sum, cols))


def _rest_split(
    W: list[int], D: list[int], V: list[int], A: list[int], R: list[int], share: float
) -> tuple[list[int], list[int], int]:
    """Rows' ``rest`` as rollback (``round(rest * share)``) and maint: what the row's wall
    leaves after draft, verify, accept and rollback (the f32 roundings), never below 0. The
    third value is how much walls grow where maint was held at 0 (the round's wall is then
    d + v + a + roll)."""
    roll = list(map(round, map(mul, R, repeat(share))))
    maint = list(map(sub, map(sub, map(sub, map(sub, W, D), V), A), roll))
    short = 0
    if min(maint) < 0:
        short = -sum(m for m in maint if m < 0)
        maint = [m if m > 0 else 0 for m in maint]
    return roll, maint, short


def _put_row(rows: list[list[Any]], v: tuple[Any, ...]) -> None:
    """One row ``(row, wall, draft, verify, accept, rest, counts)`` onto a burst's columns."""
    w, d, ve, a, r, c = rows
    w.append(v[1])
    d.append(v[2])
    ve.append(v[3])
    a.append(v[4])
    r.append(v[5])
    c.append(v[6])


def _nrows(b: _Burst) -> int:
    return 0 if b.rows is None else len(b.rows[0])


def _intervals(
    creation: list[tuple[str, int]], round0: tuple[int, ...], start: int, end: int
) -> tuple[tuple[str, int, int], ...]:
    """The profile's buckets laid out: creation back to back before the first burst, round
    0's buckets (``draft_prime`` and the ``first_*``) from the burst's start, the burst."""
    iv: list[tuple[str, int, int]] = []
    t = start - sum(ns for _, ns in creation)
    for name, ns in creation:
        iv.append((name, t, t + ns))
        t += ns
    t = start
    dp = round0[0]
    if dp > 0:
        iv.append(("draft_prime", t, t + dp))
        t += dp
    for name, ns in zip(_ROUND0, round0[1:], strict=True):
        iv.append((name, t, t + ns))
        t += ns
    iv.append(("first_burst", start, end))
    return tuple(iv)


def _burst_total_ns(total_ms: float, per_ms: float, rounds: int) -> int:
    """A phase's burst total from its two printed forms: ``total`` is exact to 0.005 ms,
    ``per-round`` to 0.0005 ms per round; the truth lies in both intervals, so take the
    middle of their intersection (per-round alone when rounding left them disjoint)."""
    if rounds <= 0:
        return 0
    t = total_ms * 1e6
    p = per_ms * 1e6 * rounds
    w = 500.0 * rounds
    lo = t - 5000.0
    x = p - w
    if not lo > x:
        lo = x
    hi = t + 5000.0
    x = p + w
    if not hi < x:
        hi = x
    if lo < 0.0:
        lo = 0.0
    if lo > hi:
        return round(p) if p > 0.0 else 0
    return round((lo + hi) * 0.5)
