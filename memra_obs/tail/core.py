"""One stream through the tail: bytes in, the same bytes out, records to the exporters.

:class:`Tail` is the part with no I/O policy of its own, so tests and the benchmark drive it
directly: ``feed(chunk, t)`` passes the chunk's complete lines through at once (a partial
last line waits for its newline, at most ~0.1 s, so the tail's own notes and other writers
do not land inside someone's line), scans each line (``[`` first, then the parser),
hands the legacy ones to the :class:`~memra_obs.tail.rebuild.Rebuilder`, and gives the
finished records to ``publish`` in one batch per chunk.

Never raises on input: a tagged line that does not parse is counted by kind, reported (line
number and reason) and skipped; bytes that are not UTF-8 pass through as they came.
"""

from __future__ import annotations

import os
import select
import struct
from collections.abc import Callable
from typing import BinaryIO

from ..events import Record
from ..legacy import (
    FAST_PHASE,
    FAST_ROW,
    FAST_TAGS_EXCLUDED,
    FAST_VERIFY,
    PHASE,
    PROF_ROUNDS,
    VERIFY,
    LegacyParseError,
    scan_line,
)
from .rebuild import Rebuilder
from .stats import TailStats

__all__ = ["MAX_LINE", "Tail"]

#: A line longer than this (no newline in 1 MiB) is nobody's legacy line: it is passed
#: through and counted as ``other`` without being kept whole in memory.
MAX_LINE = 1 << 20

_ROW_HEAD = "[spec-prof-rounds] "
#: "0".."9999" -> int: the fast row pattern's short counts, without int()'s call.
_SMALL = {str(i): i for i in range(10_000)}
_F32X5 = struct.Struct("<5f")


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
        """A chunk read at ``t`` (ns, monotonic): its complete lines go through now."""
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
        lines = blob.decode("utf-8", "replace").split("\n")
        lines.pop()  # the empty piece after the last newline
        if self._skipping:
            self._skipping = False
            self.lineno += 1
            self.stats.lines["other"] += 1
            del lines[0]
        self._lines(lines, t)
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
                self._lines([buf.decode("utf-8", "replace")], t)
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
            self.stats.orphans["phase"] += 1
            self._bad(self.lineno, why, "")

    def _lines(self, lines: list[str], t: int) -> None:
        """Scan and rebuild ``lines``. The common shapes (rows, phase and level-2 lines)
        go through the parser's fast patterns (:data:`memra_obs.legacy.FAST_ROW` ...),
        which accept only lines ``scan_line`` would return the same values for; anything
        else, malformed lines included, goes through ``scan_line`` itself."""
        st = self.stats
        counts = st.lines
        rb = self.rebuilder
        feed = rb.feed
        put_row = rb.row
        put_phase = rb.phase
        put_verify = rb.verify
        scan = scan_line
        row_match = FAST_ROW
        phase_match = FAST_PHASE
        verify_match = FAST_VERIFY
        excluded = FAST_TAGS_EXCLUDED
        small = _SMALL
        pack = _F32X5.pack
        unpack = _F32X5.unpack
        n = self.lineno
        other = nrows = nphase = nverify = 0
        for text in lines:
            n += 1
            if text[:19] == _ROW_HEAD:  # most legacy lines are rows
                m = row_match(text)
                if m is not None:
                    i, w, d, v, a, r, k, j, c, q = m.groups()
                    w, d, v, a, r = unpack(pack(float(w), float(d), float(v), float(a), float(r)))
                    nrows += 1
                    why = put_row(
                        (
                            small[i],
                            round(w * 1e6),
                            round(d * 1e6),
                            round(v * 1e6),
                            round(a * 1e6),
                            round(r * 1e6),
                            (small[k], small[j], int(c), small[q]),
                        ),
                        t,
                    )
                    if why is not None:
                        st.orphans[PROF_ROUNDS] += 1
                        self._bad(n, why, text)
                    continue
            elif text[:1] != "[":  # the common case for other programs' lines
                other += 1
                continue
            elif " total=" in text:
                m = phase_match(text)
                if m is not None:
                    g = m.groups()
                    tag = g[0]
                    if tag not in excluded:
                        nphase += 1
                        why = put_phase(tag, (int(g[1]), int(g[2]), *g[3:]), t)
                        if why is not None:
                            st.orphans[PHASE] += 1
                            self._bad(n, why, text)
                        continue
            else:
                m = verify_match(text)
                if m is not None:
                    g = m.groups()
                    tag = g[0]
                    if tag not in excluded:
                        nverify += 1
                        why = put_verify(tag, (int(g[1]), int(g[2]), *g[3:]), t)
                        if why is not None:
                            st.orphans[VERIFY] += 1
                            self._bad(n, why, text)
                        continue
            try:
                s = scan(text)
            except LegacyParseError as exc:
                kind = _kind_of(text)
                st.malformed[kind] += 1
                counts[kind] += 1
                self._bad(n, f"malformed {kind} line: {exc.reason}", text)
                continue
            if s is None:
                other += 1
                continue
            kind = s[0]
            counts[kind] += 1
            why = feed(kind, s[1], s[2], t)
            if why is not None:
                st.orphans[kind] += 1
                self._bad(n, why, text)
        self.lineno = n
        counts["other"] += other
        counts[PROF_ROUNDS] += nrows
        counts[PHASE] += nphase
        counts[VERIFY] += nverify
        self._publish()

    def _bad(self, lineno: int, why: str, text: str) -> None:
        self.reports += 1
        if self.reports <= self.report_limit:
            excerpt = text if len(text) <= 80 else text[:77] + "..."
            self.note(f"{self.name}:{lineno}: {why}" + (f": {excerpt!r}" if text else ""))
        elif self.reports == self.report_limit + 1:
            self.note(
                f"more than {self.report_limit} bad lines; counting the rest without reporting "
                "(memra_obs_tail_malformed_lines_total, memra_obs_tail_orphan_lines_total)"
            )
