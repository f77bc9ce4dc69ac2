"""memra_obs.analysis acceptance: the at-risk estimator, its intervals against a known truth,
and the by-position counter increments."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from analysis_sim import CURVES, Round, rounds, survival
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_obs.analysis import estimate_acceptance, position_counts

SEEDS = 300
N_ROUNDS = 600
K_MAX = 8
#: Coverage must sit within 3.5 binomial standard deviations of the nominal 95% over SEEDS.
TOL = 3.5 * math.sqrt(0.95 * 0.05 / SEEDS)


def test_counts_by_hand():
    """At-risk and accepted counts, α, S and E(k) on four rounds worked out by hand."""
    est = estimate_acceptance([Round(3, 2), Round(3, 3), Round(1, 0), Round(2, 1)])
    assert [(p.at_risk, p.accepted) for p in est.positions] == [(4, 3), (3, 2), (2, 1)]
    assert [p.alpha.value for p in est.positions] == [0.75, 2 / 3, 0.5]
    assert [p.survival.value for p in est.positions] == pytest.approx([0.75, 0.5, 0.25])
    assert est.expected_tokens(3).value == pytest.approx(2.5)
    assert est.pooled.value == pytest.approx(6 / 9)
    assert est.rounds == 4 and est.skipped == 0


def test_constant_k_reduces_to_vllms_per_position_rate():
    """With one k for every round, S(i+1) is vLLM's accepted_per_pos[i] / num_drafts and E(k)
    is 1 + mean j (vLLM's mean acceptance length), exactly."""
    rng = random.Random(3)
    rs = rounds(CURVES["decaying"], 500, rng, lambda r: 5)
    est = estimate_acceptance(rs)
    per_pos = [sum(r.j > i for r in rs) / len(rs) for i in range(5)]
    assert [p.survival.value for p in est.positions] == pytest.approx(per_pos)
    assert est.expected_tokens(5).value == pytest.approx(1 + sum(r.j for r in rs) / len(rs))


def test_at_risk_denominator_is_unbiased_when_k_varies():
    """k varying per round: the per-draft rate (accepted / drafted at a position) reads short
    drafts as losses; the at-risk estimate recovers the true flat α at every position."""
    alpha = CURVES["flat"]
    rs = rounds(alpha, 20000, random.Random(5), lambda r: r.randint(1, K_MAX))
    est = estimate_acceptance(rs)
    for p in est.positions[:6]:  # within 4 standard errors
        assert abs(p.alpha.value - 0.75) <= 4 * math.sqrt(0.75 * 0.25 / p.at_risk), p
    naive = sum(r.j > 5 for r in rs) / len(rs)  # vLLM's rate at position 5, k varying
    assert naive < 0.5 * survival(alpha)[5] < est.positions[5].survival.lo


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_intervals_cover_the_truth_at_the_nominal_rate(curve: str):
    """Over SEEDS runs of N_ROUNDS rounds (k uniform in 1..8), the 95% intervals of α_i, S(i+1)
    and E(k) contain the truth 95% of the time, within a binomial tolerance, at every position
    with at least 20 rounds at risk on average; so does the pooled α on the flat curve."""
    alpha = CURVES[curve]
    true_s = survival(alpha)
    rng = random.Random(11)
    hit_a, hit_s, hit_e, risk = [0] * K_MAX, [0] * K_MAX, [0] * (K_MAX + 1), [0] * K_MAX
    hit_pool = 0
    for _ in range(SEEDS):
        est = estimate_acceptance(rounds(alpha, N_ROUNDS, rng, lambda r: r.randint(1, K_MAX)))
        for p in est.positions:
            i = p.position
            risk[i] += p.at_risk
            hit_a[i] += p.alpha.lo <= alpha[i] <= p.alpha.hi
            hit_s[i] += p.survival.lo <= true_s[i] <= p.survival.hi
        for k in range(1, K_MAX + 1):
            e = est.expected_tokens(k)
            hit_e[k] += e.lo <= 1 + sum(true_s[:k]) <= e.hi
        hit_pool += est.pooled.lo <= alpha[0] <= est.pooled.hi
    checked = [i for i in range(K_MAX) if risk[i] / SEEDS >= 20]
    assert len(checked) >= 5
    report = []
    for i in checked:
        cov = (hit_a[i] / SEEDS, hit_s[i] / SEEDS, hit_e[i + 1] / SEEDS)
        report.append(
            f"pos {i} (at risk {risk[i] / SEEDS:.0f}): α {cov[0]:.3f} S {cov[1]:.3f} E {cov[2]:.3f}"
        )
        for c in cov:
            assert abs(c - 0.95) <= TOL, report[-1]
    print(f"\n{curve}: " + "; ".join(report))
    if curve == "flat":
        assert abs(hit_pool / SEEDS - 0.95) <= TOL


def test_no_rounds_and_all_unknown():
    """Nothing to estimate: no positions, E(0) = 1, unknown rounds counted as skipped."""
    est = estimate_acceptance([])
    assert est.positions == () and est.rounds == 0 and math.isnan(est.pooled.value)
    assert est.expected_tokens(0).value == 1.0
    est = estimate_acceptance([Round(-1, -1)] * 7)
    assert est.rounds == 0 and est.skipped == 7 and est.positions == ()


def test_fully_censored_rounds():
    """j == k always: α = S = 1 at every drafted position, E(k) = 1 + k, and the intervals
    stay open below (Wilson never collapses to a point at n successes)."""
    est = estimate_acceptance([Round(k, k) for k in (1, 2, 3, 4) * 25])
    assert [p.alpha.value for p in est.positions] == [1.0] * 4
    assert all(p.alpha.hi == 1.0 and p.alpha.lo < 1.0 for p in est.positions)
    e = est.expected_tokens(4)
    assert e.value == 5.0 and e.hi == 5.0 and e.lo < 5.0
    assert est.pooled.value == 1.0


def test_inconsistent_counts_are_refused():
    """j > k (or j < 0 with k known) is contradictory data: ValueError, never a clamp."""
    for contradictory in (Round(2, 3), Round(0, 1)):
        with pytest.raises(ValueError, match="refused"):
            estimate_acceptance([contradictory])
    with pytest.raises(ValueError, match="refused"):
        position_counts([Round(2, -1)])


def test_zero_draft_rounds_and_max_position():
    """k = 0 rounds count as used but put nothing at risk; max_position caps the positions."""
    est = estimate_acceptance([Round(0, 0)] * 3 + [Round(4, 2)] * 3, max_position=1)
    assert est.rounds == 6 and [p.at_risk for p in est.positions] == [3, 3]


def test_max_position_caps_the_listing_not_the_rates():
    """The pooled and tail rates are over every position: with max_position=1 the pooled rate
    read 0.885 where the data's is 0.801 (the deeper, lower positions were cut first)."""
    rs = [Round(8, j) for j in (8, 8, 8, 1, 2, 3, 5, 0, 8, 6) * 20]
    full, cut = estimate_acceptance(rs), estimate_acceptance(rs, max_position=1)
    assert len(cut.positions) == 2 and cut.positions == full.positions[:2]
    assert cut.pooled == full.pooled and cut.tail == full.tail
    assert all(cut.expected_tokens(k) == full.expected_tokens(k) for k in range(1, 12))


def test_zero_acceptance_position():
    """A position where nothing was accepted: S is 0 from there, with an upper bound above 0."""
    est = estimate_acceptance([Round(3, 1)] * 40)
    p = est.positions[1]
    assert p.alpha.value == 0.0 and p.survival.value == 0.0 and 0.0 < p.survival.hi < 0.2
    assert est.expected_tokens(3).value == 2.0


@settings(max_examples=150)
@given(
    st.lists(
        st.just((-1, -1))
        | st.integers(0, 12).flatmap(lambda k: st.tuples(st.just(k), st.integers(0, k)))
    )
)
def test_position_counts_sum_to_the_totals(pairs: list[tuple[int, int]]):
    """By-position increments equal the per-round rule (drafted at 0..k-1, accepted at 0..j-1)
    and sum exactly to Σk and Σj of the rounds with known counts."""
    rs = [Round(k, j) for k, j in pairs]
    pc = position_counts(rs)
    known = [r for r in rs if r.k >= 0]
    width = max((r.k for r in known), default=0)
    assert pc.drafted == tuple(sum(r.k > i for r in known) for i in range(width))
    assert pc.accepted == tuple(sum(r.j > i for r in known) for i in range(width))
    assert sum(pc.drafted) == sum(r.k for r in known)
    assert sum(pc.accepted) == sum(r.j for r in known)


def test_extrapolated_expected_tokens_cover_under_a_true_flat_tail():
    """One k for every round (k = 2) from a flat curve, where the flat tail is the truth: E(k)
    for k = 3..5 leans on a tail pooled from the deepest position, so the two errors are one;
    its interval still covers at the nominal rate (added as if independent: about 0.87)."""
    alpha, seeds = CURVES["flat"], 600
    true_e = [1 + sum(survival(alpha)[:k]) for k in range(6)]
    rng, hit = random.Random(13), [0] * 6
    for _ in range(seeds):
        est = estimate_acceptance(rounds(alpha, 400, rng, lambda r: 2))
        assert len(est.positions) == 2 and est.tail == est.positions[1].alpha
        for k in range(3, 6):
            e = est.expected_tokens(k)
            hit[k] += e.lo <= true_e[k] <= e.hi
    cov = [h / seeds for h in hit[3:]]
    print(f"\nE(3..5) coverage: {cov}")
    assert all(abs(c - 0.95) <= 3.5 * math.sqrt(0.95 * 0.05 / seeds) for c in cov), cov


def test_the_flat_tail_pools_the_deepest_positions_until_30_rounds_at_risk():
    """The tail is the deepest position's rate when it alone has 30 rounds at risk; with 29 it
    pools the next one up too (README: "pooled until 30 rounds at risk")."""
    est = estimate_acceptance([Round(2, 2)] * 20 + [Round(2, 1)] * 10 + [Round(2, 0)] * 70)
    assert est.positions[1].at_risk == 30 and est.tail == est.positions[1].alpha
    est = estimate_acceptance([Round(2, 2)] * 19 + [Round(2, 1)] * 10 + [Round(2, 0)] * 71)
    assert est.positions[1].at_risk == 29 and est.tail.value == (29 + 19) / (100 + 29)


def test_survival_bounds_never_rise_with_position():
    """S(i+1) = P(drafts 0..i accepted) cannot grow with i: nor can its interval's ends, also
    where a position accepted nothing out of one round at risk (its Wilson upper end is wide)."""
    kj = [(1, 0), (1, 1), (2, 0), (3, 1), (4, 0), (4, 0), (4, 0), (4, 1), (5, 3), (5, 4)]
    s = [p.survival for p in estimate_acceptance([Round(k, j) for k, j in kj]).positions]
    assert len(s) == 5 and s[-1].value == 0.0
    for a, b in itertools.pairwise(s):
        assert b.value <= a.value and b.lo <= a.lo and b.hi <= a.hi


def test_a_fully_accepting_loop_expects_at_most_k_plus_one_tokens():
    """j == k always: E(k) is 1 + k and its interval never reaches past it (a round drafting k
    commits k + 1 tokens at most), past the data too."""
    est = estimate_acceptance([Round(k, k) for k in range(1, 7)] * 5)
    for k in range(1, 10):
        e = est.expected_tokens(k)
        assert e.value == 1 + k and e.lo < e.value and e.hi <= 1 + k
