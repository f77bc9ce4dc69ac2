"""The observer: records in order, the seed's lines from live rounds, the no-op path,
failing sinks, misuse, threads."""

from __future__ import annotations

import re
import threading
import time

import pytest
from held import Held

import memra_obs
from memra_obs.demo import SimStream
from memra_obs.export import QueueSink
from memra_obs.legacy import (
    FirstTokenLine,
    PhaseLine,
    RoundsLine,
    SummaryLine,
    VerifyLine,
    parse_line,
)
from memra_obs.observer import NOOP_OBSERVER, Observer
from memra_obs.records import SeqRows, VerifySplit
from memra_obs.sinks.base import Sink
from memra_obs.testing import RecordingSink, capture
from memra_obs.timeline import (
    BurstRecord,
    FirstTokenRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)


def run_rounds(s, n, k=4, j=2, prime=False, work=None):
    b = s.burst(k)
    for i in range(n):
        b.begin_round()
        if prime and i == 0:
            s.lap("draft_prime")
        for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
            if work:
                work()
            end()
        b.end_round(k=k, j=j, ctx=100 + i)
    b.end()
    return b


def test_get_observer_is_the_noop_when_everything_is_off(monkeypatch):
    """No flags, no sinks: the process observer is the no-op and every call is free."""
    monkeypatch.delenv("MEMRA_OBS_SINKS", raising=False)
    monkeypatch.setattr(memra_obs, "_observer", None)
    obs = memra_obs.get_observer()
    assert obs is NOOP_OBSERVER and not obs.enabled
    with obs.session("glm5") as s:
        assert s.lap("prime") == 0.0
        run_rounds(s, 3)


def test_the_noop_has_every_public_method_of_the_real_objects():
    """Everything off, a call the README shows (``s.spec_decode()``, ``b.hook()``, ...) or any
    public method of Observer, Session and Burst is there and does nothing."""
    from memra_obs.burst import Burst
    from memra_obs.session import Session

    s = NOOP_OBSERVER.session("glm5")
    b = s.burst(4)
    for real, noop in ((Observer, NOOP_OBSERVER), (Session, s), (Burst, b)):
        public = {n for n in dir(real) if not n.startswith("_") and callable(getattr(real, n))}
        assert {n for n in public if not hasattr(noop, n)} == set(), real.__name__
    assert s.spec_decode() == {} and s.spec_decode(detailed=True) == {}
    assert NOOP_OBSERVER.memory_snapshot() == [] and NOOP_OBSERVER.remove_sink(object()) is None
    assert s.free_memory("before") == [] and s.burst(8) is b  # one shared burst: nothing built
    assert NOOP_OBSERVER.flush() is True
    with pytest.raises(RuntimeError, match="takes no sinks"):
        NOOP_OBSERVER.add_sink(RecordingSink())
    assert b.hook() is b.hook()  # one shared context manager, reusable
    with b.hook(), b.hook():
        pass


def test_records_arrive_in_the_stream_contract_order():
    """session, rounds, burst, first-token, rounds, burst, end — with consistent ids."""
    with capture(level=1, prof=True, memory=lambda: [(0, 1234)]) as cap:
        s = cap.observer.session("glm5")
        s.free_memory("before")
        s.lap("cache_alloc")
        s.lap("prime")
        s.free_memory("after")
        run_rounds(s, 3, prime=True)
        run_rounds(s, 2)
        s.end()
    kinds = [type(r).__name__ for r in cap.records if not type(r).__name__.startswith("Prof")]
    assert kinds == [
        "SessionRecord", "RoundRecord", "RoundRecord", "RoundRecord", "BurstRecord",
        "FirstTokenRecord", "RoundRecord", "RoundRecord", "BurstRecord", "SessionEndRecord",
    ]  # fmt: skip
    assert [r.index for r in cap.rounds] == [0, 1, 2, 3, 4]
    assert [r.burst for r in cap.rounds] == [0, 0, 0, 1, 1]
    assert cap.ends[0].rounds == 5 and cap.ends[0].bursts == 2
    ft = cap.first_tokens[0]
    assert ft.prof.free_mb_before == [(0, 1234)] == ft.prof.free_mb_after
    assert ft.prof.first_burst_rounds == 3
    assert ft.prof.first_round_tokens == 3
    assert [name for name, _, _ in ft.intervals] == [
        "cache_alloc", "prime", "draft_prime", "first_draft", "first_verify", "first_accept",
        "first_roll", "first_maint", "first_burst",
    ]  # fmt: skip


