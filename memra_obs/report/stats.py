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

from ..events import PHASES, BurstRecord, RoundRecord
from ..records import SpecRoundsLog, f32
from .inputs import Run

__all__ = [
    "AB_METRICS",
    "REL_THRESHOLD",
    "ABRow",
    "Rounds",
    "View",
    "ab_table",
    "bootstrap",
    "median",
]

#: The A/B table's rows: the round wall, then each phase (per round, ms).
AB_METRICS = ("wall", *PHASES)
#: A difference is flagged when its 95% CI excludes 0 and it is at least this large
#: relative to A's median (smaller ones are real but rarely worth a sentence).
REL_THRESHOLD = 0.02
#: The bootstrap: resamples, values drawn from per run (a fixed-seed subsample beyond it:
#: a wider, never narrower, interval), seed.
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
        self.index = np.fromiter((r.index for r in rounds), np.int64, n)
        self.k = np.fromiter((r.k for r in rounds), np.int64, n)
        self.j = np.fromiter((r.j for r in rounds), np.int64, n)
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


def burst_means(bursts: list[BurstRecord], name: str) -> np.ndarray:
    """One value per burst: its per-round mean ms of ``name`` (logs without rows)."""
    i = None if name == "wall" else PHASES.index(name)
    vals = [
        (b.phases.total() if i is None else _phase_ns(b)[i]) / 1e6 / b.phases.rounds
        for b in bursts
        if b.phases.rounds
    ]
    return np.asarray(vals, dtype=float)


def _phase_ns(b: BurstRecord) -> tuple[int, int, int, int, int]:
    p = b.phases
    return (p.draft, p.verify, p.accept, p.roll, p.maint)


def phase_totals(b: BurstRecord) -> np.ndarray:
    return np.asarray(_phase_ns(b), dtype=float)


def slow_rounds(run: Run) -> list[int]:
    """Per round log: the seed's slow-round count over its rows (``SpecRoundsLog``)."""
    return [SpecRoundsLog(rounds=log.rows).slow_rounds() for log in run.logs]


def threshold(walls_ms: np.ndarray) -> tuple[float, float, int]:
    """Median, the seed's threshold ``f32(1.5 * median)`` and how many walls pass it, with
    the walls taken as the f32 the seed stores."""
    w = walls_ms.astype(np.float32)
    med = median(w)
    thr = f32(1.5 * med)
    return med, thr, int((w > np.float32(thr)).sum())


def bootstrap(a: np.ndarray, b: np.ndarray, seed: int = SEED) -> tuple[float, float, float]:
    """``median(b) - median(a)`` and its 95% percentile-bootstrap interval (A and B resampled
    independently; at most CAP values each, the rest a fixed-seed subsample)."""
    rng = np.random.default_rng(seed)
    diff = median(b) - median(a)
    a, b = (x if len(x) <= CAP else rng.choice(x, CAP, replace=False) for x in (a, b))
    out = np.empty(N_BOOT)
    step = max(1, 2_000_000 // max(len(a), len(b)))
    for i in range(0, N_BOOT, step):
        m = min(step, N_BOOT - i)
        ma = np.partition(a[rng.integers(0, len(a), (m, len(a)))], len(a) // 2, axis=1)
        mb = np.partition(b[rng.integers(0, len(b), (m, len(b)))], len(b) // 2, axis=1)
        out[i : i + m] = mb[:, len(b) // 2] - ma[:, len(a) // 2]
    lo, hi = np.quantile(out, [0.025, 0.975])
    return diff, float(lo), float(hi)


@dataclass(frozen=True)
class ABRow:
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


def ab_table(a: Run, b: Run, ra: Rounds, rb: Rounds) -> list[ABRow]:
    """Per metric: medians, the difference B - A and its bootstrap CI. Population: rounds
    with their own measurement when both runs have some, else one per-round mean a burst."""
    own = bool(ra.own.sum() and rb.own.sum())
    rows = []
    for m in AB_METRICS:
        if own:
            xa, xb, pop = ra.metric(m), rb.metric(m), "rounds with their own times"
        else:
            xa, xb, pop = burst_means(a.bursts, m), burst_means(b.bursts, m), "burst means"
        if not len(xa) or not len(xb):
            continue
        d, lo, hi = bootstrap(xa, xb)
        rows.append(ABRow(m, median(xa), median(xb), d, lo, hi, len(xa), len(xb), pop))
    return rows
