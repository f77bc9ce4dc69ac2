"""spec_decode_record: vLLM's per-request fields (metrics.speculative_decoding) and what AIPerf's
SpecDecodeAcceptanceRecord checks of them."""

from __future__ import annotations

import random

import pytest
from analysis_sim import CURVES, Round, rounds

from memra_obs.analysis import spec_decode_record


def test_matches_vllms_own_example():
    """vLLM's unit test: k=3 with 2 then 0 accepted gives exactly these fields, in this order."""
    rec = spec_decode_record([Round(3, 2), Round(3, 0)])
    assert rec == {
        "mean_acceptance_length": 2.0,
        "draft_acceptance_rate": 1 / 3,
        "acceptance_histogram": [1, 0, 1, 0],
        "num_spec_steps": 2,
        "num_accepted_draft_tokens": 2,
        "num_draft_tokens": 6,
        "num_spec_tokens": 3,
    }
    assert list(rec) == list(rec.keys())  # insertion order is vLLM's to_dict order
    assert "per_step_accepted" not in rec


def test_detailed_and_aiperf_invariants():
    """Detailed adds the per-step arrays; the invariants AIPerf validates hold: steps = Σ
    histogram, len(histogram) = num_spec_tokens + 1, accepted = Σ j·h[j], 0 <= a <= d."""
    rs = rounds(CURVES["decaying"], 300, random.Random(1), lambda r: r.randint(0, 6))
    rs += [Round(-1, -1)] * 5  # unknown counts: left out
    rec = spec_decode_record(rs, detailed=True, num_spec_tokens=8)
    steps = [r for r in rs if r.k > 0]
    assert rec["num_spec_steps"] == len(steps) == sum(rec["acceptance_histogram"])
    assert len(rec["acceptance_histogram"]) == 9 and rec["num_spec_tokens"] == 8
    acc = sum(j * c for j, c in enumerate(rec["acceptance_histogram"]))
    assert acc == rec["num_accepted_draft_tokens"] == sum(rec["per_step_accepted"])
    assert rec["num_draft_tokens"] == sum(rec["per_step_drafted"]) == sum(r.k for r in steps)
    assert rec["per_step_drafted"] == [r.k for r in steps]
    assert all(
        0 <= a <= d for a, d in zip(rec["per_step_accepted"], rec["per_step_drafted"], strict=True)
    )
    assert rec["mean_acceptance_length"] == pytest.approx(1 + acc / len(steps))
    assert rec["draft_acceptance_rate"] == pytest.approx(acc / rec["num_draft_tokens"])


def test_no_steps_and_bad_bounds():
    """No drafting round: vLLM's empty values, and no per-step lists (vLLM's ``to_dict`` adds
    them only when there are steps; they were ``[]``); a configured k below a round's k is an
    error, one equal to it is not."""
    assert spec_decode_record([Round(0, 0), Round(-1, -1)], detailed=True) == {
        "mean_acceptance_length": 1.0,
        "draft_acceptance_rate": 0.0,
        "acceptance_histogram": [0],
        "num_spec_steps": 0,
        "num_accepted_draft_tokens": 0,
        "num_draft_tokens": 0,
        "num_spec_tokens": 0,
    }
    with pytest.raises(ValueError, match="num_spec_tokens"):
        spec_decode_record([Round(5, 1)], num_spec_tokens=4)
    at_k = spec_decode_record([Round(4, 1)], num_spec_tokens=4)  # the configured k is a bound
    assert at_k["num_spec_tokens"] == 4 and at_k["acceptance_histogram"] == [0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="refused"):
        spec_decode_record([Round(2, 3)])
