"""The legacy tagged stderr lines: formatted byte for byte as the Rust worker prints them,
and parsed back.

Three formats are the seed's ``eprintln!`` strings (the per-burst phase line, the level-2
verify line, the round-log summary); every number is computed with the seed's operations in
the seed's order, so the same f64 reaches the same ``{:.N}`` and the bytes agree. Two formats
the seed leaves open are defined here once (see the README's "Legacy lines"):

``[spec-prof] <field>=<value> ...``
    every field of :class:`SpecFirstTokenProf`, in declaration order. ms/MB values are the
    shortest decimal that reads back to the same f64, always positional (``0.00005``, never
    ``5e-05``); counts are integers; the arm is a bare word (empty when none ran); free-memory
    lists are ``[ordinal:free_mb,...]`` (``[]`` when none was taken).
``[spec-prof-rounds] row=<i> wall_ms=... draft_ms=... verify_ms=... accept_ms=... rest_ms=... k=.. j=.. ctx=.. seq_rows=..``
    one line per :class:`SpecRoundProf` row, ``row`` its index in the session's log; ms values
    are the shortest decimal that reads back to the same f32.

``parse_line`` turns any of these back into a record; ``format_line(parse_line(l)) == l``
for every line this module writes.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TextIO

from .flags import override_line, spec_trace_level
from .linewriter import LineWriter, stderr_writer
from .records import (
    FIRST_TOKEN_FIELDS,
    FIRST_TOKEN_MS_FIELDS,
    U16_MAX,
    U32_MAX,
    U64_MAX,
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundProf,
    SpecRoundsLog,
    VerifySplit,
)

__all__ = [
    "OVERRIDE",
    "PHASE",
    "PROF",
    "PROF_ROUNDS",
    "PROF_ROUNDS_TAG",
    "PROF_SUMMARY",
    "PROF_SUMMARY_TAG",
    "PROF_TAG",
    "VERIFY",
    "FirstTokenLine",
    "LegacyLine",
    "LegacyParseError",
    "OverrideLine",
    "PhaseLine",
    "RoundsLine",
    "SummaryLine",
    "VerifyLine",
    "emit",
    "format_line",
    "parse_line",
    "phase_lines",
    "prof_line",
    "prof_rounds_lines",
    "prof_summary_line",
    "round_prof",
    "scan_line",
]

_F32_PACK = struct.Struct("<f").pack
_F32_UNPACK = struct.Struct("<f").unpack

PROF_TAG = "spec-prof"
PROF_ROUNDS_TAG = "spec-prof-rounds"
PROF_SUMMARY_TAG = "spec-prof-summary"
TRACE_TAG = "spec-trace"


# ------------------------------------------------------------------------------ numbers


def _positional(s: str) -> str:
    if "e" in s or "E" in s:
        s = format(Decimal(s), "f")
    if "." not in s:
        s += ".0"
    return s


def exact_f64(x: float) -> str:
    """Shortest decimal that reads back to the same double, without an exponent."""
    return _positional(repr(float(x)))


def exact_f32(x: float) -> str:
    """A short decimal (the shortest, but for rare binade edges) that reads back to the same
    f32, without an exponent. Per-round ms values mostly need 7 digits: try 7 and 6, then
    bisect (round-tripping is monotonic in the digit count)."""
    s = f"{x:.7g}"
    if _f32_of(s) == x:
        t = f"{x:.6g}"
        if _f32_of(t) == x:
            lo, hi, s = 1, 6, t  # the answer is in lo..hi; s holds hi's digits
            while lo < hi:
                mid = (lo + hi) // 2
                t = f"{x:.{mid}g}"
                if _f32_of(t) == x:
                    hi, s = mid, t
                else:
                    lo = mid + 1
    else:
        s = f"{x:.8g}"
        if _f32_of(s) != x:
            s = f"{x:.9g}"  # 9 significant digits always identify an f32
    if "e" in s or "." not in s:
        return _positional(s)
    return s


def _f32_of(s: str) -> float:
    return _F32_UNPACK(_F32_PACK(float(s)))[0]


# ------------------------------------------------------------------------------ writers


def phase_lines(
    p: SpecPhaseNs,
    tag: str,
    tag_v: str,
    k: int,
    level: int = 1,
    split: VerifySplit | None = None,
) -> list[str]:
    """The per-burst line under ``tag`` and, at ``level >= 2``, the verify sub-split line
    under ``tag_v``; ``[]`` when the burst ran no rounds.

    Like the seed, the level-2 line drains ``split`` (reads and zeroes it); ``None`` stands
    for a split that recorded nothing.
    """
    if p.rounds == 0:
        return []
    rounds = float(p.rounds)

    def ms(ns: int) -> float:
        return float(ns) / 1e6

    def per(ns: int) -> float:
        return float(ns) / 1e6 / rounds

    total = p.total()
    out = [
        f"[{tag}] rounds={p.rounds} k={k} total={ms(total):.2f}ms | "
        f"draft={ms(p.draft):.2f} verify={ms(p.verify):.2f} accept={ms(p.accept):.2f} "
        f"roll={ms(p.roll):.2f} maint={ms(p.maint):.2f} | per-round ms: "
        f"draft={per(p.draft):.3f} verify={per(p.verify):.3f} accept={per(p.accept):.3f} "
        f"roll={per(p.roll):.3f} maint={per(p.maint):.3f} total={per(total):.3f}"
    ]
    if level >= 2:
        vkda, scan, vmla, vffn = split.drain() if split is not None else (0, 0, 0, 0)
        vrest = max(p.verify - ((vkda + vmla) & U64_MAX), 0)  # u64 saturating_sub
        out.append(
            f"[{tag_v}] rounds={p.rounds} k={k} | per-round ms: vkda={per(vkda):.3f} "
            f"(scan={per(scan):.3f}) vmla={per(vmla):.3f} vrest={per(vrest):.3f} "
            f"(vffn={per(vffn):.3f})"
        )
    return out


def _fmt_free(v: Sequence[tuple[int, int]]) -> str:
    return "[" + ",".join(f"{o}:{mb}" for o, mb in v) + "]"


_FT_FLOAT = frozenset((*FIRST_TOKEN_MS_FIELDS, "draft_kv_mb"))
_FT_FREE = frozenset(("free_mb_before", "free_mb_after"))


def prof_line(prof: SpecFirstTokenProf) -> str:
    """The ``[spec-prof]`` line: every field of the first-token profile, exact."""
    parts = [f"[{PROF_TAG}]"]
    for name in FIRST_TOKEN_FIELDS:
        v = getattr(prof, name)
        if name in _FT_FLOAT:
            parts.append(f"{name}={exact_f64(v)}")
        elif name in _FT_FREE:
            parts.append(f"{name}={_fmt_free(v)}")
        else:
            parts.append(f"{name}={v}")
    return " ".join(parts)


def prof_rounds_lines(rows: Sequence[SpecRoundProf], start: int = 0) -> list[str]:
    """One ``[spec-prof-rounds]`` line per row; ``start`` is the first row's log index."""
    out = []
    for i, r in enumerate(rows, start):
        out.append(
            f"[{PROF_ROUNDS_TAG}] row={i} wall_ms={exact_f32(r.wall_ms)} "
            f"draft_ms={exact_f32(r.draft_ms)} verify_ms={exact_f32(r.verify_ms)} "
            f"accept_ms={exact_f32(r.accept_ms)} rest_ms={exact_f32(r.rest_ms)} "
            f"k={r.k} j={r.j} ctx={r.ctx} seq_rows={r.seq_rows}"
        )
    return out


