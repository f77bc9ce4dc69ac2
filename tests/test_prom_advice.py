"""Issue 15 on /metrics: acceptance by position (counters that sum to the totals exactly) and
the k advisor's gauges (advise() over the window of recent rounds, computed off the scrape)."""

from __future__ import annotations

import logging
import random
import time
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

import memra_obs.prom.exporter as exporter_mod
from memra_obs.analysis import MIN_ROUNDS, advise
from memra_obs.environment import ConfigError, Settings
from memra_obs.prom import PrometheusExporter
from memra_obs.prom.advice import POSITIONS
from memra_obs.timeline import RoundRecord, SessionRecord

US = 1_000


def session(sid: int = 1, family: str = "glm5", clock: str = "event") -> SessionRecord:
    return SessionRecord(sid, family, "t", "tv", "w0", 0, 0, 0, 0, 0, 0, 1, False, clock)


def rounds(n: int, sid: int = 1, seed: int = 0, kmax: int = 6) -> list[RoundRecord]:
    """Rounds with varying k, acceptance decaying by position, costs linear in k."""
    rng, out, t = random.Random(seed), [], 10**9
    for i in range(n):
        k = rng.randint(1, kmax)
        j = 0
        while j < k and rng.random() < 0.85 * 0.9**j:
            j += 1
        ph = (120 * US * k + 40 * US, 900 * US + 35 * US * k, 20 * US, 10 * US, 30 * US)
        b = [t]
        for p in ph:
            b.append(b[-1] + p)
        out.append(RoundRecord(sid, 0, i, tuple(b), k, j, 100, 0, None))  # type: ignore[arg-type]
        t = b[-1]
    return out


def val(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, labels)


def positions(reg: CollectorRegistry, name: str, family: str = "glm5") -> list[float]:
    out = []
    while (v := val(reg, name, family=family, position=str(len(out)))) is not None:
        out.append(v)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 12), st.integers(0, 12), st.integers(1, 4)), max_size=80))
def test_by_position_counters_sum_to_the_totals_exactly(kjn):
    """A round with k drafts adds 1 at positions 0..k-1 (accepted: 0..j-1); runs of n equal
    rounds count n times; unknown counts (k = -1) are left out, as from the totals."""
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg, advice_window=0)
    recs: list = [session()]
    for i, (k, j, n) in enumerate(kjn):
        j = -1 if k < 0 else min(j, k)
        recs.append(RoundRecord(1, 0, i, (0, 1, 2, 3, 4, 5), k, j, 0, 0, None, n))
    ex.export(recs)
    drafted = positions(reg, "memra_spec_drafted_tokens_by_position_total")
    accepted = positions(reg, "memra_spec_accepted_tokens_by_position_total")
    known = [(k, j, n) for k, j, n in ((k, min(j, k), n) for k, j, n in kjn) if k >= 0]
    assert sum(drafted) == sum(k * n for k, _, n in known)
    assert sum(drafted) == (val(reg, "memra_spec_drafted_tokens_total", family="glm5") or 0)
    assert sum(accepted) == (val(reg, "memra_spec_accepted_tokens_total", family="glm5") or 0)
    top = max((k for k, _, _ in known), default=0)
    assert len(drafted) == len(accepted) == top
    for p in range(top):
        assert drafted[p] == sum(n for k, _, n in known if k > p)
        assert accepted[p] == sum(n for _, j, n in known if j > p)


def test_positions_past_the_bound_are_said_once_and_the_rest_stay_exact(caplog):
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg, advice_window=0)
    with caplog.at_level(logging.WARNING, logger="memra_obs"):
        ex.export(
            [session(), *(RoundRecord(1, 0, i, (0,) * 6, 70, 66, 0, 0, None) for i in (0, 1))]
        )
    drafted = positions(reg, "memra_spec_drafted_tokens_by_position_total")
    assert len(drafted) == POSITIONS and set(drafted) == {2.0}
    assert positions(reg, "memra_spec_accepted_tokens_by_position_total") == [2.0] * POSITIONS
    said = [r for r in caplog.records if "by-position counters stop" in r.getMessage()]
    assert len(said) == 1 and "k=70" in said[0].getMessage()


