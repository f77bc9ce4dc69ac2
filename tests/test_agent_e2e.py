"""Agent mode end to end: several ``memra-obs demo`` worker processes write rings, one
agent publishes. Counts add up, a SIGKILLed worker loses nothing it wrote, a restarted agent
counts nothing twice, a tiny ring's losses are exact, and a real Prometheus scrapes the
agent with exemplars that name exported traces."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import polling
import pytest

from memra_obs.agent.format import KIND_SESSION
from memra_obs.agent.main import Agent
from memra_obs.agent.reader import RingReader
from memra_obs.timeline import BurstRecord, RoundRecord, SessionEndRecord, SessionRecord

DONE = re.compile(r"demo done: sessions=(\d+) rounds=(\d+) tokens=(\d+)")
AGENT_URL = re.compile(r"/metrics on (http://\S+/metrics)")
IDENTITY = (
    "memra_obs_agent_records_total + memra_obs_agent_lost_records_total"
    " - memra_obs_agent_written_records_total"
)


class Collect:
    """A RecordExporter that keeps everything (thread-safe enough: list.extend)."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    def export(self, batch: Any) -> None:
        self.records.extend(batch)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass


#: The conditions read logs and files that may not be there yet (None[1], next() of nothing).
wait_for = partial(polling.wait_for, timeout_s=60.0, tolerate=(Exception,))


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_", "RANK"))}
    env.update(extra)
    return env


class Procs:
    """Every child this test starts; all killed at the end, whatever happened."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=f, cwd=self.tmp)
        self.procs.append(p)
        self.logs[p.pid] = log
        return p

    def log(self, p: subprocess.Popen[bytes]) -> str:
        return self.logs[p.pid].read_text(errors="replace")

    def demo(
        self, ring_dir: Path, i: int, requests: int, speed: float = 20, **env: str
    ) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "memra_obs.cli", "demo", "--requests", str(requests), "--seed", str(i),
                "--speed", str(speed)]  # fmt: skip
        e = clean_env(MEMRA_OBS_AGENT=str(ring_dir), MEMRA_OBS_SINKS="otel,prometheus",
                      MEMRA_OBS_WORKER=f"w{i}", **env)  # fmt: skip
        return self.start(f"demo{i}", argv, e)

    def totals(self, p: subprocess.Popen[bytes]) -> tuple[int, int, int]:
        assert p.wait(120) == 0, self.log(p)[-2000:]
        m = DONE.search(self.log(p))
        assert m, self.log(p)[-2000:]
        return int(m[1]), int(m[2]), int(m[3])

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    ps = Procs(tmp_path)
    try:
        yield ps
    finally:
        ps.kill_all()


class AgentThread:
    """An in-process agent running its loop on a thread."""

    def __init__(self, directory: Path, exporters: list[Any], **kw: Any) -> None:
        self.agent = Agent(str(directory), exporters, **kw)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.agent.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.agent.close()


def per_worker(records: list[Any]) -> dict[str, Counter[str]]:
    """sessions (clean ends), rounds and tokens per worker label, from the agent's stream."""
    worker_of: dict[int, str] = {}
    out: dict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        t = type(r)
        if t is SessionRecord:
            worker_of[r.session] = r.worker
        elif t is RoundRecord:
            out[worker_of[r.session]]["rounds"] += 1
        elif t is BurstRecord:
            out[worker_of[r.session]]["tokens"] += r.tokens
        elif t is SessionEndRecord and not r.error:
            out[worker_of[r.session]]["sessions"] += 1
    return out


