"""Legacy lines back into the observer's records: what the lines say, laid out in time.

The lines carry no session ids and no timestamps; the README's "Reconstruction" table is the
contract: rows are exact rounds, phase lines give the rest their burst's means (``k = j = -1``:
never invented; runs of equal rounds as one record with ``repeat``), a burst ends when its
line arrived (or right after the previous one in a backlog), rounds lie back to back in it."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ..legacy import AdviceLine, FirstTokenLine, PhaseLine, RoundsLine, SummaryLine, VerifyLine
from ..records import SPEC_PROF_ROUNDS, SpecFirstTokenProf, SpecPhaseNs, SpecRoundProf
from ..timeline import BurstRecord, FirstTokenRecord, RoundRecord, SessionEndRecord, SessionRecord

if TYPE_CHECKING:
    from ..legacy import LegacyLine

__all__ = ["FAMILY_CAP", "MAX_BURST_ROUNDS", "UNKNOWN_FAMILY", "Rebuilder", "family_of"]

#: ``family`` (and empty tag) of sessions whose lines never named one (profile-only streams).
UNKNOWN_FAMILY = "unknown"
#: How a phase line of a family past ``max_families`` is refused (the tail says it once).
FAMILY_CAP = "past MEMRA_OBS_MAX_FAMILIES="
#: Rounds one line may claim; more is a garbled line, refused rather than expanded.
MAX_BURST_ROUNDS = 1 << 16
#: A burst (with its session's creation) longer than this (~13 days) is a garbled line.
_MAX_NS = 1 << 50
#: A session's fresh anchor pair moving the epoch offset by more than this is a wall-clock step.
_STEP_NS = 1_000_000
#: The profile's creation buckets in the loop's order (before the first burst), and round 0's.
_CREATION = ("cache_alloc", "sink_alloc", "prime", "capture", "anchor", "draft_alloc")
_ROUND0 = ("draft_prime", *(f"first_{p}" for p in ("draft", "verify", "accept", "roll", "maint")))
_creation_ms, _round0_ms = (attrgetter(*[f"{b}_ms" for b in bs]) for bs in (_CREATION, _ROUND0))
#: Session ids are unique per process, whichever rebuilder made them (exporters key on them).
_session_ids = itertools.count(1)
_new = tuple.__new__  # a NamedTuple without its Python-level __new__ (the same object)
#: ``round()`` of a float (every value a parsed line holds), without round()'s argument
#: parsing: a third of its cost, the same int (half to even; inf raises OverflowError).
_round = float.__round__
Split = tuple[int, int, int, int]
Key = tuple[int, int, int, Split | None]  # a burst's session, index, first round, split


def family_of(tag: str) -> str:
    """``glm5-phase`` -> ``glm5`` (the observer's default tag); any other tag is its own."""
    return tag[:-6] if tag.endswith("-phase") and len(tag) > 6 else tag or UNKNOWN_FAMILY


class _Burst:
    """A burst being assembled: its phase line, level-2 line, profile and rows."""

    __slots__ = (
        "arrival", "k", "last", "nxt", "phase", "prof", "rounds", "rows", "stop", "tag", "verify",
    )  # fmt: skip

    def __init__(self, tag: str, rounds: int | None, k: int, phase: PhaseLine | None, t: int):
        self.tag, self.k, self.phase = tag, k, phase
        self.rounds = rounds  # None: as many as rows come (a burst seen only through its rows)
        self.verify: VerifyLine | None = None
        self.prof: SpecFirstTokenProf | None = None
        self.rows: list[SpecRoundProf] = []
        self.arrival = self.last = t
        self.nxt = self.stop = -1  # once a row is in: the next one's index, the first too many


class _Session:
    __slots__ = (
        "advice", "bursts", "id", "last_end", "last_line", "prof", "rounds", "summarized", "tag",
        "tokens",
    )  # fmt: skip

    def __init__(self, sid: int, tag: str, prof: bool, start: int, t: int) -> None:
        self.id, self.tag, self.prof, self.last_end, self.last_line = sid, tag, prof, start, t
        self.rounds = self.bursts = self.tokens = 0
        self.summarized = False
        self.advice = ""  # its [spec-advice] line (the span's memra.spec.advice.*), once read


class Rebuilder:
    """Parsed legacy lines of one stream in (:func:`memra_obs.legacy.parse_line`), records
    out (:meth:`take`, in the contract's order). The stream's sessions are taken to run one
    after another (one loop thread); what does not fit is reported back, never guessed."""

    def __init__(self, worker: str = "", *, linger_ns: int = 500_000_000,
                 session_gap_ns: int = 1_000_000_000, max_bursts: int = 64,
                 max_families: int = 64, rng: random.Random | None = None,
                 epoch_ns: Callable[[], int] = time.time_ns,
                 mono_ns: Callable[[], int] = time.perf_counter_ns,
                 sampled: Callable[[int], bool] | None = None) -> None:  # fmt: skip
        self.worker, self.linger_ns, self.max_bursts = worker, linger_ns, max_bursts
        self.max_families, self._families, self._tags = max_families, set[str](), set[str]()
        self.sampled, self.session_gap_ns = sampled, session_gap_ns
        self._rng, self._epoch, self._mono = rng or random.Random(), epoch_ns, mono_ns
        self._out: list[Any] = []
        self._pending: _Burst | None = None
        self._session: _Session | None = None
        self._fresh: _Burst | None = None  # the pending burst while its phase line is the last
        self._first: _Burst | None = None  # a session's first burst laid out, no profile claimed it
        self._last_end = 0  # end of the latest burst laid out, over all sessions
        self._off: int | None = None  # epoch - mono of the sessions' anchor pairs
        self._seen_phase = False
        self._roll_share = 0.5  # rollback's share of rest_ms: the latest phase line's
        self._latest = ("", 0)  # the latest session's tag and level (a worker's family)
        self._spare = 0  # a session id drawn for a burst that was refused: the next one's
        #: The end of a session its summary closed, held for the [spec-advice] line the worker
        #: prints right after it (maybe in the next chunk) until another line or ``linger_ns``.
        self._held: SessionEndRecord | None = None
        self._held_t = 0
        #: The lines arrive as they are written (the caller's: a live pipe or a followed file
        #: caught up): a session is not laid more than ``linger_ns`` ahead of its arrival.
        self.live = False
        self._prev_last = 0  # the latest burst laid: its last line's arrival
        #: Rounds published with a row's values / with their burst's means; sessions opened.
        self.rounds_from_rows = self.rounds_from_means = self.sessions = 0
        #: Why each burst a line closed was refused while laid out (values no clock produces:
        #: its phase line is unplaced). The caller reports and clears it (the same list object).
        self.problems: list[str] = []

    def feed(self, rec: LegacyLine, t: int) -> str | None:
        """One parsed line that arrived at ``t`` (ns, monotonic). Returns why the line could
        not be placed (it is then ignored), else None."""
        if self._held is not None and type(rec) is not AdviceLine:
            self._release()
        if type(rec) is RoundsLine:  # most lines: the next row of the burst being assembled
            b, i, p = self._pending, rec.row, rec.prof
            if b is not None and i == b.nxt and i < b.stop and p.j <= p.k:
                b.rows.append(p)
                b.nxt, b.last = i + 1, t
                return None
            return self._row(rec, t)
        b, self._fresh = self._fresh, None
        if type(rec) is PhaseLine:
            return self._phase(rec, t)
        if type(rec) is VerifyLine:
            if b is not self._pending or not b or b.rows or (b.rounds, b.k) != (rec.rounds, rec.k):
                return "level-2 line without its phase line just before it"
            b.verify, b.last = rec, t
            return None
        if type(rec) is FirstTokenLine:
            return self._prof(rec.prof, t)
        if type(rec) is SummaryLine:
            return self._summary(rec.rounds, t)
        if type(rec) is AdviceLine:  # onto its session's end, as the worker's own span has it
            if (e := self._held) is not None:
                self._held = None
                self._out.append(e._replace(advice=rec.line()))
            elif (s := self._session) is not None and s.summarized:  # a full log: it may go on
                s.advice = rec.line()
        return None  # the flag-override line: nothing to place

    def tick(self, now: int) -> None:
        """No lines for a while: settle a burst idle ``linger_ns``, a session ``session_gap_ns``."""
        if self._held is not None and now - self._held_t >= self.linger_ns:
            self._release()
        if (b := self._pending) is not None and now - b.last >= self.linger_ns:
            self._finish(b)
        s, gap = self._session, self.session_gap_ns
        if s and not self._pending and (not s.prof or s.summarized) and now - s.last_line >= gap:
            self._end(s)

    def close(self) -> None:
        """End of input: settle everything still open."""
        if self._held is not None:
            self._release()
        if self._pending is not None:
            self._finish(self._pending)
        if self._session is not None:
            self._end(self._session)

    def take(self) -> list[Any]:
        """The records completed since the last call, in order."""
        out, self._out = self._out, []
        return out

    def _phase(self, p: PhaseLine, t: int) -> str | None:
        self._seen_phase = True
        if self._pending is not None:
            self._finish(self._pending)
        if p.rounds > MAX_BURST_ROUNDS or p.k > MAX_BURST_ROUNDS:  # (a k wraps on the wire)
            return f"rounds={p.rounds} k={p.k} is past any plausible burst (> {MAX_BURST_ROUNDS})"
        if p.tag not in self._tags:  # a family: ~150-300 series on /metrics, a report section
            fam = family_of(p.tag)
            if fam not in self._families:
                if len(self._families) >= self.max_families:
                    top = self.max_families
                    return f"{FAMILY_CAP}{top}: family {fam!r} (and every new one) not published"
                self._families.add(fam)
            self._tags.add(p.tag)
        self._pending = self._fresh = _Burst(p.tag, p.rounds, p.k, p, t)
        return None

    def _row(self, rec: RoundsLine, t: int) -> str | None:
        """A row that is not its burst's next: the burst's first (at its base: 0 for a
        session's first burst, else the rounds the session ran; at most SPEC_PROF_ROUNDS a
        session, ``rounds`` a burst), a profile-only stream's next burst, or an orphan."""
        b, s, i, p = self._pending, self._session, rec.row, rec.prof
        self._fresh = None
        if p.j > p.k:
            return f"row={i} has j={p.j} > k={p.k} (more accepted than drafted: no loop does that)"
        if b is not None and not b.rows and b.rounds is not None:
            base = 0 if b.prof is not None else (s.rounds if s is not None else 0)
            if i == base < (stop := min(SPEC_PROF_ROUNDS, base + b.rounds)):
                b.rows.append(p)
                b.nxt, b.stop, b.last = i + 1, stop, t
                return None
        if not self._seen_phase:  # no phase lines: a row past its burst starts the next one
            nxt = s.rounds if s is not None else 0
            if b is not None:
                nxt = (0 if b.prof is not None else nxt) + (b.rounds or len(b.rows))
                self._finish(b)
                s = self._session
            if i == nxt and s is not None:
                b = self._pending = _Burst(s.tag, None, 0, None, t)
                b.rows.append(p)
                b.nxt, b.stop = s.rounds + 1, SPEC_PROF_ROUNDS
                return None
        return f"row={i} out of sequence (no burst of this session expects it)"

    def _prof(self, prof: SpecFirstTokenProf, t: int) -> str | None:
        b, n = self._pending, prof.first_burst_rounds
        if n > MAX_BURST_ROUNDS:
            return f"first_burst_rounds={n} is past any plausible burst (> {MAX_BURST_ROUNDS})"
        if b is not None and b.prof is None and not b.rows and b.phase and b.rounds == n:
            b.prof, b.last = prof, t  # the session's first burst: the phase line just before
            return None
        # With phase lines in the stream, rounds are a phase line's, never a profile's: its own
        # was laid out, is another worker's or was lost (a burst of no round prints none).
        if self._seen_phase and n:
            if (f := self._first) is not None and f.rounds == n:
                self._first = None  # claimed: its rounds are out, not counted twice
                return ("[spec-prof] after its first burst was laid out (--linger, or another "
                        "worker's lines between them): not counted twice")  # fmt: skip
            return "[spec-prof] without its first burst's phase line: its rounds are not counted"
        if b is not None:
            self._finish(b)
        # A profile-only stream (trace off): the profile and the rows that follow are the burst;
        # with phase lines, a first burst of no round (a cancel): the stream's family, no round.
        b = self._pending = _Burst(self._latest[0] if self._seen_phase else "", n, 0, None, t)
        b.prof = prof
        if n == 0:
            self._finish(b)
        return None

    def _summary(self, rounds: int, t: int) -> str | None:
        if self._pending is not None:
            self._finish(self._pending)
        if (s := self._session) is not None and rounds == 0 < s.rounds:
            self._end(s)  # not its summary (it ran rounds): a later session that ran none
            s = None
        if s is None:
            if rounds:
                return "[spec-prof-summary] with no session open"
            # A session that ran no round at all: no other line marked it (after the last laid out).
            start = max(t, self._last_end)
            self._last_end = start + 1  # its span lasts 1 ns (Jaeger reads an empty one as < 0)
            self._end(self._open(None, self._id(), start, t, len(self._out)), held=t)
        elif rounds < SPEC_PROF_ROUNDS:
            s.last_line = t
            self._end(s, held=t)
        else:  # the log is full; the session may go on
            s.last_line, s.summarized = t, True
        return None

    def _open(self, b: _Burst | None, sid: int, start: int, t: int, at: int) -> _Session:
        """A session for burst ``b`` (None: a session without rounds, by its summary line: the
        profile is on, its tag and level the stream's latest), its record at ``at``."""
        v = b.verify if b is not None else None
        if b is None or (b.phase is None and self._seen_phase):  # no phase line of its own
            tag, level = self._latest
        else:
            tag, level = b.tag, 0 if b.phase is None else (1 if v is None else 2)
            self._latest = (tag, level)
        s = self._session = _Session(sid, tag, b is None or b.prof is not None, start, t)
        tag_v = v.tag if v is not None else (f"{tag}-v" if tag else "")
        rng, self.sessions = self._rng, self.sessions + 1
        tid, span = rng.getrandbits(128) or 1, rng.getrandbits(64) or 1
        if self.sampled and not self.sampled(tid):  # OTEL_TRACES_SAMPLER: no ids, no spans
            tid = span = 0
        # Sessions laid back to back share one offset (a fresh pair's read jitter would overlap
        # them by up to µs); a wall-clock step is taken up by the next session.
        mono, epoch = self._mono(), self._epoch()
        if self._off is None or abs(epoch - mono - self._off) > _STEP_NS:
            self._off = epoch - mono
        rec = SessionRecord(sid, family_of(tag), tag, tag_v, self.worker, start, mono,
                            mono + self._off, tid, span, 0, level, s.prof)  # fmt: skip
        self._out.insert(at, rec)
        return s

    def _id(self) -> int:
        sid, self._spare = self._spare or next(_session_ids), 0
        return sid

    def _end(self, s: _Session, held: int | None = None) -> None:
        """``held``: its summary closed it at ``held``; its [spec-advice] line may follow."""
        self._session = None
        rec = SessionEndRecord(s.id, s.last_end, s.rounds, s.bursts, s.tokens, "", s.advice)
        if held is None:
            self._out.append(rec)
        else:
            self._held, self._held_t = rec, held

    def _release(self) -> None:
        self._out.append(self._held)
        self._held = None

    def _finish(self, b: _Burst) -> None:
        """Lay the burst out in time: its session (when new), rounds, burst record, profile."""
        self._pending = None
        s, prof, out = self._session, b.prof, self._out
        if s is not None and (
            prof is not None
            or (b.tag and b.tag != s.tag)  # (a log begun mid-session: its rows had no tag)
            or ((not s.prof or s.summarized) and b.arrival - s.last_line > self.session_gap_ns)
            or (not s.prof and s.bursts >= self.max_bursts)
        ):
            self._end(s)
            s = None
        sid, bidx, first = (s.id, s.bursts, s.rounds) if s else (self._id(), 0, 0)
        mark, split, v = len(out), None, b.verify
        try:  # the ms -> ns conversions that can overflow (the rows' f32 values cannot)
            if v is not None:
                split = (_round(v.vkda_ms * 1e6), _round(v.scan_ms * 1e6),
                         _round(v.vmla_ms * 1e6), _round(v.vffn_ms * 1e6))  # fmt: skip
            creation, r0, hook, wall0 = _prof_ns(prof) if prof is not None else ((), (), 0, 0)
            lead = sum(x for _, x in creation) + (_round(prof.unattributed_ms * 1e6) if prof else 0)
            start = self._last_end + lead
            n, wall, phases, jsum = self._lay(b, (sid, bidx, first, split), start, r0)
            wall = wall if wall > wall0 else wall0
            if wall + lead + hook + (max(split) if split else 0) + (sum(r0) if r0 else 0) > _MAX_NS:
                raise ValueError("durations past any plausible clock (> 2**50 ns)")
        except (ArithmeticError, ValueError) as exc:
            del out[mark:]
            self.problems.append(f"burst dropped: {exc}")
            if s is None:
                self._spare = sid  # no session opened: the next one's id
            return
        # The burst ended when its line arrived, unless lines come faster than bursts run: a
        # backlog (laid back to back). Read live, a session laid more than linger_ns ahead
        # starts at its line's arrival: loops interleaving one stream, laid back to back, ran
        # (C - 1) x the time ahead, hours in a day (their sessions overlap, as they ran).
        # (A session whose line came in the read the previous burst's did is one loop's batch,
        # a log shipper's flush: laid back to back.)
        ahead, prev, self._prev_last = start + wall - b.arrival, self._prev_last, b.last
        if ahead < 0 or (s is None and self.live and ahead > self.linger_ns and b.arrival > prev):
            dt, start, rounds = b.arrival - start - wall, b.arrival - wall, out[mark:]
            out[mark:] = [r._replace(t_ns_mono=tuple([x + dt for x in r.t_ns_mono])) for r in rounds]  # fmt: skip
        end = self._last_end = start + wall
        if s is None:
            s = self._open(b, sid, start - lead, b.arrival, mark)
        tokens = prof.first_burst_tokens if prof is not None else n + jsum
        k = b.k if b.phase is not None or not b.rows else max(p.k for p in b.rows)
        if split is not None:
            split = (split[0] * n, split[1] * n, split[2] * n, split[3] * n)
        out.append(_new(BurstRecord, (sid, bidx, k, start, end, phases, split, tokens, hook, first)))  # fmt: skip
        if prof is not None:
            out.append(FirstTokenRecord(sid, prof, _intervals(creation, r0, start, end)))
        self.rounds_from_rows += len(b.rows)
        self.rounds_from_means += n - len(b.rows)
        s.rounds, s.bursts, s.tokens = s.rounds + n, s.bursts + 1, s.tokens + tokens
        s.last_end, s.last_line = end, (b.last if b.last > s.last_line else s.last_line)
        if s.bursts == 1 and prof is None and b.phase is not None:
            self._first = b

    def _lay(self, b: _Burst, key: Key, t: int, r0: tuple[int, ...]) -> tuple[int, int, SpecPhaseNs, int]:  # fmt: skip
        """The burst's rounds back to back from ``t``: round 0 from the profile, the rows, then
        runs of the line's means; returns rounds, wall, phase totals, the rows' sum of j. A row's
        ``rest_ms`` is split so rollback sums to the line's (else by its rollback:maint ratio)."""
        sid, bidx, idx, split = key
        ph, body, append, share, t0 = b.phase, b.rows, self._out.append, self._roll_share, t
        n = len(body) if ph is None else ph.rounds
        if r0 and not n and b.rounds:
            n = 1  # no phase line and no rows: round 0 is still known from the profile
        end, td, tv, ta, tr, jsum = idx + n, 0, 0, 0, 0, 0
        if r0 and n:  # round 0 to the ns from the profile (with its row's counts)
            dp, td, tv, ta, tr, tm = r0
            td += dp
            counts = body[0][5:] if body else (-1, -1, 0, 0)
            ts = (t, t + td, t + td + tv, t + td + tv + ta, t + td + tv + ta + tr)
            append(_new(RoundRecord, (sid, bidx, idx, (*ts, ts[4] + tm), *counts, split, 1)))
            t, idx, body = ts[4] + tm, idx + 1, body[1:]
        if ph is not None:
            # Rows covering the burst need only its rollback and maint totals (the others
            # are computed all the same when a value is large enough to overflow).
            cover = len(b.rows) == n
            totals = _totals(ph, (3, 4) if cover and max(ph[4:14]) < 1e290 else (0, 1, 2, 3, 4))
            roll, maint = totals[-2], totals[-1]
            if roll + maint > 0:
                share = self._roll_share = roll / (roll + maint)
            if cover and body and (rest := sum([_round(p[4] * 1e6) for p in body])):
                share = (roll - tr) / rest  # the line's rollback sum, exactly
                share = 0.0 if share < 0.0 else (1.0 if share > 1.0 else share)
        for w, d, v, a, e, k, j, c, q in body:
            d, v, a = _round(d * 1e6), _round(v * 1e6), _round(a * 1e6)
            e = _round(_round(e * 1e6) * share)
            td, tv, ta = td + d, tv + v, ta + a
            tr += e
            t4 = (t3 := (t2 := (t1 := t + d) + v) + a) + e
            t5 = t + _round(w * 1e6)
            if t5 < t4:  # the f32 roundings: maint held at 0, the wall grows by as much
                t5 = t4
            append(
                _new(RoundRecord, (sid, bidx, idx, (t, t1, t2, t3, t4, t5), k, j, c, q, split, 1))
            )
            jsum, idx, t = jsum + j, idx + 1, t5
        if ph is not None and (m := end - idx) > 0:  # the rest of the line's totals, evenly
            sums = (td, tv, ta, tr, t - t0 - td - tv - ta - tr)
            left = [x - y if x > y else 0 for x, y in zip(totals, sums, strict=True)]
            t = _mean_runs(self._out, left, m, t, (sid, bidx, idx, split))
            td, tv, ta, tr = td + left[0], tv + left[1], ta + left[2], tr + left[3]
        p = object.__new__(SpecPhaseNs)  # sums of valid ns counts: the record's checks skipped
        p.draft, p.verify, p.accept, p.roll, p.maint = td, tv, ta, tr, t - t0 - td - tv - ta - tr
        p.rounds = n
        return n, t - t0, p, jsum


def _mean_runs(out: list[Any], left: list[int], m: int, t: int, key: Key) -> int:
    """``m`` rounds sharing each phase's ``left`` as evenly as ints allow (the first
    ``x mod m`` rounds carry 1 ns more: the sums come back exact), appended from ``t`` as
    runs of equal rounds: at most six records, whatever ``m`` is. Returns the end."""
    sid, bidx, idx, split = key
    (qd, ed), (qv, ev), (qa, ea), (qr, er), (qm, em) = map(divmod, left, (m,) * 5)
    for lo, hi in itertools.pairwise(sorted({0, m, ed, ev, ea, er, em})):
        t1 = t + qd + (lo < ed)
        t2 = t1 + qv + (lo < ev)
        t3 = t2 + qa + (lo < ea)
        t4 = t3 + qr + (lo < er)
        ts = (t, t1, t2, t3, t4, t4 + qm + (lo < em))
        out.append(_new(RoundRecord, (sid, bidx, idx, ts, -1, -1, 0, 0, split, hi - lo)))
        idx, t = idx + hi - lo, t + (ts[5] - t) * (hi - lo)
    return t


def _prof_ns(p: SpecFirstTokenProf) -> tuple[tuple[tuple[str, int], ...], tuple[int, ...], int, int]:  # fmt: skip
    """The profile in ns: its creation buckets that ran, round 0's six, the hook, the wall."""
    ns = [(c, _round(ms * 1e6)) for c, ms in zip(_CREATION, _creation_ms(p), strict=True)]
    r0 = tuple([_round(x * 1e6) for x in _round0_ms(p)])
    return (tuple([(c, x) for c, x in ns if x > 0]), r0, _round(p.first_burst_hook_ms * 1e6),
            _round(p.first_burst_ms * 1e6))  # fmt: skip


def _totals(ph: PhaseLine, phases: tuple[int, ...]) -> list[int]:
    """The burst totals of ``phases`` (0-4: draft .. maint): the line's ``total`` is exact to
    0.005 ms, ``per-round`` to 0.0005 ms a round; the truth lies in both intervals, so take the
    middle of their intersection (per-round alone when rounding left them disjoint)."""
    n, ms, out = float(ph.rounds), ph[4:14], []  # the totals, then the per-round values
    w = 500.0 * n
    for i in phases:
        t, p = ms[i] * 1e6, ms[i + 5] * 1e6 * n
        lo = a if (a := p - w) > (b := t - 5000.0) else b
        hi = a if (a := p + w) < (b := t + 5000.0) else b
        if lo < 0.0:
            lo = 0.0
        out.append((_round(p) if p > 0.0 else 0) if lo > hi else _round((lo + hi) * 0.5))
    return out


def _intervals(creation: tuple[tuple[str, int], ...], r0: tuple[int, ...], start: int,
               end: int) -> tuple[tuple[str, int, int], ...]:  # fmt: skip
    """The profile's buckets laid out: creation back to back before the first burst, round
    0's (``draft_prime`` when it ran, then the ``first_*``) from the burst's start, the burst."""
    iv: list[tuple[str, int, int]] = []
    t = start - sum(x for _, x in creation)
    for name, x in creation:
        iv.append((name, t, (t := t + x)))
    t = start
    for name, x in zip(_ROUND0, r0, strict=True):
        if x > 0 or name != "draft_prime":
            iv.append((name, t, (t := t + x)))
    return (*iv, ("first_burst", start, end))
