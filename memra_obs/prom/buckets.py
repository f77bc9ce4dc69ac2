"""Bucket bounds of every histogram, in seconds (or tokens), with why each is what it is.

Classic histograms cost one series per bucket per label set, and the scrape renders each of
them, so every layout here is as short as the question it answers allows.
"""

from __future__ import annotations

__all__ = [
    "FIRST_TOKEN_PHASE_BUCKETS",
    "PHASE_BUCKETS",
    "ROUND_BUCKETS",
    "TOKEN_BUCKETS",
    "TTFT_BUCKETS",
]

#: One spec round's wall: 0.5 ms to 2.5 s, about x1.33-x1.5 per step between 2 ms and 128 ms
#: where a served round lives, so ``histogram_quantile`` stays within ~20 % there and the
#: slow-round mode (1.5x the median) lands in another bucket than the median.
ROUND_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.006, 0.008, 0.012, 0.016, 0.024,
    0.032, 0.048, 0.064, 0.096, 0.128, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

#: One phase of a round and the level-2 verify parts: 50 us (an accept or a rollback) to
#: 2.5 s (a stalled verify), doubling; phases span four decades, so the steps are coarser.
PHASE_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032,
    0.064, 0.128, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

#: Drafted / accepted tokens per round: every count up to 8 (the usual k), then coarser.
#: ``le="0"`` counts the rounds that kept no draft at all.
TOKEN_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)

#: Time to first token: exactly the OpenTelemetry GenAI semantic conventions' advisory
#: boundaries for ``gen_ai.server.time_to_first_token``, so panels built on either line up.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip

#: The first-token phases: the TTFT bounds plus three below 1 ms, where the small buckets
#: (anchor draw, sink allocation, hook) sit; every TTFT bound is kept so the two compare.
FIRST_TOKEN_PHASE_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, *TTFT_BUCKETS)
