"""The legacy lines' writers (byte for byte with the seed where the seed defines the line)
and the records a parsed line becomes; the parser is :mod:`memra_obs.legacy.parse`."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from decimal import Decimal
from typing import Any, NamedTuple, TextIO

from ..diagnostics import say_once
from ..flags import override_line, spec_trace_level
from ..linewriter import LineWriter, stderr_writer
from ..records import (
    _FT_FLOAT,
    _FT_FREE,
    FIRST_TOKEN_FIELDS,
    U64_MAX,
    VERIFY_SPLIT,
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundProf,
    SpecRoundsLog,
    VerifySplit,
    f32,
    summary_text,
)

PROF_TAG = "spec-prof"
PROF_ROUNDS_TAG = "spec-prof-rounds"
PROF_SUMMARY_TAG = "spec-prof-summary"
TRACE_TAG = "spec-trace"
ADVICE_TAG = "spec-advice"
#: Line kinds (:data:`KIND` of each record's type; the tail's ``kind`` label values).
PHASE = "phase"
VERIFY = "verify"
PROF = "prof"
PROF_ROUNDS = "prof_rounds"
PROF_SUMMARY = "prof_summary"
OVERRIDE = "override"
ADVICE = "advice"


def _positional(s: str) -> str:
    if "e" in s or "E" in s:
        s = format(Decimal(s), "f")
    if "." not in s:
        s += ".0"
    return s


def exact_f32(x: float) -> str:
    """A short decimal (the shortest, but for rare binade edges) that reads back to the same f32,
    no exponent. Most ms values need 7 digits: try 7 and 6, then bisect (monotonic in digits)."""
    s = f"{x:.7g}"
    if f32(float(s)) != x:
        s = f"{x:.8g}"
        if f32(float(s)) != x:
            s = f"{x:.9g}"  # 9 significant digits always identify an f32
    elif f32(float(t := f"{x:.6g}")) == x:
        lo, hi, s = 1, 6, t  # the answer is in lo..hi; s holds hi's digits
        while lo < hi:
            mid = (lo + hi) // 2
            t = f"{x:.{mid}g}"
            if f32(float(t)) == x:
                hi, s = mid, t
            else:
                lo = mid + 1
    return _positional(s)


def phase_lines(
    p: SpecPhaseNs, tag: str, tag_v: str, k: int, level: int = 1, split: VerifySplit | None = None
) -> list[str]:
    """The per-burst line under ``tag`` and, at ``level >= 2``, the verify sub-split line
    under ``tag_v`` (draining ``split``; ``None``: nothing recorded); ``[]`` for no rounds.
    Values are the seed's ``ns as f64 / 1e6`` (then ``/ rounds``), so the digits agree."""
    n = p.rounds
    if n == 0:
        return []
    r = float(n)
    total = p.total()
    ms = [float(x) / 1e6 for x in (total, *p.phases())]
    per = [float(x) / 1e6 / r for x in (*p.phases(), total)]
    out = [_phase_text(tag, n, k, *ms, *per)]
    if level >= 2:
        vkda, scan, vmla, vffn = split.drain() if split is not None else (0, 0, 0, 0)
        vrest = max(p.verify - ((vkda + vmla) & U64_MAX), 0)  # u64 saturating_sub
        v = [float(x) / 1e6 / r for x in (vkda, scan, vmla, vrest, vffn)]
        out.append(_verify_text(tag_v, n, k, *v))
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


def prof_line(prof: SpecFirstTokenProf) -> str:
    """The ``[spec-prof]`` line: every field of the first-token profile, exact."""
    parts = [f"[{PROF_TAG}]"]
    for name in FIRST_TOKEN_FIELDS:
        v = getattr(prof, name)
        if name in _FT_FLOAT:  # the shortest decimal that reads back to the same double
            parts.append(f"{name}={_positional(repr(float(v)))}")
        elif name in _FT_FREE:
            parts.append(f"{name}=[{','.join(f'{o}:{mb}' for o, mb in v)}]")
        else:
            parts.append(f"{name}={v}")
    return " ".join(parts)


