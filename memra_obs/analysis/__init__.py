"""Acceptance analytics and the k advisor: plain functions over rounds (with ``k``, ``j``, k < 0
unknown, and ``phase_ns()``, as ``RoundRecord``), plain values out; nothing here imports the
rest of memra_obs. Position i (0-based, as vLLM's) is at risk when k > i and j >= i: dividing by
those rounds keeps a short draft from reading as a rejection. Costs are least squares on [1, k]
over exact integer sums: a window adds and removes rounds in O(1), without drift (README, "The
sliding window")."""

from __future__ import annotations

import copy
import math
import struct
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, islice
from operator import mul
from statistics import NormalDist
from typing import Any, NamedTuple, Protocol

CLOCKS = ("sync", "event", "host")
#: Fewest drafting rounds (k >= 1) for advice: below it E(k) is too loose and the slopes swing.
MIN_ROUNDS = 32
#: Steps a recommendation may take past the longest draft seen, where E(k) is the flat tail's.
EXPLORE = 2
#: Rounds at risk the flat tail (positions past the data) is pooled from, deepest first.
TAIL_AT_RISK = 30
#: x = (1, k, draft, verify, accept, rollback, maint, wall) ns: Stats keeps Σ x_a·x_b for the
#: pairs the fit uses (lines in k of draft, verify and the wall, means of the rest, verify·wall).
PAIRS = [(0, 0), (0, 1), (1, 1), *((0, a) for a in range(2, 8)), *((a, a) for a in range(2, 8))]
PAIRS += [(1, 2), (1, 3), (1, 7), (3, 7)]
AT = {p: i for i, p in enumerate(PAIRS)} | {(b, a): i for i, (a, b) in enumerate(PAIRS)}
ONE, K, DRAFT, VERIFY, ACCEPT, ROLL, MAINT, WALL = ((i,) for i in range(8))


class Counted(Protocol):
    """A round's counts: k drafted (k < 0: unknown), j accepted."""

    @property
    def k(self) -> int: ...
    @property
    def j(self) -> int: ...


class RoundLike(Counted, Protocol):
    """A round (``RoundRecord`` fits): its counts and its phases in ns."""

    def phase_ns(self) -> tuple[int, int, int, int, int]: ...


_ROW = struct.Struct("7Q")  # a round in a Ring: k, j, five phases


class Kept(NamedTuple):
    """A round as a window holds it: its counts and phases (a ``RoundLike``)."""

    k: int
    j: int
    ph: tuple[int, int, int, int, int]

    def phase_ns(self) -> tuple[int, int, int, int, int]:
        return self.ph


class Ring:
    """The last ``size`` rounds as 7 unsigned 64-bit ints in one buffer, 56 B a round (tuples of
    ints: ~300). A round no loop makes (a count or phase < 0 or past 64 bits, not five phases)
    raises ``struct.error`` at ``push``, leaving the ring as it was."""

    __slots__ = ("at", "b", "n", "size")

    def __init__(self, size: int) -> None:
        self.b, self.size, self.at, self.n = bytearray(), size, 0, 0  # grows while it fills

    def __len__(self) -> int:
        return self.n

    def _at(self, i: int) -> Kept:
        k, j, *ph = _ROW.unpack_from(self.b, 56 * i)
        return Kept(k, j, (*ph,))

    def oldest(self) -> Kept | None:
        """The round the next ``push`` overwrites (None while the ring fills)."""
        return self._at(self.at) if self.n == self.size else None

    def push(self, k: int, j: int, ph: Sequence[int]) -> None:
        if self.n < self.size:
            self.b += _ROW.pack(k, j, *ph)
            self.n += 1
        else:  # (not pack_into: it writes up to the value it refuses)
            self.b[56 * self.at : 56 * self.at + 56] = _ROW.pack(k, j, *ph)
        self.at = (self.at + 1) % self.size

    def last(self, m: int) -> Iterator[Kept]:
        """The newest ``m`` rounds (all: ``len(ring)``), oldest first."""
        m = min(m, self.n)
        for d in range(m):
            yield self._at((self.at - m + d) % self.size)


class Interval(NamedTuple):
    value: float
    lo: float
    hi: float


