"""The agent in-process, fed by RingSinks in this process: host-unique session ids, the
stream contract per session, restart without double counting, losses and dead writers."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict

import pytest
from forked import in_child

from memra_obs.agent.main import HELD_RINGS, Agent, AgentBusy, build_agent
from memra_obs.agent.reader import RingReader
from memra_obs.agent.ring import RingSink
from memra_obs.observer import Observer
from memra_obs.timeline import (
    BurstRecord,
    FirstTokenRecord,
    PriorRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)


class Collect:
    """A RecordExporter that keeps everything."""

    def __init__(self) -> None:
        self.records: list = []
        self.shut = False

    def export(self, batch):
        self.records.extend(batch)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.shut = True

    def of(self, t):
        return [r for r in self.records if type(r) is t]


def rounds(s, n, k=4, j=2):
    b = s.burst(k)
    for i in range(n):
        b.begin_round()
        for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
            end()
        b.end_round(k=k, j=j, ctx=10 + i)
    b.end()


def observer(d, worker, slots=4096, **kw):
    sink = RingSink(str(d), worker=worker, slots=slots, **kw)
    return Observer([sink], level=2, prof=True, memory=lambda: [(0, 100)], worker=worker), sink


def check_contract(records) -> dict[int, list]:
    """Per session: SessionRecord first, SessionEndRecord last (if any), nothing after it,
    and FirstTokenRecord right after the first BurstRecord."""
    by = defaultdict(list)
    for r in records:
        by[r.session].append(r)
    for recs in by.values():
        assert type(recs[0]) is SessionRecord
        assert all(type(r) is not SessionEndRecord for r in recs[:-1])
        kinds = [type(r) for r in recs]
        if FirstTokenRecord in kinds:
            i = kinds.index(FirstTokenRecord)
            assert kinds[i - 1] is BurstRecord and kinds.index(BurstRecord) == i - 1
    return by


def test_sessions_of_every_worker_get_host_unique_ids(tmp_path):
    """Two workers with the same local ids: the agent's ids are unique, workers labelled."""
    (o1, s1), (o2, s2) = observer(tmp_path, "w1"), observer(tmp_path, "w2")
    for o in (o1, o2, o1):
        with o.session("glm5") as s:
            rounds(s, 3)
            rounds(s, 2)
    cap = Collect()
    a = Agent(str(tmp_path), [cap])
    assert a.drain(5)
    by = check_contract(cap.records)
    assert len(by) == 3
    assert sorted(r.worker for r in cap.of(SessionRecord)) == ["w1", "w1", "w2"]
    assert len(cap.of(RoundRecord)) == 15 and len(cap.of(FirstTokenRecord)) == 3
    assert a.counts() == {"w1": (2 * 10, 0, 2 * 10), "w2": (10, 0, 10)}
    s1.shutdown()
    s2.shutdown()
    a.close()
    assert cap.shut


def test_restart_resumes_without_double_counting(tmp_path):
    """Agent 1 stops mid-session; agent 2 publishes exactly the rest, with each session's
    context (the SessionRecord) replayed first, whether it is still open or has ended."""
    obs, sink = observer(tmp_path, "w")
    a_open = obs.session("glm5")
    rounds(a_open, 4)
    with obs.session("glm5") as done_later:
        rounds(done_later, 3)
        cap1 = Collect()
        agent1 = Agent(str(tmp_path), [cap1], batch_slots=12)
        agent1.step()  # part of what is there
        agent1.close()
        rounds(done_later, 2)  # after the cursor; ends before agent 2 starts
    rounds(a_open, 5)
    a_open.end()
    with obs.session("glm5") as new:
        rounds(new, 2)
    cap2 = Collect()
    agent2 = Agent(str(tmp_path), [cap2])
    assert agent2.drain(5)
    total_rounds = 4 + 3 + 2 + 5 + 2
    r1, r2 = cap1.of(RoundRecord), cap2.of(RoundRecord)
    assert 0 < len(r1) < total_rounds
    assert len(r1) + len(r2) == total_rounds
    assert not {x.t_ns_mono for x in r1} & {x.t_ns_mono for x in r2}
    check_contract(cap2.records)
    assert len(cap1.of(SessionEndRecord)) + len(cap2.of(SessionEndRecord)) == 3
    assert agent2.stats()[0]["replayed"] >= 1 and agent2.lost_total() == 0
    sink.shutdown()
    agent2.close()


def test_graceful_close_leaves_open_sessions_to_the_next_agent(tmp_path):
    """close() does not end sessions of a live worker (spans would appear twice)."""
    obs, sink = observer(tmp_path, "w")
    s = obs.session("glm5")
    rounds(s, 2)
    cap = Collect()
    a = Agent(str(tmp_path), [cap])
    a.drain(5)
    a.close()
    assert not cap.of(SessionEndRecord)
    s.end()
    cap2 = Collect()
    a2 = Agent(str(tmp_path), [cap2])
    a2.drain(5)
    # the context, then (for the per-request record) what agent 1 published of it
    assert [type(r) for r in cap2.records] == [SessionRecord, PriorRecord, SessionEndRecord]
    assert len(cap2.records[1].ks) == cap2.records[2].rounds == 2
    a2.close()
    sink.shutdown()