def test_stamps_are_back_to_back_and_phase_totals_match_the_rounds():
    """Each round's six bounds are ordered; the burst's SpecPhaseNs is the sum of its rounds."""
    with capture(level=1) as cap:
        s = cap.observer.session("glm5")
        run_rounds(s, 4, work=lambda: time.sleep(0.0005))
        s.end()
    b = cap.bursts[0]
    for r in cap.rounds:
        t = r.t_ns_mono
        assert list(t) == sorted(t)
        assert all(d >= 400_000 for d in r.phase_ns()[:4])
    sums = [sum(r.phase_ns()[i] for r in cap.rounds) for i in range(5)]
    p = b.phases
    assert [p.draft, p.verify, p.accept, p.roll, p.maint] == sums and p.rounds == 4
    assert (
        b.start_ns_mono <= cap.rounds[0].t_ns_mono[0]
        and cap.rounds[-1].t_ns_mono[5] <= b.end_ns_mono
    )


def test_live_loop_prints_the_seed_lines_that_parse_back():
    """A traced loop at level 2 with the profile on prints every legacy line kind."""
    split = VerifySplit()
    with capture(level=2, prof=True, verify_split=split, memory=lambda: []) as cap:
        s = cap.observer.session("glm5")
        s.lap("cache_alloc")

        def verify_work():
            split.add(kda=1000, kda_scan=100, mla=500, ffn=300)

        run_rounds(s, 3, prime=True, work=verify_work)
        s.end()
    kinds = [type(parse_line(line)).__name__ for line in cap.lines]
    assert kinds == [
        "PhaseLine",
        "VerifyLine",
        "FirstTokenLine",
        "RoundsLine",
        "RoundsLine",
        "RoundsLine",
        "SummaryLine",
    ]
    v = parse_line(cap.lines[1])
    assert isinstance(v, VerifyLine) and v.vkda_ms == pytest.approx(0.004, abs=0.0006)
    assert cap.lines[0].startswith("[glm5-phase] rounds=3 k=4 total=")
    assert split.peek() == (0, 0, 0, 0)
    ft = parse_line(cap.lines[2])
    assert isinstance(ft, FirstTokenLine) and ft.prof == cap.first_tokens[0].prof
    rows = [parse_line(x) for x in cap.lines[3:6]]
    assert all(isinstance(r, RoundsLine) for r in rows)
    assert [r.prof for r in rows] == s.log.rounds  # type: ignore[union-attr]
    assert [r.row for r in rows] == [0, 1, 2]
    assert isinstance(parse_line(cap.lines[6]), SummaryLine)
    p = parse_line(cap.lines[0])
    assert isinstance(p, PhaseLine) and p.rounds == 3


def test_summary_is_printed_once_when_the_log_fills():
    """64 rounds fill the log: the summary comes then, not again at session end."""
    with capture(level=0, prof=True, memory=lambda: []) as cap:
        s = cap.observer.session("glm5")
        for _ in range(9):
            run_rounds(s, 8)
        s.end()
    assert len(cap.summaries) == 1 and cap.summaries[0].summary.startswith("rounds=64 ")
    assert sum(len(r.rows) for r in cap.prof_rows) == 64
    assert [x.split(" ")[0] for x in cap.lines].count("[spec-prof-summary]") == 1
    assert not any(x.startswith("[glm5-phase]") for x in cap.lines), "level 0 prints no phase lines"