def prof_summary_line(log: SpecRoundsLog) -> str:
    return f"[{PROF_SUMMARY_TAG}] {log.summary()}"


def emit(
    p: SpecPhaseNs,
    tag: str,
    tag_v: str,
    k: int,
    *,
    level: int | None = None,
    split: VerifySplit | None = None,
    out: TextIO | LineWriter | None = None,
) -> None:
    """The seed's ``SpecPhaseNs::emit``: the burst's lines to stderr, never raising.

    ``level`` defaults to the process trace level; ``split`` to the process-wide level-2
    accumulators (:data:`memra_obs.VERIFY_SPLIT`), drained here as the seed drains its atomics.
    """
    try:
        lvl = spec_trace_level() if level is None else level
        if split is None and lvl >= 2:
            from . import VERIFY_SPLIT as split  # the process-wide accumulators
        lines = phase_lines(p, tag, tag_v, k, lvl, split)
        writer = (
            out
            if isinstance(out, LineWriter)
            else (stderr_writer() if out is None else LineWriter(out))
        )
        writer.write_lines(lines)
    except Exception as exc:  # instrumentation never takes the loop down
        _report_once("emit", exc)


_reported: set[str] = set()


def _report_once(where: str, exc: BaseException) -> None:
    if where in _reported:
        return
    _reported.add(where)
    stderr_writer().write_lines([f"[memra-obs] {where} failed and is skipped from now on: {exc!r}"])