@pytest.mark.parametrize("writer", ["alive", "dead"])
def test_a_session_open_across_a_restart_whose_end_was_overwritten_is_ended(tmp_path, writer):
    """The next agent ends a session it carried over (its start read by the one before) whose
    end it then lost to a lapped ring, as one agent alone does (RingOverrun), with what was
    published of it: it never ended (no span, no request line; the loss counted, unsaid)."""
    obs, sink = observer(tmp_path, "w", slots=64)
    a = Agent(str(tmp_path), [Collect()])
    s = obs.session("glm5")
    rounds(s, 2)
    a.drain(5)
    a.close()  # graceful: s is left to the next agent
    cap = Collect()
    a = Agent(str(tmp_path), [cap])
    a.step()
    rounds(s, 3)
    s.end()
    with obs.session("glm5") as s2:  # laps the ring past s's end
        for _ in range(10):
            rounds(s2, 8)
    if writer == "dead":
        sink.shutdown()
    a.drain(5)
    ends = {r.session: r for r in cap.of(SessionEndRecord)}
    assert sorted(e.error for e in ends.values()) == ["", "RingOverrun"] and a.lost_total() > 0
    (carried,) = [r for r in cap.of(SessionRecord) if ends[r.session].error]
    assert carried.trace_id and carried.family == "glm5"
    (prior,) = cap.of(PriorRecord)
    assert prior.session == carried.session and len(prior.ks) == 2
    check_contract(cap.records)
    sink.shutdown()
    a.close()


def test_lost_end_records_are_synthesized_and_counted(tmp_path):
    """A reader lapped by a tiny ring loses session ends; the agent closes those sessions
    (RingOverrun) once the writer's table shows they ended, and counts every lost record."""
    obs, sink = observer(tmp_path, "w", slots=64)
    cap = Collect()
    a = Agent(str(tmp_path), [cap])
    with obs.session("glm5") as s:
        rounds(s, 2)
        a.step()  # the agent knows the session
        rounds(s, 80)  # laps the ring
    with obs.session("glm5") as s2:  # its SessionRecord is overwritten too: an orphan
        rounds(s2, 80)
    with obs.session("glm5") as s3:
        rounds(s3, 1)
    a.drain(5)
    ends = sorted(e.error for e in cap.of(SessionEndRecord))
    assert ends == ["", "", "RingOverrun"]  # s2's end made it: it closes its stand-in
    st = a.stats()[0]
    assert st["open_sessions"] == 0
    # The orphan's rounds are still published, behind a stand-in session without trace ids.
    stand_in = [r for r in cap.of(SessionRecord) if r.family == "unknown"]
    assert len(stand_in) == 1 and stand_in[0].trace_id == 0 and stand_in[0].worker == "w"
    delivered = len(cap.records) - a.stats()[0]["synthesized"] - a.stats()[0]["replayed"]
    assert delivered + a.lost_total() == sink.written
    check_contract(cap.records)
    sink.shutdown()
    a.close()


def _kill_a_writer_mid_session(tmp_path) -> None:
    code = (
        "import sys, os, signal\n"
        "from memra_obs.agent.ring import RingSink\n"
        "from memra_obs.observer import Observer\n"
        "sys.path.insert(0, os.path.dirname(sys.argv[1]))\n"
        "from test_agent_loop import rounds\n"
        f"sink = RingSink({str(tmp_path)!r}, worker='k', slots=4096)\n"
        "obs = Observer([sink], level=2, prof=False, worker='k')\n"
        "s = obs.session('glm5'); rounds(s, 7)\n"
        "b = s.burst(4); b.begin_round(); b.end_draft(); b.end_verify(); b.end_accept();"
        " b.end_rollback(); b.end_round(k=4, j=1)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, __file__], timeout=60)
    assert p.returncode == -9


def test_a_killed_writer_is_read_to_the_end_and_cleaned_up(tmp_path):
    """A worker SIGKILLed mid-session: every record it wrote is published, the session is
    ended as WorkerGone, and the ring file is removed."""
    _kill_a_writer_mid_session(tmp_path)
    cap = Collect()
    a = Agent(str(tmp_path), [cap])
    assert a.drain(5)
    assert [type(r) for r in cap.records] == [SessionRecord, *[RoundRecord] * 7, BurstRecord,
                                              RoundRecord, SessionEndRecord]  # fmt: skip
    end = cap.records[-1]
    assert (
        end.error == "WorkerGone"
        and end.rounds == 8
        and end.end_ns_mono == cap.records[-2].t_ns_mono[5]
    )
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".ring")]
    assert a.rings_removed == 1 and a.rings == 0
    a.close()


