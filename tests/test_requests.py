"""The per-request record: vLLM's / AIPerf's spec-decode fields for every session, returned by
``Session.spec_decode()`` and written as JSON lines when MEMRA_OBS_REQUESTS_FILE names a file."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from polling import wait_for
from prometheus_client import CollectorRegistry

from memra_obs.agent.main import build_agent
from memra_obs.environment import ConfigError
from memra_obs.observer import Observer
from memra_obs.otel.spans import SpanBuilder
from memra_obs.testing import RecordingSink
from memra_obs.wiring import build_observer

VLLM_KEYS = [
    "mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
    "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens",
]  # fmt: skip


def _rounds(b, kj):
    for k, j in kj:
        b.begin_round()
        b.end_draft()
        b.end_verify()
        b.end_accept()
        b.end_rollback()
        b.end_round(k=k, j=j)


def _session(obs, rng, n=40):
    with obs.session("glm5") as s:
        truth = []
        for _ in range(4):
            with s.burst(4) as b:
                kj = [(k, rng.randint(0, k)) for k in (rng.randint(0, 4) for _ in range(n // 4))]
                truth += kj
                _rounds(b, kj)
        got = s.spec_decode(detailed=True)
    return truth, got


def test_the_session_record_has_vllms_fields_and_the_phases(tmp_path):
    """Session.spec_decode() counts steps, tokens and the histogram as vLLM does (a step is a
    round that drafted), with the per-step lists; the requests file says the same."""
    path = tmp_path / "requests.jsonl"
    obs = build_observer(level=0, prof=False, requests_file=str(path), requests_detail="1",
                         sinks="", metrics_addr="")  # fmt: skip
    rng = random.Random(3)
    truth, got = _session(obs, rng)
    obs.shutdown(5.0)
    steps = [(k, j) for k, j in truth if k > 0]
    assert list(got)[: len(VLLM_KEYS)] == VLLM_KEYS
    assert got["num_spec_steps"] == len(steps)
    assert got["num_draft_tokens"] == sum(k for k, _ in steps)
    assert got["num_accepted_draft_tokens"] == sum(j for _, j in steps)
    assert got["mean_acceptance_length"] == 1 + sum(j for _, j in steps) / len(steps)
    assert got["per_step_drafted"] == [k for k, _ in steps]
    assert sum(got["acceptance_histogram"]) == len(steps)
    assert set(got["phase_ms"]) == {"draft", "verify", "accept", "rollback", "maint"}
    (line,) = path.read_text().splitlines()
    rec = json.loads(line)
    for key in (*VLLM_KEYS, "per_step_drafted", "per_step_accepted"):
        assert rec[key] == got[key], key
    assert (rec["family"], rec["rounds"], rec["bursts"]) == ("glm5", 40, 4)


def test_an_agent_mode_worker_still_writes_its_requests_file(tmp_path):
    """With MEMRA_OBS_AGENT and a publishing sink the records go to the ring, and the worker's
    MEMRA_OBS_REQUESTS_FILE is still written in-process, as without the agent."""
    path = tmp_path / "requests.jsonl"
    env = {"MEMRA_OBS_AGENT": str(tmp_path / "rings"), "MEMRA_OBS_SINKS": "prometheus",
           "MEMRA_OBS_REQUESTS_FILE": str(path), "MEMRA_OBS_METRICS_ADDR": ""}  # fmt: skip
    obs = build_observer(env=env, level=0, prof=False)
    truth, _ = _session(obs, random.Random(5))
    obs.shutdown(5.0)
    assert [type(s).__name__ for s in obs.sinks] == ["RingSink", "QueueSink"]
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["num_spec_steps"] == sum(1 for k, _ in truth if k > 0)
    assert obs.where == (f"requests -> {path}", f"records -> agent rings in {tmp_path / 'rings'}")
    if os.path.isdir("/dev/shm"):  # a bare name is a directory there, and the banner says so
        name = f"memra-obs-test-{os.getpid()}"
        env = {**env, "MEMRA_OBS_AGENT": name, "MEMRA_OBS_REQUESTS_FILE": ""}
        obs = build_observer(env=env, level=0, prof=False)
        obs.shutdown(5.0)
        assert obs.where == (f"records -> agent rings in /dev/shm/{name}",)
        shutil.rmtree(f"/dev/shm/{name}")


def test_the_record_so_far_mid_burst_counts_the_open_bursts_rounds_whole():
    """``spec_decode()`` before ``b.end()``: the finished rounds' phases are in ``phase_ms``
    as their counts are in ``num_spec_steps`` (they read 3 steps and 0.0 ms)."""
    import time

    from memra_obs.testing import capture

    with capture(level=0) as cap, cap.observer.session("glm5") as s, s.burst(4) as b:
        for _ in range(3):
            b.begin_round()
            time.sleep(0.002)
            b.end_draft()
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=2)
        mid = s.spec_decode()
    end = s.spec_decode()
    assert mid["num_spec_steps"] == end["num_spec_steps"] == 3
    assert mid["phase_ms"] == end["phase_ms"] and mid["phase_ms"]["draft"] >= 6.0


def test_a_session_that_sent_no_token_has_no_first_token_profile(tmp_path):
    """Ended before a first token (no burst, or a first burst an exception cut before any
    round): no profile was published, so ``spec_decode()["first_token"]`` is None, as in the
    requests file (it returned the unpublished buckets, a ``first_burst_ms`` of 0.0)."""
    from memra_obs.requests import RequestsExporter
    from memra_obs.testing import capture

    with capture(level=0, prof=True, memory=lambda: []) as cap:
        quiet = cap.observer.session("glm5")
        quiet.lap("prime")
        quiet.end()
        with pytest.raises(MemoryError), cap.observer.session("glm5") as cut, cut.burst(4) as b:
            b.begin_round()
            raise MemoryError
    ex = RequestsExporter(str(tmp_path / "r.jsonl"))
    ex.export(cap.records)
    ex.shutdown()
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [x["first_token"] for x in lines] == [None, None]
    assert quiet.spec_decode()["first_token"] is None and cut.spec_decode()["first_token"] is None


def test_a_requests_file_that_cannot_be_written_fails_at_start_up(tmp_path):
    """A missing directory or a directory: start-up stops naming the variable (it started, and
    every record was lost, said at the first session's end without the variable's name)."""
    for path in (tmp_path / "nope" / "r.jsonl", tmp_path):
        env = {
            "MEMRA_OBS_REQUESTS_FILE": str(path),
            "MEMRA_OBS_SINKS": "",
            "MEMRA_OBS_METRICS_ADDR": "",
        }
        with pytest.raises(ConfigError, match=r"^MEMRA_OBS_REQUESTS_FILE='.*': (No such|Is a)"):
            build_observer(env=env, level=0, prof=False)
        with pytest.raises(ConfigError, match=r"^argument requests_file="):
            build_observer(env={}, requests_file=str(path), sinks="", metrics_addr="")
        p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "demo", "--requests", "1"],
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert p.returncode == 2 and "MEMRA_OBS_REQUESTS_FILE=" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_a_line_cut_short_by_a_full_disk_leaves_no_torn_line(tmp_path):
    """A write the disk cut short left half a line without its newline: the next append (this
    process once space came back, or another worker) joined it, one invalid JSON line."""
    from memra_obs.linewriter import AppendFile

    path = tmp_path / "r.jsonl"
    code = (
        "import resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))\n"
        "from memra_obs.linewriter import AppendFile\n"
        f"f = AppendFile({str(path)!r})\n"
        "for i in range(40):\n"
        '    try: f.append(b\'{"n": %d, "pad": "%s"}\\n\' % (i, b\'x\' * 40))\n'
        "    except OSError: pass\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    AppendFile(str(path)).append(b'{"n": "after"}\n')
    lines = path.read_bytes().splitlines()
    for line in lines:
        json.loads(line)
    assert lines[-1] == b'{"n": "after"}'


def test_a_batch_a_stuck_exporter_held_past_shutdown_is_not_written_after_it(tmp_path):
    """shutdown(t) counts a batch still inside a stuck exporter call as dropped; when that call
    came back, the requests file (closed by then) reopened itself and wrote the batch's lines:
    counted dropped and delivered, and a descriptor nobody closes."""
    import time

    from held import Held

    stuck = Held()
    path = tmp_path / "r.jsonl"
    obs = build_observer(sinks="", requests_file=str(path), level=0, env={}, exporters=[stuck])
    s = obs.session("glm5")
    b = s.burst(4)
    b.begin_round()
    b.end_draft()
    b.end_verify()
    b.end_accept()
    b.end_rollback()
    b.end_round(k=4, j=2, ctx=1)
    b.end()
    s.end()
    obs.queue.worker.wake()
    deadline = time.monotonic() + 5
    while obs.queue.worker.held == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    obs.shutdown(0.2)
    stuck.release.set()
    obs.queue.worker._thread.join(5)
    assert obs.queue.dropped == 4 and path.read_text() == ""
    assert str(path) not in {os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")
                             if os.path.exists(f"/proc/self/fd/{f}")}  # fmt: skip


def _agent_writes(ring_dir, env, path):
    """The agent reads the workers' rings in ``ring_dir`` and writes the requests file."""
    agent, closers, _ = build_agent(
        str(ring_dir),
        env={**env, "MEMRA_OBS_REQUESTS_FILE": str(path)},
        registry=CollectorRegistry(),
    )
    agent.drain(5)
    agent.close()
    for close in closers:
        close()