# ------------------------------------------------------------------------------ records


@dataclass(frozen=True, slots=True)
class PhaseLine:
    """A parsed per-burst phase line (ms values as printed)."""

    tag: str
    rounds: int
    k: int
    total_ms: float
    draft_ms: float
    verify_ms: float
    accept_ms: float
    roll_ms: float
    maint_ms: float
    per_draft_ms: float
    per_verify_ms: float
    per_accept_ms: float
    per_roll_ms: float
    per_maint_ms: float
    per_total_ms: float

    def line(self) -> str:
        return (
            f"[{self.tag}] rounds={self.rounds} k={self.k} total={self.total_ms:.2f}ms | "
            f"draft={self.draft_ms:.2f} verify={self.verify_ms:.2f} accept={self.accept_ms:.2f} "
            f"roll={self.roll_ms:.2f} maint={self.maint_ms:.2f} | per-round ms: "
            f"draft={self.per_draft_ms:.3f} verify={self.per_verify_ms:.3f} "
            f"accept={self.per_accept_ms:.3f} roll={self.per_roll_ms:.3f} "
            f"maint={self.per_maint_ms:.3f} total={self.per_total_ms:.3f}"
        )


@dataclass(frozen=True, slots=True)
class VerifyLine:
    """A parsed level-2 verify sub-split line (per-round ms as printed)."""

    tag: str
    rounds: int
    k: int
    vkda_ms: float
    scan_ms: float
    vmla_ms: float
    vrest_ms: float
    vffn_ms: float

    def line(self) -> str:
        return (
            f"[{self.tag}] rounds={self.rounds} k={self.k} | per-round ms: "
            f"vkda={self.vkda_ms:.3f} (scan={self.scan_ms:.3f}) vmla={self.vmla_ms:.3f} "
            f"vrest={self.vrest_ms:.3f} (vffn={self.vffn_ms:.3f})"
        )


@dataclass(frozen=True, slots=True)
class FirstTokenLine:
    """A parsed ``[spec-prof]`` line."""

    prof: SpecFirstTokenProf

    def line(self) -> str:
        return prof_line(self.prof)


@dataclass(frozen=True, slots=True)
class RoundsLine:
    """A parsed ``[spec-prof-rounds]`` line: one row of the session's round log."""

    row: int
    prof: SpecRoundProf

    def line(self) -> str:
        return prof_rounds_lines([self.prof], self.row)[0]


