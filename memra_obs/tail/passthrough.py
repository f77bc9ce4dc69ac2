"""One stream through the tail: bytes in, the same bytes out, records to the exporters.

:class:`Tail` has no I/O policy of its own (tests and the benchmark drive it) and never raises
on input: a tagged line that does not parse is counted, reported (line number and reason) and
skipped; bytes that are not UTF-8 pass through as they came."""

from __future__ import annotations

import os
import select
from collections.abc import Callable
from typing import BinaryIO

from ..diagnostics import printable
from ..legacy import KIND, PHASE, CriJoin, FirstTokenLine, LegacyParseError, RoundsLine, parse_line
from ..timeline import Record
from .rebuild import FAMILY_CAP, Rebuilder
from .stats import TailStats

__all__ = ["MAX_LINE", "Tail"]

#: A line longer than this (no newline in 1 MiB) is nobody's legacy line: passed through,
#: counted as ``other`` and reported, never kept whole in memory.
MAX_LINE = 1 << 20
_OVERLONG = f"a line over {MAX_LINE} bytes; passed through, not parsed"


class Tail:
    """One worker's stderr bytes -> ``out`` (a binary stream, an fd, or None), and each chunk's
    records as one batch to ``publish``. ``notes``: where the tail's own lines go (default: the
    output, between lines); ``max_devices``: so a garbled ``[spec-prof]`` cannot mint series."""

    def __init__(self, rebuilder: Rebuilder, publish: Callable[[list[Record]], None], *,
                 out: BinaryIO | int | None = 2, name: str = "-",
                 notes: Callable[[str], None] | None = None, report_limit: int = 20,
                 max_devices: int = 64) -> None:  # fmt: skip
        self.rebuilder, self.publish, self.name = rebuilder, publish, name
        self.stats = TailStats(rebuilder)
        self.lineno = self.reports = 0
        self.report_limit, self.max_devices, self._capped = report_limit, max_devices, False
        #: Lines the output refused (a full disk, a closed pipe): published all the same.
        self.lost_lines = 0
        self._write, self._note_to = _writer(out, self._lost), notes
        self._write_notes = _writer(out, lambda rest: None)  # its own: no line of the input
        self._notes: list[bytes] = []
        # The partial last line (kept until its newline), how much of it already went
        # through (see tick) and since when; the output at a line boundary; an over-long line.
        self._buf, self._written, self._since, self._bol, self._skipping = b"", 0, 0, True, False
        self._ended = False  # close() ran: no line boundary will come to wait for
        self._cri = CriJoin(MAX_LINE)  # a pod's log: a line's CRI parts are read as one

    def _lost(self, rest: bytes | memoryview) -> None:
        self.lost_lines += bytes(rest).count(b"\n")  # a line counts once: by its newline

    def note(self, text: str) -> None:
        """One line of the tail's own on the output, between passed-through lines (a file
        name's ESC or newline spelled out: :func:`~memra_obs.diagnostics.printable`)."""
        text = printable(text)
        if self._note_to is not None:
            self._note_to(text)
            return
        self._notes.append(f"[memra-obs] tail: {text}\n".encode("utf-8", "replace"))
        self._flush_notes()

    def _flush_notes(self) -> None:
        """Held notes out, at a line boundary; after the end no boundary comes: make one."""
        if self._notes and (self._bol or self._ended):
            if not self._bol:  # the input ended mid-line
                self._write_notes(b"\n")
                self._bol = True
            notes, self._notes = self._notes, []
            self._write_notes(b"".join(notes))

    def feed(self, data: bytes, t: int) -> None:
        """A chunk read at ``t`` (ns, monotonic): its complete lines go through now, a partial
        last line waits for its newline (at most ~0.1 s: so notes never land inside a line)."""
        self.stats.bytes += len(data)
        cut = data.rfind(b"\n") + 1
        if not cut:
            if not self._buf:
                self._since = t
            self._buf += data
        else:
            pend, done = self._buf, self._written
            blob = b"".join((pend, memoryview(data)[:cut])) if pend else data[:cut]
            self._write(memoryview(blob)[done:] if done else blob)
            self._buf, self._written, self._since, self._bol = data[cut:], 0, t, True
            self._flush_notes()
            # One decode a chunk: "\n" never occurs inside a UTF-8 sequence, so lines split
            # where the bytes do; undecodable bytes become U+FFFD here (failing any legacy
            # shape) while the output keeps them as they came.
            text = blob.decode("utf-8", "replace")
            if self._skipping:  # the end of an over-long line
                text = text[text.index("\n") + 1 :]
                self._skip_line()
            self._lines(text, t)
        if len(self._buf) > MAX_LINE:
            if not self._skipping:
                self._bad(self.lineno + 1, _OVERLONG, "")
            self._write(self._buf[self._written :])
            self._buf, self._written, self._bol, self._skipping = b"", 0, False, True

    def tick(self, t: int, partial_ns: int = 100_000_000) -> None:
        """Time passed: a partial line older than ``partial_ns`` goes through (it is parsed
        when its newline comes); the rebuilder settles what its lines left open."""
        if self._written < len(self._buf) and t - self._since >= partial_ns:
            self._write(self._buf[self._written :])
            self._written, self._bol = len(self._buf), False
        self.rebuilder.tick(t)
        self._publish()

    def settle(self, t: int, end_line: bool = False) -> None:
        """The input rotated or ended: a partial last line is a whole line now. ``end_line``
        (a rotation): the output gets the newline it lacked, or the next file's first line
        would be glued to it (an input's own end keeps its bytes as they came)."""
        buf, self._buf = self._buf, b""
        self._write(buf[self._written :])
        self._written, self._bol = 0, self._bol and not buf
        if end_line and not self._bol:
            self._write(b"\n")
            self._bol = True
        if self._skipping:  # the over-long line ends here, with or without a last piece
            self._skip_line()
        elif buf:
            self._lines(buf.decode("utf-8", "replace") + "\n", t)
        self._publish()

    def close(self, t: int) -> None:
        """End of input: the partial line, then every open burst and session; notes, held or
        still to come, go out last (after a newline if the input lacked one)."""
        self.settle(t)
        self.rebuilder.close()
        self._publish()
        self._ended = True
        self._flush_notes()

    def _skip_line(self) -> None:  # the end of an over-long line: another program's line
        self._skipping = False
        self.lineno += 1
        self.stats.lines["other"] += 1

    def _problems(self, lineno: int) -> None:
        """What line ``lineno`` closed: refused bursts (unplaced phase lines)."""
        for why in self.rebuilder.problems:
            self._bad(lineno, why, "", PHASE)
        self.rebuilder.problems.clear()

    def _publish(self) -> None:
        self._problems(self.lineno)
        if recs := self.rebuilder.take():
            self.publish(recs)

    def _lines(self, text: str, t: int) -> None:
        """Parse and place the lines of ``text`` (each ends in a newline), then publish."""
        lines = text.split("\n")[:-1]  # nothing after the last newline
        st, rb = self.stats, self.rebuilder
        seen, feed, problems, cri = st.lines, rb.feed, rb.problems, self._cri
        long = len(text) > MAX_LINE  # a line over MAX_LINE can only be whole in a big chunk
        n, other, rows = self.lineno, 0, 0
        for line in lines:
            n += 1
            if long and len(line) > MAX_LINE:
                other += 1
                self._bad(n, _OVERLONG, "")
                continue
            if line[:1] != "[":  # no legacy line starts otherwise; a CRI part joins its line
                was, line = cri.overlong, cri(line)
                if cri.overlong != was:  # its parts joined past MAX_LINE
                    other += 1
                    self._bad(n, _OVERLONG, "")
                    continue
            try:
                rec = parse_line(line)
            except LegacyParseError as exc:
                seen[exc.kind] += 1
                st.malformed[exc.kind] += 1
                self._bad(n, f"malformed {exc.kind} line: {exc.reason}", line)
                continue
            if rec is None:
                other += 1
                continue
            if type(rec) is RoundsLine:  # most lines: counted once a chunk
                rows += 1
            else:
                seen[KIND[type(rec)]] += 1
                if type(rec) is FirstTokenLine and (why := self._too_many_devices(rec)):
                    st.malformed[KIND[FirstTokenLine]] += 1
                    self._bad(n, f"malformed prof line: {why}", line)
                    continue
            why = feed(rec, t)
            if why is not None:
                self._bad(n, why, line, KIND[type(rec)])
            if problems:  # a burst this line closed was refused
                self._problems(n)
        self.lineno = n
        seen["other"] += other
        seen[KIND[RoundsLine]] += rows
        self._publish()

    def _too_many_devices(self, rec: FirstTokenLine) -> str | None:
        for name in ("free_mb_before", "free_mb_after"):
            snap, top = getattr(rec.prof, name), self.max_devices
            if len(snap) > top or any(o >= top for o, _ in snap):
                return f"{name} names more than {top} devices (MEMRA_OBS_MAX_DEVICES)"
        return None

    def _bad(self, lineno: int, why: str, text: str, orphan: str = "") -> None:
        """Report a bad line (``orphan``: the kind of a valid line that could not be placed,
        counted here); the first ``report_limit`` one by one, then only counted."""
        if orphan:
            self.stats.orphans[orphan] += 1
        if why.startswith(FAMILY_CAP):  # a stream of new tags: said once, then only counted
            if self._capped:
                return
            self._capped = True
        self.reports += 1
        if self.reports <= self.report_limit:
            excerpt = text if len(text) <= 80 else text[:77] + "..."
            self.note(f"{self.name}:{lineno}: {why}" + (f": {excerpt!r}" if text else ""))
        elif self.reports == self.report_limit + 1:
            self.note(
                f"more than {self.report_limit} bad lines; counting the rest without reporting "
                "(memra_obs_tail_malformed_lines_total, memra_obs_tail_orphan_lines_total)"
            )


def _writer(
    out: BinaryIO | int | None, lost: Callable[[bytes | memoryview], None]
) -> Callable[[bytes | memoryview], None]:
    """Whole writes to ``out``; what it refuses goes to ``lost`` (publishing goes on: the
    output that failed is where it would be said)."""

    def write(b: bytes | memoryview) -> None:
        if isinstance(out, int):
            view = memoryview(b)
            while view:
                try:
                    view = view[os.write(out, view) :]
                except BlockingIOError:  # a non-blocking stderr that is full: wait, as the
                    select.select([], [out], [], 1.0)  # worker itself would have
                except OSError:
                    lost(view)
                    return
        elif out is not None:
            try:
                out.write(b)
                out.flush()
            except (OSError, ValueError):
                lost(b)

    return write