def test_a_killed_writers_kept_ring_is_not_ended_again_by_each_later_agent(tmp_path):
    """``--keep``: the dead writer's table still named the session it died in, so each later
    agent replayed it and ended it again (the same span id once more, a request line with 0
    rounds). Its ended sessions leave the table when the ring is retired."""
    _kill_a_writer_mid_session(tmp_path)
    got = []
    for _ in range(3):
        cap = Collect()
        a = Agent(str(tmp_path), [cap], cleanup=False)
        assert a.drain(5)
        a.close()
        got.append([type(r).__name__ for r in cap.records])
    assert got[0][-1] == "SessionEndRecord" and len(got[0]) == 11 and got[1:] == [[], []]
    assert [f for f in os.listdir(tmp_path) if f.endswith(".ring")]  # kept


class Stuck(Collect):
    """A span exporter whose receiver is down: nothing it is handed settles until told."""

    delivered = False

    def mark(self):
        return len(self.records)

    def settled(self, mark) -> bool:
        return self.delivered


@pytest.mark.parametrize("cleanup", [True, False])
def test_finished_rings_waiting_on_an_exporter_that_cannot_deliver_are_capped(tmp_path, cleanup):
    """A collector down for minutes, workers churning: finished workers' rings wait for their
    spans' delivery only up to HELD_RINGS (files and descriptors); older ones retire anyway
    (cursor committed, removed unless --keep), so /dev/shm cannot fill and stop new workers."""
    n = HELD_RINGS + 3
    for i in range(n):
        obs, sink = observer(tmp_path, f"w{i}")
        with obs.session("glm5") as s:
            rounds(s, 2)
        sink.shutdown()
    paths = sorted(str(p) for p in tmp_path.glob("*.ring"))
    fds = len(os.listdir("/proc/self/fd"))
    stuck = Stuck()
    agent = Agent(str(tmp_path), [stuck], cleanup=cleanup)
    assert agent.drain(5) and agent.rings == 0 and agent.rings_retired == n - HELD_RINGS
    assert len(os.listdir("/proc/self/fd")) <= fds + 1 + HELD_RINGS  # + the lock
    if cleanup:
        assert len(list(tmp_path.glob("*.ring"))) == HELD_RINGS
    else:  # kept, and read to the end by this agent: the next one does not publish them again
        ends = [(r.pos, r.state().head) for r in map(RingReader, paths)]
        assert sum(pos == head for pos, head in ends) == n - HELD_RINGS
    published = len(stuck.records)
    stuck.delivered = True
    agent.step()
    assert agent.rings_retired == n and len(stuck.records) == published == agent.published
    assert len(list(tmp_path.glob("*.ring"))) == (0 if cleanup else n)
    agent.close()


def test_one_agent_per_directory(tmp_path):
    """A second agent on the same directory is refused until the first one closes; a second
    `memra-obs agent` is told so, not that the first one's /metrics port is in use."""
    a = Agent(str(tmp_path), [])
    with pytest.raises(AgentBusy):
        Agent(str(tmp_path), [])
    a.close()
    Agent(str(tmp_path), []).close()
    env = {"MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0"}
    first, closers, server = build_agent(str(tmp_path), env=env)
    env["MEMRA_OBS_METRICS_ADDR"] = f"127.0.0.1:{server.port}"
    with pytest.raises(AgentBusy):
        build_agent(str(tmp_path), env=env)
    first.close()
    for close in closers:
        close()


