"""One stream through the tail: bytes in, the same bytes out, records to the exporters.

:class:`Tail` is the part with no I/O policy of its own, so tests and the benchmark drive it
directly: ``feed(chunk, t)`` passes the chunk's complete lines through at once (a partial
last line waits for its newline, at most ~0.1 s, so the tail's own notes and other writers
do not land inside someone's line), scans the chunk's lines (the C scanner
:data:`C_SCAN`, or one tokenizing regex, for the common shapes; the parser for the rest),
hands the legacy ones to the :class:`~memra_obs.tail.rebuild.Rebuilder`, and gives the
finished records to ``publish`` in one batch per chunk.

Never raises on input: a tagged line that does not parse is counted by kind, reported (line
number and reason) and skipped; bytes that are not UTF-8 pass through as they came.
"""

from __future__ import annotations

import gc
import os
import select
from array import array
from collections.abc import Callable
from itertools import compress, repeat
from operator import itemgetter, mul
from typing import BinaryIO

from ..events import Record
from ..legacy import (
    FAST_PHASE,
    FAST_ROW_LINES,
    FAST_TAGS_EXCLUDED,
    FAST_VERIFY,
    PHASE,
    PROF_ROUNDS,
    VERIFY,
    LegacyParseError,
    scan_line,
)
from .rebuild import Rebuilder, RowColumns
from .stats import TailStats

__all__ = ["MAX_LINE", "Tail"]

#: A line longer than this (no newline in 1 MiB) is nobody's legacy line: it is passed
#: through and counted as ``other`` without being kept whole in memory.
MAX_LINE = 1 << 20

try:  # the C scanner (setup.py builds it where a compiler is found)
    from ._scan import scan as C_SCAN
except ImportError:  # pragma: no cover - a build without it: the pure-Python path
    C_SCAN = None

_ROW_HEAD = "[spec-prof-rounds] "
#: "0".."9999" -> int: the fast row pattern's short counts, without int()'s call.
_SMALL = {str(i): i for i in range(10_000)}.__getitem__
_first = itemgetter(0)


def _row_columns(rows: list[tuple[str, ...]], n: int) -> RowColumns:
    """The ``n`` rows FAST_ROW_LINES took apart, as the rebuilder's columns: row indices,
    wall, draft, verify, accept, rest (each ns ``round(f32_ms * 1e6)``: the float, its f32
    — an ``array('f')`` rounds as ``struct``'s ``f`` does —, times 1e6, rounded), and
    (k, j, ctx, seq_rows) tuples. One map per step over all five time columns at once."""
    i, w, d, v, a, r, k, j, c, q, _ = zip(*rows, strict=True)
    ns = list(map(round, map(mul, array("f", map(float, w + d + v + a + r)), repeat(1e6))))
    return (
        list(map(_SMALL, i)),
        ns[:n],
        ns[n : 2 * n],
        ns[2 * n : 3 * n],
        ns[3 * n : 4 * n],
        ns[4 * n :],
        list(zip(map(_SMALL, k), map(_SMALL, j), map(int, c), map(_SMALL, q), strict=True)),
    )


def _kind_of(text: str) -> str:
    """The kind a malformed tagged line claims to be (for the malformed counter's label)."""
    if text.startswith("[spec-prof-rounds]"):
        return "prof_rounds"
    if text.startswith("[spec-prof-summary]"):
        return "prof_summary"
    if text.startswith("[spec-prof"):
        return "prof"
    if text.startswith("[spec-trace]"):
        return "override"
    return "verify" if "vkda=" in text else "phase"