def test_gauges_are_advise_over_the_last_window_rounds():
    """The gauges equal analysis.advise() over exactly the last `advice_window` rounds, with the
    session's clock, and the info series names that clock."""
    reg = CollectorRegistry()
    rs = rounds(900)
    ex = PrometheusExporter(reg, advice_window=256)
    ex.export([session(clock="event"), *rs])
    ex.flush()
    want = advise(rs[-256:], max_k=16, clock="event")
    assert want is not None
    assert val(reg, "memra_spec_recommended_k", family="glm5") == want.recommended_k
    assert val(reg, "memra_spec_estimated_speedup", family="glm5") == pytest.approx(
        want.estimated_speedup.value
    )
    assert val(reg, "memra_spec_expected_tokens_per_round", family="glm5") == pytest.approx(
        want.expected_tokens.value
    )
    for p in want.curve:
        got = val(reg, "memra_spec_estimated_tokens_per_second", family="glm5", k=str(p.k))
        assert got == pytest.approx(p.tokens_per_s.value)
    assert val(reg, "memra_spec_estimated_tokens_per_second", family="glm5", k="17") is None
    info = dict(family="glm5", clock="event", plain_step="verify_fit")
    assert val(reg, "memra_spec_advice_info", **info) == 1
    # The whole run would advise differently from its last 256 rounds only by chance: the
    # window is what the gauges follow, so a different window size gives advise() over it.
    reg2 = CollectorRegistry()
    ex2 = PrometheusExporter(reg2, advice_window=2048)
    ex2.export([session(), *rs])
    ex2.flush()
    whole = advise(rs, max_k=16, clock="event")
    assert whole is not None
    assert val(reg2, "memra_spec_expected_tokens_per_round", family="glm5") == pytest.approx(
        whole.expected_tokens.value
    )


def test_a_measured_plain_step_divides_the_speedup_and_says_measured():
    reg = CollectorRegistry()
    rs = rounds(400)
    ex = PrometheusExporter(reg, plain_step_ns=2_000_000)
    ex.export([session(clock="host"), *rs])
    ex.flush()
    want = advise(rs, max_k=16, clock="host", plain_step_ns=2_000_000)
    assert want is not None and want.plain_step_source == "measured"
    assert val(reg, "memra_spec_estimated_speedup", family="glm5") == pytest.approx(
        want.estimated_speedup.value
    )
    assert val(reg, "memra_spec_advice_info", family="glm5", clock="host", plain_step="measured")


def test_legacy_rounds_say_their_clock_is_unknown_and_families_advise_apart():
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    ex.export([session(1, "glm5", clock=""), *rounds(200, 1), session(2, "mtp"), *rounds(20, 2)])
    ex.flush()
    info = dict(family="glm5", clock="unknown", plain_step="verify_fit")
    assert val(reg, "memra_spec_advice_info", **info) == 1
    assert val(reg, "memra_spec_recommended_k", family="glm5") is not None
    # 20 rounds are below MIN_ROUNDS: no advice, so no gauge (rather than a made-up value).
    assert val(reg, "memra_spec_recommended_k", family="mtp") is None
    assert positions(reg, "memra_spec_drafted_tokens_by_position_total", "mtp")


def test_a_legacy_session_keeps_the_clock_its_family_has():
    """A session that names no clock (legacy lines) leaves its label set's clock as it was."""
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    ex.export([session(1, "glm5"), *rounds(100, 1), session(2, "glm5", clock=""), *rounds(100, 2)])
    ex.flush()
    assert val(reg, "memra_spec_advice_info", family="glm5", clock="event",
               plain_step="verify_fit") == 1  # fmt: skip


def test_scrapes_only_read_and_the_exporter_thread_recomputes_at_most_once_a_second(monkeypatch):
    calls = []
    real = exporter_mod.advise

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(exporter_mod, "advise", counting)
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    rs = rounds(600)
    ex.export([session(), *rs[:300]])  # first batch: advised at once
    assert len(calls) == 1
    for r in rs[300:]:
        ex.export([r])  # within the second: not again
    assert len(calls) == 1
    k = val(reg, "memra_spec_recommended_k", family="glm5")
    for _ in range(5):
        assert val(reg, "memra_spec_recommended_k", family="glm5") == k  # a scrape only reads
    assert len(calls) == 1
    ex.flush()  # flush brings the gauges up to date
    assert len(calls) == 2
    ex.flush()  # nothing new: nothing recomputed
    assert len(calls) == 2