def test_an_unusable_directory_or_poll_is_one_line_and_status_2(tmp_path):
    """A ring directory under a file, or a file (it said "File exists"): one line naming it,
    status 2. ``--poll-ms nan`` (it
    spun), ``inf`` (a traceback), ``0`` and ``--dir ''`` (it read $MEMRA_OBS_AGENT or the
    default): a usage error naming the option as typed. ``--keep`` reports no ring removed.
    The directory is said first, before a port is bound or a span file made (it said "address
    already in use" with /metrics' port taken, and left an empty span file where it ran)."""
    (tmp_path / "f").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    taken = socket.socket()  # /metrics' port, held (a demo running beside the agent)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    held = {**os.environ, "MEMRA_OBS_METRICS_ADDR": f"127.0.0.1:{taken.getsockname()[1]}"}
    held.pop("MEMRA_OBS_SPANS_FILE", None)
    (tmp_path / "cwd").mkdir()
    for args, said in (
        (["--dir", str(tmp_path / "f" / "sub")], "ring directory"),
        (["--dir", str(tmp_path / "f")], "(--dir, MEMRA_OBS_AGENT): not a directory"),
        (["--dir", str(tmp_path / "dangling")], "(--dir, MEMRA_OBS_AGENT): a link"),
        (["--dir", str(tmp_path), "--poll-ms", "nan"], "--poll-ms: 'nan' is not"),
        (["--dir", str(tmp_path), "--poll-ms", "inf"], "--poll-ms: 'inf' is not"),
        (["--dir", str(tmp_path), "--poll-ms", "0"], "--poll-ms: '0' is not a positive number"),
        (["--dir", " "], "--dir: must not be empty"),
    ):
        p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "agent", *args],
                           capture_output=True, text=True, timeout=60, env=held,
                           cwd=tmp_path / "cwd")  # fmt: skip
        assert p.returncode == 2 and "Traceback" not in p.stderr and said in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1 or p.stderr.startswith("usage: memra-obs agent")
        assert os.listdir(tmp_path / "cwd") == []  # no span file
    taken.close()
    obs, sink = observer(str(tmp_path / "r"), "w")
    with obs.session("glm5") as s:
        rounds(s, 1)
    sink.shutdown()
    env = {**os.environ, "MEMRA_OBS_SPANS_FILE": str(tmp_path / "s.jsonl"),
           "MEMRA_OBS_METRICS_ADDR": ""}  # fmt: skip
    env.pop("MEMRA_OBS_SINKS", None)
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "agent", "--dir",
                        str(tmp_path / "r"), "--once", "--keep", "--priority", "normal"],
                       capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert p.returncode == 0 and "rings_removed=0" in p.stderr, p.stderr
    assert [f for f in os.listdir(tmp_path / "r") if f.endswith(".ring")]


def test_a_read_only_ring_directory_is_refused_saying_the_agent_writes_there(tmp_path, monkeypatch):
    """The agent's container mounting the ring volume ``readOnly: true`` (the README said it
    "still reads"): one line, saying the agent writes there and to mount it read-write."""
    import errno

    from memra_obs.agent import main as agent
    from memra_obs.environment import ConfigError

    real = os.open

    def read_only(path, flags, *a, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match=r"file system; the agent writes there: mount it read-wr"):
        agent._lock(str(tmp_path))


def test_an_agent_with_nothing_to_publish_refuses_to_start(tmp_path):
    """``MEMRA_OBS_SINKS=nvtx`` or ``=``, spans only turned off by OTEL_*, or metrics with no
    /metrics (``MEMRA_OBS_METRICS_ADDR=``): status 2 with one line naming the variable, and the rings
    stay (it read them, removed them and said published)."""
    obs, sink = observer(str(tmp_path / "r"), "w")
    with obs.session("glm5") as s:
        rounds(s, 1)
    sink.shutdown()
    for extra in (
        {"MEMRA_OBS_SINKS": "nvtx"},
        {"MEMRA_OBS_SINKS": "otel", "OTEL_SDK_DISABLED": "true"},
        {"MEMRA_OBS_SINKS": "prometheus"},  # into a registry nobody serves (no /metrics)
        {"OTEL_TRACES_EXPORTER": "none"},  # the default sinks, neither readable
        {"MEMRA_OBS_SINKS": " "},  # set and empty: none, as for the tail (it was the default)
    ):
        env = {**os.environ, "MEMRA_OBS_METRICS_ADDR": "", **extra}
        p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "agent", "--dir",
                            str(tmp_path / "r"), "--once", "--priority", "normal"],
                           capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert "MEMRA_OBS_SINKS=" in p.stderr and "nothing for the agent to publish" in p.stderr
        assert [f for f in os.listdir(tmp_path / "r") if f.endswith(".ring")]


def test_agent_metrics_carry_worker_labels_and_ring_drops(tmp_path):
    """build_agent: one registry with the spec metrics labelled by worker, the agent's own
    health and memra_obs_dropped_total{signal="ring"}; promtool finds nothing to report."""
    from prometheus_client import CollectorRegistry

    from memra_obs.prom import encode

    obs, sink = observer(tmp_path, "rank3", slots=64)
    s = obs.session("glm5")
    rounds(s, 100)  # laps the ring before the agent starts; the table has the session
    env = {"MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": ""}
    reg = CollectorRegistry()
    agent, closers, server = build_agent(str(tmp_path), env=env, registry=reg)
    assert server is None
    agent.drain(5)
    body, _ = encode(reg, "application/openmetrics-text; version=1.0.0")
    text = body.decode()
    lost = agent.lost_total()
    assert lost > 0
    assert f'memra_obs_dropped_total{{signal="ring"}} {lost}.0' in text
    assert 'memra_spec_rounds_total{family="glm5",worker="rank3"}' in text
    assert f'memra_obs_agent_lost_records_total{{worker="rank3"}} {lost}.0' in text
    assert "memra_obs_agent_rings 1.0" in text
    s.end()
    promtool = shutil.which("promtool")
    if promtool:
        plain, _ = encode(reg, "text/plain")
        r = subprocess.run(
            [promtool, "check", "metrics"], input=plain, capture_output=True, timeout=30
        )
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
    sink.shutdown()
    agent.close()
    for c in closers:
        c()


