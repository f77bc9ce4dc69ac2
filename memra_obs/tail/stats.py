"""The tail's own counts (``memra_obs_tail_*``) as plain ints, and the collector that
publishes them when scraped: counting is an integer add, the hot path pays nothing more."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .rebuild import Rebuilder

__all__ = ["KINDS", "TailCollector", "TailStats"]

#: Line kinds, as the parser names them, plus ``other`` (not a legacy line).
KINDS = ("phase", "verify", "prof", "prof_rounds", "prof_summary", "override", "advice", "other")

_FAMILIES = (  # name, help, second label
    ("lines", "Lines the tail read, by kind (other = not a legacy line).", "kind"),
    ("malformed_lines", "Legacy-tagged lines that did not parse (truncated, garbled); passed "
     "through, not published.", "kind"),
    ("orphan_lines", "Valid legacy lines the tail could not place in a session or burst; not "
     "published.", "kind"),
    ("rounds", "Rounds the tail published: source=row (exact [spec-prof-rounds] values) or "
     "burst_mean (the phase line's per-round means; k and j unknown: -1, in no token metric).",
     "source"),
    ("sessions", "Sessions the tail published.", None),
    ("rotations", "Log rotations the tail followed.", "style"),
    ("bytes", "Bytes the tail read (passed through but for the lines its output refused: "
     "memra_obs_export_errors_total{signal=\"lines\"}).", None),
)  # fmt: skip


class TailStats:
    """What one tail has seen, written by the reading thread only (rounds and sessions are
    its rebuilder's)."""

    __slots__ = ("bytes", "lines", "malformed", "orphans", "rebuilder", "rotations")

    def __init__(self, rebuilder: Rebuilder) -> None:
        self.bytes = 0
        self.lines = dict.fromkeys(KINDS, 0)
        self.malformed = dict.fromkeys(KINDS, 0)
        self.orphans = dict.fromkeys(KINDS, 0)
        self.rotations = {"rename": 0, "truncate": 0}
        self.rebuilder = rebuilder

    total_lines = property(lambda self: sum(self.lines.values()))
    total_malformed = property(lambda self: sum(self.malformed.values()))
    total_orphans = property(lambda self: sum(self.orphans.values()))

    def samples(self) -> tuple[dict[Any, int], ...]:
        """Each family's values by its second label (None: only ``worker``); other lines are
        never malformed nor orphans."""
        rb, legacy = self.rebuilder, KINDS[:-1]
        rounds = {"row": rb.rounds_from_rows, "burst_mean": rb.rounds_from_means}
        return (self.lines, {k: self.malformed[k] for k in legacy}, {k: self.orphans[k] for k in legacy},
                rounds, {None: rb.sessions}, self.rotations, {None: self.bytes})  # fmt: skip


class TailCollector:
    """A prometheus_client collector over one or more tails' :class:`TailStats`."""

    def __init__(self) -> None:
        self._tails: dict[str, TailStats] = {}

    def add(self, worker: str, stats: TailStats) -> None:
        self._tails = {**self._tails, worker: stats}  # replaced, never edited: scrapes iterate

    def describe(self) -> list[Any]:
        return self._families({})

    def collect(self) -> Iterable[Any]:
        return self._families(self._tails)

    @staticmethod
    def _families(tails: dict[str, TailStats]) -> list[Any]:
        from prometheus_client.metrics_core import CounterMetricFamily

        fams = [
            CounterMetricFamily(
                f"memra_obs_tail_{name}", doc, labels=("worker", label) if label else ("worker",)
            )
            for name, doc, label in _FAMILIES
        ]
        for worker, st in tails.items():
            for fam, values in zip(fams, st.samples(), strict=True):
                for label, v in values.items():
                    fam.add_metric([worker] if label is None else [worker, label], v)
        return fams
