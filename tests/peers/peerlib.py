"""What the peer tests share: the peers as child processes on free 127.0.0.1 ports, bounded
waits, the `memra-obs` CLI as a child, Jaeger's query API, and the check of a whole trace
against DESIGN §4.

Everything here talks to the project only through its public surface: the `memra-obs`
command, `OTEL_*` / `MEMRA_OBS_*` variables, the legacy stderr lines and `/metrics`.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

PHASES = ("spec.draft", "spec.verify", "spec.accept", "spec.rollback", "spec.maint")
PHASE_KEYS = ("draft", "verify", "accept", "rollback", "maint")
SPLIT_KEYS = ("kda_ns", "kda_scan_ns", "mla_ns", "rest_ns", "ffn_ns")
#: The first-token buckets measured inside the first burst (children of .first_burst).
ROUND1_BUCKETS = frozenset(
    ("draft_prime", "first_draft", "first_verify", "first_accept", "first_roll", "first_maint")
)
DONE = re.compile(r"demo done: sessions=(\d+) rounds=(\d+) tokens=(\d+)")
PHASE_LINE = re.compile(
    r"^\[(?P<tag>[\w-]+)\] rounds=(?P<rounds>\d+) k=(?P<k>\d+) total=(?P<total>[\d.]+)ms \| "
    r"draft=(?P<draft>[\d.]+) verify=(?P<verify>[\d.]+) accept=(?P<accept>[\d.]+) "
    r"roll=(?P<roll>[\d.]+) maint=(?P<maint>[\d.]+) \|"
)


# -- processes, ports, waits ------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (all held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any OTEL_/MEMRA_/RANK setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MEMRA_", "RANK"))}
    env.update(extra)
    return env


class Procs:
    """Every child a test starts, each with its stderr (and stdout) in a log file; all are
    ended in ``close()`` (signal, bounded wait, then SIGKILL), whatever happened."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}
        self._n = 0

    def start(
        self, name: str, argv: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        self._n += 1
        log = self.tmp / f"{self._n:02d}-{name}.log"
        with open(log, "wb") as f:
            p = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd or self.tmp,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(p)
        self.logs[p.pid] = log
        return p

    def log(self, p: subprocess.Popen[bytes]) -> str:
        return self.logs[p.pid].read_text(errors="replace")

    def tail(self, p: subprocess.Popen[bytes], n: int = 40) -> str:
        lines = [ln for ln in self.log(p).splitlines() if not ln.startswith(("[glm5", "[spec"))]
        return "\n".join(lines[-n:])

    def end(self, p: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s=20) -> int:
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        return p.returncode

    def wait(self, p: subprocess.Popen[bytes], timeout_s: float) -> int:
        """Wait for ``p`` to exit by itself; fail (with its log) when it does not in time."""
        try:
            return p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{p.args!r} still running after {timeout_s}s:\n{self.tail(p)}"
            ) from None

    def close(self) -> None:
        """Newest first (senders before the peers they send to), each given 10 s."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)


def http_get(url: str, timeout_s: float = 10.0, headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return r.read()


def memra_obs(*args: str) -> list[str]:
    """argv of the project's command line, `memra-obs ...` (the console script installed
    beside this interpreter; `python -m memra_obs.cli` where there is none)."""
    import shutil

    exe = shutil.which("memra-obs", path=str(Path(sys.executable).parent))
    return [exe, *args] if exe else [sys.executable, "-m", "memra_obs.cli", *args]


# -- the demo's stderr ------------------------------------------------------------------------


@dataclass
class DemoRun:
    """What a finished `memra-obs demo` said on stderr."""

    sessions: int
    rounds: int
    tokens: int
    #: Each `[glm5-phase]` line's numbers, in the order printed (one per burst).
    bursts: list[dict[str, str]]


def demo_result(text: str) -> DemoRun:
    m = DONE.search(text)
    assert m, f"no 'demo done' line in the demo's output:\n{text[-3000:]}"
    bursts = [
        mm.groupdict()
        for mm in map(PHASE_LINE.match, text.splitlines())
        if mm and mm["tag"] == "glm5-phase"
    ]
    return DemoRun(int(m[1]), int(m[2]), int(m[3]), bursts)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``, in a Prometheus
    text exposition (read with prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


# -- Jaeger -----------------------------------------------------------------------------------


@dataclass
class Span:
    """One span as Jaeger's query API returns it (OTLP/JSON), values decoded."""

    name: str
    trace_id: str
    span_id: str
    parent: str
    start: int
    end: int
    kind: int
    attrs: dict[str, Any]
    status: int
    status_message: str
    resource: dict[str, Any]
    scope: tuple[str, str]

    @property
    def duration(self) -> int:
        return self.end - self.start


