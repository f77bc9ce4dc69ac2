"""What the observer hands to sinks: plain, immutable records of a session's timeline.

One record per thing that happened (a session started, a round finished, a burst returned,
the first-token profile closed, ...). Every timestamp says its clock in its name:
``*_ns_mono`` is ``time.perf_counter_ns()`` (CLOCK_MONOTONIC), ``*_ns_epoch`` is Unix time.
A session carries one anchor pair (mono, epoch) read back to back; sinks map mono to epoch
through it, in one place (:func:`to_epoch_ns`).

Records import only :mod:`memra_obs.records` and know nothing of sinks.
"""

from __future__ import annotations

from typing import NamedTuple

from .records import SpecFirstTokenProf, SpecPhaseNs, SpecRoundProf

__all__ = [
    "PHASES",
    "BurstRecord",
    "FirstTokenRecord",
    "ProfRowsRecord",
    "ProfSummaryRecord",
    "Record",
    "RoundRecord",
    "SessionEndRecord",
    "SessionRecord",
    "each_round",
    "to_epoch_ns",
]

#: The five phases of a round, in order; ``RoundRecord.t_ns_mono`` holds their six bounds.
PHASES = ("draft", "verify", "accept", "rollback", "maint")


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
    #: 128-bit trace id: the caller's when a span was current, else a fresh one.
    trace_id: int
    #: 64-bit id of this session's ``spec.session`` span.
    span_id: int
    #: The caller's current span (e.g. the HTTP request), 0 when there was none.
    parent_span_id: int
    #: Trace level in force (0-2) and whether the first-token profile is on.
    level: int
    prof: bool
    #: The clock timing the phases: "event", "sync" or "host" (no device stream); "" where
    #: the source does not say (legacy lines).
    clock: str = ""


class RoundRecord(NamedTuple):
    """One verify round: phase bounds and counts (k = j = -1: unknown, then ctx = seq_rows = 0)."""

    session: int
    burst: int
    #: Round index within the session, from 0.
    index: int  # type: ignore[assignment]  # the field shadows tuple.index on purpose
    #: Bounds: entry, end of draft, verify, accept, rollback, maint (= round end).
    t_ns_mono: tuple[int, int, int, int, int, int]
    #: Drafted count that entered the verify (after the confidence gate).
    k: int
    #: Accepted drafts.
    j: int
    #: Trunk rows at round entry.
    ctx: int
    #: Verify rows that took the per-row mixer arm.
    seq_rows: int
    #: Level-2 verify sub-split of this round, ns: (kda, kda_scan, mla, ffn); None below 2.
    split_ns: tuple[int, int, int, int] | None
    #: Consecutive rounds this record stands for: 1 from a loop; more from ``memra-obs tail``
    #: for a burst's rounds known only by its means. Each lasts as these bounds say and
    #: starts where the previous one ended; their indices run from ``index``.
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
    #: Burst total of the level-2 split, ns (kda, kda_scan, mla, ffn); None below level 2.
    split_ns: tuple[int, int, int, int] | None
    #: Tokens the burst returned to the caller.
    tokens: int
    #: Time inside the caller's commit hook during this burst, ns.
    hook_ns: int
    #: Index of the burst's first round within the session.
    first_round: int


class FirstTokenRecord(NamedTuple):
    """The first-token profile, closed after the first burst."""

    session: int
    prof: SpecFirstTokenProf
    #: The sequential buckets as measured: (field name, start, end), ns mono, in order.
    intervals: tuple[tuple[str, int, int], ...]


class ProfRowsRecord(NamedTuple):
    """Round-log rows not printed yet (``SpecRoundsLog.fresh``), from log index ``start``."""

    session: int
    start: int
    rows: tuple[SpecRoundProf, ...]


class ProfSummaryRecord(NamedTuple):
    """The round log's one-line summary (``SpecRoundsLog.summary``), once per session, and the
    k advisor's ``[spec-advice]`` line over the same rows ("" when too few drafted)."""

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
    #: An exception type name when the session ended by an error, else "".
    error: str
    #: The session's ``[spec-advice]`` line (the k advisor over its logged rounds), "" when
    #: there is none (the profile off, too few drafting rounds, or a source without it).
    advice: str = ""


Record = (
    SessionRecord
    | RoundRecord
    | BurstRecord
    | FirstTokenRecord
    | ProfRowsRecord
    | ProfSummaryRecord
    | SessionEndRecord
)


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