@pytest.mark.parametrize("mode", ["in-process", "agent"])
def test_an_unsampled_callers_trace_id_is_kept_for_the_join(tmp_path, mode):
    """The caller's sampler dropped the request: no spans, but its line still names the
    caller's trace (the only key that joins it to the server's own request log), written by
    the worker or by the agent (the ring carries the caller's id)."""
    path = tmp_path / "requests.jsonl"
    env = {"MEMRA_OBS_REQUESTS_FILE": str(path)}
    if mode == "agent":
        env = {"MEMRA_OBS_AGENT": str(tmp_path), "MEMRA_OBS_SINKS": "otel,prometheus",
               "MEMRA_OBS_METRICS_ADDR": "", "OTEL_TRACES_EXPORTER": "none"}  # fmt: skip
    obs = build_observer(env=env, level=0, prof=False)
    with TracerProvider(sampler=ALWAYS_OFF).get_tracer("t").start_as_current_span("req") as sp:
        _session(obs, random.Random(1), n=4)
    obs.shutdown(5.0)
    if mode == "agent":
        _agent_writes(tmp_path, env, path)
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["trace_id"] == format(sp.get_span_context().trace_id, "032x")


def _mode_env(tmp_path, mode: str) -> dict[str, str]:
    """A worker writing ``tmp_path/requests.jsonl`` itself, or (agent) through its ring."""
    if mode == "agent":
        return {"MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": "",
                "MEMRA_OBS_AGENT": str(tmp_path)}  # fmt: skip
    path = tmp_path / "requests.jsonl"
    return {
        "MEMRA_OBS_SINKS": "",
        "MEMRA_OBS_METRICS_ADDR": "",
        "MEMRA_OBS_REQUESTS_FILE": str(path),
    }


