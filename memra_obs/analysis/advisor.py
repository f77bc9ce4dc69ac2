"""The k advisor: throughput(k) = E(k) / t_round(k) for k = 1..max_k, the k that maximises it,
and the speedup over plain decoding. Every number is an estimate (``Advice.estimate``), from the
acceptance curve and the cost model of the rounds given, timed by the clock it names.

``AdviceWindow`` keeps the same sufficient statistics over the last N rounds: ``add`` is O(1)
(histogram and integer-sum updates, the leaving round subtracted), ``advice`` costs
O(max_k²), whatever N.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from .acceptance import AcceptanceEstimate, Interval, Tally, from_tally, known
from .costs import CostModel, Moments, RoundLike, check_clock, fit_from

#: Fewest rounds that drafted (k >= 1) before there is advice: below it E(k) is too loose
#: to act on and the slopes swing.
MIN_ROUNDS = 32
#: Default for how far past the longest draft seen a recommendation may go: beyond the data,
#: acceptance is the flat-tail extrapolation alone, so the loop steps there, the window sees
#: it, and the next advice can step further.
EXPLORE = 2


@dataclass(frozen=True, slots=True)
class KPoint:
    k: int
    expected_tokens: Interval
    round_ns: float
    tokens_per_s: Interval
    extrapolated: bool  # k past the positions seen: E(k) leans on the flat tail


@dataclass(frozen=True, slots=True)
class Advice:
    recommended_k: int
    expected_tokens: Interval  # E(k*)
    tokens_per_s: Interval  # throughput(k*)
    #: throughput(k*) / (1 / plain step); below 1, plain decoding is faster.
    estimated_speedup: Interval
    plain_step_ns: float
    plain_step_source: str  # "verify_fit" (verify at one row) or "measured"
    observed_k: int  # the longest draft seen; recommended_k <= observed_k + explore
    current_k: float  # mean k of the rounds
    current_tokens_per_s: Interval  # the model's throughput at round(current_k)
    measured_tokens_per_s: float  # tokens / round time actually spent in these rounds
    clock: str
    rounds: int
    level: float
    curve: tuple[KPoint, ...]  # k = 1..max_k
    acceptance: AcceptanceEstimate
    costs: CostModel
    estimate: bool = True  # label it an estimate wherever it is published


def _ratio(e: Interval, num_var: float, z: float, scale: float) -> Interval:
    """scale·E with E's (asymmetric) interval and a log-variance from the costs (MOVER)."""
    v = scale * e.value
    if not v > 0 or not e.lo > 0:
        return Interval(v, 0.0, math.inf)
    dlo, dhi, c = math.log(e.value / e.lo), math.log(e.hi / e.value), z * z * num_var
    return Interval(
        v, v * math.exp(-math.sqrt(dlo * dlo + c)), v * math.exp(math.sqrt(dhi * dhi + c))
    )


def advise_from(
    t: Tally,
    m: Moments,
    max_k: int,
    plain_step_ns: float | None,
    clock: str,
    level: float,
    explore: int,
) -> Advice | None:
    acc = from_tally(t, level)
    if not acc.positions or acc.positions[0].at_risk < MIN_ROUNDS or max_k < 1:
        return None
    c, z = fit_from(m, clock, level), acc.z
    curve = []
    for k in range(1, max_k + 1):
        e, tk = acc.expected_tokens(k), c.round_ns(k)
        var_t = c.var_round * c.leverage(k, k) / tk**2
        curve.append(KPoint(k, e, tk, _ratio(e, var_t, z, 1e9 / tk), k > len(acc.positions)))
    seen = max(i for i, n in enumerate(t.by_k) if n)
    reach = curve[: max(1, seen + explore)]
    best = max(reach, key=lambda p: p.tokens_per_s.value)  # first of equals: the smaller k
    k, tk = best.k, best.round_ns
    var = c.var_round * c.leverage(k, k) / tk**2
    if plain_step_ns is None:
        plain, source = c.verify_ns(1), "verify_fit"
        v1 = max(plain, 1.0)
        var += c.var_verify * c.leverage(0, 0) / v1**2
        var -= 2 * c.cov_verify_round * c.leverage(0, k) / (v1 * tk)
    else:
        plain, source = float(plain_step_ns), "measured"
    mean_k = sum(i * n for i, n in enumerate(t.by_k)) / t.n
    now = curve[min(max_k, max(1, round(mean_k))) - 1].tokens_per_s
    tokens = t.n + sum(i * n for i, n in enumerate(t.by_j))
    measured = tokens * 1e9 / m.s[m.W] if m.s[m.W] > 0 else math.nan
    speedup = _ratio(best.expected_tokens, max(0.0, var), z, plain / tk)
    return Advice(
        *(k, best.expected_tokens, best.tokens_per_s, speedup, plain, source, seen, mean_k, now),
        *(measured, clock, t.n, level, tuple(curve), acc, c),
    )


def advise(
    rounds: Iterable[RoundLike],
    *,
    max_k: int = 16,
    plain_step_ns: float | None = None,
    clock: str = "event",
    level: float = 0.95,
    explore: int = EXPLORE,
) -> Advice | None:
    """Advice over ``rounds`` (unknown counts skipped; j outside 0..k raises ValueError), or
    None with fewer than MIN_ROUNDS drafting rounds. ``plain_step_ns``: a measured plain
    one-token step; else the verify fit at one row stands in for it. The recommendation stays
    within ``explore`` of the longest draft seen; the curve covers 1..max_k."""
    check_clock(clock)
    t, m = Tally(), Moments()
    for r in rounds:
        if known(r.k, r.j):
            t.add(r.k, r.j)
            m.add(r.k, r.phase_ns())
    return advise_from(t, m, max_k, plain_step_ns, clock, level, explore)


class AdviceWindow:
    """The last ``size`` rounds with known counts of one family; ``advice()`` on demand.

    ``add`` runs on an exporter thread, so it never raises: a round with unknown counts is
    ignored, one with j outside 0..k is dropped and counted in ``refused``."""

    __slots__ = ("_lock", "_m", "_opts", "_q", "_t", "refused", "size")

    def __init__(
        self,
        size: int = 2048,
        *,
        max_k: int = 16,
        clock: str = "event",
        plain_step_ns: float | None = None,
        level: float = 0.95,
        explore: int = EXPLORE,
    ) -> None:
        if size < MIN_ROUNDS:
            raise ValueError(f"size={size}: a window holds at least MIN_ROUNDS={MIN_ROUNDS}")
        self.size, self.refused = size, 0
        self._opts = (max_k, plain_step_ns, check_clock(clock), level, explore)
        self._t, self._m = Tally(), Moments()
        self._q: deque[tuple[int, int, tuple[int, int, int, int, int]]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, r: RoundLike) -> bool:
        """Take one round; True when it entered the window."""
        k, j = r.k, r.j
        if k < 0 or not 0 <= j <= k:
            self.refused += k >= 0  # unknown counts are not refusals
            return False
        ph = r.phase_ns()
        with self._lock:
            self._t.add(k, j)
            self._m.add(k, ph)
            self._q.append((k, j, ph))
            if len(self._q) > self.size:
                ok, oj, oph = self._q.popleft()
                self._t.add(ok, oj, -1)
                self._m.add(ok, oph, -1)
        return True

    def advice(self) -> Advice | None:
        with self._lock:
            t, m = copy.deepcopy(self._t), copy.deepcopy(self._m)
        return advise_from(t, m, *self._opts)
