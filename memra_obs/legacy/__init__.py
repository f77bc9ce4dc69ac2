"""The legacy tagged stderr lines: written byte for byte as the Rust worker prints them, and
parsed back (``format_line(parse_line(l)) == l`` for every line this package writes).

The seed's formats (phase, level-2 verify, summary) are computed with the seed's operations in
its order. ``[spec-prof]`` and ``[spec-prof-rounds]``, which the seed leaves open, are defined
once (README, "Legacy lines"), as is the k advisor's verdict over a session's logged rounds:

``[spec-advice] (estimate) rounds=.. clock=.. k_now=.. k_rec=.. tokens_per_round=v (lo..hi) tokens_per_s=v (lo..hi) speedup=v (lo..hi) plain_step_ms=v (source)``.
:mod:`.lines` holds the writers and the line records, :mod:`.parse` the one parser.
"""

from ..records import FIRST_TOKEN_FIELDS, FIRST_TOKEN_MS_FIELDS
from .lines import (
    ADVICE,
    ADVICE_TAG,
    OVERRIDE,
    PHASE,
    PROF,
    PROF_ROUNDS,
    PROF_ROUNDS_TAG,
    PROF_SUMMARY,
    PROF_SUMMARY_TAG,
    PROF_TAG,
    VERIFY,
    AdviceLine,
    FirstTokenLine,
    LegacyLine,
    OverrideLine,
    PhaseLine,
    RoundsLine,
    SummaryLine,
    VerifyLine,
    advice_line,
    emit,
    exact_f32,
    exact_f64,
    format_line,
    phase_lines,
    prof_line,
    prof_rounds_lines,
    prof_summary_line,
)
from .parse import LegacyParseError, parse_line

__all__ = [
    "ADVICE", "ADVICE_TAG", "FIRST_TOKEN_FIELDS", "FIRST_TOKEN_MS_FIELDS", "OVERRIDE", "PHASE",
    "PROF", "PROF_ROUNDS", "PROF_ROUNDS_TAG", "PROF_SUMMARY", "PROF_SUMMARY_TAG", "PROF_TAG",
    "VERIFY", "AdviceLine", "FirstTokenLine", "LegacyLine", "LegacyParseError", "OverrideLine",
    "PhaseLine", "RoundsLine", "SummaryLine", "VerifyLine", "advice_line", "emit", "exact_f32",
    "exact_f64", "format_line", "parse_line", "phase_lines", "prof_line", "prof_rounds_lines",
    "prof_summary_line",
]  # fmt: skip