@pytest.mark.parametrize("mode", ["in-process", "agent"])
def test_num_spec_tokens_is_the_configured_k_not_the_largest_round_k(tmp_path, mode):
    """vLLM reports ``num_spec_tokens`` = the configured draft length, its histogram k+1 buckets,
    even when a request's steps drafted fewer (a gate) or none. The loop configures k with
    ``s.burst(k)``; the record said the largest round k (2, then 0 with no step)."""
    path, env = tmp_path / "requests.jsonl", _mode_env(tmp_path, mode)
    obs, got = build_observer(env=env, level=0, prof=False), []
    for kj in ([(2, 1), (2, 2), (1, 0), (0, 0)], [(0, 0)]):
        with obs.session("glm5") as s, s.burst(4) as b:  # configured k = 4
            _rounds(b, kj)
        got.append(s.spec_decode())
    obs.shutdown(5.0)
    if mode == "agent":
        _agent_writes(tmp_path, env, path)
    # By hand: 3 steps (the k = 0 round is none), 3 of 5 drafts accepted, j = 1, 2, 0.
    want = [[2.0, 0.6, [1, 1, 1, 0, 0], 3, 3, 5, 4], [1.0, 0.0, [0, 0, 0, 0, 0], 0, 0, 0, 4]]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for recs in (got, lines):
        assert [[r[key] for key in VLLM_KEYS] for r in recs] == want
    keep = RecordingSink(wants_trace_ids=True)  # the session span says the same
    with Observer([keep], level=0, prof=False).session("glm5") as s, s.burst(4) as b:
        _rounds(b, [(2, 1)])
    spans: list = []
    SpanBuilder().add(keep.records, spans)
    attrs = dict(next(sp for sp in spans if sp[0] == "spec.session")[6])
    assert attrs["memra.spec.request.num_spec_tokens"] == s.spec_decode()["num_spec_tokens"] == 4


