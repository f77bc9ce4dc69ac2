"""PrometheusExporter: records in, DESIGN §5 series out (asserted with get_sample_value on a
fresh registry per test)."""

from __future__ import annotations

import os
import re
import threading

import pytest
from forked import in_child
from prometheus_client import CollectorRegistry, generate_latest

from memra_obs.export import QueueSink
from memra_obs.observer import Observer
from memra_obs.prom import FIRST_TOKEN_PHASES, PrometheusExporter, encode
from memra_obs.records import SpecFirstTokenProf, SpecPhaseNs, VerifySplit
from memra_obs.timeline import (
    BurstRecord,
    FirstTokenRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

MS = 1_000_000
TRACE = 0x0AF7651916CD43DD8448EB211C80319C
OM = "application/openmetrics-text; version=1.0.0"


def session(
    sid: int = 1, family: str = "glm5", trace: int = TRACE, worker: str = "w0"
) -> SessionRecord:
    return SessionRecord(
        sid, family, "t", "tv", worker, 0, 0, 1_700_000_000 * 10**9, trace, 7, 0, 1, False
    )


def rnd(
    sid: int, i: int, phases_ms: tuple[float, ...], k: int = 4, j: int = 2, seq: int = 0, split=None
) -> RoundRecord:
    t = [10**9 + i * 100 * MS]
    for p in phases_ms:
        t.append(t[-1] + round(p * MS))
    return RoundRecord(sid, 0, i, tuple(t), k, j, 100, seq, split)  # type: ignore[arg-type]


def val(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def test_round_histograms_and_counters(reg):
    """One round lands in the round, phase and token histograms and bumps every counter."""
    ex = PrometheusExporter(reg)
    ex.export([session(), rnd(1, 0, (1.5, 7.0, 0.12, 0.04, 0.3), k=4, j=3, seq=2)])
    assert val(reg, "memra_spec_round_seconds_count", family="glm5") == 1
    assert val(reg, "memra_spec_round_seconds_sum", family="glm5") == pytest.approx(0.00896)
    assert val(reg, "memra_spec_round_seconds_bucket", family="glm5", le="0.008") == 0
    assert val(reg, "memra_spec_round_seconds_bucket", family="glm5", le="0.012") == 1
    sums = {"draft": 1.5, "verify": 7, "accept": 0.12, "rollback": 0.04, "maint": 0.3}
    for phase, ms in sums.items():
        got = val(reg, "memra_spec_phase_seconds_sum", family="glm5", phase=phase)
        assert got == pytest.approx(ms / 1000), phase
    for phase, le_in, le_out in (
        ("draft", "0.002", "0.001"),
        ("verify", "0.008", "0.004"),
        ("accept", "0.00025", "0.0001"),
        ("rollback", "5e-05", None),
        ("maint", "0.0005", "0.00025"),
    ):
        assert (
            val(reg, "memra_spec_phase_seconds_bucket", family="glm5", phase=phase, le=le_in) == 1
        )
        if le_out:
            assert (
                val(reg, "memra_spec_phase_seconds_bucket", family="glm5", phase=phase, le=le_out)
                == 0
            )
    assert val(reg, "memra_spec_drafted_tokens_per_round_bucket", family="glm5", le="3.0") == 0
    assert val(reg, "memra_spec_drafted_tokens_per_round_bucket", family="glm5", le="4.0") == 1
    assert val(reg, "memra_spec_accepted_tokens_per_round_sum", family="glm5") == 3
    assert val(reg, "memra_spec_rounds_total", family="glm5") == 1
    assert val(reg, "memra_spec_drafted_tokens_total", family="glm5") == 4
    assert val(reg, "memra_spec_accepted_tokens_total", family="glm5") == 3
    assert val(reg, "memra_spec_verify_seq_rows_total", family="glm5") == 2
    assert val(reg, "memra_spec_slow_rounds_total", family="glm5") == 0


def test_an_exact_bound_belongs_to_its_bucket(reg):
    """le is inclusive: a 1 ms draft counts in le="0.001" (ns compared as integers)."""
    ex = PrometheusExporter(reg)
    ex.export([session(), rnd(1, 0, (1.0, 8.0, 0, 0, 0))])
    assert (
        val(reg, "memra_spec_phase_seconds_bucket", family="glm5", phase="draft", le="0.001") == 1
    )
    assert (
        val(reg, "memra_spec_phase_seconds_bucket", family="glm5", phase="verify", le="0.008") == 1
    )


def test_series_exist_from_the_session_start(reg):
    """Children are bound at the family's first session, so rate() works from the first round."""
    PrometheusExporter(reg).export([session(family="qwen")])
    assert val(reg, "memra_spec_rounds_total", family="qwen") == 0
    assert val(reg, "memra_spec_phase_seconds_count", family="qwen", phase="maint") == 0
    assert val(reg, "memra_spec_verify_split_seconds_count", family="qwen", part="kda") is None
    assert val(reg, "memra_spec_first_token_seconds_count") == 0  # the worker's, from its first


def test_level2_split_with_saturating_rest(reg):
    """The verify split gets its five parts; rest = verify - (kda + mla), floored at 0."""
    ex = PrometheusExporter(reg)
    ex.export(
        [
            session(),
            rnd(1, 0, (1, 10, 0, 0, 0), split=(4 * MS, MS, 3 * MS, 2 * MS)),
            rnd(1, 1, (1, 5, 0, 0, 0), split=(4 * MS, MS, 3 * MS, 0)),  # kda+mla > verify
        ]
    )
    s = "memra_spec_verify_split_seconds_sum"
    assert val(reg, s, family="glm5", part="kda") == pytest.approx(0.008)
    assert val(reg, s, family="glm5", part="kda_scan") == pytest.approx(0.002)
    assert val(reg, s, family="glm5", part="mla") == pytest.approx(0.006)
    assert val(reg, s, family="glm5", part="rest") == pytest.approx(0.003)  # 3 ms + 0
    assert val(reg, s, family="glm5", part="ffn") == pytest.approx(0.002)
    assert (
        val(reg, "memra_spec_verify_split_seconds_bucket", family="glm5", part="rest", le="5e-05")
        == 1
    )


def test_slow_rounds_follow_the_seed_rule_on_a_window(reg):
    """Slow = wall > 1.5x the median of the session's recent rounds (itself included)."""
    ex = PrometheusExporter(reg, slow_window=8)
    walls = [10, 10, 40, 10, 10, 14, 16, 10, 10, 10, 10, 10, 10, 10, 31]
    ex.export([session(), *(rnd(1, i, (w, 0, 0, 0, 0)) for i, w in enumerate(walls))])
    # 40 at i=2 (median of [10,10,40] is 10): slow. 14, 16: not (<= 15 / median 10 -> 16 > 15!).
    # i=6: window [10,10,40,10,10,14,16] sorted -> median 10 -> 16 > 15: slow.
    # i=14: window (last 8) all 10 but 31 -> median 10 -> slow.
    assert val(reg, "memra_spec_slow_rounds_total", family="glm5") == 3


@pytest.mark.parametrize(
    ("window", "walls", "slow"),
    [
        (64, [10, 10, 15], 0),  # 15 is 1.5x the median, not past it: not slow (the seed's ">")
        (64, [10, 100], 0),  # a session's first two rounds are never slow: the upper median
        (64, [10, 20, 20, 31], 1),  # even count: median sorted[n // 2] = 20, 31 > 30
        (3, [100, 100, 10, 10, 16], 1),  # the window holds 3: [10, 10, 16], median 10
    ],
)
def test_the_slow_round_rule_at_its_edges(reg, window, walls, slow):
    """Slow: wall > 1.5x the sorted[n // 2] wall of the session's last ``slow_window`` rounds."""
    ex = PrometheusExporter(reg, slow_window=window)
    ex.export([session(), *(rnd(1, i, (w, 0, 0, 0, 0)) for i, w in enumerate(walls))])
    assert val(reg, "memra_spec_slow_rounds_total", family="glm5") == slow


def test_a_run_of_equal_rounds_counts_as_its_rounds(reg):
    """A record standing for ``repeat`` equal rounds (the tail's burst means, its rows' runs)
    counts as that many everywhere: the histograms' buckets and counts, the counters, and the
    slow-round window (three 10 ms rounds, then a 40 ms one: slow)."""
    ex = PrometheusExporter(reg)
    ex.export([session(), rnd(1, 0, (10, 0, 0, 0, 0), seq=5)._replace(repeat=3),
               rnd(1, 3, (40, 0, 0, 0, 0))])  # fmt: skip
    for labels in ({"le": "0.012"}, {"le": "+Inf"}):
        want = 3 if labels["le"] == "0.012" else 4
        assert val(reg, "memra_spec_round_seconds_bucket", family="glm5", **labels) == want
    assert val(reg, "memra_spec_round_seconds_count", family="glm5") == 4
    for phase in ("draft", "verify", "accept", "rollback", "maint"):
        assert val(reg, "memra_spec_phase_seconds_count", family="glm5", phase=phase) == 4
    assert val(reg, "memra_spec_rounds_total", family="glm5") == 4
    assert val(reg, "memra_spec_drafted_tokens_total", family="glm5") == 16
    assert val(reg, "memra_spec_verify_seq_rows_total", family="glm5") == 15
    assert val(reg, "memra_spec_slow_rounds_total", family="glm5") == 1


def test_first_token_phases_total_and_gpu_gauges(reg):
    """Non-zero first-token buckets, the TTFT and the free-memory gauges (MB x 2^20)."""
    ex = PrometheusExporter(reg)
    prof = SpecFirstTokenProf(
        cache_alloc_ms=2.0,
        prime_ms=40.0,
        anchor_ms=0.2,
        first_burst_ms=30.0,
        free_mb_before=[(0, 80_000), (1, 79_000)],
        free_mb_after=[(0, 60_000)],
    )
    ex.export([session(), FirstTokenRecord(1, prof, (("prime", 10, 20),))])
    ph = "memra_spec_first_token_phase_seconds"
    assert val(reg, ph + "_sum", phase="prime") == pytest.approx(0.040)
    assert val(reg, ph + "_bucket", phase="anchor", le="0.00025") == 1
    assert val(reg, ph + "_count", phase="capture") is None  # never ran: no series
    assert val(reg, "memra_spec_first_token_seconds_sum") == pytest.approx(0.0722)
    assert val(reg, "memra_spec_first_token_seconds_bucket", le="0.08") == 1
    assert val(reg, "memra_gpu_free_bytes", device="0", point="before") == 80_000 * 2**20
    assert val(reg, "memra_gpu_free_bytes", device="1", point="before") == 79_000 * 2**20
    assert val(reg, "memra_gpu_free_bytes", device="0", point="after") == 60_000 * 2**20
    assert len(FIRST_TOKEN_PHASES) == 19 and "first_burst_hook" in FIRST_TOKEN_PHASES


def test_a_card_the_latest_session_did_not_read_loses_its_free_memory_series(reg):
    """The gauges are the latest profiled session's: a card lost since (GPU_IS_LOST: skipped
    by the snapshot) kept an older session's value for good, and the README's alert
    ``min by (device) (memra_gpu_free_bytes{point="after"})`` read a dead card as healthy."""
    ex = PrometheusExporter(reg)
    snaps = [[(0, 1000), (1, 2000)], [(0, 900)], []]
    for sid, snap in enumerate(snaps, 1):
        prof = SpecFirstTokenProf(prime_ms=1.0, free_mb_before=snap, free_mb_after=snap)
        ex.export([session(sid), FirstTokenRecord(sid, prof, ())])
        for point in ("before", "after"):
            got = {d: val(reg, "memra_gpu_free_bytes", device=str(d), point=point) for d in (0, 1)}
            want = {d: free << 20 for d, free in snap}
            assert got == {d: want.get(d) for d in (0, 1)}, sid


def test_worker_label(reg):
    """worker_label=True labels every loop series with SessionRecord.worker."""
    ex = PrometheusExporter(reg, worker_label=True, worker="fallback")
    ex.export(
        [
            session(1, worker="r0"),
            session(2, worker=""),
            rnd(1, 0, (1, 1, 0, 0, 0)),
            rnd(2, 0, (1, 1, 0, 0, 0)),
            FirstTokenRecord(1, SpecFirstTokenProf(prime_ms=1.0, free_mb_before=[(0, 1)]), ()),
        ]
    )
    assert val(reg, "memra_spec_rounds_total", family="glm5", worker="r0") == 1
    assert val(reg, "memra_spec_rounds_total", family="glm5", worker="fallback") == 1
    assert val(reg, "memra_spec_first_token_seconds_count", worker="r0") == 1
    assert val(reg, "memra_gpu_free_bytes", worker="r0", device="0", point="before") == 2**20


def test_rounds_of_an_unknown_session_are_kept(reg):
    """A session record lost to a full queue: its rounds count under family="unknown"."""
    ex = PrometheusExporter(reg)
    ex.export([rnd(9, 0, (1, 1, 0, 0, 0)), rnd(9, 1, (1, 1, 0, 0, 0))])
    assert val(reg, "memra_spec_rounds_total", family="unknown") == 2


def test_exemplars_carry_the_session_trace_id(reg):
    """OpenMetrics bucket lines carry {trace_id} of the session; none without a trace id."""
    ex = PrometheusExporter(reg)
    ex.export(
        [
            session(1, "a", TRACE),
            rnd(1, 0, (1, 7, 0, 0, 0)),
            session(2, "b", 0),
            rnd(2, 0, (1, 7, 0, 0, 0)),
        ]
    )
    body = encode(reg, OM)[0].decode()
    line = next(
        ln
        for ln in body.splitlines()
        if ln.startswith('memra_spec_round_seconds_bucket{family="a",le="0.008"}')
    )
    assert line.endswith(f' # {{trace_id="{TRACE:032x}"}} 0.008 1700000001.008')
    ex.export([rnd(1, 1, (1, 15, 0, 0, 0))._replace(repeat=3)])  # a run: its last round's
    assert f'{TRACE:032x}"}} 0.016 1700000001.148' in encode(reg, OM)[0].decode()
    assert '{family="b"' in body and all(
        " # " not in ln for ln in body.splitlines() if 'family="b"' in ln
    )
    assert " # " not in encode(reg, "text/plain")[0].decode()


def test_without_spans_only_sessions_in_a_callers_trace_carry_exemplars(reg):
    """``traced=False`` (no span exporter runs): an exemplar would name a trace no backend
    receives, unless the session joined the caller's trace (``parent_span_id``), which the
    caller exports."""
    ex = PrometheusExporter(reg, traced=False)
    joined = session(2, "b")._replace(parent_span_id=9)
    ex.export([session(1, "a"), rnd(1, 0, (1, 7, 0, 0, 0)), joined, rnd(2, 0, (1, 7, 0, 0, 0))])
    lines = encode(reg, OM)[0].decode().splitlines()
    assert all(" # " not in ln for ln in lines if 'family="a"' in ln)
    assert any(f'trace_id="{TRACE:032x}"' in ln for ln in lines if 'family="b"' in ln)


def test_round_span_id_hook(reg):
    """With a round_span_id hook, round exemplars also name the round's span (0 = none)."""
    ex = PrometheusExporter(reg, round_span_id=lambda s, r: 0 if r.index else s.span_id + 1)
    ex.export([session(), rnd(1, 0, (1, 7, 0, 0, 0)), rnd(1, 1, (1, 30, 0, 0, 0))])
    body = encode(reg, OM)[0].decode()
    assert f'{{span_id="0000000000000008",trace_id="{TRACE:032x}"}}' in body
    assert f' # {{trace_id="{TRACE:032x}"}} 0.031' in body
    ex = PrometheusExporter(r2 := CollectorRegistry(), round_span_id=lambda s, r: r.index)
    ex.export([session(), rnd(1, 2, (1, 7, 0, 0, 0))._replace(repeat=3)])  # a run of 2, 3, 4
    assert 'span_id="0000000000000004"' in encode(r2, OM)[0].decode()  # its last round's span


def test_session_end_frees_state_and_other_records_are_ignored(reg):
    """SessionEnd drops the session's state; burst records add nothing; nothing raises."""
    ex = PrometheusExporter(reg)
    ex.export(
        [
            session(),
            BurstRecord(1, 0, 4, 0, 1, SpecPhaseNs(), None, 3, 0, 0),
            SessionEndRecord(1, 5, 0, 1, 3, ""),
        ]
    )
    assert not ex._sessions
    assert ex.export_errors == 0


def test_a_bad_record_is_counted_not_raised(reg, caplog):
    """A record the exporter cannot use bumps export_errors (signal="metrics") and the batch
    goes on; so does a round with j outside 0..k. Each is said once: the ExportErrors alert
    sends the on-call to stderr, which said nothing of either."""
    ex = PrometheusExporter(reg)
    bad = RoundRecord(1, 0, 0, (1, 2, 3), 4, 2, 0, 0, None)  # type: ignore[arg-type]
    ex.export([session(), bad, rnd(1, 1, (1, 1, 0, 0, 0))])
    assert ex.export_errors == 1
    assert val(reg, "memra_spec_rounds_total", family="glm5") == 1
    ex.export([rnd(1, 2, (1, 1, 0, 0, 0))._replace(k=2, j=3)] * 2)
    assert ex.export_errors == 3
    said = [r.getMessage() for r in caplog.records if 'signal="metrics"' in r.getMessage()]
    assert len(said) == 2 and "could not take a RoundRecord" in said[0], said
    assert "'glm5' accepted j=3 of k=2" in said[1], said


def test_self_metrics_read_the_queue_and_its_exporters(reg):
    """dropped/errors per signal come from the QueueSink, its worker and its exporters."""

    class SpanEx:
        signal = "spans"
        dropped_spans = 5
        export_errors = 2

        def export(self, batch): ...
        def flush(self, timeout_s=5.0):
            return True

        def shutdown(self, timeout_s=5.0): ...

    ex = PrometheusExporter(reg)
    q = QueueSink([ex, SpanEx()], start=False)
    ex.attach_queue(q)
    q.dropped = 3
    q.worker.set.errors = 1
    ex.export_errors = 4
    assert val(reg, "memra_obs_dropped_total", signal="records") == 3
    assert val(reg, "memra_obs_dropped_total", signal="spans") == 5
    assert val(reg, "memra_obs_export_errors_total", signal="records") == 1
    assert val(reg, "memra_obs_export_errors_total", signal="spans") == 2
    assert val(reg, "memra_obs_export_errors_total", signal="metrics") == 4
    ex.watch("dropped", "ring", lambda: 7)
    ex.watch("dropped", "ring", lambda: 2)  # readers of one signal add up
    assert val(reg, "memra_obs_dropped_total", signal="ring") == 9

    class Odd(SpanEx):  # counts that are no ints (a method, None): not published
        signal = "logs"
        export_errors = None

        def dropped_spans(self): ...

    ex.attach_worker(QueueSink([Odd()], start=False).worker)
    assert val(reg, "memra_obs_dropped_total", signal="logs") is None
    assert val(reg, "memra_obs_export_errors_total", signal="logs") is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_counts_only_its_own_rounds(reg):
    """After fork() the child's series start from zero (the master's warm-up rounds are the
    master's: N workers would each count them again), and its self-metrics still read its
    own queue."""
    ex = PrometheusExporter(reg)
    q = QueueSink([ex])
    ex.attach_queue(q)
    q.put_many([session(), *(rnd(1, i, (1, 1, 0, 0, 0)) for i in range(3))])
    assert q.flush(5)
    q.dropped = 2
    names = ("memra_spec_rounds_total", "memra_spec_round_seconds_count",
             "memra_spec_accepted_tokens_by_position_total")  # fmt: skip

    def child() -> bytes:
        q.put_many([session(2), rnd(2, 0, (1, 1, 0, 0, 0))])
        q.flush(5)
        mine = [val(reg, n, family="glm5", **({"position": "0"} if "pos" in n else {}))
                for n in names]  # fmt: skip
        mine.append(val(reg, "memra_obs_dropped_total", signal="records"))
        return repr([float(v) for v in mine]).encode()

    try:
        assert in_child(child) == b"[1.0, 1.0, 1.0, 0.0]"
        assert val(reg, "memra_spec_rounds_total", family="glm5") == 3  # the parent's stay
    finally:
        q.shutdown(1)


def test_a_new_exporter_takes_over_the_registry(reg):
    """A new exporter on the registry takes the names over from the old one, and the old
    one's shutdown (or unregister) leaves them with the new."""
    old = PrometheusExporter(reg)
    old.export([session(), rnd(1, 0, (1, 1, 0, 0, 0))])
    new = PrometheusExporter(reg)
    assert val(reg, "memra_spec_rounds_total", family="glm5") is None
    old.shutdown()  # must not unregister the new one
    old.unregister()  # nor forget that the new one owns the names
    new.export([session(), rnd(1, 0, (1, 1, 0, 0, 0)), rnd(1, 1, (1, 1, 0, 0, 0))])
    assert val(reg, "memra_spec_rounds_total", family="glm5") == 2
    new.shutdown()
    assert val(reg, "memra_spec_rounds_total", family="glm5") == 2  # kept for a last scrape
    new.unregister()
    assert val(reg, "memra_spec_rounds_total", family="glm5") is None
    PrometheusExporter(reg)  # the names are free again


def test_taking_over_from_an_exporter_still_live_is_said(reg, caplog):
    """Two live observers on one registry (two models, say): the second takes the names
    over and the first's series stop; that is said once, not left to be noticed. Replacing a
    shut-down one (configure()) says nothing."""
    said = "the first one's series are no longer published"
    first = PrometheusExporter(reg)
    first.shutdown()
    PrometheusExporter(reg)
    assert said not in caplog.text
    PrometheusExporter(reg)
    PrometheusExporter(reg)
    assert caplog.text.count(said) == 1


def test_a_foreign_name_clash_still_raises(reg):
    """Only our own exporters are taken over; someone else's metric of the same name is a bug."""
    from prometheus_client import Counter

    Counter("memra_spec_rounds", "someone else's", registry=reg)
    with pytest.raises(ValueError):
        PrometheusExporter(reg)


def test_observer_to_exporter_through_the_queue(reg):
    """A live observer with QueueSink([PrometheusExporter]): rounds, split and first token."""
    ex = PrometheusExporter(reg)
    q = QueueSink([ex], interval_ms=5)
    ex.attach_queue(q)
    vs = VerifySplit()
    obs = Observer([q], level=2, prof=True, verify_split=vs, memory=lambda: [(0, 1000)])
    with obs.session("glm5") as s:
        s.free_memory("before")
        s.lap("cache_alloc")
        b = s.burst(4)
        for i in range(5):
            b.begin_round()
            b.end_draft()
            vs.add(kda=1000, mla=2000)
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=i % 5, ctx=10, seq_rows=1)
        b.end()
    assert obs.flush(5.0)
    obs.shutdown()
    assert val(reg, "memra_spec_rounds_total", family="glm5") == 5
    assert val(reg, "memra_spec_accepted_tokens_total", family="glm5") == 10
    assert val(reg, "memra_spec_verify_split_seconds_count", family="glm5", part="mla") == 5
    assert val(reg, "memra_spec_first_token_seconds_count") == 1
    assert val(reg, "memra_gpu_free_bytes", device="0", point="before") == 1000 * 2**20
    assert val(reg, "memra_obs_dropped_total", signal="records") == 0


def test_openmetrics_exposition_parses_strictly(reg):
    """prometheus_client's OpenMetrics parser takes the whole exposition: no clashing family
    names (the per-round token histograms are *_per_round, the counters own the base names)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    ex = PrometheusExporter(reg)
    ex.export([session(), rnd(1, 0, (1.5, 7.0, 0.12, 0.04, 0.3), k=4, j=3)])
    body, _ = encode(reg, OM)
    text = body.decode() if isinstance(body, bytes) else body
    names = [f.name for f in text_string_to_metric_families(text)]
    assert "memra_spec_drafted_tokens" in names and "memra_spec_drafted_tokens_per_round" in names
    assert len(names) == len(set(names))


def test_state_of_sessions_whose_records_were_lost_is_bounded(reg):
    """Issue 13: rounds of 20,000 sessions whose SessionRecord and end were both dropped, with
    max_sessions=1000, hold about what 1000 sessions hold (main: every one of them, ~1 KB each)."""
    import tracemalloc

    ex = PrometheusExporter(reg, max_sessions=1000)

    def feed(first: int) -> None:
        ex.export(
            [rnd(s, i, (1, 1, 0, 0, 0)) for s in range(first, first + 1000) for i in range(3)]
        )

    tracemalloc.start()
    try:
        feed(0)
        bound = tracemalloc.get_traced_memory()[0]  # what 1000 sessions hold
        for b in range(1, 20):
            feed(b * 1000)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 1.5 * bound, f"{held / 2**20:.1f} MiB held; 1000 sessions: {bound / 2**20:.1f}"
    assert val(reg, "memra_spec_rounds_total", family="unknown") == 60_000
    ex = PrometheusExporter(r2 := CollectorRegistry(), max_sessions=2)  # 2 are 2: both kept
    ex.export([session(1, family="a"), session(2, family="b"), rnd(1, 0, (1, 1, 0, 0, 0))])
    assert val(r2, "memra_spec_rounds_total", family="a") == 1


def test_a_live_session_forgotten_past_max_sessions_is_said(reg, caplog):
    """More sessions open at once than ``max_sessions``: the oldest's later rounds count under
    ``unknown``, which the README explains as a full queue's, and nothing said why."""
    from memra_obs import diagnostics

    diagnostics.reset()
    ex = PrometheusExporter(reg, max_sessions=2)
    with caplog.at_level("WARNING", logger="memra_obs"):
        ex.export([rnd(9, 0, (1, 1, 0, 0, 0))])  # a session whose start was lost: unsaid
        ex.export([session(s, family="a") for s in (1, 2)])
        assert not caplog.records
        ex.export([session(3, family="a"), rnd(1, 0, (1, 1, 0, 0, 0))])
    assert val(reg, "memra_spec_rounds_total", family="unknown") == 2
    assert [r.getMessage() for r in caplog.records] == [
        "metrics: over 2 sessions open at once (or their ends lost); the oldest is forgotten, "
        "its later rounds counted under family='unknown'"
    ]


def test_a_family_per_request_mints_no_series_past_max_families(reg, caplog):
    """A loop naming a family per request (``session(f"req_{i}")``): each family is ~250
    series, and 15,000 such sessions held 1.1 million (80 MB /metrics, 0.5 GB), growing for
    ever. Past ``max_families`` a new family's rounds count under ``unknown``, said once; the
    knob reaches a configured observer's exporter."""
    import memra_obs

    ex = PrometheusExporter(reg, max_families=3)
    recs: list = []
    for sid in range(1, 201):
        recs += [session(sid, family=f"req_{sid}"), rnd(sid, 0, (1, 1, 0, 0, 0))]
        recs.append(SessionEndRecord(sid, 0, 1, 1, 3, ""))
    ex.export([*recs, session(999, family="req_2"), rnd(999, 0, (1, 1, 0, 0, 0))])
    text = generate_latest(reg).decode()
    assert set(re.findall(r'family="([^"]*)"', text)) == {"req_1", "req_2", "req_3", "unknown"}
    assert val(reg, "memra_spec_rounds_total", family="unknown") == 197
    assert val(reg, "memra_spec_rounds_total", family="req_2") == 2  # a known family goes on
    ex2 = PrometheusExporter(r2 := CollectorRegistry(), max_families=1)  # "unknown" takes no place
    ex2.export([session(1, family="unknown"), session(2, family="a"), rnd(2, 0, (1, 1, 0, 0, 0))])
    assert val(r2, "memra_spec_rounds_total", family="a") == 1
    assert [r.getMessage() for r in caplog.records].count(
        "metrics: over 3 families (MEMRA_OBS_MAX_FAMILIES); 'req_4' and every new one are "
        "counted under family='unknown'"
    ) == 1
    reg2 = CollectorRegistry()
    obs = memra_obs.configure(
        sinks="prometheus", metrics_addr="", registry=reg2, max_families=2, env={}
    )
    try:
        for i in range(5):
            with obs.session(f"req_{i}") as s:
                b = s.burst(k=4)
                b.begin_round(), b.end_draft(), b.end_verify(), b.end_accept(), b.end_rollback()
                b.end_round(k=4, j=2)
                b.end()
        obs.flush()
        assert reg2.get_sample_value("memra_spec_rounds_total", {"family": "unknown"}) == 3
    finally:
        memra_obs.configure(env={})


def test_a_forgotten_workers_families_free_their_place_under_max_families(reg):
    """The agent forgets an exited worker's series; its families go from the cap with them. A
    worker that named a family per request filled it, and every family of every worker after
    it was published as ``unknown`` for the agent's life (its fixed restart's ``glm5`` too)."""
    ex = PrometheusExporter(reg, worker_label=True, max_families=3)
    recs = [session(50, family="qwen3", worker="7"), rnd(50, 0, (1, 1, 0, 0, 0))]
    for sid in range(1, 10):
        recs += [session(sid, family=f"req_{sid}", worker="1234"), rnd(sid, 0, (1, 1, 0, 0, 0))]
    ex.export([*recs, rnd(99, 0, (1, 1, 0, 0, 0))])  # (no session: "unknown", taking no place)
    ex.forget("1234")
    for sid, (fam, w) in enumerate([("glm5", "1300"), ("qwen3", "1300"), ("x", "1300")], 60):
        ex.export([session(sid, family=fam, worker=w), rnd(sid, 0, (1, 1, 0, 0, 0))])
    text = generate_latest(reg).decode()
    assert set(re.findall(r'family="([^"]*)"', text)) == {"glm5", "qwen3", "x", "unknown"}
    assert val(reg, "memra_spec_rounds_total", family="glm5", worker="1300") == 1
    assert val(reg, "memra_spec_rounds_total", family="qwen3", worker="7") == 1
    assert "1234" not in {s.w[0] for s in ex._sessions.values()}  # its sessions' state too


def test_a_bound_of_zero_is_refused_at_construction(reg):
    """slow_window, max_sessions or max_families of 0 would count no slow round, keep no
    session or put every family under "unknown", silently: refused; 1 is the least."""
    for kw in ("slow_window", "max_sessions", "max_families"):
        with pytest.raises(ValueError, match="max_families >= 1"):
            PrometheusExporter(CollectorRegistry(), **{kw: 0})
        PrometheusExporter(CollectorRegistry(), **{kw: 1}).unregister()


def test_a_forked_child_scrapes_even_when_the_parent_held_the_lock(reg):
    """fork() while another thread of the parent held the exporter's lock: the child's scrape
    (its collector) takes the child's fresh lock, never the one held for ever."""
    ex = PrometheusExporter(reg)
    ex.export([session(), rnd(1, 0, (1, 1, 0, 0, 0))])
    assert ex._lock.acquire(timeout=1)  # as the parent's thread held it at the fork
    ex.after_fork()
    got: list[bytes] = []
    t = threading.Thread(target=lambda: got.append(generate_latest(reg)), daemon=True)
    t.start()
    t.join(2)
    assert got and b"memra_spec_rounds_total" in got[0]


def test_forgetting_a_worker_without_worker_labels_keeps_every_series(reg):
    """Without a ``worker`` label no series is a worker's: forget() leaves them all."""
    ex = PrometheusExporter(reg)
    ex.export([session(), rnd(1, 0, (1, 1, 0, 0, 0))])
    ex.forget("w0")
    ex.export([rnd(1, 1, (1, 1, 0, 0, 0))])
    assert val(reg, "memra_spec_rounds_total", family="glm5") == 2
