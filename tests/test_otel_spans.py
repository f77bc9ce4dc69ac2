"""The span builder: the DESIGN §4 tree from live observer records, the round cap, derived
ids, and sessions that never ended."""

from __future__ import annotations

import itertools
import random

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from memra_obs.observer import Observer
from memra_obs.otel.spans import PHASE_SPAN_NAMES, SpanBuilder, burst_span_id, round_span_id
from memra_obs.records import SpecFirstTokenProf, VerifySplit
from memra_obs.testing import RecordingSink
from memra_obs.timeline import (
    FirstTokenRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
    to_epoch_ns,
)

NAME, TID, SID, PID, START, END, ATTRS, STATUS = range(8)


def drive(obs, bursts=(3, 2), prof=True, error=None):
    """One session: first-token laps, then bursts of the given sizes."""
    s = obs.session("glm5")
    if prof:
        s.free_memory("before")
        s.lap("cache_alloc")
        s.lap("prime")
        s.lap("anchor")
        s.free_memory("after")
    for bi, n in enumerate(bursts):
        b = s.burst(4)
        for i in range(n):
            b.begin_round()
            if prof and bi == 0 and i == 0:
                s.lap("draft_prime")
            b.end_draft()
            obs.verify_split.add(kda=300, kda_scan=100, mla=200, ffn=50)
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=i % 5, ctx=1000 + i, seq_rows=i)
        b.end()
    s.end(error)
    return s


def build(records, round_spans=256):
    out = []
    SpanBuilder(round_spans).add(records, out)
    return out


def observer(level=2, prof=True):
    keep = RecordingSink(wants_trace_ids=True)
    obs = Observer(
        [keep],
        level=level,
        prof=prof,
        memory=lambda: [(0, 5000), (1, 6000)],
        verify_split=VerifySplit(),
    )
    return obs, keep


def test_tree_parentage_and_timestamps_follow_the_records():
    """session > burst > round > five phases back to back; ids derived, all in one trace."""
    obs, keep = observer()
    drive(obs)
    spans = build(keep.records)
    (sess_rec,) = keep.of(SessionRecord)
    by_id = {sp[SID]: sp for sp in spans}
    assert len(by_id) == len(spans)  # unique ids
    assert all(0 < sp[SID] < 2**64 for sp in spans)  # OTLP's 8 bytes, never 0
    assert {sp[TID] for sp in spans} == {sess_rec.trace_id}
    (session,) = [sp for sp in spans if sp[NAME] == "spec.session"]
    assert session[SID] == sess_rec.span_id and session[PID] == 0
    assert session[START] == to_epoch_ns(sess_rec, sess_rec.start_ns_mono)
    bursts = [sp for sp in spans if sp[NAME] == "spec.burst"]
    assert [sp[SID] for sp in bursts] == [burst_span_id(sess_rec.span_id, i) for i in range(2)]
    rounds = [sp for sp in spans if sp[NAME] == "spec.round"]
    assert [sp[SID] for sp in rounds] == [round_span_id(sess_rec.span_id, i) for i in range(5)]
    for b in bursts:
        assert b[PID] == session[SID]
        assert session[START] <= b[START] <= b[END] <= session[END]
    for r in rounds:
        parent = by_id[r[PID]]
        assert parent[NAME] == "spec.burst" and parent[START] <= r[START] <= r[END] <= parent[END]
        phases = [sp for sp in spans if sp[PID] == r[SID]]
        assert [p[NAME] for p in phases] == list(PHASE_SPAN_NAMES)
        assert phases[0][START] == r[START] and phases[-1][END] == r[END]
        for a, b in itertools.pairwise(phases):
            assert a[END] == b[START]  # back to back
    rec0 = keep.records[1]
    a = dict(rounds[0][ATTRS])
    assert a["memra.spec.k"] == rec0.k and a["memra.spec.j"] == rec0.j
    assert a["memra.spec.accepted"] == rec0.j  # DESIGN §4 names it
    assert a["memra.spec.ctx"] == 1000 and a["memra.spec.wall_ns"] == rec0.wall_ns
    assert a["memra.spec.tokens"] == rec0.j + 1 and a["memra.spec.seq_rows"] == 0
    verify = dict(next(sp for sp in spans if sp[NAME] == "spec.verify")[ATTRS])
    assert verify["memra.spec.verify.kda_ns"] == 300 and verify["memra.spec.verify.mla_ns"] == 200
    assert (
        verify["memra.spec.verify.kda_scan_ns"] == 100 and verify["memra.spec.verify.ffn_ns"] == 50
    )
    assert verify["memra.spec.verify.rest_ns"] == max(0, rec0.phase_ns()[1] - 500)
    ba = dict(bursts[0][ATTRS])
    assert ba["memra.spec.rounds"] == 3 and ba["memra.spec.k"] == 4
    assert ba["memra.spec.family"] == "glm5" and ba["memra.spec.rounds_unsampled"] == 0
    assert ba["memra.spec.verify.kda_ns"] == 900
    sa = dict(session[ATTRS])
    assert (
        sa["memra.spec.rounds"] == 5 and sa["gen_ai.usage.output_tokens"] == sa["memra.spec.tokens"]
    )
    assert session[STATUS] is None