def test_the_agent_publishes_exactly_what_the_workers_did(tmp_path, procs):
    """3 demo workers + 1 agent: per worker, sessions/rounds/tokens equal the demo's own count,
    on the record stream and on the agent's Prometheus counters."""
    from prometheus_client import CollectorRegistry

    from memra_obs.agent.main import build_agent

    rings = tmp_path / "rings"
    reg = CollectorRegistry()
    cap = Collect()
    agent, closers, _ = build_agent(str(rings), env={"MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": ""},
                                    registry=reg, exporters=[cap])  # fmt: skip
    stop = threading.Event()
    t = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    t.start()
    try:
        workers = [procs.demo(rings, i, requests=6) for i in range(3)]
        totals = {f"w{i}": procs.totals(p) for i, p in enumerate(workers)}
        wait_for(
            "the rings to be read and removed",
            lambda: agent.rings_removed == 3 and agent.rings == 0,
        )
    finally:
        stop.set()
        t.join(30)
        agent.close()
        for c in closers:
            c()
    got = per_worker(cap.records)
    for w, (sessions, rounds, tokens) in totals.items():
        assert got[w] == Counter(sessions=sessions, rounds=rounds, tokens=tokens), w
        assert (
            reg.get_sample_value("memra_spec_rounds_total", {"family": "glm5", "worker": w})
            == rounds
        )
    assert agent.lost_total() == 0
    assert not [f for f in os.listdir(rings) if f.endswith(".ring")]


def test_a_worker_killed_mid_burst_loses_nothing_it_wrote(tmp_path, procs):
    """SIGKILL a worker mid-run: the agent publishes every record in its ring (checked
    against an independent read of the file), ends its open session as WorkerGone."""
    rings = tmp_path / "rings"
    cap = Collect()
    at = AgentThread(rings, [cap], cleanup=False)
    try:
        other = procs.demo(rings, 1, requests=4)
        victim = procs.demo(rings, 0, requests=10_000, speed=5)
        path = wait_for(
            "the victim's ring",
            lambda: next(
                str(rings / f) for f in os.listdir(rings) if "-w0-" in f and f.endswith(".ring")
            ),
        )
        reader = RingReader(path)
        wait_for("300 records in the ring", lambda: reader.state().rec_next >= 300)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        written = reader.state().rec_next
        reader.close()
        procs.totals(other)
        wait_for("both rings retired", lambda: at.agent.rings_retired == 2)
    finally:
        at.close()
    ref = RingReader(path)  # independent read of the whole file from position 0
    ref.pos = ref.rec = 0
    raw = []
    while items := ref.poll(1 << 16):
        raw += [i.rec[0] if i.kind == KIND_SESSION else i.rec for i in items]
    assert ref.lost == 0 and len(raw) == written
    gids = {r.session for r in cap.records if type(r) is SessionRecord and r.worker == "w0"}
    mine = [r for r in cap.records if r.session in gids]
    synthesized = [r for r in mine if type(r) is SessionEndRecord and r.error == "WorkerGone"]
    published = [r for r in mine if r not in synthesized]

    def key(r: Any) -> tuple[Any, ...]:
        return (type(r).__name__, *r[1:])  # everything but the (remapped) session id

    assert [key(r) for r in published] == [key(r) for r in raw]
    assert len(synthesized) == (0 if type(raw[-1]) is SessionEndRecord else 1)
    assert Counter(type(r).__name__ for r in raw)["RoundRecord"] > 100


