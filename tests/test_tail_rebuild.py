"""Lines back to records: what is exact is exact, what is a mean sums right, order holds."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest

from memra_obs import burst as burst_mod
from memra_obs import clock as clock_mod
from memra_obs import session as session_mod
from memra_obs.legacy import parse_line
from memra_obs.otel.spans import SpanBuilder
from memra_obs.records import VerifySplit
from memra_obs.tail import Rebuilder, Tail
from memra_obs.tail.rebuild import family_of
from memra_obs.testing import capture
from memra_obs.timeline import (
    BurstRecord,
    FirstTokenRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
    each_round,
)

MS = 1_000_000


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every clock read of the observer advances by a random 50 µs - 3 ms: a loop of
    thousands of rounds runs instantly, with realistic, varied phase times."""
    rng = random.Random(5)
    t = [10**12]

    def now() -> int:
        t[0] += rng.randint(50_000, 3_000_000)
        return t[0]

    monkeypatch.setattr(clock_mod, "now_ns", now)
    monkeypatch.setattr(session_mod, "now_ns", now)
    monkeypatch.setattr(burst_mod, "now_ns", now)
    yield


def drive(obs: Any, sessions: list[int], *, seed: int = 1, k: int = 4, per_burst: int = 6) -> None:
    """A spec loop: per session the creation laps, then bursts of ``per_burst`` rounds."""
    rng = random.Random(seed)
    for n_rounds in sessions:
        with obs.session("glm5") as s:
            s.free_memory("before")
            for lap in ("cache_alloc", "prime", "capture", "anchor", "draft_alloc"):
                s.lap(lap)
            s.free_memory("after")
            s.set(
                draft_prime_rows=100, draft_prime_chunks=1, draft_prime_arm="eager", draft_kv_mb=6.5
            )
            done, first = 0, True
            while done < n_rounds:
                b = s.burst(k)
                for _ in range(min(per_burst, n_rounds - done)):
                    b.begin_round()
                    if first:
                        s.lap("draft_prime")
                        first = False
                    b.end_draft()
                    obs.verify_split.add(
                        kda=rng.randint(1, 9) * 10_000, kda_scan=5_000, mla=20_000, ffn=7_000
                    )
                    b.end_verify()
                    b.end_accept()
                    b.end_rollback()
                    kk = rng.randint(1, k)
                    b.end_round(
                        k=kk,
                        j=rng.randint(0, kk),
                        ctx=500 + done,
                        seq_rows=rng.choice([0, 0, kk + 1]),
                    )
                    done += 1
                b.end()


def rebuild(lines: list[str], **kw: Any) -> tuple[list[Any], Tail]:
    """The records a tail rebuilds from ``lines`` (all arriving at once)."""
    out: list[Any] = []
    notes: list[str] = []
    tail = Tail(Rebuilder("w", **kw), out.extend, out=None, notes=notes.append)
    tail.feed(("\n".join(lines) + "\n").encode(), 10**15)
    tail.close(10**15 + 1)
    tail.notes = notes  # type: ignore[attr-defined]
    return out, tail


def by_session(records: list[Any]) -> list[list[Any]]:
    sessions: dict[int, list[Any]] = {}
    for r in records:
        sessions.setdefault(r.session, []).append(r)
    return list(sessions.values())


def of(records: list[Any], kind: type) -> list[Any]:
    """The records of ``kind``; a run of equal rounds (``repeat`` > 1) as its rounds."""
    if kind is RoundRecord:
        return [x for r in records if type(r) is kind for x in _each(r)]
    return [r for r in records if type(r) is kind]


_each = each_round


def test_profiled_stream_rebuilds_sessions_bursts_and_exact_rows(fake_clock):
    """Level 2 + profile: every session, burst and round comes back; rows' values are the
    loop's to the f32, round 0 to the ns, and rounds past 64 sum to the lines' totals."""
    with capture(level=2, prof=True, memory=lambda: [(0, 4096)], verify_split=VerifySplit()) as cap:
        drive(cap.observer, [10, 64, 100, 1])
    truth = cap.records
    got, tail = rebuild(cap.lines)
    assert tail.stats.total_malformed == 0 and tail.stats.total_orphans == 0, tail.notes
    want_s, got_s = by_session([r for r in truth if type(r) in _PUBLISHED]), by_session(got)
    assert len(got_s) == len(want_s) == 4
    for want, have in zip(want_s, got_s, strict=True):
        have = [x for r in have for x in (_each(r) if type(r) is RoundRecord else [r])]
        assert [type(r) for r in have] == [type(r) for r in want], "the contract's order"
        s = have[0]
        assert (s.family, s.tag, s.tag_v, s.level, s.prof, s.worker) == (
            "glm5",
            "glm5-phase",
            "glm5-phase-v",
            2,
            True,
            "w",
        )
        assert 0 < s.trace_id < 1 << 128 and 0 < s.span_id < 1 << 64 and s.parent_span_id == 0
        wr, hr = of(want, RoundRecord), of(have, RoundRecord)
        for w, h in zip(wr, hr, strict=True):
            assert (h.index, h.burst) == (w.index, w.burst)
            wall_w, wall_h = w.wall_ns, h.wall_ns
            if w.index == 0:
                assert h.phase_ns()[:3] == pytest.approx(w.phase_ns()[:3], abs=2)
                assert h.phase_ns()[3:] == pytest.approx(w.phase_ns()[3:], abs=2)
            if w.index < 64:
                assert (h.k, h.j, h.ctx, h.seq_rows) == (w.k, w.j, w.ctx, w.seq_rows)
                assert wall_h == pytest.approx(wall_w, abs=2)
                assert h.phase_ns()[:3] == pytest.approx(w.phase_ns()[:3], abs=2)
                rest_w, rest_h = sum(w.phase_ns()[3:]), sum(h.phase_ns()[3:])
                assert rest_h == pytest.approx(rest_w, abs=2)
            else:
                assert (h.k, h.j, h.ctx, h.seq_rows) == (-1, -1, 0, 0), "never invented"
            assert h.split_ns is not None
        for w, h in zip(of(want, BurstRecord), of(have, BurstRecord), strict=True):
            assert (h.index, h.k, h.first_round, h.phases.rounds) == (
                w.index,
                w.k,
                w.first_round,
                w.phases.rounds,
            )
            for p in ("draft", "verify", "accept", "roll", "maint"):
                assert getattr(h.phases, p) == pytest.approx(getattr(w.phases, p), abs=5_000), p
            assert h.end_ns_mono - h.start_ns_mono >= sum(
                r.wall_ns for r in hr if r.burst == h.index
            )
        (fw,), (fh,) = of(want, FirstTokenRecord), of(have, FirstTokenRecord)
        assert fh.prof == fw.prof
        assert [name for name, _, _ in fh.intervals] == [name for name, _, _ in fw.intervals]
        for (name, a, b), (_, c, d) in zip(fw.intervals, fh.intervals, strict=True):
            assert d - c == pytest.approx(b - a, abs=2), name
        (ew,), (eh,) = of(want, SessionEndRecord), of(have, SessionEndRecord)
        assert (eh.rounds, eh.bursts) == (ew.rounds, ew.bursts)
        assert eh.end_ns_mono == of(have, BurstRecord)[-1].end_ns_mono, "ends with its last burst"
        if ew.rounds <= 64:  # every round has its row: the session's tokens are exact
            assert eh.tokens == ew.tokens
    # Rounds with their row's values: each session's first 64; the rest are their bursts' means
    # (memra_obs_tail_rounds_total{source="row"|"burst_mean"}, the end line's "from rows").
    rb = tail.rebuilder
    assert (rb.rounds_from_rows, rb.rounds_from_means, rb.sessions) == (10 + 64 + 64 + 1, 36, 4)
    ids = [(s.trace_id, s.span_id) for s in of(got, SessionRecord)]
    assert len({t for t, _ in ids}) == len({sp for _, sp in ids}) == 4, "each session its own"