def any_value(v: dict[str, Any]) -> Any:
    """An OTLP/JSON ``AnyValue`` as a Python value (ints from their decimal strings)."""
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return tuple(any_value(x) for x in v["arrayValue"].get("values", []))
    if "kvlistValue" in v:
        return {kv["key"]: any_value(kv["value"]) for kv in v["kvlistValue"].get("values", [])}
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _attrs(kvs: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: any_value(kv.get("value", {})) for kv in kvs or ()}


def otlp_spans(doc: dict[str, Any]) -> list[Span]:
    """Every span of an OTLP/JSON ``TracesData`` (Jaeger's ``result``)."""
    out = []
    for rs in doc.get("resourceSpans", []):
        res = _attrs(rs.get("resource", {}).get("attributes"))
        for ss in rs.get("scopeSpans", []):
            sc = ss.get("scope", {})
            scope = (sc.get("name", ""), sc.get("version", ""))
            for s in ss.get("spans", []):
                st = s.get("status", {})
                out.append(
                    Span(
                        name=s["name"],
                        trace_id=s["traceId"],
                        span_id=s["spanId"],
                        parent=s.get("parentSpanId", ""),
                        start=int(s["startTimeUnixNano"]),
                        end=int(s["endTimeUnixNano"]),
                        kind=int(s.get("kind", 0)),
                        attrs=_attrs(s.get("attributes")),
                        status=int(st.get("code", 0)),
                        status_message=st.get("message", ""),
                        resource=res,
                        scope=scope,
                    )
                )
    return out


JAEGER_PORTS = ("HEALTH", "QUERY", "QUERY_GRPC", "OTLP_GRPC", "OTLP_HTTP")


class Jaeger:
    """A Jaeger v2 (tests/peers/jaeger.yaml: OTLP in, memory storage, query API) on free
    127.0.0.1 ports; ``stop()``/``start()`` keep the ports, so senders see the same peer."""

    def __init__(self, binary: str, procs: Procs) -> None:
        self.binary = binary
        self.procs = procs
        self.ports = dict(zip(JAEGER_PORTS, free_ports(len(JAEGER_PORTS)), strict=True))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def otlp_http(self) -> str:
        return f"http://127.0.0.1:{self.ports['OTLP_HTTP']}"

    @property
    def otlp_grpc(self) -> str:
        """host:port of the OTLP/gRPC receiver (a collector exporter's `endpoint`)."""
        return f"127.0.0.1:{self.ports['OTLP_GRPC']}"

    @property
    def query(self) -> str:
        return f"http://127.0.0.1:{self.ports['QUERY']}"

    def start(self, timeout_s: float = 30.0) -> Jaeger:
        env = clean_env(**{f"PEER_JAEGER_{k}_PORT": str(v) for k, v in self.ports.items()})
        self.proc = self.procs.start(
            "jaeger", [self.binary, f"--config=file:{HERE / 'jaeger.yaml'}"], env
        )
        health = f"http://127.0.0.1:{self.ports['HEALTH']}/status"

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaeger exited:\n{self.procs.tail(self.proc)}")
            return json.loads(http_get(health, 2)).get("healthy") is True

        wait_for("Jaeger to be healthy", ready, timeout_s)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.procs.end(self.proc, signal.SIGTERM)
            self.proc = None

    def api(self, path: str, **params: Any) -> dict[str, Any]:
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        return json.loads(http_get(f"{self.query}/api/v3/{path}{q}"))

    def services(self) -> list[str]:
        return self.api("services").get("services", [])

    def operations(self, service: str) -> set[str]:
        return {o["name"] for o in self.api("operations", service=service).get("operations", [])}

    def trace_ids(self, service: str, since_s: float = 3600, limit: int = 1000) -> set[str]:
        """The trace ids Jaeger's search finds for ``service`` (started in the last hour), the
        stored traces left as they are."""
        now = time.time()
        fmt = "%Y-%m-%dT%H:%M:%SZ"
        try:
            doc = self.api(
                "traces",
                **{
                    "query.service_name": service,
                    "query.start_time_min": time.strftime(fmt, time.gmtime(now - since_s)),
                    "query.start_time_max": time.strftime(fmt, time.gmtime(now + 120)),
                    "query.num_traces": limit,
                    # raw: Jaeger's memory store hands the query its stored spans, and the
                    # adjusters write their warnings into them; a search that ran while a
                    # trace was still arriving would leave "parent not in the trace" on it
                    "query.raw_traces": "true",
                },
            )
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # "No traces found"
                return set()
            raise
        return {s.trace_id for s in otlp_spans(doc.get("result", {}))}

    def trace(self, trace_id: str) -> list[Span]:
        """Every span of one trace, fetched by id, exactly as stored (raw_traces: no
        adjusters; Jaeger's adjusted view would reorder and may rewrite clock skew)."""
        try:
            doc = self.api(f"traces/{trace_id}", raw_traces="true")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise
        return otlp_spans(doc.get("result", {}))