def z_of(level: float, clock: str = "host") -> float:
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {CLOCKS}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level!r}: expected a confidence level in (0, 1)")
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson(x: int, n: int, z: float) -> Interval:
    """Wilson's interval: inside [0, 1], never a point at 0 or n successes (Wald's is)."""
    if n <= 0:
        return Interval(math.nan, 0.0, 1.0)
    p, z2 = x / n, z * z
    c, h, d = p + z2 / (2 * n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)), 1 + z2 / n
    return Interval(p, max(0.0, (c - h) / d), min(1.0, (c + h) / d))


def known(r: Counted) -> bool:
    """False for unknown counts (k < 0). j outside 0..k is contradictory data: an estimate from
    it would be wrong and a clamp would hide the bug that made it, so it raises."""
    if r.k >= 0 and not 0 <= r.j <= r.k:
        raise ValueError(f"round with k={r.k}, j={r.j}: accepted drafts must be in 0..k (refused)")
    return r.k >= 0


class Stats:
    """What the estimates need of a set of rounds: rounds by (k, j), and the sums in exact ints
    (phases are integer ns), so a window adds and removes a round (``s`` = -1) in O(1), without
    drift. Rounds with unknown counts are ``skipped``."""

    def __init__(self, rounds: Iterable[RoundLike] = (), phases: bool = True) -> None:
        self.kj: Counter[tuple[int, int]] = Counter()
        self.g, self.skipped, it = [0] * len(PAIRS), 0, iter(rounds)
        while chunk := list(islice(it, 4096)):  # the sums a column at a time: 2x faster than add
            ok = [r for r in chunk if known(r)]
            self.skipped += len(chunk) - len(ok)
            self.kj.update((r.k, r.j) for r in ok)
            if phases and ok:
                x = list(zip(*((1, r.k, *(p := r.phase_ns()), sum(p)) for r in ok), strict=True))
                for i, (a, b) in enumerate(PAIRS):
                    self.g[i] += sum(map(mul, x[a], x[b]))

    def add(self, k: int, j: int, ph: Sequence[int], s: int = 1) -> None:
        self.kj[k, j] += s
        x = (1, k, *ph, sum(ph))
        self.g = [g + s * x[a] * x[b] for g, (a, b) in zip(self.g, PAIRS, strict=True)]

    def s(self, u: Sequence[int], w: Sequence[int]) -> int:  # Σ (Σ_u x_a)·(Σ_w x_b) over rounds
        return sum(self.g[AT[a, b]] for a in u for b in w)

    def counts(self) -> tuple[list[int], list[int], list[int]]:
        """(drafted, accepted, at risk) by position, up to the longest draft held."""
        kj = [(k, j, n) for (k, j), n in self.kj.items() if n]
        top = max((k for k, _, _ in kj), default=0)
        return (
            [sum(n for k, _, n in kj if k > i) for i in range(top)],
            [sum(n for _, j, n in kj if j > i) for i in range(top)],
            [sum(n for k, j, n in kj if k > i and j >= i) for i in range(top)],
        )


class PositionCounts(NamedTuple):  # sum(drafted) == Σk, sum(accepted) == Σj
    drafted: tuple[int, ...]
    accepted: tuple[int, ...]


def position_counts(rounds: Iterable[RoundLike]) -> PositionCounts:
    """What the ``..._by_position_total`` counters add: a round adds 1 to drafted at 0..k-1 and
    to accepted at 0..j-1; rounds with unknown counts are left out."""
    return PositionCounts(*map(tuple, Stats(rounds, phases=False).counts()[:2]))


@dataclass(frozen=True, slots=True)
class Position:
    position: int
    at_risk: int
    accepted: int
    alpha: Interval  # P(accepted | drafted, every earlier draft accepted): Wilson
    survival: Interval  # S(position + 1) = P(drafts 0..position accepted): product-limit, MOVER