_PUBLISHED = (SessionRecord, RoundRecord, BurstRecord, FirstTokenRecord, SessionEndRecord)


def test_the_first_bursts_commit_hook_and_verify_split_come_back(fake_clock):
    """The profile's ``first_burst_hook_ms`` is the first burst's hook time (the later bursts'
    no line prints: 0); each of the level-2 line's four per-round means, x the burst's rounds,
    is the burst's split to the 0.0005 ms a round its print rounds to."""
    with capture(level=2, prof=True, memory=lambda: [(0, 1)], verify_split=VerifySplit()) as cap:
        obs = cap.observer
        with obs.session("glm5") as s:
            s.lap("prime")
            for n in (5, 3):
                b = s.burst(4)
                for i in range(n):
                    b.begin_round()
                    b.end_draft()
                    obs.verify_split.add(kda=300_000 + i, kda_scan=41_000, mla=520_000, ffn=77_000)
                    b.end_verify()
                    b.end_accept()
                    b.end_rollback()
                    b.end_round(k=4, j=2, ctx=100 + i, seq_rows=0)
                    with b.hook():
                        pass
                b.end()
    want, (got, tail) = of(cap.records, BurstRecord), rebuild(cap.lines)
    assert tail.stats.total_orphans == 0, tail.notes
    (fw,), (fh,) = of(cap.records, FirstTokenRecord), of(got, FirstTokenRecord)
    names = [name for name, _, _ in fh.intervals]
    assert names == [name for name, _, _ in fw.intervals] and "draft_prime" not in names
    have = of(got, BurstRecord)
    assert want[0].hook_ns > 0 and have[0].hook_ns == pytest.approx(want[0].hook_ns, abs=2)
    assert want[1].hook_ns > 0 and have[1].hook_ns == 0
    for w, h, n in zip(want, have, (5, 3), strict=True):
        assert h.split_ns == pytest.approx(w.split_ns, abs=500 * n)
        assert h.split_ns[1:] == (41_000 * n, 520_000 * n, 77_000 * n)


def test_timestamps_are_laid_out_in_order_and_end_at_arrival():
    """Rounds sit back to back inside their burst, bursts never overlap, a live burst ends
    when its line arrived, and the first-token buckets precede the first burst."""
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        drive(cap.observer, [20, 7])
    rb = Rebuilder("w")
    out: list[Any] = []
    tail = Tail(rb, out.extend, out=None)
    t = 5 * 10**12
    for line in cap.lines:  # one line per second: arrivals leave room for every burst
        tail.feed((line + "\n").encode(), t)
        t += 10**9
    tail.close(t)
    prev_end = 0
    for b in of(out, BurstRecord):
        assert b.start_ns_mono >= prev_end
        prev_end = b.end_ns_mono
        rs = [r for r in of(out, RoundRecord) if r.session == b.session and r.burst == b.index]
        assert rs[0].t_ns_mono[0] == b.start_ns_mono
        for r0, r1 in itertools.pairwise(rs):
            assert r0.t_ns_mono[5] == r1.t_ns_mono[0]
        for r in rs:
            assert list(r.t_ns_mono) == sorted(r.t_ns_mono)
    for f in of(out, FirstTokenRecord):
        burst0 = next(b for b in of(out, BurstRecord) if b.session == f.session)
        creation = [
            iv
            for iv in f.intervals
            if iv[0] in ("cache_alloc", "prime", "capture", "anchor", "draft_alloc")
        ]
        assert creation[-1][2] == burst0.start_ns_mono
        assert f.intervals[-1] == ("first_burst", burst0.start_ns_mono, burst0.end_ns_mono)
        s = next(r for r in out if type(r) is SessionRecord and r.session == f.session)
        # What no bucket covered comes first: the wall from the session's start to the first
        # burst's end is the profile's total (the spec.first_token span's duration).
        assert s.start_ns_mono == creation[0][1] - round(f.prof.unattributed_ms * 1e6)
        wall = burst0.end_ns_mono - s.start_ns_mono
        assert f.prof.unattributed_ms > 0 and abs(wall / 1e6 - f.prof.total_ms()) < 1e-5


