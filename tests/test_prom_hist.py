"""The C bucket counter (memra_obs/prom/_hist.c) against Hist.observe_many's Python path.

Same state afterwards — per-bucket counts, sum, count, each bucket's exemplar (labels, value,
timestamp) — for any batch, including negative values, observations without an exemplar,
and the inputs the C loop hands back to Python (floats, bools, values past 64 bits, sums
past 63 bits).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_obs.prom import model
from memra_obs.prom.buckets import PHASE_BUCKETS, ROUND_BUCKETS, TOKEN_BUCKETS
from memra_obs.prom.model import Family, Hist

C_COUNT = model.C_COUNT
needs_c = pytest.mark.skipif(C_COUNT is None, reason="the C bucket counter is not built")

BOUNDS = [
    Family("a", "", "histogram", (), buckets=PHASE_BUCKETS, div=1e9).bounds,
    Family("b", "", "histogram", (), buckets=ROUND_BUCKETS, div=1e9).bounds,
    Family("c", "", "histogram", (), buckets=TOKEN_BUCKETS).bounds,
]


def _state(bounds, batches, ex_mask, c: bool, monkeypatch) -> tuple:
    monkeypatch.setattr(model, "C_COUNT", C_COUNT if c else None)
    h = Hist(bounds)
    h.counts[3] = 7  # a child that already holds observations
    h.total = 123
    h.n = 7
    h.ex[3] = ({"trace_id": "old"}, 5, 1.0)
    for k, vals in enumerate(batches):

        def ex_at(p: int, k: int = k) -> tuple[dict[str, str], float] | None:
            if ex_mask is None or not ex_mask[(k + p) % len(ex_mask)]:
                return None if ex_mask is not None else ({"trace_id": f"{k}:{p}"}, float(p))
            return ({"trace_id": f"{k}:{p}"}, float(p))

        h.observe_many(vals, None if ex_mask == [] else ex_at)
    return h.counts, h.total, type(h.total), h.n, h.ex


ns = st.one_of(
    st.integers(0, 3_000_000_000),
    st.integers(-5_000_000, 5_000_000),
    st.sampled_from([0, 50_000, 100_000, 250_000, 2_500_000_000, 2_500_000_001]),
)
batch = st.lists(ns, min_size=0, max_size=300)


@needs_c
@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(BOUNDS),
    st.lists(batch, min_size=1, max_size=4),
    st.one_of(st.none(), st.just([]), st.lists(st.booleans(), min_size=1, max_size=7)),
)
def test_c_counter_leaves_the_python_path_s_state(bounds, batches, ex_mask):
    with pytest.MonkeyPatch.context() as m:
        want = _state(bounds, batches, ex_mask, False, m)
        got = _state(bounds, batches, ex_mask, True, m)
    assert got == want


@needs_c
@pytest.mark.parametrize(
    "vals",
    [
        [1.5] * 10,  # floats: observe()'s order of additions
        [True] * 10,
        [2**63] + [1] * 9,  # past 64 bits
        [2**62] * 10,  # a sum past 63 bits
        [-(2**64)] + [1] * 9,
    ],
)
def test_inputs_the_counter_hands_back(vals):
    bounds = BOUNDS[0]
    assert C_COUNT(bounds, vals, [0] * (len(bounds) + 1)) is None
    with pytest.MonkeyPatch.context() as m:
        want = _state(bounds, [vals], None, False, m)
        got = _state(bounds, [vals], None, True, m)
    assert got == want


@needs_c
def test_counter_refuses_bounds_it_cannot_compare_exactly():
    counts = [0, 0, 0]
    assert C_COUNT((0.5, 1.0), [1] * 8, counts) is None  # float bounds
    assert C_COUNT((2, 1), [1] * 8, counts) is None  # not ascending
    assert C_COUNT((1, 2), [1] * 8, [0, 0]) is None  # counts of the wrong length
    assert C_COUNT(tuple(range(65)), [1] * 8, [0] * 66) is None
    assert counts == [0, 0, 0]
    with pytest.raises(TypeError):
        C_COUNT((1, 2), 5, counts)
