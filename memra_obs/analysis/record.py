"""The spec-decode part of a per-request record, in the ecosystem's own field names.

vLLM returns it under ``metrics.speculative_decoding`` (its ``RequestSpecDecodeMetrics``) and
AIPerf reads that into ``spec_decode_acceptance`` (``SpecDecodeAcceptanceRecord``): same names,
same meanings, so either consumes this dict unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .acceptance import Counted, known


def spec_decode_record(
    rounds: Iterable[Counted], *, detailed: bool = False, num_spec_tokens: int | None = None
) -> dict[str, Any]:
    """vLLM's per-request fields for one session's rounds, in vLLM's key order:

    - a *spec step* is a round that drafted (k >= 1): vLLM counts a step only when drafts were
      scheduled, so rounds with k = 0 and rounds with unknown counts are left out;
    - ``num_spec_tokens``: the configured draft length; default the largest k seen (the loop's
      k before its confidence gate is not in the rounds); a value below some k is a ValueError;
    - ``num_draft_tokens`` = Σ k, ``num_accepted_draft_tokens`` = Σ j (no bonus tokens);
    - ``mean_acceptance_length`` = 1 + accepted / steps (1.0 with no step), bonus included;
    - ``draft_acceptance_rate`` = accepted / drafted (0.0 with nothing drafted), as vLLM;
    - ``acceptance_histogram``: dense, ``num_spec_tokens + 1`` buckets, bucket j = steps that
      accepted exactly j drafts (vLLM's wire form; AIPerf keeps the non-zero buckets as a map);
    - ``detailed``: ``per_step_accepted`` / ``per_step_drafted``, one entry per step, in order.
    """
    steps = [(r.k, r.j) for r in rounds if known(r.k, r.j) and r.k > 0]
    top = max((k for k, _ in steps), default=0)
    n_spec = top if num_spec_tokens is None else num_spec_tokens
    if n_spec < top:
        raise ValueError(f"num_spec_tokens={n_spec} is below a round's k={top}")
    hist = [0] * (n_spec + 1)
    for _, j in steps:
        hist[j] += 1
    drafted, accepted = sum(k for k, _ in steps), sum(j for _, j in steps)
    out: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / len(steps) if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": hist,
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": n_spec,
    }
    if detailed:
        out["per_step_accepted"] = [j for _, j in steps]
        out["per_step_drafted"] = [k for k, _ in steps]
    return out