def test_trace_only_stream_bounds_its_synthetic_sessions(fake_clock):
    """Without the profile nothing marks requests: bursts are grouped into sessions of at
    most ``max_bursts``, and rounds carry no invented k/j."""
    with capture(level=1, prof=False) as cap:
        drive(cap.observer, [30, 30, 30])  # 15 bursts
    got, tail = rebuild(cap.lines, max_bursts=4)
    sessions = of(got, SessionRecord)
    assert [e.bursts for e in of(got, SessionEndRecord)] == [4, 4, 4, 3]
    assert all((s.level, s.prof, s.family) == (1, False, "glm5") for s in sessions)
    rounds = of(got, RoundRecord)
    assert len(rounds) == 90 and all(r.k == r.j == -1 and r.split_ns is None for r in rounds)
    assert tail.rebuilder.rounds_from_means == 90


def test_level2_line_gives_each_round_the_burst_mean_split(fake_clock):
    """The verify sub-split line's per-round means become every round's split_ns."""
    with capture(level=2, prof=False, verify_split=VerifySplit()) as cap:
        drive(cap.observer, [6])
    got, _ = rebuild(cap.lines)
    line = next(x for x in cap.lines if x.startswith("[glm5-phase-v]"))
    kda = round(float(line.split("vkda=")[1].split()[0]) * 1e6)
    assert {r.split_ns[0] for r in of(got, RoundRecord)} == {kda}
    (b,) = of(got, BurstRecord)
    assert b.split_ns[0] == kda * 6


def test_profile_only_stream_takes_bursts_from_rows(fake_clock):
    """Profile on, trace off: sessions start at [spec-prof], rounds come from the rows."""
    with capture(level=0, prof=True, memory=lambda: [(0, 1)]) as cap:
        drive(cap.observer, [13, 8])
    assert not any(x.startswith("[glm5-phase") for x in cap.lines)
    got, tail = rebuild(cap.lines)
    assert tail.stats.total_orphans == 0, tail.notes
    ends = of(got, SessionEndRecord)
    assert [e.rounds for e in ends] == [13, 8]
    # The profile's burst, then the rows past it as one burst (no phase line splits them).
    assert [e.bursts for e in ends] == [2, 2]
    assert [f.prof for f in of(got, FirstTokenRecord)] == [f.prof for f in cap.first_tokens]
    assert all(s.family == "unknown" and s.level == 0 for s in of(got, SessionRecord))
    want = [r for r in cap.rounds]
    for w, h in zip(want, of(got, RoundRecord), strict=True):
        assert (h.k, h.j, h.ctx) == (w.k, w.j, w.ctx)


def test_unplaceable_lines_are_reported_not_guessed():
    """A level-2 line with no phase line before it, a row nobody expects and a summary with
    no session are counted as orphans, reported with their line number, and published as
    nothing."""
    lines = [
        "[glm5-phase-v] rounds=6 k=4 | per-round ms: vkda=0.893 (scan=0.357) vmla=0.552 vrest=1.277 (vffn=0.788)",
        "some other program",
        "[spec-prof-rounds] row=7 wall_ms=1.0 draft_ms=0.2 verify_ms=0.5 accept_ms=0.1 rest_ms=0.2 k=4 j=2 ctx=9 seq_rows=0",
        "[spec-prof-summary] rounds=3 k_mean=4.00 j_mean=2.00 accept=0.500 tok_per_round=3.00 wall_ms mean=1.0 min=1.0 "
        "med=1.0 max=1.0 slow_rounds(>1.5x med)=0 draft_mean=0.2 verify_mean=0.5 seq_rows_total=0 ctx_first=1 ctx_last=3",
    ]
    got, tail = rebuild(lines)
    assert got == []
    assert (
        tail.stats.orphans["verify"]
        == tail.stats.orphans["prof_rounds"]
        == tail.stats.orphans["prof_summary"]
        == 1
    )
    assert [n.split(":")[1] for n in tail.notes] == ["1", "3", "4"]


def test_a_row_accepting_more_than_it_drafted_is_refused_as_unplaced(fake_clock):
    """A row with j > k (no loop's; the k advisor refuses it) is reported by line number and
    counted as unplaced, whether it opens its burst or follows a row, and never published."""
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        drive(cap.observer, [20])
    lines = cap.lines
    # a burst's first row (the slow path), a later one (the fast path); j = k + 1 is refused too
    for row, j in ((0, 9), (9, 5)):
        i = next(n for n, x in enumerate(lines) if x.startswith(f"[spec-prof-rounds] row={row} "))
        lines[i] = re.sub(r" k=\d+ j=\d+ ", f" k=4 j={j} ", lines[i])
        assert any(
            n.startswith(f"-:{i + 1}: row={row} has j={j} > k=4") for n in rebuild(lines)[1].notes
        )
    got, tail = rebuild(lines)
    assert all(0 <= r.j <= r.k for r in of(got, RoundRecord) if r.k >= 0)
    assert tail.stats.orphans["prof_rounds"] >= 2 and len(of(got, RoundRecord)) == 20


def test_a_session_without_rounds_after_a_full_round_log_is_its_own(fake_clock):
    """A profiled session past 64 rounds stays open after its summary; the next session's
    ``rounds=0`` summary ends it and is a session of its own (none lost), while a session
    whose first burst ran no round still takes ``rounds=0`` as its own summary."""
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        drive(cap.observer, [100, 0])
        with cap.observer.session("glm5") as s:
            s.burst(4).end()
    got, tail = rebuild(cap.lines)
    ends = of(got, SessionEndRecord)
    assert [(e.rounds, e.bursts) for e in ends] == [(100, 17), (0, 0), (0, 1)], tail.notes
    assert tail.rebuilder.sessions == len(cap.sessions) == 3


