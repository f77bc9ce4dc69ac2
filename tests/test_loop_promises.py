"""The loop's promises under misuse: nothing raises into the loop, spoiled rounds are dropped
and counted, open bursts are closed, the profile covers its wall, memory stays bounded."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import threading
import time

import pytest
from forked import in_child
from stepped import SteppedStream, SteppingClock

import memra_obs
from memra_obs.demo import SimStream
from memra_obs.environment import ConfigError
from memra_obs.legacy import PhaseLine, parse_line
from memra_obs.observer import NOOP_OBSERVER, Observer
from memra_obs.records import SEQ_ROWS, VERIFY_SPLIT
from memra_obs.sinks.stderr import StderrSink
from memra_obs.testing import RecordingSink, capture
from memra_obs.timeline import (
    BurstRecord,
    FirstTokenRecord,
    ProfRowsRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)


def one_round(b, k=4, j=2, **kw):
    b.begin_round()
    b.end_draft()
    b.end_verify()
    b.end_accept()
    b.end_rollback()
    b.end_round(k=k, j=j, **kw)


@pytest.fixture
def stepping_clock(monkeypatch):
    """Every clock read of the observer on a :class:`SteppingClock` (as test_tail_rebuild's)."""
    from memra_obs import burst as burst_mod
    from memra_obs import clock as clock_mod
    from memra_obs import session as session_mod

    c = SteppingClock()
    for mod in (clock_mod, session_mod, burst_mod):
        monkeypatch.setattr(mod, "now_ns", c)
    return c


def test_a_stream_without_synchronize_is_said_not_raised(caplog):
    """``session(e=object())``: no AttributeError; the session runs undrained, said once."""
    with capture(level=1) as cap:
        for _ in range(2):
            with cap.observer.session("glm5", e=object()) as s, s.burst(4) as b:
                one_round(b)
    assert len(cap.rounds) == 2
    assert caplog.text.count("expected a stream with .synchronize()") == 1


@pytest.mark.parametrize(
    "kw",
    [{"j": None}, {"j": 5}, {"j": -1}, {"k": -2, "j": 0}, {"k": 4.5}, {"ctx": -1}, {"k": 70_000},
     {"ctx": 2**33}, {"seq_rows": 2**32}, {"seq_rows": -1}],
)  # fmt: skip
def test_bad_counts_drop_the_round_whole(caplog, kw):
    """``end_round(k=4, j=None)`` and counts no loop produces (j > k, negatives, floats): no
    error, the round is dropped and counted, the burst's totals hold only the good round."""
    with capture(level=1) as cap:
        obs = cap.observer
        with obs.session("glm5") as s, s.burst(4) as b:
            one_round(b)
            one_round(b, **{"k": 4, "j": 2, **kw})
    (burst,) = cap.bursts
    assert burst.phases.rounds == 1 and len(cap.rounds) == 1
    assert obs.dropped_rounds == 1
    assert "the round is dropped" in caplog.text
    assert "ctx and seq_rows in 0..4294967295" in caplog.text  # the limits, as checked
    line = parse_line(next(x for x in cap.lines if x.startswith("[glm5-phase]")))
    assert isinstance(line, PhaseLine) and line.rounds == 1


def test_counts_at_their_limits_are_recorded():
    """k = j = 65535, ctx and seq_rows 2**32 - 1 are counts a loop may pass: recorded."""
    with capture(level=1) as cap, cap.observer.session("glm5") as s, s.burst(4) as b:
        one_round(b, k=65535, j=65535, ctx=2**32 - 1, seq_rows=2**32 - 1)
    assert [(r.k, r.j, r.ctx, r.seq_rows) for r in cap.rounds] == [(65535,) * 2 + (2**32 - 1,) * 2]
    assert cap.observer.dropped_rounds == 0


def test_a_round_that_drafted_nothing_is_no_spec_step():
    """A k = 0 round (the gate drafted nothing) is recorded, but is no step of spec_decode()."""
    with capture(level=1) as cap, cap.observer.session("glm5") as s, s.burst(4) as b:
        one_round(b, k=0, j=0)
        one_round(b, k=4, j=2)
        assert s.spec_decode(detailed=True)["per_step_drafted"] == [4]
    assert len(cap.rounds) == 2


def test_a_burst_of_no_round_says_nothing_and_sends_no_rows(caplog):
    """A burst that closed no round: no clock settle failure said, no empty profile rows."""
    with capture(level=1, prof=True) as cap, cap.observer.session("glm5") as s:
        with s.burst(4) as b:
            one_round(b)
        with s.burst(4):
            pass
    assert len(cap.bursts) == 2 and len(cap.sink.of(ProfRowsRecord)) == 1
    assert "failed" not in caplog.text


def test_a_walk_between_two_bursts_lands_in_the_next_round():
    """What the walk adds outside a round stays in its thread's set until a round drains it."""
    with capture(level=2) as cap, cap.observer.session("glm5") as s:
        with s.burst(4) as b:
            one_round(b)
        VERIFY_SPLIT.add(kda=10)
        SEQ_ROWS.add(3)
        with s.burst(4) as b:
            one_round(b)
    assert [(r.split_ns, r.seq_rows) for r in cap.rounds] == [((0,) * 4, 0), ((10, 0, 0, 0), 3)]


def test_hook_time_adds_up_over_a_bursts_hooks(monkeypatch):
    from memra_obs import burst as burst_mod

    ticks = itertools.count(0, 10)
    with capture(level=1) as cap, cap.observer.session("glm5") as s, s.burst(4) as b:
        monkeypatch.setattr(burst_mod, "now_ns", lambda: next(ticks))
        for _ in range(2):
            with b.hook():
                pass
    assert cap.bursts[0].hook_ns == 20


def test_a_rounds_log_row_rest_is_its_rollback_and_maintenance():
    class Ticking(_FakeEventClock):
        immediate = True

        def mark(self):
            self.n += 1000
            return self.n

    with capture(level=1, prof=True, clock=Ticking) as cap:
        s = cap.observer.session("glm5")
        with s, s.burst(4) as b:
            one_round(b)
    (row,) = next(iter(cap.sink.of(ProfRowsRecord))).rows
    assert (row.wall_ms, row.draft_ms, row.verify_ms, row.accept_ms, row.rest_ms) == pytest.approx(
        (0.005, 0.001, 0.001, 0.001, 0.002)
    )


def test_counts_left_out_are_said_after_counts_out_of_range(caplog):
    """One said-once key served every bad count: after ``j > k`` was said, a loop that then
    left its counts out (``end_round(k=4)``) dropped every round unsaid. Each kind is said."""
    from memra_obs import diagnostics

    diagnostics.reset()
    with capture(level=0) as cap, cap.observer.session("glm5") as s, s.burst(4) as b:
        one_round(b, k=4, j=5)
        one_round(b, k=4, j=None)
    said = [r.getMessage() for r in caplog.records if "Burst.end_round(" in r.getMessage()]
    assert [m.split(",")[1] for m in said] == [" j=5", " j=None"]
    assert cap.observer.dropped_rounds == 2


def test_every_boundary_knows_its_place(caplog):
    """Out of order or missing boundaries: that round is dropped and counted once, said
    once per kind, the next good round still counts, and nothing raises."""
    with capture(level=0) as cap:
        obs = cap.observer
        with obs.session("glm5") as s, s.burst(4) as b:
            b.begin_round()
            b.end_verify()  # before end_draft
            b.end_draft()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=1)
            b.begin_round()
            b.end_draft()
            b.begin_round()  # end_verify..end_round missing
            b.end_draft()
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=1)
            b.end_round(k=4, j=1)  # no begin_round
            b.end_draft()  # no round open
            one_round(b)
            b.begin_round()
            b.end_draft()
            b.end_round(k=4, j=1)  # end_verify..end_rollback missing
            one_round(b)
    assert obs.dropped_rounds == 5
    assert len(cap.rounds) == 3
    said = caplog.text
    assert "Burst.end_round() after end_draft() (expected end_verify())" in said
    assert "Burst.end_verify() after begin_round() (expected end_draft())" in said
    assert "Burst.begin_round() after end_draft() (expected end_verify())" in said
    assert "Burst.end_round() after no open round (expected begin_round())" in said


def test_an_open_burst_is_closed_by_its_session(caplog):
    """Forgetting ``b.end()``: the next ``burst()`` and ``end()`` close it; its rounds, its
    line and the first-token profile are published; said once."""
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        s = cap.observer.session("glm5")
        one_round(s.burst(4))
        one_round(s.burst(4))  # the first burst was never ended
        s.end()  # nor the second
    assert [b.index for b in cap.bursts] == [0, 1]
    assert len(cap.rounds) == 2 and len(cap.sink.of(FirstTokenRecord)) == 1
    assert sum(1 for x in cap.lines if x.startswith("[glm5-phase]")) == 2
    assert "previous burst was not ended" in caplog.text
    assert "Session.end() with a burst not ended" in caplog.text


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"level": "2"}, "configure\\(level='2'\\): expected 0, 1 or 2"),
        ({"level": 3}, "expected 0, 1 or 2"),
        ({"level": True}, "expected 0, 1 or 2"),
        ({"prof": 1}, "configure\\(prof=1\\)"),
        ({"queue_size": -5}, "argument queue_size"),
        ({"round_spans": "many"}, "argument round_spans"),
    ],
)
def test_configure_refuses_what_no_loop_can_use(kw, why):
    """A typed signature; every refusal names the argument."""
    with pytest.raises(ConfigError, match=why):
        memra_obs.configure(**kw)


def test_configure_lists_its_knobs():
    """``help(memra_obs.configure)`` shows each knob by name."""
    import inspect

    params = inspect.signature(memra_obs.configure).parameters
    for knob in ("level", "prof", "sinks", "metrics_addr", "spans_file", "clock", "max_devices"):
        assert knob in params


def test_configure_env_carries_the_seed_flags_too(monkeypatch):
    """``configure(env=...)`` replaces os.environ for the trace flags as for the knobs."""
    for var in ("MEMRA_SPEC_TRACE", "MEMRA_GLM5_SPEC_TRACE", "MEMRA_SPEC_PROF"):
        monkeypatch.delenv(var, raising=False)
    obs = memra_obs.configure(env={"MEMRA_SPEC_TRACE": "2", "MEMRA_SPEC_PROF": "1"})
    try:
        assert isinstance(obs, Observer) and (obs.level, obs.prof) == (2, True)
    finally:
        memra_obs.configure(env={})
    assert memra_obs.get_observer() is NOOP_OBSERVER


def test_free_memory_snapshots_land_in_no_bucket(stepping_clock):
    """A slow snapshot (NVML's first call) is not charged to cache_alloc; the profile's
    unattributed_ms carries it, and the buckets sum to the first-token wall."""

    def slow_snapshot():
        stepping_clock.advance(0.05)  # 50 ms: cache_alloc would read 50 ms, not µs
        return [(0, 80_000)]

    with capture(level=0, prof=True, memory=slow_snapshot) as cap, cap.observer.session("g") as s:
        s.free_memory("before")
        s.lap("cache_alloc")
        s.lap("prime")
        s.free_memory("after")
        with s.burst(4) as b:
            one_round(b)
    (ft,) = cap.sink.of(FirstTokenRecord)
    p = ft.prof
    assert p.cache_alloc_ms < 20 and p.unattributed_ms >= 100
    (sess,) = cap.sessions
    (burst,) = cap.bursts
    wall_ms = (burst.end_ns_mono - sess.start_ns_mono) / 1e6
    assert p.total_ms() == pytest.approx(wall_ms, rel=0.005)


