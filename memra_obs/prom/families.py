"""The metric set of DESIGN §5 (public interface) and the children a label set binds once,
so a round touches attributes, never a lookup. A classic histogram costs a series per bucket
per label set, so each layout is as short as its question allows.
"""

from __future__ import annotations

from ..records import FIRST_TOKEN_MS_FIELDS
from ..timeline import PHASES
from .advice import LoopAdvisor
from .model import Family, Hist, Value

#: A round's wall, 0.5 ms to 2.5 s: x1.33-1.5 steps from 2 to 128 ms, where served rounds
#: live, keep ``histogram_quantile`` within ~20 % and put a slow round (> 1.5x the median)
#: in another bucket than the median.
ROUND_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.006, 0.008, 0.012, 0.016, 0.024,
    0.032, 0.048, 0.064, 0.096, 0.128, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
#: A phase (and a level-2 verify part), 50 µs accept to 2.5 s stalled verify: coarser steps.
PHASE_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032,
    0.064, 0.128, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
#: Drafted / accepted tokens per round: every count to 8 (the usual k), then coarser;
#: ``le="0"`` counts the rounds that kept no draft.
TOKEN_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
#: Time to first token: the OpenTelemetry GenAI conventions' boundaries for
#: ``gen_ai.server.time_to_first_token``, so panels on either line up.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
#: First-token phases: the TTFT bounds and three below 1 ms for the small buckets.
FIRST_TOKEN_PHASE_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, *TTFT_BUCKETS)

#: ``part`` values of the level-2 verify split, in the seed's line order.
SPLIT_PARTS = ("kda", "kda_scan", "mla", "rest", "ffn")
#: ``phase`` values of the first-token profile: each ``SpecFirstTokenProf`` ms field.
FIRST_TOKEN_PHASES = tuple(f[: -len("_ms")] for f in FIRST_TOKEN_MS_FIELDS)

H, C, G = "histogram", "counter", "gauge"
F = ("family",)
# name, type, labels after the optional worker, buckets, help. Counters carry no _total (the
# encoders add it). The per-round token histograms are *_per_round: in OpenMetrics the
# counters own the names memra_spec_*_tokens, and two TYPE lines for one name break parsers.
_TABLE: tuple[tuple[str, str, tuple[str, ...], tuple[float, ...], str], ...] = (
    ("memra_spec_round_seconds", H, F, ROUND_BUCKETS,
     "Wall time of one speculative-decoding round (draft+verify+accept+rollback+maint)."),
    ("memra_spec_phase_seconds", H, (*F, "phase"), PHASE_BUCKETS,
     "Time of one phase of a round, drained at both ends (device time included)."),
    ("memra_spec_verify_split_seconds", H, (*F, "part"), PHASE_BUCKETS,
     "Level-2 split of one round's verify: kda (kda_scan inside it), mla, "
     "rest = verify - (kda + mla) saturating, ffn inside rest."),
    ("memra_spec_drafted_tokens_per_round", H, F, TOKEN_BUCKETS,
     "Draft tokens that entered one round's verify (k)."),
    ("memra_spec_accepted_tokens_per_round", H, F, TOKEN_BUCKETS,
     "Draft tokens one round accepted (j; the round commits j+1)."),
    ("memra_spec_rounds", C, F, (), "Verify rounds run."),
    ("memra_spec_drafted_tokens", C, F, (), "Draft tokens verified (sum of k)."),
    ("memra_spec_accepted_tokens", C, F, (), "Draft tokens accepted (sum of j)."),
    ("memra_spec_verify_seq_rows", C, F, (),
     "Verify rows that took the per-row (sequential) mixer arm."),
    ("memra_spec_slow_rounds", C, F, (),
     "Rounds whose wall exceeded 1.5x the median wall of the session's last 64 rounds "
     "(itself included)."),
    ("memra_spec_drafted_tokens_by_position", C, (*F, "position"), (),
     "Draft tokens verified at each draft position (0-based, as vLLM's *_per_pos): a round "
     "with k drafts adds 1 at positions 0..k-1; the sum over positions is "
     "memra_spec_drafted_tokens_total."),
    ("memra_spec_accepted_tokens_by_position", C, (*F, "position"), (),
     "Draft tokens accepted at each draft position: a round that accepted j adds 1 at "
     "positions 0..j-1; the sum over positions is memra_spec_accepted_tokens_total."),
    ("memra_spec_recommended_k", G, F, (),
     "The k advisor's draft length (estimate): the k maximising estimated tokens/s over the "
     "window of recent rounds (MEMRA_OBS_ADVICE_WINDOW)."),
    ("memra_spec_estimated_speedup", G, F, (),
     "Estimated speedup over plain decoding at the recommended k (estimate; below 1 plain "
     "decoding wins)."),
    ("memra_spec_expected_tokens_per_round", G, F, (),
     "Expected tokens per round E(k) at the recommended k (estimate)."),
    ("memra_spec_estimated_tokens_per_second", G, (*F, "k"), (),
     "Estimated tokens/s at draft length k, E(k) / t_round(k), for k = 1..16 (estimate)."),
    ("memra_spec_advice_info", G, (*F, "clock", "plain_step"), (),
     "1 per label set with advice: the clock that timed the rounds the advice was fitted "
     "from (event, sync, host; unknown from legacy lines) and where the plain step came "
     "from (verify_fit or measured)."),
    ("memra_spec_first_token_phase_seconds", H, ("phase",), FIRST_TOKEN_PHASE_BUCKETS,
     "One bucket of a session's first-token profile (SpecFirstTokenProf *_ms field); "
     "buckets the route did not run (0 ms) are not observed. They nest: cache_alloc, "
     "sink_alloc, prime, capture, anchor, draft_alloc, first_burst and unattributed add up to "
     "memra_spec_first_token_seconds; the others sit inside them (draft_prime, first_* and "
     "first_burst_hook inside first_burst), so a sum over every phase counts them twice."),
    ("memra_spec_first_token_seconds", H, (), TTFT_BUCKETS,
     "Time to first token of a session: creation plus the first burst "
     "(SpecFirstTokenProf.total_ms)."),
    ("memra_gpu_free_bytes", G, ("device", "point"), (),
     "Free device memory per CUDA ordinal, before the trunk cache allocation and after "
     "the drafter KV allocation of the latest profiled session."),
    # The instrument's own health (never labelled worker): read from the objects that
    # drop or fail (QueueSink.dropped, ExportWorker.errors, ...) when scraped.
    ("memra_obs_dropped", C, ("signal",), (),
     "Telemetry the instrument dropped instead of blocking the loop (signal: records = "
     "the hand-off queue was full; spans = a span exporter's queue was full; rounds = a "
     "round with counts no loop produces, or one an exception out of the loop cut; ring = "
     "records a lapped agent ring lost)."),
    ("memra_obs_export_errors", C, ("signal",), (),
     "Exports that failed (signal: records = an exporter raised on a batch; spans = a "
     "span export failed; metrics = a record this exporter could not aggregate; requests "
     "= lines the requests file could not take; lines = legacy lines stderr refused; the tail's: the lines its output refused)."),
)  # fmt: skip


