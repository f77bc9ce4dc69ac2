"""A real Prometheus (exemplar storage on) scrapes a worker driven through a few hundred rounds;
its HTTP API must give sane quantiles, exact counters and the sessions' trace ids."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import wait_for
from prometheus_client import CollectorRegistry

from memra_obs.clock import now_ns
from memra_obs.export import QueueSink
from memra_obs.observer import Observer
from memra_obs.prom import PrometheusExporter, serve_metrics
from memra_obs.records import VerifySplit

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus not on PATH (Debian: apt-get install prometheus)",
    ),
]

MS = 1_000_000
#: (gap, draft, verify, accept, rollback, maint) ns; every 10th round's verify is 3x: slow.
NORMAL = (50_000, 1_200_000, 7_000_000, 120_000, 60_000, 300_000)
SLOW = (50_000, 1_200_000, 21_000_000, 120_000, 60_000, 300_000)
ROUNDS = 100  # per session
SESSIONS = (("glm5", 0), ("qwen3", 1), ("glm5", 2), ("qwen3", 3))


class SpanCollector:
    """The spans engineer's SpanBuilder behind the same queue: the spans that would be exported."""

    def __init__(self) -> None:
        from memra_obs.otel.spans import SpanBuilder

        self.builder = SpanBuilder(round_spans=256)
        self.spans: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    def export(self, batch: Any) -> None:
        with self.lock:
            self.builder.add(batch, self.spans)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        pass

    def ids(self, name: str) -> set[tuple[str, str]]:
        with self.lock:
            return {(f"{sp[1]:032x}", f"{sp[2]:016x}") for sp in self.spans if sp[0] == name}


def round_span(s: Any, r: Any) -> int:
    from memra_obs.otel.spans import round_span_id

    return round_span_id(s.span_id, r.index) if r.index < 256 else 0


class ScriptedClock:
    """Round boundaries from a script, not a stopwatch: the histograms are then exact."""

    immediate = True

    def __init__(self, e: Any = None, eh: Any = None) -> None:
        self._t = now_ns()
        self._steps = (d for i in range(10**6) for d in (SLOW if i % 10 == 9 else NORMAL))

    def mark(self) -> int:
        self._t += next(self._steps)
        return self._t

    def begin(self) -> int:
        return self.mark()

    def settle(self, stamps: list[int]) -> list[int]:
        return stamps


def readme_promql() -> list[list[str]]:
    """The README's ```promql blocks, a list of queries each (a query: a line and the indented
    lines after it; comments left out)."""
    text = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = []
    for body in re.findall(r"^```promql\n(.*?)^```", text, re.M | re.S):
        qs: list[str] = []
        for line in body.splitlines():
            line = re.sub(r"\s+#.*$", "", line)
            if not line.strip() or line.startswith("#"):
                continue
            if line[0].isspace() and qs:
                qs[-1] += " " + line.strip()
            else:
                qs.append(line.strip())
        blocks.append(qs)
    return blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.load(r)
    assert doc["status"] == "success", doc
    return doc["data"]


def scalar(base: str, q: str) -> float | None:
    res = api(base, "query", query=q)["result"]
    return float(res[0]["value"][1]) if res else None


@pytest.fixture
def worker() -> Iterator[dict[str, Any]]:
    pytest.importorskip("memra_obs.otel.spans")
    reg = CollectorRegistry()
    prom = PrometheusExporter(reg, round_span_id=round_span)
    spans = SpanCollector()
    q = QueueSink([prom, spans], interval_ms=20)
    prom.attach_queue(q)
    vs = VerifySplit()
    obs = Observer(
        [q],
        level=2,
        prof=True,
        clock=ScriptedClock,
        verify_split=vs,
        memory=lambda: [(0, 81_000), (1, 80_500)],
    )
    srv = serve_metrics(("127.0.0.1", 0), registry=reg)
    try:
        yield {"obs": obs, "srv": srv, "vs": vs, "queue": q, "spans": spans}
    finally:
        obs.shutdown(5.0)
        srv.close()