def prof_rounds_lines(rows: Sequence[SpecRoundProf], start: int = 0) -> list[str]:
    """One ``[spec-prof-rounds]`` line per row; ``start`` is the first row's log index."""
    return [
        f"[{PROF_ROUNDS_TAG}] row={i} wall_ms={exact_f32(r.wall_ms)} "
        f"draft_ms={exact_f32(r.draft_ms)} verify_ms={exact_f32(r.verify_ms)} "
        f"accept_ms={exact_f32(r.accept_ms)} rest_ms={exact_f32(r.rest_ms)} "
        f"k={r.k} j={r.j} ctx={r.ctx} seq_rows={r.seq_rows}"
        for i, r in enumerate(rows, start)
    ]


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
    out: TextIO | None = None,
) -> None:
    """The seed's ``SpecPhaseNs::emit``: the burst's lines to stderr (or ``out``), never raising.
    ``level`` defaults to the process trace level, ``split`` to :data:`memra_obs.VERIFY_SPLIT`."""
    try:
        lvl = spec_trace_level() if level is None else level
        lines = phase_lines(p, tag, tag_v, k, lvl, VERIFY_SPLIT if split is None else split)
        (stderr_writer() if out is None else LineWriter(out)).write_lines(lines)
    except Exception as exc:  # instrumentation never takes the loop down
        say_once("legacy.emit", f"emit failed and is skipped from now on: {exc!r}")


# Parsed lines: tuples (cheap, one per line in the tail) with their ``line()``; kinds in KIND.


class PhaseLine(NamedTuple):
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
        return _phase_text(self.tag, self.rounds, self.k, *self[3:])


class VerifyLine(NamedTuple):
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
        return _verify_text(self.tag, self.rounds, self.k, *self[3:])


class FirstTokenLine(NamedTuple):
    """A parsed ``[spec-prof]`` line."""

    prof: SpecFirstTokenProf

    def line(self) -> str:
        return prof_line(self.prof)


class RoundsLine(NamedTuple):
    """A parsed ``[spec-prof-rounds]`` line: one row of the session's round log."""

    row: int
    prof: SpecRoundProf

    def line(self) -> str:
        return prof_rounds_lines([self.prof], self.row)[0]


class SummaryLine(NamedTuple):
    """A parsed ``[spec-prof-summary]`` line (as printed; ``rounds=0``: the rest ``None``)."""

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

    general: int
    alias: int

    def line(self) -> str:
        return override_line(self.general, self.alias)


class AdviceLine(NamedTuple):
    """A parsed ``[spec-advice]`` line: the k advisor's estimates with their intervals."""

    rounds: int
    clock: str
    k_now: float
    k_rec: int
    tokens_per_round: tuple[float, float, float]
    tokens_per_s: tuple[float, float, float]
    speedup: tuple[float, float, float]
    plain_step_ms: float
    plain_source: str

    def line(self) -> str:
        t, s, x = self.tokens_per_round, self.tokens_per_s, self.speedup
        return (
            f"[{ADVICE_TAG}] (estimate) rounds={self.rounds} clock={self.clock} "
            f"k_now={self.k_now:.2f} k_rec={self.k_rec} "
            f"tokens_per_round={t[0]:.3f} ({t[1]:.3f}..{t[2]:.3f}) "
            f"tokens_per_s={s[0]:.1f} ({s[1]:.1f}..{s[2]:.1f}) "
            f"speedup={x[0]:.3f} ({x[1]:.3f}..{x[2]:.3f}) "
            f"plain_step_ms={self.plain_step_ms:.3f} ({self.plain_source})"
        )


def advice_line(a: Any) -> str:
    """The ``[spec-advice]`` line of an :class:`memra_obs.analysis.Advice`."""
    iv = operator.attrgetter("value", "lo", "hi")
    return AdviceLine(
        a.rounds, a.clock, a.current_k, a.recommended_k, iv(a.expected_tokens),
        iv(a.tokens_per_s), iv(a.estimated_speedup), a.plain_step_ns / 1e6, a.plain_step_source,
    ).line()  # fmt: skip


LegacyLine = (
    PhaseLine | VerifyLine | FirstTokenLine | RoundsLine | SummaryLine | OverrideLine | AdviceLine
)
#: Each record type's line kind (a NamedTuple cannot carry it as a class constant for mypy).
KIND: dict[type, str] = {
    PhaseLine: PHASE, VerifyLine: VERIFY, FirstTokenLine: PROF, RoundsLine: PROF_ROUNDS,
    SummaryLine: PROF_SUMMARY, OverrideLine: OVERRIDE, AdviceLine: ADVICE,
}  # fmt: skip


def format_line(rec: LegacyLine) -> str:
    """The line a parsed record came from (exactly, for every line this module writes)."""
    return rec.line()