def _spans(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                out.extend(ss["spans"])
    return out


def _rings(d: Path) -> list[str]:
    return sorted(str(d / f) for f in os.listdir(d) if f.endswith(".ring"))


def _cursor(path: str) -> int:
    r = RingReader(path)
    try:
        return r.pos
    finally:
        r.close()


def _agent(
    procs: Procs, name: str, rings: Path, spans: Path, addr: str = ""
) -> subprocess.Popen[bytes]:
    env = clean_env(MEMRA_OBS_SPANS_FILE=str(spans), MEMRA_OBS_METRICS_ADDR=addr,
                    MEMRA_OBS_SINKS="otel,prometheus")  # fmt: skip
    # nice 10, not the default SCHED_IDLE: on a CI machine whose cores other jobs keep busy,
    # an idle-class agent can starve for longer than these tests wait.
    argv = [
        sys.executable,
        "-m",
        "memra_obs.cli",
        "agent",
        "--dir",
        str(rings),
        "--priority",
        "low",
    ]
    return procs.start(name, argv, env)


def test_a_restarted_agent_resumes_without_double_counting(tmp_path, procs):
    """`memra-obs agent` SIGTERMed mid-run and started again: across both agents' span files
    every round of every worker appears exactly once, and every session once, finished."""
    rings = tmp_path / "rings"
    a1 = _agent(procs, "agent1", rings, tmp_path / "spans1.jsonl")
    wait_for("agent 1 up", lambda: "publishing" in procs.log(a1))
    # speed 3: the same records over more wall time, so the workers outlive agent 1 even
    # when a loaded machine makes its drain and flush take seconds
    workers = [procs.demo(rings, i, requests=25, speed=3) for i in range(3)]
    paths = wait_for("3 rings", lambda: _rings(rings) if len(_rings(rings)) == 3 else None)

    def committed() -> bool:  # agent 1 has published part of every ring
        return all(_cursor(p) > 0 for p in paths)

    wait_for("agent 1 to commit a cursor in every ring", committed)
    a1.send_signal(signal.SIGTERM)
    assert a1.wait(30) == 0, procs.log(a1)
    assert all(p.poll() is None for p in workers), "the workers should outlive agent 1"
    time.sleep(0.3)  # records pile up while no agent runs
    a2 = _agent(procs, "agent2", rings, tmp_path / "spans2.jsonl")
    wait_for("agent 2 up", lambda: "publishing" in procs.log(a2))
    totals = [procs.totals(p) for p in workers]
    wait_for("rings retired", lambda: not [f for f in os.listdir(rings) if f.endswith(".ring")])
    a2.send_signal(signal.SIGTERM)
    assert a2.wait(30) == 0, procs.log(a2)
    s1, s2 = _spans(tmp_path / "spans1.jsonl"), _spans(tmp_path / "spans2.jsonl")
    rounds1 = [s["spanId"] for s in s1 if s["name"] == "spec.round"]
    rounds2 = [s["spanId"] for s in s2 if s["name"] == "spec.round"]
    assert rounds1 and rounds2, "the restart should fall mid-run"
    all_rounds = rounds1 + rounds2
    assert len(all_rounds) == len(set(all_rounds)) == sum(t[1] for t in totals)
    sessions = [s for s in s1 + s2 if s["name"] == "spec.session"]
    assert len(sessions) == len({s["spanId"] for s in sessions}) == sum(t[0] for t in totals)
    for s in sessions:
        keys = {a["key"] for a in s.get("attributes", [])}
        assert not any(k.endswith("unfinished") for k in keys), s
    assert "lost=0" in procs.log(a1) and "lost=0" in procs.log(a2)
    # Some sessions were open across the restart: their rounds are split over both files.
    t1 = {s["traceId"] for s in s1 if s["name"] == "spec.round"}
    t2 = {s["traceId"] for s in s2 if s["name"] == "spec.round"}
    assert t1 & t2


def _sum(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))


def test_spans_an_agent_had_not_delivered_survive_its_sigkill(tmp_path, procs):
    """At-least-once is about delivery (README, "Delivery semantics"): an agent SIGKILLed
    while its spans wait on a receiver that never answers has committed no cursor past them
    and removed no ring, so the next agent publishes every round."""
    hole = socket.socket()  # accepts connections (the backlog), never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    rings = tmp_path / "rings"
    env = clean_env(MEMRA_OBS_SINKS="otel,prometheus", MEMRA_OBS_METRICS_ADDR="127.0.0.1:0",
                    OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                    OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{hole.getsockname()[1]}",
                    OTEL_EXPORTER_OTLP_TIMEOUT="120000")  # fmt: skip
    argv = [sys.executable, "-m", "memra_obs.cli", "agent", "--dir", str(rings), "--priority", "low"]  # fmt: skip
    try:
        a1 = procs.start("agent1", argv, env)
        url = wait_for("agent 1's /metrics", lambda: AGENT_URL.search(procs.log(a1))[1])
        totals = [procs.totals(p) for p in [procs.demo(rings, i, requests=4) for i in range(2)]]

        def read_all() -> bool:  # every ring read to its end and no longer attached
            w = _sum(url, "memra_obs_agent_written_records_total")
            n = _sum(url, "memra_obs_agent_records_total")
            return w > 0 and n == w and _sum(url, "memra_obs_agent_rings ") == 0

        wait_for("agent 1 to read both rings to their end", read_all)
        a1.kill()
        a1.wait(10)
        assert len(_rings(rings)) == 2, "the rings' spans were never delivered: they must stay"
    finally:
        hole.close()
    spans = tmp_path / "spans.jsonl"
    a2 = _agent(procs, "agent2", rings, spans)
    wait_for("rings retired", lambda: not _rings(rings))
    a2.send_signal(signal.SIGTERM)
    assert a2.wait(30) == 0, procs.log(a2)
    rounds = [s for s in _spans(spans) if s["name"] == "spec.round"]
    assert len(rounds) == sum(t[1] for t in totals), procs.log(a2)
    assert "lost=0" in procs.log(a2)