def test_first_token_buckets_cover_the_wall():
    """Every stretch from the session's start to the first burst's return is in a bucket or
    in unattributed_ms: the sum is the wall (within 0.5 %), also with set-up between them."""
    with (
        capture(level=0, prof=True, memory=lambda: [(0, 1)]) as cap,
        cap.observer.session("g") as s,
    ):
        for lap in ("cache_alloc", "prime", "anchor", "draft_alloc"):
            time.sleep(0.002)
            s.lap(lap)
        time.sleep(0.01)  # burst set-up that no bucket names
        with s.burst(4) as b:
            b.begin_round()
            time.sleep(0.003)
            s.lap("draft_prime")
            for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
                time.sleep(0.001)
                end()
            b.end_round(k=4, j=2)
    (ft,) = cap.sink.of(FirstTokenRecord)
    (sess,) = cap.sessions
    (burst,) = cap.bursts
    wall_ms = (burst.end_ns_mono - sess.start_ns_mono) / 1e6
    assert ft.prof.unattributed_ms >= 9.0
    assert ft.prof.total_ms() == pytest.approx(wall_ms, rel=0.005)


def test_unattributed_ms_is_to_the_ns_as_every_bucket():
    """``unattributed_ms`` is whole ns, as every bucket: the [spec-prof] line, the requests
    file and the span said ``unattributed_ms=0.22100000000000364`` (the float remainder of
    the wall less the buckets) beside ``prime_ms=35.936742``."""
    with capture(level=0, prof=True, memory=lambda: [(0, 1)]) as cap:
        for _ in range(10):
            with cap.observer.session("g") as s:
                for lap in ("cache_alloc", "prime", "anchor", "draft_alloc"):
                    s.lap(lap)
                with s.burst(4) as b:
                    one_round(b)
    fts = cap.sink.of(FirstTokenRecord)
    assert len(fts) == 10
    for ft in fts:
        assert ft.prof.unattributed_ms == round(ft.prof.unattributed_ms, 6) > 0


def test_a_bucket_lapped_out_of_its_place_is_said_and_counts_once(caplog):
    """A creation bucket lapped inside the first burst (the anchor drawn after ``s.burst()``)
    and a drafter prime lapped before it are said once and ignored: their time stays where it
    ran (first_burst, unattributed_ms), so the TTFT is the wall (the anchor counted twice: the
    histogram said more than the span; the drafter prime sat in unattributed_ms and its own
    bucket, and the tail laid it inside round 1)."""
    with capture(level=0, prof=True, memory=lambda: [(0, 1)]) as cap:
        for out_of_place in ("anchor", "draft_prime"):
            with cap.observer.session("g") as s:
                s.lap("cache_alloc")
                if out_of_place == "draft_prime":
                    time.sleep(0.01)
                    assert s.lap("draft_prime") == 0.0
                with s.burst(4) as b:
                    if out_of_place == "anchor":
                        time.sleep(0.01)
                        assert s.lap("anchor") == 0.0
                    one_round(b)
    sess = {r.session: r for r in cap.sessions}
    for ft, burst in zip(cap.sink.of(FirstTokenRecord), cap.bursts, strict=True):
        wall_ms = (burst.end_ns_mono - sess[ft.session].start_ns_mono) / 1e6
        assert ft.prof.anchor_ms == ft.prof.draft_prime_ms == 0.0
        assert ft.prof.total_ms() == pytest.approx(wall_ms, abs=1e-6)
    assert cap.sink.of(FirstTokenRecord)[1].prof.unattributed_ms >= 10.0
    assert caplog.text.count("Session.lap('anchor') inside a burst") == 1
    assert caplog.text.count("Session.lap('draft_prime') outside round 1's draft") == 1


def test_a_second_lap_in_the_first_round_starts_where_the_first_ended():
    """Two ``draft_prime`` laps in round 1 (one per prime chunk): each starts at the previous
    boundary, so the bucket stays within the burst (it counted the first stretch twice)."""
    with (
        capture(level=0, prof=True, memory=lambda: [(0, 1)]) as cap,
        cap.observer.session("g") as s,
        s.burst(4) as b,
    ):
        b.begin_round()
        for _ in range(2):
            time.sleep(0.02)
            s.lap("draft_prime")
        for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
            end()
        b.end_round(k=4, j=2)
    (ft,) = cap.sink.of(FirstTokenRecord)
    assert 40.0 <= ft.prof.draft_prime_ms <= ft.prof.first_burst_ms


@pytest.mark.parametrize("k", [None, -1, 4.0, "4", 70_000])
def test_a_burst_no_loop_drafts_or_after_the_end_records_nothing(caplog, k):
    """``s.burst(k)`` with a k no loop drafts, a burst's rounds after its ``end()``, a burst of
    an ended session: said once, recorded nowhere, no line the parser refuses."""
    with capture(level=1) as cap:
        with cap.observer.session("glm5") as s:
            with s.burst(k) as bad:
                one_round(bad)
            b = s.burst(4)
            one_round(b)
            b.end(tokens=3.0)  # type: ignore[arg-type]
            one_round(b)  # after its end
        one_round(s.burst(4))  # the session has ended
    assert len(cap.bursts) == 1 and len(cap.rounds) == 1 and cap.bursts[0].phases.rounds == 1
    assert cap.bursts[0].tokens == 4  # the round's j + 1, +1 anchor: not 3.0
    assert all(parse_line(x) for x in cap.lines) and len(cap.lines) == 1
    for said in ("expected an int in 0..65535", "tokens=3.0", "after its end()", "has ended"):
        assert caplog.text.count(said) == 1, said


def test_a_round_open_at_end_is_dropped_and_counted_and_rounds_after_it_are_not():
    """``end()`` with a round open (from ``begin_round`` on) drops that round and counts it in
    memra_obs_dropped_total{signal="rounds"}; boundaries after ``end()`` are ignored, not
    counted. The no-op burst's ``rounds`` and ``k`` read 0 (a real one's: its rounds, its k)."""
    from memra_obs.burst import NoOpBurst

    with capture(level=1) as cap, cap.observer.session("glm5") as s:
        obs = cap.observer
        b = s.burst(4)
        one_round(b)
        b.end()
        assert (b.rounds, b.k, obs.dropped_rounds) == (1, 4, 0)
        one_round(b)  # after its end: ignored
        assert (b.rounds, obs.dropped_rounds) == (1, 0)
        for steps in (0, 1, 4):  # end() right after begin_round, end_draft, end_rollback
            b = s.burst(4)
            b.begin_round()
            for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback)[:steps]:
                end()
            b.end()
        assert obs.dropped_rounds == 3 and len(cap.rounds) == 1
    assert (NoOpBurst().rounds, NoOpBurst().k) == (0, 0)


def test_accumulators_take_float_ns_and_refuse_negatives_without_raising(caplog):
    """``VERIFY_SPLIT.add(kda=dt * 1e9)`` (a float) is rounded; a negative or a string is said
    once and ignored: they raised TypeError into the loop, or wrapped to 2**64 - 5."""
    VERIFY_SPLIT.drain()
    SEQ_ROWS.take()
    VERIFY_SPLIT.add(kda=1500.4, mla=2)
    VERIFY_SPLIT.add(kda=-5)
    VERIFY_SPLIT.add(ffn="3")  # type: ignore[arg-type]
    SEQ_ROWS.add(2.0)  # type: ignore[arg-type]
    SEQ_ROWS.add(-1)
    assert VERIFY_SPLIT.drain() == (1500, 0, 2, 0) and SEQ_ROWS.take() == 2
    np = pytest.importorskip("numpy")  # numpy's scalars: float32 was refused, said as misuse
    VERIFY_SPLIT.add(kda=np.float32(1500.0), mla=np.int64(3), ffn=np.float64(2.6))
    VERIFY_SPLIT.add(kda=float("nan"))
    assert VERIFY_SPLIT.drain() == (1500, 0, 3, 3)
    assert caplog.text.count("expected nanoseconds >= 0") == 2  # once a call site (nan too)


def test_a_long_sync_burst_holds_bounded_memory():
    """100,000 rounds in one burst keep only the open round's marks."""
    obs = Observer([RecordingSink()], level=1, prof=False)
    with obs.session("glm5") as s, s.burst(4) as b:
        for _ in range(100_000):
            one_round(b)
        assert len(b._t) <= 6
        assert b.rounds == 100_000


class _FakeEventClock:
    """A deferred clock (like the event clock): stamps are settled later, in one call."""

    immediate = False

    def __init__(self, e, eh):
        self.n = 0
        self.settles = 0

    def mark(self):
        self.n += 1
        return self.n

    def settle(self, stamps):
        self.settles += 1
        return list(stamps)


def test_a_long_event_clock_burst_settles_in_chunks():
    """A deferred clock settles every SETTLE_ROUNDS rounds: the marks kept stay bounded."""
    from memra_obs.burst import SETTLE_ROUNDS

    clocks = []

    def factory(e, eh):
        clocks.append(_FakeEventClock(e, eh))
        return clocks[-1]

    keep = RecordingSink()
    obs = Observer([keep], level=0, prof=False, clock=factory)
    with obs.session("glm5") as s, s.burst(4) as b:
        for _ in range(3 * SETTLE_ROUNDS + 5):
            one_round(b)
            assert len(b._t) < 6 * SETTLE_ROUNDS
    rounds = keep.of(RoundRecord)
    assert len(rounds) == 3 * SETTLE_ROUNDS + 5
    assert clocks[0].settles == 4
    assert [r.t_ns_mono for r in rounds[:2]] == [(1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)]


def test_a_clock_that_fails_to_settle_keeps_its_rounds_host_stamps(caplog):
    """A deferred clock whose settle raises (a stream it cannot time): its rounds keep their
    host stamps and counts, said once, as a burst whose event record failed. They were dropped:
    an engine's torch.cuda.Stream subclass lost every round to it."""

    class Failing(_FakeEventClock):
        def settle(self, stamps):
            raise RuntimeError("device lost")

    keep = RecordingSink()
    obs = Observer([keep], level=0, prof=False, clock=Failing)
    with obs.session("glm5") as s, s.burst(4) as b:
        one_round(b)
        one_round(b)
    rounds = keep.of(RoundRecord)
    assert obs.dropped_rounds == 0 and [(r.k, r.j) for r in rounds] == [(4, 2), (4, 2)]
    assert [r.t_ns_mono for r in rounds] == [(1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11, 12)]
    assert caplog.text.count("clock settle failed (RuntimeError('device lost'))") == 1


def test_a_full_round_log_is_summarized_at_the_burst_that_fills_it():
    """At 64 rounds the log is full: ``[spec-prof-summary]`` (and ``[spec-advice]``) print
    after the burst that filled it, while the session goes on, not at its end."""
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        s = cap.observer.session("glm5")
        for _ in range(12):
            with s.burst(4) as b:
                for _ in range(6):
                    one_round(b)
        tags = [x.split(" ", 1)[0] for x in cap.lines if not x.startswith("[spec-prof-rounds]")]
        assert tags.count("[spec-prof-summary]") == 1 and len(cap.summaries) == 1
        i = tags.index("[spec-prof-summary]")
        assert tags[i - 1 : i + 3] == ["[glm5-phase]", "[spec-prof-summary]", "[spec-advice]",
                                       "[glm5-phase]"]  # fmt: skip
        assert tags[:i].count("[glm5-phase]") == 11  # the burst that reached 66 rounds
        s.end()
    assert len(cap.summaries) == 1  # not again at the end