@dataclass(frozen=True, slots=True)
class SummaryLine:
    """A parsed ``[spec-prof-summary]`` line (values as printed; ``rounds=0`` leaves the
    rest ``None``)."""

    rounds: int
    k_mean: float | None = None
    j_mean: float | None = None
    accept: float | None = None
    tok_per_round: float | None = None
    wall_mean_ms: float | None = None
    wall_min_ms: float | None = None
    wall_med_ms: float | None = None
    wall_max_ms: float | None = None
    slow_rounds: int | None = None
    draft_mean_ms: float | None = None
    verify_mean_ms: float | None = None
    seq_rows_total: int | None = None
    ctx_first: int | None = None
    ctx_last: int | None = None

    def line(self) -> str:
        if self.k_mean is None:
            return f"[{PROF_SUMMARY_TAG}] rounds={self.rounds}"
        return (
            f"[{PROF_SUMMARY_TAG}] rounds={self.rounds} k_mean={self.k_mean:.2f} "
            f"j_mean={self.j_mean:.2f} accept={self.accept:.3f} "
            f"tok_per_round={self.tok_per_round:.2f} wall_ms mean={self.wall_mean_ms:.1f} "
            f"min={self.wall_min_ms:.1f} med={self.wall_med_ms:.1f} max={self.wall_max_ms:.1f} "
            f"slow_rounds(>1.5x med)={self.slow_rounds} draft_mean={self.draft_mean_ms:.1f} "
            f"verify_mean={self.verify_mean_ms:.1f} seq_rows_total={self.seq_rows_total} "
            f"ctx_first={self.ctx_first} ctx_last={self.ctx_last}"
        )


@dataclass(frozen=True, slots=True)
class OverrideLine:
    """The flag-override line (``[spec-trace] MEMRA_SPEC_TRACE=.. overrides ..``)."""

    general: int
    alias: int

    def line(self) -> str:
        return override_line(self.general, self.alias)


LegacyLine = PhaseLine | VerifyLine | FirstTokenLine | RoundsLine | SummaryLine | OverrideLine


def format_line(rec: LegacyLine) -> str:
    """The line a parsed record came from (exactly, for every line this module writes)."""
    return rec.line()


# ------------------------------------------------------------------------------ parsing
#
# Two layers: ``scan_line`` does every check and conversion and returns plain tuples (what
# ``memra-obs tail`` consumes, hundreds of thousands of lines a second); ``parse_line`` wraps
# them in the record classes above. Records built here skip their constructors' checks only
# after the same checks ran here; any value those checks would refuse goes through the
# constructor, so the refusal (and its message) is the record's own.


class LegacyParseError(ValueError):
    """A line carries a legacy tag but not the shape that goes with it."""

    def __init__(self, line: str, reason: str) -> None:
        super().__init__(f"{reason}: {line[:200]!r}")
        self.line = line
        self.reason = reason


#: ``scan_line`` kinds (the first element of its tuple).
PHASE = "phase"
VERIFY = "verify"
PROF = "prof"
PROF_ROUNDS = "prof_rounds"
PROF_SUMMARY = "prof_summary"
OVERRIDE = "override"

_N = r"(0|[1-9][0-9]*)"
_F = r"(-?[0-9]+\.[0-9]+)"
_TAGGED = re.compile(r"\[([^\]\s]+)\] (.*)", re.S)
_TAG_HEAD = re.compile(r"\[([^\]\s]+)\] ")
_PHASE = re.compile(
    rf"rounds={_N} k={_N} total={_F}ms \| draft={_F} verify={_F} accept={_F} roll={_F} "
    rf"maint={_F} \| per-round ms: draft={_F} verify={_F} accept={_F} roll={_F} maint={_F} "
    rf"total={_F}"
)
_VERIFY = re.compile(
    rf"rounds={_N} k={_N} \| per-round ms: vkda={_F} \(scan={_F}\) vmla={_F} vrest={_F} "
    rf"\(vffn={_F}\)"
)
_SUMMARY = re.compile(
    rf"rounds={_N} k_mean={_F} j_mean={_F} accept={_F} tok_per_round={_F} "
    rf"wall_ms mean={_F} min={_F} med={_F} max={_F} slow_rounds\(>1\.5x med\)={_N} "
    rf"draft_mean={_F} verify_mean={_F} seq_rows_total={_N} ctx_first={_N} ctx_last={_N}"
)
_OVERRIDE = re.compile(
    r"MEMRA_SPEC_TRACE=([12]) overrides MEMRA_GLM5_SPEC_TRACE=([12]) "
    r"\(the general flag wins; unset one to silence this\)"
)
_ROW = re.compile(
    rf"row={_N} wall_ms={_F} draft_ms={_F} verify_ms={_F} accept_ms={_F} rest_ms={_F} "
    rf"k={_N} j={_N} ctx={_N} seq_rows={_N}"
)

