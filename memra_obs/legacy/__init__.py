"""The legacy tagged stderr lines, written byte for byte as the Rust worker prints them (the
seed's phase, level-2 verify and summary lines with its operations in its order; the lines it
leaves open as the README's "Legacy lines" defines them) and parsed back:
``format_line(parse_line(l)) == l`` for every line written. :mod:`.lines` holds the writers and
the line records, :mod:`.parse` the one parser."""

from ..records import FIRST_TOKEN_FIELDS, FIRST_TOKEN_MS_FIELDS
from .lines import (
    KIND,
    PHASE,
    PROF_ROUNDS,
    PROF_SUMMARY_TAG,
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
    format_line,
    phase_lines,
    prof_line,
    prof_rounds_lines,
    prof_summary_line,
)
from .parse import CriJoin, LegacyParseError, parse_line

__all__ = [
    "FIRST_TOKEN_FIELDS", "FIRST_TOKEN_MS_FIELDS", "KIND", "PHASE", "PROF_ROUNDS",
    "PROF_SUMMARY_TAG", "VERIFY", "AdviceLine", "CriJoin", "FirstTokenLine", "LegacyLine",
    "LegacyParseError", "OverrideLine", "PhaseLine", "RoundsLine", "SummaryLine", "VerifyLine",
    "advice_line", "emit", "format_line", "parse_line", "phase_lines", "prof_line",
    "prof_rounds_lines", "prof_summary_line",
]  # fmt: skip
