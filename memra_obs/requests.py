"""Per-request records as JSON lines (``MEMRA_OBS_REQUESTS_FILE``): per session, the fields
vLLM returns in ``metrics.speculative_decoding`` (AIPerf's ``spec_decode_acceptance``), plus
the phase totals and the first-token profile. A record exporter, off the loop: it keeps a
session's counts until its end record, then writes one line (``Session.spec_decode()`` gives a
server the same record for its response).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

from .analysis import spec_decode_record
from .diagnostics import say_once
from .timeline import (
    PHASES,
    BurstRecord,
    FirstTokenRecord,
    Record,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

__all__ = ["RequestsExporter", "request_record"]


class _Counts:
    """One session's (k, j) per round that drafted, and its phase totals."""

    __slots__ = ("bursts", "first_token", "js", "ks", "phases", "rec")

    def __init__(self, rec: SessionRecord) -> None:
        self.rec = rec
        self.ks, self.js = array("H"), array("H")
        self.phases = [0, 0, 0, 0, 0]
        self.first_token: dict[str, Any] | None = None
        self.bursts = 0


class _Round(NamedTuple):
    k: int
    j: int


def request_record(
    ks: Sequence[int], js: Sequence[int], phases_ns: Sequence[int], detailed: bool
) -> dict[str, Any]:
    """A session's spec-decode fields (from its rounds' ``ks``/``js``) and phase totals (ms)."""
    rounds = map(_Round, ks, js)
    out = spec_decode_record(rounds, detailed=detailed)
    out["phase_ms"] = {p: ns / 1e6 for p, ns in zip(PHASES, phases_ns, strict=True)}
    return out


class RequestsExporter:
    """Writes one JSON line per ended session to ``path`` (appending); ``detailed`` adds the
    per-step lists. At most ``max_open`` sessions wait for their end (a dropped end record
    must not leak); the oldest is then forgotten, said once."""

    signal = "requests"
    max_open = 4096

    def __init__(self, path: str, *, detailed: bool = False) -> None:
        self.path = path
        self.detailed = detailed
        self._open: dict[int, _Counts] = {}
        self._f: Any = None
        self.export_errors = 0

    def export(self, batch: Sequence[Record]) -> None:
        lines = []
        for rec in batch:
            if isinstance(rec, SessionRecord):
                if len(self._open) >= self.max_open:
                    self._open.pop(next(iter(self._open)))
                    say_once("requests-open", "requests file: too many open sessions; "
                             "the oldest is forgotten")  # fmt: skip
                self._open[rec.session] = _Counts(rec)
                continue
            c = self._open.get(rec.session)
            if c is None:
                continue
            if isinstance(rec, RoundRecord):
                n = rec.repeat
                if rec.k > 0:
                    c.ks.extend([rec.k] * n)
                    c.js.extend([rec.j] * n)
                for i, ns in enumerate(rec.phase_ns()):
                    c.phases[i] += ns * n
            elif isinstance(rec, BurstRecord):
                c.bursts += 1
            elif isinstance(rec, FirstTokenRecord):
                c.first_token = asdict(rec.prof)
            elif isinstance(rec, SessionEndRecord):
                del self._open[rec.session]
                lines.append(self._line(c, rec))
        if lines:
            self._write(lines)

    def _line(self, c: _Counts, end: SessionEndRecord) -> str:
        s = c.rec
        out = {
            "session": s.session, "trace_id": format(s.trace_id, "032x") if s.trace_id else "",
            "family": s.family, "worker": s.worker, "rounds": end.rounds, "bursts": end.bursts,
            "tokens": end.tokens, "error": end.error,
            **request_record(c.ks, c.js, c.phases, self.detailed),
            "first_token": c.first_token,
        }  # fmt: skip
        return json.dumps(out, separators=(",", ":"))

    def _write(self, lines: list[str]) -> None:
        try:
            if self._f is None:
                self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._f.write("\n".join(lines) + "\n")
            self._f.flush()
        except OSError as exc:
            self.export_errors += len(lines)
            say_once("requests-write", f"requests file {self.path}: {exc.strerror}; lines lost")

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