class Collector:
    """The pinned OpenTelemetry Collector running one of the repository's own config files,
    its addresses set through the `${env:OTELCOL_*}` variables those files read: OTLP
    receivers, health check and self-telemetry on free 127.0.0.1 ports."""

    def __init__(
        self, binary: str, procs: Procs, config: Path, name: str = "otelcol", **env: str
    ) -> None:
        self.binary = binary
        self.procs = procs
        self.config = config
        self.name = name
        grpc, http, health, telemetry = free_ports(4)
        self.otlp_grpc = f"127.0.0.1:{grpc}"
        self.otlp_http = f"http://127.0.0.1:{http}"
        self.health = f"http://127.0.0.1:{health}/"
        self.telemetry = f"http://127.0.0.1:{telemetry}/metrics"
        self.env = {
            "OTELCOL_OTLP_GRPC_ENDPOINT": self.otlp_grpc,
            "OTELCOL_OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http}",
            "OTELCOL_HEALTH_ENDPOINT": f"127.0.0.1:{health}",
            "OTELCOL_TELEMETRY_HOST": "127.0.0.1",
            "OTELCOL_TELEMETRY_PORT": str(telemetry),
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> Collector:
        self.proc = self.procs.start(
            self.name, [self.binary, f"--config=file:{self.config}"], clean_env(**self.env)
        )

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.procs.tail(self.proc)}")
            http_get(self.health, 2)
            return True

        wait_for(f"{self.name} ({self.config.name}) to be healthy", ready, timeout_s)
        return self

    def self_metric(self, name: str, **labels: str) -> float:
        """A sample of the collector's own telemetry (otelcol_* metrics; a counter's name
        with or without `_total`, which depends on the reader's settings)."""
        text = http_get(self.telemetry).decode()
        return metric_value(text, name, **labels) + metric_value(text, f"{name}_total", **labels)


class Prometheus:
    """The pinned Prometheus 3 with exemplar storage on (and its OTLP receiver when asked),
    scraping ``targets`` (``job -> host:port``) every second, on a free 127.0.0.1 port."""

    def __init__(
        self,
        binary: str,
        procs: Procs,
        tmp: Path,
        targets: dict[str, str] | None = None,
        *,
        otlp: bool = False,
    ) -> None:
        self.binary = binary
        self.procs = procs
        self.tmp = tmp
        self.targets = targets or {}
        self.otlp = otlp
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def otlp_metrics(self) -> str:
        return f"{self.url}/api/v1/otlp/v1/metrics"

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        import yaml

        cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "storage": {"exemplars": {"max_exemplars": 100000}},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [addr]}]}
                for job, addr in self.targets.items()
            ],
        }
        path = self.tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg))
        argv = [
            self.binary,
            f"--config.file={path}",
            f"--storage.tsdb.path={self.tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--enable-feature=exemplar-storage",
            "--log.level=warn",
        ]
        if self.otlp:
            argv.append("--web.enable-otlp-receiver")
        self.proc = self.procs.start("prometheus", argv, clean_env())

        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{self.procs.tail(self.proc)}")
            return bool(http_get(f"{self.url}/-/ready", 2))

        wait_for("Prometheus to be ready", ready, timeout_s)
        return self

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns ``data``; raises ValueError with Prometheus' error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = json.loads(http_get(url))
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"{path}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def warnings(self) -> list[str]:
        """What Prometheus logged so far (it runs at --log.level=warn: a refused scrape, a
        rejected OTLP write, an out-of-order exemplar would all be here)."""
        assert self.proc is not None
        return [ln for ln in self.procs.log(self.proc).splitlines() if "level=" in ln]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def exemplars(self, expr: str, since_s: float = 600) -> list[dict[str, Any]]:
        """(series labels + one exemplar) for every exemplar ``expr``'s series hold."""
        now = time.time()
        out = []
        for series in self.api("query_exemplars", query=expr, start=now - since_s, end=now + 60):
            for ex in series.get("exemplars", []):
                out.append({"series": series["seriesLabels"], **ex})
        return out