def test_a_tiny_ring_reports_exactly_what_it_lost(tmp_path, procs):
    """A worker on a 64-slot ring with no agent running: the late agent counts as lost
    exactly what it could not deliver."""
    rings = tmp_path / "rings"
    p = procs.demo(rings, 0, requests=3, MEMRA_OBS_RING_SLOTS="64")
    procs.totals(p)
    path = str(next(rings.glob("*.ring")))
    written = RingReader(path).state().rec_next
    cap = Collect()
    agent = Agent(str(rings), [cap], cleanup=False)
    assert agent.drain(10)
    st = agent.stats()
    agent.close()
    assert st == []  # retired: the writer is gone and the ring is read
    synthetic = sum(1 for r in cap.records if type(r) is SessionRecord and r.family == "unknown")
    synthetic += sum(1 for r in cap.records if type(r) is SessionEndRecord and r.error)
    delivered = len(cap.records) - synthetic
    assert agent.lost_total() > 0 and delivered + agent.lost_total() == written
    assert RingReader(path).state().refused == 0  # nothing refused: all of it was overwrite


# ------------------------------------------------------------------- a real Prometheus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not on PATH")
def test_prometheus_scrapes_the_agent_and_exemplars_name_exported_traces(tmp_path, procs):
    """Prometheus scrapes the agent's /metrics: every worker's rounds are there under its
    worker label, and query_exemplars returns trace ids that are in the exported spans."""
    rings = tmp_path / "rings"
    spans = tmp_path / "spans.jsonl"
    t_start = time.time()
    agent = _agent(procs, "agent", rings, spans, addr="127.0.0.1:0")
    url = wait_for(
        "the agent's /metrics", lambda: AGENT_URL.search(procs.log(agent))[1], timeout_s=30
    )
    hostport = url.split("//")[1].split("/")[0]
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: memra-agent\n    static_configs: [{{targets: ['{hostport}']}}]\n"
    )
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    prom = procs.start(
        "prometheus",
        [
            "prometheus",
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--enable-feature=exemplar-storage",
        ],
        clean_env(),
    )
    wait_for(
        "Prometheus ready",
        lambda: urllib.request.urlopen(base + "/-/ready", timeout=2).status == 200,
    )
    workers = [procs.demo(rings, i, requests=5) for i in range(2)]
    totals = {f"w{i}": procs.totals(p) for i, p in enumerate(workers)}

    def scraped() -> bool:
        res = _api(base, "query", query="memra_spec_rounds_total")["result"]
        got = {r["metric"].get("worker"): float(r["value"][1]) for r in res}
        return got == {w: float(t[1]) for w, t in totals.items()}

    wait_for("Prometheus to hold every worker's rounds", scraped, timeout_s=60, every_s=0.5)

    def balanced() -> bool:  # read + lost == written, per worker, in PromQL (README, "Agent mode")
        res = _api(base, "query", query=IDENTITY)["result"]
        return {r["metric"]["worker"] for r in res} == set(totals) and all(
            float(r["value"][1]) == 0 for r in res
        )

    wait_for("records + lost - written == 0 for every worker", balanced, timeout_s=30, every_s=0.5)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0
    trace_ids = {s["traceId"] for s in _spans(spans)}
    assert trace_ids
    data = _api(base, "query_exemplars", query="memra_spec_round_seconds_bucket",
                start=str(t_start - 60), end=str(time.time() + 60))  # fmt: skip
    ex_ids = {e["labels"]["trace_id"] for series in data for e in series["exemplars"]}
    workers_seen = {series["seriesLabels"].get("worker") for series in data}
    assert ex_ids and ex_ids <= trace_ids
    assert workers_seen == set(totals)
    prom.terminate()
    prom.wait(30)
