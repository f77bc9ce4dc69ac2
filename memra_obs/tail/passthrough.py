"""One stream through the tail: bytes in, the same bytes out, records to the exporters.

:class:`Tail` is the part with no I/O policy of its own, so tests and the benchmark drive it
directly: ``feed(chunk, t)`` passes the chunk's complete lines through at once (a partial
last line waits for its newline, at most ~0.1 s, so the tail's own notes and other writers
do not land inside someone's line), parses each line with the package's one parser
(:func:`memra_obs.legacy.parse_line`), hands the legacy ones to the
:class:`~memra_obs.tail.rebuild.Rebuilder`, and gives the finished records to ``publish`` in
one batch per chunk.

Never raises on input: a tagged line that does not parse is counted by kind, reported (line
number and reason) and skipped; bytes that are not UTF-8 pass through as they came; a line
over :data:`MAX_LINE` passes through and is reported, never kept whole in memory.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable
from typing import BinaryIO

from ..legacy import PHASE, PROF, LegacyParseError, parse_line
from ..records import SpecFirstTokenProf
from ..timeline import Record
from .rebuild import Rebuilder
from .stats import TailStats

__all__ = ["MAX_LINE", "Tail"]

#: A line longer than this (no newline in 1 MiB) is nobody's legacy line: it is passed
#: through, counted as ``other`` and reported, without being kept whole in memory.
MAX_LINE = 1 << 20


class Tail:
    """Bytes of one worker's stderr -> pass-through + records for ``publish``.

    ``out``: where the bytes go on (a binary stream, or an fd; None = nowhere).
    ``publish``: called with each non-empty batch of records, in order.
    ``notes``: where the tail's own lines (reports) go; default: the output, between
    passed-through lines.
    ``report_limit``: malformed/orphan lines reported one by one before only counting.
    ``max_devices``: CUDA ordinals a ``[spec-prof]`` line may name (``MEMRA_OBS_MAX_DEVICES``):
    a profile naming more is refused, so a garbled line cannot mint series.
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
        max_devices: int = 64,
    ) -> None:
        self.max_devices = max_devices
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
        text = blob.decode("utf-8", "replace")
        if self._skipping:
            self._skipping = False
            self.lineno += 1
            self.stats.lines["other"] += 1
            text = text[text.index("\n") + 1 :]
        if text:
            self._text(text, t)
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

    def _overlong_line(self, lineno: int) -> None:
        self.stats.overlong += 1
        self._bad(lineno, f"a line over {MAX_LINE} bytes; passed through, not parsed", "")

    def _overlong(self) -> None:
        if not self._skipping:
            self._overlong_line(self.lineno + 1)
        self._write(self._buf[self._written :])
        self._buf = b""
        self._written = 0
        self._bol = False
        self._skipping = True

    def _publish(self) -> None:
        rb = self.rebuilder
        if rb.problems:
            self._problems(self.lineno)
        recs = rb.take()
        if recs:
            self.publish(recs)

    def _problems(self, lineno: int) -> None:
        """Bursts the rebuilder refused while laying them out (on line ``lineno``, which
        closed them): counted with the phase lines that could not be placed, reported
        like them."""
        probs = self.rebuilder.problems
        self.rebuilder.problems = []
        for why in probs:
            self._orphan(PHASE, lineno, why, "")

    def _text(self, text: str, t: int) -> None:
        """Parse and rebuild the lines of ``text`` (each ends in "\\n"), then publish."""
        lines = text.split("\n")
        lines.pop()  # after the last "\n"
        n = self.lineno
        lines_seen = self.stats.lines
        other = 0
        rb = self.rebuilder
        feed = rb.feed
        for line in lines:
            n += 1
            if line[:1] != "[":  # the common case for other programs' lines
                other += 1
                continue
            if len(line) > MAX_LINE:  # (whole within one read; longer ones are skipped)
                other += 1
                self._overlong_line(n)
                continue
            try:
                rec = parse_line(line)
            except LegacyParseError as exc:
                lines_seen[exc.kind] += 1
                self.stats.malformed[exc.kind] += 1
                self._bad(n, f"malformed {exc.kind} line: {exc.reason}", line)
                continue
            if rec is None:
                other += 1
                continue
            if rec.kind is PROF and self._too_many_devices(rec.prof, n, line):  # type: ignore[union-attr]
                continue
            lines_seen[rec.kind] += 1
            why = feed(rec, t)
            if why is not None:
                self._orphan(rec.kind, n, why, line)
            if rb.problems:  # a burst this line closed was refused
                self._problems(n)
        self.lineno = n
        lines_seen["other"] += other
        self._publish()

    def _too_many_devices(self, prof: SpecFirstTokenProf, n: int, line: str) -> bool:
        top = self.max_devices
        for name in ("free_mb_before", "free_mb_after"):
            snap = getattr(prof, name)
            if len(snap) > top or any(o >= top for o, _ in snap):
                self.stats.lines[PROF] += 1
                self.stats.malformed[PROF] += 1
                why = f"{name} names more than {top} devices (MEMRA_OBS_MAX_DEVICES)"
                self._bad(n, f"malformed prof line: {why}", line)
                return True
        return False

    def _orphan(self, kind: str, lineno: int, why: str, text: str | None) -> None:
        """A valid line the rebuilder could not place: counted by kind and reported."""
        self.stats.orphans[kind] += 1
        self._bad(lineno, why, text)

    def _bad(self, lineno: int, why: str, text: str | None) -> None:
        self.reports += 1
        if self.reports <= self.report_limit:
            excerpt = text if len(text) <= 80 else text[:77] + "..."
            self.note(f"{self.name}:{lineno}: {why}" + (f": {excerpt!r}" if text else ""))
        elif self.reports == self.report_limit + 1:
            self.note(
                f"more than {self.report_limit} bad lines; counting the rest without reporting "
                "(memra_obs_tail_malformed_lines_total, memra_obs_tail_orphan_lines_total)"
            )
