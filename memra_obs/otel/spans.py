"""Records -> plain span tuples: the tree of DESIGN §4, built on the export worker's thread.

Times are the records' stamps moved to epoch ns, never "now". Ids below the session are
``session_span_id XOR (n * GAMMA)`` (splitmix64's Weyl step, a bijection: no collisions, one
multiply) for ``n = 8 * index + kind``, so a round's span can be named from outside
(:func:`round_span_id`, for exemplars). Goal (DESIGN §9): :mod:`.otlp`'s (no SDK span object).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Iterable
from typing import Any

from ..diagnostics import say_once
from ..records import FIRST_TOKEN_FIELDS, U64_MAX
from ..timeline import (
    MAX_OPEN,
    BurstRecord,
    FirstTokenRecord,
    PriorRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

#: (name, trace_id, span_id, parent_span_id, start_ns_epoch, end_ns_epoch, (key, value) pairs,
#: None or (status code, message)); plain tuples, as they are built on a hot path.
Span = tuple[str, int, int, int, int, int, tuple[tuple[str, Any], ...], "tuple[int, str] | None"]

STATUS_ERROR = 2
#: spec.burst spans a session keeps whose rounds have no span (past the round cap).
MAX_BURST_SPANS = 256
_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
# Kinds: 0 the first-token family (index >= 1, so n is never 0), 1 burst, 2 round, 3-7 phases.
_G = tuple(k * _GAMMA for k in range(8))
#: The phase spans of a round, in order (the seed's five phases).
PHASE_SPAN_NAMES = ("spec.draft", "spec.verify", "spec.accept", "spec.rollback", "spec.maint")
_BURST, _FT, _TOKENS = "spec.burst", "memra.spec.first_token.", "memra.spec.tokens"


def _keys(names: str, prefix: str = "memra.spec.") -> tuple[str, ...]:
    return tuple(prefix + n for n in names.split())


_SPLIT = _keys("kda_ns kda_scan_ns mla_ns rest_ns ffn_ns", "memra.spec.verify.")
_SESSION_KEYS = _keys("session family worker trace_level prof")
_ENDED_KEYS = (*_keys("rounds bursts tokens"), "gen_ai.usage.output_tokens")
_OPEN_KEYS = _keys("burst rounds family tokens first_round rounds_unsampled unfinished")
_BURST_KEYS = _keys("burst rounds k family tokens first_round rounds_unsampled draft_ns verify_ns")
_BURST_KEYS += _keys("accept_ns rollback_ns maint_ns hook_ns")
_IV = ("expected_tokens_per_round", "tokens_per_second", "estimated_speedup")  # with _lo, _hi
_ADVICE_KEYS = _keys("estimate clock rounds current_k recommended_k", "memra.spec.advice.")
_ADVICE_KEYS += tuple(f"memra.spec.advice.{n}{x}" for n in _IV for x in ("", "_lo", "_hi"))
_ADVICE_KEYS += _keys("plain_step_ms plain_step_source", "memra.spec.advice.")


def derived_span_id(session_span_id: int, n: int) -> int:
    """Span id number ``n`` (>= 1) of the session whose ``spec.session`` id is given."""
    return (session_span_id ^ ((n * _GAMMA) & _M64)) or 1


def burst_span_id(session_span_id: int, burst: int) -> int:
    """The ``spec.burst`` span id of burst ``burst`` (0-based) of a session."""
    return derived_span_id(session_span_id, 8 * burst + 1)


def round_span_id(session_span_id: int, round_index: int) -> int:
    """The ``spec.round`` span id of round ``round_index`` (0-based, per session)."""
    return derived_span_id(session_span_id, 8 * round_index + 2)


def round_span_ids(cap: int) -> Callable[[SessionRecord, RoundRecord], int] | None:
    """The Prometheus exporter's hook: a round's exemplar names its span (0 past ``cap``)."""
    if cap <= 0:
        return None
    return lambda s, r: round_span_id(s.span_id, r.index) if r.index < cap else 0


def _split_attrs(verify_ns: int, split: tuple[int, int, int, int]) -> tuple[tuple[str, Any], ...]:
    kda, scan, mla, ffn = split
    rest = verify_ns - ((kda + mla) & U64_MAX)  # saturating_sub of a wrapping sum, as the line
    k0, k1, k2, k3, k4 = _SPLIT
    return ((k0, kda), (k1, scan), (k2, mla), (k3, rest if rest > 0 else 0), (k4, ffn))


def _widen(t: tuple[int, ...]) -> tuple[int, ...]:
    """A round's span boundaries with every phase >= 1 ns, taken from its longest phase (the event
    clock charges host work hidden under the device's tail nothing, and Jaeger flags an empty span
    "Negative duration detected"); its start and end stay, and all of them if it is too short."""
    w = [b - a for a, b in itertools.pairwise(t)]
    zeros, m = w.count(0), w.index(max(w))
    if w[m] <= zeros:
        return t
    w = [x or 1 for x in w]
    w[m] -= zeros
    return tuple(itertools.accumulate(w, initial=t[0]))


class _Session:
    """Per open session; ``burst``: the burst whose rounds came but whose record has not (-1)."""

    __slots__ = (
        "b_first", "b_rounds", "b_skipped", "b_start", "b_tokens", "burst", "guessed", "js", "k",
        "ks", "last", "off", "ph", "rec", "sid", "tid",
    )  # fmt: skip

    def __init__(self, rec: SessionRecord) -> None:
        self.rec, self.tid, self.sid = rec, rec.trace_id, rec.span_id
        self.off = rec.anchor_ns_epoch - rec.anchor_ns_mono
        self.last = rec.start_ns_mono
        self.burst, self.b_start, self.b_rounds, self.b_tokens = -1, 0, 0, 0
        self.b_first = self.b_skipped = 0
        self.guessed = False  # a round of unknown counts (the tail's): its tokens a lower bound
        #: The per-request record's inputs: (k, j) of each drafting round, phase totals, and
        #: the largest burst k (the configured draft length).
        self.ks, self.js, self.ph, self.k = array("H"), array("H"), [0, 0, 0, 0, 0], 0


class SpanBuilder:
    """Records of interleaved sessions, fed in order, to span tuples; rounds past ``round_spans``
    get none. At most ``max_open`` sessions stay open (a lost end must not leak: the oldest
    closes unfinished, said once). Skipped, counted: ``orphans`` (no SessionRecord came) and
    ``bad_records`` (they raised)."""

    __slots__ = ("_open", "bad_records", "max_open", "orphans", "round_spans")

    def __init__(self, round_spans: int = 256, *, max_open: int = MAX_OPEN) -> None:
        self.round_spans, self.max_open = round_spans, max_open
        self._open: dict[int, _Session] = {}
        self.orphans = self.bad_records = 0

    def add(self, records: Iterable[Any], out: list[Span]) -> None:
        """Append the spans ``records`` complete to ``out``."""
        sessions = self._open
        for rec in records:
            t = type(rec)
            try:
                if t is SessionRecord:
                    if rec.span_id == 0:  # no ids: no trace sink, or an unsampled caller
                        self.orphans += 1
                        continue
                    if len(sessions) >= self.max_open:
                        self._close(sessions.pop(next(iter(sessions))), None, out)
                        say_once("spans-open", f"spans: over {self.max_open} sessions open at "
                                 "once; the oldest is closed unfinished and what it records "
                                 "later makes no spans")  # fmt: skip
                    sessions[rec.session] = _Session(rec)
                    continue
                do = _BY_TYPE.get(t)
                if do is None:
                    continue  # ProfRows/ProfSummary carry nothing a span needs
                get = sessions.pop if t is SessionEndRecord else sessions.get
                s = get(rec.session, None)
                if s is None:
                    self.orphans += 1
                else:
                    do(self, s, rec, out)
            except Exception:
                self.bad_records += 1

    def finish_open(self, out: list[Span]) -> int:
        """Close every open session (process exit) as unfinished; returns how many."""
        for s in self._open.values():
            self._close(s, None, out)
        return self.forget_open()

    def forget_open(self) -> int:
        """Drop every open session unpublished (the agent hands them to the next one)."""
        n = len(self._open)
        self._open.clear()
        return n

    def _round(self, s: _Session, rec: RoundRecord, out: list[Span]) -> None:
        rep, b, j, k, t = rec.repeat, rec.burst, rec.j, rec.k, rec.t_ns_mono
        t0, t1, t2, t3, t4, t5 = t
        if b != s.burst:
            s.burst = b
            s.b_start, s.b_rounds, s.b_tokens, s.b_first = t0, 0, 0, rec.index
        s.b_rounds += rep
        s.b_tokens += (j + 1 if j >= 0 else 1) * rep  # j = -1: unknown; the bonus token
        s.guessed |= j < 0
        wall = t5 - t0
        s.last = t5 + (rep - 1) * wall
        if k > 0:
            s.ks.extend((k,) * rep)
            s.js.extend((j,) * rep)
        ph = s.ph
        for i in range(5):
            ph[i] += (t[i + 1] - t[i]) * rep
        sid, tid = s.sid, s.tid
        bid = (sid ^ (((8 * b + 1) * _GAMMA) & _M64)) or 1
        split = () if rec.split_ns is None else _split_attrs(t2 - t1, rec.split_ns)
        if not t0 < t1 < t2 < t3 < t4 < t5:  # a phase that took no time (the event clock)
            t0, t1, t2, t3, t4, t5 = _widen(t)
        # A run of equal rounds (the tail's burst means) gets a span per round, up to the cap.
        for i in range(min(rep, self.round_spans - rec.index)):
            idx, d = rec.index + i, s.off + i * wall
            g = 8 * idx * _GAMMA  # ids n = 8*idx + kind: g + kind*GAMMA (one multiply a round)
            rid = (sid ^ ((g + _G[2]) & _M64)) or 1
            e0, e1, e2, e3, e4, e5 = t0 + d, t1 + d, t2 + d, t3 + d, t4 + d, t5 + d
            if k >= 0:
                attrs: tuple[tuple[str, Any], ...] = (
                    ("memra.spec.round", idx),
                    ("memra.spec.k", k),
                    ("memra.spec.j", j),
                    ("memra.spec.accepted", j),  # DESIGN §4's name for j (drafts accepted)
                    ("memra.spec.ctx", rec.ctx),
                    ("memra.spec.seq_rows", rec.seq_rows),
                    ("memra.spec.acceptance_rate", j / k if k else 0.0),
                    (_TOKENS, j + 1),
                    ("memra.spec.wall_ns", wall),
                )
            else:  # k = j = -1: counts unknown (a round rebuilt from a phase line): no zeros
                attrs = (("memra.spec.round", idx), ("memra.spec.wall_ns", wall))
            out += (
                ("spec.round", tid, rid, bid, e0, e5, attrs, None),
                ("spec.draft", tid, (sid ^ ((g + _G[3]) & _M64)) or 1, rid, e0, e1, (), None),
                ("spec.verify", tid, (sid ^ ((g + _G[4]) & _M64)) or 1, rid, e1, e2, split, None),
                ("spec.accept", tid, (sid ^ ((g + _G[5]) & _M64)) or 1, rid, e2, e3, (), None),
                ("spec.rollback", tid, (sid ^ ((g + _G[6]) & _M64)) or 1, rid, e3, e4, (), None),
                ("spec.maint", tid, (sid ^ ((g + _G[7]) & _M64)) or 1, rid, e4, e5, (), None),
            )

    def _burst(self, s: _Session, rec: BurstRecord, out: list[Span]) -> None:
        s.last, s.k = max(s.last, rec.end_ns_mono), max(s.k, rec.k)
        if s.burst == rec.index:
            s.burst = -1
        ph, first = rec.phases, rec.first_round
        if self._unsampled_burst(rec.index, first):
            s.b_skipped += 1
            return
        u = self._unsampled_rounds(first, ph.rounds)
        v: tuple[Any, ...] = (rec.index, ph.rounds, rec.k, s.rec.family, rec.tokens, first, u)
        v += (*ph.phases(), rec.hook_ns)
        attrs: tuple[tuple[str, Any], ...] = tuple(zip(_BURST_KEYS, v, strict=True))
        if rec.split_ns is not None:
            attrs += _split_attrs(ph.verify, rec.split_ns)
        start, end = rec.start_ns_mono + s.off, rec.end_ns_mono + s.off
        out.append((_BURST, s.tid, burst_span_id(s.sid, rec.index), s.sid, start, end, attrs, None))

    def _unsampled_burst(self, index: int, first_round: int) -> bool:
        """Past ``MAX_BURST_SPANS`` a burst with no round span under it gets no span either: a
        loop that returns after every round made a burst span per round, without bound."""
        return index >= MAX_BURST_SPANS and first_round >= self.round_spans

    def _unsampled_rounds(self, first_round: int, rounds: int) -> int:
        """A burst's rounds past the round cap (``memra.spec.rounds_unsampled``)."""
        return max(first_round + rounds - max(self.round_spans, first_round), 0)

    def _first_token(self, s: _Session, rec: FirstTokenRecord, out: list[Span]) -> None:
        prof = rec.prof
        attrs: list[tuple[str, Any]] = []
        for name in FIRST_TOKEN_FIELDS:
            v = getattr(prof, name)
            if isinstance(v, list):  # free MB per device: values and CUDA ordinals
                attrs.append((_FT + name, tuple(mb for _, mb in v)))
                attrs.append((_FT + name + "_devices", tuple(dev for dev, _ in v)))
            else:
                attrs.append((_FT + name, v))
        attrs.append((_FT + "total_ms", prof.total_ms()))
        iv = [x for x in rec.intervals if x[2] > x[1] or x[0] == "first_burst"]
        fb = next((x for x in iv if x[0] == "first_burst"), None)
        sid, tid, off = s.sid, s.tid, s.off
        ft_id, fb_id = derived_span_id(sid, 8), derived_span_id(sid, 16)
        start = min([s.rec.start_ns_mono, *(x[1] for x in iv)])  # its wall: total_ms
        end = max((x[2] for x in iv), default=s.last)
        s.last = max(s.last, end)
        fa = tuple(attrs)
        out.append(("spec.first_token", tid, ft_id, sid, start + off, end + off, fa, None))
        for i, (name, a, b) in enumerate(iv):
            if name == "first_burst":
                kid, parent, v = fb_id, ft_id, prof.first_burst_ms
            else:  # a round-1 bucket sits under first_burst
                kid, v = derived_span_id(sid, 8 * (3 + i)), (b - a) / 1e6
                parent = fb_id if fb is not None and a >= fb[1] and b <= fb[2] else ft_id
            ka = ((f"{_FT}{name}_ms", v),)
            out.append(("spec.first_token." + name, tid, kid, parent, a + off, b + off, ka, None))

    def _close(self, s: _Session, rec: SessionEndRecord | None, out: list[Span]) -> None:
        """The session span from its end record, or (``rec`` None) unfinished at the last
        stamp seen; first a burst whose record never came, so its rounds have a parent."""
        off = s.off
        if s.burst >= 0 and self._unsampled_burst(s.burst, s.b_first):
            s.burst, s.b_skipped = -1, s.b_skipped + 1
        if s.burst >= 0:
            b, s.burst = s.burst, -1
            u = self._unsampled_rounds(s.b_first, s.b_rounds)
            bv = (b, s.b_rounds, s.rec.family, s.b_tokens, s.b_first, u, True)
            ba = tuple(zip(_OPEN_KEYS, bv, strict=True))
            bid = burst_span_id(s.sid, b)
            out.append((_BURST, s.tid, bid, s.sid, s.b_start + off, s.last + off, ba, None))
        r = s.rec
        vals = (r.session, r.family, r.worker, r.level, r.prof)
        attrs: tuple[tuple[str, Any], ...] = tuple(zip(_SESSION_KEYS, vals, strict=True))
        status, end = None, max(s.last, r.start_ns_mono + 1)  # Jaeger: end == start "negative"
        if s.b_skipped:
            attrs += (("memra.spec.bursts_unsampled", s.b_skipped),)
        attrs += _request_attrs(s)  # unfinished: what it did up to its last stamp
        if rec is None:
            attrs += (("memra.spec.unfinished", True),)
        else:
            ended = (rec.rounds, rec.bursts, rec.tokens, rec.tokens)
            attrs += tuple(zip(_ENDED_KEYS[: 3 if s.guessed else 4], ended, strict=False))  # no
            # gen_ai.usage.output_tokens that is a lower bound: dashboards would sum it as exact
            if rec.error:
                attrs += (("error.type", rec.error.partition(": ")[0]),)
                status = (STATUS_ERROR, rec.error)
            end = max(end, rec.end_ns_mono)
            attrs += _advice_attrs(rec.advice) if rec.advice else ()
        start, end = r.start_ns_mono + off, end + off
        out.append(("spec.session", s.tid, s.sid, r.parent_span_id, start, end, attrs, status))


