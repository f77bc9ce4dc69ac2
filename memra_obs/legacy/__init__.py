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

``[spec-advice] (estimate) rounds=.. clock=.. k_now=.. k_rec=.. tokens_per_round=v (lo..hi) tokens_per_s=v (lo..hi) speedup=v (lo..hi) plain_step_ms=v (source)``
    the k advisor's verdict over a session's logged rounds (:mod:`memra_obs.analysis`),
    printed with the summary; every figure is an estimate with its interval.

``parse_line`` turns any of these back into a record; ``format_line(parse_line(l)) == l``
for every line this package writes. :mod:`.lines` holds the writers and the line records,
:mod:`.parse` the one parser every reader goes through.
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
