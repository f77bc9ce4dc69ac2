"""The legacy tagged lines on stderr, immediately and verbatim: the phase line at trace level
>= 1, the verify split at level 2, ``[spec-prof*]`` and ``[spec-advice]`` with the profile on.
Each record's lines go out under one lock, in writes of whole lines of at most PIPE_BUF bytes,
so neither threads nor processes sharing the pipe tear a line.
"""

from __future__ import annotations

import contextlib

from .. import timeline as tl
from ..diagnostics import say_once
from ..legacy import PROF_SUMMARY_TAG, phase_lines, prof_line, prof_rounds_lines
from ..linewriter import LineWriter, stderr_writer
from ..records import VerifySplit
from .base import Sink

__all__ = ["StderrSink"]


class StderrSink(Sink):
    """Writes the legacy lines for the records it is given. At most ``max_sessions`` sessions'
    tags are kept (sessions never ended must not leak, as in the span builder): past it the
    oldest is forgotten, said once, and its lines say ``spec-phase``."""

    max_sessions = 4096

    def __init__(self, level: int = 1, prof: bool = False, writer: LineWriter | None = None):
        self.level, self.prof = level, prof
        self.writer = writer if writer is not None else stderr_writer()
        # Tags are per session; the burst record only carries the session id.
        self._tags: dict[int, tuple[str, str]] = {}
        # Hooks whose lines are off stay the base no-ops, so the observer never calls them.
        off = ["on_burst"] if level < 1 else []
        for name in off + ([] if prof else ["on_first_token", "on_prof_rows", "on_prof_summary"]):
            setattr(self, name, getattr(Sink, name).__get__(self))

    def on_session(self, rec: tl.SessionRecord) -> None:
        tags = self._tags
        while len(tags) >= self.max_sessions:  # loop threads trim at once: the same oldest, a
            with contextlib.suppress(RuntimeError):  # size changed mid-look: no raise, no leak
                tags.pop(next(iter(tags)), None)
            say_once("stderr-tags", f"legacy lines: over {self.max_sessions} sessions not "
                     "ended; the oldest one's lines now say spec-phase")  # fmt: skip
        tags[rec.session] = (rec.tag, rec.tag_v)

    def on_session_end(self, rec: tl.SessionEndRecord) -> None:
        self._tags.pop(rec.session, None)

    def _write(self, lines: list[str]) -> None:
        w = self.writer
        lost = w.errors
        w.write_lines(lines)
        if w.errors != lost:  # a closed stderr, a pipe whose reader died: the app's handlers
            say_once("stderr-lines", "legacy lines: stderr refused a write; those lines are "
                     'lost, counted in memra_obs_export_errors_total{signal="lines"}')  # fmt: skip

    def on_burst(self, rec: tl.BurstRecord) -> None:
        tag, tag_v = self._tags.get(rec.session, ("spec-phase", "spec-phase-v"))
        split = VerifySplit(*rec.split_ns) if rec.split_ns is not None else None
        self._write(phase_lines(rec.phases, tag, tag_v, rec.k, self.level, split))

    def on_first_token(self, rec: tl.FirstTokenRecord) -> None:
        self._write([prof_line(rec.prof)])

    def on_prof_rows(self, rec: tl.ProfRowsRecord) -> None:
        self._write(prof_rounds_lines(rec.rows, rec.start))

    def on_prof_summary(self, rec: tl.ProfSummaryRecord) -> None:
        lines = [f"[{PROF_SUMMARY_TAG}] {rec.summary}"]
        self._write([*lines, rec.advice] if rec.advice else lines)
