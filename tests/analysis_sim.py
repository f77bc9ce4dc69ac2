"""Rounds drawn from a known truth, for the memra_obs.analysis tests: a per-position acceptance
curve and a cost model (draft, verify over k+1 rows, fixed accept/rollback/maint)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

CURVES: dict[str, list[float]] = {
    "flat": [0.75] * 24,
    "decaying": [0.92 * 0.9**i for i in range(24)],
    "cliff": [0.9 if i < 3 else 0.2 for i in range(24)],
}

#: ns: draft = d0 + d1·k, verify = a + b·(k+1), then fixed accept / rollback / maint.
COSTS: dict[str, dict[str, float]] = {
    "launch-bound": dict(d0=100e3, d1=350e3, a=3.0e6, b=60e3, acc=200e3, rb=80e3, mt=50e3),
    "cheap-draft": dict(d0=50e3, d1=120e3, a=2.0e6, b=20e3, acc=100e3, rb=50e3, mt=50e3),
    "compute-bound": dict(d0=100e3, d1=200e3, a=1.0e6, b=250e3, acc=100e3, rb=50e3, mt=50e3),
}


class Round(NamedTuple):
    """Duck-typed like RoundRecord: k, j, phase_ns()."""

    k: int
    j: int
    ph: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)

    def phase_ns(self) -> tuple[int, int, int, int, int]:
        return self.ph


def draw_j(alpha: list[float], k: int, rng: random.Random) -> int:
    j = 0
    while j < k and rng.random() < alpha[j]:
        j += 1
    return j


def rounds(
    alpha: list[float],
    n: int,
    rng: random.Random,
    k_of: Callable[[random.Random], int],
    cost: dict[str, float] | None = None,
    noise: float = 0.05,
) -> list[Round]:
    out = []
    for _ in range(n):
        k = k_of(rng)
        j = draw_j(alpha, k, rng)
        if cost is None:
            out.append(Round(k, j))
            continue
        c = cost

        def f(x: float) -> int:
            return max(1, int(x * (1 + noise * rng.gauss(0, 1))))

        ph = (
            f(c["d0"] + c["d1"] * k),
            f(c["a"] + c["b"] * (k + 1)),
            f(c["acc"]),
            f(c["rb"]),
            f(c["mt"]),
        )
        out.append(Round(k, j, ph))
    return out


def survival(alpha: list[float]) -> list[float]:
    out, s = [], 1.0
    for a in alpha:
        s *= a
        out.append(s)
    return out


def true_tokens_per_s(alpha: list[float], cost: dict[str, float], k: int) -> float:
    e = 1 + sum(survival(alpha)[:k])
    c = cost
    t = c["d0"] + c["d1"] * k + c["a"] + c["b"] * (k + 1) + c["acc"] + c["rb"] + c["mt"]
    return e / t * 1e9