# -- the span tree of DESIGN §4 ---------------------------------------------------------------


@dataclass
class TraceSummary:
    """What one checked trace holds (for totals across traces)."""

    trace_id: str
    session: Span
    bursts: list[Span]
    rounds: int
    round_spans: int
    tokens: int
    spans: int
    #: span_id -> span, for exemplar look-ups.
    by_id: dict[str, Span] = field(repr=False, default_factory=dict)


def check_trace(
    spans: list[Span],
    *,
    service: str,
    round_cap: int = 256,
    level: int = 2,
    prof: bool = True,
    worker: str | None = None,
    parent: str = "",
    status: int = 0,
    added: dict[str, Any] | None = None,
) -> TraceSummary:
    """Assert that ``spans`` are one whole `spec.session` trace of DESIGN §4 and return its
    summary. Checks: one trace id, unique span ids, every parent present, children inside
    their parents, the resource and scope, every burst (indices, attributes, totals against
    its rounds), every round (attributes, its five phases back to back tiling it exactly, the
    level-2 split), the round cap, the first-token profile and the session's totals.
    ``parent``: the caller's span id the session hangs under ("" = a root); ``status``: the
    session's status code (2 = ERROR, a request that failed); ``added``: attributes a
    pipeline puts on every span (the otlp_json_file receiver's ``log.file.name``), checked
    and then set aside."""
    assert spans, "empty trace"
    for s in spans:
        for key, value in (added or {}).items():
            assert s.attrs.pop(key, None) == value, (s.name, key, value)
    tid = spans[0].trace_id
    by_id: dict[str, Span] = {}
    children: dict[str, list[Span]] = {}
    for s in spans:
        assert s.trace_id == tid, f"{s.name} {s.span_id} in trace {s.trace_id}, not {tid}"
        assert s.span_id not in by_id, f"span id {s.span_id} twice in trace {tid}"
        assert s.kind == 1, f"{s.name}: kind {s.kind}, expected INTERNAL (1)"
        assert s.end >= s.start, f"{s.name} ends before it starts"
        assert s.resource.get("service.name") == service, s.resource
        assert s.resource.get("telemetry.sdk.language") == "python", s.resource
        assert s.scope[0] == "memra_obs" and s.scope[1], s.scope
        by_id[s.span_id] = s
    sessions = [s for s in spans if s.name == "spec.session"]
    assert len(sessions) == 1, f"trace {tid}: {len(sessions)} spec.session spans"
    sess = sessions[0]
    # The demo has no caller span (a root); a session under a caller's span is its child.
    assert sess.parent == parent, f"spec.session has parent {sess.parent!r}, not {parent!r}"
    for s in spans:
        if s is sess:
            continue
        p = by_id.get(s.parent)
        assert p is not None, f"trace {tid}: {s.name} {s.span_id} has no parent {s.parent!r}"
        assert p.start <= s.start and s.end <= p.end, (
            f"{s.name} [{s.start},{s.end}] outside its parent {p.name} [{p.start},{p.end}]"
        )
        children.setdefault(s.parent, []).append(s)

    sa = sess.attrs
    assert sess.status == status, f"session status {sess.status} {sess.status_message}"
    assert sa["memra.spec.trace_level"] == level and sa["memra.spec.prof"] is prof, sa
    assert isinstance(sa["memra.spec.session"], int) and sa["memra.spec.family"], sa
    if worker is not None:
        assert sa["memra.spec.worker"] == worker, sa
    assert "memra.spec.unfinished" not in sa, "a finished session marked unfinished"
    top = children.get(sess.span_id, [])
    assert {s.name for s in top} <= {"spec.burst", "spec.first_token"}, {s.name for s in top}
    bursts = sorted((s for s in top if s.name == "spec.burst"), key=lambda s: s.start)
    assert [b.attrs["memra.spec.burst"] for b in bursts] == list(range(len(bursts))), (
        "bursts out of order or missing"
    )
    assert len(bursts) == sa["memra.spec.bursts"], (len(bursts), sa)

    first_round = rounds_total = tokens_total = round_spans = 0
    prev_end = sess.start
    for b in bursts:
        ba = b.attrs
        n, k = ba["memra.spec.rounds"], ba["memra.spec.k"]
        assert ba["memra.spec.family"] == sa["memra.spec.family"]
        assert ba["memra.spec.first_round"] == first_round, (ba, first_round)
        expect_unsampled = max(0, first_round + n - max(round_cap, first_round))
        assert ba["memra.spec.rounds_unsampled"] == expect_unsampled, (ba, round_cap)
        assert b.start >= prev_end, "bursts overlap"
        prev_end = b.end
        rounds = sorted(
            (s for s in children.get(b.span_id, []) if s.name == "spec.round"),
            key=lambda s: s.start,
        )
        assert len(children.get(b.span_id, [])) == len(rounds), "a burst child is not a round"
        assert len(rounds) == n - expect_unsampled, (len(rounds), ba)
        sums = dict.fromkeys(PHASE_KEYS, 0)
        split = dict.fromkeys(SPLIT_KEYS, 0)
        tokens = 0
        last = b.start
        for i, r in enumerate(rounds):
            ra = r.attrs
            assert ra["memra.spec.round"] == first_round + i, (ra, first_round + i)
            rk, rj = ra["memra.spec.k"], ra["memra.spec.j"]
            assert 0 <= rj <= rk <= k, ra
            assert ra["memra.spec.tokens"] == rj + 1, ra
            assert ra["memra.spec.acceptance_rate"] == (rj / rk if rk else 0.0), ra
            assert ra["memra.spec.wall_ns"] == r.duration, (ra, r.duration)
            assert isinstance(ra["memra.spec.ctx"], int) and ra["memra.spec.seq_rows"] >= 0
            assert r.start >= last, "rounds overlap"
            last = r.end
            ph = children.get(r.span_id, [])
            assert sorted(p.name for p in ph) == sorted(PHASES), [p.name for p in ph]
            ph.sort(key=lambda p: PHASES.index(p.name))
            # Back to back: each phase starts where the previous ended; together they are
            # exactly the round.
            assert ph[0].start == r.start and ph[-1].end == r.end, "phases do not tile the round"
            for a, c in itertools.pairwise(ph):
                assert a.end == c.start, f"{a.name} ends {a.end}, {c.name} starts {c.start}"
            for key, p in zip(PHASE_KEYS, ph, strict=True):
                sums[key] += p.duration
            v = ph[1]
            if level >= 2:
                va = {key: v.attrs[f"memra.spec.verify.{key}"] for key in SPLIT_KEYS}
                rest = v.duration - (va["kda_ns"] + va["mla_ns"])
                assert va["rest_ns"] == max(rest, 0), (va, v.duration)
                for key in SPLIT_KEYS:
                    split[key] += va[key]
            else:
                assert not v.attrs, v.attrs
            for p in ph[0:1] + ph[2:]:
                assert not p.attrs, f"{p.name} has attributes {p.attrs}"
            tokens += rj + 1
        if not expect_unsampled:
            # The burst's totals (the [glm5-phase] line's numbers) are its rounds' sums.
            for key in PHASE_KEYS:
                assert ba[f"memra.spec.{key}_ns"] == sums[key], (key, ba, sums)
            # b.end() without tokens=: the rounds' j+1 each, and the anchor token (drawn at
            # session creation) returned with the first burst.
            anchor = 1 if ba["memra.spec.burst"] == 0 else 0
            assert ba["memra.spec.tokens"] == tokens + anchor, (ba, tokens)
            if level >= 2:
                for key in ("kda_ns", "kda_scan_ns", "mla_ns", "ffn_ns"):
                    assert ba[f"memra.spec.verify.{key}"] == split[key], (key, ba, split)
        first_round += n
        rounds_total += n
        tokens_total += ba["memra.spec.tokens"]
        round_spans += len(rounds)
    assert sa["memra.spec.rounds"] == rounds_total, (sa, rounds_total)
    assert sa["memra.spec.tokens"] == tokens_total == sa["gen_ai.usage.output_tokens"], sa

    fts = [s for s in top if s.name == "spec.first_token"]
    if prof:
        assert len(fts) == 1, f"{len(fts)} spec.first_token spans"
        _check_first_token(fts[0], children, bursts[0] if bursts else None)
    else:
        assert not fts
    return TraceSummary(
        tid, sess, bursts, rounds_total, round_spans, tokens_total, len(spans), by_id
    )