# The tail's fast path: whole-line patterns (tag, body and the trailing "\r"s scan_line
# strips) for a *subset* of the strict shapes above: every count short enough that int()
# cannot fail nor leave the record's range, every row value unsigned and below 1e30 ms so
# its f32 can neither overflow nor be refused. A line they match is one scan_line takes
# and returns the same values for (phase and level-2 lines: unless the tag is one of
# FAST_TAGS_EXCLUDED, which scan_line reads as another kind); memra_obs.tail hands every
# other line to scan_line, which does every check and gives every reason.
_N4 = r"(0|[1-9][0-9]{0,3})"  # < 10**4: inside u16 (k, j), a row index, seq_rows
_N9 = r"(0|[1-9][0-9]{0,8})"  # < 10**9: inside u32 (ctx)
_N18 = r"(0|[1-9][0-9]{0,17})"  # < 10**18: int() never meets its digit limit
_F30 = r"([0-9]{1,30}\.[0-9]+)"  # no sign, < 1e30
_FAST_ROW = (
    rf"\[{PROF_ROUNDS_TAG}\] row={_N4} wall_ms={_F30} draft_ms={_F30} verify_ms={_F30} "
    rf"accept_ms={_F30} rest_ms={_F30} k={_N4} j={_N4} ctx={_N9} seq_rows={_N4}\r*"
)
#: ``[spec-prof-rounds]`` row: groups row, wall, draft, verify, accept, rest, k, j, ctx, seq_rows.
FAST_ROW = re.compile(_FAST_ROW).fullmatch
#: Every line of a text whose lines all end in "\n", one tuple a line: a line FAST_ROW takes
#: gives its ten groups and "" last; any other line gives ten "" and the line itself (the
#: tail tokenizes a whole chunk with this, then converts the rows' numbers column-wise).
FAST_ROW_LINES = re.compile(rf"(?:{_FAST_ROW}|(.*))\n").findall
#: Phase line: groups tag, then :class:`PhaseLine`'s fields as printed.
FAST_PHASE = re.compile(r"\[([^\]\s]+)\] " + _PHASE.pattern.replace(_N, _N18) + r"\r*").fullmatch
#: Level-2 line: groups tag, then :class:`VerifyLine`'s fields as printed.
FAST_VERIFY = re.compile(r"\[([^\]\s]+)\] " + _VERIFY.pattern.replace(_N, _N18) + r"\r*").fullmatch
FAST_TAGS_EXCLUDED = frozenset((PROF_TAG, PROF_ROUNDS_TAG, PROF_SUMMARY_TAG, TRACE_TAG))

_KV = re.compile(r"([a-z0-9_]+)=(\S*)")
_FREE = re.compile(r"\[((?:[0-9]+:[0-9]+)(?:,[0-9]+:[0-9]+)*)?\]")
_FLOAT = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_COUNT = re.compile(_N)
_ARM_WORD = re.compile(r"[A-Za-z0-9_.:+-]*")

_F32X5 = struct.Struct("<5f")
_INF = math.inf
_PHASE_MATCH = _PHASE.fullmatch
_VERIFY_MATCH = _VERIFY.fullmatch
_ROW_MATCH = _ROW.fullmatch
_TAG_MATCH = _TAG_HEAD.match
_new = object.__new__
_set = object.__setattr__