def test_gauges_catch_up_when_the_records_stop_coming(monkeypatch):
    """Rounds that came within the second after the last fit are fitted at the worker's next
    tick, idle too: a tail that read its backlog published the fit of part of it for good."""
    from memra_obs.export import QueueSink

    monkeypatch.setattr(exporter_mod, "ADVICE_EVERY_S", 0.3)
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    q = QueueSink([ex], interval_ms=20)
    rs = rounds(1200, kmax=8)
    q.put_many([session(), *rs[:100]])  # fitted at once: on 100 rounds
    time.sleep(0.1)
    q.put_many(rs[100:])  # within the period: not fitted yet
    first, want = advise(rs[:100], max_k=16, clock="event"), advise(rs, max_k=16, clock="event")
    assert first is not None and want is not None
    e = want.expected_tokens.value
    assert e != pytest.approx(first.expected_tokens.value)
    deadline = time.monotonic() + 5
    while val(reg, "memra_spec_expected_tokens_per_round", family="glm5") != pytest.approx(e):
        assert time.monotonic() < deadline, "the gauges kept the fit of the first rounds"
        time.sleep(0.05)
    q.shutdown(2)


def test_window_zero_publishes_no_advice_but_keeps_the_position_counters():
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg, advice_window=0)
    ex.export([session(), *rounds(300)])
    ex.flush()
    assert val(reg, "memra_spec_recommended_k", family="glm5") is None
    assert positions(reg, "memra_spec_drafted_tokens_by_position_total")


def test_a_failing_advisor_is_said_once_and_the_gauges_stay(monkeypatch, caplog):
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    ex.export([session(), *rounds(300)])
    ex.flush()
    k = val(reg, "memra_spec_recommended_k", family="glm5")

    def broken(*a, **kw):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(exporter_mod, "advise", broken)
    with caplog.at_level(logging.WARNING, logger="memra_obs"):
        for i in range(3):
            ex.export(rounds(40, seed=i + 1))
            ex.flush()
    assert val(reg, "memra_spec_recommended_k", family="glm5") == k
    assert sum("k advisor failed" in r.getMessage() for r in caplog.records) == 1


def test_a_window_that_gives_no_advice_leaves_no_stale_gauges():
    """A loop that turned speculation off (k = 0 rounds fill the window): the window gives no
    advice, so no advice series; the speedup of rounds long gone stayed, for good (an alert
    on it never resolved). Drafting again brings them back."""
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg, advice_window=256)
    rs = rounds(400)
    ex.export([session(), *rs])
    ex.flush()
    names = ("memra_spec_recommended_k", "memra_spec_estimated_speedup",
             "memra_spec_expected_tokens_per_round")  # fmt: skip
    assert all(val(reg, n, family="glm5") is not None for n in names)
    off = [r._replace(index=400 + i, k=0, j=0) for i, r in enumerate(rs[:300])]
    ex.export(off)
    ex.flush()
    assert advise(off[-256:], max_k=16) is None
    assert [val(reg, n, family="glm5") for n in names] == [None] * 3
    assert val(reg, "memra_spec_estimated_tokens_per_second", family="glm5", k="1") is None
    assert not [m for m in reg.collect() if m.name == "memra_spec_advice_info" and m.samples]
    assert positions(reg, "memra_spec_drafted_tokens_by_position_total")  # counters stay
    ex.export(rs[:100])
    ex.flush()
    assert val(reg, "memra_spec_recommended_k", family="glm5") is not None
    assert (
        val(reg, "memra_spec_advice_info", family="glm5", clock="event", plain_step="verify_fit")
        == 1
    )