def _request_attrs(s: _Session) -> tuple[tuple[str, Any], ...]:
    """The per-request record (``Session.spec_decode()``'s values) as ``memra.spec.request.*``."""
    from ..requests import request_record

    out = []
    for key, v in request_record(s.ks, s.js, s.ph, False, s.k, s.guessed).items():
        if v is None:  # no known counts: no acceptance (an attribute cannot be null)
            continue
        if key == "phase_ms":
            out += [(f"memra.spec.request.{p}_ms", ms) for p, ms in v.items()]
        else:
            out.append((f"memra.spec.request.{key}", tuple(v) if isinstance(v, list) else v))
    return tuple(out)


def _advice_attrs(line: str) -> tuple[tuple[str, Any], ...]:
    """The session's ``[spec-advice]`` line as ``memra.spec.advice.*``; none if unparsable."""
    from ..legacy import AdviceLine, parse_line

    try:
        a = parse_line(line)
    except ValueError:
        a = None
    if not isinstance(a, AdviceLine):
        say_once("otel.advice", f"session advice not set on its span: {line[:120]!r}")
        return ()
    vals: tuple[Any, ...] = (True, a.clock, a.rounds, a.k_now, a.k_rec, *a.tokens_per_round)
    vals += (*a.tokens_per_s, *a.speedup, a.plain_step_ms, a.plain_source)
    return tuple(zip(_ADVICE_KEYS, vals, strict=True))


def _prior(self: SpanBuilder, s: _Session, rec: PriorRecord, out: list[Span]) -> None:
    """Agent mode: the rounds an earlier agent published, for ``memra.spec.request.*`` only."""
    s.ks.extend(rec.ks)
    s.js.extend(rec.js)
    s.ph = [t + ns for t, ns in zip(s.ph, rec.phases_ns, strict=True)]
    s.k = max(s.k, rec.k)


_BY_TYPE: dict[type, Callable[[SpanBuilder, _Session, Any, list[Span]], None]] = {
    PriorRecord: _prior,
    RoundRecord: SpanBuilder._round,
    BurstRecord: SpanBuilder._burst,
    FirstTokenRecord: SpanBuilder._first_token,
    SessionEndRecord: SpanBuilder._close,
}