def test_family_of_tags():
    """The observer's default tag names its family; other tags are their own family."""
    assert family_of("glm5-phase") == "glm5"
    assert family_of("dspark-phase") == "dspark"
    assert family_of("mtp") == "mtp"
    assert family_of("eagle3-draft") == "eagle3-draft"  # long, without the suffix
    assert family_of("x-phase") == "x"  # the shortest a family can be
    assert family_of("-phase") == "-phase"  # the suffix alone names no family: its own
    assert family_of("") == "unknown"


def test_absurd_values_are_refused_not_expanded():
    """A phase line claiming millions of rounds, or rows no clock produces, are reported
    and published as nothing, instead of being expanded into that many records."""
    big = PHASE_LINE.replace("rounds=6", "rounds=10000000")
    row = (
        "[spec-prof-rounds] row=0 wall_ms=3.0e38 draft_ms=1.0 verify_ms=1.0 accept_ms=1.0 "
        "rest_ms=1.0 k=4 j=1 ctx=1 seq_rows=0"
    ).replace("3.0e38", "3" + "0" * 38 + ".0")
    got, tail = rebuild([big, PHASE_LINE.replace("rounds=6", "rounds=1"), row])
    assert [type(r) for r in got] == [], got
    assert tail.stats.orphans["phase"] == 2  # the huge burst, and the burst its row made absurd
    assert any("past any plausible burst" in n for n in tail.notes)
    assert any("past any plausible clock" in n for n in tail.notes)
    got, tail = rebuild([PHASE_LINE.replace("k=4", "k=" + "9" * 23)])  # was wrapped mod 2**64
    assert got == [] and tail.stats.orphans["phase"] == 1


def test_a_profile_without_its_phase_line_adds_no_rounds_in_a_traced_stream():
    """In a stream with phase lines, a [spec-prof] without its first burst's phase line (lost,
    or another worker's lines between them) is reported unplaced: its rounds are a phase
    line's, never a second, profile-made burst of them (profile-only streams: below)."""
    from memra_obs.legacy import prof_line
    from memra_obs.records import SpecFirstTokenProf

    prof = prof_line(SpecFirstTokenProf(prime_ms=3.0, first_burst_rounds=5, first_burst_ms=20.0))
    got, tail = rebuild([PHASE_LINE, prof])
    assert not of(got, FirstTokenRecord) and [e.rounds for e in of(got, SessionEndRecord)] == [6]
    assert tail.stats.orphans["prof"] == 1
    assert [n.split(": '", 1)[0] for n in tail.notes] == [
        "-:2: [spec-prof] without its first burst's phase line: its rounds are not counted"
    ]


def test_workers_sharing_one_stream_do_not_count_rounds_twice(fake_clock, tmp_path):
    """Two workers' lines in one stderr (trace level 1 + profile): each one's first phase line,
    then the rest of each. The second [spec-prof] finds its phase line claimed by the first's
    profile; it adds no burst of its own (it made 3 sessions of 48 rounds out of 2 of 32)."""
    from memra_obs.report.inputs import read

    logs = []
    for seed in (1, 2):
        with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
            drive(cap.observer, [16], seed=seed)
        logs.append(cap.lines)
    a0, a1 = logs
    lines = [a0[0], a1[0], *a0[1:], *a1[1:]]
    got, tail = rebuild(lines)
    assert sum(e.rounds for e in of(got, SessionEndRecord)) == len(of(got, RoundRecord)) == 32
    assert tail.stats.orphans["prof"] == 1 and "not counted twice" in tail.notes[0]
    (tmp_path / "mini.log").write_text("\n".join(lines) + "\n")
    assert len(read(str(tmp_path / "mini.log")).rounds) == 32  # the report: the same Rebuilder


def test_a_profile_after_its_burst_was_laid_out_does_not_count_its_rounds_twice(fake_clock):
    """A [spec-prof] (and its rows) arriving past --linger after its first burst's phase line:
    that burst is already published; the late lines are reported unplaced, never a second
    burst of the same rounds."""
    with capture(level=2, prof=True) as cap:
        drive(cap.observer, [6])
    lines = [x for x in cap.lines if not x.startswith(("[spec-prof-summary]", "[spec-advice]"))]
    assert [x.split(" ", 1)[0] for x in lines[:3]] == [
        "[glm5-phase]",
        "[glm5-phase-v]",
        "[spec-prof]",
    ]
    for gap_s, unplaced in ((0.0, 0), (0.6, 1 + 6)):  # the profile and its six rows
        out: list[Any] = []
        notes: list[str] = []
        tail = Tail(Rebuilder("w"), out.extend, out=None, notes=notes.append)
        t0 = 10**15
        tail.feed(("\n".join(lines[:2]) + "\n").encode(), t0)
        tail.tick(t0 + int(gap_s * 1e9))
        tail.feed(("\n".join(lines[2:]) + "\n").encode(), t0 + int(gap_s * 1e9))
        tail.close(t0 + int(gap_s * 1e9) + 1)
        assert len(of(out, RoundRecord)) == 6 and len(of(out, BurstRecord)) == 1, gap_s
        assert tail.stats.total_orphans == unplaced
        late = [n for n in notes if "[spec-prof] after its first burst was laid out" in n]
        assert len(late) == (unplaced > 0), notes  # said as what it is, not as a lost line