@dataclass(frozen=True, slots=True)
class AcceptanceEstimate:
    rounds: int  # rounds with known counts
    skipped: int  # rounds with unknown counts, left out
    level: float
    positions: tuple[Position, ...]
    pooled: Interval  # the i.i.d. rate: Σ accepted / Σ at risk, the censored-geometric MLE
    tail: Interval  # assumed past the data: the deepest positions' rate (a flat tail)
    #: Every position (``positions`` may be capped by ``max_position``): E(k) reads these.
    every: tuple[Position, ...] = field(default=(), repr=False, compare=False)

    def expected_tokens(self, k: int) -> Interval:
        """E(k) = 1 + Σ_{i=1..k} S(i), the tokens a round drafting k commits; its interval has
        each α's Wilson half-widths through dE/dα (MOVER), past the data the flat tail's
        and its covariance with the deepest positions it pools."""
        ps = self.every or self.positions
        n = len(ps)
        al = [ps[i].alpha if i < n else self.tail for i in range(k)]
        surv = list(accumulate((a.value for a in al), mul))
        grad, r = [0.0] * (min(k, n) + 1), 1.0  # dE/dα of each position seen, then of the tail
        for m in range(k - 1, -1, -1):
            grad[min(m, n)] += (surv[m - 1] if m else 1.0) * r
            r = 1.0 + al[m].value * r
        # (weight, α): weight·half-width² adds to the variance; g² of each estimate, and the
        # tail's covariance with the deepest positions it pools (w_m var(α_m), w_m their share)
        terms = [(g * g, a) for g, a in zip(grad, [*al[:n], self.tail], strict=True) if g]
        if k > n:
            first, _, pooled = _tail_of(ps)
            for p in ps[first:]:
                terms.append((2 * grad[n] * grad[p.position] * p.at_risk / pooled, p.alpha))
        lo = math.sqrt(sum(w * (a.value - a.lo) ** 2 for w, a in terms))
        hi = math.sqrt(sum(w * (a.hi - a.value) ** 2 for w, a in terms))
        return Interval(e := 1.0 + sum(surv), max(1.0, e - lo), min(1.0 + k, e + hi))


def _tail_of(positions: Sequence[Position]) -> tuple[int, int, int]:
    """The flat tail's data: (first position pooled, accepted, at risk) of the deepest
    positions, until TAIL_AT_RISK rounds at risk."""
    first, x, n = len(positions), 0, 0
    for p in reversed(positions):
        if n >= TAIL_AT_RISK:
            break
        first, x, n = p.position, x + p.accepted, n + p.at_risk
    return first, x, n


def estimate_acceptance(
    rounds: Iterable[RoundLike] | Stats, *, level: float = 0.95, max_position: int | None = None
) -> AcceptanceEstimate:
    """α_i and S(i+1) by position (0..max_position at most: the pooled and tail rates and
    E(k) are over every position), E(k) and the pooled rate."""
    st = rounds if isinstance(rounds, Stats) else Stats(rounds, phases=False)
    z, (_, accepted, at_risk) = z_of(level), st.counts()
    n_pos = next((i for i, n in enumerate(at_risk) if n == 0), len(at_risk))
    positions: list[Position] = []
    logs, lo2, hi2, up, prev = 0.0, 0.0, 0.0, 1.0, Interval(1.0, 1.0, 1.0)
    for i in range(n_pos):
        a = wilson(accepted[i], at_risk[i], z)
        up *= a.hi
        if a.value == 0.0 or prev.value == 0.0:  # S is 0 from here; above: Π upper bounds
            sv = Interval(0.0, 0.0, up)
        else:
            logs += math.log(a.value)
            lo2 += math.log(a.value / a.lo) ** 2 if a.lo > 0 else math.inf
            hi2 += math.log(a.hi / a.value) ** 2
            s = math.exp(logs)
            sv = Interval(s, s * math.exp(-math.sqrt(lo2)), min(1.0, s * math.exp(math.sqrt(hi2))))
        prev = Interval(sv.value, min(sv.lo, prev.lo), min(sv.hi, prev.hi))
        positions.append(Position(i, at_risk[i], accepted[i], a, prev))
    pooled = wilson(sum(p.accepted for p in positions), sum(p.at_risk for p in positions), z)
    tail = wilson(*_tail_of(positions)[1:], z)
    shown = positions if max_position is None else positions[: max_position + 1]
    return AcceptanceEstimate(
        st.kj.total(), st.skipped, level, (*shown,), pooled, tail, (*positions,)
    )


