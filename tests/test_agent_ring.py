"""The ring: every record type round-trips bit for bit, losses are counted exactly, a
reader never sees a torn record, the cursor persists, and liveness follows the writer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memra_obs.agent import format as F
from memra_obs.agent import ring
from memra_obs.agent.reader import FormatError, RingReader
from memra_obs.agent.ring import RingSink
from memra_obs.observer import Observer
from memra_obs.records import FIRST_TOKEN_MS_FIELDS, SpecFirstTokenProf, SpecPhaseNs
from memra_obs.timeline import (
    BurstRecord,
    FirstTokenRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

U64 = st.integers(0, (1 << 64) - 1)
U32 = st.integers(0, (1 << 32) - 1)
MS = st.floats(0, 1e9, allow_nan=False, allow_infinity=False)
WORD = st.text("abcdefghijklmnopqrstuvwxyz_-.0123456789", max_size=12)
TEXT = st.text(max_size=20)

sessions = st.builds(
    SessionRecord,
    session=U64, family=TEXT, tag=TEXT, tag_v=TEXT, worker=TEXT,
    start_ns_mono=U64, anchor_ns_mono=U64, anchor_ns_epoch=U64,
    trace_id=st.integers(0, (1 << 128) - 1), span_id=U64, parent_span_id=U64,
    level=st.integers(0, 2), prof=st.booleans(), caller_trace_id=st.integers(0, (1 << 128) - 1),
)  # fmt: skip
rounds = st.builds(
    RoundRecord,
    session=U64, burst=U32, index=U32, t_ns_mono=st.tuples(U64, U64, U64, U64, U64, U64),
    k=U32, j=U32, ctx=U32, seq_rows=U32, split_ns=st.none() | st.tuples(U64, U64, U64, U64),
    repeat=st.just(1),  # a loop's rounds: one a record
)  # fmt: skip
bursts = st.builds(
    BurstRecord,
    session=U64, index=U32, k=U32, start_ns_mono=U64, end_ns_mono=U64,
    phases=st.builds(SpecPhaseNs, U64, U64, U64, U64, U64, U64),
    split_ns=st.none() | st.tuples(U64, U64, U64, U64),
    tokens=U64, hook_ns=U64, first_round=U64,
)  # fmt: skip
pairs = st.lists(st.tuples(U64, U64), max_size=16)


@st.composite
def first_tokens(draw: st.DrawFn) -> FirstTokenRecord:
    p = SpecFirstTokenProf()
    for f in FIRST_TOKEN_MS_FIELDS:
        setattr(p, f, draw(MS))
    for f in ("first_round_tokens", "first_burst_rounds", "first_burst_tokens", "draft_prime_rows",
              "draft_prime_chunks"):  # fmt: skip
        setattr(p, f, draw(U64))
    p.draft_prime_arm = draw(st.sampled_from(["", "eager", "chunked"]))
    p.draft_kv_mb = draw(MS)
    p.free_mb_before = draw(pairs)
    p.free_mb_after = draw(pairs)
    ivs = draw(st.lists(st.tuples(WORD, U64, U64), max_size=14))
    return FirstTokenRecord(draw(U64), p, tuple(ivs))


ends = st.builds(SessionEndRecord, U64, U64, U64, U64, U64, TEXT)
records = st.one_of(sessions, rounds, bursts, first_tokens(), ends)


def _read_all(path: str) -> list:
    r = RingReader(path)
    out = []
    while True:
        items = r.poll(1 << 20)
        if not items:
            break
        out.extend(items)
    r.close()
    return out


def _plain(item):
    return item.rec[0] if item.kind == F.KIND_SESSION else item.rec


@given(records)
def test_codec_round_trips_every_record(rec):
    """encode -> decode gives back an equal record, every field, every type."""
    kind, payload = F.encode(rec)
    back = F.decode(kind, payload)
    if kind == F.KIND_SESSION:
        back = back[0]
    assert back == rec


@given(sessions)
def test_a_session_from_a_writer_without_the_callers_trace_id_reads_as_none(rec):
    """The caller's trace id follows a session's strings only when there is one: a session
    without it (or from a writer before it) reads as no caller, and its record keeps its size."""
    rec = rec._replace(caller_trace_id=rec.caller_trace_id or 1)
    kind, payload = F.encode(rec)
    back, _ = F.decode(kind, payload[: -F._PAIR.size])
    assert back == rec._replace(caller_trace_id=0)
    assert len(F.encode(back)[1]) == len(payload) - F._PAIR.size


def test_a_session_without_a_caller_reads_none_after_the_ring_wraps(tmp_path):
    """A session's last slot is written whole: what an earlier lap left after its strings
    read as the caller's trace id (the agent's requests file joined an unsampled session to
    a trace that never was)."""
    sink = RingSink(str(tmp_path), worker="w", slots=64)
    reader = RingReader(sink.path)
    for i in range(64):  # a lap of rounds: no slot is zero any more
        sink.on_round(RoundRecord(7, 0, i, tuple(range(1 << 40, (1 << 40) + 6)), 4, 2, 9, 0, None))
    reader.poll()  # read (the last MAXSPAN slots may count as lost)
    fam = "deepseek"  # a session of 2 slots, the second mostly free
    s = SessionRecord(1, fam, f"{fam}-phase", f"{fam}-phase-v", "w", 1, 1, 1, 0, 0, 0, 1, False)
    sink.on_session(s)
    (item,) = reader.poll()
    assert item.rec[0] == s
    sink.shutdown()


def test_a_ring_of_another_format_version_names_both(tmp_path, monkeypatch):
    """Mid rolling deploy a worker's ring of another version is refused at attach naming both
    versions (it said "not a memra-obs ring v2"), never decoded."""
    monkeypatch.setattr(F, "VERSION", 3)
    sink = RingSink(str(tmp_path), worker="w", slots=64)
    monkeypatch.setattr(F, "VERSION", 2)
    with pytest.raises(FormatError, match="ring format v3, this agent reads v2"):
        RingReader(sink.path)
    sink.shutdown()


@given(st.lists(records, max_size=30))
def test_records_round_trip_through_a_ring(tmp_path_factory, recs):
    """What the sink writes, the reader reads back equal and in order (multi-slot included)."""
    d = tmp_path_factory.mktemp("ring")
    sink = RingSink(str(d), worker="w", slots=1024, table_entries=8)
    hooks = {SessionRecord: sink.on_session, RoundRecord: sink.on_round, BurstRecord: sink.on_burst,
             FirstTokenRecord: sink.on_first_token, SessionEndRecord: sink.on_session_end}  # fmt: skip
    for r in recs:
        hooks[type(r)](r)
    assert sink.refused == 0
    got = [_plain(i) for i in _read_all(sink.path)]
    sink.shutdown()
    assert got == recs


def test_values_the_format_cannot_hold_are_refused_and_counted(tmp_path):
    """A negative count or a huge profile is refused (counted), never raised into the loop."""
    sink = RingSink(str(tmp_path), slots=64)
    sink.on_round(RoundRecord(1, 0, 0, (0,) * 6, -1, 0, 0, 0, None))
    p = SpecFirstTokenProf()
    p.free_mb_before = [(i, i) for i in 200 * [0]]
    sink.on_first_token(FirstTokenRecord(1, p, ()))
    sink.on_round(RoundRecord(1, 0, 1, (1,) * 6, 4, 2, 10, 0, None))
    assert sink.refused == 2 and sink.written == 1
    items = _read_all(sink.path)
    assert [i.rec.index for i in items] == [1]
    assert RingReader(sink.path).state().refused == 2


def _round(i: int) -> RoundRecord:
    # Every field derives from i: a torn copy cannot look consistent.
    t = tuple(i * 1000 + n for n in range(6))
    return RoundRecord(
        i, i & 0xFFFF, i, t, i % 7, i % 5, i * 3 % 1000, i % 11, (i, i + 1, i + 2, i + 3)
    )


def _check_round(r: RoundRecord) -> None:
    assert r == _round(r.session)


def test_a_reader_that_falls_behind_counts_exactly_what_it_lost(tmp_path):
    """A tiny ring, lapped many times: delivered + lost == written, delivered are the newest."""
    sink = RingSink(str(tmp_path), slots=64)
    reader = RingReader(sink.path)
    n = 1000
    delivered = []
    for i in range(n):
        sink.on_round(_round(i))
        if i % 300 == 0:  # read now and then, far too rarely
            delivered += [it.rec for it in reader.poll(4096)]
    delivered += [it.rec for it in reader.poll(4096)]
    for r in delivered:
        _check_round(r)
    idx = [r.index for r in delivered]
    assert idx == sorted(idx) and idx[-1] == n - 1
    assert reader.lost == n - len(delivered) > 0
    assert reader.rec == n
    # A record spanning several slots is lost once, not once per slot.
    sink2 = RingSink(str(tmp_path), slots=64)
    p = SpecFirstTokenProf()
    p.free_mb_before = [(i, 1000) for i in range(16)]
    big = FirstTokenRecord(7, p, tuple((f"b{i}", i, i + 1) for i in range(12)))
    assert len(F.encode(big)[1]) > 5 * F.PAYLOAD
    r2 = RingReader(sink2.path)
    for _ in range(40):
        sink2.on_first_token(big)
    got = r2.poll(4096)
    assert all(it.rec == big for it in got)
    assert r2.lost + len(got) == 40 and r2.lost > 0
    sink.shutdown()
    sink2.shutdown()


_WRITER = textwrap.dedent(
    """
    import sys, time
    from memra_obs.agent.ring import RingSink
    from memra_obs.timeline import FirstTokenRecord
    from memra_obs.records import SpecFirstTokenProf
    sys.path.insert(0, {tests!r})
    from test_agent_ring import _round
    sink = RingSink({d!r}, worker="stress", slots=128)
    print(sink.path, flush=True)
    sys.stdin.readline()
    p = SpecFirstTokenProf(); p.free_mb_before = [(i, i) for i in range(8)]
    for i in range({n}):
        if i % 97 == 0:
            sink.on_first_token(FirstTokenRecord(i, p, (("x", i, i),) * 5))
        else:
            sink.on_round(_round(i))
    print(sink.written, flush=True)
    sys.stdin.readline()
    """
)


def test_a_concurrent_reader_never_sees_a_torn_record(tmp_path):
    """A writer process laps a small ring flat out while the reader copies: every record read
    is intact, in order, and delivered + lost == written."""
    n = 200_000
    code = _WRITER.format(d=str(tmp_path), n=n, tests=os.path.dirname(__file__))
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        path = p.stdout.readline().strip()
        reader = RingReader(path)
        p.stdin.write("go\n")
        p.stdin.flush()
        got = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got += reader.poll(96)
            if reader.rec >= n:
                break
        written = int(p.stdout.readline())
        got += reader.poll(4096)
        p.stdin.write("bye\n")
        p.stdin.flush()
        assert p.wait(10) == 0
    finally:
        p.kill()
        p.wait()
    assert written == n
    last = -1
    for it in got:
        r = it.rec
        if isinstance(r, RoundRecord):
            _check_round(r)
            key = r.index
        else:
            assert (
                r.prof.free_mb_before == [(i, i) for i in range(8)]
                and r.intervals[0][1] == r.session
            )
            key = r.session
        assert key > last
        last = key
    assert len(got) + reader.lost == n
    assert reader.read == len(got)  # a damaged record would have raised FormatError
    # It did read along, not just the last lap: the ring holds 128 records, so more than two
    # laps' worth were read while the writer ran (tens of thousands even with both processes
    # on one busy core; a fixed share of n was up to the scheduler).
    assert len(got) > 2 * 128


def test_cursor_persists_and_a_new_reader_resumes(tmp_path):
    """commit() stores the cursor in the ring; the next reader starts after it."""
    sink = RingSink(str(tmp_path), slots=256)
    for i in range(10):
        sink.on_round(_round(i))
    r1 = RingReader(sink.path)
    assert [it.rec.index for it in r1.poll(5)] == [0, 1, 2, 3, 4]
    r1.commit(r1.cursor())
    r1.close()
    for i in range(10, 12):
        sink.on_round(_round(i))
    r2 = RingReader(sink.path)
    assert [it.rec.index for it in r2.poll(4096)] == list(range(5, 12))
    assert r2.lost == 0
    sink.shutdown()


def test_writer_gone_follows_the_process_and_shutdown(tmp_path):
    """The liveness lock is held while the writer lives and released by exit or shutdown."""
    sink = RingSink(str(tmp_path), slots=64)
    r = RingReader(sink.path)
    assert not r.writer_gone()
    sink.shutdown()
    assert r.writer_gone() and r.state().closed
    code = f"from memra_obs.agent.ring import RingSink; import sys; print(RingSink({str(tmp_path)!r}, slots=64).path, flush=True); sys.stdin.readline()"
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        r2 = RingReader(p.stdout.readline().strip())
        assert not r2.writer_gone()
        p.kill()
        p.wait(10)
        assert r2.writer_gone() and not r2.state().closed
    finally:
        p.kill()
        p.wait()


def test_rings_leave_no_fork_hook_behind(tmp_path, monkeypatch):
    """Each RingSink registered its own fork hook, which Python can never remove: a process
    that replaced its observer 10,000 times (configure() in agent mode) forked 18x slower.
    One hook serves every live ring; a ring gone is gone from it."""
    import gc

    from memra_obs.agent import ring as ring_mod

    hooks: list[object] = []
    monkeypatch.setattr(os, "register_at_fork", lambda **kw: hooks.append(kw))
    for i in range(20):
        RingSink(str(tmp_path), worker=f"w{i}", slots=64).shutdown()
    gc.collect()
    assert hooks == [] and len(ring_mod._RINGS) == 0


def test_a_forked_child_writes_its_own_ring(tmp_path):
    """After fork the child gets a fresh ring; the parent's stays the parent's, and so do
    the dropped rounds it counts (the child's from the fork on)."""
    sink = RingSink(str(tmp_path), worker="fork", slots=64)
    dropped = [2]
    sink.dropped_rounds = lambda: dropped[0]
    parent_path = sink.path
    sink.on_round(_round(1))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            sink.on_round(_round(2))
            code = 0 if sink.path != parent_path else 3
            dropped[0] += 1
            sink.shutdown()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    rings = sorted(p for p in os.listdir(tmp_path) if p.endswith(".ring"))
    assert len(rings) == 2
    assert [i.rec.index for i in _read_all(parent_path)] == [1]
    other = next(str(tmp_path / p) for p in rings if str(tmp_path / p) != parent_path)
    assert [i.rec.index for i in _read_all(other)] == [2]
    assert RingReader(other).state().dropped_rounds == 1
    assert not RingReader(parent_path).writer_gone()
    sink.shutdown()
    assert RingReader(parent_path).state().dropped_rounds == 2


def test_a_forked_child_that_records_nothing_makes_no_ring(tmp_path):
    """Each forked child made its 8 MiB ring at the fork: a ``subprocess`` with
    ``preexec_fn`` between fork and exec, every worker of a tokenizer pool (eight filled a
    container's 64 MiB /dev/shm). A child's ring is made at its first record."""
    sink = RingSink(str(tmp_path), worker="fork", slots=64)
    subprocess.run(["true"], preexec_fn=os.setpgrp, check=True)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(len(os.listdir(tmp_path)))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    assert os.listdir(tmp_path) == [os.path.basename(sink.path)]
    sink.shutdown()


def test_a_forked_child_without_a_ring_of_its_own_says_so(tmp_path, monkeypatch):
    """A forked child whose ring cannot be made says once that its records are not
    published; its records then go nowhere, without raising."""
    said: list[str] = []
    monkeypatch.setattr(ring, "say_once", lambda key, msg, kind="": said.append(msg))
    sink = RingSink(str(tmp_path), worker="fork", slots=64)
    (tmp_path / "file").touch()
    sink.directory = str(tmp_path / "file" / "sub")  # no ring can be made there
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 3
        try:
            sink.on_round(_round(2))
            mine = [m for m in said if sink.directory in m]
            code = 0 if len(mine) == 1 and "not published" in mine[0] else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _read_all(sink.path) == [] and said == []
    sink.shutdown()


def test_records_after_the_ring_is_shut_are_said_once(tmp_path, caplog):
    """A session still open when its observer was shut down (configure() again, the exit
    with a loop thread running): the queue says its drops so, the ring went silent."""
    sink = RingSink(str(tmp_path), slots=64)
    obs = Observer([sink], level=0, prof=False)
    s = obs.session("glm5")
    obs.shutdown()
    for _ in range(3):
        b = s.burst(4)
        b.begin_round()
        for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
            end()
        b.end_round(k=4, j=1)
        b.end()
    s.end()
    said = [r.getMessage() for r in caplog.records if "still open when" in r.getMessage()]
    assert len(said) == 1 and sink.path in said[0] and sink.written == 1


def test_a_ring_directory_no_agent_has_read_is_said_once(tmp_path, caplog):
    """``MEMRA_OBS_AGENT=/dev/shm/memra-ob`` (a typo of the agent's ``--dir``): the worker made
    the directory and wrote its ring there, silently, for no agent to read. A directory without
    the agent's lock file is said once, with the agent's command; one an agent held is not."""
    fresh, served = str(tmp_path / "typo"), str(tmp_path / "served")
    sinks = [RingSink.create(fresh, slots=64) for _ in range(2)]
    said = [r.getMessage() for r in caplog.records if "no agent has read" in r.getMessage()]
    assert len(said) == 1 and f"`memra-obs agent --dir {fresh}` runs" in said[0], said
    os.makedirs(served)
    open(os.path.join(served, ".agent.lock"), "w").close()  # what an agent leaves
    sinks.append(RingSink.create(served, slots=64))
    assert not [r for r in caplog.records if f"{served}: no agent" in r.getMessage()]
    for sink in sinks:
        sink.shutdown()


def test_a_file_that_is_not_a_ring_is_refused(tmp_path):
    """Junk in the directory is a FormatError, not a crash."""
    p = tmp_path / "junk.ring"
    p.write_bytes(b"x" * 8192)
    with pytest.raises(FormatError):
        RingReader(str(p))


def test_observer_records_reach_the_ring_with_trace_ids(tmp_path):
    """RingSink asks for trace ids, so sessions carry them into the ring."""
    sink = RingSink(str(tmp_path), slots=256)
    obs = Observer([sink], level=0, prof=False)
    with obs.session("glm5") as s:
        b = s.burst(4)
        b.begin_round()
        for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
            end()
        b.end_round(k=4, j=1, ctx=3)
        b.end()
    items = _read_all(sink.path)
    srec = items[0].rec[0]
    assert srec.trace_id and srec.span_id
    assert [type(_plain(i)).__name__ for i in items] == [
        "SessionRecord", "RoundRecord", "BurstRecord", "SessionEndRecord",
    ]  # fmt: skip
    sink.shutdown()


def test_a_ring_not_ours_to_write_is_read_without_persisting(tmp_path, monkeypatch):
    """Without write permission the reader still reads (read-only map); commit is a no-op."""
    sink = RingSink(str(tmp_path), slots=64)
    sink.on_round(_round(3))
    real_open = os.open

    def no_write(path, flags, *a):
        if flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_write)
    r = RingReader(sink.path)
    monkeypatch.setattr(os, "open", real_open)
    assert not r.writable
    assert [i.rec.index for i in r.poll()] == [3]
    r.commit(r.cursor())
    assert RingReader(sink.path).pos == 0
    assert not r.writer_gone()
    sink.shutdown()
    assert r.writer_gone()