@pytest.mark.parametrize("mode", ["in-process", "agent"])
def test_a_long_error_is_the_same_256_characters_in_process_and_through_the_agent(tmp_path, mode):
    """A failed request's ``error`` is at most 256 characters, a loop's own text
    (``s.end(traceback.format_exc())``) as an exception's: in-process a str went whole into the
    requests file and the span status (4,567 characters), through the agent the ring cut it to
    ~1,700, so one request read differently by mode."""
    path, env = tmp_path / "requests.jsonl", _mode_env(tmp_path, mode)
    obs = build_observer(env=env, level=0, prof=False)
    text = "RuntimeError: CUDA error: an illegal memory access\n" + "  File x, line 1\n" * 300
    s = obs.session("glm5")
    _rounds(s.burst(4), [(4, 2)])
    s.end(text)
    with pytest.raises(RuntimeError), obs.session("glm5") as s, s.burst(4):
        raise RuntimeError("CUDA out of memory. " * 50)
    obs.shutdown(5.0)
    if mode == "agent":
        _agent_writes(tmp_path, env, path)
    got = [json.loads(line)["error"] for line in path.read_text().splitlines()]
    assert got == [text[:256], f"RuntimeError: {'CUDA out of memory. ' * 50}"[:256]]


def test_a_requests_line_states_the_sessions_phase_totals_in_ms_and_its_error(tmp_path):
    """The line's ``phase_ms`` are the rounds' phase totals in ms (an agent's replayed prior
    rounds included, and their largest burst k), with the session's end (rounds, tokens,
    error) as it was recorded."""
    from memra_obs.requests import RequestsExporter
    from memra_obs.timeline import PriorRecord, RoundRecord, SessionEndRecord, SessionRecord

    path = tmp_path / "r.jsonl"
    ex = RequestsExporter(str(path))
    ms = 1_000_000
    rounds = [RoundRecord(1, 0, i, (t := 10 * ms * i, t + 2 * ms, t + 7 * ms, t + 8 * ms,
                                    t + 8 * ms + 500_000, t + 9 * ms), 4, i % 3, 0, 0, None)
              for i in range(3)]  # fmt: skip
    ex.export([
        SessionRecord(1, "glm5", "t", "tv", "w", 0, 0, 0, 0, 0, 0, 0, False),
        PriorRecord(1, (4,), (4,), (ms, 3 * ms, 0, 0, 0), 6, None),  # an earlier burst(6)
        *rounds,
        SessionEndRecord(1, 40 * ms, 4, 2, 9, "RuntimeError"),
    ])  # fmt: skip
    ex.shutdown()
    rec = json.loads(path.read_text())
    assert rec["phase_ms"] == {"draft": 7.0, "verify": 18.0, "accept": 3.0, "rollback": 1.5,
                               "maint": 1.5}  # fmt: skip
    assert (rec["rounds"], rec["bursts"], rec["tokens"], rec["error"]) == (4, 2, 9, "RuntimeError")
    assert rec["num_draft_tokens"] == 16 and rec["num_accepted_draft_tokens"] == 4 + 0 + 1 + 2
    assert rec["num_spec_tokens"] == 6