def test_sync_clock_drains_so_queued_work_lands_in_its_phase():
    """Work queued on the stream in verify is charged to verify, not to the phase that drains."""
    e = SimStream()
    with capture(level=1) as cap:
        s = cap.observer.session("glm5", e=e)
        b = s.burst(4)
        b.begin_round()
        b.end_draft()
        e.enqueue(0.05)  # verify queues 50 ms of device work and returns at once
        b.end_verify()
        b.end_accept()
        b.end_rollback()
        b.end_round(k=4, j=1)
        b.end()
        s.end()
    _, v, a, _, _ = cap.rounds[0].phase_ns()
    # Drained in the wrong phase, accept would hold >= 50 ms; 25 ms leaves a loaded host room.
    assert v >= 49_000_000 and a < 25_000_000


class Boom(Sink):
    def on_round(self, rec):
        raise RuntimeError("exporter bug")


def test_a_failing_sink_is_reported_once_and_others_still_get_records(caplog):
    """A sink that raises never reaches the loop or the sinks after it."""
    keep = RecordingSink()
    obs = Observer([Boom(), keep], level=0, prof=False)
    s = obs.session("glm5")
    run_rounds(s, 5)
    s.end()
    assert len(keep.of(RoundRecord)) == 5
    assert caplog.text.count("Boom.on_round raised") == 1


def test_misuse_is_reported_and_the_round_dropped(caplog):
    """A round with missing boundaries is dropped with one message; the loop never sees an error."""
    keep = RecordingSink()
    obs = Observer([keep], level=0, prof=False)
    s = obs.session("glm5")
    b = s.burst(4)
    b.begin_round()
    b.end_draft()
    b.end_round(k=4, j=1)  # forgot verify/accept/rollback
    b.end_round(k=4, j=1)  # no begin_round at all
    run_rounds(s, 1)
    s.lap("not_a_bucket")
    s.end()
    assert len(keep.of(RoundRecord)) == 1
    assert "Burst.end_round() after end_draft() (expected end_verify())" in caplog.text
    assert obs.dropped_rounds == 2


def test_full_queue_drops_newest_and_counts_without_blocking():
    """The hand-off never blocks: past capacity records are dropped and counted."""

    class Slow:
        def export(self, batch):
            time.sleep(10)

        def flush(self, timeout_s=5.0):
            return True

        def shutdown(self, timeout_s=5.0):
            pass

    q = QueueSink([Slow()], capacity=16, start=False)
    obs = Observer([q], level=0, prof=False)
    s = obs.session("glm5")
    t0 = time.perf_counter()
    run_rounds(s, 40)
    s.end()
    assert time.perf_counter() - t0 < 0.5
    assert len(q) == 16 and q.dropped == 1 + 40 + 1 + 1 - 16


def test_a_full_queue_is_said_once_naming_the_knob(caplog):
    """A full hand-off queue dropped records unsaid: with spans only (no prometheus, so no
    /metrics) 4,186 of a burst-heavy session's records went missing from its trace in silence."""
    held = Held()
    q = QueueSink([held], capacity=16)
    try:
        for _ in range(200):
            q.on_round(None)  # type: ignore[arg-type]
        assert q.dropped > 100
        said = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
        assert len(said) == 1 and "MEMRA_OBS_QUEUE_SIZE" in said[0], said
        assert 'memra_obs_dropped_total{signal="records"}' in said[0]
    finally:
        held.release.set()
        q.shutdown(1)


def test_legacy_lines_a_closed_stderr_refuses_are_counted_on_metrics(monkeypatch, caplog):
    """stderr a pipe whose reader died (the log shipper restarted): every legacy line was
    lost, counted in a writer's ``errors`` that no /metrics showed and nothing said."""
    from prometheus_client import CollectorRegistry

    from memra_obs.wiring import build_observer

    class Broken:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    reg = CollectorRegistry()
    obs = build_observer(level=1, registry=reg, sinks="prometheus", metrics_addr="")
    monkeypatch.setattr("sys.stderr", Broken())
    try:
        s = obs.session("glm5")
        for _ in range(3):
            run_rounds(s, 2)
        s.end()
        obs.flush(5)
        lost = reg.get_sample_value("memra_obs_export_errors_total", {"signal": "lines"})
        assert lost == 3  # one phase line a burst
        said = [r.getMessage() for r in caplog.records if "stderr refused" in r.getMessage()]
        assert len(said) == 1 and 'export_errors_total{signal="lines"}' in said[0]
    finally:
        obs.shutdown(2)