def _check_first_token(ft: Span, children: dict[str, list[Span]], burst0: Span | None) -> None:
    fa = ft.attrs
    for key in ("cache_alloc_ms", "prime_ms", "first_burst_ms", "first_burst_rounds", "total_ms"):
        assert f"memra.spec.first_token.{key}" in fa, (key, sorted(fa))
    for point in ("before", "after"):
        mb = fa[f"memra.spec.first_token.free_mb_{point}"]
        dev = fa[f"memra.spec.first_token.free_mb_{point}_devices"]
        assert len(mb) == len(dev) and all(isinstance(x, int) for x in (*mb, *dev)), (mb, dev)
    kids = sorted(children.get(ft.span_id, []), key=lambda s: s.start)
    names = [s.name for s in kids]
    assert "spec.first_token.first_burst" in names, names
    fb = kids[names.index("spec.first_token.first_burst")]
    inner = sorted(children.get(fb.span_id, []), key=lambda s: s.start)
    if burst0 is not None:
        assert (fb.start, fb.end) == (burst0.start, burst0.end), "first_burst != burst 0"
        assert fa["memra.spec.first_token.first_burst_rounds"] == burst0.attrs["memra.spec.rounds"]
        assert fa["memra.spec.first_token.first_burst_tokens"] == burst0.attrs["memra.spec.tokens"]
    for group, inside in ((kids, False), (inner, True)):
        for a, c in itertools.pairwise(group):
            assert a.end <= c.start, f"first-token buckets {a.name} and {c.name} overlap"
        for s in group:
            if s is fb:
                continue
            bucket = s.name.removeprefix("spec.first_token.")
            assert (bucket in ROUND1_BUCKETS) is inside, f"{bucket} under the wrong parent"
            ms = s.attrs[f"memra.spec.first_token.{bucket}_ms"]
            assert abs(ms - s.duration / 1e6) < 1e-6, (s.name, ms, s.duration)
            assert fa[f"memra.spec.first_token.{bucket}_ms"] > 0