def test_ring_directory_and_slots_knob(tmp_path):
    """A bare MEMRA_OBS_AGENT name lives in /dev/shm; MEMRA_OBS_RING_SLOTS is a power of two."""
    from memra_obs.agent.ring import ring_directory
    from memra_obs.environment import ConfigError, Settings

    assert ring_directory(str(tmp_path)) == str(tmp_path)
    if os.path.isdir("/dev/shm"):
        assert ring_directory("memra-obs") == "/dev/shm/memra-obs"
    assert Settings.resolve({"MEMRA_OBS_RING_SLOTS": "128"}).ring_slots == 128
    assert Settings.resolve({}).ring_slots == 65536
    for bad in ("100", "32", "x"):
        with pytest.raises(ConfigError, match="MEMRA_OBS_RING_SLOTS"):
            Settings.resolve({"MEMRA_OBS_RING_SLOTS": bad})
    sink = RingSink.create(
        str(tmp_path), slots=Settings.resolve({"MEMRA_OBS_RING_SLOTS": "256"}).ring_slots
    )
    assert RingReader(sink.path).geo.slots == 256
    sink.shutdown()


def test_with_no_dev_shm_a_bare_ring_name_is_in_the_temp_directory_for_worker_and_agent(
    tmp_path, monkeypatch
):
    """A container without /dev/shm (``docker --ipc=none``) whose temp directories are all
    read-only: a bare ``MEMRA_OBS_AGENT`` name is ``$TMPDIR/NAME`` for the worker and the agent
    alike (it was relative to each one's working directory), and ``memra-obs agent`` starts (its
    default directory probed for a writable temp directory: FileNotFoundError, a traceback, even
    with ``--dir``)."""
    import tempfile

    from memra_obs.agent import main as agent

    def nothing_writable() -> str:
        raise FileNotFoundError(2, "No usable temporary directory found")

    isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: p != "/dev/shm" and isdir(p))
    monkeypatch.setattr(tempfile, "gettempdir", nothing_writable)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert ring.ring_directory("memra-obs") == str(tmp_path / "memra-obs")
    assert agent.default_directory() == str(tmp_path / "memra-obs")
    with pytest.raises(SystemExit) as exited:
        agent.main(["--dir", str(tmp_path), "--help"])
    assert exited.value.code == 0