def scan_line(line: str) -> tuple[str, str, tuple[Any, ...]] | None:
    """Parse one line into ``(kind, tag, values)``, ``None`` for anyone else's line.

    The fast layer under :func:`parse_line`, with the same checks and the same
    :class:`LegacyParseError` reasons. ``values`` per kind, in line order:
    :data:`PHASE` the :class:`PhaseLine` fields after ``tag``; :data:`VERIFY` the
    :class:`VerifyLine` fields after ``tag``; :data:`PROF` ``(SpecFirstTokenProf,)``;
    :data:`PROF_ROUNDS` ``(row, wall_ms, draft_ms, verify_ms, accept_ms, rest_ms, k, j, ctx,
    seq_rows)`` with the ms already rounded to f32; :data:`PROF_SUMMARY` the
    :class:`SummaryLine` fields (just ``(0,)`` for ``rounds=0``); :data:`OVERRIDE`
    ``(general, alias)``.
    """
    if line[:1] != "[":  # the common case for other programs' lines: one slice, no regex
        return None
    text = line.rstrip("\r\n")
    if text[:19] == "[spec-prof-rounds] ":  # most legacy lines are rows: no tag regex
        try:
            return PROF_ROUNDS, PROF_ROUNDS_TAG, _scan_row(line, text[19:])
        except LegacyParseError:
            raise
        except (TypeError, ValueError) as exc:
            raise LegacyParseError(line, str(exc)) from None
    m = _TAG_MATCH(text)
    if m is None:
        if text.startswith("[spec-prof") or text.startswith("[spec-trace]"):
            raise LegacyParseError(line, "tag without a body")
        return None
    tag = m.group(1)
    body = text[m.end() :]
    try:
        if tag[:5] == "spec-":
            if tag == PROF_ROUNDS_TAG:
                return PROF_ROUNDS, tag, _scan_row(line, body)
            if tag == PROF_TAG:
                return PROF, tag, (_parse_prof(line, body),)
            if tag == PROF_SUMMARY_TAG:
                return PROF_SUMMARY, tag, _scan_summary(line, body)
            if tag == TRACE_TAG:
                o = _OVERRIDE.fullmatch(body)
                if o is None:
                    raise LegacyParseError(line, "not the flag-override line")
                return OVERRIDE, tag, (int(o.group(1)), int(o.group(2)))
        if body[:7] != "rounds=":
            return None  # some other program's tagged line
        if " total=" in body:
            p = _PHASE_MATCH(body)
            if p is None:
                raise LegacyParseError(line, "phase line truncated or malformed")
            g = p.groups()
            return PHASE, tag, (int(g[0]), int(g[1]), *map(float, g[2:]))
        if "| per-round ms: vkda=" in body:
            v = _VERIFY_MATCH(body)
            if v is None:
                raise LegacyParseError(line, "verify sub-split line truncated or malformed")
            g = v.groups()
            return VERIFY, tag, (int(g[0]), int(g[1]), *map(float, g[2:]))
        raise LegacyParseError(line, "tagged rounds= line of no known shape")
    except LegacyParseError:
        raise
    except (TypeError, ValueError) as exc:  # a record refused a parsed value
        raise LegacyParseError(line, str(exc)) from None


def parse_line(line: str) -> LegacyLine | None:
    """Parse one line: a record for a legacy line, ``None`` for anyone else's line.

    Raises :class:`LegacyParseError` (with the reason) for a line that carries one of the
    legacy tags or shapes but is malformed or truncated.
    """
    s = scan_line(line)
    if s is None:
        return None
    kind, tag, v = s
    if kind is PROF_ROUNDS:
        return RoundsLine(v[0], round_prof(v))
    if kind is PHASE:
        return PhaseLine(tag, *v)
    if kind is VERIFY:
        return VerifyLine(tag, *v)
    if kind is PROF:
        return FirstTokenLine(v[0])
    if kind is PROF_SUMMARY:
        return SummaryLine(*v)
    return OverrideLine(*v)