def test_first_token_span_has_every_field_and_ordered_bucket_children():
    """spec.first_token: all SpecFirstTokenProf fields; buckets in order, round 1 nested."""
    obs, keep = observer()
    drive(obs)
    spans = build(keep.records)
    (ft,) = [sp for sp in spans if sp[NAME] == "spec.first_token"]
    session = next(sp for sp in spans if sp[NAME] == "spec.session")
    assert ft[PID] == session[SID]
    a = dict(ft[ATTRS])
    for f in (
        "cache_alloc_ms",
        "prime_ms",
        "first_verify_ms",
        "first_burst_rounds",
        "draft_prime_arm",
    ):
        assert "memra.spec.first_token." + f in a
    assert a["memra.spec.first_token.free_mb_before"] == (5000, 6000)
    assert a["memra.spec.first_token.free_mb_before_devices"] == (0, 1)
    assert a["memra.spec.first_token.first_burst_rounds"] == 3
    # Its wall is the time to first token: from the session's start (the free-memory snapshot
    # sits in no bucket) to the first burst's end, the profile's total_ms.
    assert ft[START] == session[START] and a["memra.spec.first_token.unattributed_ms"] > 0
    assert abs((ft[END] - ft[START]) / 1e6 - a["memra.spec.first_token.total_ms"]) < 1e-6
    kids = [sp for sp in spans if sp[PID] == ft[SID]]
    assert [k[NAME] for k in kids] == [
        "spec.first_token.cache_alloc",
        "spec.first_token.prime",
        "spec.first_token.anchor",
        "spec.first_token.first_burst",
    ]
    fb = kids[-1]
    inner = [sp[NAME].rsplit(".", 1)[1] for sp in spans if sp[PID] == fb[SID]]
    assert inner == [
        "draft_prime",
        "first_draft",
        "first_verify",
        "first_accept",
        "first_roll",
        "first_maint",
    ]
    for k in kids[:-1]:
        assert ft[START] <= k[START] <= k[END] <= ft[END]
    for a_, b_ in itertools.pairwise(kids):
        assert a_[END] <= b_[START]


def test_round_cap_drops_round_spans_and_says_so_on_the_burst():
    """Past round_spans per session: no round/phase spans; bursts count what they left out."""
    obs, keep = observer(level=1, prof=False)
    drive(obs, bursts=(2, 4, 3), prof=False)
    spans = build(keep.records, round_spans=3)
    assert sum(sp[NAME] == "spec.round" for sp in spans) == 3
    assert sum(sp[NAME] in PHASE_SPAN_NAMES for sp in spans) == 15
    unsampled = [
        dict(sp[ATTRS])["memra.spec.rounds_unsampled"] for sp in spans if sp[NAME] == "spec.burst"
    ]
    assert unsampled == [0, 3, 3]
    assert not [sp for sp in build(keep.records, round_spans=0) if sp[NAME] == "spec.round"]


def test_caller_span_becomes_the_session_parent():
    """A current SDK span when the session starts: same trace, spec.session is its child."""
    obs, keep = observer(prof=False)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("http.request") as req:
        drive(obs, prof=False)
    ctx = req.get_span_context()
    spans = build(keep.records)
    session = next(sp for sp in spans if sp[NAME] == "spec.session")
    assert session[PID] == ctx.span_id
    assert {sp[TID] for sp in spans} == {ctx.trace_id}
    assert trace.get_current_span() is trace.INVALID_SPAN
    (rec,) = [r for r in keep.records if type(r) is SessionRecord]
    assert rec.caller_trace_id == rec.trace_id == ctx.trace_id  # the join key, sampled too


