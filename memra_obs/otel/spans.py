"""Records -> plain span tuples: the tree of DESIGN §4, built off the loop's thread.

A span here is a plain tuple (cheap to build, cheap to encode)::

    (name, trace_id, span_id, parent_span_id, start_ns_epoch, end_ns_epoch, attrs, status)

``attrs`` is a tuple of ``(key, value)`` pairs (int, float, str, bool, or a tuple of one of
those); ``status`` is ``None`` (unset) or ``(code, message)`` with OTLP's codes (2 = error).
``parent_span_id`` 0 means a root span. Start and end are the records' boundary stamps
mapped to epoch ns through the session's anchor pair (:func:`memra_obs.timeline.to_epoch_ns`,
inlined as one offset per session) — never "now".

The tree::

    spec.session                (parent: the caller's span in SessionRecord, if any)
    ├─ spec.first_token         every SpecFirstTokenProf field as an attribute
    │  ├─ spec.first_token.<bucket>        one per non-zero session-creation bucket, in order
    │  └─ spec.first_token.first_burst
    │     └─ spec.first_token.<bucket>     round-1 buckets (draft_prime, first_draft, ...)
    └─ spec.burst               rounds, k, family, tokens, phase totals, rounds_unsampled
       └─ spec.round            round, k, j, ctx, seq_rows, acceptance_rate, tokens, wall_ns
          │                     (round and wall_ns only when k = j = -1: counts unknown)
          ├─ spec.draft  ├─ spec.verify (level 2: the sub-split)  ├─ spec.accept
          ├─ spec.rollback  └─ spec.maint

Span ids below the session are derived, not drawn: ``session_span_id XOR (n * GAMMA)``
(the Weyl step of splitmix64) with ``n`` a per-session counter of (kind, index). It is a
bijection of ``n``, so ids never collide inside a session; the session's random span id
makes them unrelated across sessions; and it costs one multiply. Anyone holding the
session's ids can name a round's span (:func:`round_span_id`, for metric exemplars).

Only the first ``round_spans`` rounds of a session get spans; each burst span says how many
of its rounds were left out (``memra.spec.rounds_unsampled``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..records import FIRST_TOKEN_FIELDS
from ..timeline import (
    BurstRecord,
    FirstTokenRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

__all__ = [
    "ATTR_PREFIX",
    "PHASE_SPAN_NAMES",
    "STATUS_ERROR",
    "Span",
    "SpanBuilder",
    "burst_span_id",
    "derived_span_id",
    "round_span_id",
    "round_span_ids",
]

#: A span tuple (see the module doc); typed loosely on purpose, it is built on a hot path.
Span = tuple[str, int, int, int, int, int, tuple[tuple[str, Any], ...], "tuple[int, str] | None"]

ATTR_PREFIX = "memra.spec."
STATUS_ERROR = 2

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15

# n = 8 * index + kind; kind 0 is the first-token family (index >= 1), so n is never 0.
_K_FT, _K_BURST, _K_ROUND = 0, 1, 2  # phases are kinds 3..7
_G = tuple(k * _GAMMA for k in range(8))
_FT_SPAN, _FT_BURST, _FT_BUCKET0 = 1, 2, 3

SESSION_SPAN = "spec.session"
FIRST_TOKEN_SPAN = "spec.first_token"
BURST_SPAN = "spec.burst"
ROUND_SPAN = "spec.round"
#: The phase spans of a round, in order (the seed's five phases).
PHASE_SPAN_NAMES = ("spec.draft", "spec.verify", "spec.accept", "spec.rollback", "spec.maint")


def derived_span_id(session_span_id: int, n: int) -> int:
    """The span id number ``n`` (>= 1) of the session whose ``spec.session`` id is given."""
    return (session_span_id ^ ((n * _GAMMA) & _M64)) or 1


def burst_span_id(session_span_id: int, burst: int) -> int:
    """The ``spec.burst`` span id of burst ``burst`` (0-based) of a session."""
    return derived_span_id(session_span_id, 8 * burst + _K_BURST)


def round_span_id(session_span_id: int, round_index: int) -> int:
    """The ``spec.round`` span id of round ``round_index`` (0-based, per session): what a
    metric exemplar links to. Rounds past the round cap have no span (use the burst's)."""
    return derived_span_id(session_span_id, 8 * round_index + _K_ROUND)


def round_span_ids(cap: int) -> Callable[[SessionRecord, RoundRecord], int] | None:
    """The Prometheus exporter's ``round_span_id`` hook when rounds get spans up to ``cap``
    per session (``MEMRA_OBS_ROUND_SPANS``): a round's exemplar names its span, 0 past the
    cap. None when no round has a span (``cap`` 0)."""
    if cap <= 0:
        return None

    def span_of(s: SessionRecord, r: RoundRecord) -> int:
        return round_span_id(s.span_id, r.index) if r.index < cap else 0

    return span_of


# -- attribute keys (memra.spec.*; GenAI / general semantic conventions where one exists) --
A_SESSION = "memra.spec.session"
A_FAMILY = "memra.spec.family"
A_WORKER = "memra.spec.worker"
A_LEVEL = "memra.spec.trace_level"
A_PROF = "memra.spec.prof"
A_ROUNDS = "memra.spec.rounds"
A_BURSTS = "memra.spec.bursts"
A_TOKENS = "memra.spec.tokens"
A_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
A_ERROR_TYPE = "error.type"
A_UNFINISHED = "memra.spec.unfinished"
A_BURST = "memra.spec.burst"
A_K = "memra.spec.k"
A_FIRST_ROUND = "memra.spec.first_round"
A_UNSAMPLED = "memra.spec.rounds_unsampled"
A_HOOK_NS = "memra.spec.hook_ns"
A_PHASE_NS = (
    "memra.spec.draft_ns",
    "memra.spec.verify_ns",
    "memra.spec.accept_ns",
    "memra.spec.rollback_ns",
    "memra.spec.maint_ns",
)
A_SPLIT_NS = (
    "memra.spec.verify.kda_ns",
    "memra.spec.verify.kda_scan_ns",
    "memra.spec.verify.mla_ns",
    "memra.spec.verify.rest_ns",
    "memra.spec.verify.ffn_ns",
)
A_ROUND = "memra.spec.round"
A_J = "memra.spec.j"
A_CTX = "memra.spec.ctx"
A_SEQ_ROWS = "memra.spec.seq_rows"
A_ACCEPT_RATE = "memra.spec.acceptance_rate"
A_WALL_NS = "memra.spec.wall_ns"
A_FT = "memra.spec.first_token."
A_FT_TOTAL = "memra.spec.first_token.total_ms"


def _split_attrs(verify_ns: int, split: tuple[int, int, int, int]) -> tuple[tuple[str, Any], ...]:
    kda, scan, mla, ffn = split
    rest = verify_ns - (kda + mla)
    return (
        (A_SPLIT_NS[0], kda),
        (A_SPLIT_NS[1], scan),
        (A_SPLIT_NS[2], mla),
        (A_SPLIT_NS[3], rest if rest > 0 else 0),
        (A_SPLIT_NS[4], ffn),
    )


class _Session:
    """What the builder keeps per open session."""

    __slots__ = (
        "burst",
        "burst_rounds",
        "burst_start",
        "burst_tokens",
        "last",
        "off",
        "rec",
        "sid",
        "tid",
    )

    def __init__(self, rec: SessionRecord) -> None:
        self.rec = rec
        self.tid = rec.trace_id
        self.sid = rec.span_id
        self.off = rec.anchor_ns_epoch - rec.anchor_ns_mono
        self.last = rec.start_ns_mono
        #: The burst whose rounds are arriving but whose record has not (-1: none).
        self.burst = -1
        self.burst_start = 0
        self.burst_rounds = 0
        self.burst_tokens = 0


class SpanBuilder:
    """Turns the record stream of any number of interleaved sessions into span tuples.

    Not thread-safe: one consumer (the export worker, or the agent) feeds it in order.
    ``max_open`` bounds the sessions kept waiting for their end record (a dropped
    ``SessionEndRecord`` must not leak); the oldest is then flushed as unfinished.
    """

    __slots__ = ("_open", "bad_records", "max_open", "orphans", "round_spans")

    def __init__(self, round_spans: int = 256, *, max_open: int = 4096) -> None:
        self.round_spans = round_spans
        self.max_open = max_open
        self._open: dict[int, _Session] = {}
        #: Records whose SessionRecord never arrived (dropped upstream); skipped.
        self.orphans = 0
        #: Records that raised while being turned into spans; skipped.
        self.bad_records = 0

    @property
    def open_sessions(self) -> int:
        return len(self._open)

    def add(self, records: Iterable[object], out: list[Span]) -> None:
        """Append the spans ``records`` complete to ``out``. A record that cannot be turned
        into spans (malformed, e.g. rebuilt from damaged legacy lines) is skipped and
        counted in ``bad_records``; the others still go out."""
        sessions = self._open
        cap = self.round_spans
        for rec in records:
            t = type(rec)
            try:
                if t is RoundRecord:
                    s = sessions.get(rec.session)  # type: ignore[attr-defined]
                    if s is None:
                        self.orphans += 1
                        continue
                    self._round(s, rec, cap, out)  # type: ignore[arg-type]
                elif t is BurstRecord:
                    s = sessions.get(rec.session)  # type: ignore[attr-defined]
                    if s is None:
                        self.orphans += 1
                        continue
                    self._burst(s, rec, cap, out)  # type: ignore[arg-type]
                elif t is SessionRecord:
                    if rec.span_id == 0:  # type: ignore[attr-defined]
                        self.orphans += 1  # no ids: the observer had no trace sink
                        continue
                    if len(sessions) >= self.max_open:
                        oldest = next(iter(sessions))
                        self._unfinished(sessions.pop(oldest), out)
                    sessions[rec.session] = _Session(rec)  # type: ignore[attr-defined,arg-type]
                elif t is SessionEndRecord:
                    s = sessions.pop(rec.session, None)  # type: ignore[attr-defined]
                    if s is None:
                        self.orphans += 1
                        continue
                    self._end(s, rec, out)  # type: ignore[arg-type]
                elif t is FirstTokenRecord:
                    s = sessions.get(rec.session)  # type: ignore[attr-defined]
                    if s is None:
                        self.orphans += 1
                        continue
                    self._first_token(s, rec, out)  # type: ignore[arg-type]
                # other records (ProfRows/ProfSummary) carry nothing a span needs
            except Exception:
                self.bad_records += 1

    def finish_open(self, out: list[Span]) -> int:
        """Close every session still open (process exit): end = the last stamp seen, status
        unset, ``memra.spec.unfinished = true``. Returns how many there were."""
        n = len(self._open)
        for s in self._open.values():
            self._unfinished(s, out)
        self._open.clear()
        return n

    def forget_open(self) -> int:
        """Drop every open session without publishing it (the agent hands them to the next
        agent, which ends them). Returns how many there were."""
        n = len(self._open)
        self._open.clear()
        return n

    # -- per record ----------------------------------------------------------------------

    def _round(self, s: _Session, rec: RoundRecord, cap: int, out: list[Span]) -> None:
        rep = rec.repeat
        b = rec.burst
        j = rec.j
        if b != s.burst:
            s.burst = b
            s.burst_start = rec.t_ns_mono[0]
            s.burst_rounds = 0
            s.burst_tokens = 0
        s.burst_rounds += rep
        s.burst_tokens += (j + 1 if j >= 0 else 1) * rep  # j = -1: unknown; the bonus token
        t = rec.t_ns_mono
        wall = t[5] - t[0]
        s.last = t[5] + (rep - 1) * wall
        # A run of equal rounds (the tail's burst means) gets a span per round, up to the cap.
        for i in range(min(rep, cap - rec.index)):
            tt = t if i == 0 else tuple(x + i * wall for x in t)
            self._round_spans(s, rec, rec.index + i, tt, out)  # type: ignore[arg-type]

    def _round_spans(
        self, s: _Session, rec: RoundRecord, idx: int, t: tuple[int, ...], out: list[Span]
    ) -> None:
        t0, t1, t2, t3, t4, t5 = t
        b = rec.burst
        j = rec.j
        sid = s.sid
        tid = s.tid
        off = s.off
        g = 8 * idx * _GAMMA  # ids n = 8*idx + kind: g + kind*GAMMA (one multiply a round)
        rid = (sid ^ ((g + _G[2]) & _M64)) or 1
        bid = (sid ^ (((8 * b + 1) * _GAMMA) & _M64)) or 1
        e0 = t0 + off
        e1 = t1 + off
        e2 = t2 + off
        e3 = t3 + off
        e4 = t4 + off
        e5 = t5 + off
        k = rec.k
        out.append(
            (
                ROUND_SPAN,
                tid,
                rid,
                bid,
                e0,
                e5,
                (
                    (A_ROUND, idx),
                    (A_K, k),
                    (A_J, j),
                    (A_CTX, rec.ctx),
                    (A_SEQ_ROWS, rec.seq_rows),
                    (A_ACCEPT_RATE, j / k if k else 0.0),
                    (A_TOKENS, j + 1),
                    (A_WALL_NS, t5 - t0),
                )
                if k >= 0
                # k = j = -1: the counts are unknown (a round rebuilt from a phase line
                # alone): no k, j, acceptance, tokens, ctx or seq_rows rather than zeros
                else ((A_ROUND, idx), (A_WALL_NS, t5 - t0)),
                None,
            )
        )
        split = rec.split_ns
        out.append(("spec.draft", tid, (sid ^ ((g + _G[3]) & _M64)) or 1, rid, e0, e1, (), None))
        out.append(
            (
                "spec.verify",
                tid,
                (sid ^ ((g + _G[4]) & _M64)) or 1,
                rid,
                e1,
                e2,
                () if split is None else _split_attrs(t2 - t1, split),
                None,
            )
        )
        out.append(("spec.accept", tid, (sid ^ ((g + _G[5]) & _M64)) or 1, rid, e2, e3, (), None))
        out.append(("spec.rollback", tid, (sid ^ ((g + _G[6]) & _M64)) or 1, rid, e3, e4, (), None))
        out.append(("spec.maint", tid, (sid ^ ((g + _G[7]) & _M64)) or 1, rid, e4, e5, (), None))

    def _burst(self, s: _Session, rec: BurstRecord, cap: int, out: list[Span]) -> None:
        if rec.end_ns_mono > s.last:
            s.last = rec.end_ns_mono
        if s.burst == rec.index:
            s.burst = -1
        ph = rec.phases
        n = ph.rounds
        first = rec.first_round
        unsampled = first + n - (cap if cap > first else first)
        attrs: tuple[tuple[str, Any], ...] = (
            (A_BURST, rec.index),
            (A_ROUNDS, n),
            (A_K, rec.k),
            (A_FAMILY, s.rec.family),
            (A_TOKENS, rec.tokens),
            (A_FIRST_ROUND, first),
            (A_UNSAMPLED, unsampled if unsampled > 0 else 0),
            (A_PHASE_NS[0], ph.draft),
            (A_PHASE_NS[1], ph.verify),
            (A_PHASE_NS[2], ph.accept),
            (A_PHASE_NS[3], ph.roll),
            (A_PHASE_NS[4], ph.maint),
            (A_HOOK_NS, rec.hook_ns),
        )
        if rec.split_ns is not None:
            attrs += _split_attrs(ph.verify, rec.split_ns)
        off = s.off
        out.append(
            (
                BURST_SPAN,
                s.tid,
                burst_span_id(s.sid, rec.index),
                s.sid,
                rec.start_ns_mono + off,
                rec.end_ns_mono + off,
                attrs,
                None,
            )
        )

    def _first_token(self, s: _Session, rec: FirstTokenRecord, out: list[Span]) -> None:
        prof = rec.prof
        attrs: list[tuple[str, Any]] = []
        for name in FIRST_TOKEN_FIELDS:
            v = getattr(prof, name)
            if isinstance(v, list):
                attrs.append((A_FT + name, tuple(mb for _, mb in v)))
                attrs.append((A_FT + name + "_devices", tuple(dev for dev, _ in v)))
            else:
                attrs.append((A_FT + name, v))
        attrs.append((A_FT_TOTAL, prof.total_ms()))
        iv = [x for x in rec.intervals if x[2] > x[1] or x[0] == "first_burst"]
        fb = next((x for x in iv if x[0] == "first_burst"), None)
        sid, tid, off = s.sid, s.tid, s.off
        ft_id = derived_span_id(sid, 8 * _FT_SPAN)
        fb_id = derived_span_id(sid, 8 * _FT_BURST)
        start = min((x[1] for x in iv), default=s.rec.start_ns_mono)
        end = max((x[2] for x in iv), default=s.last)
        if end > s.last:
            s.last = end
        out.append((FIRST_TOKEN_SPAN, tid, ft_id, sid, start + off, end + off, tuple(attrs), None))
        for i, (name, a, b) in enumerate(iv):
            if name == "first_burst":
                out.append(
                    (
                        "spec.first_token.first_burst",
                        tid,
                        fb_id,
                        ft_id,
                        a + off,
                        b + off,
                        ((A_FT + "first_burst_ms", prof.first_burst_ms),),
                        None,
                    )
                )
                continue
            inside = fb is not None and a >= fb[1] and b <= fb[2]
            out.append(
                (
                    "spec.first_token." + name,
                    tid,
                    derived_span_id(sid, 8 * (_FT_BUCKET0 + i)),
                    fb_id if inside else ft_id,
                    a + off,
                    b + off,
                    ((A_FT + name + "_ms", (b - a) / 1e6),),
                    None,
                )
            )

    def _end(self, s: _Session, rec: SessionEndRecord, out: list[Span]) -> None:
        if s.burst >= 0:  # a burst whose record never came: close it so rounds have a parent
            self._open_burst(s, out)
        r = s.rec
        attrs: tuple[tuple[str, Any], ...] = (
            (A_SESSION, r.session),
            (A_FAMILY, r.family),
            (A_WORKER, r.worker),
            (A_LEVEL, r.level),
            (A_PROF, r.prof),
            (A_ROUNDS, rec.rounds),
            (A_BURSTS, rec.bursts),
            (A_TOKENS, rec.tokens),
            (A_OUTPUT_TOKENS, rec.tokens),
        )
        status = None
        if rec.error:
            attrs += ((A_ERROR_TYPE, rec.error),)
            status = (STATUS_ERROR, rec.error)
        end = rec.end_ns_mono if rec.end_ns_mono > s.last else s.last
        out.append(
            (
                SESSION_SPAN,
                s.tid,
                s.sid,
                r.parent_span_id,
                r.start_ns_mono + s.off,
                end + s.off,
                attrs,
                status,
            )
        )

    def _unfinished(self, s: _Session, out: list[Span]) -> None:
        if s.burst >= 0:
            self._open_burst(s, out)
        r = s.rec
        out.append(
            (
                SESSION_SPAN,
                s.tid,
                s.sid,
                r.parent_span_id,
                r.start_ns_mono + s.off,
                s.last + s.off,
                (
                    (A_SESSION, r.session),
                    (A_FAMILY, r.family),
                    (A_WORKER, r.worker),
                    (A_LEVEL, r.level),
                    (A_PROF, r.prof),
                    (A_UNFINISHED, True),
                ),
                None,
            )
        )

    def _open_burst(self, s: _Session, out: list[Span]) -> None:
        b = s.burst
        s.burst = -1
        out.append(
            (
                BURST_SPAN,
                s.tid,
                burst_span_id(s.sid, b),
                s.sid,
                s.burst_start + s.off,
                s.last + s.off,
                (
                    (A_BURST, b),
                    (A_ROUNDS, s.burst_rounds),
                    (A_FAMILY, s.rec.family),
                    (A_TOKENS, s.burst_tokens),
                    (A_UNFINISHED, True),
                ),
                None,
            )
        )