class Tail:
    """Bytes of one worker's stderr -> pass-through + records for ``publish``.

    ``out``: where the bytes go on (a binary stream, or an fd; None = nowhere).
    ``publish``: called with each non-empty batch of records, in order.
    ``notes``: where the tail's own lines (reports) go; default: the output, between
    passed-through lines.
    ``report_limit``: malformed/orphan lines reported one by one before only counting.
    """

    def __init__(
        self,
        rebuilder: Rebuilder,
        publish: Callable[[list[Record]], None],
        *,
        out: BinaryIO | int | None = 2,
        name: str = "-",
        stats: TailStats | None = None,
        notes: Callable[[str], None] | None = None,
        report_limit: int = 20,
    ) -> None:
        self.rebuilder = rebuilder
        self.publish = publish
        self.name = name
        self.stats = stats or TailStats()
        self.stats.rounds = lambda: (rebuilder.rounds_from_rows, rebuilder.rounds_from_means)
        self.stats.sessions = lambda: rebuilder.sessions
        self.lineno = 0
        self.report_limit = report_limit
        self.reports = 0
        self._out = out
        self._write = self._writer(out)
        self._buf = b""  # the partial last line, kept until its newline for scanning
        self._written = 0  # how much of it already went through (see tick)
        self._since = 0  # when it started
        self._bol = True  # the output stands at a line boundary
        self._skipping = False  # inside an over-long line
        self._notes: list[bytes] = []
        self._note_to = notes
        self._chunk = ""  # the text being scanned, its lines (split for a report) and
        self._chunk_lines: list[str] | None = None  # the line number before it
        self._chunk_n0 = 0

    # -- output --------------------------------------------------------------------------

    @staticmethod
    def _writer(out: BinaryIO | int | None) -> Callable[[bytes], None]:
        if out is None:
            return lambda b: None
        if isinstance(out, int):
            fd = out

            def write_fd(b: bytes) -> None:
                view = memoryview(b)
                while view:
                    try:
                        n = os.write(fd, view)
                    except BlockingIOError:  # a non-blocking stderr that is full: wait, as
                        select.select([], [fd], [], 1.0)  # the worker itself would have
                        continue
                    except OSError:
                        return  # stderr closed: publishing goes on without it
                    view = view[n:]

            return write_fd
        stream = out

        def write_stream(b: bytes) -> None:
            try:
                stream.write(b)
                stream.flush()
            except (OSError, ValueError):
                pass

        return write_stream

    def note(self, text: str) -> None:
        """One line of the tail's own on the output, between passed-through lines."""
        if self._note_to is not None:
            self._note_to(text)
            return
        self._notes.append(f"[memra-obs] tail: {text}\n".encode("utf-8", "replace"))
        if self._bol:
            self._flush_notes()

    def _flush_notes(self) -> None:
        if self._notes:
            notes, self._notes = self._notes, []
            self._write(b"".join(notes))

    # -- input ---------------------------------------------------------------------------

    def feed(self, data: bytes, t: int) -> None:
        """A chunk read at ``t`` (ns, monotonic): its complete lines go through now (with
        the cycle collector paused while they are scanned and published)."""
        if not data:
            return
        self.stats.bytes += len(data)
        cut = data.rfind(b"\n") + 1
        if not cut:
            if not self._buf:
                self._since = t
            self._buf += data
            if len(self._buf) > MAX_LINE:
                self._overlong()
            return
        if self._buf:
            pend = self._buf
            self._write(pend[self._written :] + data[:cut])
            blob = pend + data[:cut]
        else:
            blob = data[:cut] if cut < len(data) else data
            self._write(blob)
        self._buf = data[cut:]
        self._written = 0
        self._since = t
        self._bol = True
        if self._notes:
            self._flush_notes()
        # One decode per chunk: "\n" never occurs inside a UTF-8 sequence, so the lines split
        # where the bytes do; undecodable bytes become U+FFFD here (and fail any legacy shape)
        # while the output keeps them as they came.
        text = blob.decode("utf-8", "replace")
        if self._skipping:
            self._skipping = False
            self.lineno += 1
            self.stats.lines["other"] += 1
            text = text[text.index("\n") + 1 :]
        if text:
            # A chunk makes tens of thousands of short-lived containers, all freed by their
            # reference counts; left on, the cycle collector would run dozens of times a
            # chunk, each time walking whatever young objects are alive (3-8 % of the tail's
            # time, measured). Off for the chunk (~2 ms, process-wide), it runs once after.
            paused = gc.isenabled()
            if paused:
                gc.disable()
            try:
                self._text(text, t)
            finally:
                if paused:
                    gc.enable()
        if len(self._buf) > MAX_LINE:
            self._overlong()

    def tick(self, t: int, partial_ns: int = 100_000_000) -> None:
        """Time passed: a partial line older than ``partial_ns`` goes through (it is scanned
        when its newline comes); the rebuilder settles what its lines left open."""
        if self._buf and self._written < len(self._buf) and t - self._since >= partial_ns:
            self._write(self._buf[self._written :])
            self._written = len(self._buf)
            self._bol = False
        self.rebuilder.tick(t)
        self._publish()

    def settle(self, t: int) -> None:
        """The input rotated or ended: a partial last line is a whole line now."""
        if self._buf:
            buf, self._buf = self._buf, b""
            self._write(buf[self._written :])
            self._written = 0
            self._bol = buf.endswith(b"\n")
            if self._skipping:
                self._skipping = False
                self.lineno += 1
                self.stats.lines["other"] += 1
            else:
                self._text(buf.decode("utf-8", "replace") + "\n", t)
        self._publish()

    def close(self, t: int) -> None:
        """End of input: the partial line, then every open burst and session; notes still
        held for a line boundary go out last (after a newline if the input lacked one)."""
        self.settle(t)
        self.rebuilder.close()
        self._publish()
        if self._notes and not self._bol:
            self._write(b"\n")
            self._bol = True
        self._flush_notes()

    def _overlong(self) -> None:
        self._write(self._buf[self._written :])
        self._buf = b""
        self._written = 0
        self._bol = False
        self._skipping = True

    def _publish(self) -> None:
        rb = self.rebuilder
        if rb.problems:
            self._problems()
        recs = rb.take()
        if recs:
            self.publish(recs)

    def _problems(self) -> None:
        """Bursts the rebuilder refused while laying them out: counted with the phase
        lines that could not be placed, reported like them."""
        probs = self.rebuilder.problems
        self.rebuilder.problems = []
        for why in probs:
            self._orphan(PHASE, self.lineno, why, "")

    def _text(self, text: str, t: int) -> None:
        """Scan and rebuild the lines of ``text`` (each ends in "\\n"), then publish.

        The three shapes that make up almost every legacy line — ``[spec-prof-rounds]``
        rows, phase lines, level-2 lines — go through the C scanner (:data:`C_SCAN`) or,
        where it was not built, through the parser's fast patterns; each run of
        consecutive rows goes to the rebuilder in one call. Any other line starting with
        "[" goes through :meth:`_tagged` (``scan_line``, which does every check and gives
        every reason). Both fast paths accept only lines ``scan_line`` returns the same
        values for."""
        self._chunk = text
        self._chunk_lines = None
        self._chunk_n0 = self.lineno
        if C_SCAN is not None:
            self._scanned(text, t)
        else:
            self._tokens(text, t)
        self._chunk = ""
        self._chunk_lines = None
        self._publish()

    def _scanned(self, text: str, t: int) -> None:
        """:meth:`_text` through the C scanner: one call a chunk, then one step per event
        (a run of rows, a phase line, a level-2 line, a line for the Python path)."""
        try:
            events, cols, nlines, plain = C_SCAN(text)
        except Exception:  # (out of memory, say) the Python path does the chunk instead
            self._tokens(text, t)
            return
        n0 = self.lineno + 1  # the number of the chunk's line 0
        rb = self.rebuilder
        put = (None, rb.phase, rb.verify)  # by event kind
        kinds = (PROF_ROUNDS, PHASE, VERIFY)
        seen = [0, 0, 0]
        for ev in events:
            kind = ev[0]
            if kind == 0:
                self._rows(cols, ev[2], ev[3], n0 + ev[1], t)
            elif kind < 3:  # a phase or level-2 line
                seen[kind] += 1
                why = put[kind](ev[2], ev[3], t)  # type: ignore[misc]
                if why is not None:
                    self._orphan(kinds[kind], n0 + ev[1], why, None)
            else:
                self._tagged(ev[2], n0 + ev[1], t)
        self.lineno += nlines
        counts = self.stats.lines
        counts["other"] += plain
        if cols is not None:
            counts[PROF_ROUNDS] += len(cols[0])
        counts[PHASE] += seen[1]
        counts[VERIFY] += seen[2]

    def _tokens(self, text: str, t: int) -> None:
        """:meth:`_text` in Python: one tokenizing pass
        (:data:`memra_obs.legacy.FAST_ROW_LINES`) splits the text into lines and takes
        apart every row the fast pattern accepts; the rows' numbers are converted a column
        at a time (C-level maps, no Python step per value)."""
        toks = FAST_ROW_LINES(text)
        rows = list(compress(toks, map(_first, toks)))
        nrows = len(rows)
        if nrows:
            cols = _row_columns(rows, nrows)
        tagged = self._tagged
        n = self.lineno
        other = 0
        ri = 0  # rows handed over so far
        run = 0  # rows in the run being gathered
        for tok in toks:
            n += 1
            if tok[0]:  # a row (most legacy lines are)
                run += 1
                continue
            if run:
                self._rows(cols, ri, ri + run, n - run, t)
                ri += run
                run = 0
            text = tok[10]
            if text[:1] != "[":  # the common case for other programs' lines
                other += 1
            else:
                tagged(text, n, t)
        if run:
            self._rows(cols, ri, ri + run, n + 1 - run, t)
        self.lineno = n
        counts = self.stats.lines
        counts["other"] += other
        counts[PROF_ROUNDS] += nrows

    def _tagged(self, text: str, n: int, t: int) -> None:
        """Line ``n``, starting with "[", that no fast row took: a phase or level-2 line
        through its fast pattern, anything else through ``scan_line``."""
        st = self.stats
        rb = self.rebuilder
        if text[:19] != _ROW_HEAD:  # (a row the fast pattern refused: scan_line says why)
            phase = " total=" in text  # only a phase line has one; else try a level-2 line
            m = (FAST_PHASE if phase else FAST_VERIFY)(text)
            if m is not None and m.group(1) not in FAST_TAGS_EXCLUDED:
                g = m.groups()
                kind = PHASE if phase else VERIFY
                st.lines[kind] += 1
                put = rb.phase if phase else rb.verify
                why = put(g[0], (int(g[1]), int(g[2]), *g[3:]), t)
                if why is not None:
                    self._orphan(kind, n, why, text)
                return
        try:
            s = scan_line(text)
        except LegacyParseError as exc:
            kind = _kind_of(text)
            st.malformed[kind] += 1
            st.lines[kind] += 1
            self._bad(n, f"malformed {kind} line: {exc.reason}", text)
            return
        if s is None:
            st.lines["other"] += 1
            return
        kind = s[0]
        st.lines[kind] += 1
        why = rb.feed(kind, s[1], s[2], t)
        if why is not None:
            self._orphan(kind, n, why, text)

    def _rows(self, cols: RowColumns, a: int, z: int, lineno: int, t: int) -> None:
        """Rows ``a:z`` of the chunk's row columns (the first on line ``lineno``) to the
        rebuilder; the ones it cannot place are counted and reported by line."""
        bad = self.rebuilder.rows(cols, a, z, t)
        if bad:
            for i, why in bad:
                self._orphan(PROF_ROUNDS, lineno + i, why, None)

    def _orphan(self, kind: str, lineno: int, why: str, text: str | None) -> None:
        """A valid line the rebuilder could not place: counted by kind and reported."""
        self.stats.orphans[kind] += 1
        self._bad(lineno, why, text)

    def _line(self, lineno: int) -> str:
        """The text of line ``lineno`` of the chunk being scanned (for a report)."""
        lines = self._chunk_lines
        if lines is None:
            lines = self._chunk_lines = self._chunk.split("\n")
        return lines[lineno - self._chunk_n0 - 1]

    def _bad(self, lineno: int, why: str, text: str | None) -> None:
        self.reports += 1
        if self.reports <= self.report_limit:
            if text is None:
                text = self._line(lineno)
            excerpt = text if len(text) <= 80 else text[:77] + "..."
            self.note(f"{self.name}:{lineno}: {why}" + (f": {excerpt!r}" if text else ""))
        elif self.reports == self.report_limit + 1:
            self.note(
                f"more than {self.report_limit} bad lines; counting the rest without reporting "
                "(memra_obs_tail_malformed_lines_total, memra_obs_tail_orphan_lines_total)"
            )
