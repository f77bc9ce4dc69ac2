"""What the observer hands to sinks: plain, immutable records of a session's timeline (and
the agent's :class:`PriorRecord`, for its exporters only).

One record per thing that happened. Timestamps say their clock: ``*_ns_mono`` is
``time.perf_counter_ns()``, ``*_ns_epoch`` Unix time; a session's anchor pair (read back to
back) maps one to the other: :func:`to_epoch_ns` (the span builder and the Prometheus exporter
keep its offset, ``anchor_ns_epoch - anchor_ns_mono``, once per session).
"""

from __future__ import annotations

from typing import NamedTuple

from .records import SpecFirstTokenProf, SpecPhaseNs, SpecRoundProf

__all__ = [
    "MAX_OPEN", "PHASES", "BurstRecord", "FirstTokenRecord", "PriorRecord", "ProfRowsRecord",
    "ProfSummaryRecord", "Record", "RoundRecord", "SessionEndRecord", "SessionRecord",
    "each_round", "to_epoch_ns",
]  # fmt: skip

#: The five phases of a round, in order; ``RoundRecord.t_ns_mono`` holds their six bounds.
PHASES = ("draft", "verify", "accept", "rollback", "maint")
#: Sessions a process's span and requests exporters keep open at once (an end record lost must
#: not leak: past it the oldest is forgotten, said); the agent's keep the host's, more.
MAX_OPEN = 4096


class SessionRecord(NamedTuple):
    """A session (one request) started."""

    session: int
    family: str
    tag: str
    tag_v: str
    worker: str
    start_ns_mono: int
    anchor_ns_mono: int
    anchor_ns_epoch: int
    trace_id: int  #: 128-bit: the caller's span's, else fresh; 0: no sink wants one, or unsampled
    span_id: int  #: 64-bit id of this session's ``spec.session`` span
    parent_span_id: int  #: the caller's current span (e.g. the HTTP request), else 0
    level: int  #: trace level in force (0-2)
    prof: bool  #: the first-token profile is on
    clock: str = ""  #: the phases': "event", "sync" or "host" (no stream); "" unknown (legacy)
    #: The caller's trace id (0: none), kept also when its sampler dropped the session: the
    #: requests file's join key (the agent's too: the ring carries it).
    caller_trace_id: int = 0


class RoundRecord(NamedTuple):
    """One verify round: phase bounds and counts (k = j = -1: unknown, then ctx = seq_rows = 0)."""

    session: int
    burst: int
    index: int  # type: ignore[assignment]  # round index in the session (shadows tuple.index)
    #: Bounds: entry, end of draft, verify, accept, rollback, maint (= round end).
    t_ns_mono: tuple[int, int, int, int, int, int]
    k: int  #: drafted count that entered the verify (after the confidence gate)
    j: int  #: accepted drafts
    ctx: int  #: trunk rows at round entry
    seq_rows: int  #: verify rows that took the per-row mixer arm
    #: Level-2 verify sub-split of this round, ns: (kda, kda_scan, mla, ffn); None below 2.
    split_ns: tuple[int, int, int, int] | None
    #: Consecutive equal rounds this stands for, back to back from ``index``: 1 from a loop,
    #: more from ``memra-obs tail`` (a burst's rounds known only by its means).
    repeat: int = 1

    def phase_ns(self) -> tuple[int, int, int, int, int]:
        t = self.t_ns_mono
        return (t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3], t[5] - t[4])

    @property
    def wall_ns(self) -> int:
        return self.t_ns_mono[5] - self.t_ns_mono[0]

    @property
    def tokens(self) -> int:
        """Tokens the round committed: the accepted drafts plus the bonus token."""
        return self.j + 1


class BurstRecord(NamedTuple):
    """A burst returned to the caller: its phase totals as the seed's line prints them."""

    session: int
    index: int  # type: ignore[assignment]  # the field shadows tuple.index on purpose
    k: int
    start_ns_mono: int
    end_ns_mono: int
    phases: SpecPhaseNs
    split_ns: tuple[int, int, int, int] | None  #: burst total of the level-2 split, ns
    tokens: int  #: returned to the caller
    hook_ns: int  #: inside the caller's commit hook
    first_round: int  #: index of the burst's first round in the session


class FirstTokenRecord(NamedTuple):
    """The first-token profile, closed after the first burst."""

    session: int
    prof: SpecFirstTokenProf
    intervals: tuple[tuple[str, int, int], ...]  #: buckets in order: (name, start, end), ns mono


class ProfRowsRecord(NamedTuple):
    """Round-log rows not printed yet (``SpecRoundsLog.fresh``), from log index ``start``."""

    session: int
    start: int
    rows: tuple[SpecRoundProf, ...]


class ProfSummaryRecord(NamedTuple):
    """The round log's summary, once per session, and its ``[spec-advice]`` line (or "")."""

    session: int
    summary: str
    slow_rounds: int
    advice: str = ""


class SessionEndRecord(NamedTuple):
    """The session ended."""

    session: int
    end_ns_mono: int
    rounds: int
    bursts: int
    tokens: int
    error: str  #: an exception type name when the session ended by an error, else ""
    advice: str = ""  #: the session's ``[spec-advice]`` line, "" when there is none


class PriorRecord(NamedTuple):
    """Agent mode: what a previous agent published of a session still open across its restart,
    right after the replayed SessionRecord. Only the per-request record reads it (metrics and
    spans counted those rounds then): without it, the record held only the later rounds."""

    session: int
    ks: tuple[int, ...]  #: k of each drafting round (k > 0), in order
    js: tuple[int, ...]  #: j of the same rounds
    phases_ns: tuple[int, int, int, int, int]  #: phase totals over every round
    k: int  #: the largest burst k
    first_token: SpecFirstTokenProf | None


Record = (SessionRecord | RoundRecord | BurstRecord | FirstTokenRecord | ProfRowsRecord
          | ProfSummaryRecord | SessionEndRecord | PriorRecord)  # fmt: skip


def _shift(t: tuple[int, int, int, int, int, int], d: int) -> tuple[int, int, int, int, int, int]:
    return (t[0] + d, t[1] + d, t[2] + d, t[3] + d, t[4] + d, t[5] + d)


def each_round(r: RoundRecord) -> list[RoundRecord]:
    """A record's rounds one by one (``repeat`` > 1: a run of equal rounds, back to back)."""
    if r.repeat == 1:
        return [r]
    t, w = r.t_ns_mono, r.wall_ns
    return [
        r._replace(index=r.index + i, t_ns_mono=_shift(t, i * w), repeat=1) for i in range(r.repeat)
    ]


def to_epoch_ns(s: SessionRecord, ns_mono: int) -> int:
    """Map a monotonic reading of session ``s`` to Unix-epoch ns through its anchor pair."""
    return s.anchor_ns_epoch + (ns_mono - s.anchor_ns_mono)