def test_agent_self_metrics_are_the_in_process_ones(tmp_path):
    """Every exporter's own counts reach /metrics in agent mode as in-process (one wiring):
    a requests file that cannot be written (its directory gone after start-up) counts under
    export_errors{signal="requests"}."""
    import shutil

    from prometheus_client import CollectorRegistry

    from memra_obs.prom import encode
    from memra_obs.wiring import build_observer

    env = {
        "MEMRA_OBS_SINKS": "otel,prometheus",
        "MEMRA_OBS_METRICS_ADDR": "",
        "OTEL_TRACES_EXPORTER": "none",
        "MEMRA_OBS_REQUESTS_FILE": str(tmp_path / "gone" / "requests.jsonl"),
    }
    series = {}
    for mode in ("in-process", "agent"):
        reg = CollectorRegistry()
        (tmp_path / "gone").mkdir()
        if mode == "agent":
            obs, sink = observer(tmp_path, "rank0")
            agent, closers, _ = build_agent(str(tmp_path), env=env, registry=reg)
        else:
            obs = build_observer(env=env, registry=reg, level=0, prof=False)
        shutil.rmtree(tmp_path / "gone")
        with obs.session("glm5") as s:
            rounds(s, 3)
        if mode == "agent":
            agent.drain(5)
            agent.worker.flush(5.0)  # the requests file's appends have their own thread
        else:
            obs.flush(5.0)
        text = encode(reg, "text/plain")[0].decode()
        series[mode] = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line.startswith(("memra_obs_export_errors_total{", "memra_obs_dropped_total{"))
        }
        if mode == "agent":
            sink.shutdown()
            agent.close()
            for c in closers:
                c()
        obs.shutdown()
    for mode in series:
        assert series[mode]['memra_obs_export_errors_total{signal="requests"}'] == 1.0, mode
    signals = {mode: {k.split('"')[1] for k in v} for mode, v in series.items()}
    # The ring's losses are the agent's only.
    assert signals["in-process"] == signals["agent"] - {"ring"}


def test_rounds_a_worker_dropped_reach_the_agents_metrics(tmp_path):
    """A worker in agent mode that drops rounds for misuse: its ring carries the count and
    the agent publishes it as memra_obs_dropped_total{signal="rounds"}, as in-process."""
    from prometheus_client import CollectorRegistry

    from memra_obs.prom import encode
    from memra_obs.wiring import build_observer

    env = {"MEMRA_OBS_AGENT": str(tmp_path), "MEMRA_OBS_WORKER": "bad",
           "MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": ""}  # fmt: skip
    obs = build_observer(env=env, level=0, prof=False)
    with obs.session("glm5") as s:
        b = s.burst(4)
        for j in (1, 7, 2, 9, 3):  # j > k: dropped
            b.begin_round()
            for end in (b.end_draft, b.end_verify, b.end_accept, b.end_rollback):
                end()
            b.end_round(k=4, j=j)
        b.end()
    assert obs.dropped_rounds == 2
    reg = CollectorRegistry()
    agent, closers, _ = build_agent(str(tmp_path), env=env, registry=reg)
    agent.drain(5)
    text = encode(reg, "text/plain")[0].decode()
    assert 'memra_obs_dropped_total{signal="rounds"} 2.0' in text
    obs.shutdown()
    agent.close()
    for c in closers:
        c()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_worker_is_labelled_with_its_own_pid(tmp_path):
    """Workers forked from a master that built the observer: a label defaulted from the pid
    is each child's own pid (not the master's, shared by every ring); an explicit one stays."""
    from prometheus_client import CollectorRegistry

    from memra_obs.prom import encode
    from memra_obs.wiring import build_observer

    for extra in ({}, {"MEMRA_OBS_WORKER": "rank0"}):
        d = tmp_path / str(len(extra))
        env = {"MEMRA_OBS_AGENT": str(d), "MEMRA_OBS_SINKS": "prometheus",
               "MEMRA_OBS_METRICS_ADDR": "", **extra}  # fmt: skip
        obs = build_observer(env=env, level=0, prof=False)

        def child(obs=obs) -> bytes:
            with obs.session("glm5") as s:
                rounds(s, 2)
            return str(os.getpid()).encode()

        pid = in_child(child).decode()
        obs.shutdown()
        reg = CollectorRegistry()
        agent, closers, _ = build_agent(str(d), env=env, registry=reg)
        agent.drain(5)
        text = encode(reg, "text/plain")[0].decode()
        agent.close()
        for c in closers:
            c()
        label = extra.get("MEMRA_OBS_WORKER", pid)
        assert f'memra_spec_rounds_total{{family="glm5",worker="{label}"}} 2.0' in text, text
        assert f'worker="{os.getpid()}"}} 2.0' not in text  # not the master's