def round_prof(v: Sequence[Any]) -> SpecRoundProf:
    """The :class:`SpecRoundProf` of a scanned ``[spec-prof-rounds]`` row (values already
    checked and f32-rounded by :func:`scan_line`, so the constructor's checks are skipped)."""
    r = _new(SpecRoundProf)
    _set(r, "wall_ms", v[1])
    _set(r, "draft_ms", v[2])
    _set(r, "verify_ms", v[3])
    _set(r, "accept_ms", v[4])
    _set(r, "rest_ms", v[5])
    _set(r, "k", v[6])
    _set(r, "j", v[7])
    _set(r, "ctx", v[8])
    _set(r, "seq_rows", v[9])
    return r


def _int(s: str) -> int:
    return int(s)


def _scan_row(line: str, body: str) -> tuple[Any, ...]:
    m = _ROW_MATCH(body)
    if m is None:
        raise LegacyParseError(line, "[spec-prof-rounds] row truncated or malformed")
    g = m.groups()
    k, j, ctx, seq = map(int, g[6:])
    # No sign, no 300-digit number (an infinity), counts in range: round to f32 here. Anything
    # else, or an f32 overflow, is the record's to take or refuse (naming the field).
    if (
        "-" in body
        or len(body) > 300
        or k > U16_MAX
        or j > U16_MAX
        or ctx > U32_MAX
        or seq > U32_MAX
    ):
        return _row_by_record(g, k, j, ctx, seq)
    try:
        w, d, v, a, r = _F32X5.unpack(_F32X5.pack(*map(float, g[1:6])))
    except OverflowError:
        return _row_by_record(g, k, j, ctx, seq)
    return (int(g[0]), w, d, v, a, r, k, j, ctx, seq)


def _row_by_record(g: Sequence[str], k: int, j: int, ctx: int, seq: int) -> tuple[Any, ...]:
    p = SpecRoundProf(*map(float, g[1:6]), k, j, ctx, seq)  # type: ignore[call-arg]
    return (int(g[0]), p.wall_ms, p.draft_ms, p.verify_ms, p.accept_ms, p.rest_ms, k, j, ctx, seq)


def _prof_fast_pattern() -> re.Pattern[str]:
    """Every field in order, each value in a shape whose record needs no further check:
    ms/MB unsigned, positional and below 1e30, counts and free-memory numbers of at most
    19 digits (inside u64), the arm one bare word. A subset of what _parse_prof accepts
    with its fast flag up, so both give the same record."""
    parts = []
    for name in FIRST_TOKEN_FIELDS:
        if name in _FT_FLOAT:
            pat = r"([0-9]{1,30}(?:\.[0-9]+)?)"
        elif name in _FT_FREE:
            pat = r"\[((?:[0-9]{1,19}:[0-9]{1,19})(?:,[0-9]{1,19}:[0-9]{1,19})*)?\]"
        elif name == "draft_prime_arm":
            pat = r"([A-Za-z0-9_.:+-]*)"
        else:
            pat = r"(0|[1-9][0-9]{0,18})"
        parts.append(f"{name}={pat}")
    return re.compile(" ".join(parts))


_PROF_FAST = _prof_fast_pattern().fullmatch
#: Where the fast pattern's groups sit, by kind (the arm stays a str).
_PROF_FLOATS = tuple(i for i, n in enumerate(FIRST_TOKEN_FIELDS) if n in _FT_FLOAT)
_PROF_FREES = tuple(i for i, n in enumerate(FIRST_TOKEN_FIELDS) if n in _FT_FREE)
_PROF_COUNTS = tuple(
    i
    for i, n in enumerate(FIRST_TOKEN_FIELDS)
    if n not in _FT_FLOAT and n not in _FT_FREE and n != "draft_prime_arm"
)


