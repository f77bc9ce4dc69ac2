"""The metric set of DESIGN §5: names, types, labels, buckets — public interface.

:class:`SpecFamilies` builds every family once per exporter; :class:`LoopChildren` binds
one ``(worker,) family`` label set's children once, so recording a round touches only
attributes, never a label lookup; :class:`FirstTokenChildren` does the same per worker.
"""

from __future__ import annotations

from ..records import FIRST_TOKEN_MS_FIELDS
from ..timeline import PHASES
from .buckets import (
    FIRST_TOKEN_PHASE_BUCKETS,
    PHASE_BUCKETS,
    ROUND_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
)
from .model import Family, Hist, Value

__all__ = [
    "FIRST_TOKEN_PHASES",
    "SPLIT_PARTS",
    "FirstTokenChildren",
    "LoopChildren",
    "SpecFamilies",
]

#: ``part`` label values of the level-2 verify split, in the seed's line order.
SPLIT_PARTS = ("kda", "kda_scan", "mla", "rest", "ffn")
#: ``phase`` label values of the first-token profile: each ``SpecFirstTokenProf`` ms field
#: without ``_ms``.
FIRST_TOKEN_PHASES = tuple(f[: -len("_ms")] for f in FIRST_TOKEN_MS_FIELDS)

NS = 1e9  # time histograms store integer nanoseconds


class SpecFamilies:
    """Every family the exporter publishes; ``worker_label`` adds ``worker`` to each."""

    def __init__(self, worker_label: bool) -> None:
        w: tuple[str, ...] = ("worker",) if worker_label else ()
        fam = (*w, "family")
        self.round = Family(
            "memra_spec_round_seconds",
            "Wall time of one speculative-decoding round (draft+verify+accept+rollback+maint).",
            "histogram", fam, unit="seconds", buckets=ROUND_BUCKETS, div=NS,
        )  # fmt: skip
        self.phase = Family(
            "memra_spec_phase_seconds",
            "Time of one phase of a round, drained at both ends (device time included).",
            "histogram", (*fam, "phase"), unit="seconds", buckets=PHASE_BUCKETS, div=NS,
        )  # fmt: skip
        self.split = Family(
            "memra_spec_verify_split_seconds",
            "Level-2 split of one round's verify: kda (kda_scan inside it), mla, "
            "rest = verify - (kda + mla) saturating, ffn inside rest.",
            "histogram", (*fam, "part"), unit="seconds", buckets=PHASE_BUCKETS, div=NS,
        )  # fmt: skip
        self.drafted = Family(
            # Not "memra_spec_drafted_tokens": in OpenMetrics the counter below owns that
            # family name (a counter's family drops _total), and two TYPE lines for one name
            # make strict parsers (prometheus_client's among them) reject the exposition.
            "memra_spec_drafted_tokens_per_round",
            "Draft tokens that entered one round's verify (k).",
            "histogram", fam, buckets=TOKEN_BUCKETS,
        )  # fmt: skip
        self.accepted = Family(
            "memra_spec_accepted_tokens_per_round",
            "Draft tokens one round accepted (j; the round commits j+1).",
            "histogram", fam, buckets=TOKEN_BUCKETS,
        )  # fmt: skip
        self.rounds = Family("memra_spec_rounds", "Verify rounds run.", "counter", fam)
        self.drafted_total = Family(
            "memra_spec_drafted_tokens", "Draft tokens verified (sum of k).", "counter", fam
        )
        self.accepted_total = Family(
            "memra_spec_accepted_tokens", "Draft tokens accepted (sum of j).", "counter", fam
        )
        self.seq_rows = Family(
            "memra_spec_verify_seq_rows",
            "Verify rows that took the per-row (sequential) mixer arm.",
            "counter", fam,
        )  # fmt: skip
        self.slow = Family(
            "memra_spec_slow_rounds",
            "Rounds whose wall exceeded 1.5x the median wall of the session's last 64 rounds "
            "(itself included).",
            "counter", fam,
        )  # fmt: skip
        self.ft_phase = Family(
            "memra_spec_first_token_phase_seconds",
            "One bucket of a session's first-token profile (SpecFirstTokenProf *_ms field); "
            "buckets the route did not run (0 ms) are not observed.",
            "histogram", (*w, "phase"), unit="seconds", buckets=FIRST_TOKEN_PHASE_BUCKETS, div=NS,
        )  # fmt: skip
        self.ft_total = Family(
            "memra_spec_first_token_seconds",
            "Time to first token of a session: creation plus the first burst "
            "(SpecFirstTokenProf.total_ms).",
            "histogram", w, unit="seconds", buckets=TTFT_BUCKETS, div=NS,
        )  # fmt: skip
        self.gpu_free = Family(
            "memra_gpu_free_bytes",
            "Free device memory per CUDA ordinal, before the trunk cache allocation and after "
            "the drafter KV allocation of the latest profiled session.",
            "gauge", (*w, "device", "point"), unit="bytes",
        )  # fmt: skip
        # The counters' names above carry no _total: prometheus_client appends it.
        self.all = (
            self.round, self.phase, self.split, self.drafted, self.accepted,
            self.rounds, self.drafted_total, self.accepted_total, self.seq_rows, self.slow,
            self.ft_phase, self.ft_total, self.gpu_free,
        )  # fmt: skip


class LoopChildren:
    """The children of one ``(worker,) family`` label set, bound once."""

    __slots__ = (
        "_fams",
        "_lv",
        "accepted",
        "accepted_total",
        "drafted",
        "drafted_total",
        "phases",
        "round",
        "rounds",
        "seq_rows",
        "slow",
        "split",
    )

    def __init__(self, f: SpecFamilies, lv: tuple[str, ...]) -> None:
        self._fams = f
        self._lv = lv
        self.round = f.round.hist(lv)
        self.phases = tuple(f.phase.hist((*lv, p)) for p in PHASES)
        self.split: tuple[Hist, ...] = ()  # bound on the first level-2 round
        self.drafted = f.drafted.hist(lv)
        self.accepted = f.accepted.hist(lv)
        self.rounds = f.rounds.value(lv)
        self.drafted_total = f.drafted_total.value(lv)
        self.accepted_total = f.accepted_total.value(lv)
        self.seq_rows = f.seq_rows.value(lv)
        self.slow = f.slow.value(lv)

    def bind_split(self) -> tuple[Hist, ...]:
        self.split = tuple(self._fams.split.hist((*self._lv, p)) for p in SPLIT_PARTS)
        return self.split


class FirstTokenChildren:
    """The first-token children of one worker (or of the process), bound once."""

    __slots__ = ("_fams", "_w", "phases", "total")

    def __init__(self, f: SpecFamilies, w: tuple[str, ...]) -> None:
        self._fams = f
        self._w = w
        # Bound on first use: a bucket the route never runs gets no all-zero series.
        self.phases: list[Hist | None] = [None] * len(FIRST_TOKEN_PHASES)
        self.total = f.ft_total.hist(w)

    def phase(self, i: int) -> Hist:
        h = self.phases[i]
        if h is None:
            h = self.phases[i] = self._fams.ft_phase.hist((*self._w, FIRST_TOKEN_PHASES[i]))
        return h

    def gpu(self, device: int, point: str) -> Value:
        return self._fams.gpu_free.value((*self._w, str(device), point))