def spec_decode_record(
    rounds: Iterable[Counted], *, detailed: bool = False, num_spec_tokens: int | None = None
) -> dict[str, Any]:
    """vLLM's per-request ``metrics.speculative_decoding`` (AIPerf's ``spec_decode_acceptance``)
    in vLLM's key order; a step is a round that drafted (k >= 1), as vLLM counts one."""
    steps = [(r.k, r.j) for r in rounds if known(r) and r.k > 0]
    n_spec = max((k for k, _ in steps), default=0)
    if num_spec_tokens is not None and num_spec_tokens < n_spec:
        raise ValueError(f"num_spec_tokens={num_spec_tokens} is below a round's k={n_spec}")
    by_j = Counter(j for _, j in steps)
    hist = [by_j[j] for j in range((num_spec_tokens or n_spec) + 1)]
    drafted, accepted = sum(k for k, _ in steps), sum(j for _, j in steps)
    out: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / len(steps) if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": hist,
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": len(hist) - 1,
    }
    if detailed and steps:  # as vLLM's to_dict: no step, no lists
        out["per_step_accepted"] = [j for _, j in steps]
        out["per_step_drafted"] = [k for k, _ in steps]
    return out


@dataclass(frozen=True, slots=True)
class CostModel:
    clock: str  # which clock fed it: "sync", "event" or "host"
    rounds: int
    identifiable: bool  # False when k never varied: slopes assumed, see ``assumption``
    assumption: str  # "" when everything was fitted
    draft_fixed_ns: Interval
    draft_per_token_ns: Interval
    verify_fixed_ns: Interval
    verify_per_row_ns: Interval
    accept_ns: Interval
    rollback_ns: Interval
    maint_ns: Interval
    var_round: float  # residual variance of the round wall about its line in k, ns²
    var_verify: float  # of verify
    cov_verify_round: float
    design: tuple[int, int, int]  # n, Σk, Σk²: residual (co)variances -> prediction ones

    def verify_ns(self, rows: float) -> float:
        return self.verify_fixed_ns.value + self.verify_per_row_ns.value * rows

    def round_ns(self, k: float) -> float:
        fixed = self.accept_ns.value + self.rollback_ns.value + self.maint_ns.value
        draft = self.draft_fixed_ns.value + self.draft_per_token_ns.value * k
        return max(1.0, draft + self.verify_ns(k + 1) + fixed)

    def leverage(self, k1: float, k2: float) -> float:  # cov(fit at k1, fit at k2) per unit σ²
        n, sk, skk = self.design
        dd = n * skk - sk * sk
        return (skk - (k1 + k2) * sk + k1 * k2 * n) / dd if dd else 1.0 / n