def spec_families(worker_label: bool) -> dict[str, Family]:
    """Every family by name, in exposition order; ``worker_label`` puts ``worker`` first on
    each but the ``memra_obs_*`` ones."""
    w = ("worker",) if worker_label else ()
    return {
        n: Family(n, h, k, lab if n.startswith("memra_obs_") else (*w, *lab), b)
        for n, k, lab, b, h in _TABLE
    }


class LoopChildren(LoopAdvisor):
    """The children of one ``(worker,) family`` label set, bound once, and its advisor."""

    __slots__ = ("accepted", "drafted", "phases", "round", "seq_rows", "slow", "split")

    def __init__(self, f: dict[str, Family], lv: tuple[str, ...], window: int = 0) -> None:
        super().__init__(f, lv, window)
        self.round: Hist = f["memra_spec_round_seconds"].child(lv)
        phase = f["memra_spec_phase_seconds"]
        self.phases: tuple[Hist, ...] = tuple(phase.child((*lv, p)) for p in PHASES)
        self.split: tuple[Hist, ...] = ()  # bound on the first level-2 round
        self.drafted: Hist = f["memra_spec_drafted_tokens_per_round"].child(lv)
        self.accepted: Hist = f["memra_spec_accepted_tokens_per_round"].child(lv)
        # Totals the histograms already hold, read when scraped: equal by construction.
        rnd, drafted, accepted = self.round, self.drafted, self.accepted
        f["memra_spec_rounds"].child(lv, lambda: sum(rnd.counts))
        f["memra_spec_drafted_tokens"].child(lv, lambda: drafted.total)
        f["memra_spec_accepted_tokens"].child(lv, lambda: accepted.total)
        self.seq_rows: Value = f["memra_spec_verify_seq_rows"].child(lv)
        self.slow: Value = f["memra_spec_slow_rounds"].child(lv)

    def bind_split(self) -> tuple[Hist, ...]:
        split = self.f["memra_spec_verify_split_seconds"]
        self.split = tuple(split.child((*self.lv, p)) for p in SPLIT_PARTS)
        return self.split
