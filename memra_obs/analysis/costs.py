"""The round's cost as a function of k, fitted from the loop's own phases.

Least squares over rounds on the design [1, k]: draft(k) = d0 + d1·k, verify over t = k+1 rows
= a + b·t, accept / rollback / maint fixed (their means). The sums it needs are Python ints
(phases are integer ns), so a sliding window adds and removes rounds exactly, without drift.
When k never varied, the slopes are not identifiable: verify is then assumed flat in rows (the
memory-bound regime the speculative-decoding speedup argument rests on) and draft proportional
to k, and the model says so in ``assumption``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from operator import add, sub
from typing import Protocol

from .acceptance import Counted, Interval, known, z_of

CLOCKS = ("sync", "event", "host")


class RoundLike(Counted, Protocol):
    """A round with counts and phase times (``RoundRecord`` fits)."""

    def phase_ns(self) -> tuple[int, int, int, int, int]: ...


class Moments:
    """Exact integer sums over rounds for the fits: k, and draft/verify/wall (y, k·y, y²)."""

    __slots__ = ("n", "s")

    #: Index of each sum in ``s``.
    K, KK, D, KD, DD, V, KV, VV, W, KW, WW, VW, A, AA, R, RR, M, MM = range(18)

    def __init__(self) -> None:
        self.n = 0
        self.s = [0] * 18

    def add(self, k: int, ph: tuple[int, ...], sign: int = 1) -> None:
        d, v, a, r, m = ph
        w = d + v + a + r + m
        lin = (k, k * k, d, k * d, d * d, v, k * v, v * v, w, k * w, w * w, v * w)
        self.n += sign
        self.s = list(map(add if sign > 0 else sub, self.s, (*lin, a, a * a, r, r * r, m, m * m)))


@dataclass(frozen=True, slots=True)
class CostModel:
    clock: str  # which clock fed it: "sync", "event" or "host"
    rounds: int
    identifiable: bool  # False when k never varied (slopes assumed, see ``assumption``)
    assumption: str  # "" when everything was fitted
    draft_fixed_ns: Interval
    draft_per_token_ns: Interval
    verify_fixed_ns: Interval
    verify_per_row_ns: Interval
    accept_ns: Interval
    rollback_ns: Interval
    maint_ns: Interval
    #: Residual variance of the round wall and of verify, their covariance (ns²), and the
    #: design sums (n, Σk, Σk²) that turn them into prediction variances.
    var_round: float
    var_verify: float
    cov_verify_round: float
    design: tuple[int, int, int]

    def draft_ns(self, k: float) -> float:
        return self.draft_fixed_ns.value + self.draft_per_token_ns.value * k

    def verify_ns(self, rows: float) -> float:
        return self.verify_fixed_ns.value + self.verify_per_row_ns.value * rows

    def round_ns(self, k: float) -> float:
        fixed = self.accept_ns.value + self.rollback_ns.value + self.maint_ns.value
        return max(1.0, self.draft_ns(k) + self.verify_ns(k + 1) + fixed)

    def leverage(self, k1: float, k2: float) -> float:
        """Cov of two fitted values at k1, k2 per unit residual covariance."""
        n, sk, skk = self.design
        dd = n * skk - sk * sk
        return (skk - (k1 + k2) * sk + k1 * k2 * n) / dd if dd else 1.0 / n


def check_clock(clock: str) -> str:
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}: expected one of {CLOCKS}")
    return clock


def fit_from(m: Moments, clock: str, level: float) -> CostModel:
    check_clock(clock)
    n, s, z = m.n, m.s, z_of(level)
    if n < 3:
        raise ValueError(f"fit_costs needs at least 3 rounds with known counts, got {n}")
    sk, skk = s[m.K], s[m.KK]
    dd = n * skk - sk * sk
    df = n - 2 if dd else n - 1
    notes: list[str] = [] if dd else [f"k never varied (k={sk // n}): verify assumed flat in rows"]

    def cross(a: int, b: int, ka: int, kb: int, ab: int) -> float:  # residual cross-product
        if not dd:
            return (n * ab - a * b) / n
        return ((n * ab - a * b) * dd - (n * ka - sk * a) * (n * kb - sk * b)) / (n * dd)

    def line(y: int, ky: int, yy: int, name: str, per: float) -> tuple[Interval, Interval]:
        var = max(0.0, cross(y, y, ky, ky, yy)) / max(df, 1)
        c1 = (n * ky - sk * y) / dd if dd else (y / sk if sk and per else 0.0)
        if c1 < 0:
            notes.append(f"{name} slope fitted negative ({c1:.0f} ns): clamped to 0")
            c1 = 0.0
        c0 = (y - c1 * sk) / n
        se1 = math.sqrt(var * n / dd) if dd else math.sqrt(var / n) * per * n / max(sk, 1)
        se0 = math.sqrt(var * skk / dd) if dd else math.sqrt(var / n) * (1 - per)
        return Interval(c0, c0 - z * se0, c0 + z * se0), Interval(c1, c1 - z * se1, c1 + z * se1)

    def mean(y: int, yy: int) -> Interval:
        h = z * math.sqrt(max(0.0, (n * yy - y * y) / (n * (n - 1))) / n)
        return Interval(y / n, y / n - h, y / n + h)

    if not dd and sk:
        notes.append("draft assumed proportional to k")
    d0, d1 = line(s[m.D], s[m.KD], s[m.DD], "draft", 1.0)
    v0, b = line(s[m.V], s[m.KV], s[m.VV], "verify", 0.0)
    var_w = cross(s[m.W], s[m.W], s[m.KW], s[m.KW], s[m.WW]) / df
    var_v = cross(s[m.V], s[m.V], s[m.KV], s[m.KV], s[m.VV]) / df
    h = z * math.sqrt(max(0.0, var_v) * ((skk + 2 * sk + n) / dd if dd else 1 / n))
    a = Interval(v0.value - b.value, v0.value - b.value - h, v0.value - b.value + h)  # t = 0
    cov = cross(s[m.V], s[m.W], s[m.KV], s[m.KW], s[m.VW]) / df
    fixed = (mean(s[m.A], s[m.AA]), mean(s[m.R], s[m.RR]), mean(s[m.M], s[m.MM]))
    return CostModel(
        clock, n, bool(dd), "; ".join(notes), d0, d1, a, b, *fixed,
        max(0.0, var_w), max(0.0, var_v), cov, (n, sk, skk),
    )  # fmt: skip


def fit_costs(rounds: Iterable[RoundLike], *, clock: str, level: float = 0.95) -> CostModel:
    """Fit the cost model from ``rounds`` (unknown counts skipped) timed by ``clock``."""
    m = Moments()
    for r in rounds:
        if known(r.k, r.j):
            m.add(r.k, r.phase_ns())
    return fit_from(m, clock, level)
