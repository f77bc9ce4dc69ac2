"""The tail's own counts, as plain ints, and the collector that publishes them when scraped.

Counting is an integer add on the reading thread; nothing touches prometheus_client until
a scrape asks (the client_python "render when scraped" rule), so the hot path pays nothing
for these series. Names follow the project's ``memra_obs_*`` convention for the
instrument's own health (the README's tail section lists them):

* ``memra_obs_tail_lines_total{worker,kind}``: lines read, by kind (``phase``, ``verify``,
  ``prof``, ``prof_rounds``, ``prof_summary``, ``override``; ``other`` = not a legacy line)
* ``memra_obs_tail_malformed_lines_total{worker,kind}``: legacy-tagged lines that did not
  parse (truncated, garbled, invalid UTF-8); passed through, never published
* ``memra_obs_tail_orphan_lines_total{worker,kind}``: valid lines the rebuilder could not
  place (e.g. a level-2 line without its phase line, a row out of sequence)
* ``memra_obs_tail_rounds_total{worker,source}``: rounds published, ``source="row"`` (a
  ``[spec-prof-rounds]`` row: exact) or ``source="burst_mean"`` (the burst's means)
* ``memra_obs_tail_sessions_total{worker}``: sessions published
* ``memra_obs_tail_rotations_total{worker,style}``: ``rename`` or ``truncate``
* ``memra_obs_tail_bytes_total{worker}``: bytes read (and passed through)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["KINDS", "TailCollector", "TailStats"]

#: Line kinds, as ``scan_line`` names them, plus ``other``.
KINDS = ("phase", "verify", "prof", "prof_rounds", "prof_summary", "override", "advice", "other")


class TailStats:
    """What one tail has seen; plain ints, written by the reading thread only."""

    __slots__ = (
        "bytes", "lines", "malformed", "orphans", "overlong", "rotations", "rounds", "sessions",
    )  # fmt: skip

    def __init__(self) -> None:
        self.bytes = 0
        self.lines = dict.fromkeys(KINDS, 0)
        self.malformed = dict.fromkeys(KINDS, 0)
        self.orphans = dict.fromkeys(KINDS, 0)
        #: Lines over MAX_LINE bytes (passed through, reported, counted as ``other``).
        self.overlong = 0
        self.rotations = {"rename": 0, "truncate": 0}
        #: Filled from the rebuilder when read (row / burst_mean).
        self.rounds: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.sessions: Callable[[], int] = lambda: 0

    @property
    def total_lines(self) -> int:
        return sum(self.lines.values())

    @property
    def total_malformed(self) -> int:
        return sum(self.malformed.values())

    @property
    def total_orphans(self) -> int:
        return sum(self.orphans.values())


class TailCollector:
    """A prometheus_client collector over one or more tails' :class:`TailStats`."""

    def __init__(self) -> None:
        self._tails: dict[str, TailStats] = {}

    def add(self, worker: str, stats: TailStats) -> None:
        self._tails = {**self._tails, worker: stats}  # replaced, never edited: scrapes iterate

    def describe(self) -> list[Any]:
        return list(self._families({}))

    def collect(self) -> Iterable[Any]:
        return list(self._families(self._tails))

    @staticmethod
    def _families(tails: dict[str, TailStats]) -> Iterable[Any]:
        from prometheus_client.metrics_core import CounterMetricFamily

        lines = CounterMetricFamily(
            "memra_obs_tail_lines", "Lines the tail read, by kind (other = not a legacy line).",
            labels=("worker", "kind"),
        )  # fmt: skip
        bad = CounterMetricFamily(
            "memra_obs_tail_malformed_lines",
            "Legacy-tagged lines that did not parse (truncated, garbled); passed through, "
            "not published.",
            labels=("worker", "kind"),
        )
        orphan = CounterMetricFamily(
            "memra_obs_tail_orphan_lines",
            "Valid legacy lines the tail could not place in a session or burst; not published.",
            labels=("worker", "kind"),
        )
        rounds = CounterMetricFamily(
            "memra_obs_tail_rounds",
            "Rounds the tail published: source=row (exact [spec-prof-rounds] values) or "
            "burst_mean (the phase line's per-round means; k and j unknown: -1, in no token "
            "metric).",
            labels=("worker", "source"),
        )
        sessions = CounterMetricFamily(
            "memra_obs_tail_sessions", "Sessions the tail published.", labels=("worker",)
        )
        rot = CounterMetricFamily(
            "memra_obs_tail_rotations",
            "Log rotations the tail followed.",
            labels=("worker", "style"),
        )
        nbytes = CounterMetricFamily(
            "memra_obs_tail_bytes", "Bytes the tail read (all passed through).", labels=("worker",)
        )
        for w, st in tails.items():
            for kind in KINDS:
                lines.add_metric([w, kind], st.lines[kind])
                if kind != "other":
                    bad.add_metric([w, kind], st.malformed[kind])
                    orphan.add_metric([w, kind], st.orphans[kind])
            r_rows, r_means = st.rounds()
            rounds.add_metric([w, "row"], r_rows)
            rounds.add_metric([w, "burst_mean"], r_means)
            sessions.add_metric([w], st.sessions())
            for style, n in st.rotations.items():
                rot.add_metric([w, style], n)
            nbytes.add_metric([w], st.bytes)
        return (lines, bad, orphan, rounds, sessions, rot, nbytes)
