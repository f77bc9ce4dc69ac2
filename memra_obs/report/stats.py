"""The numbers the page prints and the figures draw, computed by the package's own code where
the seed defines them (slow rounds: ``SpecRoundsLog.slow_rounds`` over each session's logged
rows; medians ``sorted[n // 2]``; estimates: ``analysis``)."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from functools import cached_property
from itertools import chain
from typing import NamedTuple

import numpy as np

from ..analysis import AcceptanceEstimate, Advice, advise, estimate_acceptance
from ..diagnostics import printable
from ..records import SpecRoundsLog
from ..tail.rebuild import UNKNOWN_FAMILY
from ..timeline import PHASES, RoundRecord
from .inputs import LOGGED, Rounds, Run

AB_METRICS = ("wall", *PHASES)  # the A/B table's rows, per round
#: Flagged: the CI excludes 0 and |B - A| is at least this share of A's median (rounds of one
#: session are not independent draws: a CI alone flags shifts nobody would act on).
REL_THRESHOLD = 0.02
#: Fewest sessions a run for a flag: below 6, no interval of a median reaches 95% (0.5**5 * 2 >
#: 0.05), and a bootstrap of one session is a point that "excludes 0" whatever the noise.
MIN_N = 6
#: Bootstrap resamples (enough for a row's 0.4% tails); values a run they are drawn from (past
#: it, a fixed-seed subsample: a wider interval, never a narrower one); seed.
N_BOOT, CAP, SEED = 4000, 20_000, 0
#: The table's CIs hold together at 95%: each row's at 1 - 0.05 / rows (Bonferroni). Each at
#: 95%, a pair of runs of 12 sessions alike flagged some row in 18% of pairs; so, 5%.
FAMILY_LEVEL = 0.95
AB_METHOD = (
    "Medians are the seed's (sorted[n/2]). The CI resamples A's sessions and B's independently, "
    f"each with its rounds ({N_BOOT} resamples, fixed seed, at most {CAP:,} values a run); the "
    f"rows' CIs hold together at {FAMILY_LEVEL:.0%} (each at 1 - {1 - FAMILY_LEVEL:.2f} / rows). "
    f"Flagged: {MIN_N} sessions a run or more, the CI excludes 0 and |B - A| is at least "
    f"{REL_THRESHOLD:.0%} of median A. The CI covers sessions, not runs: a machine that drifts "
    "between two runs is a difference too (compare runs interleaved, A B A B)"
)
#: The advisor's clock where the inputs name none (or several): "host" claims no device (the
#: page says the clock is unknown). ``[spec-advice]`` lines and session spans name it.
CLOCK = "host"


def median(x: np.ndarray) -> float:
    """The seed's median: ``sorted[n // 2]`` (the upper one for even n); NaN when empty."""
    return float(np.partition(x, len(x) // 2)[len(x) // 2]) if len(x) else float("nan")


class View:
    """One run as the page shows it: label (``A: base.log``), records, rounds as columns (a run
    of equal rounds one column, ``n`` its rounds); ``own``: rounds with their own measurement
    (k >= 0), the others carry their burst's per-round means."""

    def __init__(self, label: str, run: Run) -> None:
        self.label, self.run = printable(label), run  # ESC in a name broke the SVG figures
        rs = run.rounds.runs
        t = np.fromiter(chain.from_iterable(r.t_ns_mono for r in rs), np.int64).reshape(-1, 6)
        self.phase_ms, self.wall_ms = np.diff(t, axis=1) / 1e6, (t[:, 5] - t[:, 0]) / 1e6
        self.index, self.k, self.j, self.n, self.session = (
            np.fromiter((getattr(r, a) for r in rs), np.int64, len(rs))
            for a in ("index", "k", "j", "repeat", "session"))  # fmt: skip
        self.own = self.k >= 0
        self.without = int(self.n[~self.own].sum())  # rounds with unknown k, j (burst means)
        ph = [b.phases for b in run.bursts]
        #: Each burst's phase totals, ms (the phase line's numbers), and its rounds.
        self.burst_ms = np.array([p.phases() for p in ph], dtype=float).reshape(-1, 5) / 1e6
        self.burst_n = np.array([p.rounds for p in ph], dtype=float)
        self.ttft_ms = np.array([f.prof.total_ms() for f in run.first_tokens])
        clocks = sorted(run.clocks & {"event", "sync", "host"})
        #: The clock that timed the phases, if the input names one ("": unknown, fitted as CLOCK),
        #: and what the page says of it ("": none named).
        self.clock = clocks[0] if len(clocks) == 1 else ""
        self.clock_said = self.clock or f"several ({', '.join(clocks)}): fitted as {CLOCK}" * (
            len(clocks) > 1
        )

    @cached_property  # a run of several families is advised per family only (by_family)
    def advice(self) -> Advice | None:
        return advise(self.known(), clock=self.clock or CLOCK)

    @cached_property
    def acceptance(self) -> AcceptanceEstimate:
        return self.advice.acceptance if self.advice else estimate_acceptance(self.known())

    def known(self) -> list[RoundRecord]:
        """The rounds with known k and j (runs of burst means have none: not expanded)."""
        return [r for r in self.run.rounds.runs if r.k >= 0]

    def wall_quantile(self, q: float) -> float:
        """The q-quantile of every round's wall (a run of n equal rounds weighs n)."""
        order = np.argsort(self.wall_ms)
        at = np.searchsorted(np.cumsum(self.n[order]), q * self.n.sum())
        return float(self.wall_ms[order][min(int(at), len(order) - 1)])

    def metric(self, name: str, first: int | None = None) -> np.ndarray:
        """Per-round ms of ``name`` (``wall``, a phase, ``rollback+maint``) over the rounds with
        their own (``first``: of those, the first ``first`` rounds of each session)."""
        ms = self.phase_ms[:, 3] + self.phase_ms[:, 4] if name == "rollback+maint" else (
            self.wall_ms if name == "wall" else self.phase_ms[:, PHASES.index(name)])  # fmt: skip
        return ms[self.measured(first)]

    def unlike(self, b: View) -> str:
        """What this run and B hold, where it differs ("" where nothing does): instrumentation
        takes time in the loop (in the demo, the round profile ~5% of accept, level 2 ~7%)."""
        x, y = ({"families": ", ".join(sorted({s.family for s in v.run.sessions})) or "none",
                 "level-2 verify split": "yes" if any(r.split_ns for r in v.run.bursts) else "no",
                 "round profile": "yes" if v.own.any() else "no", "k drafted": _ks(v),
                 "first-token profile": "yes" if v.run.first_tokens else "no"} for v in (self, b))  # fmt: skip
        return "; ".join(f"{k}: A {x[k]}, B {y[k]}" for k in x if x[k] != y[k])

    def measured(self, first: int | None = None) -> np.ndarray:
        """Which records :meth:`metric` takes."""
        return self.own if first is None else self.own & (self.index < first)


def _ks(v: View) -> str:
    """The k its bursts drafted (a B drafting 6 a round read "draft B slower" against k = 4)."""
    ks = sorted({b.k for b in v.run.bursts})
    return "none" if not ks else str(ks[0]) if ks[0] == ks[-1] else f"{ks[0]}-{ks[-1]}"


def by_family(views: list[View]) -> list[tuple[str, list[View]]]:
    """``[(family, the runs' views of its rounds)]``, or ``[("", views)]`` when every run has one
    family: acceptance and the advice are a family's, as the live advisor's window is (one over
    two families told a family whose drafts were all refused to draft 6)."""
    fams = [{s.session: s.family for s in v.run.sessions} for v in views]
    runs = [v.run.rounds.runs for v in views]
    names = sorted({f.get(r.session, "?") for rs, f in zip(runs, fams, strict=True) for r in rs})
    if len(set(names) - {UNKNOWN_FAMILY, "?"}) < 2:  # a log of rows only is "unknown": A/B kept
        return [("", views)]
    out = []
    for name in names:
        pairs = zip(views, runs, fams, strict=True)
        vs = [View(f"{v.label} · {name}", replace(v.run, rounds=Rounds(rs))) for v, run, f in pairs
              if (rs := [r for r in run if f.get(r.session, "?") == name])]  # fmt: skip
        out.append((name, vs))
    return out


def slow_rounds(run: Run) -> list[int]:
    """Per round log: the seed's slow-round count over its rows (``SpecRoundsLog``)."""
    return [SpecRoundsLog(rounds=log.rows).slow_rounds() for log in run.logs]


def bootstrap(a: np.ndarray, b: np.ndarray, ga: np.ndarray | None = None,
              gb: np.ndarray | None = None, level: float = 0.95) -> tuple[float, float, float]:  # fmt: skip
    """``median(b) - median(a)`` and its ``level`` percentile-bootstrap interval: A and B resampled
    independently, N_BOOT times, from at most CAP values each, by session (``ga``, ``gb``: each
    value's session; None: each value its own). Rounds of one session share its prompt and its
    acceptance: resampled one by one, twelve sessions against twelve others of one configuration
    "differed" by 3% in half the pairs."""
    rng, diff, out = np.random.default_rng(SEED), median(b) - median(a), np.zeros(N_BOOT)
    for x, g, sign in ((a, ga, -1), (b, gb, 1)):
        g = np.arange(len(x)) if g is None else np.unique(g, return_inverse=True)[1].ravel()
        if len(x) > CAP:
            keep = rng.choice(len(x), CAP, replace=False)
            x, g = x[keep], np.unique(g[keep], return_inverse=True)[1].ravel()
        order = np.argsort(x, kind="stable")
        x, g, s = x[order], g[order], int(np.max(g)) + 1
        step = max(1, 2_000_000 // len(x))  # ~16 MB of weights
        for i in range(0, N_BOOT, step):  # each session drawn w times: its rounds weigh w
            at = rng.integers(0, s, (m := min(step, N_BOOT - i), s)) + s * np.arange(m)[:, None]
            w = np.bincount(at.ravel(), minlength=m * s).astype(np.int32).reshape(m, s)[:, g]
            w = w.cumsum(axis=1, dtype=np.int32)
            out[i : i + m] += sign * x[(w <= w[:, -1:] // 2).sum(axis=1)]  # sorted[n // 2]
    lo, hi = np.quantile(out, [(1 - level) / 2, (1 + level) / 2])
    return diff, float(lo), float(hi)


class ABRow(NamedTuple):
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
    #: Sessions of A and B the values came from (the bootstrap's unit); None: each value its own.
    sessions: tuple[int, int] | None = None

    @property
    def rel(self) -> float:
        if self.med_a:
            return self.diff / self.med_a
        return math.copysign(math.inf, self.diff) if self.diff else 0.0  # from 0: any change

    @property
    def enough(self) -> bool:
        """At least MIN_N sessions (values, when they are each their own) in each run."""
        return min(self.sessions or (self.n_a, self.n_b)) >= MIN_N

    @property
    def flagged(self) -> bool:
        return self.enough and (self.lo > 0 or self.hi < 0) and abs(self.rel) >= REL_THRESHOLD

    @property
    def verdict(self) -> str:
        if not self.flagged:
            return "no change shown" if self.enough else f"too few sessions ({MIN_N} a run needed)"
        by = f"by {abs(self.rel):.1%}" if self.med_a else "(median A is 0)"
        return f"B {'slower' if self.diff > 0 else 'faster'} {by}"


def ab_table(a: View, b: View) -> list[ABRow]:
    """Per metric: the medians, B - A and its bootstrap CI. Population: the rounds with their
    own measurement when both runs have some, else one per-round mean a burst (trace only).
    A log against a span file: a log's rounds of their own are each session's first LOGGED
    (context grows after them), its rollback and maint a split of one ``rest_ms``: both runs are
    compared on those rounds, on rollback + maint."""
    own = bool(a.own.any() and b.own.any())
    pop, rows = "rounds with their own times" if own else "bursts' per-round means", []
    # (a trace-only log's sessions are the tail's, by adjacency: resampled each burst its own,
    # two runs of one configuration read "B faster by 13%" in 2 pairs of 6)
    pop += "" if own else " (a trace-only log: by the sessions its bursts were read into)"
    first = LOGGED if own and a.run.kind != b.run.kind else None
    metrics = AB_METRICS if first is None else (*AB_METRICS[:4], "rollback+maint")
    pop += "" if first is None else f", the first {LOGGED} of each session"
    per = [v.burst_ms[v.burst_n > 0] / v.burst_n[v.burst_n > 0, None] for v in (a, b)]
    ga, gb = (
        v.session[v.measured(first)] if own
        else np.array([r.session for r in v.run.bursts], dtype=np.int64)[v.burst_n > 0]
        for v in (a, b)
    )  # fmt: skip
    n_s, level = (len(np.unique(ga)), len(np.unique(gb))), 1 - (1 - FAMILY_LEVEL) / len(metrics)
    for i, m in enumerate(metrics):
        means = (t.sum(axis=1) if i == 0 else t[:, i - 1] for t in per)  # a trace-only log
        xa, xb = (a.metric(m, first), b.metric(m, first)) if own else means
        if len(xa) and len(xb):
            ci = bootstrap(xa, xb, ga, gb, level)
            rows.append(ABRow(m, median(xa), median(xb), *ci, len(xa), len(xb), pop, n_s))
    return rows


def started(v: View) -> str:
    """First and last session start of a span file, UTC (a log's lines carry no time)."""
    t = [s.start_ns_mono // 10**9 for s in v.run.sessions if 0 < s.start_ns_mono < 1 << 63]
    if not t or v.run.kind != "spans":
        return "-"
    return " to ".join(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x)) for x in (min(t), max(t)))