def test_past_max_open_sessions_the_oldest_is_forgotten(tmp_path):
    """At most ``max_open`` sessions wait for their end: one more forgets the oldest (its end
    then writes nothing: a line lost, counted), the newer ones are written."""
    from memra_obs.requests import RequestsExporter
    from memra_obs.timeline import SessionEndRecord, SessionRecord

    path = tmp_path / "r.jsonl"
    ex = RequestsExporter(str(path), max_open=2)
    ex.export(
        [SessionRecord(s, "f", "t", "tv", "w", 0, 0, 0, 0, 0, 0, 0, False) for s in (1, 2, 3)]
    )
    ex.export([SessionEndRecord(s, 1, 0, 0, 0, "") for s in (1, 2, 3)])
    ex.shutdown()
    assert [json.loads(x)["session"] for x in path.read_text().splitlines()] == [2, 3]
    assert ex.export_errors == 1


def test_an_append_waiting_for_the_lock_at_close_writes_nothing_and_leaks_nothing(tmp_path):
    """``close()`` (shutdown, or configure() replacing the observer) while the export thread
    waits in ``flock`` for another process's append: the batch, counted dropped, was written
    when the lock came, through the closed fd's number (by then the next observer's file) or a
    file it reopened and never closed."""
    import fcntl
    import threading
    import time

    from memra_obs.linewriter import AppendFile

    path = tmp_path / "r.jsonl"
    f = AppendFile(str(path))
    f.open()
    holder = os.open(path, os.O_WRONLY)  # another open file: another process's, for flock
    fcntl.flock(holder, fcntl.LOCK_EX)
    errors: list[OSError] = []

    def append() -> None:
        try:
            f.append(b'{"n": "old"}\n')
        except OSError as exc:
            errors.append(exc)

    t = threading.Thread(target=append)
    t.start()
    time.sleep(0.2)  # waiting for the lock
    f.close()
    nxt = AppendFile(str(path))
    nxt.open()  # the lowest free fd: the closed one's number, had close() closed it
    fcntl.flock(holder, fcntl.LOCK_UN)
    t.join(5)
    nxt.close()
    os.close(holder)
    assert path.read_text() == "" and [e.errno for e in errors] == [errno.EBADF]
    assert str(path) not in {os.readlink(f"/proc/self/fd/{x}") for x in os.listdir("/proc/self/fd")
                             if os.path.exists(f"/proc/self/fd/{x}")}  # fmt: skip


def test_a_relative_requests_file_stays_where_it_was_opened(tmp_path, monkeypatch):
    """``MEMRA_OBS_REQUESTS_FILE=requests.jsonl``, then the process's chdir(): the next lines
    went to a new requests.jsonl in the new directory (the spans file stayed put)."""
    from memra_obs.linewriter import AppendFile

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    f = AppendFile("requests.jsonl")
    f.append(b"1\n")
    monkeypatch.chdir(tmp_path / "b")
    f.append(b"2\n")
    f.close()
    assert (tmp_path / "a" / "requests.jsonl").read_text() == "1\n2\n"
    assert not (tmp_path / "b" / "requests.jsonl").exists()
    obs = build_observer(sinks="", requests_file="r.jsonl", level=0, env={})
    assert obs.where == (f"requests -> {tmp_path / 'b' / 'r.jsonl'}",)
    obs.shutdown(1)


def test_an_append_follows_a_file_others_keep_rotating_for_more_than_8_tries(tmp_path):
    """Many workers on a small rotating spans file: each rotation by another costs a waiter one
    try, and after 8 its line was dropped ("kept moving under the append"). Others rotating
    is progress: the append goes on for 2 s, 8 tries at least."""
    from memra_obs.linewriter import AppendFile

    class Busy(AppendFile):
        moves = 12

        def _put(self, fd: int, data: bytes) -> bool:
            if self.moves:
                self.moves -= 1
                return False  # another process moved it between our open and our lock
            return super()._put(fd, data)

    f = Busy(str(tmp_path / "s.jsonl"))
    f.append(b"x\n")
    f.close()
    assert (tmp_path / "s.jsonl").read_text() == "x\n"


