"""Large batches and RoundBlocks: the aggregated path leaves exactly the state (and the
exposition bytes, exemplars included) that one round at a time leaves; rounds whose counts
are unknown (k = j = -1) stay out of every token metric."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from memra_obs.events import BurstRecord, RoundRecord, SessionEndRecord, SessionRecord
from memra_obs.prom import PrometheusExporter, RoundBlock
from memra_obs.prom.buckets import PHASE_BUCKETS, TOKEN_BUCKETS
from memra_obs.prom.exporter import BULK_MIN
from memra_obs.prom.exposition import encode
from memra_obs.prom.model import Hist
from memra_obs.records import SpecPhaseNs

OM = "application/openmetrics-text; version=1.0.0"
MS = 1_000_000


def session(sid: int, family: str = "glm5", trace: int = 0xABC) -> SessionRecord:
    return SessionRecord(
        sid, family, "t", "tv", "w", 0, 0, 1_700_000_000 * 10**9, trace, 7 + sid, 0, 2, True
    )


def exposition(ex: PrometheusExporter) -> bytes:
    return encode(ex.registry, OM)[0] + encode(ex.registry, "text/plain")[0]


# ---------------------------------------------------------------------------- Hist


@settings(max_examples=300)
@given(
    vals=st.lists(
        st.one_of(st.integers(-3 * MS, 3 * 10**9), st.sampled_from([0, 50_000, 100_000, 1])),
        max_size=80,
    ),
    tokens=st.booleans(),
    ex_mask=st.lists(st.booleans(), min_size=80, max_size=80),
    prior=st.lists(st.integers(0, 10**9), max_size=5),
)
def test_observe_many_is_observe_in_order(vals, tokens, ex_mask, prior):
    """Counts, sum, count and every bucket's latest exemplar: as one observe() per value,
    negative values (observed as 0) and observations without an exemplar included."""
    bounds = tuple(TOKEN_BUCKETS) if tokens else tuple(round(b * 1e9) for b in PHASE_BUCKETS)
    one, many = Hist(bounds), Hist(bounds)
    for h in (one, many):
        for v in prior:
            h.observe(v, {"trace_id": "old"}, 1.0)

    def ex_at(p: int) -> tuple[dict[str, str], float] | None:
        return ({"trace_id": f"{p:032x}"}, 1.5 + p) if ex_mask[p] else None

    for p, v in enumerate(vals):
        e = ex_at(p)
        if e is None:
            one.observe(v)
        else:
            one.observe(v, e[0], e[1])
    many.observe_many(vals, ex_at)
    assert many.state() == one.state()


# ---------------------------------------------------------------------------- streams


@st.composite
def streams(draw: st.DrawFn) -> list[Any]:
    """Record streams as an observer (or a tail) hands them over: sessions (some without
    a trace id), rounds (unknown counts, level-2 splits, clocks that stepped back), burst
    records between them, session ends, rounds of a session never announced."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    out: list[Any] = []
    t = 10**9
    for sid in range(1, draw(st.integers(1, 4)) + 1):
        fam = rng.choice(["glm5", "qwen"])
        if rng.random() < 0.9:
            out.append(session(sid, fam, 0 if rng.random() < 0.2 else rng.getrandbits(128)))
        idx = 0
        for burst in range(rng.randint(1, 6)):
            split = rng.random() < 0.6
            for _ in range(rng.randint(1, 12)):
                b = [t]
                for _ in range(5):
                    t += rng.choice([rng.randint(0, 9 * MS), rng.randint(-MS, 3 * MS), 50_000])
                    b.append(t)
                known = rng.random() < 0.7
                k = rng.randint(0, 8) if known else -1
                j = rng.randint(0, max(k, 0)) if known else -1
                sp = (
                    (rng.randint(0, 4 * MS), rng.randint(0, MS), rng.randint(0, 4 * MS),
                     rng.randint(0, MS))
                    if split else None
                )  # fmt: skip
                out.append(
                    RoundRecord(sid, burst, idx, tuple(b), k, j, 100 + idx,
                                rng.randint(0, 3) if known else 0, sp)  # type: ignore[arg-type]
                )  # fmt: skip
                idx += 1
                t += rng.randint(0, MS)
            out.append(BurstRecord(sid, burst, 4, 0, t, SpecPhaseNs(), None, 1, 0, 0))
        if rng.random() < 0.8:
            out.append(SessionEndRecord(sid, t, idx, 1, idx, ""))
    return out


def _hook(s: SessionRecord, r: RoundRecord) -> int:
    return 0 if r.index % 3 == 2 else (s.span_id * 31 + r.index) & ((1 << 64) - 1) or 1