def test_a_clock_that_settles_too_few_stamps_drops_its_rounds_counted_and_said(caplog):
    """A deferred clock whose settle returns fewer stamps than it was given (a clock of the
    loop's own, broken): the rounds it cannot finish are dropped, counted in
    memra_obs_dropped_total{signal="rounds"} and said once; the rounds before them and the
    burst are published (they were counted as dropped too)."""
    from memra_obs.timeline import BurstRecord

    class Short(_FakeEventClock):
        def settle(self, stamps):
            return super().settle(stamps)[:-1]

    keep = RecordingSink()
    obs = Observer([keep], level=0, prof=False, clock=Short)
    with obs.session("glm5") as s, s.burst(4) as b:
        for _ in range(3):
            one_round(b)
    assert obs.dropped_rounds == 1 and [r.index for r in keep.of(RoundRecord)] == [0, 1]
    assert len(keep.of(BurstRecord)) == 1
    assert caplog.text.count("finishing rounds failed") == 1


def test_a_failing_clock_never_raises_into_a_loop_that_drops_its_rounds():
    """Forgetting the marks of dropped rounds asks the clock too (settle of none): a clock
    whose settle raises raised into the loop at the 1,535th dropped round, and a burst whose
    only round was dropped was not published."""

    class Failing(_FakeEventClock):
        def settle(self, stamps):
            raise RuntimeError("cudaErrorLaunchFailure")

    keep = RecordingSink()
    obs = Observer([keep], level=1, prof=False, clock=Failing)
    with obs.session("glm5") as s:
        b = s.burst(4)
        for _ in range(3000):
            one_round(b, k=None)  # dropped: no k
        b.end()
        b2 = s.burst(4)
        one_round(b2, k=None)
        b2.end()
    assert obs.dropped_rounds == 3001 and len(keep.of(BurstRecord)) == 2


def test_a_clock_going_back_refuses_the_log_row_not_the_loop(caplog):
    """A clock factory whose stamps go back: the round's profile row is refused, said; nothing
    raises into the loop."""

    class Back(_FakeEventClock):
        immediate = True

        def mark(self):
            self.n -= 1
            return self.n

    with capture(level=1, prof=True, clock=Back) as cap:
        s = cap.observer.session("glm5")
        with s, s.burst(4) as b:
            one_round(b)
    assert len(cap.rounds) == 1
    assert "round log row refused" in caplog.text


@pytest.mark.parametrize(
    "calls",
    [
        "begin_round end_draft walk end_verify end_rollback end_round",  # no end_accept
        "begin_round end_draft end_verify end_rollback walk end_round",  # walked after the drop
        "begin_round end_draft walk end_verify end_accept end_rollback end_round:j=9",
        "end_draft walk end_verify end_accept end_rollback end_round",  # no begin_round
        "begin_round end_draft walk begin_round end_draft end_verify end_accept end_rollback "
        "end_round",  # the walked round never ended: the next one begins
    ],
)
def test_a_dropped_rounds_split_and_seq_rows_go_with_it(calls):
    """A round dropped for misuse takes its level-2 split and SEQ_ROWS along (also what its
    walk adds after the drop): every good round is charged only its own."""
    with capture(level=2) as cap, cap.observer.session("glm5") as s, s.burst(4) as b:
        for call in calls.split():
            if call == "walk":
                VERIFY_SPLIT.add(kda=111, mla=2)
                SEQ_ROWS.add(7)
            elif call.startswith("end_round"):
                b.end_round(k=4, j=9 if call.endswith("j=9") else 2)
            else:
                getattr(b, call)()
        one_round(b)
    assert cap.observer.dropped_rounds == 1 and cap.rounds
    assert {(r.split_ns, r.seq_rows) for r in cap.rounds} == {((0, 0, 0, 0), 0)}
    assert cap.bursts[0].split_ns == (0, 0, 0, 0)


@pytest.mark.parametrize("how", ["after end()", "bad k", "ended session"])
def test_an_unrecorded_rounds_split_and_seq_rows_go_with_it(how):
    """A round nothing records (its burst ended, a k no loop drafts, its session ended) takes
    what its walk added to VERIFY_SPLIT and SEQ_ROWS along: the next recorded round is charged
    only its own (it took the ignored round's 5 ms of kda inside a 0.01 ms verify)."""

    def walked(b):
        b.begin_round()
        b.end_draft()
        VERIFY_SPLIT.add(kda=5_000_000)
        SEQ_ROWS.add(1000)
        for end in (b.end_verify, b.end_accept, b.end_rollback):
            end()
        VERIFY_SPLIT.add(ffn=7)  # after end_verify: also its own
        SEQ_ROWS.add(5)
        b.end_round(k=4, j=2)

    with capture(level=2) as cap:
        with cap.observer.session("glm5") as s:
            if how == "after end()":
                b = s.burst(4)
                b.end()
                walked(b)
            elif how == "bad k":
                walked(s.burst(-1))
        if how == "ended session":
            walked(s.burst(4))
        with cap.observer.session("glm5") as s2, s2.burst(4) as b2:
            b2.begin_round()
            VERIFY_SPLIT.add(kda=10)
            SEQ_ROWS.add(3)
            for end in (b2.end_draft, b2.end_verify, b2.end_accept, b2.end_rollback):
                end()
            b2.end_round(k=4, j=2)
    (r,) = cap.rounds
    assert (r.split_ns, r.seq_rows) == ((10, 0, 0, 0), 3)


def test_burst_end_with_tokens_that_raise_on_compare_is_said_not_raised(caplog):
    """``b.end(tokens=x)`` where ``x >= 0`` itself raises (a numpy array): said once, the
    burst published with its rounds' tokens (it raised into the loop and the burst was lost)."""

    class Ambiguous:
        def __ge__(self, other):
            raise ValueError("The truth value of an array is ambiguous")

    with capture(level=1) as cap, cap.observer.session("glm5") as s:
        b = s.burst(4)
        one_round(b)
        b.end(tokens=Ambiguous())  # type: ignore[arg-type]
    assert len(cap.bursts) == 1 and cap.bursts[0].tokens == 4
    assert "Burst.end(tokens=" in caplog.text


@pytest.mark.parametrize("tokens", [0, 2**64 - 1])
def test_burst_end_with_tokens_at_the_seeds_limits_is_taken(tokens):
    with capture(level=1) as cap, cap.observer.session("glm5") as s:
        b = s.burst(4)
        one_round(b)
        b.end(tokens=tokens)
    assert [x.tokens for x in cap.bursts] == [tokens]


def test_burst_end_with_tokens_past_the_seeds_usize_is_said_and_the_profile_kept(caplog):
    """``b.end(tokens=2**70)`` is refused up front, as a negative count is: the burst and the
    first-token profile carry the rounds' tokens (it half-published, then lost the profile)."""
    with capture(level=1, prof=True) as cap, cap.observer.session("glm5") as s:
        b = s.burst(4)
        one_round(b)
        b.end(tokens=2**70)
    assert [x.tokens for x in cap.bursts] == [4]
    assert [f.prof.first_burst_tokens for f in cap.first_tokens] == [4]
    assert "Burst.end(tokens=1180591620717411303424): expected an int in 0.." in caplog.text
    assert "failed" not in caplog.text


def test_shutdown_counts_the_records_a_stuck_exporter_call_still_holds():
    """An exporter call that outlasts ``shutdown(t)``: the exporters after it are closed by
    then and never see that batch; its records are counted in ``QueueSink.dropped``, not
    lost uncounted."""
    from memra_obs.export import QueueSink

    release = threading.Event()

    class Stuck:
        def export(self, batch):
            release.wait(30)  # a shutdown that waits for it takes ~30 s

        def flush(self, timeout_s=5.0):
            return True

        def shutdown(self, timeout_s=5.0):
            pass

    class Count(Stuck):
        closed, got = False, 0

        def export(self, batch):
            if not self.closed:
                self.got += len(batch)

        def shutdown(self, timeout_s=5.0):
            self.closed = True

    ex = Count()
    q = QueueSink([Stuck(), ex], interval_ms=5)
    for _ in range(9):
        q.on_round(None)  # type: ignore[arg-type]
    q.worker.wake()
    deadline = time.monotonic() + 5
    while q.worker.held == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    try:
        q.shutdown(0.2)
        assert time.monotonic() - t0 < 4.0  # 0.2 s and a loaded host's stalls; not the 30 s
    finally:
        release.set()
    q.worker._thread.join(5)
    assert ex.got == 0 and q.dropped == 9