def fit_costs(rounds: Iterable[RoundLike] | Stats, *, clock: str, level: float = 0.95) -> CostModel:
    m = rounds if isinstance(rounds, Stats) else Stats(rounds)
    n, sk, skk, z = m.s(ONE, ONE), m.s(ONE, K), m.s(K, K), z_of(level, clock)
    if n < 3:
        raise ValueError(f"fit_costs needs at least 3 rounds with known counts, got {n}")
    dd = n * skk - sk * sk  # 0: k never varied
    df = n - 2 if dd else n - 1
    notes = [] if dd else [f"k never varied (k={sk // n}): verify assumed flat in rows"]
    notes += ["draft assumed proportional to k"] if not dd and sk else []

    def cross(u: tuple[int, ...], w: tuple[int, ...]) -> float:  # residual covariance
        a, b = m.s(ONE, u), m.s(ONE, w)
        c = n * m.s(u, w) - a * b
        if not dd:
            return c / n / df
        return (c * dd - (n * m.s(K, u) - sk * a) * (n * m.s(K, w) - sk * b)) / (n * dd) / df

    def mean(u: tuple[int, ...]) -> Interval:
        y, var = m.s(ONE, u) / n, max(0.0, n * m.s(u, u) - m.s(ONE, u) ** 2) / (n * n * (n - 1))
        return Interval(y, y - z * math.sqrt(var), y + z * math.sqrt(var))

    def line(u: tuple[int, ...], x: tuple[int, ...], per: int, name: str) -> tuple[Interval, ...]:
        """u on [1, x]; with k constant: flat (per = 0) or through 0 (per = 1)."""
        y, sx, var = m.s(ONE, u), m.s(ONE, x), max(0.0, cross(u, u))
        c1 = (n * m.s(x, u) - sx * y) / dd if dd else (y / sx if sx and per else 0.0)
        if c1 < 0:
            notes.append(f"{name} slope fitted negative ({c1:.0f} ns): clamped to 0")
            c1 = 0.0
        c0 = (y - c1 * sx) / n if dd or not per else 0.0  # through 0: exactly, not -1e-12
        se1 = math.sqrt(var * n / dd) if dd else math.sqrt(var / n) * per * n / max(sx, 1)
        se0 = math.sqrt(var * m.s(x, x) / dd) if dd else math.sqrt(var / n) * (1 - per)
        if c0 < 0 and per:  # no cost is negative: draft through 0 (k sequential steps)
            notes.append(f"{name} fixed part fitted negative ({c0:.0f} ns): line through 0")
            hi0, c1, se1 = c0 + z * se0, m.s(x, u) / m.s(x, x), math.sqrt(var / m.s(x, x))
            return Interval(0.0, 0.0, max(0.0, hi0)), Interval(c1, c1 - z * se1, c1 + z * se1)
        if c0 < 0:  # verify: a step jump over a narrow range of k (a tile boundary). Any line
            # extrapolates it; through 0, one row cost a fraction of the step: the plain step
            # read 4x short, k=1 won and the speedup read < 1. Flat, as with k constant.
            notes.append(f"{name} fixed part fitted negative ({c0:.0f} ns): assumed flat in rows")
            return mean(u), Interval(0.0, 0.0, 0.0)
        return Interval(c0, c0 - z * se0, c0 + z * se0), Interval(c1, c1 - z * se1, c1 + z * se1)

    d0, d1, a, b = *line(DRAFT, K, 1, "draft"), *line(VERIFY, ONE + K, 0, "verify")
    return CostModel(
        clock, n, bool(dd), "; ".join(notes), d0, d1, a, b, mean(ACCEPT), mean(ROLL),
        mean(MAINT), max(0.0, cross(WALL, WALL)), max(0.0, cross(VERIFY, VERIFY)),
        cross(VERIFY, WALL), (n, sk, skk),
    )  # fmt: skip


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
    estimated_speedup: Interval  # throughput(k*) · plain step; below 1 plain decoding wins
    plain_step_ns: float
    plain_step_source: str  # "verify_fit" (verify at one row) or "measured"
    observed_k: int  # the longest draft seen; recommended_k <= observed_k + explore
    current_k: float  # mean k of the rounds
    current_tokens_per_s: Interval  # the model's throughput at round(current_k)
    measured_tokens_per_s: float  # tokens / round time the rounds actually took
    clock: str
    rounds: int
    level: float
    curve: tuple[KPoint, ...]  # k = 1..max_k
    acceptance: AcceptanceEstimate
    costs: CostModel
    estimate: bool = True  # label it an estimate wherever it is published


def _ratio(e: Interval, log_var: float, z: float, scale: float) -> Interval:
    """scale·E: E's asymmetric interval and the costs' log-variance combined (MOVER)."""
    v = scale * e.value
    if not v > 0 or not e.lo > 0:
        return Interval(v, 0.0, math.inf)
    lo, hi, c = math.log(e.value / e.lo), math.log(e.hi / e.value), z * z * log_var
    up = math.sqrt(hi * hi + c)  # past exp's range (costs no fit explains): no upper bound
    down = math.sqrt(lo * lo + c)
    return Interval(v, v * math.exp(-down), v * math.exp(up) if up < 709 else math.inf)