def test_a_line_short_of_rounds_a_full_queue_dropped_says_how_many(tmp_path):
    """Under load the queue drops the newest records: a session whose start and end got
    through but some rounds did not was written with fewer steps, its line silently unlike
    ``spec_decode()`` (14,629 steps against 16,000). The line now says how many it lacks."""
    from memra_obs.requests import RequestsExporter
    from memra_obs.timeline import RoundRecord, SessionEndRecord, SessionRecord

    path = tmp_path / "r.jsonl"
    ex = RequestsExporter(str(path))
    t = (0, 1, 2, 3, 4, 5)
    ex.export([
        SessionRecord(1, "glm5", "t", "tv", "w", 0, 0, 0, 0, 0, 0, 0, False),
        *[RoundRecord(1, 0, i, t, 4, 2, 0, 0, None) for i in range(3)],
        SessionEndRecord(1, 9, 5, 1, 15, ""),  # 5 rounds ran; 2 of them never came
        SessionRecord(2, "glm5", "t", "tv", "w", 0, 0, 0, 0, 0, 0, 0, False),
        *[RoundRecord(2, 0, i, t, 4, 2, 0, 0, None) for i in range(3)],
        SessionEndRecord(2, 9, 3, 1, 9, ""),
    ])  # fmt: skip
    ex.shutdown()
    short, whole = map(json.loads, path.read_text().splitlines())
    assert short["rounds_missing"] == 2 and short["num_spec_steps"] == 3
    assert "rounds_missing" not in whole


def test_rounds_of_unknown_counts_are_no_zero_acceptance(tmp_path):
    """``memra-obs tail`` over a log without rows: every round's k, j unknown. The line said
    k=4, 277 rounds, no spec step and 0% acceptance; unknown is not zero: vLLM's fields are
    null (as vLLM sends no stats) and ``unknown_rounds`` counts them."""
    from memra_obs.requests import RequestsExporter
    from memra_obs.timeline import BurstRecord, RoundRecord, SessionEndRecord, SessionRecord

    path = tmp_path / "r.jsonl"
    ex = RequestsExporter(str(path))
    t = (0, 1, 2, 3, 4, 5)
    for sid, known in ((1, 0), (2, 1)):
        ex.export([
            SessionRecord(sid, "glm5", "t", "tv", "w", 0, 0, 0, 0, 0, 0, 0, False),
            *[RoundRecord(sid, 0, i, t, 4, 3, 0, 0, None) for i in range(known)],
            RoundRecord(sid, 0, known, t, -1, -1, 0, 0, None, 5),
            BurstRecord(sid, 0, 4, 0, 5, None, None, 9, 0, 0),
            SessionEndRecord(sid, 9, known + 5, 1, 9, ""),
        ])  # fmt: skip
    ex.shutdown()
    none, some = map(json.loads, path.read_text().splitlines())
    assert none["unknown_rounds"] == 5 and none["num_spec_tokens"] == 4
    assert none["mean_acceptance_length"] is None and none["draft_acceptance_rate"] is None
    assert none["acceptance_histogram"] is None and none["num_spec_steps"] is None
    assert some["unknown_rounds"] == 5 and some["num_spec_steps"] == 1  # the known round's
    assert "rounds_missing" not in none


def test_an_error_with_a_lone_surrogate_is_written_as_valid_unicode(tmp_path):
    """An exception naming a path that is not UTF-8 (``os.fsdecode``) wrote ``\\udcff``: JSON
    that jq and Go read as U+FFFD and Python cannot encode back to UTF-8."""
    path = tmp_path / "r.jsonl"
    obs = build_observer(level=0, env={}, sinks="", requests_file=str(path))
    try:
        s = obs.session("glm5")
        name = os.fsdecode(b"model-\xff.safetensors")
        s.end(RuntimeError(f"cannot load {name}"))
    finally:
        obs.shutdown(5)
    err = json.loads(path.read_text())["error"]
    err.encode("utf-8")  # valid text
    assert err == "RuntimeError: cannot load model-\\udcff.safetensors"  # the escape, as text


def test_a_line_says_when_as_its_session_span_does(tmp_path):
    """start_unix_nano / end_unix_nano: the session span's start and end (Unix ns, through the
    session's anchor pair). A line with no trace id (an unsampled session) joined nothing."""
    import time

    from memra_obs.requests import RequestsExporter
    from memra_obs.testing import capture
    from memra_obs.timeline import SessionEndRecord, SessionRecord, to_epoch_ns

    t0 = time.time_ns()
    with capture(level=0, prof=False) as cap:
        _session(cap.observer, random.Random(1))
    t1 = time.time_ns()
    ex = RequestsExporter(str(tmp_path / "requests.jsonl"))
    ex.export(cap.records)
    ex.shutdown()
    (rec,) = map(json.loads, (tmp_path / "requests.jsonl").read_text().splitlines())
    (s,), (e,) = cap.sink.of(SessionRecord), cap.sink.of(SessionEndRecord)
    assert rec["start_unix_nano"] == to_epoch_ns(s, s.start_ns_mono)
    assert rec["end_unix_nano"] == to_epoch_ns(s, e.end_ns_mono)
    assert t0 <= rec["start_unix_nano"] < rec["end_unix_nano"] <= t1
    assert list(rec)[4:6] == ["start_unix_nano", "end_unix_nano"]