def test_level2_splits_of_concurrent_sessions_do_not_mix():
    """Two loop threads at level 2, each adding its own split to the process-wide
    accumulators: each burst's split is its own thread's."""
    results: dict[int, BurstRecord] = {}
    keep = RecordingSink()
    obs = Observer([keep], level=2, prof=False)
    start = threading.Barrier(2)

    def loop(kda: int) -> None:
        start.wait()
        with obs.session("glm5") as s, s.burst(4) as b:
            for _ in range(200):
                b.begin_round()
                b.end_draft()
                VERIFY_SPLIT.add(kda=kda, mla=1)
                SEQ_ROWS.add(kda)
                b.end_verify()
                b.end_accept()
                b.end_rollback()
                b.end_round(k=4, j=1)
                time.sleep(0)
        results[kda] = next(r for r in keep.of(BurstRecord) if r.session == s.id)

    ts = [threading.Thread(target=loop, args=(k,)) for k in (10, 1000)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results[10].split_ns[0] == 10 * 200
    assert results[1000].split_ns[0] == 1000 * 200
    seq = {r.session: r.seq_rows for r in keep.of(RoundRecord)}
    assert sorted(set(seq.values())) == [10, 1000]


def test_level2_splits_of_asyncio_tasks_awaiting_after_verify_do_not_mix():
    """asyncio tasks share their thread's sets: a task that adds and ends its verify with no
    ``await`` between keeps its split and SEQ_ROWS though it awaits before ``end_round`` (they
    were taken at end_round: another task's round took them), as does a burst that records
    nothing; a share added after ``end_verify`` with no ``await`` before ``end_round`` still
    lands in its own round."""
    keep = RecordingSink()
    obs = Observer([keep], level=2, prof=False)
    own: dict[int, int] = {}

    async def request(kda: int, k: int = 4, misuse: str = "") -> None:
        with obs.session("glm5") as s, s.burst(k) as b:  # k=-1: refused, its walks discarded
            own[s.id] = kda
            if misuse == "ended":  # its rounds come after its end(): ignored, walks discarded
                b.end()
            for _ in range(20):
                b.begin_round()
                await asyncio.sleep(0)
                if misuse == "dropped":  # out of order: the round is dropped, its walk too
                    b.end_accept()
                b.end_draft()
                VERIFY_SPLIT.add(kda=kda, mla=1)
                SEQ_ROWS.add(kda)
                b.end_verify()
                await asyncio.sleep(0)
                b.end_accept()
                b.end_rollback()
                VERIFY_SPLIT.add(ffn=kda)
                b.end_round(k=4, j=1)

    async def serve() -> None:
        # a misused round's walk left in the set went to the next task's round
        await asyncio.gather(request(8, misuse="dropped"), request(10), request(9, misuse="ended"),
                             request(1000), request(100000), request(7, -1))  # fmt: skip

    asyncio.run(serve())
    rounds = keep.of(RoundRecord)
    assert len(rounds) == 60
    for r in rounds:
        kda = own[r.session]
        assert (r.split_ns, r.seq_rows) == ((kda, 0, 1, kda), kda)


def test_a_burst_split_past_u64_wraps_as_the_seeds_fetch_add():
    """Level-2 sums past 2**64 over a burst wrap (the seed's AtomicU64 fetch_add): the phase
    line and its level-2 line are printed, not lost to a refused record."""
    with capture(level=2) as cap, cap.observer.session("glm5") as s, s.burst(4) as b:
        for _ in range(2):
            b.begin_round()
            b.end_draft()
            VERIFY_SPLIT.add(kda=1 << 63, mla=3, ffn=5)
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            VERIFY_SPLIT.add(kda=(1 << 63) + 1)  # a late share wraps in its round too
            b.end_round(k=4, j=2)
    (burst,) = cap.bursts
    assert [r.split_ns for r in cap.rounds] == [(1, 0, 3, 5)] * 2
    assert burst.split_ns == (2, 0, 6, 10)
    assert [x.split(" ", 1)[0] for x in cap.lines] == ["[glm5-phase]", "[glm5-phase-v]"]
    assert "vkda=0.000 (scan=0.000) vmla=0.000" in cap.lines[1]


def test_a_burst_phase_sum_past_u64_wraps_as_the_seeds_fetch_add():
    """Phase sums past 2**64 over a burst wrap (the seed's u64 fetch_add), and the verify
    span's rest is the line's u64 saturating_sub of the wrapped kda + mla."""
    from memra_obs.otel.spans import _split_attrs

    class Leaping:
        """A clock whose draft lasts 2**63 ns: two rounds' draft sum is 2**64."""

        immediate = True

        def __init__(self) -> None:
            self.t, self.n = 0, 0

        def mark(self) -> int:
            self.t += (1 << 63) if self.n % 6 == 1 else 1000
            self.n += 1
            return self.t

        def settle(self, stamps: list[int]) -> list[int]:
            return stamps

    with capture(level=1, clock=lambda e, eh: Leaping()) as cap:
        s = cap.observer.session("glm5")
        b = s.burst(4)
        one_round(b)
        one_round(b)
        b.end()
        s.end()
    (burst,) = cap.bursts
    assert burst.phases.draft == 0 and burst.phases.verify == 2000
    (line,) = cap.lines
    assert parse_line(line).draft_ms == 0.0  # type: ignore[union-attr]
    rest = dict(_split_attrs(5000, (1 << 63, 0, 1 << 63, 0)))["memra.spec.verify.rest_ns"]
    assert rest == 5000  # (2**63 + 2**63) & U64_MAX == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_exports_its_own_records():
    """After fork() the child's export worker runs again: its records reach its exporters, and
    it counts its own dropped rounds (not its parent's too)."""

    class Count:
        def __init__(self):
            self.rounds = 0

        def export(self, batch):
            self.rounds += sum(1 for r in batch if type(r) is RoundRecord)

        def flush(self, timeout_s=5.0):
            return True

        def shutdown(self, timeout_s=5.0):
            pass

    from memra_obs.export import QueueSink

    ex = Count()
    q = QueueSink([ex], interval_ms=10)
    obs = Observer([q], level=0, prof=False)
    obs.dropped_rounds = 7  # the parent's: the child counts its own

    def child() -> bytes:
        with obs.session("glm5") as s, s.burst(4) as b:
            for _ in range(103):
                one_round(b)
            b.end_round(k=4, j=9)  # j > k: dropped, the child's one
        q.flush(5.0)
        return f"{ex.rounds} {obs.dropped_rounds}".encode()

    got = in_child(child)
    q.shutdown(1.0)
    assert got == b"103 1"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_that_unwinds_its_parents_session_publishes_nothing(monkeypatch):
    """A child forked inside a session that leaves the ``with`` it inherited (``sys.exit``
    unwinds it) printed the parent's phase line and wrote its requests line a second time
    (the error ``SystemExit: 0``): it is the parent's to publish, once; the child says so."""
    from memra_obs import session as session_mod

    said: list[str] = []
    monkeypatch.setattr(session_mod, "say_once", lambda key, msg, kind="": said.append(msg))
    sink = RecordingSink()
    obs = Observer([sink], level=1, prof=False)
    with obs.session("glm5") as s, s.burst(4) as b:
        for _ in range(3):
            one_round(b)

        b.begin_round()
        b.end_draft()  # a round open across the fork: the parent's to end, or to drop

        def child() -> bytes:
            n = len(sink.records)
            with contextlib.suppress(SystemExit):
                try:
                    raise SystemExit(0)
                finally:
                    b.__exit__(SystemExit, SystemExit(0), None)
                    s.__exit__(SystemExit, SystemExit(0), None)
            one_round(s.burst(4))  # nor a burst of it (records of a session it never opened)
            fork = {m for m in said if "before fork()" in m}  # (one key: said once)
            return f"{len(sink.records) - n} {len(fork)} {obs.dropped_rounds}".encode()

        assert in_child(child) == b"0 1 0"
        b.end_verify()
        b.end_accept()
        b.end_rollback()
        b.end_round(k=4, j=2)
    assert len(sink.of(BurstRecord)) == 1 and len(sink.of(SessionEndRecord)) == 1
    assert sink.of(SessionEndRecord)[0].error == "" and said == []
    assert len(sink.of(RoundRecord)) == 4 and obs.dropped_rounds == 0


def test_a_forked_child_records_under_its_own_pid():
    """A worker label defaulted to the pid is the forked child's own pid in its records (its
    spans and requests file are told apart from its siblings'); an explicit label stays."""
    sink = RecordingSink()
    observers = [
        Observer([sink], level=0, prof=False, worker=w) for w in (str(os.getpid()), "rank0")
    ]

    def child() -> bytes:
        for obs in observers:
            with obs.session("glm5") as s, s.burst(4) as b:
                one_round(b)
        workers = [r.worker for r in sink.of(SessionRecord)]
        return " ".join([str(os.getpid()), *workers]).encode()

    pid, *workers = in_child(child).decode().split()
    assert workers == [pid, "rank0"]
    assert [o.worker for o in observers] == [str(os.getpid()), "rank0"]  # the parent's stay


def test_a_forked_child_takes_no_lock_a_parent_thread_held(monkeypatch):
    """fork() while another thread holds the stderr writer's lock, is inside configure() or is
    saying something: the child writes its lines, says its own and gets its observer (it
    waited forever); its queue counts only its own drops."""
    import memra_obs.diagnostics as diag
    import memra_obs.export as export_mod
    from memra_obs.linewriter import stderr_writer

    held = [stderr_writer()._lock, memra_obs._lock, diag._said_lock]
    for lock in held:
        lock.acquire()
    try:
        q = export_mod.QueueSink([], capacity=16, start=False)
        q.dropped = q.worker.set.errors = 5

        def child() -> bytes:
            signal.alarm(10)  # a child that waits forever dies: b"" back
            stderr_writer().write_lines(["[memra-obs] test: a line from the child"])
            diag.say_once("fork-test", "said in the child")
            q._after_fork()
            return f"{memra_obs.get_observer() is not None} {q.dropped} {q.worker.errors}".encode()

        assert in_child(child) == b"True 0 0"
    finally:
        for lock in held:
            lock.release()


def test_shutdown_under_busy_loop_threads_counts_every_record():
    """Loop threads still handing records over while ``shutdown(t)`` runs (the atexit case):
    the drain takes half of ``t``, the worker stops before its exporters close, and every
    record is exported or counted dropped (some were taken after the exporters closed)."""
    from memra_obs.export import QueueSink

    class Count:
        closed, got, late = False, 0, 0

        def export(self, batch):
            time.sleep(0.001)
            if self.closed:
                self.late += len(batch)
            self.got += len(batch)

        def flush(self, timeout_s=5.0):
            return True

        def shutdown(self, timeout_s=5.0):
            self.closed = True

    ex, stop, puts = Count(), threading.Event(), [0, 0]
    q = QueueSink([ex], interval_ms=5)

    def loop(i: int) -> None:
        while not stop.is_set():
            q.on_round(None)  # type: ignore[arg-type]
            puts[i] += 1
            time.sleep(0.00005)

    threads = [threading.Thread(target=loop, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    q.shutdown(0.4)
    took = time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join()
    # ~0.2 s (the drain's half, then a stop); a drain until the queue is empty (busy loop
    # threads never let it be) never returns: the bound leaves a loaded host its stalls.
    assert ex.late == 0 and not q.worker.alive and took < 2.0
    assert ex.got + q.dropped + len(q) == sum(puts) and len(q) == 0


class _Refusing:
    """Refuses (uncounted) what arrives after shutdown, as the span and requests exporters do."""

    def __init__(self, pause_s: float, closing_s: float = 0.0) -> None:
        self.pause_s, self.closing_s = pause_s, closing_s
        self.closed, self.got, self.refused = False, 0, 0

    def export(self, batch):
        time.sleep(self.pause_s)
        if self.closed:
            self.refused += len(batch)
        else:
            self.got += len(batch)

    def flush(self, timeout_s=5.0):
        return True

    def shutdown(self, timeout_s=5.0):
        self.closed = True  # refusing from here on; then its own flush, as a real one
        time.sleep(self.closing_s)


def test_a_batch_taken_as_shutdown_runs_out_of_time_is_counted():
    """The worker starved between its stop check and its take (CPU-bound loop threads): it took
    a batch after ``stop()`` had read what the exporters held and closed them, and the batch
    was neither exported nor counted. A take and its count are now one step for ``stop()``."""
    from memra_obs.export import QueueSink

    ex = _Refusing(0.05, closing_s=0.4)
    q = QueueSink([ex], interval_ms=5)
    take = q.take

    def starved(n: int):
        while not q.worker._stop:  # stop() past its drain: the worker is descheduled here
            time.sleep(0.005)
        time.sleep(0.3)  # past the join's time, while the exporters shut down
        return take(n)

    q.take = starved  # type: ignore[method-assign]
    for _ in range(10):
        q.on_round(None)  # type: ignore[arg-type]
    q.shutdown(0.2)
    q.worker._thread.join(2)
    assert ex.got + q.dropped == 10, (ex.got, ex.refused, q.dropped)


def test_a_flush_waiting_when_shutdown_stops_the_worker_returns():
    """A ``flush(5)`` (a health thread, a concurrent configure()) waiting on the worker when
    ``shutdown()`` stopped it waited its whole timeout for an answer no thread would give."""
    from memra_obs.export import QueueSink

    q = QueueSink([_Refusing(0.05)], interval_ms=5, max_batch=1)
    for _ in range(100):
        q.on_round(None)  # type: ignore[arg-type]
    took: list[float] = []

    def flush() -> None:
        t0 = time.monotonic()
        q.flush(5.0)
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=flush)
    t.start()
    time.sleep(0.1)
    q.shutdown(0.5)
    t.join(6)
    assert took and took[0] < 4.0, took  # ~0.35 s; left waiting, flush(5.0) takes 5 s


def test_what_the_noop_takes_the_real_one_takes_too(caplog):
    """Code written with everything off: ``session(stream=...)`` (an unknown keyword) and
    ``end_round(k=4)`` (j forgotten) raised TypeError into the loop once telemetry was on.
    The keyword is said once and ignored; the round is dropped, counted and said once."""
    with capture(level=1) as cap:
        obs = cap.observer
        for _ in range(2):
            with obs.session("glm5", stream=None) as s, s.burst(4) as b:
                one_round(b)
                b.begin_round()
                b.end_draft()
                b.end_verify()
                b.end_accept()
                b.end_rollback()
                b.end_round(k=4)
    assert len(cap.rounds) == 2 and obs.dropped_rounds == 2
    assert [b.phases.rounds for b in cap.bursts] == [1, 1]
    assert caplog.text.count("Observer.session(stream=...): not a keyword") == 1
    assert caplog.text.count("the round is dropped") == 1


def test_the_noop_objects_take_exactly_what_the_real_ones_take():
    """Each no-op method's parameters are the real one's: ``b.end_round(k=4, j=2, tokens=3)``,
    ``b.end_draft(0)``, ``s.end("x", 1)`` passed with everything off, then raised TypeError
    into the loop once telemetry was on. Now a wrong call fails alike, at its first run.
    (``session()``: both take any keyword, an unknown one said once by the real one.)"""
    import inspect

    from memra_obs.burst import Burst, NoOpBurst
    from memra_obs.observer import NoOpObserver, NoOpSession, Observer
    from memra_obs.ranged_burst import _RangedBurst
    from memra_obs.session import Session

    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    checked = 0
    for noop, reals in ((NoOpObserver, (Observer,)), (NoOpSession, (Session,)),
                        (NoOpBurst, (Burst, _RangedBurst))):  # fmt: skip
        for name in [
            n for n in dir(noop) if not n.startswith("_") or n in ("__enter__", "__exit__")
        ]:
            if not callable(getattr(noop, name)) or (noop, name) == (NoOpObserver, "session"):
                continue
            for real in reals:
                assert params(getattr(noop, name)) == params(getattr(real, name)), (real, name)
                checked += 1
    assert checked >= 20
    b = NOOP_OBSERVER.session("glm5").burst(4)
    with pytest.raises(TypeError):
        b.end_round(k=4, j=2, tokens=3)


def test_configure_at_run_time_never_holds_up_a_loop(caplog, monkeypatch, tmp_path):
    """A loop thread calling get_observer() while another thread's configure() shuts the old
    observer down (5 s with a collector that never answers) waited on configure()'s lock all
    that time. Now it gets the old observer, shut down: its request is a no-op, said once. A
    session still open across configure() has its later records dropped: said once too."""
    import socket
    import threading

    monkeypatch.setattr(memra_obs, "_observer", None)
    with socket.socket() as hole:  # accepts (the kernel's backlog), never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        env = {"MEMRA_OBS_SINKS": "otel", "MEMRA_OBS_METRICS_ADDR": "",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{hole.getsockname()[1]}"}  # fmt: skip
        try:
            obs = memra_obs.configure(level=0, prof=False, env=env)
            open_one = obs.session("glm5")  # in flight across configure()
            one_round(open_one.burst(4))
            with obs.session("glm5") as s:
                one_round(s.burst(4))
            t = threading.Thread(target=memra_obs.configure, kwargs={"env": {}})
            t.start()
            time.sleep(0.2)  # configure() is in the old observer's shutdown now
            worst = 0.0
            while t.is_alive():
                t0 = time.monotonic()
                with memra_obs.get_observer().session("glm5") as s:
                    one_round(s.burst(4))
                worst = max(worst, time.monotonic() - t0)
                time.sleep(0.01)
            assert worst < 2.5  # µs; a loop held by configure()'s lock waits its 5 s shutdown
            one_round(open_one.burst(4))
            open_one.end()
        finally:
            t.join(10)
            memra_obs.configure(env={})
    assert caplog.text.count("still open when its observer was shut down") == 1


def test_a_session_on_a_replaced_observer_says_so(caplog, monkeypatch):
    """The README's order: ``obs = get_observer()`` at import, ``configure(...)`` in main. The
    old observer (shut down, or the no-op) recorded later sessions nowhere, silently: now
    said once, naming get_observer(); the session stays a no-op."""
    monkeypatch.delenv("MEMRA_OBS_SINKS", raising=False)
    monkeypatch.setattr(memra_obs, "_observer", None)
    try:
        noop = memra_obs.get_observer()
        assert noop is NOOP_OBSERVER
        old = memra_obs.configure(level=1, metrics_addr="")
        for _ in range(2):
            with noop.session("glm5") as s:
                one_round(s.burst(4))
        assert caplog.text.count("replaced by configure()") == 1
        memra_obs.configure(level=1, metrics_addr="")
        assert isinstance(old, Observer) and old is not memra_obs.get_observer()
        for _ in range(2):
            with old.session("glm5") as s:
                one_round(s.burst(4))
        assert caplog.text.count("was shut down (by configure(), shutdown() or the exit)") == 1
        assert "get_observer() returns the current one" in caplog.text
        assert old.dropped_rounds == 0
    finally:
        memra_obs.configure(env={})
    caplog.clear()
    with NOOP_OBSERVER.session("glm5"):  # the no-op is the current observer again: quiet
        pass
    assert caplog.text == ""


def test_profile_calls_after_the_first_burst_are_said_not_dropped_silently(caplog):
    """The first-token profile is published when the first burst returns: a later ``lap``,
    ``add``, ``set`` or ``free_memory`` changed nothing published (lap even returned ms).
    Each is said once per kind of call and ignored; the published profile is untouched."""
    with (
        capture(level=0, prof=True, memory=lambda: [(0, 7)]) as cap,
        cap.observer.session("g") as s,
    ):
        s.lap("prime")
        with s.burst(4) as b:
            one_round(b)
        for _ in range(2):
            assert s.lap("prime") == 0.0
            s.add(prime_tap_dtoh_ms=1.0)
            s.set(draft_prime_rows=3)
            assert s.free_memory("after") == []
        assert s.spec_decode()["first_token"]["free_mb_after"] == []
    (ft,) = cap.sink.of(FirstTokenRecord)
    assert ft.prof.draft_prime_rows == 0 and ft.prof.prime_tap_dtoh_ms == 0.0
    for call in ("lap", "add", "set", "free_memory"):
        said = f"Session.{call}(...) after the first burst: the first-token profile is closed"
        assert caplog.text.count(said) == 1, call


def test_profile_calls_after_a_session_ended_without_a_burst_are_said(caplog):
    """A session ended before any burst publishes no profile: a later ``lap`` (which
    returned ms), ``add``, ``set`` or ``free_memory`` is said once each and ignored, and the
    session's record is untouched."""
    with capture(level=0, prof=True, memory=lambda: [(0, 7)]) as cap:
        s = cap.observer.session("g")
        s.end()
        assert s.lap("prime") == 0.0
        s.add(prime_tap_dtoh_ms=1.0)
        s.set(draft_prime_rows=3)
        assert s.free_memory("after") == []
    ft = s.prof
    assert (ft.prime_ms, ft.prime_tap_dtoh_ms, ft.draft_prime_rows) == (0.0, 0.0, 0)
    assert s.spec_decode()["first_token"] is None  # no profile was published
    for call in ("lap", "add", "set", "free_memory"):
        said = f"Session.{call}(...) after the session ended: the first-token profile is closed"
        assert caplog.text.count(said) == 1, call


def test_a_first_burst_of_no_round_keeps_its_published_profile():
    """A first burst that returns the anchor token alone (no round) closes the profile with
    ``first_round_tokens=0``; the next burst's first round rewrote the live profile, so
    ``spec_decode()`` said 4 where the ``[spec-prof]`` line and the requests file said 0."""
    with capture(level=0, prof=True, memory=lambda: []) as cap, cap.observer.session("g") as s:
        s.burst(4).end()
        with s.burst(4) as b:
            one_round(b, k=4, j=3)
    (ft,) = cap.first_tokens
    assert ft.prof.first_round_tokens == 0 and ft.prof == s.prof
    assert s.spec_decode()["first_token"]["first_round_tokens"] == 0


def test_a_family_that_is_not_a_name_is_said_and_recorded_under_the_default(caplog):
    """``session("")`` (or None, or 7): said once, and the request recorded under the default
    family ``spec``, lines and metrics alike (its rounds went to family="unknown" and
    counted an export error, silently)."""
    from prometheus_client import CollectorRegistry

    from memra_obs.prom import PrometheusExporter

    with capture(level=1) as cap:
        for bad in ("", None, 7):
            with cap.observer.session(bad) as s, s.burst(4) as b:  # type: ignore[arg-type]
                one_round(b)
    assert {x.family for x in cap.sessions} == {"spec"}
    assert sum(x.startswith("[spec-phase] rounds=1 ") for x in cap.lines) == 3
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    ex.export(cap.sink.records)
    assert reg.get_sample_value("memra_spec_rounds_total", {"family": "spec"}) == 3
    assert ex.export_errors == 0
    assert caplog.text.count("Observer.session(family=''): expected a non-empty str") == 1
    assert caplog.text.count("expected a non-empty str") == 3  # once per value


def test_each_family_renamed_is_said_once_by_its_name(caplog):
    """After one bad family was said, every later one was renamed unsaid (one said-once key
    for all): a second model's ``"qwen 2"`` series appeared as ``qwen_2``, a ``None`` from an
    unset config field merged into ``spec``, and nothing told the user."""
    with capture(level=0) as cap:
        for fam in ("llama 3", "qwen 2", 42, None, "llama 3"):
            with cap.observer.session(fam) as s, s.burst(4) as b:  # type: ignore[arg-type]
                one_round(b)
    assert [x.family for x in cap.sessions] == ["llama_3", "qwen_2", "spec", "spec", "llama_3"]
    for said in ("family='llama 3'): a legacy tag", "family='qwen 2'): a legacy tag",
                 "family=42): expected", "family=None): expected"):  # fmt: skip
        assert caplog.text.count(said) == 1, said


def test_a_family_its_own_lines_could_not_carry_is_said_and_made_taggable(caplog):
    """``session("a b")`` (or ``"x]"``, a tab, a custom tag with a space): the lines
    ``[a b-phase] ...`` did not parse back, so the tail and the report passed them off as
    another program's output. Said once; the request is recorded as ``a_b`` everywhere, and
    its lines parse back."""
    from memra_obs.legacy import parse_line

    with capture(level=2) as cap:
        fams = (("a b", None), ("x]", None), ("t\tab", None), ("ok", "my tag"), ("spec-prof", None))
        for fam, tag in fams:
            with cap.observer.session(fam, tag=tag) as s, s.burst(4) as b:
                one_round(b)
    assert [x.family for x in cap.sessions] == ["a_b", "x_", "t_ab", "ok", "xspec-prof"]
    tags = [parse_line(x).tag for x in cap.lines if x.startswith("[")]  # every line parses
    assert {"a_b-phase", "x_-phase", "t_ab-phase", "my_tag", "ok-phase-v"} <= set(tags)
    assert "xspec-prof-phase" in tags  # a phase line under [spec-prof...] is refused as its own
    assert caplog.text.count("Observer.session(family='a b'): a legacy tag holds") == 1
    assert caplog.text.count("Observer.session(tag='my tag'): a legacy tag holds") == 1


def test_a_family_with_an_undecodable_byte_is_made_taggable_and_metrics_still_encode(caplog):
    """``session(os.fsdecode(b"llama-\\xff"))`` (a model directory's name): its surrogate made
    every ``/metrics`` scrape fail to encode (HTTP 500 for good, the app's own series too) and
    the agent's ring refuse the session. Said once; recorded as ``llama-_`` everywhere."""
    from prometheus_client import CollectorRegistry, generate_latest

    from memra_obs.legacy import parse_line
    from memra_obs.prom import PrometheusExporter, encode

    fam = os.fsdecode(b"llama-\xff")
    with capture(level=2) as cap, cap.observer.session(fam) as s, s.burst(4) as b:
        one_round(b)
    assert [x.family for x in cap.sessions] == ["llama-_"]
    assert {parse_line(x).tag for x in cap.lines if x.startswith("[")} >= {"llama-_-phase"}
    assert caplog.text.count("or undecodable byte") == 1
    reg = CollectorRegistry()
    PrometheusExporter(reg).export(cap.sink.records)
    assert reg.get_sample_value("memra_spec_rounds_total", {"family": "llama-_"}) == 1
    assert encode(reg, "")[0] == generate_latest(reg)


def test_a_family_or_tag_too_long_for_its_lines_is_cut_and_said(caplog):
    """A family of 57+ characters made ``[<family>-phase-v]`` longer than the 64 characters the
    tail and the report take: the worker's own lines were refused by its own tail. The family
    is cut to 56 (a custom tag to 64), said once, and every line parses back."""
    from memra_obs.legacy import parse_line

    with capture(level=2) as cap:
        for fam, tag in (("f" * 80, None), ("ok", "t" * 70)):
            with cap.observer.session(fam, tag=tag) as s, s.burst(4) as b:
                one_round(b)
    assert [x.family for x in cap.sessions] == ["f" * 56, "ok"]
    tags = {parse_line(x).tag for x in cap.lines if x.startswith("[")}  # every line parses
    assert {"f" * 56 + "-phase", "f" * 56 + "-phase-v", "t" * 64} <= tags
    assert caplog.text.count("a family at most 56") == 1
    assert caplog.text.count("Observer.session(tag='" + "t" * 70) == 1


def test_legacy_lines_hold_no_tags_of_sessions_never_ended(caplog):
    """Sessions never ended (no ``with``, a client gone): the stderr sink kept each one's tags
    forever (~120 B a session); it now keeps at most ``max_sessions``, as the span builder
    and the Prometheus exporter bound theirs."""
    with capture(level=1) as cap:
        stderr = cap.observer.sinks[0]
        for _ in range(stderr.max_sessions + 100):
            one_round(cap.observer.session("glm5").burst(4))
        assert len(stderr._tags) == stderr.max_sessions
        with cap.observer.session("glm5") as s, s.burst(4) as b:
            one_round(b)
    assert cap.lines[-1].startswith("[glm5-phase] rounds=1")
    assert caplog.text.count("over 4096 sessions not ended") == 1


def test_legacy_tags_trimmed_by_loop_threads_at_once_never_raise():
    """Loop threads starting sessions at once past the bound picked the same oldest tag: the
    second ``del`` raised KeyError, so that session kept no tag (its lines said
    ``spec-phase``) and the table stayed over its bound for good."""
    sink, ids, raised = StderrSink(level=1), itertools.count(1), []
    sink.max_sessions = 64

    def start_sessions() -> None:
        for _ in range(5000):
            rec = SessionRecord(
                next(ids), "f", "f-phase", "f-phase-v", "w", 0, 0, 0, 0, 0, 0, 1, False
            )
            try:
                sink.on_session(rec)
            except Exception as exc:
                raised.append(exc)

    threads = [threading.Thread(target=start_sessions) for _ in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, as many busy loop threads do
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    sink.on_session(SessionRecord(0, "f", "g-phase", "g-phase-v", "w", 0, 0, 0, 0, 0, 0, 1, False))
    assert raised == [] and len(sink._tags) == sink.max_sessions


MP_SCRIPT = """
import multiprocessing as mp, sys, memra_obs

def serve(fam):
    obs = memra_obs.get_observer()
    for _ in range(5):
        with obs.session(fam) as s, s.burst(2) as b:
            b.begin_round(); b.end_draft(); b.end_verify(); b.end_accept(); b.end_rollback()
            b.end_round(k=2, j=1)

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    memra_obs.get_observer()  # the parent's, before its children start
    procs = [ctx.Process(target=serve, args=(f"child{i}",)) for i in range(2)]
    for p in procs:
        p.start()
    pool = ctx.Pool(1)  # close + join: its worker exits (a with block terminates it)
    pool.map(serve, ["pool"])
    pool.close()
    pool.join()
    for p in procs:
        p.join()
    serve("parent")
"""


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_multiprocessing_children_publish_what_they_recorded(tmp_path, method):
    """multiprocessing's fork and forkserver children end in ``os._exit``, past atexit: they
    published nothing of what was still queued (a short-lived worker: everything), and
    counted none of it. Their exit now flushes, as a process's exit does."""
    import collections
    import json
    import subprocess

    script, spans = tmp_path / "mp.py", tmp_path / "spans.jsonl"
    script.write_text(MP_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(MEMRA_OBS_SINKS="otel", MEMRA_OBS_SPANS_FILE=str(spans), MEMRA_OBS_METRICS_ADDR="")
    env["MEMRA_OBS_EXPORT_INTERVAL_MS"] = "60000"  # nothing leaves before the exit's flush
    subprocess.run([sys.executable, str(script), method], env=env, check=True, timeout=120,
                   cwd=tmp_path)  # fmt: skip
    families: collections.Counter[str] = collections.Counter()
    for line in spans.read_text().splitlines():
        for sp in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            if sp["name"] == "spec.session":
                attrs = {a["key"]: a["value"] for a in sp["attributes"]}
                families[attrs["memra.spec.family"]["stringValue"]] += 1
    assert families == {"child0": 5, "child1": 5, "pool": 5, "parent": 5}


def test_the_observer_imports_what_a_first_session_needs_when_it_is_built():
    """The first session() imported opentelemetry.trace: a fork() from another thread while it
    did left the module's import lock held in the child, whose sessions then blocked for ever.
    Built, the observer has imported it; the loop's first session imports nothing."""
    import subprocess
    import sys

    script = (
        "import sys, memra_obs\n"
        "assert 'opentelemetry.trace' not in sys.modules\n"
        "obs = memra_obs.configure(level=0, prof=False, sinks='prometheus', metrics_addr='')\n"
        "assert 'opentelemetry.trace' in sys.modules\n"
        "before = set(sys.modules)\n"
        "obs.session('glm5').end()\n"
        "assert set(sys.modules) == before, sorted(set(sys.modules) - before)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr


def test_misuse_with_a_new_name_each_time_is_bounded(caplog):
    """``s.lap(f"step_{i}")`` in a loop: each new name was said, and kept as a key, for ever
    (200,000 lines and +21 MB); then it spent the bound of distinct reports, MAX_SAID, and
    every later problem of the process (a full queue, a failed export) went unsaid. A misuse
    says its first names, then that more are not; other things are still said; keys of no
    kind stop at MAX_SAID, the bound said once."""
    from memra_obs import diagnostics

    diagnostics.reset()
    with capture(level=0, prof=True) as cap:
        s = cap.observer.session("glm5")
        for i in range(diagnostics.MAX_SAID + 500):
            s.lap(f"step_{i}")
            s.add(**{f"x{i}_ms": 1.0})
        with s.burst(4):
            s.lap("anchor")  # another misuse of lap(): said, whatever came before
        s.end()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 * (diagnostics.PER_KIND + 1) + 1, said
    assert sum(m.endswith("more are not)") for m in said) == 2
    assert said[-1].startswith("Session.lap('anchor') inside a burst")
    diagnostics.say_once("queue-full:1", "record queue full")
    assert caplog.records[-1].getMessage() == "record queue full"
    for i in range(diagnostics.MAX_SAID + 500):
        diagnostics.say_once(f"key:{i}", f"thing {i}")
    said = [r.getMessage() for r in caplog.records]
    assert len(diagnostics._said) == diagnostics.MAX_SAID + 1
    assert sum("different things said; new ones are not" in m for m in said) == 1


def test_a_tag_that_is_not_a_str_is_said_and_the_default_used(caplog):
    """``tag=b"glm5"`` printed ``[b'glm5'] ...`` lines that parse back to nothing, so the tail
    and the report skipped them without a word."""
    bad: dict = {"tag": b"glm5", "tag_v": 7}
    with capture(level=2) as cap, cap.observer.session("glm5", **bad) as s, s.burst(4) as b:
        one_round(b)
    assert {parse_line(x).tag for x in cap.lines if x.startswith("[")} >= {
        "glm5-phase",
        "glm5-phase-v",
    }
    assert caplog.text.count("Observer.session(tag=b'glm5'): expected a str") == 1
    assert caplog.text.count("Observer.session(tag_v=7): expected a str") == 1


def _walked_rounds(obs, n):
    with obs.session("glm5") as s, s.burst(4) as b:
        for _ in range(n):
            b.begin_round()
            b.end_draft()
            VERIFY_SPLIT.add(kda=1_000, mla=500)
            SEQ_ROWS.add(2)
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=2)


def test_what_an_earlier_observer_left_undrained_lands_in_no_round():
    """Serving with everything off (or at level 1), then level 2 or the profile turned on: the
    first round carried the process's whole history of the walk's adds (a bogus vkda, a huge
    seq_rows; past 2**32 rows, the round dropped), not its own."""
    _walked_rounds(NOOP_OBSERVER, 100)
    with capture(level=1) as cap:
        _walked_rounds(cap.observer, 100)
    _walked_rounds(NOOP_OBSERVER, 100)
    with capture(level=2, prof=True) as cap:
        _walked_rounds(cap.observer, 2)
    assert [r.split_ns for r in cap.rounds] == [(1_000, 0, 500, 0)] * 2
    assert [r.seq_rows for r in cap.rounds] == [2, 2]


def test_a_configure_refused_leaves_the_current_observer_serving(monkeypatch):
    """A bad knob raised ConfigError only after the working observer was shut down: from then
    on every session recorded nothing."""
    monkeypatch.setattr(memra_obs, "_observer", None)
    obs = memra_obs.configure(level=1, sinks="")
    try:
        with pytest.raises(ConfigError, match="queue_size"):
            memra_obs.configure(level=1, queue_size=5)
        assert memra_obs.get_observer() is obs and not obs._closed
        assert type(obs.session("glm5")).__name__ == "Session"
    finally:
        memra_obs.get_observer().shutdown()


def test_numpy_counts_and_sizes_are_taken_as_python_numbers(caplog):
    """``s.set(draft_prime_rows=np.int64(5), draft_kv_mb=np.float32(3.0))`` (a CuPy ``.get()``,
    a numpy sum) was refused and the value lost, while ``add`` and the walk's accumulators took
    numpy; a wrong ``draft_kv_mb`` was said to want milliseconds."""
    np = pytest.importorskip("numpy")
    with capture(level=0, prof=True) as cap, cap.observer.session("g") as s:
        s.set(draft_prime_rows=np.int64(5), draft_kv_mb=np.float32(3.0))
        s.add(prime_tap_dtoh_ms=np.float32(0.5))
        s.set(draft_kv_mb="3 MB", draft_prime_chunks=np.True_)
        with s.burst(4) as b:
            one_round(b)
    (ft,) = cap.sink.of(FirstTokenRecord)
    p = ft.prof
    assert (p.draft_prime_rows, p.draft_kv_mb, p.prime_tap_dtoh_ms) == (5, 3.0, 0.5)
    assert type(p.draft_prime_rows) is int and type(p.draft_kv_mb) is float
    assert "draft_kv_mb must be a number of MB, got str '3 MB'" in caplog.text
    assert p.draft_prime_chunks == 0 and "draft_prime_chunks must be an int" in caplog.text


@pytest.mark.parametrize("how", ["requests_file", "spans_file", "otel_env"])
def test_a_configure_refused_for_a_file_or_otel_value_leaves_the_observer_serving(
    monkeypatch, tmp_path, how
):
    """A requests/spans file that cannot be opened, or an OTEL_* value no exporter can use,
    raised ConfigError only after the working observer was shut down (every later session a
    no-op), and left the requests file's descriptor open."""
    monkeypatch.setattr(memra_obs, "_observer", None)
    obs = memra_obs.configure(level=1, sinks="")
    kw: dict = {
        "requests_file": dict(requests_file=str(tmp_path / "no" / "r.jsonl")),
        "spans_file": dict(sinks="otel", spans_file=str(tmp_path / "no" / "s.jsonl"), env={}),
        "otel_env": dict(sinks="otel", requests_file=str(tmp_path / "r.jsonl"),
                         env={"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "x"}),
    }[how]  # fmt: skip
    fds = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(ConfigError):
            memra_obs.configure(level=1, **kw)
        assert memra_obs.get_observer() is obs and not obs._closed
        assert type(obs.session("glm5")).__name__ == "Session"
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        memra_obs.get_observer().shutdown()


@pytest.mark.parametrize(
    "kw",
    [{"family": "spec-prof"}, {"family": "spec-tracer"}, {"family": "glm5", "tag": "spec-trace"},
     {"family": "glm5", "tag": "spec-prof-rounds"}, {"family": "glm5", "tag_v": "spec-advice"}],
)  # fmt: skip
def test_a_tag_under_the_parsers_own_prefixes_is_said_and_its_lines_parse_back(kw, caplog):
    """``session("spec-prof")`` wrote ``[spec-prof-phase] ...``, which the parser refuses as an
    unknown tag of its own: the tail counted the worker's lines malformed."""
    with capture(level=2) as cap, cap.observer.session(**kw) as s, s.burst(4) as b:
        one_round(b)
    lines = [x for x in cap.lines if x.startswith("[")]
    assert any(parse_line(x).tag.startswith("xspec-") for x in lines)
    assert [type(parse_line(x)).__name__ for x in lines] == ["PhaseLine", "VerifyLine"]
    assert "starts with none of spec-prof, spec-trace, spec-advice" in caplog.text


def test_a_first_burst_cut_before_any_round_publishes_no_first_token():
    """A client gone (an asyncio cancel) during round 1 of the first burst: no token went out,
    yet the cut burst was published as the first one, so the request's time to the cancel
    became a TTFT (``[spec-prof]``, ``memra_spec_first_token_seconds``) and the session said
    one token served. A session that goes on after such a cut profiles its next burst."""

    async def request(obs, started):
        with obs.session("glm5") as s:
            s.lap("prime")
            b = s.burst(4)
            b.begin_round()
            b.end_draft()
            started.set()
            await asyncio.sleep(10)  # verify on the device when the client goes away

    async def serve(obs):
        started = asyncio.Event()
        task = asyncio.create_task(request(obs, started))
        await started.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with capture(level=1, prof=True) as cap:
        asyncio.run(serve(cap.observer))
        with cap.observer.session("glm5") as s:
            with contextlib.suppress(RuntimeError), s.burst(4) as b:
                raise RuntimeError("CUDA out of memory")  # the loop retries the burst
            with s.burst(4) as b:
                one_round(b)
    assert [(e.error, e.tokens, e.rounds) for e in cap.ends] == [
        ("asyncio.exceptions.CancelledError", 0, 0), ("", 4, 1)
    ]  # fmt: skip
    (ft,) = cap.first_tokens
    assert ft.session == cap.ends[1].session
    assert (ft.prof.first_burst_rounds, ft.prof.first_burst_tokens) == (1, 4)
    assert sum(x.startswith("[spec-prof] ") for x in cap.lines) == 1


def test_an_exception_out_of_the_loop_is_re_raised_and_not_said_as_misuse(caplog):
    """A CUDA OOM (or a CancelledError) leaving a round half-done through the README's loop
    (``b.end()`` after the rounds) or a ``with`` burst: re-raised unchanged, recorded as the
    session's error, the open round dropped and counted; no "boundary out of order" message
    sent the engineer hunting a misuse that was not there."""
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with capture(level=1) as cap:
        for use_with in (False, True):
            with pytest.raises(RuntimeError) as got, cap.observer.session("glm5") as s:
                b = s.burst(4)
                with b if use_with else contextlib.nullcontext():
                    one_round(b)
                    b.begin_round()
                    b.end_draft()
                    raise oom
            assert got.value is oom
        s = cap.observer.session("glm5")  # no `with`: the loop ends it with its exception
        b = s.burst(4)
        one_round(b)
        b.begin_round()
        s.end(oom)
    assert [e.error for e in cap.ends] == [f"RuntimeError: {oom}"] * 3
    assert [b.phases.rounds for b in cap.bursts] == [1, 1, 1]
    assert cap.observer.dropped_rounds == 3
    assert [x.split(" k=")[0] for x in cap.lines] == ["[glm5-phase] rounds=1"] * 3
    assert not [r for r in caplog.records if r.name == "memra_obs"], caplog.text


def test_a_session_ended_by_a_cancel_and_its_loop_at_once_ends_once():
    """A server thread ends the session (a cancel) while its loop leaves ``with s:``: both got
    past the ended check while the open burst published, so two end records went out, the
    first before the burst's first token (requests file ``first_token: null``, no
    ``spec.first_token`` spans, ``[spec-prof-summary]`` before ``[spec-prof]``)."""
    from memra_obs.sinks.base import Sink
    from memra_obs.timeline import SessionEndRecord

    publishing, done = threading.Event(), threading.Event()

    class Slow(Sink):  # the canceller is still publishing the open burst
        def on_burst(self, rec):
            if threading.current_thread().name == "server":
                publishing.set()
                done.wait(5)

    with capture(level=1, prof=True, sinks=[Slow()]) as cap:
        s = cap.observer.session("glm5")
        one_round(s.burst(4))
        th = threading.Thread(target=s.end, name="server")
        th.start()
        assert publishing.wait(5)
        s.end()  # the loop's own end
        done.set()
        th.join()
        kinds = [type(r) for r in cap.records]
        lines = [ln.split("]")[0] for ln in cap.lines]
    assert kinds.count(SessionEndRecord) == 1 and kinds[-1] is SessionEndRecord
    assert kinds.index(FirstTokenRecord) < kinds.index(SessionEndRecord)
    assert lines.index("[spec-prof") < lines.index("[spec-prof-summary")


def test_a_misplaced_drafter_prime_lap_is_not_charged_to_the_next_bucket(stepping_clock):
    """A ``draft_prime`` lap before any burst drains and moves the profile's boundary: what
    ran before it stays in unattributed_ms, not in the next creation bucket."""
    with capture(level=0, prof=True, memory=list) as cap, cap.observer.session("g") as s:
        s.lap("cache_alloc")
        stepping_clock.advance(0.03)  # 30 ms of work: prime_ms would read 30 ms, not µs
        assert s.lap("draft_prime") == 0.0
        s.lap("prime")
        with s.burst(4) as b:
            one_round(b)
    (ft,) = cap.sink.of(FirstTokenRecord)
    assert ft.prof.prime_ms < 30.0 <= ft.prof.unattributed_ms


def test_round_one_buckets_start_at_the_round_and_after_the_drafter_prime():
    """Round 1's drafter prime starts at ``begin_round`` (not at the last creation lap: burst
    set-up is no prime), and ``first_draft`` starts where the prime ended (not counted twice)."""
    with capture(level=1, prof=True, memory=list) as cap, cap.observer.session("g") as s:
        s.lap("anchor")
        time.sleep(0.005)
        with s.burst(4) as b:
            b.begin_round()
            time.sleep(0.005)
            s.lap("draft_prime")
            for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
                end()
            b.end_round(k=4, j=2)
    (ft,) = cap.sink.of(FirstTokenRecord)
    (rnd,) = cap.rounds
    iv = {name: (a, z) for name, a, z in ft.intervals}
    assert iv["draft_prime"][0] == rnd.t_ns_mono[0] > iv["anchor"][1]
    assert iv["first_draft"] == (iv["draft_prime"][1], rnd.t_ns_mono[1])
    assert ft.prof.first_draft_ms == (rnd.t_ns_mono[1] - iv["draft_prime"][1]) / 1e6


def test_laps_adds_and_sets_land_only_in_their_own_fields(caplog):
    """``lap`` returns what it added; ``add`` accumulates into share buckets only, ``set``
    sets geometry only; a name of neither (a creation bucket to ``add``, a made-up bucket to
    ``lap``, a bad ``free_memory`` point) is said and changes nothing, raising nothing."""
    with (
        capture(level=0, prof=True, memory=lambda: [(0, 7)]) as cap,
        cap.observer.session("g") as s,
    ):
        ms = s.lap("prime") + s.lap("prime")
        for name in ("bogus", "first_burst", "unattributed"):
            assert s.lap(name) == 0.0
        s.add(prime_tap_dtoh_ms=1.5)
        s.add(prime_tap_dtoh_ms=1.5, prime_ms=5.0)
        s.set(draft_prime_rows=3, draft_prime_ms=9.0)
        assert s.free_memory("middle") == []
        assert s.free_memory("before") == [(0, 7)]
        with s.burst(4) as b:
            one_round(b)
    (ft,) = cap.sink.of(FirstTokenRecord)
    p = ft.prof
    assert p.prime_ms == ms and p.prime_tap_dtoh_ms == 3.0 and p.draft_prime_rows == 3
    assert p.draft_prime_ms == 0.0 and p.free_mb_before == [(0, 7)]
    names = [name for name, _, _ in ft.intervals]
    assert names[:2] == ["prime", "prime"] and names.count("first_burst") == 1
    assert not {"bogus", "unattributed"} & set(names)
    assert "Session.add(prime_ms=...): not one of" in caplog.text
    assert "Session.set(draft_prime_ms=...): not one of" in caplog.text
    assert "Session.free_memory('middle'): use 'before' or 'after'" in caplog.text


def test_a_phase_clock_that_fails_to_start_falls_back_to_the_sync_clock(caplog):
    """A clock factory that raises (no CUDA events) never raises into the loop: the session
    runs on the sync clock, said once."""

    def broken(e, eh):
        raise RuntimeError("no events")

    with capture(level=1, clock=broken) as cap:
        for _ in range(2):
            with cap.observer.session("g", e=SimStream()) as s, s.burst(4) as b:
                one_round(b)
    assert len(cap.rounds) == 2 and [r.clock for r in cap.sessions] == ["sync", "sync"]
    assert caplog.text.count("the phase clock failed to start") == 1


def test_the_profile_starts_after_the_work_queued_before_the_session(stepping_clock):
    """The profile's start drains the streams: work queued before the session (the previous
    request's) is in no bucket of this one."""
    e = SteppedStream(stepping_clock)
    with capture(level=0, prof=True, memory=list) as cap:
        e.enqueue(0.05)
        with cap.observer.session("g", e=e) as s:
            s.lap("cache_alloc")
            with s.burst(4) as b:
                one_round(b)
    (ft,) = cap.sink.of(FirstTokenRecord)
    # µs; an undrained start leaves cache_alloc the 50 ms less the clock reads before it
    assert ft.prof.cache_alloc_ms < 25.0


def test_the_record_so_far_carries_the_live_profile_and_the_loops_own_hook_share():
    """Before the first burst returns, ``spec_decode()`` shows the profile so far (None only
    once the session ended without one); hook time the loop added itself is kept beside the
    burst's own ``hook()`` time, not replaced by it."""
    with capture(level=0, prof=True, memory=list) as cap, cap.observer.session("g") as s:
        ms = s.lap("prime")
        assert s.spec_decode()["first_token"]["prime_ms"] == ms
        s.add(first_burst_hook_ms=2.0)
        with s.burst(4) as b:
            with b.hook():
                time.sleep(0.001)
            one_round(b)
    (ft,) = cap.sink.of(FirstTokenRecord)
    (burst,) = cap.bursts
    assert burst.hook_ns > 0
    assert ft.prof.first_burst_hook_ms == pytest.approx(2.0 + burst.hook_ns / 1e6)


def test_a_session_names_its_phase_clock_and_whether_it_profiles():
    """``clock`` on the session record: "host" with no stream at all, else the clock that
    drains it ("sync", "event"); ``prof`` is whether the first-token profile is on."""
    with capture(level=1, clock="event") as cap:
        for kw in ({}, {"e": SimStream()}, {"eh": SimStream()}):
            cap.observer.session("g", **kw).end()
    with capture(level=1, prof=True, memory=list) as pcap:
        for kw in ({"e": SimStream()}, {"eh": SimStream()}):
            pcap.observer.session("g", **kw).end()
    assert [(r.clock, r.prof) for r in cap.sessions] == [("host", False), *[("event", False)] * 2]
    assert [(r.clock, r.prof) for r in pcap.sessions] == [("sync", True)] * 2


def test_bursts_of_every_k_a_loop_drafts_are_recorded():
    """k = 0 (a plain decode step) and k = 65535 (the u16 top) are bursts like any other."""
    with capture(level=1) as cap, cap.observer.session("g") as s:
        for k in (0, 65535):
            with s.burst(k) as b:
                one_round(b, k=k, j=0)
    assert [(r.k, r.j) for r in cap.rounds] == [(0, 0), (65535, 0)]


def test_the_session_advice_explores_past_the_longest_draft_and_takes_the_plain_step():
    """The ``[spec-advice]`` a session ends with may recommend up to EXPLORE past the longest
    draft it ran (every draft accepted: k 2 -> 4), prices the plain step from the settings'
    ``plain_step_ms`` when measured, and is the one on the summary and on the end record."""
    from types import SimpleNamespace

    from memra_obs.records import SpecRoundProf

    lines = []
    for settings in (None, SimpleNamespace(plain_step_ms=4.0)):
        with capture(level=0, prof=True, memory=list, settings=settings) as cap:
            s = cap.observer.session("g")
            for i in range(200):
                k = 1 + i % 2
                d, v = 0.05 * k + i % 3 * 0.003, 5.0 + 0.1 * k + i % 5 * 0.01
                s.log.rounds.append(SpecRoundProf(d + v + 0.2, d, v, 0.1, 0.1, k, k, 100, 0))
            s.end()
        (summary,), (end,) = cap.summaries, cap.ends
        assert end.advice == summary.advice
        lines.append(summary.advice)
    assert " k_rec=4 " in lines[0] and "(verify_fit)" in lines[0]
    assert "plain_step_ms=4.000 " in lines[1]


def test_the_session_summary_names_its_slow_rounds():
    """The end's ``[spec-prof-summary]`` record counts the rounds past 1.5x the median."""
    from memra_obs.records import SpecRoundProf

    with capture(level=0, prof=True, memory=list) as cap:
        s = cap.observer.session("g")
        for wall in (5.0, 5.0, 5.0, 9.0):
            s.log.rounds.append(SpecRoundProf(wall, 1.0, wall - 2.0, 0.5, 0.5, 2, 1, 100, 0))
        s.end()
    (summary,) = cap.summaries
    assert summary.slow_rounds == 1


def test_a_drafter_prime_lapped_between_rounds_is_said_and_ignored(caplog):
    """``lap("draft_prime")`` inside the first burst but after its round ended (no round
    open): said and ignored, not a bucket from the last creation lap over the whole round."""
    with capture(level=0, prof=True, memory=list) as cap, cap.observer.session("g") as s:
        s.lap("anchor")
        with s.burst(4) as b:
            one_round(b)
            assert s.lap("draft_prime") == 0.0
            one_round(b)
    (ft,) = cap.sink.of(FirstTokenRecord)
    assert ft.prof.draft_prime_ms == 0.0
    assert "Session.lap('draft_prime') outside round 1's draft" in caplog.text


@pytest.mark.parametrize("clock", ["sync", "event"])
def test_a_drafter_prime_lapped_in_a_later_round_or_after_the_draft_is_ignored(caplog, clock):
    """In round 2's draft, or in round 1 after ``end_draft()``: said and ignored. Taken, it
    clamped round 1's ``first_draft_ms`` to 0 with an interval ending before it began, or
    counted the verify's time twice (in ``draft_prime_ms`` and ``first_verify_ms``)."""
    e = SimStream() if clock == "event" else None
    with capture(level=0, prof=True, memory=list) as cap:
        for late in ("round 2", "after end_draft"):
            with cap.observer.session("g", e=e) as s, s.burst(4) as b:
                b.begin_round()
                time.sleep(0.002)
                b.end_draft()
                if late == "after end_draft":
                    time.sleep(0.002)
                    assert s.lap("draft_prime") == 0.0
                b.end_verify()
                b.end_accept()
                b.end_rollback()
                b.end_round(k=4, j=2)
                b.begin_round()
                if late == "round 2":
                    time.sleep(0.002)
                    assert s.lap("draft_prime") == 0.0
                for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
                    end()
                b.end_round(k=4, j=2)
    for ft in cap.sink.of(FirstTokenRecord):
        assert ft.prof.draft_prime_ms == 0.0 and ft.prof.first_draft_ms >= 1.9
        assert all(a <= z for _, a, z in ft.intervals), ft.intervals
    assert caplog.text.count("Session.lap('draft_prime') outside round 1's draft") == 1


def test_num_spec_tokens_is_the_largest_burst_k_not_the_last():
    """A burst of k=4 whose rounds the gate cut to 3, then a burst of k=2: the request's
    ``num_spec_tokens`` is 4 (the configured draft length), not the last burst's."""
    with capture(level=1) as cap, cap.observer.session("g") as s:
        with s.burst(4) as b:
            one_round(b, k=3, j=1)
        with s.burst(2) as b:
            one_round(b, k=2, j=1)
        assert s.spec_decode()["num_spec_tokens"] == 4


def test_a_generator_closed_early_is_no_error():
    """A streaming generator holding ``with obs.session(...)`` whose consumer stopped reading
    (``g.close()``: GeneratorExit) ended the session as failed: ERROR status and
    error.type=GeneratorExit on every early close, where the SDK's own spans say nothing."""
    with capture(level=1) as cap:

        def stream(obs):
            with obs.session("glm5") as s:
                for _ in range(10):
                    with s.burst(4) as b:
                        one_round(b)
                    yield "tok"

        g = stream(cap.observer)
        next(g), next(g)
        g.close()

        def manual(obs):  # a burst without `with`, open when the consumer stops
            with obs.session("glm5") as s:
                b = s.burst(4)
                b.begin_round()
                yield "tok"

        g = manual(cap.observer)
        next(g)
        g.close()
        said = set(memra_obs.diagnostics._said)
    assert [(e.error, e.rounds) for e in cap.ends] == [("", 2), ("", 0)]
    assert cap.observer.dropped_rounds == 1 and "burst-open-end" not in said  # cut, unsaid


def test_error_type_is_qualified_by_its_module():
    """semconv's error.type: the class "within the artifact" (torch.OutOfMemoryError and a
    CuPy or user class of the same name were one value); a builtin stays bare."""
    OutOfMemoryError = type("OutOfMemoryError", (RuntimeError,), {"__module__": "torch"})
    with capture(level=0) as cap:
        for exc in (OutOfMemoryError("CUDA out of memory"), ValueError("x")):
            with contextlib.suppress(Exception), cap.observer.session("glm5"):
                raise exc
    assert [e.error for e in cap.ends] == [
        "torch.OutOfMemoryError: CUDA out of memory",
        "ValueError: x",
    ]


def test_a_round_whose_session_a_cancel_ended_during_its_drain_is_dropped_and_counted():
    """The sync clock drains at end_round with the GIL released: a cancel from the handler's
    thread ended the session meanwhile, then the round was published after the end record
    (family="unknown" on /metrics, no span, not in the request) and the loop's own
    ``b.end()`` was said as a misuse ("called twice")."""
    in_drain, cancelled = threading.Event(), threading.Event()

    class Stream:
        n = 0

        def synchronize(self) -> None:
            Stream.n += 1
            if Stream.n == 6:  # round 1's end_round() drain
                in_drain.set()
                cancelled.wait(5)

    said: list[str] = []
    with capture(level=1) as cap:
        s = cap.observer.session("glm5", e=Stream())

        def loop() -> None:
            b = s.burst(4)
            one_round(b, k=4, j=3)
            b.end()

        th = threading.Thread(target=loop)
        th.start()
        assert in_drain.wait(5)
        s.end(RuntimeError("client disconnected"))
        cancelled.set()
        th.join(5)
        said = [r for r in memra_obs.diagnostics._said if "burst-end" in r]
        dropped = cap.observer.dropped_rounds
    ends = [i for i, r in enumerate(cap.sink.records) if type(r).__name__ == "SessionEndRecord"]
    assert not cap.rounds and ends == [len(cap.sink.records) - 1], cap.sink.records
    assert dropped == 1 and cap.ends[0].rounds == 0 and said == []


def test_values_said_by_kind_keep_the_budget_for_everything_else(caplog):
    """A family per request (``f"chat req{i}"``, renamed) said each one: 1,024 lines, then the
    budget of things said was spent and a later misuse went unsaid for the process's life.
    The first few of a kind are said, then that more are not; other warnings still come."""
    with capture(level=0) as cap:
        for i in range(40):
            with cap.observer.session(f"chat req{i}") as s, s.burst(4) as b:
                one_round(b)
        with cap.observer.session("glm5") as s, s.burst(4) as b:
            b.end_round(k=4, j=1)  # no open round: a misuse
    renamed = [r.getMessage() for r in caplog.records if "a legacy tag holds" in r.getMessage()]
    assert len(renamed) == 9 and renamed[-1].endswith("(9 of this kind said: more are not)")
    assert any("Burst.end_round() after no open round" in r.getMessage() for r in caplog.records)
