"""Acceptance by draft position that stays right when k varies from round to round.

A round that drafted ``k`` and accepted ``j`` puts position ``i`` (0-based, as vLLM's
``..._per_pos``) *at risk* when ``k >= i+1`` and ``j >= i`` (the draft was made and every one
before it accepted); it is *accepted* there when ``j > i``. A round with ``j == k`` accepted all
it drafted and says nothing about position ``k``: it is censored there. Dividing by the rounds
at risk, not by all rounds, keeps a round that drafted fewer from reading as a rejection.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist
from typing import NamedTuple, Protocol

#: Rounds at risk the flat tail (positions past the data) is pooled from, deepest first.
TAIL_AT_RISK = 30


class Counted(Protocol):
    """What the estimator reads of a round (``RoundRecord`` fits; -1 = unknown)."""

    @property
    def k(self) -> int: ...
    @property
    def j(self) -> int: ...


class Interval(NamedTuple):
    """A point estimate and its confidence interval."""

    value: float
    lo: float
    hi: float


def z_of(level: float) -> float:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level!r}: expected a confidence level in (0, 1)")
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson(x: int, n: int, z: float) -> Interval:
    """Wilson score interval: inside [0, 1], not a point at 0 or n successes (Wald's is), and
    close to nominal coverage from small n on."""
    if n <= 0:
        return Interval(math.nan, 0.0, 1.0)
    p, z2 = x / n, z * z
    d = 1 + z2 / n
    c = (p + z2 / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / d
    return Interval(p, max(0.0, c - h), min(1.0, c + h))


def known(k: int, j: int) -> bool:
    """True for a round with counts, False for unknown ones (k < 0); j outside 0..k is refused."""
    if k < 0:
        return False
    if not 0 <= j <= k:
        raise ValueError(f"round with k={k}, j={j}: accepted drafts must be in 0..k (refused)")
    return True


class Tally:
    """Histograms that every per-position count derives from; add/remove in O(1)."""

    __slots__ = ("by_j", "by_k", "full", "n")

    def __init__(self) -> None:
        self.n = 0
        self.by_k: list[int] = []  # rounds by k
        self.by_j: list[int] = []  # rounds by j
        self.full: list[int] = []  # rounds with j == k, by k (censored there)

    def add(self, k: int, j: int, s: int = 1) -> None:
        if k >= len(self.by_k):
            grow = [0] * (k + 1 - len(self.by_k))
            self.by_k += grow
            self.by_j += grow
            self.full += grow
        self.n += s
        self.by_k[k] += s
        self.by_j[j] += s
        if j == k:
            self.full[k] += s

    def counts(self) -> tuple[list[int], list[int], list[int]]:
        """(drafted, accepted, at_risk) by position, up to the largest k seen."""
        drafted, accepted, at_risk = [], [], []
        dk = dj = 0
        for i in range(len(self.by_k) - 1, 0, -1):
            dk += self.by_k[i]
            dj += self.by_j[i]
            drafted.append(dk)
            accepted.append(dj)
            at_risk.append(dj + self.by_j[i - 1] - self.full[i - 1])
        cut = next((i for i, d in enumerate(drafted) if d), len(drafted))  # k's no longer held
        return drafted[cut:][::-1], accepted[cut:][::-1], at_risk[cut:][::-1]


class PositionCounts(NamedTuple):
    """By-position counter increments: ``sum(drafted) == Σk``, ``sum(accepted) == Σj``."""

    drafted: tuple[int, ...]
    accepted: tuple[int, ...]


def position_counts(rounds: Iterable[Counted]) -> PositionCounts:
    """What the ``..._by_position_total`` counters add for ``rounds``: a round adds 1 to
    drafted at 0..k-1 and to accepted at 0..j-1; unknown rounds are left out."""
    t = Tally()
    for r in rounds:
        if known(r.k, r.j):
            t.add(r.k, r.j)
    drafted, accepted, _ = t.counts()
    return PositionCounts(tuple(drafted), tuple(accepted))


@dataclass(frozen=True, slots=True)
class Position:
    position: int
    at_risk: int
    accepted: int
    #: P(accepted | drafted and every earlier draft accepted), Wilson interval.
    alpha: Interval
    #: P(drafts 0..position all accepted) = S(position+1), product-limit with a MOVER interval.
    survival: Interval


@dataclass(frozen=True, slots=True)
class AcceptanceEstimate:
    rounds: int  # rounds with known counts used
    skipped: int  # rounds with unknown counts left out
    level: float
    z: float
    positions: tuple[Position, ...]
    #: i.i.d. acceptance: the censored-geometric MLE, Σ accepted / Σ at risk (Wilson).
    pooled: Interval
    #: Assumed past the observed positions: the deepest positions' rate (a flat tail).
    tail: Interval

    def alpha(self, i: int) -> Interval:
        return self.positions[i].alpha if i < len(self.positions) else self.tail

    def expected_tokens(self, k: int) -> Interval:
        """E(k) = 1 + Σ_{i=1..k} S(i): tokens a round drafting k commits. Interval: each α's
        Wilson half-widths through dE/dα (MOVER); past the data, under the flat tail only."""
        al = [self.alpha(i) for i in range(k)]
        surv, s = [], 1.0
        for a in al:
            s *= a.value
            surv.append(s)
        e, lo2, hi2, r, g_tail = 1.0 + sum(surv), 0.0, 0.0, 1.0, 0.0
        for m in range(k - 1, -1, -1):
            g = (surv[m - 1] if m else 1.0) * r  # dE/dα_m
            if m < len(self.positions):
                lo2 += (g * (al[m].value - al[m].lo)) ** 2
                hi2 += (g * (al[m].hi - al[m].value)) ** 2
            else:
                g_tail += g
            r = 1.0 + al[m].value * r
        t = self.tail
        lo2 += (g_tail * (t.value - t.lo)) ** 2 if g_tail else 0.0
        hi2 += (g_tail * (t.hi - t.value)) ** 2 if g_tail else 0.0
        return Interval(e, max(1.0, e - math.sqrt(lo2)), min(1.0 + k, e + math.sqrt(hi2)))


def from_tally(
    t: Tally, level: float, max_position: int | None = None, skipped: int = 0
) -> AcceptanceEstimate:
    z = z_of(level)
    _, accepted, at_risk = t.counts()
    n_pos = next((i for i, n in enumerate(at_risk) if n == 0), len(at_risk))
    if max_position is not None:
        n_pos = min(n_pos, max_position + 1)
    positions: list[Position] = []
    logs = lo2 = hi2 = 0.0
    zero, up, prev = False, 1.0, Interval(1.0, 1.0, 1.0)
    for i in range(n_pos):
        a = wilson(accepted[i], at_risk[i], z)
        up *= a.hi
        zero = zero or a.value == 0.0
        if zero:  # S is 0 from here; the upper bound falls back to Π of the upper bounds
            sv = Interval(0.0, 0.0, up)
        else:
            logs += math.log(a.value)
            lo2 += (math.log(a.value) - math.log(a.lo)) ** 2 if a.lo > 0 else math.inf
            hi2 += (math.log(a.hi) - math.log(a.value)) ** 2
            lo = math.exp(logs - math.sqrt(lo2)) if lo2 < math.inf else 0.0
            sv = Interval(math.exp(logs), lo, min(1.0, math.exp(logs + math.sqrt(hi2))))
        prev = Interval(sv.value, min(sv.lo, prev.lo), min(sv.hi, prev.hi))
        positions.append(Position(i, at_risk[i], accepted[i], a, prev))
    acc_tail = risk_tail = 0
    for p in reversed(positions):
        acc_tail, risk_tail = acc_tail + p.accepted, risk_tail + p.at_risk
        if risk_tail >= TAIL_AT_RISK:
            break
    pooled = wilson(sum(p.accepted for p in positions), sum(p.at_risk for p in positions), z)
    tail = wilson(acc_tail, risk_tail, z)
    return AcceptanceEstimate(t.n, skipped, level, z, tuple(positions), pooled, tail)


def estimate_acceptance(
    rounds: Iterable[Counted], *, level: float = 0.95, max_position: int | None = None
) -> AcceptanceEstimate:
    """Per-position acceptance (positions 0..max_position at most), survival, E(k) and the
    pooled i.i.d. rate over ``rounds``; rounds with unknown counts (k < 0) are skipped, a
    round with j outside 0..k raises ValueError."""
    t, skipped = Tally(), 0
    for r in rounds:
        if known(r.k, r.j):
            t.add(r.k, r.j)
        else:
            skipped += 1
    return from_tally(t, level, max_position, skipped)
