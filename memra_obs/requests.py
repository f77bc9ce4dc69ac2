"""Per-request records as JSON lines (``MEMRA_OBS_REQUESTS_FILE``): per session, vLLM's
``metrics.speculative_decoding`` fields (AIPerf's ``spec_decode_acceptance``), the phase totals
and the first-token profile. Off the loop: a session's counts are kept until its end record."""

from __future__ import annotations

import json
from array import array
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
    must not leak); the oldest is then forgotten, said once."""

    signal = "requests"
    max_open = 4096

    def __init__(self, path: str, *, detailed: bool = False) -> None:
        self.detailed, self.export_errors, self._closed = detailed, 0, False
        self._file = AppendFile(path)
        self.path = self._file.path  # absolute: lines go there whatever chdir() comes later
        self._file.open()  # OSError now, not every line lost later; no lock: never waits
        self._open: dict[int, _Counts] = {}

    def export(self, batch: Sequence[tl.Record]) -> None:
        lines = []
        for rec in batch:
            if isinstance(rec, tl.SessionRecord):
                if len(self._open) >= self.max_open:
                    self._open.pop(next(iter(self._open)))
                    say_once("requests-open", "requests file: too many open sessions; "
                             "the oldest is forgotten")  # fmt: skip
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
            self._write(lines)

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

    def _write(self, lines: list[str]) -> None:
        if self._closed:  # a stuck exporter's batch, counted dropped by the queue's shutdown
            return
        try:
            self._file.append(("\n".join(lines) + "\n").encode())
        except OSError as exc:
            self.export_errors += len(lines)
            say_once("requests-write", f"requests file {self.path}: {exc.strerror}; lines lost")

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._closed = True
        self._file.close()