def test_notes_never_land_inside_a_line():
    """A partial line is passed through after a pause; a report about it waits for the
    line's end, so the output still splits into the input's lines plus whole notes."""
    out = bytearray()

    class Out:
        def write(self, b: bytes) -> None:
            out.extend(b)

        def flush(self) -> None:
            pass

    tail = Tail(Rebuilder("w"), lambda b: None, out=Out())  # type: ignore[arg-type]
    tail.feed(b"[glm5-phase] rounds=1 k=4 total=", 0)
    tail.tick(500_000_000)
    assert bytes(out) == b"[glm5-phase] rounds=1 k=4 total="  # passed through while waiting
    tail.feed(b"oops\nnext line\n", 600_000_000)
    tail.close(700_000_000)
    lines = bytes(out).split(b"\n")
    assert lines[0] == b"[glm5-phase] rounds=1 k=4 total=oops"
    assert lines[1] == b"next line"  # the chunk goes through first, its reports after it
    assert lines[2].startswith(b"[memra-obs] tail: -:1: malformed phase line")
    assert lines[3:] == [b""]


PHASE_LINE = (
    "[glm5-phase] rounds=6 k=4 total=29.37ms | draft=9.49 verify=16.33 accept=1.77 roll=0.83 "
    "maint=0.95 | per-round ms: draft=1.581 verify=2.722 accept=0.295 roll=0.138 maint=0.158 "
    "total=4.895"
)


def test_a_session_without_rounds_still_has_a_sane_span():
    """``[spec-prof-summary] rounds=0`` alone (a request that ran no round) is a session
    that starts and ends when the line arrived."""
    got, _ = rebuild(["[spec-prof-summary] rounds=0"])
    s, e = got
    assert type(s) is SessionRecord and type(e) is SessionEndRecord
    assert e.end_ns_mono == s.start_ns_mono and (e.rounds, e.bursts) == (0, 0)


def test_a_session_without_rounds_is_of_the_streams_family_as_in_the_worker(fake_clock):
    """A request cancelled before its first round (``rounds=0`` summary) is a session of the
    worker's family, with the profile on, as the worker's own record says: not a
    ``family="unknown"`` set of series on /metrics that the worker never publishes."""
    with capture(level=1, prof=True) as cap:
        drive(cap.observer, [6])
        with cap.observer.session("glm5"):
            pass
    assert cap.lines[-1] == "[spec-prof-summary] rounds=0"
    got, _ = rebuild(cap.lines)
    worker = [(r.family, r.prof) for r in cap.records if type(r) is SessionRecord]
    assert [(r.family, r.prof) for r in of(got, SessionRecord)] == worker == [("glm5", True)] * 2


def test_a_first_burst_of_no_round_is_of_the_streams_family_as_in_the_worker(fake_clock):
    """A request whose first burst ran no round (``s.burst(4).end()``: its ``[spec-prof]``
    says ``first_burst_rounds=0`` and no phase line comes) and then a burst of 3: the session
    was ``family="unknown"``, level 0, and the 3 rounds went under it (a whole unknown-family
    set of series on /metrics the worker never publishes)."""
    with capture(level=1, prof=True) as cap:
        drive(cap.observer, [6])
        with cap.observer.session("glm5") as s:
            s.burst(4).end()
            b = s.burst(4)
            for _ in range(3):
                for step in (b.begin_round, b.end_draft, b.end_verify, b.end_accept):
                    step()
                b.end_rollback()
                b.end_round(k=4, j=2)
            b.end()
    got, _ = rebuild(cap.lines)
    worker = [(r.family, r.level) for r in cap.records if type(r) is SessionRecord]
    assert [(r.family, r.level) for r in of(got, SessionRecord)] == worker == [("glm5", 1)] * 2
    assert [e.rounds for e in of(got, SessionEndRecord)] == [6, 3]


def test_a_log_begun_mid_session_keeps_its_later_bursts_in_their_family(fake_clock):
    """A log read from its middle (``--follow`` starts at the file's end) whose first line is a
    session's ``[spec-prof]``: its profile and rows cannot be told from a profile-only stream's
    and count under ``unknown``, but every later burst of that session went there too (10 of
    10 rounds unknown); now a tagged burst never joins an untagged session."""
    with capture(level=1, prof=True) as cap:
        drive(cap.observer, [10], per_burst=6)
    assert cap.lines[0].startswith("[glm5-phase]") and cap.lines[1].startswith("[spec-prof]")
    got, _ = rebuild(cap.lines[1:])
    ends = of(got, SessionEndRecord)
    fams = [(r.family, e.rounds) for r, e in zip(of(got, SessionRecord), ends, strict=True)]
    assert fams == [("unknown", 6), ("glm5", 4)]


def test_a_session_without_rounds_in_a_backlog_follows_the_sessions_before_it(fake_clock):
    """A backlog lays sessions back to back past the arrival: a ``rounds=0`` one comes after
    the session before it, not inside it."""
    with capture(level=1, prof=True) as cap:
        drive(cap.observer, [6, 6])
    got, _ = rebuild([*cap.lines, "[spec-prof-summary] rounds=0"])
    (*_, e1, e2), (*_, s2) = of(got, SessionEndRecord), of(got, SessionRecord)
    assert s2.start_ns_mono >= e1.end_ns_mono and e2.rounds == 0


_PHASE = ("[glm5-phase] rounds=3 k=4 total=6.00ms | draft=1.50 verify=3.00 accept=0.60 roll=0.45 "
          "maint=0.45 | per-round ms: draft=0.500 verify=1.000 accept=0.200 roll=0.150 "
          "maint=0.150 total=2.000")  # fmt: skip


