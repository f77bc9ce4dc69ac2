"""Acceptance analytics and the k advisor: plain functions over round records.

Records in, plain values out; nothing here imports the rest of memra_obs. A round is anything
with ``k``, ``j`` (-1 = unknown: skipped) and ``phase_ns()`` -> (draft, verify, accept,
rollback, maint) ns, such as ``RoundRecord``. docs/ADVISOR.md has the formulas.
"""

from .acceptance import (
    AcceptanceEstimate,
    Counted,
    Interval,
    Position,
    PositionCounts,
    estimate_acceptance,
    position_counts,
)
from .advisor import EXPLORE, MIN_ROUNDS, Advice, AdviceWindow, KPoint, advise
from .costs import CostModel, RoundLike, fit_costs
from .record import spec_decode_record

__all__ = [
    "EXPLORE",
    "MIN_ROUNDS",
    "AcceptanceEstimate",
    "Advice",
    "AdviceWindow",
    "CostModel",
    "Counted",
    "Interval",
    "KPoint",
    "Position",
    "PositionCounts",
    "RoundLike",
    "advise",
    "estimate_acceptance",
    "fit_costs",
    "position_counts",
    "spec_decode_record",
]