def test_a_copy_the_writer_lapped_is_counted_lost_not_a_broken_ring(tmp_path):
    """A reader descheduled mid-pass (SCHED_IDLE on a busy host) while the writer laps its copy
    finds no intact record: that is a loss to count, not a rule broken (twice = ring dropped)."""
    sink = RingSink(str(tmp_path), worker="w", slots=64, table_entries=8)
    rnd = RoundRecord(1, 0, 0, (1, 2, 3, 4, 5, 6), 4, 2, 100, 0, None)

    class Stalled(RingReader):
        stall = 0

        def _walk(self, *a):  # the writer runs while the reader is off the CPU
            for _ in range(self.stall):
                sink.on_round(rnd)
            return super()._walk(*a)

    rd = Stalled(sink.path)
    for _ in range(100):
        sink.on_round(rnd)
    Stalled.stall = 200
    for _ in range(2):
        rd.poll()  # without the fix: FormatError on the second pass
    Stalled.stall = 0
    got = rd.poll(1 << 20)
    assert got and rd.caught_up()
    assert rd.read + rd.lost == rd.written == sink.written
    sink.shutdown()
    rd.close()


def test_a_session_ended_with_a_long_or_undecodable_error_still_ends(tmp_path):
    """s.end(str(exc)) with a long CUDA message, or bytes that are not UTF-8: the end record
    is published (error cut to fit), not refused (the session would stay open, spanless)."""
    sink = RingSink(str(tmp_path), worker="w", slots=1024, table_entries=8)
    long = "CUDA out of memory. " + "Tried to allocate 2.00 GiB; " * 80
    for sid, err in ((1, long), (2, "bad \udcff byte")):
        sink.on_session_end(SessionEndRecord(sid, 5, 1, 1, 2, err, "advice"))
    assert sink.refused == 0
    got = [_plain(i) for i in _read_all(sink.path)]
    assert [type(r) for r in got] == [SessionEndRecord, SessionEndRecord]
    assert long.startswith(got[0].error) and len(got[0].error) > 1000
    assert got[1].error == "bad ? byte" and got[1].advice == "advice"
    sink.shutdown()
    # Every length about the largest record's room, and cuts inside a 2-byte character.
    sink = RingSink(str(tmp_path / "b"), worker="w", slots=1024, table_entries=8)
    errs = ["E" * n for n in range(1730, 1760)] + ["x" * i + "é" * 900 for i in range(4)]
    for sid, err in enumerate(errs, start=1):
        sink.on_session_end(SessionEndRecord(sid, 5, 1, 1, 2, err, "advice"))
    assert sink.refused == 0
    got = [_plain(i) for i in _read_all(sink.path)]
    assert [r.session for r in got] == list(range(1, len(errs) + 1))
    assert all(e.startswith(r.error) and len(r.error) > 800 for e, r in zip(errs, got, strict=True))
    sink.shutdown()


