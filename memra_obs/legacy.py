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

import re
import struct
from collections.abc import Sequence
from decimal import Decimal
from typing import Any, NamedTuple, TextIO

from .diagnostics import say_once
from .flags import override_line, spec_trace_level
from .linewriter import LineWriter, stderr_writer
from .records import (
    FIRST_TOKEN_FIELDS,
    FIRST_TOKEN_MS_FIELDS,
    U16_MAX,
    U32_MAX,
    U64_MAX,
    VERIFY_SPLIT,
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundProf,
    SpecRoundsLog,
    VerifySplit,
    summary_text,
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
]

_F32X5 = struct.Struct("<5f")
_F32_PACK = struct.Struct("<f").pack
_F32_UNPACK = struct.Struct("<f").unpack

PROF_TAG = "spec-prof"
PROF_ROUNDS_TAG = "spec-prof-rounds"
PROF_SUMMARY_TAG = "spec-prof-summary"
TRACE_TAG = "spec-trace"

#: Line kinds (each record's ``kind``; the tail's ``kind`` label values).
PHASE = "phase"
VERIFY = "verify"
PROF = "prof"
PROF_ROUNDS = "prof_rounds"
PROF_SUMMARY = "prof_summary"
OVERRIDE = "override"


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
    for a split that recorded nothing. Every value is the seed's ``ns as f64 / 1e6`` (per
    round: ``/ rounds`` after that), so the same f64 reaches the same ``{:.N}``.
    """
    n = p.rounds
    if n == 0:
        return []
    r = float(n)
    total = p.total()
    ms = [float(x) / 1e6 for x in (total, p.draft, p.verify, p.accept, p.roll, p.maint)]
    per = [float(x) / 1e6 / r for x in (p.draft, p.verify, p.accept, p.roll, p.maint, total)]
    out = [_phase_text(tag, n, k, *ms, *per)]
    if level >= 2:
        vkda, scan, vmla, vffn = split.drain() if split is not None else (0, 0, 0, 0)
        vrest = max(p.verify - ((vkda + vmla) & U64_MAX), 0)  # u64 saturating_sub
        out.append(
            _verify_text(
                tag_v, n, k, *(float(x) / 1e6 / r for x in (vkda, scan, vmla, vrest, vffn))
            )
        )
    return out


def _phase_text(tag: str, n: int, k: int, *v: float) -> str:
    return (
        f"[{tag}] rounds={n} k={k} total={v[0]:.2f}ms | draft={v[1]:.2f} verify={v[2]:.2f} "
        f"accept={v[3]:.2f} roll={v[4]:.2f} maint={v[5]:.2f} | per-round ms: draft={v[6]:.3f} "
        f"verify={v[7]:.3f} accept={v[8]:.3f} roll={v[9]:.3f} maint={v[10]:.3f} total={v[11]:.3f}"
    )


def _verify_text(tag: str, n: int, k: int, *v: float) -> str:
    return (
        f"[{tag}] rounds={n} k={k} | per-round ms: vkda={v[0]:.3f} (scan={v[1]:.3f}) "
        f"vmla={v[2]:.3f} vrest={v[3]:.3f} (vffn={v[4]:.3f})"
    )


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
            split = VERIFY_SPLIT  # the process-wide accumulators
        lines = phase_lines(p, tag, tag_v, k, lvl, split)
        writer = (
            out
            if isinstance(out, LineWriter)
            else (stderr_writer() if out is None else LineWriter(out))
        )
        writer.write_lines(lines)
    except Exception as exc:  # instrumentation never takes the loop down
        say_once("legacy.emit", f"emit failed and is skipped from now on: {exc!r}")


# ------------------------------------------------------------------------------ records
#
# Parsed lines are immutable tuples (cheap to build: the tail builds one per line); each
# says its ``kind`` and gives its line back with ``line()``.


class PhaseLine(NamedTuple):
    """A parsed per-burst phase line (ms values as printed)."""

    kind = PHASE

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
        return _phase_text(self.tag, self.rounds, self.k, *self[3:])


class VerifyLine(NamedTuple):
    """A parsed level-2 verify sub-split line (per-round ms as printed)."""

    kind = VERIFY

    tag: str
    rounds: int
    k: int
    vkda_ms: float
    scan_ms: float
    vmla_ms: float
    vrest_ms: float
    vffn_ms: float

    def line(self) -> str:
        return _verify_text(self.tag, self.rounds, self.k, *self[3:])


class FirstTokenLine(NamedTuple):
    """A parsed ``[spec-prof]`` line."""

    kind = PROF

    prof: SpecFirstTokenProf

    def line(self) -> str:
        return prof_line(self.prof)


class RoundsLine(NamedTuple):
    """A parsed ``[spec-prof-rounds]`` line: one row of the session's round log."""

    kind = PROF_ROUNDS

    row: int
    prof: SpecRoundProf

    def line(self) -> str:
        return prof_rounds_lines([self.prof], self.row)[0]


class SummaryLine(NamedTuple):
    """A parsed ``[spec-prof-summary]`` line (values as printed; ``rounds=0`` leaves the
    rest ``None``)."""

    kind = PROF_SUMMARY

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
        return f"[{PROF_SUMMARY_TAG}] " + summary_text(*self)  # type: ignore[arg-type]