@settings(max_examples=60, deadline=None)
@given(streams(), st.booleans(), st.integers(1, 3))
def test_a_large_batch_leaves_what_round_by_round_leaves(stream, hook, window_div):
    """The bulk path against one record at a time: the same exposition, byte for byte
    (buckets, sums, counters, slow rounds, every exemplar with its span id)."""
    kw: dict[str, Any] = {"slow_window": 64 // window_div, "worker_label": True, "worker": "x"}
    if hook:
        kw["round_span_id"] = _hook
    bulk = PrometheusExporter(CollectorRegistry(), **kw)
    one = PrometheusExporter(CollectorRegistry(), **kw)
    pad = [BurstRecord(99, 0, 0, 0, 0, SpecPhaseNs(), None, 0, 0, 0)] * BULK_MIN
    bulk.export(stream + pad)  # long enough for the bulk path whatever the stream
    for rec in stream:
        one.export([rec])
    assert exposition(bulk) == exposition(one)
    assert bulk.export_errors == one.export_errors == 0


def test_a_bad_record_in_a_large_batch_is_counted_and_the_rest_kept():
    """A malformed round in a bulk batch: counted in export_errors, its neighbours (and
    the rounds before it) published as round by round would."""
    good = [session(1)] + [
        RoundRecord(1, 0, i, (i, i + 1, i + 3, i + 4, i + 5, i + 9), 4, 2, 0, 1, None)
        for i in range(60)
    ]
    bad = RoundRecord(1, 0, 60, (1, 2, 3), 4, 2, 0, 0, None)  # type: ignore[arg-type]
    batch = [*good[:30], bad, *good[30:]]
    bulk, one = PrometheusExporter(CollectorRegistry()), PrometheusExporter(CollectorRegistry())
    bulk.export(batch)
    for rec in batch:
        one.export([rec])
    assert bulk.export_errors == one.export_errors == 1
    assert exposition(bulk) == exposition(one)


# ---------------------------------------------------------------------------- blocks


@st.composite
def blocks(draw: st.DrawFn) -> list[Any]:
    """Sessions and the RoundBlocks of their bursts (counts for a prefix of each)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    out: list[Any] = []
    for sid in range(1, draw(st.integers(1, 3)) + 1):
        out.append(session(sid, rng.choice(["glm5", "qwen"]), rng.getrandbits(128)))
        first = 0
        start = 10**12 + sid * 10**10
        for burst in range(rng.randint(1, 8)):
            n = rng.randint(0, 9)
            cols = tuple([rng.randint(0, 6 * MS) for _ in range(n)] for _ in range(5))
            c = rng.randint(0, n)
            counts = [(4, rng.randint(0, 4), 500 + i, rng.randint(0, 2)) for i in range(c)]
            sp = (rng.randint(0, 3 * MS), rng.randint(0, MS), rng.randint(0, 3 * MS), 7)
            split = sp if rng.random() < 0.7 else None
            out.append(RoundBlock(sid, burst, first, start, cols, counts, split))
            first += n
            start += sum(map(sum, cols)) + rng.randint(0, MS)
        out.append(SessionEndRecord(sid, start, first, 8, first, ""))
    return out


def _expand(items: list[Any]) -> list[Any]:
    out: list[Any] = []
    for it in items:
        out.extend(it.records() if type(it) is RoundBlock else [it])
    return out


@settings(max_examples=60, deadline=None)
@given(blocks(), st.booleans())
def test_round_blocks_publish_what_their_records_publish(items, hook):
    """A RoundBlock stands for its rounds: in a large batch, in a small one, and as the
    RoundRecords ``records()`` expands it to, the exposition is the same."""
    kw: dict[str, Any] = {"round_span_id": _hook} if hook else {}
    pad = [BurstRecord(99, 0, 0, 0, 0, SpecPhaseNs(), None, 0, 0, 0)] * BULK_MIN
    bulk, small, recs = (PrometheusExporter(CollectorRegistry(), **kw) for _ in range(3))
    bulk.export(items + pad)
    for it in items:
        small.export([it])
    for r in _expand(items):
        recs.export([r])
    assert exposition(bulk) == exposition(recs) == exposition(small)
    assert bulk.export_errors == small.export_errors == recs.export_errors == 0


def test_round_block_records_lie_back_to_back():
    blk = RoundBlock(3, 1, 10, 1000, ([1, 2], [3, 4], [5, 6], [7, 8], [9, 10]), [(4, 2, 9, 1)],
                     (1, 0, 1, 0))  # fmt: skip
    a, b = blk.records()
    assert a == RoundRecord(
        3, 1, 10, (1000, 1001, 1004, 1009, 1016, 1025), 4, 2, 9, 1, (1, 0, 1, 0)
    )
    assert b.t_ns_mono[0] == 1025 and b.index == 11 and (b.k, b.j, b.ctx, b.seq_rows) == (
        -1, -1, 0, 0
    )  # fmt: skip
    assert blk.record(1) == b


# ---------------------------------------------------------------------------- k = j = -1


@pytest.mark.parametrize("bulk", [False, True])
def test_unknown_counts_stay_out_of_every_token_metric(bulk):
    """Rounds with k = j = -1 (rebuilt without their row) count as rounds and in every
    timing histogram, never in the drafted/accepted histograms and totals nor seq_rows."""
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    rounds = [
        RoundRecord(1, 0, i, (0, MS, 3 * MS, 4 * MS, 5 * MS, 6 * MS), *c, None)
        for i, c in enumerate([(4, 3, 10, 2), (-1, -1, 0, 0), (-1, -1, 0, 0)] * 20)
    ]
    batch = [session(1), *rounds]
    if bulk:
        ex.export(batch)
    else:
        for rec in batch:
            ex.export([rec])

    def v(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, {"family": "glm5", **labels})

    assert v("memra_spec_rounds_total") == 60
    assert v("memra_spec_round_seconds_count") == 60
    assert v("memra_spec_phase_seconds_count", phase="maint") == 60
    assert v("memra_spec_drafted_tokens_per_round_count") == 20
    assert v("memra_spec_accepted_tokens_per_round_count") == 20
    assert v("memra_spec_accepted_tokens_per_round_bucket", le="0.0") == 0
    assert v("memra_spec_drafted_tokens_total") == 80
    assert v("memra_spec_accepted_tokens_total") == 60
    assert v("memra_spec_verify_seq_rows_total") == 40
    assert ex.export_errors == 0
