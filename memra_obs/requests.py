"""Per-request records as JSON lines (``MEMRA_OBS_REQUESTS_FILE``): per session, vLLM's
``metrics.speculative_decoding`` fields (AIPerf's ``spec_decode_acceptance``), the phase totals
and the first-token profile. Off the loop: a session's counts are kept until its end record."""

from __future__ import annotations

import json
import threading
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from . import timeline as tl
from .analysis import spec_decode_record
from .diagnostics import say_once
from .linewriter import AppendFile

__all__ = ["RequestsExporter", "request_record"]


@dataclass(slots=True)
class _Counts:
    """One session's (k, j) per round that drafted, and its phase totals."""

    rec: tl.SessionRecord
    k: int = 0  #: the largest burst k: the configured draft length (vLLM's num_spec_tokens)
    ks: array[int] = field(default_factory=lambda: array("H"))
    js: array[int] = field(default_factory=lambda: array("H"))
    phases: list[int] = field(default_factory=lambda: [0] * 5)
    first_token: dict[str, Any] | None = None
    seen: int = 0  #: rounds received (a full queue may have dropped some)
    unknown: int = 0  #: rounds of unknown k, j (the tail's past the logged rows)
    prior: bool = False  #: agent mode: an earlier agent's rounds (their count not carried)


class _Round(NamedTuple):
    k: int
    j: int


#: The vLLM fields a request of no known counts cannot give (null, as vLLM sends no stats).
SPEC_KEYS = ("mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram",
              "num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens")  # fmt: skip


def request_record(
    ks: Sequence[int],
    js: Sequence[int],
    phases_ns: Sequence[int],
    detailed: bool,
    k: int = 0,
    unknown: int = 0,
) -> dict[str, Any]:
    """A session's spec-decode fields (from its rounds' ``ks``/``js``) and phase totals (ms);
    ``Session.spec_decode()`` gives a server the same record. ``k``: the largest burst k, the
    configured draft length vLLM reports as ``num_spec_tokens`` (a gated round drafts fewer).
    ``unknown``: rounds of unknown k, j; with no known one, vLLM's fields are None (no stats,
    as vLLM sends none: not a 0% acceptance)."""
    n = max(k, max(ks, default=0))
    out = spec_decode_record(map(_Round, ks, js), detailed=detailed, num_spec_tokens=n)
    if unknown and not ks:
        out.update(dict.fromkeys(SPEC_KEYS))
    out["phase_ms"] = {p: ns / 1e6 for p, ns in zip(tl.PHASES, phases_ns, strict=True)}
    return out