def _parse_prof(line: str, body: str) -> SpecFirstTokenProf:
    m = _PROF_FAST(body)
    if m is None:
        return _parse_prof_strict(line, body)
    v: list[Any] = list(m.groups())
    for i in _PROF_FLOATS:
        v[i] = float(v[i])
    for i in _PROF_COUNTS:
        v[i] = int(v[i])
    for i in _PROF_FREES:
        x = v[i]
        v[i] = (
            [(int(a), int(b)) for a, _, b in (p.partition(":") for p in x.split(","))] if x else []
        )
    prof = _new(SpecFirstTokenProf)
    # every field, in the shape the constructor would keep it
    prof.__dict__.update(zip(FIRST_TOKEN_FIELDS, v, strict=True))
    return prof


def _parse_prof_strict(line: str, body: str) -> SpecFirstTokenProf:
    pairs = body.split(" ")
    names = [p.partition("=")[0] for p in pairs]
    if names != _FT_NAMES:
        missing = [n for n in FIRST_TOKEN_FIELDS if n not in names]
        reason = f"missing {missing[0]}" if missing else "fields out of order or unknown"
        raise LegacyParseError(line, f"[spec-prof] {reason}")
    kw: dict[str, Any] = {}
    fast = True
    for name, pair in zip(FIRST_TOKEN_FIELDS, pairs, strict=True):
        v = pair.partition("=")[2]
        if name in _FT_FLOAT:
            if not _FLOAT.fullmatch(v):
                raise LegacyParseError(line, f"{name}={v!r} is not a number")
            x = float(v)
            if not 0.0 <= x < _INF:
                fast = False
            kw[name] = x
        elif name in _FT_FREE:
            f = _FREE.fullmatch(v)
            if f is None:
                raise LegacyParseError(line, f"{name}={v!r} is not [ordinal:free_mb,...]")
            pairs_ = [
                (int(a), int(b))
                for a, _, b in (x.partition(":") for x in filter(None, v[1:-1].split(",")))
            ]
            if any(a > U64_MAX or b > U64_MAX for a, b in pairs_):
                fast = False
            kw[name] = pairs_
        elif name == "draft_prime_arm":
            if not _ARM_WORD.fullmatch(v):
                fast = False
            kw[name] = v
        else:
            if not _COUNT.fullmatch(v):
                raise LegacyParseError(line, f"{name}={v!r} is not a count")
            n = int(v)
            if n > U64_MAX:
                fast = False
            kw[name] = n
    if not fast:
        try:
            return SpecFirstTokenProf(**kw)  # refuses the bad value, naming the field
        except (TypeError, ValueError) as exc:
            raise LegacyParseError(line, str(exc)) from None
    prof = _new(SpecFirstTokenProf)
    prof.__dict__.update(kw)  # every field, each checked above as the constructor would
    return prof


_FT_NAMES = list(FIRST_TOKEN_FIELDS)


def _parse_row(line: str, body: str) -> RoundsLine:
    v = _scan_row(line, body)
    return RoundsLine(v[0], round_prof(v))


def _scan_summary(line: str, body: str) -> tuple[Any, ...]:
    if body == "rounds=0":
        return (0,)
    m = _SUMMARY.fullmatch(body)
    if m is None:
        raise LegacyParseError(line, "[spec-prof-summary] truncated or malformed")
    g = m.groups()
    return (
        int(g[0]),
        float(g[1]),
        float(g[2]),
        float(g[3]),
        float(g[4]),
        float(g[5]),
        float(g[6]),
        float(g[7]),
        float(g[8]),
        int(g[9]),
        float(g[10]),
        float(g[11]),
        int(g[12]),
        int(g[13]),
        int(g[14]),
    )


def _parse_summary(line: str, body: str) -> SummaryLine:
    return SummaryLine(*_scan_summary(line, body))