def test_a_registry_given_in_agent_mode_is_said_unused(tmp_path, caplog):
    """In agent mode the agent publishes: a registry argument is not used, and that is said
    once (not silently dropped)."""
    import logging

    from prometheus_client import CollectorRegistry

    from memra_obs import diagnostics
    from memra_obs.wiring import build_observer

    diagnostics.reset()
    env = {"MEMRA_OBS_AGENT": str(tmp_path), "MEMRA_OBS_SINKS": "prometheus",
           "MEMRA_OBS_METRICS_ADDR": ""}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="memra_obs"):
        for _ in range(2):
            build_observer(env=env, registry=CollectorRegistry(), level=0, prof=False).shutdown()
    said = [r.getMessage() for r in caplog.records if "registry argument" in r.getMessage()]
    assert len(said) == 1 and "MEMRA_OBS_AGENT" in said[0] and "not used" in said[0], said


def test_a_finished_workers_series_go_after_the_grace_period(tmp_path):
    """The series of a worker whose ring retired stay for ``forget_s`` (the last scrapes),
    then go, the agent's per-worker counts with them; a live worker's and the totals stay."""
    from prometheus_client import CollectorRegistry

    from memra_obs.prom import encode

    env = {"MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": ""}
    reg = CollectorRegistry()
    agent, closers, _ = build_agent(str(tmp_path), env=env, registry=reg, forget_s=1.0)
    (o1, gone), (o2, live) = observer(tmp_path, "gone"), observer(tmp_path, "live")
    for o in (o1, o2):
        with o.session("glm5") as s:
            rounds(s, 3)
    gone.shutdown()
    agent.drain(5)
    assert agent.rings == 1

    def scrape():
        return encode(reg, "text/plain")[0].decode()

    assert 'memra_spec_rounds_total{family="glm5",worker="gone"} 3.0' in scrape()
    time.sleep(1.1)
    agent.drain(5)
    text = scrape()
    assert 'worker="gone"' not in text
    assert 'memra_spec_first_token_seconds_count{worker="live"} 1.0' in text
    assert 'memra_spec_rounds_total{family="glm5",worker="live"} 3.0' in text
    assert 'memra_obs_agent_records_total{worker="live"}' in text
    assert agent.published == 2 * (1 + 3 + 1 + 1 + 1)
    live.shutdown()
    agent.close()
    for c in closers:
        c()