def test_the_librarys_own_messages_a_closed_stderr_refuses_are_not_lost_lines(monkeypatch):
    """``signal="lines"`` counts legacy lines: each ``[memra-obs]`` message the fallback could
    not print (the "stderr refused" notice itself among them) was counted as one, and an alert
    on lost lines read the wrong number."""
    from memra_obs import diagnostics
    from memra_obs.linewriter import stderr_writer

    class Broken:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    monkeypatch.setattr("sys.stderr", Broken())
    monkeypatch.setattr(diagnostics, "_routed", lambda level: False)  # no handler: the fallback
    before = stderr_writer().errors
    diagnostics.say_once("test-unprinted", "a message stderr refuses")
    from memra_obs import cli

    cli._say("[memra-obs] demo: a banner")  # the CLI's and the agent's own lines neither
    assert stderr_writer().errors == before
    stderr_writer().write_lines(["[glm5-phase] rounds=1"])
    assert stderr_writer().errors == before + 1


def test_records_put_while_the_exporters_shut_down_are_counted_dropped():
    """A record the loop hands over while shutdown waits on the exporters is never exported:
    it is counted in ``dropped`` (it used to stay in the queue, neither sent nor counted)."""
    exported: list = []
    entered, release = threading.Event(), threading.Event()

    class SlowShutdown:
        def export(self, batch):
            exported.extend(batch)

        def flush(self, timeout_s=5.0):
            return True

        def shutdown(self, timeout_s=5.0):
            entered.set()
            release.wait(10)  # until the records below are in: they come while it waits

    q = QueueSink([SlowShutdown()], pause_s=0, stretch_ms=0)
    t = threading.Thread(target=q.shutdown, args=(5.0,))
    t.start()
    assert entered.wait(10), "shutdown never reached the exporter's shutdown"
    for _ in range(10):
        q.on_round(None)  # type: ignore[arg-type]
    release.set()
    t.join(10)
    assert (len(exported), q.dropped, len(q)) == (0, 10, 0)