def test_a_session_a_previous_agent_read_is_ended_when_its_writer_dies(tmp_path):
    """Agent A read a session's records and stopped (SIGTERM: open sessions are left to the
    next agent); the worker then died with nothing more written. Agent B ends it (WorkerGone)
    after replaying its context, or the trace's root span never appears."""
    import itertools

    from memra_obs.agent.reader import RingStream

    sink = RingSink(str(tmp_path), worker="w", slots=1024, table_entries=8)
    sink.on_session(SessionRecord(7, "spec", "t", "tv", "w", 1, 1, 1, 5, 6, 0, 0, False))
    sink.on_round(RoundRecord(7, 0, 0, (1, 2, 3, 4, 5, 6), 4, 2, 100, 0, None))
    a = RingStream(sink.path, itertools.count(1))
    seen: list = []
    a.publish(seen, 4096)
    assert len(seen) == 2  # the session and its round
    a.commit(a.cursor())
    a.close()
    sink.shutdown()  # the writer is gone (its lock with it), the session still in its table
    b = RingStream(sink.path, itertools.count(100))
    b.writer_gone()
    out: list = []
    assert b.publish(out, 4096)
    names = [type(r).__name__ for r in out]
    assert names == [
        "SessionRecord",
        "PriorRecord",
        "SessionEndRecord",
    ]  # its round, for its record
    assert out[2].error == "WorkerGone" and out[0].session == out[1].session == out[2].session
    assert out[1].ks == (4,) and out[1].js == (2,)
    b.close()