def test_an_unsampled_caller_gets_no_spans_and_no_ids():
    """The caller's sampler dropped the request: its sessions build no spans (they were
    exported as sampled children of a parent Jaeger never gets) and carry no ids."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    obs, keep = observer(prof=False)
    with TracerProvider(sampler=ALWAYS_OFF).get_tracer("test").start_as_current_span("req"):
        drive(obs, prof=False)
    (rec,) = [r for r in keep.records if type(r) is SessionRecord]
    assert (rec.trace_id, rec.span_id, rec.parent_span_id) == (0, 0, 0)
    assert build(keep.records) == []


def test_ids_do_not_follow_a_seeded_random_and_a_forked_child_draws_its_own():
    """A loop that seeds ``random`` (vLLM seeds 0 in every worker) made every session of every
    run and replica one trace: Jaeger merged them and exemplars named the wrong request. A
    child forked from a worker draws other ids than its parent."""
    from forked import in_child

    obs, keep = observer(prof=False)
    for _ in range(3):
        random.seed(0)
        drive(obs, bursts=(1,), prof=False)
    recs = [r for r in keep.records if type(r) is SessionRecord]
    assert len({r.trace_id for r in recs}) == len({r.span_id for r in recs}) == 3

    def child() -> bytes:
        drive(obs, bursts=(1,), prof=False)
        return b"%x" % [r for r in keep.records if type(r) is SessionRecord][-1].trace_id

    theirs = in_child(child)
    drive(obs, bursts=(1,), prof=False)
    mine = b"%x" % [r for r in keep.records if type(r) is SessionRecord][-1].trace_id
    assert theirs and theirs != mine


def test_otel_traces_sampler_decides_root_sessions_and_follows_a_sampled_caller():
    """OTEL_TRACES_SAMPLER (the SDK's sampler, on the observer): always_off drops every session,
    traceidratio keeps about its share (by trace id), parentbased_* follows the caller."""
    from memra_obs.otel.config import traces_sampler

    def ids(env, n=1, caller=None):
        obs, keep = observer(prof=False)
        obs.sampled = traces_sampler(env)
        for _ in range(n):
            if caller is None:
                drive(obs, bursts=(1,), prof=False)
            else:
                with TracerProvider(sampler=caller).get_tracer("t").start_as_current_span("r"):
                    drive(obs, bursts=(1,), prof=False)
        return [r.trace_id for r in keep.records if type(r) is SessionRecord]

    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    assert ids({"OTEL_TRACES_SAMPLER": "always_off"}, 3) == [0, 0, 0]
    assert all(ids({"OTEL_TRACES_SAMPLER": "ALWAYS_ON"}, 3, caller=ALWAYS_OFF))
    kept = ids({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}, 400)
    assert 50 <= sum(map(bool, kept)) <= 150
    ratio0 = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    assert ids(ratio0, 3) == [0, 0, 0] and all(ids(ratio0, 3, caller=ALWAYS_ON))
    assert ids({"OTEL_TRACES_SAMPLER": "parentbased_always_off"}, 2) == [0, 0]
    assert all(ids({}, 3)) and ids({}, 1, caller=ALWAYS_OFF) == [0]


@pytest.mark.parametrize("agent", [False, True])
def test_build_observer_hands_the_sampler_to_its_sessions(tmp_path, agent):
    """Wired from the environment: in-process, and in agent mode, where the worker decides
    (the ids it writes into its ring are the agent's spans)."""
    from memra_obs.wiring import build_observer

    env = {"MEMRA_OBS_SINKS": "otel", "MEMRA_OBS_SPANS_FILE": str(tmp_path / "s.jsonl"),
           "OTEL_TRACES_SAMPLER": "always_off", "MEMRA_OBS_METRICS_ADDR": ""}  # fmt: skip
    if agent:
        env["MEMRA_OBS_AGENT"] = str(tmp_path / "rings")
    keep = RecordingSink(wants_trace_ids=True)
    obs = build_observer(level=0, prof=False, extra_sinks=[keep], env=env)
    try:
        drive(obs, bursts=(1,), prof=False)
    finally:
        obs.shutdown()
    assert [r.trace_id for r in keep.records if type(r) is SessionRecord] == [0]


def test_otel_traces_sampler_values_it_cannot_use_are_warned_of_once(caplog):
    """The specification: an unknown sampler or a bad ratio is a warning, and the default
    (or a ratio of 1) is taken; the process starts all the same."""
    from memra_obs import diagnostics
    from memra_obs.otel.config import traces_sampler

    diagnostics.reset()
    assert traces_sampler({"OTEL_TRACES_SAMPLER": "jaeger_remote"}) is None
    assert traces_sampler({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}) is None
    ids = [random.getrandbits(128) for _ in range(200)]
    for bad in ("2", "nan", "-0.5", "inf", "1_0", "0x1", "1e", ".", "2e-0"):
        s = traces_sampler({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": bad})
        assert s is not None and all(map(s, ids))  # a ratio of 1
    # Numbers as the SDKs read them, exponents included (1e-3 was refused: every session kept).
    for arg in ("1e-3", "1E-3", "+.001", "0.001", "1.e-3", "-0"):
        s = traces_sampler({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": arg})
        assert s is not None and sum(map(s, ids)) <= 5, arg
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "OTEL_TRACES_SAMPLER='jaeger_remote': not one of always_on, always_off, traceidratio, "
        "parentbased_always_on/_off/_traceidratio; parentbased_always_on taken",
        "OTEL_TRACES_SAMPLER_ARG='2': not a ratio in 0..1; taken as 1",
    ]


def test_error_sets_status_and_unfinished_sessions_close_at_the_last_stamp():
    """An error ends the session span with status ERROR; a session with no end record (and
    an open burst) is closed by finish_open, every round keeping a parent."""
    obs, keep = observer(prof=False)
    drive(obs, bursts=(1,), prof=False, error=RuntimeError("x"))
    spans = build(keep.records)
    session = next(sp for sp in spans if sp[NAME] == "spec.session")
    assert (
        session[STATUS] == (2, "RuntimeError: x")
        and dict(session[ATTRS])["error.type"] == "RuntimeError"
    )

    obs, keep = observer(prof=False)
    s = obs.session("glm5")
    b = s.burst(4)
    for _ in range(2):
        b.begin_round()
        b.end_draft()
        b.end_verify()
        b.end_accept()
        b.end_rollback()
        b.end_round(k=4, j=1)
    builder = SpanBuilder()
    out: list = []
    builder.add(keep.records, out)
    assert not [sp for sp in out if sp[NAME] == "spec.session"]
    assert builder.finish_open(out) == 1  # the one open session
    ids = {sp[SID] for sp in out}
    assert all(sp[PID] in ids for sp in out if sp[NAME] != "spec.session")
    session = next(sp for sp in out if sp[NAME] == "spec.session")
    last_round = keep.records[-1]
    assert session[END] == to_epoch_ns(keep.records[0], last_round.t_ns_mono[5])
    assert session[STATUS] is None and dict(session[ATTRS])["memra.spec.unfinished"] is True
    burst = next(sp for sp in out if sp[NAME] == "spec.burst")
    assert dict(burst[ATTRS])["memra.spec.rounds"] == 2


def test_an_unfinished_session_says_what_it_did_up_to_its_last_stamp():
    """A request cut off by process exit showed only ``unfinished`` in Jaeger: not how many
    rounds it drafted, tokens it accepted or where its time went."""
    obs, keep = observer(prof=False)
    b = obs.session("glm5").burst(4)
    for j in (1, 3):
        b.begin_round()
        b.end_draft()
        b.end_verify()
        b.end_accept()
        b.end_rollback()
        b.end_round(k=4, j=j)
    out: list = []
    builder = SpanBuilder()
    builder.add(keep.records, out)
    builder.finish_open(out)
    at = dict(next(sp for sp in out if sp[NAME] == "spec.session")[ATTRS])
    assert at["memra.spec.unfinished"] is True
    assert at["memra.spec.request.num_spec_steps"] == 2
    assert at["memra.spec.request.num_draft_tokens"] == 8
    assert at["memra.spec.request.num_accepted_draft_tokens"] == 4
    assert at["memra.spec.request.acceptance_histogram"] == (0, 1, 0, 1, 0)
    assert at["memra.spec.request.draft_ms"] >= 0 and "memra.spec.rounds" not in at


def test_an_unfinished_burst_says_how_many_of_its_rounds_the_cap_left_out():
    """A burst still open at shutdown gets its span from its rounds: it said ``rounds`` = 3
    beside one round span and no ``rounds_unsampled`` (capped rounds read as lost)."""
    obs, keep = observer(prof=False)
    s = obs.session("glm5")

    def one_round(b):
        for step in (b.begin_round, b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
            step()
        b.end_round(k=4, j=1)

    with s.burst(4) as b:
        one_round(b)
    b = s.burst(4)
    for _ in range(3):
        one_round(b)
    out: list = []
    builder = SpanBuilder(round_spans=2)
    builder.add(keep.records, out)
    builder.finish_open(out)
    bursts = sorted((dict(sp[ATTRS]) for sp in out if sp[NAME] == "spec.burst"),
                    key=lambda a: a["memra.spec.burst"])  # fmt: skip
    assert [a["memra.spec.rounds_unsampled"] for a in bursts] == [0, 2]
    assert bursts[1]["memra.spec.first_round"] == 1 and bursts[1]["memra.spec.unfinished"] is True
    assert sum(sp[NAME] == "spec.round" for sp in out) == 2


def test_orphan_records_and_untraced_sessions_are_skipped():
    """Records whose session record was dropped upstream produce nothing and are counted."""
    obs, keep = observer(prof=False)
    drive(obs, prof=False)
    builder = SpanBuilder()
    out: list = []
    builder.add(keep.records[1:], out)
    assert out == [] and builder.orphans == len(keep.records) - 1


def test_sessions_past_max_open_close_the_oldest_and_say_so(caplog):
    """More sessions open at once than the builder keeps (an agent's 8 workers x 512
    requests): the oldest closed unfinished and its later rounds made no spans, unsaid."""
    obs, keep = observer(prof=False)
    first = obs.session("glm5")
    others = [obs.session("glm5") for _ in range(3)]
    b = first.burst(4)
    b.begin_round()
    for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
        end()
    b.end_round(k=4, j=1)
    b.end()
    for s in (first, *others):
        s.end()
    builder, out = SpanBuilder(max_open=3), []
    builder.add(keep.records, out)
    assert [sp[NAME] for sp in out].count("spec.session") == 4
    assert "spec.round" not in {sp[NAME] for sp in out}  # what the evicted one did later
    said = [r.getMessage() for r in caplog.records if "sessions open at once" in r.getMessage()]
    assert len(said) == 1 and "over 3 sessions" in said[0]


def test_forget_open_drops_state_without_publishing():
    """The agent's hand-over: open sessions are forgotten, not closed as unfinished."""
    obs, keep = observer(prof=False)
    s = obs.session("glm5")
    b = s.burst(4)
    b.begin_round()
    b.end_draft()
    b.end_verify()
    b.end_accept()
    b.end_rollback()
    b.end_round(k=4, j=1)
    builder = SpanBuilder()
    out: list = []
    builder.add(keep.records, out)
    assert builder.forget_open() == 1
    assert builder.finish_open(out) == 0


def test_session_span_carries_the_request_record_and_the_advice():
    """Issue 15: the session span has the per-request record (the same values as
    Session.spec_decode()) and, with the profile on, the k advisor's [spec-advice] figures."""
    import random

    from memra_obs.legacy import parse_line

    obs, keep = observer(level=1, prof=True)
    s = obs.session("glm5")
    rng = random.Random(5)
    for _ in range(3):
        b = s.burst(4)
        for _ in range(30):
            b.begin_round()
            b.end_draft()
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            k = rng.randint(1, 4)
            b.end_round(k=k, j=rng.randint(0, k))
        b.end()
    want = s.spec_decode()
    s.end()
    end = keep.records[-1]
    assert end.advice.startswith("[spec-advice] (estimate)")
    spans = build(keep.records)
    attrs = dict(next(sp for sp in spans if sp[NAME] == "spec.session")[ATTRS])
    for key in ("num_spec_tokens", "num_spec_steps", "num_draft_tokens", "mean_acceptance_length",
                "num_accepted_draft_tokens", "draft_acceptance_rate"):  # fmt: skip
        assert attrs[f"memra.spec.request.{key}"] == want[key], key
    assert list(attrs["memra.spec.request.acceptance_histogram"]) == want["acceptance_histogram"]
    for phase, ms in want["phase_ms"].items():
        assert attrs[f"memra.spec.request.{phase}_ms"] == ms
    line = parse_line(end.advice)
    assert attrs["memra.spec.advice.estimate"] is True
    assert attrs["memra.spec.advice.recommended_k"] == line.k_rec
    assert attrs["memra.spec.advice.clock"] == "host"  # no device stream here
    lo, v, hi = (attrs[f"memra.spec.advice.estimated_speedup{x}"] for x in ("_lo", "", "_hi"))
    assert (v, lo, hi) == line.speedup and lo <= v <= hi
    # A session without the profile has no advice line, and its span no advice attributes.
    obs2, keep2 = observer(level=1, prof=False)
    drive(obs2, prof=False)
    attrs2 = dict(next(sp for sp in build(keep2.records) if sp[NAME] == "spec.session")[ATTRS])
    assert "memra.spec.request.num_spec_steps" in attrs2
    assert not any(k.startswith("memra.spec.advice.") for k in attrs2)


def test_a_damaged_advice_line_costs_only_its_attributes(caplog):
    import logging

    from memra_obs.timeline import SessionEndRecord

    obs, keep = observer(level=1, prof=False)
    drive(obs, prof=False)
    recs = [*keep.records[:-1], SessionEndRecord(*keep.records[-1][:6], "[spec-advice] rounds=")]
    with caplog.at_level(logging.WARNING, logger="memra_obs"):
        spans = build(recs)
    attrs = dict(next(sp for sp in spans if sp[NAME] == "spec.session")[ATTRS])
    assert "memra.spec.request.num_spec_steps" in attrs
    assert not any(k.startswith("memra.spec.advice.") for k in attrs)
    assert any("session advice not set" in r.getMessage() for r in caplog.records)


def test_an_error_session_keeps_the_exception_message():
    """Jaeger showed ``RuntimeError`` and nothing of "CUDA out of memory": the status now says
    ``Type: message`` as the SDK's does; ``error.type`` stays the type."""
    obs, keep = observer(prof=False)
    drive(obs, bursts=(1,), prof=False, error=RuntimeError("CUDA out of memory"))
    session = next(sp for sp in build(keep.records) if sp[NAME] == "spec.session")
    assert dict(session[ATTRS])["error.type"] == "RuntimeError"
    assert session[STATUS] == (2, "RuntimeError: CUDA out of memory")


def test_the_round_cap_bounds_the_trace_when_every_burst_is_one_round():
    """A loop returning after every round made a burst span per round (5,000 bursts: a 7 MB
    trace in Jaeger): bursts past the cap get none, counted on the session."""
    obs, keep = observer(level=1, prof=False)
    drive(obs, bursts=(1,) * 300, prof=False)
    for cap, rounds in ((8, 8), (0, 0), (280, 280)):
        spans = build(keep.records, round_spans=cap)
        assert sum(sp[NAME] == "spec.round" for sp in spans) == rounds
        bursts = max(256, rounds)  # a burst with a round span keeps its own: no orphan
        assert sum(sp[NAME] == "spec.burst" for sp in spans) == bursts
        session = next(sp for sp in spans if sp[NAME] == "spec.session")
        assert dict(session[ATTRS])["memra.spec.bursts_unsampled"] == 300 - bursts


def test_an_unfinished_session_with_no_stamps_is_not_zero_length():
    """A session stuck before its first burst at shutdown ended where it started, and Jaeger
    flagged it "Negative duration detected"."""
    from memra_obs.otel.spans import SpanBuilder

    obs, keep = observer(prof=False)
    obs.session("glm5")
    out: list = []
    b = SpanBuilder()
    b.add(keep.records, out)
    b.finish_open(out)
    (session,) = out
    assert session[5] > session[4]


def test_a_phase_that_took_no_time_still_gets_a_span_jaeger_accepts():
    """The event clock charges host work hidden under the device's tail nothing (accept and
    rollback end where verify ended): those spans were empty, and Jaeger flagged each one
    "Negative duration detected". Each gets 1 ns of the round's longest phase; the round keeps
    its start, end and wall, the phases still tile it."""

    class HiddenHostWork:  # marks: begin, draft, verify, accept, rollback, maint
        immediate = True

        def __init__(self, e, eh):
            self.steps = itertools.cycle((1000, 2000, 3000, 0, 0, 500))
            self.t = 0

        def mark(self):
            self.t += next(self.steps)
            return self.t

        def settle(self, stamps):
            return stamps

    keep = RecordingSink(wants_trace_ids=True)
    obs = Observer([keep], level=1, prof=False, clock=HiddenHostWork)
    drive(obs, bursts=(2,), prof=False)
    spans = build(keep.records)
    assert all(sp[END] > sp[START] for sp in spans), [sp[:1] + sp[4:6] for sp in spans]
    rounds = [sp for sp in spans if sp[NAME] == "spec.round"]
    assert len(rounds) == 2  # none lost (a widening that raised dropped them: vacuously true)
    for r in rounds:
        phases = [sp for sp in spans if sp[PID] == r[SID]]
        assert phases[0][START] == r[START] and phases[-1][END] == r[END]
        assert all(a[END] == b[START] for a, b in itertools.pairwise(phases))
        assert [p[END] - p[START] for p in phases] == [2000, 2998, 1, 1, 500]
        assert dict(r[ATTRS])["memra.spec.wall_ns"] == r[END] - r[START] == 5500


def test_a_span_that_has_ended_is_no_later_sessions_parent():
    """A loop task started inside the first request (vLLM's AsyncLLMEngine starts its
    background loop so) keeps that request's span current for good: every later session of the
    process joined the first request's trace (its parent, its sampling decision, its trace id in
    the requests file). A span that has ended is no parent: a trace of its own, said once."""
    import asyncio

    from memra_obs.otel.config import traces_sampler

    tracer = TracerProvider().get_tracer("app")

    def serve(env):
        obs, keep = observer(prof=False)
        obs.sampled = traces_sampler(env)

        async def main():
            q, task, reqs = asyncio.Queue(), None, []

            async def engine_loop():
                while True:
                    fut = await q.get()
                    drive(obs, bursts=(1,), prof=False)
                    fut.set_result(None)

            for _ in range(3):
                with tracer.start_as_current_span("POST /generate") as req:
                    task = task or asyncio.get_running_loop().create_task(engine_loop())
                    fut = asyncio.get_running_loop().create_future()
                    await q.put(fut)
                    await fut
                reqs.append(req.get_span_context())
            task.cancel()
            return reqs

        reqs = asyncio.run(main())
        return reqs, [r for r in keep.records if type(r) is SessionRecord]

    reqs, (first, *later) = serve({})
    assert (first.trace_id, first.parent_span_id) == (reqs[0].trace_id, reqs[0].span_id)
    assert all(r.trace_id and r.parent_span_id == r.caller_trace_id == 0 for r in later)
    assert len({r.trace_id for r in (first, *later)}) == 3
    _, (first, *later) = serve({"OTEL_TRACES_SAMPLER": "parentbased_always_off"})
    assert first.trace_id and [r.trace_id for r in later] == [0, 0]  # a root's decision


def test_every_session_span_attribute_is_in_the_readme_table():
    """README, "Attributes" names every attribute a `spec.session` span carries: an errored
    session with the profile's advice, one past the burst-span cap, one closed unfinished
    (`memra.spec.request.*`, `.advice.*`, `.bursts_unsampled`, `.unfinished` were missing)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = text.split("### Attributes\n\n", 1)[1].split("\n\n", 1)[0]
    obs, keep = observer(level=1, prof=True)
    drive(obs, bursts=(20, 20), error=RuntimeError("oom"))
    drive(obs, bursts=(1,) * 300, prof=False)
    out = build(keep.records, round_spans=0)
    open_ = observer(prof=False)
    s = open_[0].session("glm5")
    s.burst(4).begin_round()
    builder = SpanBuilder()
    builder.add(open_[1].records, out)
    builder.finish_open(out)
    keys = {k for sp in out if sp[NAME] == "spec.session" for k, _ in sp[ATTRS]}
    for prefix in ("memra.spec.request.", "memra.spec.advice."):
        assert any(k.startswith(prefix) for k in keys), prefix
        keys = {prefix + "*" if k.startswith(prefix) else k for k in keys}
    assert {"memra.spec.bursts_unsampled", "memra.spec.unfinished", "error.type"} <= keys
    assert not [k for k in sorted(keys) if f"`{k}`" not in table]


def _session(sid=0x77):
    """A SessionRecord by hand: mono = epoch - 10**18, so span times read as ns from 10**18."""
    return SessionRecord(1, "glm5", "", "", "w", 1000, 1000, 10**18 + 1000, 5, sid, 0, 1, False)


def _spans(*records, finish=False):
    out: list = []
    b = SpanBuilder()
    b.add(records, out)
    if finish:
        b.finish_open(out)
    return {sp[NAME]: sp for sp in out}, out


def test_a_run_of_equal_rounds_counts_every_round_it_stands_for():
    """A tail-rebuilt round with repeat=3 and unknown counts: the unfinished burst and session
    end after the third round, hold its three bonus tokens and three rounds' phase time."""
    t = (1000, 1100, 1300, 1400, 1500, 1600)
    r = RoundRecord(1, 0, 0, t, -1, -1, 0, 0, None, repeat=3)
    by, out = _spans(_session(), r, finish=True)
    assert [sp[NAME] for sp in out].count("spec.round") == 3
    burst, session = dict(by["spec.burst"][ATTRS]), by["spec.session"]
    assert burst["memra.spec.rounds"] == 3 and burst["memra.spec.tokens"] == 3
    assert by["spec.burst"][END] == session[END] == 10**18 + 1600 + 2 * 600
    sa = dict(session[ATTRS])
    assert sa["memra.spec.request.draft_ms"] == pytest.approx(3 * 100 / 1e6)
    assert sa["memra.spec.request.verify_ms"] == pytest.approx(3 * 200 / 1e6)


def test_round_attributes_rate_and_a_verify_rest_that_cannot_go_negative():
    """acceptance_rate is j/k; rest_ns (verify minus kda and mla) is 0, never negative, when
    the level-2 split adds up past the verify phase."""
    t = (1000, 1100, 1300, 1400, 1500, 1600)  # verify: 200 ns
    r = RoundRecord(1, 0, 0, t, 4, 3, 10, 2, (300, 100, 400, 50))
    by, _ = _spans(_session(), r, finish=True)
    assert dict(by["spec.round"][ATTRS])["memra.spec.acceptance_rate"] == 0.75
    v = dict(by["spec.verify"][ATTRS])
    assert v["memra.spec.verify.rest_ns"] == 0 and v["memra.spec.verify.mla_ns"] == 400


def test_first_token_buckets_empty_ones_left_out_and_nesting_at_the_edge():
    """A bucket that took no time gets no span; a round-1 bucket starting exactly where the
    first burst starts sits under it."""
    iv = (
        ("cache_alloc", 1000, 1200),
        ("prime", 1200, 1200),  # empty
        ("first_burst", 1300, 2000),
        ("first_draft", 1300, 1400),  # starts with the burst
    )
    rec = FirstTokenRecord(1, SpecFirstTokenProf(), iv)
    by, out = _spans(_session(), rec, finish=True)
    names = [sp[NAME] for sp in out]
    assert "spec.first_token.prime" not in names
    assert by["spec.first_token.first_draft"][PID] == by["spec.first_token.first_burst"][SID]


def test_a_session_span_ends_no_earlier_than_what_it_holds():
    """An end record stamped before the last round's end (clocks settled past it): the session
    span still ends at the round's end, so no child outlives it."""
    t = (1000, 1100, 1300, 1400, 1500, 1600)
    r = RoundRecord(1, 0, 0, t, 4, 3, 10, 2, None)
    end = SessionEndRecord(1, 1500, 1, 1, 4, "")
    by, _ = _spans(_session(), r, end)
    assert by["spec.session"][END] == by["spec.round"][END] == 10**18 + 1600


def test_derived_span_ids_are_never_zero():
    """A zero span id is invalid in OTLP: the id that would XOR to 0 is 1."""
    gamma = 0x9E3779B97F4A7C15
    assert round_span_id((2 * gamma) & (2**64 - 1), 0) == 1


def test_a_session_with_rounds_of_unknown_counts_carries_no_gen_ai_tokens():
    """The tail's rounds past the logged rows have k = j = -1 and count one token each: the
    session's token count is a lower bound (20-30% low on long requests), which
    gen_ai.usage.output_tokens published as exact to every token dashboard."""
    obs, keep = observer(prof=False)
    drive(obs, bursts=(3,), prof=False)
    exact = dict(next(sp for sp in build(keep.records) if sp[NAME] == "spec.session")[ATTRS])
    assert exact["gen_ai.usage.output_tokens"] == exact["memra.spec.tokens"]
    recs = [r._replace(k=-1, j=-1) if type(r).__name__ == "RoundRecord" and r.index == 2 else r
            for r in keep.records]  # fmt: skip
    guessed = dict(next(sp for sp in build(recs) if sp[NAME] == "spec.session")[ATTRS])
    assert "gen_ai.usage.output_tokens" not in guessed and guessed["memra.spec.tokens"] > 0
    assert guessed["memra.spec.request.num_spec_steps"] == 2  # the known rounds' record
    recs = [r._replace(k=-1, j=-1) if type(r).__name__ == "RoundRecord" else r
            for r in keep.records]  # fmt: skip
    none = dict(next(sp for sp in build(recs) if sp[NAME] == "spec.session")[ATTRS])
    # no round's counts known: no acceptance at all (it read 0%: draft_acceptance_rate 0.0)
    assert "memra.spec.request.draft_acceptance_rate" not in none
    assert "memra.spec.request.mean_acceptance_length" not in none
