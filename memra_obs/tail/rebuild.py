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
  ``ctx = seq_rows = 0``; exporters leave them out of every token count. They are handed
  over as a few records with ``repeat`` > 1 (runs of equal means), so a burst line of n
  rounds costs a few records, not n.
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
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable

from ..legacy import (
    FirstTokenLine,
    LegacyLine,
    PhaseLine,
    RoundsLine,
    SummaryLine,
    VerifyLine,
)
from ..records import SPEC_PROF_ROUNDS, SpecFirstTokenProf, SpecPhaseNs, SpecRoundProf
from ..timeline import (
    BurstRecord,
    FirstTokenRecord,
    Record,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

__all__ = ["MAX_BURST_ROUNDS", "UNKNOWN_FAMILY", "Rebuilder", "family_of"]

#: ``family`` (and empty tag) of sessions whose lines never named one (profile-only streams).
UNKNOWN_FAMILY = "unknown"

#: Session-creation buckets of the first-token profile, in the loop's order (they precede
#: the first burst); ``draft_prime`` and the ``first_*`` buckets sit inside round 0.
_CREATION = ("cache_alloc", "sink_alloc", "prime", "capture", "anchor", "draft_alloc")
_ROUND0 = ("first_draft", "first_verify", "first_accept", "first_roll", "first_maint")
_ROUND0_MS = ("draft_prime_ms", *(f + "_ms" for f in _ROUND0))
#: A burst (with its session's creation) longer than this (~13 days) is a garbled line.
_MAX_NS = 1 << 50
#: Rounds one burst may claim; a line claiming more is refused as garbled (a real burst
#: returns to its caller every few thousand rounds at most).
MAX_BURST_ROUNDS = 1 << 16
_UNKNOWN = (-1, -1, 0, 0)

#: Session ids are unique per process, whichever rebuilder made them (exporters key on them).
_session_ids = itertools.count(1)

#: One row in ns: wall, draft, verify, accept, rest, (k, j, ctx, seq_rows).
Row = tuple[int, int, int, int, int, tuple[int, int, int, int]]
#: Rounds as laid out: (repeat, (draft, verify, accept, rollback, maint) ns, counts).
Group = tuple[int, tuple[int, int, int, int, int], tuple[int, int, int, int]]


def family_of(tag: str) -> str:
    """``glm5-phase`` -> ``glm5``: the family a caller's tag names (the observer's default
    tag is ``{family}-phase``); any other tag is its own family."""
    if tag.endswith("-phase") and len(tag) > 6:
        return tag[:-6]
    return tag or UNKNOWN_FAMILY


def _ns(row: SpecRoundProf) -> Row:
    return (
        round(row.wall_ms * 1e6), round(row.draft_ms * 1e6), round(row.verify_ms * 1e6),
        round(row.accept_ms * 1e6), round(row.rest_ms * 1e6),
        (row.k, row.j, row.ctx, row.seq_rows),
    )  # fmt: skip


class _Burst:
    """A burst being assembled: its phase line, then its level-2 line, its first-token
    profile (a session's first burst) and its rows, until the next burst or a timeout."""

    __slots__ = (
        "arrival", "k", "last", "left", "nxt", "phase", "prof", "rounds", "rows", "tag", "verify",
    )  # fmt: skip

    def __init__(self, tag: str, rounds: int | None, k: int, phase: PhaseLine | None, t: int):
        self.tag = tag
        #: None: as many rounds as rows arrive (a burst seen only through its rows).
        self.rounds = rounds
        self.k = k
        self.phase = phase
        self.verify: VerifyLine | None = None
        self.prof: SpecFirstTokenProf | None = None
        #: None until a row is in.
        self.rows: list[Row] | None = None
        self.arrival = t
        self.last = t
        #: Once a row is in: the index the next row must have, and how many more fit.
        self.nxt = 0
        self.left = 0


class _Session:
    __slots__ = (
        "bursts", "id", "last_end", "last_line", "prof", "rounds", "summarized", "tag", "tokens",
    )  # fmt: skip

    def __init__(self, sid: int, tag: str, prof: bool) -> None:
        self.id = sid
        self.tag = tag
        self.prof = prof
        self.rounds = 0
        self.bursts = 0
        self.tokens = 0
        self.last_end = 0
        self.last_line = 0
        self.summarized = False


class Rebuilder:
    """Feeds on parsed legacy lines (:func:`memra_obs.legacy.parse_line`), hands out records.

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
    ) -> None:
        self.worker = worker
        self.linger_ns = linger_ns
        self.session_gap_ns = session_gap_ns
        self.max_bursts = max_bursts
        self._rng = rng or random.Random()
        self._epoch = epoch_ns
        self._mono = mono_ns
        self._out: list[Record] = []
        self._pending: _Burst | None = None
        self._session: _Session | None = None
        self._last: type = type(None)  # the kind of the previous legacy line
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

    def feed(self, rec: LegacyLine, t: int) -> str | None:
        """One parsed line that arrived at ``t`` (ns, monotonic). Returns why the line could
        not be placed (it is then ignored), else None."""
        kind = type(rec)
        why: str | None = None
        if kind is RoundsLine:
            why = self._row(rec.row, _ns(rec.prof), t)  # type: ignore[union-attr]
        elif kind is PhaseLine:
            why = self._phase(rec, t)  # type: ignore[arg-type]
        elif kind is VerifyLine:
            why = self._verify(rec, t)  # type: ignore[arg-type]
        elif kind is FirstTokenLine:
            why = self._prof(rec.prof, t)  # type: ignore[union-attr]
        elif kind is SummaryLine:
            why = self._summary(rec.rounds, t)
        self._last = kind
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

    def take(self) -> list[Record]:
        """The records completed since the last call, in order."""
        out, self._out = self._out, []
        return out

    @property
    def busy(self) -> bool:
        """Something is still open (a burst being assembled, or a session)."""
        return self._pending is not None or self._session is not None

    # -- per kind --------------------------------------------------------------------------

    def _phase(self, p: PhaseLine, t: int) -> str | None:
        self._seen_phase = True
        if self._pending is not None:
            self._finish(self._pending)
        if p.rounds > MAX_BURST_ROUNDS:
            return f"rounds={p.rounds} is past any plausible burst (> {MAX_BURST_ROUNDS})"
        self._pending = _Burst(p.tag, p.rounds, p.k, p, t)
        return None

    def _verify(self, v: VerifyLine, t: int) -> str | None:
        b = self._pending
        if (
            b is None
            or b.phase is None
            or b.verify is not None
            or self._last is not PhaseLine
            or b.rounds != v.rounds
            or b.k != v.k
        ):
            return "level-2 line without its phase line just before it"
        b.verify = v
        b.last = t
        return None

    def _prof(self, prof: SpecFirstTokenProf, t: int) -> str | None:
        b = self._pending
        n = prof.first_burst_rounds
        if n > MAX_BURST_ROUNDS:
            return f"first_burst_rounds={n} is past any plausible burst (> {MAX_BURST_ROUNDS})"
        if b is not None and b.prof is None and b.rows is None and b.phase and b.rounds == n:
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

    def _row(self, idx: int, row: Row, t: int) -> str | None:
        b = self._pending
        if (
            b is not None
            and (b.rows is not None or self._place(b, idx))
            and b.left > 0
            and idx == b.nxt  # the burst's next row
        ):
            b.rows.append(row)  # type: ignore[union-attr]
            b.nxt += 1
            b.left -= 1
            b.last = t
            return None
        return self._row_other(b, idx, row, t)

    def _place(self, b: _Burst, idx: int) -> bool:
        """Whether a first row ``idx`` starts ``b``'s rows: its index must be the burst's
        base (0 for a session's first burst, else the rounds the session has run); at most
        ``SPEC_PROF_ROUNDS`` rows a session, ``rounds`` a burst."""
        s = self._session
        base = 0 if b.prof is not None else (s.rounds if s is not None else 0)
        limit = SPEC_PROF_ROUNDS - base  # the log keeps no more: nor do we
        if b.rounds is not None and b.rounds < limit:
            limit = b.rounds
        if limit > 0 and idx == base:
            b.rows = []
            b.nxt = base
            b.left = limit
            return True
        return False

    def _row_other(self, b: _Burst | None, idx: int, row: Row, t: int) -> str | None:
        """A row its burst does not expect: in a profile-only stream, the start of a burst
        of rows; anywhere else, an orphan."""
        s = self._session
        if not self._seen_phase:
            nxt = s.rounds if s is not None else 0
            if b is not None:
                n = b.rounds if b.rounds is not None else len(b.rows or ())
                nxt = (0 if b.prof is not None else nxt) + n
                self._finish(b)
            s = self._session
            if idx == nxt and s is not None:
                b = self._pending = _Burst(s.tag, None, 0, None, t)
                b.rows = [row]
                b.nxt = s.rounds + 1
                b.left = SPEC_PROF_ROUNDS - s.rounds - 1
                return None
        return f"row={idx} out of sequence (no burst of this session expects it)"

    def _summary(self, rounds: int, t: int) -> str | None:
        if self._pending is not None:
            self._finish(self._pending)
        s = self._session
        if s is None:
            if rounds == 0:  # a session that ran no round at all: no other line marked it
                self._end(self._open("", False, t, t))
                return None
            return "[spec-prof-summary] with no session open"
        s.last_line = t
        if rounds < SPEC_PROF_ROUNDS:
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
        level = 0 if b is None or b.phase is None else (2 if b.verify is not None else 1)
        tag_v = b.verify.tag if b is not None and b.verify is not None else ""
        self._out.append(
            SessionRecord(
                session=s.id,
                family=family_of(tag),
                tag=tag,
                tag_v=tag_v or (f"{tag}-v" if tag else ""),
                worker=self.worker,
                start_ns_mono=start,
                anchor_ns_mono=self._mono(),
                anchor_ns_epoch=self._epoch(),
                trace_id=rng.getrandbits(128) or 1,
                span_id=rng.getrandbits(64) or 1,
                parent_span_id=0,
                level=level,
                prof=prof,
            )
        )
        self.sessions += 1
        return s

    def _end(self, s: _Session) -> None:
        self._session = None
        self._out.append(SessionEndRecord(s.id, s.last_end, s.rounds, s.bursts, s.tokens, ""))

    # -- bursts ----------------------------------------------------------------------------

    def _ends_session(self, s: _Session, b: _Burst) -> bool:
        return (
            b.prof is not None
            or bool(b.tag and s.tag and b.tag != s.tag)
            or ((not s.prof or s.summarized) and b.arrival - s.last_line > self.session_gap_ns)
            or (not s.prof and s.bursts >= self.max_bursts)
        )

    def _finish(self, b: _Burst) -> None:
        """Lay the burst out in time and emit its session (when new), rounds and burst."""
        self._pending = None
        s = self._session
        if s is not None and self._ends_session(s, b):
            self._end(s)
            s = None
        prof = b.prof
        creation: list[tuple[str, int]] = []
        round0: tuple[int, ...] = ()
        hook = lead = 0
        split: tuple[int, int, int, int] | None = None
        try:  # every ms -> ns conversion of the lines happens here: past any clock is refused
            groups, wall = self._layout(b)
            v = b.verify
            if v is not None:
                split = (ns(v.vkda_ms), ns(v.scan_ms), ns(v.vmla_ms), ns(v.vffn_ms))
            if prof is not None:
                wall = max(wall, ns(prof.first_burst_ms))
                hook = ns(prof.first_burst_hook_ms)
                round0 = tuple(ns(getattr(prof, f)) for f in _ROUND0_MS)
                creation = [(c, x) for c in _CREATION if (x := ns(getattr(prof, c + "_ms"))) > 0]
                lead = sum(x for _, x in creation)
        except (ArithmeticError, ValueError) as exc:
            self._drop(f"burst dropped: {exc}")
            return
        if wall + lead + hook + max(split or (0,)) + sum(round0) > _MAX_NS:
            self._drop("burst dropped: durations past any plausible clock (> 2**50 ns)")
            return
        end = max(b.arrival, self._last_end + lead + wall)
        start = end - wall
        self._last_end = end
        if s is None:
            s = self._open(b.tag, prof is not None, start - lead, b.arrival, b)
        n, tokens = self._records(b, s, start, end, groups, split, hook)
        if prof is not None:
            self._out.append(FirstTokenRecord(s.id, prof, _intervals(creation, round0, start, end)))
        s.rounds += n
        s.bursts += 1
        s.tokens += tokens
        s.last_end = end
        s.last_line = max(s.last_line, b.last)

    def _drop(self, why: str) -> None:
        self.bursts_dropped += 1
        self.problems.append(why)

    def _records(
        self,
        b: _Burst,
        s: _Session,
        start: int,
        end: int,
        groups: list[Group],
        split: tuple[int, int, int, int] | None,
        hook: int,
    ) -> tuple[int, int]:
        """The burst as the observer records it: its rounds (runs of equal means as one
        record with ``repeat``), then its BurstRecord. Returns its rounds and tokens."""
        out = self._out
        bidx, idx = s.bursts, s.rounds
        t0 = start
        td = tv = ta = tr = tm = rows = jsum = 0
        for rep, (d, v, a, r, m), (k, j, ctx, seq) in groups:
            if k >= 0:
                rows += 1
                jsum += j
            t1 = t0 + d
            t2 = t1 + v
            t3 = t2 + a
            t4 = t3 + r
            t5 = t4 + m
            t = (t0, t1, t2, t3, t4, t5)
            out.append(_tuple_new(RoundRecord, (s.id, bidx, idx, t, k, j, ctx, seq, split, rep)))
            idx += rep
            t0 += (t5 - t0) * rep
            td += d * rep
            tv += v * rep
            ta += a * rep
            tr += r * rep
            tm += m * rep
        n = idx - s.rounds
        self.rounds_from_rows += rows
        self.rounds_from_means += n - rows
        # j + 1 tokens a round with a row, 1 a round without (its counts unknown)
        tokens = b.prof.first_burst_tokens if b.prof is not None else n + jsum
        k = b.k if b.phase is not None or not b.rows else max(row[5][0] for row in b.rows)
        phases = _phase_totals(td, tv, ta, tr, tm, n)
        bsplit = None if split is None else (split[0] * n, split[1] * n, split[2] * n, split[3] * n)
        out.append(BurstRecord(s.id, bidx, k, start, end, phases, bsplit, tokens, hook, s.rounds))
        return n, tokens

    def _layout(self, b: _Burst) -> tuple[list[Group], int]:
        """The burst's rounds as groups — round 0 from the profile, then the rows' own,
        then the burst's means for rounds without a row — and the burst's wall.

        A row has rollback + maint only as ``rest_ms``: when rows cover the whole burst the
        rollback share is chosen so the burst's rollback sum matches the phase line's total;
        otherwise it is the line's rollback:maint ratio (the stream's latest one, for a
        burst without a line)."""
        ph = b.phase
        prof = b.prof
        rows = b.rows or []
        n = b.rounds if (b.rounds is not None and ph is not None) else len(rows)
        if prof is not None and n == 0 and b.rounds:
            n = 1  # no phase line and no rows: round 0 is still known from the profile
        if len(rows) > n:
            rows = rows[:n]
        r0: tuple[int, int, int, int, int] | None = None
        if prof is not None and n:
            dp, fd, fv, fa, fr, fm = (ns(getattr(prof, f)) for f in _ROUND0_MS)
            r0 = (dp + fd, fv, fa, fr, fm)
        share = self._roll_share
        totals: list[int] = []
        if ph is not None:  # the line's fields: totals at 4..8, per round at 9..13
            r = ph.rounds
            totals = [_burst_total_ns(ph[4 + i], ph[9 + i], r) for i in range(5)]
            roll_t, maint_t = totals[3], totals[4]
            if roll_t + maint_t > 0:
                share = self._roll_share = roll_t / (roll_t + maint_t)
            if rows and len(rows) == n:
                rest = sum([row[4] for row in rows]) - (rows[0][4] if r0 is not None else 0)
                if rest > 0:
                    left = roll_t - (r0[3] if r0 is not None else 0)
                    share = min(max(left / rest, 0.0), 1.0)
        groups: list[Group] = []
        append = groups.append
        wall = 0
        for w, d, v, a, rest, counts in rows:
            roll = round(rest * share)
            maint = w - d - v - a - roll
            if maint < 0:  # the f32 roundings: hold maint at 0, the wall grows by that much
                w -= maint
                maint = 0
            append((1, (d, v, a, roll, maint), counts))
            wall += w
        if r0 is not None:
            if groups:
                wall += sum(r0) - sum(groups[0][1])
                groups[0] = (1, r0, groups[0][2])
            else:
                groups.append((1, r0, _UNKNOWN))
                wall += sum(r0)
        m = n - len(groups)
        if m > 0 and totals:
            left = [max(t - sum(g[1][p] for g in groups), 0) for p, t in enumerate(totals)]
            groups.extend(_mean_runs(left, m))
            wall += sum(left)
        return groups, wall


def _phase_totals(d: int, v: int, a: int, r: int, m: int, n: int) -> SpecPhaseNs:
    """A burst's totals: sums of valid ns counts, so the record's checks are skipped."""
    p = _new(SpecPhaseNs)
    p.draft, p.verify, p.accept, p.roll, p.maint, p.rounds = d, v, a, r, m, n
    return p


_new = object.__new__
_tuple_new = tuple.__new__  # a NamedTuple without its Python-level __new__ (same object)


def ns(ms: float) -> int:
    """Milliseconds as printed -> integer ns (raises on inf/nan: a garbled line)."""
    return round(ms * 1e6)


def _mean_runs(totals: list[int], m: int) -> list[Group]:
    """Each phase's total over ``m`` rounds as evenly as integers allow (the first
    ``total mod m`` rounds carry one ns more, so the sums come back exact), as runs of
    equal rounds: at most six groups, whatever ``m`` is."""
    qs = [divmod(t, m) for t in totals]
    cuts = sorted({0, m, *(e for _, e in qs if 0 < e < m)})
    return [
        (z - a, tuple(q + (1 if a < e else 0) for q, e in qs), _UNKNOWN)  # type: ignore[misc]
        for a, z in itertools.pairwise(cuts)
    ]


def _intervals(
    creation: list[tuple[str, int]], round0: tuple[int, ...], start: int, end: int
) -> tuple[tuple[str, int, int], ...]:
    """The profile's buckets laid out: creation back to back before the first burst, round
    0's buckets (``draft_prime`` and the ``first_*``) from the burst's start, the burst."""
    iv: list[tuple[str, int, int]] = []
    t = start - sum(x for _, x in creation)
    for name, x in creation:
        iv.append((name, t, t + x))
        t += x
    t = start
    dp = round0[0]
    if dp > 0:
        iv.append(("draft_prime", t, t + dp))
        t += dp
    for name, x in zip(_ROUND0, round0[1:], strict=True):
        iv.append((name, t, t + x))
        t += x
    iv.append(("first_burst", start, end))
    return tuple(iv)


def _burst_total_ns(total_ms: float, per_ms: float, rounds: int) -> int:
    """A phase's burst total from its two printed forms: ``total`` is exact to 0.005 ms,
    ``per-round`` to 0.0005 ms per round; the truth lies in both intervals, so take the
    middle of their intersection (per-round alone when rounding left them disjoint)."""
    t = total_ms * 1e6
    p = per_ms * 1e6 * rounds
    w = 500.0 * rounds
    lo = p - w if p - w > t - 5000.0 else t - 5000.0
    hi = p + w if p + w < t + 5000.0 else t + 5000.0
    if lo < 0.0:
        lo = 0.0
    if lo > hi:
        return round(p) if p > 0.0 else 0
    return round((lo + hi) * 0.5)
