"""Pure functions over a run's records: the numbers the page prints and the figures draw.

Where the seed defines a number it is computed by the package's own code: the slow-round
count is ``SpecRoundsLog.slow_rounds`` over each session's logged rows (what its
``[spec-prof-summary]`` counts), thresholds are ``f32(1.5 * median)``, and every median is
the seed's ``sorted[n // 2]``. The rest is plain statistics over a named population.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..records import SpecRoundsLog, f32
from ..timeline import PHASES, BurstRecord, RoundRecord
from .inputs import Run

__all__ = ["AB_METRICS", "REL_THRESHOLD", "ABRow", "Rounds", "View", "ab_table", "bootstrap"]
__all__ += ["burst_ms", "median", "slow_rounds", "threshold"]

#: The A/B table's rows: the round wall, then each phase (per round, ms).
AB_METRICS = ("wall", *PHASES)
#: A difference is flagged when its 95% CI excludes 0 and it is at least this large
#: relative to A's median (rounds of a session are not independent draws: see docs/REPORT.md).
REL_THRESHOLD = 0.02
#: The bootstrap: resamples, values drawn from per run (past it, a fixed-seed subsample: a
#: wider interval, never a narrower one), seed.
N_BOOT, CAP, SEED = 1000, 20_000, 0


def median(x: np.ndarray) -> float:
    """The seed's median: ``sorted[n // 2]`` (the upper one for even n); NaN when empty."""
    return float(np.partition(x, len(x) // 2)[len(x) // 2]) if len(x) else float("nan")


class Rounds:
    """A run's rounds as columns. ``own``: rounds with their own measurement (a log's rows,
    a span file's round spans: k >= 0); the others carry their burst's per-round means."""

    def __init__(self, rounds: list[RoundRecord]) -> None:
        n = len(rounds)
        t = np.fromiter(chain.from_iterable(r.t_ns_mono for r in rounds), np.int64, 6 * n)
        t = t.reshape(n, 6)
        self.phase_ms = np.diff(t, axis=1) / 1e6
        self.wall_ms = (t[:, 5] - t[:, 0]) / 1e6
        self.index, self.k, self.j = (
            np.fromiter((getattr(r, a) for r in rounds), np.int64, n) for a in ("index", "k", "j")
        )
        self.own = self.k >= 0

    def metric(self, name: str) -> np.ndarray:
        """Per-round ms of ``name`` (``wall`` or a phase) over the rounds with their own."""
        col = self.wall_ms if name == "wall" else self.phase_ms[:, PHASES.index(name)]
        return col[self.own]


@dataclass
class View:
    """One run as the page shows it: its label (``A: base.log``), records and columns."""

    label: str
    run: Run
    cols: Rounds


def burst_ms(bursts: list[BurstRecord]) -> np.ndarray:
    """Each burst's phase totals, ms, one row a burst (the phase line's numbers)."""
    p = [
        (b.phases.draft, b.phases.verify, b.phases.accept, b.phases.roll, b.phases.maint)
        for b in bursts
    ]
    return np.array(p, dtype=float).reshape(-1, 5) / 1e6


def slow_rounds(run: Run) -> list[int]:
    """Per round log: the seed's slow-round count over its rows (``SpecRoundsLog``)."""
    return [SpecRoundsLog(rounds=log.rows).slow_rounds() for log in run.logs]


def threshold(walls_ms: np.ndarray) -> tuple[float, float, int]:
    """Median, the seed's threshold ``f32(1.5 * median)`` and how many walls pass it, the
    walls taken as the f32 the seed stores."""
    w = walls_ms.astype(np.float32)
    med = median(w)
    thr = f32(1.5 * med)
    return med, thr, int((w > np.float32(thr)).sum())


def bootstrap(a: np.ndarray, b: np.ndarray, seed: int = SEED) -> tuple[float, float, float]:
    """``median(b) - median(a)`` and its 95% percentile-bootstrap interval (A and B resampled
    independently, N_BOOT times, from at most CAP values each)."""
    rng = np.random.default_rng(seed)
    diff = median(b) - median(a)
    a, b = (x if len(x) <= CAP else rng.choice(x, CAP, replace=False) for x in (a, b))
    out = np.empty(N_BOOT)
    step = max(1, 2_000_000 // max(len(a), len(b)))  # resamples at once: ~16 MB of indices
    for i in range(0, N_BOOT, step):
        m = min(step, N_BOOT - i)
        ma, mb = (np.partition(x[rng.integers(0, len(x), (m, len(x)))], len(x) // 2, axis=1)
                  [:, len(x) // 2] for x in (a, b))  # fmt: skip
        out[i : i + m] = mb - ma
    lo, hi = np.quantile(out, [0.025, 0.975])
    return diff, float(lo), float(hi)


@dataclass(frozen=True)
class ABRow:
    """One row of the A/B table: B - A of a per-round median, with its interval."""

    metric: str
    med_a: float
    med_b: float
    diff: float
    lo: float
    hi: float
    n_a: int
    n_b: int
    population: str

    @property
    def rel(self) -> float:
        return self.diff / self.med_a if self.med_a else float("nan")

    @property
    def flagged(self) -> bool:
        return (self.lo > 0 or self.hi < 0) and abs(self.rel) >= REL_THRESHOLD


def ab_table(a: View, b: View) -> list[ABRow]:
    """Per metric: the medians, B - A and its bootstrap CI. Population: the rounds with their
    own measurement when both runs have some, else one per-round mean a burst."""
    own = bool(a.cols.own.any() and b.cols.own.any())
    rows = []
    for i, m in enumerate(AB_METRICS):
        if own:
            xa, xb = a.cols.metric(m), b.cols.metric(m)
        else:  # a trace-only log: the burst's per-round means
            xa, xb = ((t.sum(axis=1) if i == 0 else t[:, i - 1]) for t in map(_per_round, (a, b)))
        if len(xa) and len(xb):
            d, lo, hi = bootstrap(xa, xb)
            pop = "rounds with their own times" if own else "bursts' per-round means"
            rows.append(ABRow(m, median(xa), median(xb), d, lo, hi, len(xa), len(xb), pop))
    return rows


def _per_round(v: View) -> np.ndarray:
    n = np.array([x.phases.rounds for x in v.run.bursts], dtype=float)
    return burst_ms(v.run.bursts)[n > 0] / n[n > 0, None]