def test_the_readme_sizes_the_ring_directory_for_the_rings_it_holds(tmp_path):
    """README, "Running it": a ring directory sized as it says holds (workers + HELD_RINGS)
    rings of the default size (it said 8 MiB each and 96 MiB for 8 ranks: 12 rings of 8.3 MiB
    do not fit, and the last worker to start finds the tmpfs full)."""
    import re
    from pathlib import Path

    from memra_obs.agent.main import HELD_RINGS

    sink = RingSink(str(tmp_path), worker="w")
    size = max(p.stat().st_size for p in tmp_path.glob("*.ring"))
    sink.shutdown()
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    m = re.search(
        r"([\d.]+) MiB each at the default .*?so (\d+) ranks want ≥ (\d+) MiB", text, re.S
    )
    assert m, "README, Running it: the ring directory's size"
    each, ranks, want = float(m[1]), int(m[2]), int(m[3])
    assert each * 2**20 >= size
    assert want * 2**20 >= (ranks + HELD_RINGS) * size


def test_a_worker_that_dies_mid_session_ends_it_with_what_it_did(tmp_path):
    """The agent's WorkerGone end holds the rounds, bursts and tokens it read and closes at the
    session's last stamp (the burst's return, after its last round); a session recorded with
    no worker label carries the ring's."""
    import itertools

    from memra_obs.agent.reader import RingStream

    sink = RingSink(str(tmp_path), worker="w9", slots=1024, table_entries=8)
    sink.on_session(SessionRecord(7, "spec", "t", "tv", "", 1, 1, 1, 5, 6, 0, 0, False))
    for i in range(2):
        sink.on_round(RoundRecord(7, 0, i, (1, 2, 3, 4, 5, 6 + i), 4, 2, 100, 0, None))
    ph = SpecPhaseNs(2, 2, 2, 2, 2, 2)
    sink.on_burst(BurstRecord(7, 0, 4, 1, 50, ph, None, 7, 0, 0))
    sink.shutdown()
    s = RingStream(sink.path, itertools.count(1))
    s.writer_gone()
    out: list = []
    assert s.publish(out, 4096)
    assert out[0].worker == "w9"
    end = out[-1]
    assert (end.error, end.rounds, end.bursts, end.tokens, end.end_ns_mono) == (
        "WorkerGone",
        2,
        1,
        7,
        50,
    )
    s.close()