class OverrideLine(NamedTuple):
    """The flag-override line (``[spec-trace] MEMRA_SPEC_TRACE=.. overrides ..``)."""

    kind = OVERRIDE

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
# The one parser of these lines (every reader goes through it: the tail, the report, tests).
# A regex per shape, then the record; rows, the commonest legacy line, skip their record's
# checks only after the same checks ran here (records.round_prof).


class LegacyParseError(ValueError):
    """A line carries a legacy tag but not the shape that goes with it.

    ``kind`` is the kind the line claims to be (``phase``, ``verify``, ``prof``,
    ``prof_rounds``, ``prof_summary``, ``override``), for counting refusals by kind.
    """

    def __init__(self, line: str, reason: str, kind: str = PHASE) -> None:
        super().__init__(f"{reason}: {line[:200]!r}")
        self.line = line
        self.reason = reason
        self.kind = kind


_N = r"(0|[1-9][0-9]*)"
_F = r"(-?[0-9]+\.[0-9]+)"
_TAG_HEAD = re.compile(r"\[([^\]\s]+)\] ").match
_PHASE = re.compile(
    rf"rounds={_N} k={_N} total={_F}ms \| draft={_F} verify={_F} accept={_F} roll={_F} "
    rf"maint={_F} \| per-round ms: draft={_F} verify={_F} accept={_F} roll={_F} maint={_F} "
    rf"total={_F}"
).fullmatch
_VERIFY = re.compile(
    rf"rounds={_N} k={_N} \| per-round ms: vkda={_F} \(scan={_F}\) vmla={_F} vrest={_F} "
    rf"\(vffn={_F}\)"
).fullmatch
_SUMMARY = re.compile(
    rf"rounds={_N} k_mean={_F} j_mean={_F} accept={_F} tok_per_round={_F} "
    rf"wall_ms mean={_F} min={_F} med={_F} max={_F} slow_rounds\(>1\.5x med\)={_N} "
    rf"draft_mean={_F} verify_mean={_F} seq_rows_total={_N} ctx_first={_N} ctx_last={_N}"
).fullmatch
_OVERRIDE = re.compile(
    r"MEMRA_SPEC_TRACE=([12]) overrides MEMRA_GLM5_SPEC_TRACE=([12]) "
    r"\(the general flag wins; unset one to silence this\)"
).fullmatch
_ROW = re.compile(
    rf"row={_N} wall_ms={_F} draft_ms={_F} verify_ms={_F} accept_ms={_F} rest_ms={_F} "
    rf"k={_N} j={_N} ctx={_N} seq_rows={_N}"
).fullmatch
_FREE = re.compile(r"\[((?:[0-9]+:[0-9]+)(?:,[0-9]+:[0-9]+)*)?\]").fullmatch
_FLOAT = re.compile(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?").fullmatch
_COUNT = re.compile(_N).fullmatch
_FT_NAMES = list(FIRST_TOKEN_FIELDS)
_ROW_HEAD = f"[{PROF_ROUNDS_TAG}] "
_tuple_new = tuple.__new__  # a NamedTuple without its Python-level __new__
#: The project's own tags: a line under a damaged one is refused, never passed off as foreign.
_OWN_TAGS = {
    PROF_ROUNDS_TAG: PROF_ROUNDS,
    PROF_SUMMARY_TAG: PROF_SUMMARY,
    PROF_TAG: PROF,
    TRACE_TAG: OVERRIDE,
}


def parse_line(line: str) -> LegacyLine | None:
    """Parse one line: a record for a legacy line, ``None`` for anyone else's line.

    Raises :class:`LegacyParseError` (with the reason and the kind the line claims) for a
    line that carries one of the legacy tags or shapes but is malformed or truncated.
    """
    if line[:1] != "[":  # the common case for other programs' lines: one slice, no regex
        return None
    text = line.rstrip("\r\n")
    try:
        if text.startswith(_ROW_HEAD):  # most legacy lines are rows
            return _row(line, text[len(_ROW_HEAD) :])
        m = _TAG_HEAD(text)
        if m is None:
            if text.startswith("[spec-"):
                raise LegacyParseError(line, "tag without a body", _claimed(text))
            return None
        tag = m.group(1)
        body = text[m.end() :]
        kind = _OWN_TAGS.get(tag)
        if kind is not None:
            return _own(line, kind, body)
        if tag.startswith(("spec-prof", "spec-trace")):
            raise LegacyParseError(line, f"unknown tag [{tag}]", _claimed(text))
        if not body.startswith("rounds="):
            return None  # some other program's tagged line
        if " total=" in body:
            p = _PHASE(body)
            if p is None:
                raise LegacyParseError(line, "phase line truncated or malformed", PHASE)
            g = p.groups()
            return PhaseLine(tag, int(g[0]), int(g[1]), *_durations(line, g[2:], PHASE))
        if "| per-round ms: vkda=" in body:
            v = _VERIFY(body)
            if v is None:
                raise LegacyParseError(line, "verify sub-split line truncated or malformed", VERIFY)
            g = v.groups()
            return VerifyLine(tag, int(g[0]), int(g[1]), *_durations(line, g[2:], VERIFY))
        raise LegacyParseError(line, "tagged rounds= line of no known shape", PHASE)
    except ValueError as exc:  # a record (or int()) refused a parsed value
        if isinstance(exc, LegacyParseError):
            raise
        raise LegacyParseError(line, str(exc), _claimed(text)) from None


def _durations(line: str, values: Sequence[str], kind: str) -> tuple[float, ...]:
    """Printed ms values as floats: no clock gives a negative or an infinite one."""
    out = tuple(map(float, values))
    if min(out) < 0.0 or max(out) == _INF:
        raise LegacyParseError(line, "a negative or infinite duration (no clock gives one)", kind)
    return out


_INF = float("inf")


def _claimed(text: str) -> str:
    """The kind a damaged tagged line claims to be (for counting it)."""
    for tag, kind in _OWN_TAGS.items():
        if text.startswith("[" + tag):
            return kind
    return VERIFY if "vkda=" in text else PHASE


def _own(line: str, kind: str, body: str) -> LegacyLine:
    if kind is PROF_ROUNDS:
        return _row(line, body)
    if kind is PROF:
        return FirstTokenLine(_prof(line, body))
    if kind is PROF_SUMMARY:
        return _summary(line, body)
    o = _OVERRIDE(body)
    if o is None:
        raise LegacyParseError(line, "not the flag-override line", OVERRIDE)
    return OverrideLine(int(o.group(1)), int(o.group(2)))


def _row(line: str, body: str) -> RoundsLine:
    m = _ROW(body)
    if m is None:
        raise LegacyParseError(line, "[spec-prof-rounds] row truncated or malformed", PROF_ROUNDS)
    i, w, d, v, a, r, k, j, c, q = m.groups()
    k, j, c, q = int(k), int(j), int(c), int(q)
    # The regex took digits: with no sign and the counts in range, only an f32 overflow is
    # left to check, so the row is built as the record would store it. Anything else goes
    # through the record, which refuses it naming the field.
    if "-" not in body and k <= U16_MAX and j <= U16_MAX and c <= U32_MAX and q <= U32_MAX:
        try:
            ms = _F32X5.unpack(_F32X5.pack(float(w), float(d), float(v), float(a), float(r)))
        except OverflowError:
            ms = (_INF,)
        if _INF not in ms:
            return _tuple_new(RoundsLine, (int(i), _tuple_new(SpecRoundProf, (*ms, k, j, c, q))))
    try:
        prof = SpecRoundProf(float(w), float(d), float(v), float(a), float(r), k, j, c, q)
    except (TypeError, ValueError) as exc:
        raise LegacyParseError(line, str(exc), PROF_ROUNDS) from None
    return _tuple_new(RoundsLine, (int(i), prof))


def _summary(line: str, body: str) -> SummaryLine:
    if body == "rounds=0":
        return SummaryLine(0)
    m = _SUMMARY(body)
    if m is None:
        raise LegacyParseError(line, "[spec-prof-summary] truncated or malformed", PROF_SUMMARY)
    g = m.groups()
    f = _durations(line, (*g[1:9], g[10], g[11]), PROF_SUMMARY)
    return SummaryLine(int(g[0]), *f[:8], int(g[9]), f[8], f[9], int(g[12]), int(g[13]), int(g[14]))


def _prof(line: str, body: str) -> SpecFirstTokenProf:
    pairs = body.split(" ")
    names = [p.partition("=")[0] for p in pairs]
    if names == _FT_NAMES[:-1]:  # a line from before the last field (unattributed_ms) was
        pairs.append("unattributed_ms=0.0")
        names = _FT_NAMES
    if names != _FT_NAMES:
        missing = [n for n in FIRST_TOKEN_FIELDS if n not in names]
        reason = f"missing {missing[0]}" if missing else "fields out of order or unknown"
        raise LegacyParseError(line, f"[spec-prof] {reason}", PROF)
    kw: dict[str, Any] = {}
    for name, pair in zip(FIRST_TOKEN_FIELDS, pairs, strict=True):
        v = pair.partition("=")[2]
        if name in _FT_FLOAT:
            if not _FLOAT(v):
                raise LegacyParseError(line, f"{name}={v!r} is not a number", PROF)
            kw[name] = float(v)
        elif name in _FT_FREE:
            if _FREE(v) is None:
                raise LegacyParseError(line, f"{name}={v!r} is not [ordinal:free_mb,...]", PROF)
            kw[name] = [
                (int(a), int(b))
                for a, _, b in (x.partition(":") for x in filter(None, v[1:-1].split(",")))
            ]
        elif name == "draft_prime_arm":
            kw[name] = v
        else:
            if not _COUNT(v):
                raise LegacyParseError(line, f"{name}={v!r} is not a count", PROF)
            kw[name] = int(v)
    try:
        return SpecFirstTokenProf(**kw)  # refuses a bad value, naming the field
    except (TypeError, ValueError) as exc:
        raise LegacyParseError(line, str(exc), PROF) from None