def test_a_round_with_j_outside_0_k_is_an_export_error_and_the_gauges_go_on():
    """Counts no loop produces (j > k, j < 0; a hostile ring, say) enter neither the token
    histograms nor the advisor's window (whose every refit would fail): export errors."""
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    rs = rounds(300)
    bad = [rs[0]._replace(k=4, j=9), rs[0]._replace(k=4, j=-1), rs[0]._replace(k=0, j=1)]
    unknown = rs[0]._replace(k=-1, j=-1)  # a round rebuilt without its row: no error
    ex.export([session(), *rs[:150], *bad, unknown, *rs[150:]])
    ex.flush()
    want = advise(rs, max_k=16, clock="event")
    assert want is not None and ex.export_errors == 3
    assert val(reg, "memra_spec_recommended_k", family="glm5") == want.recommended_k
    assert val(reg, "memra_spec_drafted_tokens_per_round_count", family="glm5") == 300
    assert val(reg, "memra_spec_round_seconds_count", family="glm5") == 304


def test_the_observer_publishes_the_advice_of_its_own_clock():
    """End to end through configure(): the host clock (no device stream) names itself."""
    from memra_obs.wiring import build_observer

    reg = CollectorRegistry()
    obs = build_observer(
        level=1, prof=False, registry=reg, env={}, sinks="prometheus", metrics_addr="",
        advice_window=64,
    )  # fmt: skip
    try:
        rng = random.Random(3)
        with obs.session("glm5") as s:
            for _ in range(4):
                b = s.burst(4)
                for _ in range(40):
                    b.begin_round()
                    b.end_draft()
                    b.end_verify()
                    b.end_accept()
                    b.end_rollback()
                    b.end_round(k=4, j=rng.randint(0, 4))
                b.end()
        obs.flush()
        assert val(
            reg, "memra_spec_advice_info", family="glm5", clock="host", plain_step="verify_fit"
        )
        assert sum(positions(reg, "memra_spec_drafted_tokens_by_position_total")) == 640
    finally:
        obs.shutdown()


def test_a_run_of_equal_rounds_counts_n_times_in_the_window():
    """A record with repeat=n is n rounds for the advisor too, as for the counters: 100 rounds
    sent as 5 runs of 20 give the advice of the 100 rounds one by one."""
    base = rounds(5)
    runs = [r._replace(repeat=20) for r in base]
    ones = [r._replace(index=20 * i + m) for i, r in enumerate(base) for m in range(20)]
    got = []
    for recs in (runs, ones):
        reg = CollectorRegistry()
        ex = PrometheusExporter(reg, advice_window=256)
        ex.export([session(), *recs])
        ex.flush()
        got.append(val(reg, "memra_spec_expected_tokens_per_round", family="glm5"))
    assert got[0] is not None and got[0] == pytest.approx(got[1])


def test_a_negative_advice_window_is_refused_at_construction():
    with pytest.raises(ValueError, match="advice_window >= 0"):
        PrometheusExporter(CollectorRegistry(), advice_window=-1)


def test_an_advice_window_below_min_rounds_is_refused_at_construction():
    """A window of 1..31 rounds would never publish a gauge (advise() answers None below
    MIN_ROUNDS), silently: refused, as AdviceWindow refuses it, and so is the knob."""
    for n in (1, MIN_ROUNDS - 1):
        with pytest.raises(ValueError, match=f"advice_window={n}: 0 or at least MIN_ROUNDS"):
            PrometheusExporter(CollectorRegistry(), advice_window=n)
    with pytest.raises(ConfigError, match=f"MEMRA_OBS_ADVICE_WINDOW='{MIN_ROUNDS - 1}'"):
        Settings.resolve({"MEMRA_OBS_ADVICE_WINDOW": str(MIN_ROUNDS - 1)})
    assert Settings.resolve({"MEMRA_OBS_ADVICE_WINDOW": str(MIN_ROUNDS)}).advice_window == 32
    PrometheusExporter(CollectorRegistry(), advice_window=MIN_ROUNDS).unregister()