def advise(rounds: Iterable[RoundLike] | Stats, *, max_k: int = 16,
           plain_step_ns: float | None = None, clock: str = "event", level: float = 0.95,
           explore: int = EXPLORE) -> Advice | None:  # fmt: skip
    """Advice over ``rounds`` (or their Stats); None below MIN_ROUNDS drafting rounds, or if they
    (or their verify, with no measured plain step ``plain_step_ns`` to stand for its fit at one
    row) took no time. k stays within ``explore`` of the longest draft seen; curve: 1..max_k."""
    z = z_of(level, clock)
    for name, v in (("max_k", max_k), ("explore", explore)):
        if type(v) is not int:
            raise TypeError(f"{name}={v!r}: expected an int")
        if v < (name == "max_k"):  # max_k=0 read as "too few rounds"; explore<0 advised below k
            raise ValueError(
                f"{name}={v}: expected {'1 or more' if name == 'max_k' else '0 or more'}"
            )
    if plain_step_ns is not None and not 0 < plain_step_ns < math.inf:
        raise ValueError(f"plain_step_ns={plain_step_ns!r}: expected a positive time in ns")
    st = rounds if isinstance(rounds, Stats) else Stats(rounds)
    acc = estimate_acceptance(st, level=level)
    wall = st.s(ONE, WALL)  # 0: billions of tokens/s, nan speedup; verify 0: speedup 0
    untimed = wall <= 0 or (plain_step_ns is None and st.s(ONE, VERIFY) <= 0)
    if not acc.positions or acc.positions[0].at_risk < MIN_ROUNDS or untimed:
        return None
    c = fit_costs(st, clock=clock, level=level)
    curve = []
    for k in range(1, max_k + 1):
        e, tk = acc.expected_tokens(k), c.round_ns(k)
        tps = _ratio(e, c.var_round * c.leverage(k, k) / tk**2, z, 1e9 / tk)
        curve.append(KPoint(k, e, tk, tps, k > len(acc.positions)))
    seen = max(k for (k, _), n in st.kj.items() if n)
    best = max(curve[: max(1, seen + explore)], key=lambda p: p.tokens_per_s.value)  # ties: min k
    k, tk = best.k, best.round_ns
    var = c.var_round * c.leverage(k, k) / tk**2
    if plain_step_ns is None:  # verify at one row shares the rounds with t_round: covariance
        plain, source, v1 = c.verify_ns(1), "verify_fit", max(c.verify_ns(1), 1.0)
        var += c.var_verify * c.leverage(0, 0) / v1**2
        var -= 2 * c.cov_verify_round * c.leverage(0, k) / (v1 * tk)
    else:
        plain, source = float(plain_step_ns), "measured"
    mean_k = sum(k * n for (k, _), n in st.kj.items()) / acc.rounds
    now = curve[min(max_k, max(1, round(mean_k))) - 1].tokens_per_s
    tokens = sum((j + 1) * n for (_, j), n in st.kj.items())
    speedup = _ratio(best.expected_tokens, max(0.0, var), z, plain / tk)
    return Advice(
        k, best.expected_tokens, best.tokens_per_s, speedup, plain, source, seen, mean_k, now,
        tokens * 1e9 / wall, clock, acc.rounds, level, (*curve,), acc, c,
    )  # fmt: skip


class AdviceWindow:
    """The last ``size`` rounds with known counts of one family; ``advice()`` is :func:`advise`
    over them with ``options`` (its keywords). ``add`` runs on an exporter thread, so it never
    raises: unknown counts are ignored, j outside 0..k (or a phase no loop makes: < 0, past 64
    bits) dropped and counted in ``refused``."""

    def __init__(self, size: int = 2048, **options: Any) -> None:
        if size < MIN_ROUNDS:
            raise ValueError(f"size={size}: a window holds at least MIN_ROUNDS={MIN_ROUNDS}")
        advise(Stats(), **options)  # a bad keyword, clock or level fails here, not on a scrape
        self.size, self.refused, self._opts, self._st = size, 0, options, Stats()
        self._lock, self._q = threading.Lock(), Ring(size)

    def __len__(self) -> int:
        return len(self._q)

    def add(self, r: RoundLike) -> bool:  # True when the round entered the window
        k, j = r.k, r.j
        if k < 0 or not 0 <= j <= k:
            self.refused += k >= 0  # unknown counts are not refusals
            return False
        with self._lock:
            old = self._q.oldest()
            try:
                self._q.push(k, j, ph := r.phase_ns())
            except (TypeError, struct.error):
                self.refused += 1
                return False
            if old is not None:
                self._st.add(*old, -1)
            self._st.add(k, j, ph)
        return True

    def advice(self) -> Advice | None:
        with self._lock:
            st = copy.deepcopy(self._st)
        return advise(st, **self._opts)