def _full_fifo(tmp_path):
    """A FIFO whose reader reads nothing, its buffer full: the next append blocks."""
    import contextlib

    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    filler = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(filler, b"x" * 4095 + b"\n")  # whole lines (atomic: PIPE_BUF)
    return fifo, reader, filler


def test_a_requests_file_that_blocks_holds_back_neither_metrics_nor_shutdown(tmp_path):
    """A requests file whose appends block (a FIFO whose reader stopped, a hung NFS mount) held
    the export worker: /metrics and the spans stood still with it, and shutdown waited out its
    time. The appends have their own thread: the rest flows, lines past ``max_bytes`` are lost
    and counted, shutdown is on time and counts what it could not append."""
    import time

    fifo, reader, filler = _full_fifo(tmp_path)
    reg = CollectorRegistry()
    obs = build_observer(sinks="prometheus", requests_file=str(fifo), level=0, prof=False,
                         env={}, registry=reg, metrics_addr="")  # fmt: skip
    (req,) = [x for x in obs.queue.worker.exporters if x.signal == "requests"]
    req.max_bytes = 1100  # two lines of ~513 bytes wait, a third does not

    def published() -> float:
        return sum(x.value for m in reg.collect() for x in m.samples
                   if x.name == "memra_spec_rounds_total")  # fmt: skip

    try:
        for n in range(1, 6):
            with obs.session("glm5") as s, s.burst(4) as b:
                _rounds(b, [(4, 2)])
            obs.flush(0.3)  # (times out: the requests file's append is stuck for good)
            # Polled (a busy host's worker may take longer than the flush's 0.3 s): a worker
            # held by the blocked append never gets there.
            wait_for(f"{n} requests published", lambda n=n: published() == n, 10.0, 0.01)
        t0 = time.monotonic()
        obs.shutdown(0.3)
        # ~0.3 s here; a shutdown that took a part's default timeout (5 s) instead, or waited
        # on the stuck append, is well past 3 s.
        assert time.monotonic() - t0 < 3.0
        assert req.export_errors == 5  # 1 stuck in its append, 2 waiting, 2 past max_bytes
    finally:
        os.close(reader)  # the stuck append ends (EPIPE): counted once, at shutdown
        os.close(filler)
    req._thread.join(5)
    assert req.export_errors == 5 and not req._thread.is_alive()


def test_a_requests_line_is_settled_once_appended(tmp_path):
    """The agent persists its rings' cursors past a pass once its exporters have delivered it:
    a requests line still waiting for a blocked append is not, and is once it is appended;
    lines lost behind it do not settle it (a count of lines done did: cursors went past lines
    neither written nor counted)."""
    import time

    from memra_obs.requests import RequestsExporter
    from memra_obs.timeline import SessionEndRecord, SessionRecord

    def request(sid: int) -> list:
        return [SessionRecord(sid, "f", "t", "tv", "w", 0, 0, 0, 0, 0, 0, 0, False),
                SessionEndRecord(sid, 1, 0, 0, 0, "")]  # fmt: skip

    fifo, reader, filler = _full_fifo(tmp_path)
    ex = RequestsExporter(str(fifo))
    ex.max_bytes = 600  # one line waits
    ex.export(request(7))
    mark = ex.mark()
    time.sleep(0.1)
    assert not ex.settled(mark) and not ex.flush(0.05)
    ex.export(request(8) + request(9))  # 8 waits, 9 is lost: no settling past 7, 8 (by count)
    assert ex.export_errors == 1 and not ex.settled(mark) and not ex.settled(ex.mark())
    for sid in range(10, 60):  # lost one export at a time: one count waits for them all
        ex.export(request(sid))
    assert ex.export_errors == 51 and len(ex._q) == 2
    os.close(filler)
    got = b""
    deadline = time.monotonic() + 5
    while b'"session":7' not in got and time.monotonic() < deadline:
        try:
            got += os.read(reader, 1 << 16)
        except BlockingIOError:
            time.sleep(0.01)
    assert ex.flush(5) and ex.settled(ex.mark()) and ex.export_errors == 51
    ex.shutdown(1)
    os.close(reader)
    assert json.loads(got[got.index(b'{"session":7') :].splitlines()[0])["session"] == 7


