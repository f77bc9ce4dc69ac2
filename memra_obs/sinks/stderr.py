"""The legacy tagged lines on stderr, immediately and verbatim.

Which lines appear follows the seed's flags: the per-burst phase line at trace level >= 1,
the verify sub-split line at level 2, and the ``[spec-prof*]`` lines with the profile on.
Each record's lines go out in one locked write, so threads never interleave a line.
"""

from __future__ import annotations

from ..legacy import PROF_SUMMARY_TAG, phase_lines, prof_line, prof_rounds_lines
from ..linewriter import LineWriter, stderr_writer
from ..records import SpecPhaseNs, VerifySplit
from ..timeline import (
    BurstRecord,
    FirstTokenRecord,
    ProfRowsRecord,
    ProfSummaryRecord,
    SessionRecord,
)
from .base import Sink

__all__ = ["StderrSink"]


class StderrSink(Sink):
    """Writes the legacy lines for the records it is given."""

    def __init__(
        self, level: int = 1, prof: bool = False, writer: LineWriter | None = None
    ) -> None:
        self.level = level
        self.prof = prof
        self.writer = writer if writer is not None else stderr_writer()
        # Tags are per session; the burst record only carries the session id.
        self._tags: dict[int, tuple[str, str]] = {}
        if level < 1:
            self.on_burst = Sink.on_burst.__get__(self)  # type: ignore[method-assign]
        if not prof:
            self.on_first_token = Sink.on_first_token.__get__(self)  # type: ignore[method-assign]
            self.on_prof_rows = Sink.on_prof_rows.__get__(self)  # type: ignore[method-assign]
            self.on_prof_summary = Sink.on_prof_summary.__get__(self)  # type: ignore[method-assign]

    def on_session(self, rec: SessionRecord) -> None:
        self._tags[rec.session] = (rec.tag, rec.tag_v)

    def on_session_end(self, rec: object) -> None:
        self._tags.pop(rec.session, None)  # type: ignore[attr-defined]

    def on_burst(self, rec: BurstRecord) -> None:
        tag, tag_v = self._tags.get(rec.session, ("spec-phase", "spec-phase-v"))
        split = VerifySplit(*rec.split_ns) if rec.split_ns is not None else None
        p: SpecPhaseNs = rec.phases
        self.writer.write_lines(phase_lines(p, tag, tag_v, rec.k, self.level, split))

    def on_first_token(self, rec: FirstTokenRecord) -> None:
        self.writer.write_lines([prof_line(rec.prof)])

    def on_prof_rows(self, rec: ProfRowsRecord) -> None:
        self.writer.write_lines(prof_rounds_lines(rec.rows, rec.start))

    def on_prof_summary(self, rec: ProfSummaryRecord) -> None:
        lines = [f"[{PROF_SUMMARY_TAG}] {rec.summary}"]
        self.writer.write_lines([*lines, rec.advice] if rec.advice else lines)