@pytest.fixture
def prometheus(tmp_path: Path, worker: dict[str, Any]) -> Iterator[str]:
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
        "scrape_configs:\n  - job_name: memra\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{worker['srv'].port}']\n"
    )
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage",
             "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            "Prometheus to be ready",
            lambda: urllib.request.urlopen(base + "/-/ready", timeout=2).status == 200,
            40.0,
            detail=lambda: log.read_text()[-3000:] if log.exists() else "",
        )
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def drive(obs: Observer, vs: VerifySplit, trace_ids: dict[str, str]) -> None:
    """The simulated loop: sessions of ROUNDS rounds, two families, first-token profile on."""
    for family, n in SESSIONS:
        with obs.session(family) as s:
            trace_ids[f"{family}:{n}"] = f"{s.record.trace_id:032x}"
            s.free_memory("before")
            for bucket in ("cache_alloc", "prime", "anchor", "draft_alloc"):
                s.lap(bucket)
            s.free_memory("after")
            for burst in range(ROUNDS // 20):
                b = s.burst(4)
                for i in range(20):
                    b.begin_round()
                    b.end_draft()
                    vs.add(kda=2 * MS, kda_scan=MS // 2, mla=3 * MS, ffn=MS)
                    b.end_verify()
                    b.end_accept()
                    b.end_rollback()
                    b.end_round(k=4, j=(burst * 20 + i) % 5, ctx=100, seq_rows=1)
                b.end()
        time.sleep(1.2)  # let a scrape see each session's exemplars


def test_prometheus_scrapes_quantiles_counters_and_exemplars(worker, prometheus):
    """Quantiles in the right buckets, counters equal to what the loop did, exemplars that
    name exported spans."""
    obs, base = worker["obs"], prometheus
    trace_ids: dict[str, str] = {}
    t_start = time.time()
    loop = threading.Thread(target=drive, args=(obs, worker["vs"], trace_ids), daemon=True)
    loop.start()
    loop.join(60)
    assert not loop.is_alive(), "the simulated loop did not finish in 60 s"
    assert obs.flush(10.0)
    total = ROUNDS * len(SESSIONS)
    wait_for(
        f"{total} rounds in Prometheus",
        lambda: scalar(base, "sum(memra_spec_rounds_total)") == total,
        40.0,
    )
    wait_for("the target to be up", lambda: scalar(base, 'up{job="memra"}') == 1, 40.0)

    per_family = ROUNDS * 2
    for fam in ("glm5", "qwen3"):
        sel = f'{{family="{fam}"}}'
        assert scalar(base, f"memra_spec_rounds_total{sel}") == per_family
        assert scalar(base, f"memra_spec_drafted_tokens_total{sel}") == 4 * per_family
        assert scalar(base, f"memra_spec_accepted_tokens_total{sel}") == 2 * per_family  # j = 0..4
        assert scalar(base, f"memra_spec_verify_seq_rows_total{sel}") == per_family
        assert scalar(base, f"memra_spec_slow_rounds_total{sel}") == per_family // 10
        assert scalar(base, f"memra_spec_round_seconds_count{sel}") == per_family
        assert scalar(base, f"memra_spec_drafted_tokens_per_round_sum{sel}") == 4 * per_family

    def q(quantile: float, metric: str, sel: str = "") -> float:
        v = scalar(base, f"histogram_quantile({quantile}, sum by (le) ({metric}_bucket{sel}))")
        assert v is not None
        return v

    # Round wall: 8.73 ms normally (8 < . <= 12 ms), 22.73 ms every 10th round (16 < . <= 24).
    assert 0.008 < q(0.5, "memra_spec_round_seconds") <= 0.012
    assert 0.016 < q(0.95, "memra_spec_round_seconds") <= 0.024
    assert 0.004 < q(0.5, "memra_spec_phase_seconds", '{phase="verify"}') <= 0.008
    assert 0.016 < q(0.95, "memra_spec_phase_seconds", '{phase="verify"}') <= 0.032
    assert 0.001 < q(0.5, "memra_spec_phase_seconds", '{phase="draft"}') <= 0.002
    assert 0.0001 < q(0.5, "memra_spec_phase_seconds", '{phase="accept"}') <= 0.00025
    assert 0.002 < q(0.5, "memra_spec_verify_split_seconds", '{part="mla"}') <= 0.004
    assert scalar(base, 'sum(memra_spec_verify_split_seconds_sum{part="rest"})') == pytest.approx(
        0.002 * 360 + 0.016 * 40
    )
    assert scalar(base, "sum(memra_spec_first_token_seconds_count)") == len(SESSIONS)
    assert scalar(base, 'memra_gpu_free_bytes{device="1",point="before"}') == 80_500 * 2**20
    assert scalar(base, 'memra_obs_dropped_total{signal="records"}') == 0

    ex = api(
        base,
        "query_exemplars",
        query="memra_spec_round_seconds_bucket",
        start=str(t_start - 60),
        end=str(time.time() + 600),
    )
    seen = {e["labels"]["trace_id"] for series in ex for e in series["exemplars"]}
    assert seen, "no exemplars stored"
    assert seen <= set(trace_ids.values())
    # Each (trace_id, span_id) is a spec.round span the span pipeline built.
    pairs = {
        (e["labels"]["trace_id"], e["labels"]["span_id"])
        for series in ex
        for e in series["exemplars"]
    }
    assert pairs <= worker["spans"].ids("spec.round")
    # The last session of each family keeps its exemplars: nothing overwrote them.
    assert {trace_ids["glm5:2"], trace_ids["qwen3:3"]} <= seen
    ex = api(
        base,
        "query_exemplars",
        query='memra_spec_phase_seconds_bucket{phase="verify"}',
        start=str(t_start - 60),
        end=str(time.time() + 600),
    )
    assert {e["labels"]["trace_id"] for series in ex for e in series["exemplars"]} <= set(
        trace_ids.values()
    )
    # Every recipe the README gives is a query Prometheus takes; the in-process ones (the first
    # block's, but for the losses filter: none here) find their series.
    wait_for(
        "two samples of every series (a rate's least)",
        lambda: scalar(base, "min(count_over_time(memra_spec_rounds_total[5m]))") >= 2,
        40.0,
    )
    bad, empty = [], []
    for n, block in enumerate(readme_promql()):
        for query in block:
            try:
                found = api(base, "query", query=query)["result"]
            except urllib.error.HTTPError as exc:
                bad.append((query, exc.read().decode(errors="replace")[:300]))
                continue
            if not found and n == 0 and not query.endswith("> 0"):
                empty.append(query)
    assert len(readme_promql()) == 3 and not bad and not empty, (bad, empty)