def test_the_gauges_are_refitted_once_the_second_is_over(monkeypatch):
    """Rounds that came within the second are fitted by the first tick ADVICE_EVERY_S after
    the last fit, not later (a clock of our own: no sleeping)."""
    now = [100.0]
    monkeypatch.setattr(exporter_mod, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    rs = rounds(1200, kmax=8)
    ex.export([session(), *rs[:100]])
    first = val(reg, "memra_spec_expected_tokens_per_round", family="glm5")
    ex.export(rs[100:])
    assert val(reg, "memra_spec_expected_tokens_per_round", family="glm5") == first
    now[0] += exporter_mod.ADVICE_EVERY_S
    ex.tick()
    want = advise(rs, max_k=16, clock="event")
    assert want is not None and first != pytest.approx(want.expected_tokens.value)
    got = val(reg, "memra_spec_expected_tokens_per_round", family="glm5")
    assert got == pytest.approx(want.expected_tokens.value)


def test_the_refit_keeps_the_windows_sums_instead_of_rebuilding_them(monkeypatch):
    """Each second the advisor rebuilt every family's sums from all its window's rounds (~8 ms
    a family, on the GIL the loop shares: 64 families slowed a loop ~30%), and kept the rounds
    whole (~665 B each). A refit now adds what came and takes off what went: the gauges equal
    advise() over the last window rounds exactly, through refits and evictions, and a refit
    after a few rounds builds no sums over the whole window."""
    from memra_obs import analysis

    built: list[int] = []
    real = analysis.Stats.__init__

    def counting(self, rounds=(), phases=True):
        rounds = list(rounds)
        built.append(len(rounds))
        real(self, rounds, phases)

    monkeypatch.setattr(analysis.Stats, "__init__", counting)
    reg, rng = CollectorRegistry(), random.Random(5)
    ex = PrometheusExporter(reg, advice_window=256)
    rs = rounds(2000, seed=5)
    ex.export([session(clock="event")])
    at = 0
    for step in range(80):
        n = rng.choice([1, 3, 10, 40]) if step else 300
        ex.export(rs[at : at + n])
        at += n
        built.clear()
        ex.flush()
        if step:
            assert not [b for b in built if b], built  # sums kept, not rebuilt
        want = advise(rs[:at][-256:], max_k=16, clock="event")
        assert want is not None
        got = val(reg, "memra_spec_expected_tokens_per_round", family="glm5")
        assert got == want.expected_tokens.value
        assert val(reg, "memra_spec_recommended_k", family="glm5") == want.recommended_k


def test_a_full_advice_window_holds_a_round_in_56_bytes() -> None:
    """The window of 2,048 rounds a (worker,) family keeps held ~611 KB as tuples of boxed
    ints: 330 MB in an agent at the 64-family cap x 8 workers. As seven unsigned ints a round
    in one buffer it is ~115 KB (README, "The sliding window")."""
    import gc
    import tracemalloc

    e = PrometheusExporter(CollectorRegistry())
    rs = rounds(4096)
    gc.collect()
    tracemalloc.start()
    try:
        for f in range(4):
            e.export([session(f + 1, family=f"f{f}")])
            e.export([r._replace(session=f + 1) for r in rs])
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    print(f"\n{held / 4 / 1024:.0f} KB a family with a full window")
    assert held / 4 < 200 * 1024


def test_a_round_whose_stamps_are_out_of_order_enters_the_window_at_zero() -> None:
    """A round with a negative phase (stamps out of order: a clock stepped, a hostile ring) is
    observed at 0 by its histogram; the advisor's window keeps it the same way, uncounted as an
    error (its unsigned ring would refuse the negative value)."""
    reg = CollectorRegistry()
    e = PrometheusExporter(reg)
    e.export([session()])
    rs = rounds(300)
    t = rs[5].t_ns_mono
    rs[5] = rs[5]._replace(t_ns_mono=(t[0], t[0] - 7, *t[2:]))
    t = rs[9].t_ns_mono  # and one past the ring's 64 bits, which only a hand-made record has
    rs[9] = rs[9]._replace(t_ns_mono=(t[0], t[0] + 10**20, *(x + 10**20 for x in t[2:])))
    e.export(rs)
    e.flush()
    assert e.export_errors == 0
    assert val(reg, "memra_spec_slow_rounds_total", family="glm5") == 1  # the round went on
    assert val(reg, "memra_spec_recommended_k", family="glm5") is not None