def test_the_tail_holds_its_reading_back_for_a_slow_requests_file(tmp_path, monkeypatch, capfd):
    """``memra-obs tail`` promises backpressure, not drops: a requests file read slowly (a FIFO,
    ``/dev/stdout | slow-consumer``) lost about half the lines once its queue was full, the
    tail's closing line saying 0 dropped. The tail waits for room instead."""
    import threading
    import time

    from memra_obs.cli import main as cli_main
    from memra_obs.requests import RequestsExporter

    log = tmp_path / "demo.log"
    with open(log, "wb") as f:
        subprocess.run([sys.executable, "-m", "memra_obs.cli", "demo", "--requests", "30",
                        "--speed", "100", "--seed", "3"], stderr=f, check=True, timeout=120,
                       env={**os.environ, "MEMRA_OBS_SINKS": ""})  # fmt: skip
    fifo, reader, filler = _full_fifo(tmp_path)
    monkeypatch.setattr(RequestsExporter, "max_bytes", 1100)  # two lines wait
    monkeypatch.setenv("MEMRA_OBS_SINKS", "")
    monkeypatch.setenv("MEMRA_OBS_REQUESTS_FILE", str(fifo))
    got = bytearray()

    def slow_reader() -> None:
        time.sleep(1.0)
        os.close(filler)
        os.set_blocking(reader, True)
        while chunk := os.read(reader, 1 << 16):
            got.extend(chunk)

    t = threading.Thread(target=slow_reader)
    t.start()
    assert cli_main(["tail", str(log), "--quiet"]) == 0
    t.join(10)
    os.close(reader)
    capfd.readouterr()
    lines = [json.loads(x) for x in bytes(got).split(b"\n") if x.startswith(b'{"session"')]
    assert len(lines) == 30


def test_a_stop_signal_lets_go_of_a_requests_file_nobody_reads(tmp_path):
    """A tail held back by a requests file whose reader stopped for good (SIGSTOP, ``| less``,
    a hung mount) ran on 30 s past SIGTERM (only SIGKILL ended it, its buffered lines lost
    uncounted): a stop signal lets go of the hold, the lines then lost are counted, and the
    tail ends within its bounded shutdown."""
    import signal
    import time

    log = tmp_path / "demo.log"
    with open(log, "wb") as f:
        subprocess.run([sys.executable, "-m", "memra_obs.cli", "demo", "--requests", "60",
                        "--speed", "100", "--seed", "4"], stderr=f, check=True, timeout=120,
                       env={**os.environ, "MEMRA_OBS_SINKS": ""})  # fmt: skip
    fifo, reader, filler = _full_fifo(tmp_path)  # never read
    code = ("import sys\n"
            "from memra_obs.requests import RequestsExporter\n"
            "RequestsExporter.max_bytes = 1100\n"
            "from memra_obs.cli import main\n"
            f"sys.exit(main(['tail', {str(log)!r}, '--quiet']))\n")  # fmt: skip
    env = {**os.environ, "MEMRA_OBS_SINKS": "", "MEMRA_OBS_REQUESTS_FILE": str(fifo),
           "MEMRA_OBS_QUEUE_SIZE": "16"}  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)  # fmt: skip
    try:
        time.sleep(2.0)
        assert p.poll() is None  # held: the reader stopped
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        assert time.monotonic() - t0 < 15, "the shutdown's bound is 10 s"
    finally:
        p.kill()
        os.close(reader)
        os.close(filler)
    assert p.returncode == 0, err[-2000:]
    assert b"requests file" in err and b"lines lost, counted" in err