def test_what_a_previous_agent_read_counts_drafting_rounds_and_the_largest_k(tmp_path):
    """A restarted agent's PriorRecord: rounds that drafted nothing (k = 0) are no draft step
    of the request's record, and its k is the largest burst's, not the last's."""
    import itertools

    from memra_obs.agent.reader import RingStream

    sink = RingSink(str(tmp_path), worker="w", slots=1024, table_entries=8)
    sink.on_session(SessionRecord(7, "spec", "t", "tv", "w", 1, 1, 1, 5, 6, 0, 0, False))
    ph = SpecPhaseNs(1, 1, 1, 1, 1, 1)
    for b, k in enumerate((4, 0, 2)):
        sink.on_round(RoundRecord(7, b, b, (1, 2, 3, 4, 5, 6), k, min(k, 1), 100, 0, None))
        sink.on_burst(BurstRecord(7, b, k, 1, 6, ph, None, 2, 0, b))
    a = RingStream(sink.path, itertools.count(1))
    a.publish([], 4096)
    a.commit(a.cursor())
    a.close()
    sink.shutdown()
    b = RingStream(sink.path, itertools.count(100))
    b.writer_gone()
    out: list = []
    b.publish(out, 4096)
    (prior,) = [r for r in out if type(r).__name__ == "PriorRecord"]
    assert (prior.ks, prior.js, prior.k) == ((4, 2), (1, 1), 4)
    b.close()