def test_sessions_laid_back_to_back_never_overlap_in_epoch_time():
    """Each session reads an anchor pair; the reads' jitter (hundreds of ns) must not make
    back-to-back sessions overlap once mapped to epoch; a wall-clock step is taken up."""
    jitter, step = itertools.cycle([0, -250, 300]), [0]
    rb = Rebuilder("w", max_bursts=1, epoch_ns=lambda: 10**18 + next(jitter) + step[0],
                   mono_ns=lambda: 7 * 10**12)  # fmt: skip
    for _ in range(4):  # a backlog: four bursts, a session each, laid back to back
        rb.feed(parse_line(_PHASE), 10**15)
    rb.close()
    spans: list[Any] = []
    SpanBuilder().add(rb.take(), spans)
    bursts = sorted((sp[4], sp[5]) for sp in spans if sp[0] == "spec.burst")
    assert len(bursts) == 4 and all(b[1] <= c[0] for b, c in itertools.pairwise(bursts))
    step[0] = 5 * 10**9  # NTP stepped the wall clock: the next session is anchored anew
    rb.feed(parse_line(_PHASE), 10**15 + 1)
    rb.close()
    (s,) = of(rb.take(), SessionRecord)
    assert s.anchor_ns_mono == 7 * 10**12  # the pair as read: epoch - mono is the offset
    assert abs(s.anchor_ns_epoch - s.anchor_ns_mono - (10**18 + 5 * 10**9 - 7 * 10**12)) < 1000


def test_a_burst_settles_after_linger_ns_idle_and_its_session_after_the_gap():
    """``tick``: the burst of a line is laid out once ``linger_ns`` passed without another
    line (not a ns before), its session ends ``session_gap_ns`` after its last line; a tick
    with nothing open publishes nothing."""
    rb, t = Rebuilder("w", linger_ns=500, session_gap_ns=2_000), 10**15
    rb.tick(t)
    assert rb.take() == []
    rb.feed(parse_line(_PHASE), t)
    rb.tick(t + 499)
    assert rb.take() == []
    rb.tick(t + 500)
    assert [type(r) for r in rb.take()] == [SessionRecord, RoundRecord, BurstRecord]
    rb.tick(t + 1_999)
    assert rb.take() == []
    rb.tick(t + 2_000)
    (end,) = rb.take()
    assert type(end) is SessionEndRecord and (end.rounds, end.bursts) == (3, 1)
    rb.tick(t + 10**12)
    assert rb.take() == []
    # A session its summary closed waits linger_ns for the [spec-advice] line after it.
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        drive(cap.observer, [3])
    for line in cap.lines:
        if not line.startswith("[spec-advice]"):
            rb.feed(parse_line(line), t)
    assert SessionEndRecord not in [type(r) for r in rb.take()]
    rb.tick(t + 499)
    assert rb.take() == []
    rb.tick(t + 500)
    assert [type(r) for r in rb.take()] == [SessionEndRecord]


def test_profiled_sessions_in_a_backlog_follow_one_another_with_their_creation(fake_clock):
    """Read at once (a finished log), profiled sessions are laid back to back: each one's
    creation and unattributed time lie before its first burst and after the previous
    session's end, as the loop ran them."""
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        drive(cap.observer, [7, 7, 7])
    got, tail = rebuild(cap.lines)
    starts, ends = of(got, SessionRecord), of(got, SessionEndRecord)
    assert len(starts) == len(ends) == 3 and tail.notes == []
    for f, s in zip(of(got, FirstTokenRecord), starts, strict=True):
        assert f.intervals[0][1] > s.start_ns_mono  # the unattributed time first
    for e, s in zip(ends[:-1], starts[1:], strict=True):
        assert e.end_ns_mono <= s.start_ns_mono


def test_a_pause_past_the_gap_starts_a_session_unless_a_profile_marks_them(fake_clock):
    """Without the profile, a burst arriving more than ``session_gap_ns`` after the stream's
    last line starts a new session; with it, a session lasts from its [spec-prof] to its
    summary however long the request paused between bursts."""
    rb, t = Rebuilder("w", session_gap_ns=10**9), 10**15
    for dt in (0, 5 * 10**8, 4 * 10**9, 45 * 10**8):  # a pause of 3.5 s after the second
        rb.feed(parse_line(_PHASE), t + dt)
    rb.close()
    assert [e.bursts for e in of(rb.take(), SessionEndRecord)] == [2, 2]
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        drive(cap.observer, [12, 12])  # two bursts a session
    rb = Rebuilder("w", session_gap_ns=10**9)
    for i, line in enumerate(cap.lines):  # 2 s between lines
        rb.feed(parse_line(line), t + i * 2 * 10**9)
    rb.close()
    assert [(e.rounds, e.bursts) for e in of(rb.take(), SessionEndRecord)] == [(12, 2), (12, 2)]


