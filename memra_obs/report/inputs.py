"""A worker's stderr log or a span file -> one run's records (plain data for the page).

The report re-derives nothing: a log goes through :func:`memra_obs.legacy.parse_line` (the
one grammar) and the tail's Rebuilder (:func:`rebuild`, the only place here that touches
it), so its records are those ``memra-obs tail`` publishes for the same lines. A span file
(OTLP-JSON lines this package wrote) is read back into the same records from the DESIGN §4
tree; rounds past the span cap exist there only as burst totals, and are rebuilt the way a
log's rounds without rows are (the burst's remainder spread evenly, counts unknown).
"""

from __future__ import annotations

import itertools
import os
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from ..legacy import (
    LegacyLine,
    LegacyParseError,
    RoundsLine,
    SummaryLine,
    parse_line,
)
from ..records import SpecRoundProf
from ..timeline import (
    BurstRecord,
    FirstTokenRecord,
    Record,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
    each_round,
)

__all__ = ["RoundLog", "Run", "read", "rebuild"]

CHUNK = 1 << 22


@dataclass
class RoundLog:
    """One session's round log: the rows its summary covers (the first 64 rounds) and that
    summary (``lineno`` 0: recomputed with ``SpecRoundsLog.summary`` from a span file)."""

    rows: list[SpecRoundProf] = field(default_factory=list)
    summary: SummaryLine | None = None
    lineno: int = 0


@dataclass
class Run:
    """Everything the page shows of one input, as records and parsed lines."""

    name: str
    kind: str = "log"
    size: int = 0
    lines: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    #: (line number, reason, the line's start) for every line the parser refused.
    refused: list[tuple[int, str, str]] = field(default_factory=list)
    #: (line number, why) for valid lines the rebuild could not place.
    unplaced: list[tuple[int, str]] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)
    bursts: list[BurstRecord] = field(default_factory=list)
    first_tokens: list[FirstTokenRecord] = field(default_factory=list)
    ends: list[SessionEndRecord] = field(default_factory=list)
    logs: list[RoundLog] = field(default_factory=list)
    #: Span files: rounds past the span cap (no spans, times from their burst's totals).
    unsampled: int = 0
    notes: list[str] = field(default_factory=list)


def read(path: str, progress: Callable[[int, int], None] | None = None) -> Run:
    """Read one input (``-`` = standard input); ``progress(done, total)`` gets bytes read
    (total 0 when unknown). Raises OSError when it cannot be opened."""
    f: BinaryIO = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    try:
        st = os.fstat(f.fileno())
        run = Run("stdin" if path == "-" else path, size=st.st_size if path != "-" else 0)
        chunks = _chunks(f, progress, run)
        first = next(chunks, b"")
        if first.lstrip()[:1] == b"{" and b'"resourceSpans"' in first[:65536]:
            run.kind = "spans"
        lines = _lines(first, chunks)
        if run.kind == "spans":
            from .spans import read_spans

            read_spans(lines, run)
        else:
            _read_log(lines, run)
        return run
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def _chunks(f: BinaryIO, progress: Callable[[int, int], None] | None, run: Run) -> Iterator[bytes]:
    total, done = run.size, 0
    while data := f.read(CHUNK):
        done += len(data)
        if progress is not None:
            progress(done, total)
        yield data
    run.size = done


def _lines(first: bytes, chunks: Iterator[bytes]) -> Iterator[str]:
    """Lines split on ``\\n`` only (as the tail splits), decoded whole: bytes that are not
    UTF-8 become U+FFFD, so such a tagged line is refused by the parser, with its reason."""
    rest = b""
    for c in itertools.chain((first,), chunks):
        cut = c.rfind(b"\n") + 1
        if not cut:
            rest += c
            continue
        text = (rest + c[:cut]).decode("utf-8", "replace")
        rest = c[cut:]
        yield from text.split("\n")[:-1]
    if rest:
        yield rest.decode("utf-8", "replace")


def _read_log(lines: Iterable[str], run: Run) -> None:
    def parsed() -> Iterator[tuple[int, LegacyLine]]:
        log = RoundLog(summary=SummaryLine(0))  # a closed one: the first row opens a log
        n = 0
        for n, line in enumerate(lines, 1):
            try:
                rec = parse_line(line)
            except LegacyParseError as exc:
                run.refused.append((n, exc.reason, line[:160]))
                continue
            if rec is None:
                continue
            run.kinds[rec.kind] += 1
            # The round logs as the worker kept them: row 0 opens a session's log, its
            # summary closes it (concurrent sessions interleave: see docs/REPORT.md).
            if isinstance(rec, RoundsLine):
                if log.summary is not None or rec.row == 0:
                    log = RoundLog()
                    run.logs.append(log)
                log.rows.append(rec.prof)
            elif isinstance(rec, SummaryLine):
                if log.summary is not None:
                    log = RoundLog()
                    run.logs.append(log)
                log.summary, log.lineno = rec, n
            yield n, rec
        run.lines = n

    records, run.unplaced = rebuild(parsed())
    into = {SessionRecord: run.sessions, BurstRecord: run.bursts,
            FirstTokenRecord: run.first_tokens, SessionEndRecord: run.ends}  # fmt: skip
    for r in records:
        if type(r) is RoundRecord:
            run.rounds.extend(each_round(r))  # type: ignore[arg-type]
        else:
            into[type(r)].append(r)  # type: ignore[index]


def rebuild(lines: Iterable[tuple[int, LegacyLine]]) -> tuple[list[Record], list[tuple[int, str]]]:
    """Parsed legacy lines ``(line number, record)`` -> the observer's records as the tail
    rebuilds them, and ``(line number, why)`` for each line it could not place.

    The only use of :class:`memra_obs.tail.rebuild.Rebuilder` in the report. Line numbers
    stand in for arrival stamps (1 ns apart): as when the tail reads a finished log, bursts
    lie back to back and no session ends by silence.
    """
    from ..tail.rebuild import Rebuilder

    rb = Rebuilder("report", rng=random.Random(0), epoch_ns=lambda: 0, mono_ns=lambda: 0)
    out: list[Record] = []
    unplaced: list[tuple[int, str]] = []
    for n, rec in lines:
        why = rb.feed(rec, n)
        if why is not None:
            unplaced.append((n, why))
        if rb.problems:  # bursts refused while being laid out
            unplaced += [(n, p) for p in rb.problems]
            rb.problems.clear()
        if n % 65536 == 0:
            out += rb.take()
    rb.close()
    out += rb.take()
    unplaced += [(0, p) for p in rb.problems]
    return out, unplaced