def test_records_reach_exporters_in_batches_not_one_by_one(tmp_path):
    """One pass hands every ring's news to each exporter as one batch."""
    (o1, s1), (o2, s2) = observer(tmp_path, "a"), observer(tmp_path, "b")
    for o in (o1, o2):
        with o.session("glm5") as s:
            rounds(s, 20)
    sizes: list[int] = []

    class Sizes(Collect):
        def export(self, batch):
            sizes.append(len(batch))

    a = Agent(str(tmp_path), [Sizes()])
    a.step()
    assert sizes == [2 * (1 + 20 + 1 + 1 + 1)]
    assert Counter(sizes)
    s1.shutdown()
    s2.shutdown()
    a.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_only_the_reading_thread_runs_idle(tmp_path):
    """``--priority idle`` (the default) is the ring reader's alone: /metrics' and the span
    senders' threads keep ordinary scheduling. They inherited SCHED_IDLE, and a scrape then
    waited seconds for a turn on a host whose cores were busy (Prometheus saw ``up == 0``)."""
    env = {**os.environ, "MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0",
           "MEMRA_OBS_SPANS_FILE": str(tmp_path / "s.jsonl")}  # fmt: skip
    env.pop("MEMRA_OBS_SINKS", None)
    p = subprocess.Popen([sys.executable, "-m", "memra_obs.cli", "agent", "--dir",
                          str(tmp_path / "r")], env=env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stderr is not None and "publishing rings" in p.stderr.readline()
        time.sleep(0.3)  # past set_priority, which follows the banner's exporters
        policy = {}  # /proc/PID/task/TID/stat field 41: 0 SCHED_OTHER, 5 SCHED_IDLE
        for tid in os.listdir(f"/proc/{p.pid}/task"):
            with open(f"/proc/{p.pid}/task/{tid}/stat") as f:
                policy[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[38])
        assert policy.pop(p.pid) == os.SCHED_IDLE
        assert policy and set(policy.values()) == {os.SCHED_OTHER}, policy
    finally:
        p.terminate()
        p.wait(30)


def test_a_worker_in_agent_mode_without_a_sink_says_so(tmp_path, caplog):
    """``MEMRA_OBS_AGENT=... ./serve`` (as the README and worker.yaml showed it) with no
    MEMRA_OBS_SINKS wrote no ring and published nothing, without a word."""
    from memra_obs.wiring import build_observer

    ring = tmp_path / "ring"
    obs = build_observer(env={"MEMRA_OBS_AGENT": str(ring)}, level=0, prof=False)
    obs.shutdown()
    assert not ring.exists() or not os.listdir(ring)
    assert caplog.text.count("no ring is written, since MEMRA_OBS_SINKS names neither") == 1


def test_agent_spans_carry_the_agents_resource_and_each_workers_label(tmp_path):
    """Agent mode: every worker's spans go out under the agent's resource (its
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the ring carries records, not a resource),
    and workers are told apart by memra.spec.worker on their session spans (README)."""
    for w in ("0", "1"):
        obs, sink = observer(tmp_path, w)
        with obs.session("glm5") as s:
            rounds(s, 3)
        sink.shutdown()
    spans = tmp_path / "s.jsonl"
    env = {"MEMRA_OBS_SINKS": "otel", "MEMRA_OBS_SPANS_FILE": str(spans),
           "OTEL_SERVICE_NAME": "agent-svc", "OTEL_RESOURCE_ATTRIBUTES": "host.name=h1"}  # fmt: skip
    agent, closers, _ = build_agent(str(tmp_path), env=env)
    agent.drain(5)
    agent.close()
    for c in closers:
        c()
    workers, resources = [], set()
    for line in spans.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            attrs = {a["key"]: a["value"]["stringValue"] for a in rs["resource"]["attributes"]
                     if "stringValue" in a["value"]}  # fmt: skip
            resources.add((attrs["service.name"], attrs.get("host.name")))
            for sp in rs["scopeSpans"][0]["spans"]:
                if sp["name"] == "spec.session":
                    a = {x["key"]: x["value"] for x in sp["attributes"]}
                    workers.append(a["memra.spec.worker"]["stringValue"])
    assert resources == {("agent-svc", "h1")}
    assert sorted(workers) == ["0", "1"]


def test_a_session_open_across_a_graceful_restart_keeps_its_whole_request_record(tmp_path):
    """The per-request record (the agent's requests file, the session span's
    ``memra.spec.request.*``) of a session open across a SIGTERMed agent counts every round,
    as the worker's own ``spec_decode()`` does: it held only the rounds after the restart
    (num_spec_steps 5 of rounds 9, the first-token profile gone)."""
    from memra_obs.otel.spans import SpanBuilder
    from memra_obs.requests import RequestsExporter

    rings, out = tmp_path / "rings", tmp_path / "req.jsonl"
    rings.mkdir()
    obs, sink = observer(rings, "w")
    s = obs.session("glm5")
    rounds(s, 4, k=4, j=3)
    agent1 = Agent(str(rings), [Collect()])
    assert agent1.drain(5)
    agent1.close()  # graceful: the session stays open for the next agent
    rounds(s, 5, k=4, j=1)
    truth = s.spec_decode()
    s.end()
    cap, req = Collect(), RequestsExporter(str(out))
    agent2 = Agent(str(rings), [cap, req])
    assert agent2.drain(5)
    agent2.close()
    sink.shutdown()
    line = json.loads(out.read_text())
    assert line["rounds"] == line["num_spec_steps"] == truth["num_spec_steps"] == 9
    for key in ("acceptance_histogram", "num_accepted_draft_tokens", "phase_ms"):
        assert line[key] == truth[key], key
    assert line["first_token"] is not None
    spans: list = []
    SpanBuilder().add(cap.records, spans)
    (session,) = [sp for sp in spans if sp[0] == "spec.session"]
    attrs = dict(session[6])
    assert attrs["memra.spec.request.num_spec_steps"] == 9
    assert attrs["memra.spec.request.num_accepted_draft_tokens"] == 4 * 3 + 5 * 1
    assert len(cap.of(RoundRecord)) == 5  # the rounds agent 1 published are not published again


def test_two_live_workers_given_one_label_are_said_once(tmp_path, caplog):
    """Two ranks given one MEMRA_OBS_WORKER sum their series under one label: said once, naming
    both rings; a ring that never published (a forked helper) or a restarted worker is not."""
    import logging

    from memra_obs import diagnostics

    diagnostics.reset()
    (a0, r0), (b0, q0) = observer(tmp_path, "0"), observer(tmp_path, "0")
    (o1, s1), (_, idle1) = observer(tmp_path, "1"), observer(tmp_path, "1")
    (old, old_sink) = observer(tmp_path, "r")
    with old.session("glm5") as s:
        rounds(s, 2)
    old_sink.shutdown()
    (new, new_sink) = observer(tmp_path, "r")
    cap = Collect()
    a = Agent(str(tmp_path), [cap])
    with caplog.at_level(logging.WARNING, logger="memra_obs"):
        for _ in range(2):
            for o in (a0, b0, o1, new):
                with o.session("glm5") as s:
                    rounds(s, 3)
            assert a.drain(5)
    said = [r.getMessage() for r in caplog.records if "worker label" in r.getMessage()]
    assert len(said) == 1 and "'0'" in said[0] and "MEMRA_OBS_WORKER" in said[0], said
    assert os.path.basename(r0.path) in said[0] and os.path.basename(q0.path) in said[0]
    assert a.counts()["0"][0] == 2 * a.counts()["1"][0]  # summed: why it is said
    for sink in (r0, q0, s1, idle1, new_sink):
        sink.shutdown()
    a.close()


def test_the_agent_keeps_every_workers_sessions_open(tmp_path, caplog):
    """The agent's exporters kept 4096 sessions open at once, one process's bound, for every
    worker of the host: 8 ranks of 600 requests in flight lost 704 request lines, closed 704
    session spans unfinished and counted 1,218 rounds under family="unknown", counted nowhere."""
    from prometheus_client import CollectorRegistry

    rings, out = tmp_path / "rings", tmp_path / "r.jsonl"
    rings.mkdir()
    workers = [observer(rings, f"w{i}", slots=1 << 14) for i in range(5)]
    sessions = [obs.session("glm5") for obs, _ in workers for _ in range(850)]
    for s in sessions:
        rounds(s, 1)
    env = {"MEMRA_OBS_SINKS": "otel,prometheus", "MEMRA_OBS_METRICS_ADDR": "",
           "MEMRA_OBS_REQUESTS_FILE": str(out), "MEMRA_OBS_SPANS_FILE": str(tmp_path / "s.jsonl")}  # fmt: skip
    reg = CollectorRegistry()
    with caplog.at_level("WARNING", logger="memra_obs"):
        agent, closers, _ = build_agent(str(rings), env=env, registry=reg)
        assert agent.drain(30)  # 4,250 sessions open at the exporters
        for s in sessions:
            rounds(s, 1)
            s.end()
        assert agent.drain(30)
        agent.close()
        for close in closers:
            close()
    for _, sink in workers:
        sink.shutdown()
    assert len(out.read_text().splitlines()) == len(sessions)
    assert not [r.getMessage() for r in caplog.records if "open at once" in r.getMessage()]
    unfinished = out.with_name("s.jsonl").read_text().count('"memra.spec.unfinished"')
    assert unfinished == 0
    assert (
        reg.get_sample_value("memra_spec_rounds_total", {"family": "unknown", "worker": "w0"})
        is None
    )


def test_records_the_writer_refused_are_not_said_as_a_lapped_ring(tmp_path, caplog):
    """A session record too large for the ring (a 3,000-character label, given past the knob's
    bound) was refused by the writer, unsaid, and the agent blamed a lapped ring: a slow agent
    or MEMRA_OBS_RING_SLOTS too small. The writer's own count is said as refused."""
    from memra_obs import diagnostics

    diagnostics.reset()
    obs, sink = observer(tmp_path, "w" * 3000)
    with obs.session("glm5") as s:
        rounds(s, 1)
    sink.shutdown()
    a = Agent(str(tmp_path), [Collect()])
    with caplog.at_level("WARNING", logger="memra_obs"):
        assert a.drain(5)
    a.close()
    said = [r.getMessage() for r in caplog.records if "ring" in r.getMessage()]
    assert a.lost_total() == sink.refused == 1
    assert not [m for m in said if "lapped" in m], said
    assert [m for m in said if "ring refused 1 records" in m and "cannot hold" in m], said


def test_the_agent_says_where_spans_go_and_how_many_arrived(tmp_path):
    """``memra-obs agent``'s banner named only the ring directory and /metrics while it wrote
    ./memra-obs-spans.jsonl or sent to OTEL_EXPORTER_OTLP_ENDPOINT, and with no collector
    listening its done line said ``published=N lost=0`` with every span dropped. Now the banner
    names where spans go and the done line adds the spans exported and dropped (as the demo's);
    the fields both lines had stay first, as they were."""
    spans = tmp_path / "s.jsonl"
    dead = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "500",
    }
    for extra, where, done in (
        ({"MEMRA_OBS_SPANS_FILE": str(spans)}, f"; spans -> {spans}", r"spans to file: (\d+) exp"),
        (dead, "; spans -> http://127.0.0.1:1/", r"spans to otlp: 0 exported, (\d+) dropped"),
    ):
        obs, sink = observer(str(tmp_path / "r"), "w")
        with obs.session("glm5") as s:
            rounds(s, 1)
        sink.shutdown()
        env = {**os.environ, "MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0", **extra}
        env.pop("MEMRA_OBS_SINKS", None)
        p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "agent", "--dir",
                            str(tmp_path / "r"), "--once", "--priority", "normal"],
                           capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
        banner, *_, end = p.stderr.splitlines()
        assert p.returncode == 0 and re.fullmatch(
            r"\[memra-obs agent\] publishing rings in \S+; /metrics on http://\S+" + re.escape(where)
            + r".*", banner), p.stderr  # fmt: skip
        n = re.fullmatch(r"\[memra-obs agent\] done: published=\d+ lost=0 rings_removed=1; "
                         + done + ".*", end)  # fmt: skip
        assert n and int(n[1]) > 0, p.stderr
    assert spans.read_text().count('"spec.session"') == 1