def test_otel_traces_sampler_decides_each_rebuilt_sessions_ids():
    """The tail makes its sessions' trace ids, so it applies OTEL_TRACES_SAMPLER as a loop
    does: a session sampled out has trace and span id 0 (no spans), its records still flow."""
    from memra_obs.wiring import sessions_sampled

    def ids(env: dict[str, str]) -> list[tuple[int, int]]:
        rb = Rebuilder("w", max_bursts=1, sampled=sessions_sampled(env), rng=random.Random(3))
        for _ in range(40):
            rb.feed(parse_line(_PHASE), 10**15)
        rb.close()
        got = rb.take()
        assert len(of(got, RoundRecord)) == 40 * 3
        return [(s.trace_id, s.span_id) for s in of(got, SessionRecord)]

    assert ids({"OTEL_TRACES_SAMPLER": "always_off"}) == [(0, 0)] * 40
    assert all(t and sp for t, sp in ids({}))
    half = ids({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"})
    kept = [t for t, sp in half if t and sp]
    assert 5 < len(kept) < 35 and half.count((0, 0)) == 40 - len(kept)
    assert all(t & ((1 << 64) - 1) < 1 << 63 for t in kept), "the ratio sampler's own rule"


# ----------------------------------------------------------------------- unknown counts


def test_rounds_without_a_row_have_unknown_counts_in_spans_and_metrics(fake_clock):
    """Rounds past the 64-row log: k = j = -1 in their records, no k/j/acceptance on their
    round spans, and the per-round token histograms count only the rounds with a row."""
    from prometheus_client import CollectorRegistry

    from memra_obs.otel.spans import SpanBuilder
    from memra_obs.prom import PrometheusExporter

    with capture(level=2, prof=True, memory=lambda: [(0, 1)], verify_split=VerifySplit()) as cap:
        drive(cap.observer, [100])
    got, _ = rebuild(cap.lines)
    rounds = of(got, RoundRecord)
    assert [r.k >= 0 for r in rounds] == [True] * 64 + [False] * 36
    assert all((r.k, r.j, r.ctx, r.seq_rows) == (-1, -1, 0, 0) for r in rounds[64:])
    spans: list[Any] = []
    SpanBuilder(round_spans=1000).add(got, spans)
    round_attrs = [dict(sp[6]) for sp in spans if sp[0] == "spec.round"]
    assert len(round_attrs) == 100
    for a in round_attrs[:64]:
        assert {"memra.spec.k", "memra.spec.j", "memra.spec.acceptance_rate"} <= a.keys()
    for a in round_attrs[64:]:
        assert set(a) == {"memra.spec.round", "memra.spec.wall_ns"}
    reg = CollectorRegistry()
    PrometheusExporter(reg).export(got)
    v = reg.get_sample_value
    assert v("memra_spec_rounds_total", {"family": "glm5"}) == 100
    assert v("memra_spec_round_seconds_count", {"family": "glm5"}) == 100
    assert v("memra_spec_drafted_tokens_per_round_count", {"family": "glm5"}) == 64
    assert v("memra_spec_drafted_tokens_total", {"family": "glm5"}) == sum(r.k for r in rounds[:64])


def test_a_sessions_advice_line_reaches_its_end_record_as_in_the_worker(fake_clock):
    """The `[spec-advice]` line after a summary lands on the session's end record (the
    span's `memra.spec.advice.*`), also when a chunk ends between the two lines, and for a
    full round log whose session goes on after its summary."""
    with capture(level=2, prof=True, memory=lambda: [(0, 4096)], verify_split=VerifySplit()) as cap:
        drive(cap.observer, [40, 64, 100, 50])
    want = [r.advice for r in cap.records if type(r) is SessionEndRecord]
    assert all(want) and len(want) == 4
    got, _ = rebuild(cap.lines)  # the file read at once
    assert [r.advice for r in of(got, SessionEndRecord)] == want
    out: list[Any] = []
    tail = Tail(Rebuilder("w"), out.extend, out=None, notes=lambda _: None)
    t = 10**15
    for line in cap.lines:  # a chunk (and a tick) a line: a summary's chunk ends before its advice
        t += 1_000_000
        tail.feed((line + "\n").encode(), t)
        tail.tick(t)
    tail.close(t + 1)
    assert [r.advice for r in of(out, SessionEndRecord)] == want
    spans: list[Any] = []
    SpanBuilder(round_spans=0).add(out, spans)
    advised = [dict(sp[6]) for sp in spans if sp[0] == "spec.session"]
    assert len(advised) == 4 and all("memra.spec.advice.recommended_k" in a for a in advised)


def test_a_bursts_phase_totals_are_the_middle_of_where_its_two_roundings_agree():
    """A phase line prints each total to 0.01 ms and each per-round mean to 0.001 ms: the truth
    lies within 5 µs of the one and within 0.5 µs x rounds of the other's x rounds. The burst
    total is the middle of the two intervals' overlap, never negative; where they miss each
    other (no rounding explains both), the per-round value alone."""

    def phases(n: int, totals: str, means: str) -> tuple[int, ...]:
        d, v, a, r, m = totals.split()
        pd, pv, pa, pr, pm = means.split()
        line = (f"[glm5-phase] rounds={n} k=4 total=1.00ms | draft={d} verify={v} accept={a} "
                f"roll={r} maint={m} | per-round ms: draft={pd} verify={pv} accept={pa} "
                f"roll={pr} maint={pm} total=0.100")  # fmt: skip
        got, tail = rebuild([line])
        assert tail.stats.total_malformed == 0, tail.notes
        (b,) = of(got, BurstRecord)
        return b.phases.draft, b.phases.verify, b.phases.accept, b.phases.roll, b.phases.maint

    # 100 rounds: the total's ±5 µs lies inside the means' ±50 µs: the total's value.
    # 0.00 and 0.000: [0, 5 µs]. 12.00 against 100 x 0.100: they miss; the means' 10 ms.
    got = phases(100, "10.04 5.00 12.00 0.00 1.00", "0.100 0.050 0.100 0.000 0.010")
    assert got == (10_040_000, 5_000_000, 10_000_000, 2_500, 1_000_000)
    # 2 rounds: the means' ±1 µs lies inside the total's ±5 µs: the means' value.
    assert phases(2, "1.00 1.01 0.10 0.10 0.10", "0.501 0.504 0.050 0.050 0.050")[:2] == (
        1_002_000,
        1_008_000,
    )
    # 20 rounds: 4.01 ± 0.005 and 20 x 0.200 ± 0.01 overlap on [4.005, 4.010] ms.
    assert phases(20, "4.01 1.00 1.00 1.00 1.00", "0.200 0.050 0.050 0.050 0.050")[0] == 4_007_500


_SEVEN = ("[glm5-phase] rounds=7 k=4 total=8.08ms | draft=1.01 verify=5.03 accept=0.52 roll=0.81 "
          "maint=0.71 | per-round ms: draft=0.144 verify=0.719 accept=0.074 roll=0.116 "
          "maint=0.101 total=1.154")  # fmt: skip


def test_rounds_without_rows_share_their_bursts_totals_to_the_ns():
    """Rounds known only by their line's means split each phase's total as evenly as whole ns
    allow: they differ by at most 1 ns, and each phase sums back to the burst's exactly."""
    got, tail = rebuild([_SEVEN])
    (b,) = of(got, BurstRecord)
    rounds = of(got, RoundRecord)
    assert tail.notes == [] and len(rounds) == 7
    assert len([r for r in got if type(r) is RoundRecord]) <= 6  # runs of equal rounds
    totals = (b.phases.draft, b.phases.verify, b.phases.accept, b.phases.roll, b.phases.maint)
    for i, total in enumerate(totals):
        each = [r.phase_ns()[i] for r in rounds]
        assert sum(each) == total and max(each) - min(each) <= 1, (i, each)
    assert rounds[-1].t_ns_mono[5] == b.end_ns_mono


def test_a_rows_rest_is_split_by_its_lines_rollback_to_maintenance_ratio():
    """A row prints rollback and maintenance as one ``rest_ms``; where rows do not cover the
    burst, the line's rollback : maintenance totals split it."""
    row = ("[spec-prof-rounds] row=0 wall_ms=1.2 draft_ms=0.1 verify_ms=0.7 accept_ms=0.1 "
           "rest_ms=0.3 k=4 j=2 ctx=10 seq_rows=0")  # fmt: skip
    got, tail = rebuild([_SEVEN, row])
    assert tail.notes == []
    (b,) = of(got, BurstRecord)
    r0 = of(got, RoundRecord)[0]
    share = b.phases.roll / (b.phases.roll + b.phases.maint)
    assert r0.phase_ns()[:3] == (100_000, 700_000, 100_000)
    assert r0.phase_ns()[3] == round(300_000 * share) and sum(r0.phase_ns()[3:]) == 300_000


def test_an_advice_line_with_no_session_is_ignored(fake_clock):
    """A [spec-advice] line whose session is not in the stream (a log cut after its summary)
    places nothing and reports nothing."""
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        drive(cap.observer, [40])
    advice = next(x for x in cap.lines if x.startswith("[spec-advice]"))
    got, tail = rebuild([advice])
    assert got == [] and tail.notes == [] and tail.stats.total_orphans == 0


def test_a_run_of_equal_rounds_expands_to_rounds_back_to_back():
    """``each_round``: a record standing for ``repeat`` rounds gives that many, numbered on,
    each with the run's phases and tokens, each starting where the one before ended."""
    from memra_obs.timeline import each_round

    r = RoundRecord(1, 0, 7, (100, 103, 110, 111, 112, 114), 4, 2, 9, 0, None, repeat=3)
    got = each_round(r)
    assert [x.index for x in got] == [7, 8, 9] and {x.repeat for x in got} == {1}
    assert all(x.phase_ns() == (3, 7, 1, 1, 2) and x.wall_ns == 14 for x in got)
    assert all(a.t_ns_mono[5] == b.t_ns_mono[0] for a, b in itertools.pairwise(got))
    assert got[0].t_ns_mono == r.t_ns_mono and sum(x.tokens for x in got) == 3 * (2 + 1)


def _interleaved(live: bool, loops: int = 4, seconds: int = 20) -> tuple[list[int], list[int]]:
    """``loops`` loop threads of one worker on one stream, each printing a 30 ms burst's line
    every 30 ms; fed at their arrival times. Returns (burst ends, arrivals), ns mono."""
    clock = [10**12]
    rb = Rebuilder("w", rng=random.Random(0), mono_ns=lambda: clock[0], epoch_ns=lambda: clock[0])
    rb.live = live
    line = parse_line(PHASE_LINE.replace("total=29.37ms", "total=30.00ms"))
    arrivals = sorted(clock[0] + (i + 1) * 30_000_000 + c * 7_000_000
                      for i in range(seconds * 33) for c in range(loops))  # fmt: skip
    out: list[Any] = []
    for t in arrivals:
        clock[0] = t
        rb.feed(line, t)
        rb.tick(t)
        out += rb.take()
    rb.close()
    out += rb.take()
    bursts = [b for b in out if type(b) is BurstRecord]
    for a, b in itertools.pairwise(bursts):  # a session's bursts never overlap
        assert a.session != b.session or a.end_ns_mono <= b.start_ns_mono
    return [b.end_ns_mono for b in bursts], arrivals


def test_loops_interleaving_a_live_stream_stay_with_the_clock():
    """Four loop threads on one live stream: laid back to back, the bursts' 4 x the time ran
    3 x ahead of the clock without end (a day's tail put spans and exemplars hours in the
    future; Prometheus then refused every later exemplar as out of order). Read live, a
    session laid more than ``linger_ns`` ahead starts at its line's arrival (here a session
    is 64 bursts: at most ~1.5 s ahead); a backlog still runs ahead, as said."""
    ends, arrivals = _interleaved(live=True)
    assert max(ends) - arrivals[-1] < 2 * 10**9
    _interleaved(live=True, loops=1)  # one loop read live: no burst of a session overlaps


def test_one_loops_sessions_shipped_in_batches_never_overlap():
    """One loop's lines forwarded every 5 s (a log shipper's flush), read live: a session
    whose line came in the read the previous burst's did is laid after it, not moved back to
    the batch's arrival (11 of 20 sessions began inside the previous one, by up to 1.2 s)."""
    rb = Rebuilder("w", rng=random.Random(0), mono_ns=lambda: 0, epoch_ns=lambda: 0,
                   max_bursts=20)  # fmt: skip
    rb.live = True
    line = parse_line(PHASE_LINE.replace("total=29.37ms", "total=30.00ms"))
    out: list[Any] = []
    for batch in range(12):  # 5 s of one loop's 30 ms bursts a batch, ~8 sessions
        t = (batch + 1) * 5 * 10**9
        for _ in range(166):
            rb.feed(line, t)
        rb.tick(t)
        out += rb.take()
    rb.close()
    out += rb.take()
    starts = {r.session: r.start_ns_mono for r in out if type(r) is SessionRecord}
    ends = {r.session: r.end_ns_mono for r in out if type(r) is SessionEndRecord}
    order = sorted(starts, key=starts.get)
    assert len(order) > 50
    assert all(ends[a] <= starts[b] for a, b in itertools.pairwise(order))
    ends, arrivals = _interleaved(live=False)
    assert max(ends) - arrivals[-1] > 30 * 10**9  # (a backlog: bursts back to back, documented)