def test_sessions_on_threads_keep_their_own_ids_and_records():
    """Concurrent sessions: every record lands under its own session, none lost."""
    keep = RecordingSink(wants_trace_ids=True)
    obs = Observer([keep], level=0, prof=False)

    def worker(n):
        with obs.session("glm5") as s:
            for _ in range(n):
                run_rounds(s, 5)

    threads = [threading.Thread(target=worker, args=(10,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sessions = keep.of(SessionRecord)
    assert len({x.session for x in sessions}) == 6
    assert len({x.trace_id for x in sessions}) == 6 and all(x.trace_id for x in sessions)
    for x in sessions:
        rounds = [r for r in keep.of(RoundRecord) if r.session == x.session]
        assert [r.index for r in rounds] == list(range(50))
    assert len(keep.of(SessionEndRecord)) == 6
    assert len(keep.of(BurstRecord)) == 60
    assert not keep.of(FirstTokenRecord), "no profile, no first-token record"


def test_adding_a_sink_swaps_the_tuple():
    """add_sink takes effect from the next record of running sessions."""
    first = RecordingSink()
    obs = Observer([first], level=0, prof=False)
    s = obs.session("glm5")
    run_rounds(s, 2)
    late = RecordingSink()
    obs.add_sink(late)
    run_rounds(s, 3)
    s.end()
    assert len(late.of(RoundRecord)) == 3 and len(first.of(RoundRecord)) == 5
    obs.remove_sink(late)
    assert obs.sinks == (first,)


def test_process_observer_built_from_environment(monkeypatch, capsys):
    """MEMRA_SPEC_TRACE=1 alone gives an observer that prints the phase line."""
    monkeypatch.setenv("MEMRA_SPEC_TRACE", "1")
    monkeypatch.delenv("MEMRA_OBS_SINKS", raising=False)
    memra_obs.flags._reset()
    monkeypatch.setattr(memra_obs, "_observer", None)
    obs = memra_obs.get_observer()
    assert obs.enabled and obs.level == 1
    s = obs.session("glm5")
    run_rounds(s, 2)
    s.end()
    err = capsys.readouterr().err
    assert err.startswith("[glm5-phase] rounds=2 k=4 total=")
    monkeypatch.setattr(memra_obs, "_observer", None)


def test_bad_knob_is_a_clear_error_naming_the_variable(monkeypatch):
    """A bad MEMRA_OBS_* value fails at start-up and names the variable."""
    from memra_obs.environment import ConfigError
    from memra_obs.wiring import build_observer

    for var, value in [
        ("MEMRA_OBS_CLOCK", "fast"),
        ("MEMRA_OBS_SINKS", "otel,statsd"),
        ("MEMRA_OBS_METRICS_ADDR", "9464"),
        ("MEMRA_OBS_QUEUE_SIZE", "lots"),
    ]:
        with pytest.raises(ConfigError, match=var):
            build_observer(env={var: value}, level=1)


def test_ending_a_burst_twice_emits_it_once(caplog):
    """A second Burst.end is reported and ignored: no duplicate burst record or line."""
    keep = RecordingSink()
    obs = Observer([keep], level=0, prof=False)
    s = obs.session("glm5")
    b = run_rounds(s, 2)
    b.end()
    s.end()
    assert len(keep.of(BurstRecord)) == 1
    assert "Burst.end called twice" in caplog.text


def _holding(n: int) -> tuple[QueueSink, Held]:
    """A queue of ``n`` records whose exporter holds them (its worker has taken the batch)."""
    ex = Held()
    q = QueueSink([ex], interval_ms=5)
    for _ in range(n):
        q.on_round(None)  # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while q.worker.held == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    return q, ex


def test_flush_is_false_while_an_exporter_still_holds_a_batch():
    """flush(t) said True (everything out) when the queue was empty but the batch taken from
    it was still inside a slow exporter call: nothing had been delivered."""
    q, ex = _holding(10)
    try:
        assert q.flush(0.2) is False
        ex.release.set()
        assert q.flush(5) is True
    finally:
        ex.release.set()
        q.shutdown(1)


def test_two_shutdowns_at_once_count_a_stuck_batch_once():
    """atexit while another thread calls shutdown() or configure(): both ran the whole
    shutdown and counted the batch a stuck exporter held twice in dropped."""
    q, ex = _holding(9)
    try:
        ts = [threading.Thread(target=q.shutdown, args=(0.3,)) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(5)
        assert q.dropped == 9
    finally:
        ex.release.set()


def test_records_a_shutdown_drops_are_said(caplog):
    """Records still queued or held when shutdown's time ran out (loop threads still running
    at exit, a stuck exporter) were counted in a ``dropped`` that no ``/metrics`` shows any
    more: at exit, the spans and requests of sessions long ended went missing unsaid."""
    q, ex = _holding(9)
    try:
        for _ in range(3):
            q.on_round(None)  # type: ignore[arg-type]
        q.shutdown(0.3)
        q.shutdown(0.3)
        assert q.dropped == 12
        assert caplog.text.count("shutdown: 12 records not exported in its time") == 1
    finally:
        ex.release.set()


def test_an_observers_own_seq_rows_counter_feeds_its_rounds():
    """``Observer(seq_rows=...)``: the loop's own counter (not the process's) is what each
    round takes."""
    rows = SeqRows()
    with capture(level=1, seq_rows=rows) as cap, cap.observer.session("g") as s, s.burst(4) as b:
        for n in (3, 5):
            b.begin_round()
            rows.add(n)
            for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
                end()
            b.end_round(k=4, j=2)
    assert [r.seq_rows for r in cap.rounds] == [3, 5]


def test_the_published_first_token_profile_is_a_snapshot():
    """A loop writing ``s.prof`` after the first burst changes no record already handed to
    the sinks (an exporter thread reads it later)."""
    with capture(level=0, prof=True, memory=list) as cap, cap.observer.session("g") as s:
        run_rounds(s, 1)
        s.prof.draft_prime_rows = 9
    (ft,) = cap.first_tokens
    assert ft.prof.draft_prime_rows == 0


def test_shutdown_closes_sinks_and_closers_once_then_sessions_are_no_ops(caplog):
    """``flush``/``shutdown`` pass their timeout to the sinks; the first shutdown closes the
    sinks, then the closers (one that raises is said, the next still runs), a second nothing;
    a later session is the no-op, said once."""
    ran = []

    def bad():
        ran.append("bad")
        raise OSError("gone")

    class Closing(RecordingSink):
        def flush(self, timeout_s=5.0):
            ran.append(f"flush {timeout_s}")
            return True

        def shutdown(self, timeout_s=5.0):
            ran.append(f"sink {timeout_s}")

    obs = Observer([Closing()], level=0, prof=False, closers=(bad, lambda: ran.append("ok")))
    assert obs.flush(0.25) is True
    obs.shutdown(0.5)
    obs.shutdown()
    assert ran == ["flush 0.25", "sink 0.5", "bad", "ok"] and "OSError('gone')" in caplog.text
    assert obs.session("g") is obs.session("g") and not obs.session("g").id
    assert caplog.text.count("this observer was shut down") == 1


def test_flush_is_true_only_when_every_sink_flushed(caplog):
    """``Observer.flush``: False when any sink says False or raises (said once), after asking
    every sink; True when all said True."""
    asked = []

    class Flushing(RecordingSink):
        def __init__(self, result):
            super().__init__()
            self.result = result

        def flush(self, timeout_s=5.0):
            asked.append(self.result)
            if self.result is None:
                raise OSError("flush failed")
            return self.result

    for results, want in (((True, True), True), ((False, True), False), ((None, True), False)):
        obs = Observer([Flushing(r) for r in results], level=0, prof=False)
        assert obs.flush(0.1) is want
        obs.shutdown(0.1)
    assert asked == [True, True, False, True, None, True]
    assert caplog.text.count("Flushing.flush raised OSError('flush failed')") == 1


def test_a_memory_callable_that_yields_its_pairs_is_snapshotted():
    """``memory=`` written as a generator: the snapshot is its pairs, in the profile and as
    ``free_memory``'s return."""

    def gen():
        yield (0, 5)

    with capture(level=0, prof=True, memory=gen) as cap, cap.observer.session("g") as s:
        assert s.free_memory("before") == [(0, 5)]
        run_rounds(s, 1)
    assert cap.first_tokens[0].prof.free_mb_before == [(0, 5)]


def test_session_ids_are_one_count_per_process():
    """Observers built one after another (``configure()`` again) go on counting: each started at
    1, so one requests file held ``"session": 1`` twice under one worker label."""
    ids = []
    for _ in range(2):
        obs = Observer([], level=1, prof=False, worker="w")
        ids += [obs.session("glm5").id, obs.session("glm5").id]
        obs.shutdown(1)
    assert len(set(ids)) == 4 and ids == sorted(ids)


@pytest.mark.parametrize(("kw", "why"), [
    ({"level": 3}, "capture(level=3): expected 0, 1 or 2"),
    ({"level": "2"}, "capture(level='2'): expected 0, 1 or 2"),
    ({"prof": "no"}, "capture(prof='no'): expected True or False"),
])  # fmt: skip
def test_capture_refuses_what_configure_refuses(kw, why):
    """A user's test passed with settings production refuses: ``capture(level=3)`` printed the
    level-2 lines, ``prof="no"`` turned the profile on, ``level="2"`` was a TypeError."""
    with pytest.raises(memra_obs.ConfigError, match=re.escape(why)), capture(**kw):
        pass
    with pytest.raises(memra_obs.ConfigError):
        memra_obs.configure(env={}, **kw)