class RequestsExporter:
    """Writes one JSON line per ended session to ``path`` (appending); ``detailed`` adds the
    per-step lists. At most ``max_open`` sessions wait for their end (a dropped end record
    must not leak); the oldest is then forgotten, said once.

    The appends have a thread of their own: one that blocks (a FIFO whose reader stopped, a
    hung NFS mount) holds back this file, not the spans and /metrics the export worker also
    feeds. At most ``max_bytes`` of lines wait for it; more are lost, counted in
    ``export_errors`` (with ``hold``, the tail's, they wait for room: its reading held back)."""

    signal = "requests"
    hold = False  #: a full queue waits for room instead of losing lines (the tail's reading)
    max_bytes = 32 << 20  # ~27,000 requests (~60,000 without the first-token profile)

    def __init__(self, path: str, *, detailed: bool = False, max_open: int = tl.MAX_OPEN) -> None:
        self.detailed, self.export_errors, self._closed = detailed, 0, False
        self.max_open = max_open
        self._file = AppendFile(path)
        self.path = self._file.path  # absolute: lines go there whatever chdir() comes later
        self._file.open()  # OSError now, not every line lost later; no lock: never waits
        self._open: dict[int, _Counts] = {}
        self._fresh()
        try:
            self._thread.start()
        except BaseException:  # a thread refused (a pids limit): no descriptor left open
            self._file.close()
            raise

    def _fresh(self) -> None:
        """An empty queue, its lock, and the writer thread (not started)."""
        #: Lines, and the counts of lines lost behind them (settled in order: see settled).
        self._q: deque[str | int] = deque()
        self._cv = threading.Condition()  # guards the queue, the counts and export_errors
        self._qbytes = 0
        self._busy = (0, 0)  # the append in flight: its lines, and those it settles
        self._added = self._done = 0  # lines put; lines before them appended or counted lost
        self._thread = threading.Thread(target=self._run, name="memra-obs-requests", daemon=True)

    def after_fork(self) -> None:
        """In a forked child: its own queue, thread and count; the parent's open sessions stay
        the parent's (their ends come there)."""
        self._open.clear()
        self.export_errors = 0
        self._fresh()
        if not self._closed:
            self._thread.start()

    def export(self, batch: Sequence[tl.Record]) -> None:
        if self._closed:  # a stuck exporter's batch, counted dropped by the queue's shutdown
            return
        lines = []
        for rec in batch:
            if isinstance(rec, tl.SessionRecord):
                if len(self._open) >= self.max_open:  # its line is lost, counted
                    self._open.pop(next(iter(self._open)))
                    with self._cv:
                        self.export_errors += 1
                    say_once("requests-open", f"requests file: over {self.max_open} sessions "
                             "open at once; the oldest is forgotten, its line lost")  # fmt: skip
                self._open[rec.session] = _Counts(rec)
                continue
            c = self._open.get(rec.session)
            if c is None:
                continue
            if isinstance(rec, tl.RoundRecord):
                n = rec.repeat
                c.seen += n
                c.unknown += n if rec.k < 0 else 0
                if rec.k > 0:
                    c.ks.extend([rec.k] * n)
                    c.js.extend([rec.j] * n)
                c.phases = [t + ns * n for t, ns in zip(c.phases, rec.phase_ns(), strict=True)]
            elif isinstance(rec, tl.BurstRecord):
                c.k = max(c.k, rec.k)
            elif isinstance(rec, tl.FirstTokenRecord):
                c.first_token = asdict(rec.prof)
            elif isinstance(rec, tl.PriorRecord):  # agent mode: what an earlier agent read
                c.prior = True
                c.ks.extend(rec.ks)
                c.js.extend(rec.js)
                c.phases = [t + ns for t, ns in zip(c.phases, rec.phases_ns, strict=True)]
                c.k = max(c.k, rec.k)
                if rec.first_token is not None:
                    c.first_token = asdict(rec.first_token)
            elif isinstance(rec, tl.SessionEndRecord):
                del self._open[rec.session]
                lines.append(self._line(c, rec))
        if lines:
            self._put(lines)

    def _line(self, c: _Counts, end: tl.SessionEndRecord) -> str:
        s = c.rec
        tid = s.trace_id or s.caller_trace_id  # an unsampled caller's too: the join key
        out = {
            "session": s.session, "trace_id": format(tid, "032x") if tid else "",
            "family": s.family, "worker": s.worker,  # when, as the spans say it (a join by time)
            "start_unix_nano": tl.to_epoch_ns(s, s.start_ns_mono),
            "end_unix_nano": tl.to_epoch_ns(s, end.end_ns_mono),
            "rounds": end.rounds, "bursts": end.bursts,
            "tokens": end.tokens, "error": end.error,
            **request_record(c.ks, c.js, c.phases, self.detailed, c.k, c.unknown),
            "first_token": c.first_token,
        }  # fmt: skip
        if c.unknown:
            out["unknown_rounds"] = c.unknown
        if (missing := end.rounds - c.seen) > 0 and not c.prior:  # a full queue's, said here:
            out["rounds_missing"] = missing  # this line is short of them, not the request
        return json.dumps(out, separators=(",", ":"))

    def mark(self) -> int:
        """Lines so far; :meth:`settled` says when every line before a mark is appended or
        counted lost (the agent persists its cursors past them only then)."""
        return self._added

    def settled(self, mark: int) -> bool:
        return self._done >= mark

    def _put(self, lines: list[str]) -> None:
        with self._cv:
            self._added += len(lines)
            for i, line in enumerate(lines):  # (JSON, ASCII: a character is a byte)
                while self.hold and not self._closed and not self._room(line):
                    if not self._thread.is_alive():
                        break
                    self._cv.notify_all()  # (the writer: what this call queued so far)
                    self._cv.wait(0.05)  # the tail: its reading held back, nothing dropped
                if self._closed or not self._room(line):
                    self._lose(len(lines) - i)
                    break
                self._q.append(line)
                self._qbytes += len(line) + 1
            self._cv.notify_all()

    def _room(self, line: str) -> bool:
        return not self._q or self._qbytes + len(line) + 1 <= self.max_bytes

    def _lose(self, n: int) -> None:
        """``n`` lines lost (under the lock): counted now, settled after what waits before."""
        self.export_errors += n
        if self._q and isinstance(self._q[-1], int):
            self._q[-1] += n  # (one count for a run of losses: a stuck file's queue stays small)
        elif self._q or self._busy[1]:
            self._q.append(n)
        else:
            self._done += n
        say_once("requests-full", f"requests file {self.path}: appends are not keeping up (a "
                 "blocked pipe, a stalled disk?) or shut down; lines lost, counted in "
                 'memra_obs_export_errors_total{signal="requests"}')  # fmt: skip

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    return
                lines = [x for x in self._q if isinstance(x, str)]
                self._busy = (
                    len(lines),
                    len(lines) + sum(x for x in self._q if isinstance(x, int)),
                )
                self._q.clear()
                self._qbytes = 0
            lost = ""
            try:
                if lines:
                    self._file.append(("\n".join(lines) + "\n").encode())
            except OSError as exc:
                lost = exc.strerror or str(exc)
            with self._cv:
                if lost:
                    self.export_errors += self._busy[0]
                self._done += self._busy[1]
                self._busy = (0, 0)
                self._cv.notify_all()
            if lost:
                say_once("requests-write", f"requests file {self.path}: {lost}; lines lost")

    def flush(self, timeout_s: float = 5.0) -> bool:
        """True once every line so far is appended (or counted lost)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._q or self._busy[1]:
                if (left := deadline - time.monotonic()) <= 0 or not self._thread.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Append what waits while ``timeout_s`` lasts; what is still waiting then, and an
        append stuck in flight, is counted lost."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(max(0.0, timeout_s))
        with self._cv:
            left = sum(isinstance(x, str) for x in self._q) + self._busy[0]
            self._done += sum(x if isinstance(x, int) else 1 for x in self._q) + self._busy[1]
            self._q.clear()
            self._qbytes = 0
            self._busy = (0, 0)
            self.export_errors += left
        if left:
            say_once("requests-shutdown", f"requests file {self.path}: shutdown's time ran out "
                     f"with {left} lines not appended (an append in flight may yet end); "
                     "counted lost")  # fmt: skip
        self._file.close()