def check_against_legacy(summaries: list[TraceSummary], run: DemoRun) -> None:
    """The bursts of the traces (in session order) say what the `[glm5-phase]` lines said:
    the rounds, k and every phase total of each burst, to the line's two decimals."""
    bursts = [b for t in sorted(summaries, key=lambda t: t.session.start) for b in t.bursts]
    assert len(bursts) == len(run.bursts), (len(bursts), len(run.bursts))
    for b, line in zip(bursts, run.bursts, strict=True):
        a = b.attrs
        assert int(line["rounds"]) == a["memra.spec.rounds"] and int(line["k"]) == a["memra.spec.k"]
        for key, lk in zip(PHASE_KEYS, ("draft", "verify", "accept", "roll", "maint"), strict=True):
            assert f"{a[f'memra.spec.{key}_ns'] / 1e6:.2f}" == line[lk], (key, a, line)


def collect_traces(
    jaeger: Jaeger,
    service: str,
    sessions: int,
    timeout_s: float = 30.0,
    **check: Any,
) -> list[TraceSummary]:
    """Wait until Jaeger holds ``sessions`` traces of ``service``, each one whole (the
    receiver batches, so the last spans may land a moment after the sender's ack), and
    return their checked summaries; on time-out the check's own error is raised."""

    def whole() -> list[TraceSummary]:
        ids = jaeger.trace_ids(service)
        assert len(ids) == sessions, f"{len(ids)} traces of {service}, expected {sessions}"
        return [check_trace(jaeger.trace(t), service=service, **check) for t in sorted(ids)]

    try:
        return wait_for(f"{sessions} whole traces of {service} in Jaeger", whole, timeout_s, 0.5)
    except AssertionError:
        return whole()  # the real reason, as the assertion it is
