"""The span exporter against real receivers on 127.0.0.1: OTLP/HTTP (protobuf and JSON) and
OTLP/gRPC decoded with opentelemetry-proto, the file default, a closed port, threads, and
the OTEL_* selection rules."""

from __future__ import annotations

import contextlib
import gzip
import http.server
import itertools
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from polling import wait_for

from memra_obs.environment import ConfigError, Settings
from memra_obs.export import QueueSink
from memra_obs.observer import Observer
from memra_obs.otel import SpanExporter, build_span_exporter
from memra_obs.otel.config import traces_sampler
from memra_obs.otel.exporter import Output
from memra_obs.otel.spans import PHASE_SPAN_NAMES
from memra_obs.otel.transport import SendError
from memra_obs.records import VerifySplit
from memra_obs.version import __version__

pytestmark = pytest.mark.integration

# -------------------------------------------------------------------------------- receivers


class Receiver:
    """An OTLP/HTTP receiver on 127.0.0.1:0 that decodes every request it gets."""

    def __init__(self, statuses: list[int] | None = None, response: bytes = b"") -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        self.statuses = list(statuses or [])
        self.response = response
        self.lock = threading.Lock()
        rx = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with rx.lock:
                    status = rx.statuses.pop(0) if rx.statuses else 200
                    hs = self.headers  # a name sent twice reads "a, b" (RFC 9110 5.3)
                    rx.headers.append({k.lower(): ", ".join(hs.get_all(k, [])) for k in hs})
                if status == 200:
                    if self.headers.get("Content-Encoding") == "gzip":
                        body = gzip.decompress(body)
                    msg = ExportTraceServiceRequest()
                    if self.headers["Content-Type"] == "application/json":
                        json_format.Parse(body, msg)
                    else:
                        msg.ParseFromString(body)
                    with rx.lock:
                        rx.requests.append(msg)
                self.send_response(status)
                if status != 200:
                    self.send_header("Retry-After", "0")
                if status in (301, 302, 307, 308):  # an ingress: http to https
                    self.send_header("Location", "https://collector.example/v1/traces")
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(rx.response)))
                self.end_headers()
                self.wfile.write(rx.response)

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def spans(self) -> list:
        with self.lock:
            return [
                sp
                for m in self.requests
                for rs in m.resource_spans
                for ss in rs.scope_spans
                for sp in ss.spans
            ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver()
    yield rx
    rx.close()


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---------------------------------------------------------------------------------- driving


def run_session(
    obs: Observer, bursts=(3, 2), prof: bool = True, end: bool = True, work=None
) -> None:
    s = obs.session("glm5")
    if prof:
        s.free_memory("before")
        s.lap("cache_alloc")
        s.lap("prime")
        s.lap("anchor")
    for bi, n in enumerate(bursts):
        b = s.burst(4)
        for i in range(n):
            b.begin_round()
            if prof and bi == 0 and i == 0:
                s.lap("draft_prime")
            b.end_draft()
            if work:
                work()
            obs.verify_split.add(kda=30, kda_scan=10, mla=20, ffn=5)
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=i % 5, ctx=500 + i)
        b.end()
    if end:
        s.end()


def make(
    env: dict[str, str], round_spans: int = 256, prof: bool = True, **settings
) -> tuple[Observer, QueueSink, SpanExporter]:
    ex = build_span_exporter(Settings(round_spans=round_spans, **settings), env=env)
    assert isinstance(ex, SpanExporter)
    q = QueueSink([ex], interval_ms=20)
    obs = Observer([q], level=2, prof=prof, memory=lambda: [(0, 4096)], verify_split=VerifySplit())
    return obs, q, ex


def tree(spans) -> dict[bytes, object]:
    return {sp.span_id: sp for sp in spans}


def attrs(sp) -> dict[str, object]:
    out = {}
    for a in sp.attributes:
        v = a.value
        which = v.WhichOneof("value")
        out[a.key] = (
            tuple(getattr(x, x.WhichOneof("value")) for x in v.array_value.values)
            if which == "array_value"
            else getattr(v, which)
        )
    return out


# -------------------------------------------------------------------------------------- tests


def test_otlp_http_delivers_the_tree_under_the_callers_span(receiver):
    """Real OTLP/HTTP (gzip, headers, resource from OTEL_*): the decoded tree has the
    caller's span as parent, phases back to back in rounds, rounds in bursts, bursts in
    the session, the level-2 split on verify and the round cap on the bursts."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-team=spec%20loop,authorization=Bearer t",
        "OTEL_SERVICE_NAME": "worker-7",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
    }
    obs, _q, ex = make(env, round_spans=4)
    tracer = TracerProvider().get_tracer("framework")
    with tracer.start_as_current_span("POST /generate") as req:
        run_session(obs)
    assert obs.flush(10)
    obs.shutdown(5)
    caller = req.get_span_context()
    spans = receiver.spans
    assert ex.exported_spans == len(spans) and ex.dropped_spans == 0 and ex.export_errors == 0
    m = receiver.requests[0]
    res = attrs(m.resource_spans[0].resource)
    assert res["service.name"] == "worker-7" and res["deployment.environment"] == "test"
    assert m.resource_spans[0].scope_spans[0].scope.name == "memra_obs"
    h = receiver.headers[0]
    assert h["x-team"] == "spec loop" and h["authorization"] == "Bearer t"
    assert h["content-encoding"] == "gzip" and h["content-type"] == "application/x-protobuf"
    assert h["user-agent"].startswith(f"memra-obs-otlp/{__version__} python/3.")  # the spec

    by_id = tree(spans)
    assert {sp.trace_id for sp in spans} == {caller.trace_id.to_bytes(16, "big")}
    (session,) = [sp for sp in spans if sp.name == "spec.session"]
    assert session.parent_span_id == caller.span_id.to_bytes(8, "big")
    bursts = [sp for sp in spans if sp.name == "spec.burst"]
    rounds = [sp for sp in spans if sp.name == "spec.round"]
    assert len(bursts) == 2 and len(rounds) == 4  # capped at 4 of 5
    assert [attrs(b)["memra.spec.rounds_unsampled"] for b in bursts] == [0, 1]
    for b in bursts:
        assert b.parent_span_id == session.span_id
        assert session.start_time_unix_nano <= b.start_time_unix_nano <= b.end_time_unix_nano
        assert b.end_time_unix_nano <= session.end_time_unix_nano
    for r in rounds:
        parent = by_id[r.parent_span_id]
        assert parent.name == "spec.burst"
        assert parent.start_time_unix_nano <= r.start_time_unix_nano <= r.end_time_unix_nano
        assert r.end_time_unix_nano <= parent.end_time_unix_nano
        phases = sorted(
            (sp for sp in spans if sp.parent_span_id == r.span_id),
            key=lambda s: s.start_time_unix_nano,
        )
        assert [p.name for p in phases] == list(PHASE_SPAN_NAMES)
        assert phases[0].start_time_unix_nano == r.start_time_unix_nano
        assert phases[-1].end_time_unix_nano == r.end_time_unix_nano
        for a, b in itertools.pairwise(phases):
            assert a.end_time_unix_nano == b.start_time_unix_nano
        ra = attrs(r)
        assert {"memra.spec.k", "memra.spec.j", "memra.spec.ctx", "memra.spec.seq_rows"} <= set(ra)
        assert ra["memra.spec.wall_ns"] == r.end_time_unix_nano - r.start_time_unix_nano
        assert attrs(phases[1])["memra.spec.verify.kda_ns"] == 30
    (ft,) = [sp for sp in spans if sp.name == "spec.first_token"]
    fa = attrs(ft)
    assert ft.parent_span_id == session.span_id and fa["memra.spec.first_token.free_mb_before"] == (
        4096,
    )
    assert fa["memra.spec.first_token.first_burst_rounds"] == 3
    assert now_ns_epoch() - 60e9 < session.start_time_unix_nano < now_ns_epoch()


def now_ns_epoch() -> int:
    return time.time_ns()


def test_otlp_http_json_protocol(receiver):
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/json posts OTLP/JSON that protobuf's parser reads."""
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
    }
    obs, _q, ex = make(env, prof=False)
    run_session(obs, prof=False)
    obs.shutdown(5)
    assert receiver.headers[0]["content-type"] == "application/json"
    assert ex.exported_spans == len(receiver.spans) == 1 + 2 + 5 * 6


def test_a_header_of_theirs_replaces_ours_in_any_case(receiver):
    """``user-agent=...`` in OTEL_EXPORTER_OTLP_HEADERS replaces the exporter's own, as
    ``User-Agent=...`` did: both went, and a receiver that reads the first read ours."""
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_HEADERS": "user-agent=gateway/2,CONTENT-TYPE=application/json",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
    }
    obs, _q, ex = make(env, prof=False)
    run_session(obs, prof=False)
    obs.shutdown(5)
    h = receiver.headers[0]
    assert h["user-agent"] == "gateway/2" and h["content-type"] == "application/json"
    assert ex.exported_spans == len(receiver.spans) > 0


def grpc_trace_service(export) -> tuple[Any, int]:
    """A real gRPC TraceService on a free 127.0.0.1 port, ``export(request, context)``
    answering each call; returns (started server, port)."""
    import grpc

    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {
            "Export": grpc.unary_unary_rpc_method_handler(
                export,
                request_deserializer=ExportTraceServiceRequest.FromString,
                response_serializer=ExportTraceServiceResponse.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_otlp_grpc_generic_call():
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc: our bytes through grpcio's generic unary call, with
    headers as metadata, decoded by a real gRPC server."""
    pytest.importorskip("grpc")
    got: list[ExportTraceServiceRequest] = []
    meta: list[dict[str, str]] = []

    def export(req: ExportTraceServiceRequest, ctx) -> ExportTraceServiceResponse:
        got.append(req)
        meta.append(dict(ctx.invocation_metadata()))
        return ExportTraceServiceResponse()

    server, port = grpc_trace_service(export)
    try:
        env = {
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=a",
            "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
        }
        obs, _q, ex = make(env)
        run_session(obs)
        obs.shutdown(5)
    finally:
        server.stop(0)
    spans = [sp for m in got for sp in m.resource_spans[0].scope_spans[0].spans]
    assert ex.exported_spans == len(spans) > 30 and ex.export_errors == 0
    assert meta[0]["x-tenant"] == "a"
    assert meta[0]["user-agent"].startswith(f"memra-obs-otlp/{__version__} python/")
    names = {sp.name for sp in spans}
    assert {
        "spec.session",
        "spec.burst",
        "spec.round",
        "spec.first_token",
        *PHASE_SPAN_NAMES,
    } <= names


def loop_us_per_round(obs: Observer, rounds: int = 400) -> float:
    """Median per-round loop time (µs) over blocks of 50 rounds."""
    s = obs.session("glm5")
    per = []
    for _ in range(rounds // 50):
        b = s.burst(4)
        t0 = time.perf_counter_ns()
        for _ in range(50):
            b.begin_round()
            b.end_draft()
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=2, ctx=10)
        per.append((time.perf_counter_ns() - t0) / 50 / 1000)
        b.end()
        time.sleep(0.002)  # device time: the export worker runs here
    s.end()
    return statistics.median(per)


def test_closed_port_costs_the_loop_nothing_and_counts_every_drop(receiver):
    """Exporter aimed at a closed port: per-round loop time as with a live receiver, nothing
    raises, every span counted dropped, failures counted, shutdown bounded."""
    live, _, live_ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}, round_spans=10_000)
    dead, dead_q, dead_ex = make(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}, round_spans=10_000
    )
    loop_us_per_round(live, 100)  # warm up
    loop_us_per_round(dead, 100)
    # Live and dead in turns, so a busy moment of a loaded machine falls on both alike; the
    # best of each. ~4 us a round either way; the loop paying for the dead receiver (a
    # connection attempt, a wait) costs tens of us a round, far past 3x.
    us: dict[str, list[float]] = {"live": [], "dead": []}
    for _ in range(5):
        us["live"].append(loop_us_per_round(live))
        us["dead"].append(loop_us_per_round(dead))
    t_live, t_dead = min(us["live"]), min(us["dead"])
    assert t_dead < t_live * 3 + 3.0, us
    # every record in the exporter's hands: all its spans count
    wait_for("the dead exporter's queue to drain", lambda: not len(dead_q), every_s=0.01)
    t0 = time.monotonic()
    dead.shutdown(2.0)
    # ~2 s. Unbounded, a request retrying the closed port holds shutdown for the 10 s export
    # timeout; 6 s leaves a loaded CI machine 4 s of slack and the defect as much.
    assert time.monotonic() - t0 < 6.0
    assert live.flush(30)  # delivered, whatever the load, before the counts are compared
    live.shutdown(5)
    assert dead_ex.exported_spans == 0 and dead_ex.export_errors > 0
    assert dead_ex.dropped_spans == live_ex.exported_spans > 0


def test_sessions_on_threads_land_in_their_own_traces(receiver):
    """Six sessions at once on six threads: six traces, every span delivered."""
    obs, q, ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}, prof=False)
    threads = [threading.Thread(target=run_session, args=(obs, (4, 3, 2), False)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    obs.shutdown(10)
    spans = receiver.spans
    per_session = 1 + 3 + 9 * 6
    assert len(spans) == 6 * per_session == ex.exported_spans and q.dropped == 0
    traces: dict[bytes, list] = {}
    for sp in spans:
        traces.setdefault(sp.trace_id, []).append(sp)
    assert len(traces) == 6
    for tspans in traces.values():
        assert len(tspans) == per_session
        assert sum(sp.name == "spec.session" for sp in tspans) == 1
        ids = {sp.span_id for sp in tspans}
        assert len(ids) == per_session
        assert all(sp.parent_span_id in ids for sp in tspans if sp.name != "spec.session")


def test_file_default_writes_otlp_json_lines(tmp_path):
    """No OTEL_* exporter set: OTLP/JSON lines in MEMRA_OBS_SPANS_FILE, each one parsed by
    protobuf's JSON parser, with hex ids that agree across spans."""
    path = tmp_path / "spans.jsonl"
    obs, _q, ex = make({}, spans_file=str(path))
    run_session(obs)
    run_session(obs, bursts=(1,), prof=False)
    obs.shutdown(5)
    lines = path.read_text().splitlines()
    assert lines
    n = 0
    for line in lines:
        json_format.Parse(line, ExportTraceServiceRequest())
        doc = json.loads(line)
        for sp in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]:
            n += 1
            assert len(sp["traceId"]) == 32 and len(sp["spanId"]) == 16
            int(sp["traceId"], 16)
            assert sp["startTimeUnixNano"].isdigit()
    assert n == ex.exported_spans and doc["resourceSpans"][0]["resource"]["attributes"]


def test_retryable_status_is_retried_and_partial_success_counts_rejects(caplog):
    """503 then 200: delivered after a retry. A partial-success answer: the rejected spans
    are counted as dropped, and said once (they were counted only)."""
    resp = ExportTraceServiceResponse()
    resp.partial_success.rejected_spans = 2
    resp.partial_success.error_message = "attribute value too long"
    rx = Receiver(statuses=[503], response=resp.SerializeToString())
    try:
        obs, _q, ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url})
        run_session(obs, bursts=(1,), prof=False)
        obs.shutdown(5)
        assert len(rx.headers) == 2 and len(rx.requests) == 1
        assert ex.export_errors == 0 and ex.dropped_spans == 2
        assert ex.exported_spans == len(rx.spans) - 2
        said = [r.getMessage() for r in caplog.records if "receiver rejected" in r.getMessage()]
        assert len(said) == 1 and "rejected 2 of" in said[0] and "dropped_spans" in said[0]
        assert "(attribute value too long)" in said[0]  # the receiver's reason (never read)
    finally:
        rx.close()


def test_a_receivers_warning_and_error_status_are_said_in_its_words(caplog):
    """OTLP: a partial success with 0 rejected and a message is a warning (ignored, unsaid); a
    4xx body is a google.rpc.Status (shown as protobuf bytes); a 308 (an ingress sending http
    to https) was dropped without saying where to."""
    from google.rpc.status_pb2 import Status

    resp = ExportTraceServiceResponse()
    resp.partial_success.error_message = "service.name is deprecated"
    for statuses, body, want in (
        ([], resp.SerializeToString(), "the receiver warns: service.name is deprecated"),
        (
            [400],
            Status(code=3, message="bad trace_id").SerializeToString(),
            "HTTP 400 bad trace_id;",
        ),
        ([308], b"", "HTTP 308 b'' to https://collector.example/v1/traces (not followed"),
    ):
        rx = Receiver(statuses=statuses, response=body)
        try:
            obs, _q, _ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url}, prof=False)
            run_session(obs, bursts=(1,), prof=False)
            obs.shutdown(5)
            said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("spans to")]
            assert any(want in m and m.count(rx.url) == 1 for m in said), (want, said)
        finally:
            rx.close()


def test_unretryable_status_drops_without_retry():
    """A 400 is not retried: one attempt, counted as an error and a drop."""
    rx = Receiver(statuses=[400])
    try:
        obs, _q, ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url}, prof=False)
        run_session(obs, bursts=(1,), prof=False)
        obs.shutdown(5)
        assert len(rx.headers) == 1 and ex.export_errors == 1 and ex.exported_spans == 0
        assert ex.dropped_spans == 1 + 1 + 6
    finally:
        rx.close()


def test_an_otlp_timeout_of_zero_means_no_limit():
    """The specification's Timeout type: ``0`` is no limit (was a ConfigError that stopped
    start-up); the exporter starts, retries and delivers. A negative one is still refused."""
    from memra_obs.otel.config import OtlpConfig

    for var in ("OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"):
        assert OtlpConfig.from_env({var: "0"}).timeout_s >= (2**31 - 1) / 1000
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT='-1'"):
        OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "-1"})
    rx = Receiver(statuses=[503])
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url, "OTEL_EXPORTER_OTLP_TIMEOUT": "0"}
        obs, _q, ex = make(env, prof=False)
        run_session(obs, bursts=(1,), prof=False)
        obs.shutdown(5)
        assert len(rx.headers) == 2 and ex.exported_spans == len(rx.spans) == 1 + 1 + 6
        assert ex.dropped_spans == ex.export_errors == 0
    finally:
        rx.close()


def test_shutdown_flushes_a_session_that_never_ended(receiver):
    """Process exit mid-request: the session and its open burst still arrive, unfinished."""
    obs, _q, _ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    run_session(obs, bursts=(2,), prof=False, end=False)
    obs.shutdown(5)
    names = [sp.name for sp in receiver.spans]
    assert names.count("spec.session") == 1 and names.count("spec.burst") == 1
    session = next(sp for sp in receiver.spans if sp.name == "spec.session")
    assert attrs(session)["memra.spec.unfinished"] is True


class BlockingSender:
    url = "blocking://"
    timeout_s = 10.0

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.sent = 0

    def send(self, payload, timeout_s: float) -> tuple[int, str]:
        self.gate.wait(10)
        if not self.gate.is_set():
            raise SendError("gate closed")
        self.sent += 1
        return 0, ""

    def abort(self) -> None:
        self.gate.set()

    close = abort


def test_full_request_queue_drops_and_counts_and_never_blocks():
    """A stuck sender: requests past the queue bound are dropped and counted at once, export
    never waits; a bounded shutdown cuts the stuck send off."""
    from memra_obs.testing import RecordingSink

    keep = RecordingSink(wants_trace_ids=True)
    run_session(
        Observer([keep], level=1, prof=False, verify_split=VerifySplit()), bursts=(4,), prof=False
    )
    sender = BlockingSender()
    ex = SpanExporter([Output("t", None, sender, max_spans=1, queue_requests=2)])
    t0 = time.monotonic()
    for rec in keep.records:  # one request per record that completes spans
        ex.export([rec])
    assert time.monotonic() - t0 < 0.5
    total = 1 + 1 + 4 * 6
    # At most one request in flight and two queued (6 spans each at most); the rest dropped.
    assert ex.dropped_spans >= total - 3 * 6
    assert ex.flush(0.2) is False
    t0 = time.monotonic()
    ex.shutdown(0.5)
    assert time.monotonic() - t0 < 1.5
    assert ex.exported_spans + ex.dropped_spans == total


# ------------------------------------------------------------------------------- selection


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"},
        {"OTEL_TRACES_EXPORTER": "none"},
    ],
)
def test_spans_off(env):
    """OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none: no exporter at all."""
    assert build_span_exporter(Settings(), env=env) is None


@pytest.mark.parametrize(
    ("env", "var"),
    [
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "soon"},
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        ),
        (  # float() reads other scripts' digits and 1_000
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "\u0661\u0662"},
            "OTEL_EXPORTER_OTLP_TIMEOUT",
        ),
        ({"OTEL_TRACES_EXPORTER": " , "}, "OTEL_TRACES_EXPORTER"),  # it turned spans off
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_COMPRESSION": "br"},
            "OTEL_EXPORTER_OTLP_COMPRESSION",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_HEADERS": "novalue"},
            "OTEL_EXPORTER_OTLP_HEADERS",
        ),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://x"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_CERTIFICATE": "/nope.pem"},
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ),
        (  # not PEM: was a raw ssl.SSLError
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "https://x",
                "OTEL_EXPORTER_OTLP_CERTIFICATE": __file__,
            },
            "OTEL_EXPORTER_OTLP_CERTIFICATE",
        ),
        (  # mTLS half set: gRPC's C core aborted the process; HTTP ignored a lone key
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://x", "OTEL_EXPORTER_OTLP_CLIENT_KEY": __file__},
            "OTEL_EXPORTER_OTLP_CLIENT_KEY and OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://x",
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": __file__,
            },
            "OTEL_EXPORTER_OTLP_CLIENT_KEY and OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        ),
        (  # gRPC took a port past 65535 modulo 65536: spans to some other port
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:99999",
            },
            "OTEL_EXPORTER_OTLP_ENDPOINT='http://h:99999': bad port",
        ),
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "h:abc"},
            "OTEL_EXPORTER_OTLP_ENDPOINT='h:abc': bad port",
        ),
        *(  # gRPC took these as ":443" / ":4317": a target with no host, every span dropped
            (
                {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": e},
                re.escape(f"OTEL_EXPORTER_OTLP_ENDPOINT='{e}': no host"),
            )
            for e in ("/", "///", ":4317", "[]:4317")
        ),
        (  # headers the sender cannot send: every request failed, every span dropped
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h", "OTEL_EXPORTER_OTLP_HEADERS": "a=b%0Ac"},
            "OTEL_EXPORTER_OTLP_HEADERS: header 'a' cannot be sent",
        ),
        (
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h",
                "OTEL_EXPORTER_OTLP_HEADERS": "a=%E2%82%AC",
            },
            "OTEL_EXPORTER_OTLP_HEADERS: header 'a' cannot be sent",
        ),
        (
            {
                "OTEL_TRACES_EXPORTER": "otlp_proto_grpc",
                "OTEL_EXPORTER_OTLP_HEADERS": "a=caf%C3%A9",
            },
            "OTEL_EXPORTER_OTLP_HEADERS: header 'a' cannot be sent",
        ),
        *(  # keys and values the senders cannot send (http.client, grpcio): every request failed
            (
                {
                    "OTEL_EXPORTER_OTLP_PROTOCOL": proto,
                    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4317",
                    "OTEL_EXPORTER_OTLP_HEADERS": headers,
                },
                "OTEL_EXPORTER_OTLP_HEADERS: header .* cannot be sent",
            )
            for proto, headers in (
                ("http/protobuf", "a%3Ab=c"),
                ("http/protobuf", "a%00=c"),
                ("http/protobuf", "a=b%00c"),
                ("grpc", "a%2Fb=c"),
                ("grpc", "a%40b=c"),
                ("grpc", "%3Aauthority=x"),
                ("grpc", "grpc-timeout=1S"),
                ("grpc", "x-trace-bin=abc"),
                ("grpc", "a=b%09c"),
            )
        ),
        ({"OTEL_TRACES_EXPORTER": "jaeger-thrift-nope"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_EXPORTER": "nope"}, "OTEL_TRACES_EXPORTER='nope': .* known: .*file"),
        ({"OTEL_TRACES_EXPORTER": "none,otlp"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_EXPORTER": "otlp, otlp"}, "OTEL_TRACES_EXPORTER=.*named twice"),
        (  # a gRPC endpoint is host:port or an http(s) URL: ftp:// is no scheme gRPC speaks
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://h:1"},
            re.escape("OTEL_EXPORTER_OTLP_ENDPOINT='ftp://h:1': expected http(s)://host:port"),
        ),
        ({"OTEL_RESOURCE_ATTRIBUTES": "a"}, "OTEL_RESOURCE_ATTRIBUTES"),
    ],
)
def test_bad_values_fail_at_start_up_naming_the_variable(env, var):
    """A value we cannot use is a ConfigError that names its variable."""
    with pytest.raises(ConfigError, match=var):
        build_span_exporter(Settings(), env=env)


def test_a_sampler_name_is_matched_whole():
    """An unknown sampler that merely ends in traceidratio is warned of and the default
    taken (README), not run as a ratio sampler: ARG=0 would have dropped every session."""
    env = {"OTEL_TRACES_SAMPLER": "my_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    assert traces_sampler(env) is None


_SECRET = "SUPERSECRET"
_USERINFO = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: user:password@ .* OTEL_EXPORTER_OTLP_HEADERS"


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ({"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{_SECRET},x-tenant"},
         "OTEL_EXPORTER_OTLP_HEADERS: item 2 is not key=value"),
        ({"OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"a=b,,{_SECRET}"},
         "OTEL_EXPORTER_OTLP_TRACES_HEADERS: item 3 is not key=value"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"https://u:{_SECRET}@h:9/v1/traces?k={_SECRET}"},
         _USERINFO),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"u:{_SECRET}@h:4317"}, _USERINFO),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://h:99999/?api_key={_SECRET}"},
         r"OTEL_EXPORTER_OTLP_ENDPOINT='http://h:99999/\?<redacted>': bad port"),
    ],
)  # fmt: skip
def test_otlp_secrets_are_never_echoed_and_url_credentials_refused(env, why):
    """A header's value, a URL's password or its ?query (API keys go there) never reach a
    start-up error; a user:password@ (http.client never sent it) is refused, pointing to
    the headers."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **env}
    with pytest.raises(ConfigError, match=why) as exc:
        build_span_exporter(Settings(), env=env)
    assert _SECRET not in str(exc.value)


@pytest.mark.parametrize("proto", ["http/protobuf", "grpc"])
def test_a_header_key_that_is_no_header_name_is_named_by_position(proto):
    """A header written HTTP-style (``Authorization: Basic <base64>==``) splits at the base64
    padding, so its key holds the credential: the error names the item, never that key."""
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": proto,
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_EXPORTER_OTLP_HEADERS": f"a=1,,Authorization: Basic {_SECRET}==",
    }
    with pytest.raises(ConfigError, match="HEADERS: header number 3 cannot be sent") as exc:
        build_span_exporter(Settings(), env=env)
    assert _SECRET not in str(exc.value)


def test_the_otlp_configs_repr_leaves_its_headers_out():
    """A traceback that shows locals (or a debugger) prints OtlpConfig's repr: no header values."""
    from memra_obs.otel.config import OtlpConfig

    cfg = OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_HEADERS": f"authorization=Bearer%20{_SECRET}"})
    assert cfg.headers == (("authorization", f"Bearer {_SECRET}"),)
    assert _SECRET not in repr(cfg) and "endpoint=" in repr(cfg)


def test_the_endpoints_query_is_not_shown_on_the_banner_or_in_send_errors():
    """An API key in the endpoint's ?query is sent, never shown (the start-up line, errors)."""
    from memra_obs.otel.transport import Retry

    url = f"http://127.0.0.1:9/v1/traces?api_key={_SECRET}"
    ex = build_span_exporter(Settings(), env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url})
    try:
        sender = ex.outputs[0].sender
        assert sender.url == "http://127.0.0.1:9/v1/traces?<redacted>"
        assert sender._path.endswith(f"?api_key={_SECRET}")  # sent all the same
        with pytest.raises((Retry, SendError)) as err:
            sender.send(b"", 2.0)
        assert _SECRET not in str(err.value)  # (the exporter says it after sender.url)
    finally:
        ex.shutdown(1.0)


@pytest.mark.parametrize("url", [f"http://h:9/v1/traces?api_key={_SECRET} x",
                                 f"http://h:9/v1/traces?api_key={_SECRET}\u00e9",
                                 f"http://h:9/v1/tr\x7faces?api_key={_SECRET}"])  # fmt: skip
def test_an_endpoint_http_client_cannot_send_is_refused_without_its_query(url):
    """A space, control or non-ASCII character in the URL's path or query was taken, then
    every send failed, its error quoting the request line: the ``?api_key=`` on stderr."""
    with pytest.raises(ConfigError, match=r"\?<redacted>': a space, control or non-ASCII") as e:
        build_span_exporter(Settings(), env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url})
    assert _SECRET not in str(e.value)
    ok = f"http://b\u00fccher.example:9/v1/traces?api_key={_SECRET}"  # a host http.client IDNA-encodes
    build_span_exporter(Settings(), env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ok}).shutdown(1.0)


@pytest.mark.parametrize(
    ("value", "true", "warned"),
    [("true", True, False), (" TRUE ", True, False), ("false", False, False),
     ("", False, False), ("1", False, True), ("yes", False, True), ("maybe", False, True)],
)  # fmt: skip
def test_otel_booleans_are_true_only_for_true(value, true, warned, caplog):
    """The specification's booleans: only "true" (any case); anything else is false, warned
    of unless "false" or empty (OTEL_SDK_DISABLED=1 leaves spans on, as in every SDK)."""
    from memra_obs import diagnostics
    from memra_obs.otel.config import OtlpConfig, traces_exporters

    diagnostics.reset()
    assert (traces_exporters({"OTEL_SDK_DISABLED": value}) == []) is true
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317", "OTEL_EXPORTER_OTLP_INSECURE": value}
    assert OtlpConfig.from_env(env, protocol="grpc").secure is not true
    assert [r.getMessage() for r in caplog.records] == warned * [
        f"OTEL_SDK_DISABLED={value!r}: not true or false; taken as false",
        f"OTEL_EXPORTER_OTLP_INSECURE={value!r}: not true or false; taken as false",
    ]


def test_resource_keys_are_kept_as_written_and_values_decoded(monkeypatch):
    """Keys are the baggage tokens as written (the SDK's own detector, which Resource.create
    runs too, keeps them so: decoding them here gave one attribute twice); values decoded."""
    from opentelemetry.sdk.resources import Resource

    from memra_obs.otel.config import resource_attributes

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "k%3Dx=1,site=eu%2Cwest")
    attrs = dict(Resource.create(resource_attributes(dict(os.environ))).attributes)
    assert attrs["k%3Dx"] == "1" and "k=x" not in attrs and attrs["site"] == "eu,west"


def test_the_resource_comes_from_env_not_os_environ(monkeypatch, tmp_path):
    """``configure(env=...)`` replaces os.environ: the SDK's detector, which Resource.create
    runs on os.environ whatever ``env`` says, added the process's own attributes to its spans;
    the SDK's own service.instance.id, which the process's hid, stays (it was taken out too)."""
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES",
                       "team=other,deployment.environment=staging,service.instance.id=pod-a")  # fmt: skip
    path = tmp_path / "spans.jsonl"
    obs, _q, _ex = make({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod"},
                        spans_file=str(path))  # fmt: skip
    run_session(obs, bursts=(1,), prof=False)
    obs.shutdown(5)
    doc = json.loads(path.read_text().splitlines()[0])
    kvs = doc["resourceSpans"][0]["resource"]["attributes"]
    attrs = {kv["key"]: kv["value"]["stringValue"] for kv in kvs}
    assert "team" not in attrs and attrs["deployment.environment"] == "prod"
    assert attrs["service.name"] == "memra-obs" and attrs["telemetry.sdk.language"] == "python"
    assert attrs.get("service.instance.id", "pod-a") != "pod-a"  # the SDK's own detector's
    # semconv reserves "opentelemetry" for the official SDKs: these spans are encoded here
    assert (attrs["telemetry.sdk.name"], attrs["telemetry.sdk.version"]) == (
        "memra_obs",
        __version__,
    )
    from memra_obs.otel import _resource  # the one resource, the SDK exporters' path too

    assert _resource({}).attributes["telemetry.sdk.name"] == "memra_obs"


def test_an_sdk_before_1_43_still_gives_spans_an_instance_id(monkeypatch):
    """The SDK makes a ``service.instance.id`` from 1.43 only; with the floor's (1.27) spans
    had none, and a forked child's were not told from its parent's. One of the process's own
    is there whatever the SDK makes; ``OTEL_RESOURCE_ATTRIBUTES``' stays."""
    from forked import in_child
    from opentelemetry.sdk import resources

    from memra_obs.otel import _resource

    create = resources.Resource.create

    def old_sdk(attributes=None, schema_url=None):
        res = create(attributes, schema_url)
        attrs = {k: v for k, v in res.attributes.items() if k != "service.instance.id"}
        return resources.Resource(attrs | dict(attributes or {}), res.schema_url)

    monkeypatch.setattr(resources.Resource, "create", staticmethod(old_sdk))
    a, b = (_resource({}).attributes.get("service.instance.id") for _ in range(2))
    assert a and a == b  # one a process, as the SDK's; a forked child's its own
    assert in_child(lambda: _resource({}).attributes["service.instance.id"].encode()) not in (
        b"",
        a.encode(),
    )
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=pod-a"}
    assert _resource(env).attributes["service.instance.id"] == "pod-a"


def test_the_requests_file_and_the_span_file_must_be_two_files(tmp_path):
    """One regular file for both was taken: it mixed records and spans, and the report the demo
    suggested for it read none of them. A stream (/dev/stdout) may take both, and a requests
    file beside spans sent elsewhere (OTLP, none, agent mode) is no span file's."""
    x = str(tmp_path / "x.jsonl")
    (tmp_path / "lnk").symlink_to(x)  # a link to the requests file: still one file
    for spans, req in ((x, f"{tmp_path}/./x.jsonl"), (x, x), (str(tmp_path / "lnk"), x)):
        with pytest.raises(ConfigError, match="SPANS_FILE name one file") as e:
            build_span_exporter(
                Settings.resolve({"MEMRA_OBS_SPANS_FILE": spans}, requests_file=req)
            )
        assert "argument requests_file and MEMRA_OBS_SPANS_FILE" in str(e.value)
    for path, env in (("/dev/stdout", {}), (x, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}),
                      (x, {"OTEL_TRACES_EXPORTER": "none"})):  # fmt: skip
        ex = build_span_exporter(Settings(spans_file=path, requests_file=path), env=env)
        assert ex is None or ex.shutdown(1) is None


def test_a_spans_file_it_cannot_write_fails_at_start_up(tmp_path):
    """It used to start, then drop every span (said once at the first write): a missing
    directory, a directory (``new/`` too: it wrote a file ``new``), a file it may not create,
    a FIFO nobody reads (it blocked start-up)."""
    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))  # ENXIO too, but no FIFO
    for path, why in (
        (tmp_path / "nope" / "spans.jsonl", "No such file"),
        (tmp_path, "Is a directory"),
        (f"{tmp_path}/new/", "Is a directory"),
        ("/proc/spans.jsonl", "No such file"),
        (tmp_path / "fifo", "a FIFO nobody reads"),  # was "No such device or address"
        (tmp_path / "sock", "No such device or address"),
    ):
        with pytest.raises(ConfigError, match=rf"MEMRA_OBS_SPANS_FILE=.*: {why}"):
            build_span_exporter(
                Settings(spans_file=str(path)), env={"MEMRA_OBS_SPANS_FILE": str(path)}
            )
    assert not (tmp_path / "new").exists()
    sock.close()
    ex = build_span_exporter(Settings(spans_file=str(tmp_path / "s.jsonl")), env={})
    assert ex is not None
    ex.shutdown(1)


@pytest.mark.parametrize("knob", ["spans_file", "requests_file"])
def test_start_up_never_waits_on_another_process_holding_the_file(tmp_path, knob):
    """Its start-up check appended b"" under LOCK_EX: a rank mid-append (or ``flock FILE sleep
    8``) held start-up as long as the lock. Opening the file is the check: no lock, no wait."""
    import fcntl

    from memra_obs.wiring import build_observer

    path = tmp_path / "shared.jsonl"
    path.touch()
    held = os.open(path, os.O_RDONLY)  # another open file description: as another process's
    fcntl.flock(held, fcntl.LOCK_EX)
    sinks = "otel" if knob == "spans_file" else ""
    with futures.ThreadPoolExecutor(1) as pool:
        obs = pool.submit(build_observer, env={}, sinks=sinks, metrics_addr="", **{knob: str(path)})
        prompt, _ = futures.wait([obs], timeout=1.0)
        fcntl.flock(held, fcntl.LOCK_UN)
        os.close(held)
        obs.result(10).shutdown(5)
    assert prompt, "start-up waited on another process's lock"


def test_endpoint_rules():
    """Base endpoint + /v1/traces; the traces endpoint as given; gRPC host:port and TLS."""
    from memra_obs.otel.config import OtlpConfig

    assert OtlpConfig.from_env({}).endpoint == "http://localhost:4318/v1/traces"
    assert (
        OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}).endpoint
        == "http://c:4318/v1/traces"
    )
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c/otlp/?tenant=a"}  # the path, not the query
    assert OtlpConfig.from_env(env).endpoint == "https://c/otlp/v1/traces?tenant=a"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://t/x",
    }
    assert OtlpConfig.from_env(env).endpoint == "https://t/x"
    g = OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert (g.endpoint, g.secure) == ("localhost:4317", False)
    g = OtlpConfig.from_env(
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317"}
    )
    assert (g.endpoint, g.secure) == ("c:4317", True)
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    g = OtlpConfig.from_env(env)
    assert (g.protocol, g.endpoint, g.secure) == ("grpc", "c:4317", False)
    assert OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "2500"}).timeout_s == 2.5
    for target in ("unix:/tmp/otel.sock", "unix:///tmp/otel.sock", "unix-abstract:otel"):
        env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_ENDPOINT": target}
        assert OtlpConfig.from_env(env).endpoint == target


@pytest.mark.parametrize("given", ["collector:4318", "http://c:99999"])
def test_a_bad_general_endpoint_is_quoted_as_written(given):
    """The refusal quotes what the user wrote, not it with ``/v1/traces`` appended (a value they
    never set, sending them looking for where the path came from)."""
    from memra_obs.otel.config import OtlpConfig

    with pytest.raises(ConfigError) as e:
        OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": given})
    assert f"OTEL_EXPORTER_OTLP_ENDPOINT={given!r}:" in str(e.value)


def test_headers_http_and_grpc_can_send_are_taken():
    """RFC 9110 lets a value hold a tab and Latin-1 bytes; a key is a token, any case. gRPC
    keys are lowercased by the sender; its values are printable ASCII."""
    from memra_obs.otel.config import OtlpConfig

    env = {"OTEL_EXPORTER_OTLP_HEADERS": "X-Api_Key.v1=a%09b,tok%21=%C2%A0%C3%BF,e="}
    got = OtlpConfig.from_env(env).headers
    assert got == (("X-Api_Key.v1", "a\tb"), ("tok!", "\xa0\xff"), ("e", ""))
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_HEADERS": "X-Tenant=a b~"}
    assert OtlpConfig.from_env(env).headers == (("X-Tenant", "a b~"),)


def test_sdk_exporter_by_entry_point_gets_readable_spans(capfd, monkeypatch):
    """OTEL_TRACES_EXPORTER=console: the SDK's ConsoleSpanExporter, loaded by entry point,
    prints the spans built from our tuples (the slow, universal path)."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    # Its default ``out`` is the sys.stdout of the SDK's first import: in this suite, maybe
    # an earlier test's capture, closed since (bench_observer imports the SDK).
    init = ConsoleSpanExporter.__init__
    outs = tuple(sys.stdout if hasattr(d, "write") else d for d in init.__defaults__)
    monkeypatch.setattr(init, "__defaults__", outs)
    obs, _q, ex = make({"OTEL_TRACES_EXPORTER": "console"}, prof=False)
    run_session(obs, bursts=(1,), prof=False)
    obs.shutdown(5)
    out = capfd.readouterr().out
    assert ex.exported_spans == 1 + 1 + 6 and ex.export_errors == 0
    assert '"name": "spec.round"' in out and '"memra.spec.k": 4' in out
    assert '"service.name": "memra-obs"' in out


def test_an_sdk_exporter_that_fails_now_and_then_is_counted_span_for_span(monkeypatch):
    """An entry-point exporter whose every second export() fails: each call's spans are counted
    by its own result, and every span is handed over once (a failed chunk dropped its whole
    request, delivered chunks included, and the chunks after it were never tried)."""
    import importlib.metadata

    from opentelemetry.sdk.trace.export import SpanExportResult

    calls: list[tuple[int, bool]] = []

    class Flaky:
        def export(self, spans):
            ok = len(calls) % 2 == 0
            calls.append((len(spans), ok))
            return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

        def shutdown(self):
            pass

    class EntryPoint:
        name = "flaky"

        def load(self):
            return Flaky

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [EntryPoint()])
    obs, q, ex = make({"OTEL_TRACES_EXPORTER": "flaky"}, prof=False)
    for _ in range(2):
        run_session(obs, bursts=(100,), prof=False)
    assert q.flush(10.0) and ex.flush(10.0)
    obs.shutdown(5)
    delivered = sum(n for n, ok in calls if ok)
    failed = sum(n for n, ok in calls if not ok)
    assert delivered + failed == 2 * (1 + 1 + 100 * 6)  # every span handed over, once
    assert (ex.exported_spans, ex.dropped_spans) == (delivered, failed)
    assert max(n for n, _ in calls) <= 64 and ex.export_errors == len(calls) // 2


def test_process_exit_without_shutdown_still_writes_the_open_session(tmp_path):
    """A worker that exits mid-request without calling shutdown: the at-exit hook flushes
    the queue and closes the open session as unfinished, in bounded time."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "exit.jsonl"
    script = textwrap.dedent(
        f"""
        from memra_obs.environment import Settings
        from memra_obs.export import QueueSink
        from memra_obs.observer import Observer
        from memra_obs.otel import build_span_exporter
        ex = build_span_exporter(Settings(spans_file={str(path)!r}), env={{}})
        obs = Observer([QueueSink([ex])], level=1, prof=False)
        s = obs.session("glm5")
        b = s.burst(4)
        for _ in range(3):
            b.begin_round(); b.end_draft(); b.end_verify(); b.end_accept(); b.end_rollback()
            b.end_round(k=4, j=2)
        """
    )
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30)
    assert time.monotonic() - t0 < 20
    names = [
        sp["name"]
        for line in path.read_text().splitlines()
        for sp in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    ]
    assert names.count("spec.session") == 1 and names.count("spec.round") == 3
    assert names.count("spec.burst") == 1


def test_sigterm_with_the_readmes_recipe_flushes_every_finished_session(tmp_path):
    """SIGTERM's default action (torchrun stopping ranks, a pod stopping) skips atexit: the
    last spans were lost. The README's recipe (``sys.exit`` from a SIGTERM handler, as
    printed there) runs atexit, where every finished session reaches the span file."""
    import re
    import signal
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    found = re.search(r"\n    (signal\.signal\(signal\.SIGTERM, .*)\n", readme)
    assert found, "README gives no SIGTERM recipe"
    recipe = found[1]
    path = tmp_path / "term.jsonl"
    script = f"""import signal, sys, memra_obs
{recipe}
obs = memra_obs.get_observer()
for i in range(10**6):
    with obs.session("glm5") as s, s.burst(4) as b:
        for _ in range(3):
            b.begin_round(); b.end_draft(); b.end_verify(); b.end_accept(); b.end_rollback()
            b.end_round(k=4, j=2)
    print(i, flush=True)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    env.update(MEMRA_OBS_SINKS="otel", MEMRA_OBS_SPANS_FILE=str(path))
    p = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, bufsize=0)
    assert p.stdout is not None  # unbuffered: communicate() below reads what readline left
    assert [p.stdout.readline() for _ in range(5)][-1] == b"4\n"  # sessions are under way
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    done = 5 + len(out.splitlines())  # sessions it finished before exiting
    assert p.returncode == 143
    spans = [
        sp
        for line in path.read_text().splitlines()
        for sp in json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    ]
    cut = "memra.spec.unfinished"  # the one SIGTERM interrupted, closed at exit
    ended = [
        sp
        for sp in spans
        if sp["name"] == "spec.session" and cut not in {a["key"] for a in sp["attributes"]}
    ]
    assert len(ended) >= done, (len(ended), done)


def test_malformed_records_and_values_are_skipped_and_counted(receiver):
    """A record that cannot become spans, or a span value the wire cannot carry (a negative
    time), is skipped and counted; the rest of the batch still goes out intact."""
    from memra_obs.testing import RecordingSink

    keep = RecordingSink(wants_trace_ids=True)
    run_session(
        Observer([keep], level=1, prof=False, verify_split=VerifySplit()), bursts=(2,), prof=False
    )
    recs = list(keep.records)
    bad_round = recs[1]._replace(t_ns_mono=(-(10**30),) * 6)  # negative epoch times
    broken = recs[2]._replace(t_ns_mono=None)  # not even a tuple
    ex = build_span_exporter(Settings(), env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url})
    ex.export([recs[0], bad_round, broken, *recs[3:]])
    ex.shutdown(5)
    assert ex.export_errors == 1  # the record that raised
    assert ex.dropped_spans == 6  # the bad round and its five phases
    assert ex.exported_spans == len(receiver.spans) == 1 + 1 + 6 * (len(recs) - 5)


def test_a_spans_file_argument_with_no_directory_names_the_argument(tmp_path, monkeypatch):
    """``configure(spans_file=...)``: the refusal names the argument, as every other one does
    (it named MEMRA_OBS_SPANS_FILE, which was not set)."""
    import memra_obs

    for var in ("MEMRA_OBS_SPANS_FILE", "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(memra_obs, "_observer", None)
    bad = str(tmp_path / "nope" / "x.jsonl")
    try:
        with pytest.raises(ConfigError, match=r"^argument spans_file='.*': No such file or dir"):
            memra_obs.configure(sinks="otel", spans_file=bad, metrics_addr="")
        monkeypatch.setenv("MEMRA_OBS_SPANS_FILE", bad)
        with pytest.raises(ConfigError, match=r"^MEMRA_OBS_SPANS_FILE='.*': No such file or dir"):
            memra_obs.configure(sinks="otel", metrics_addr="")
    finally:
        memra_obs.configure(env={})


def test_a_read_only_working_directory_says_where_the_default_span_file_was(tmp_path, monkeypatch):
    """A container's read-only workdir (readOnlyRootFilesystem, an arbitrary uid): the default
    ``memra-obs-spans.jsonl``, a variable nobody set, is refused naming the full path and the
    two ways out (it said ``'memra-obs-spans.jsonl': Permission denied``, nothing more)."""
    import errno

    real = os.open

    def read_only(path, flags, *a, **kw):
        if str(path).endswith("memra-obs-spans.jsonl"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, flags, *a, **kw)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError) as refused:
        build_span_exporter(Settings(), env={})
    said = str(refused.value)
    assert said.startswith("MEMRA_OBS_SPANS_FILE='memra-obs-spans.jsonl': Read-only file system")
    assert str(tmp_path / "memra-obs-spans.jsonl") in said
    assert "OTEL_TRACES_EXPORTER=none" in said and "a file this process can write" in said


def test_the_readmes_using_it_directly_example_runs_as_written(tmp_path):
    """README "Using it directly", as printed there (the loop for its ``...``): it reads the
    MEMRA_OBS_* knobs (it built Settings bare: spans went to ./memra-obs-spans.jsonl), keeps
    OTEL_TRACES_SAMPLER's decision, and with spans turned off carries on (a None exporter
    killed the export thread)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"### Using it directly\n\n((?:    .*\n|\n)+)", readme)[1]
    loop = "with obs.session('glm5') as s, s.burst(4) as b:\n" + "".join(
        f"    b.{c}()\n" for c in ("begin_round", "end_draft", "end_verify", "end_accept", "end_rollback")
    ) + "    b.end_round(k=4, j=2)\n"  # fmt: skip
    script = "\n".join(x[4:] for x in block.splitlines()).replace("...\n", loop)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_", "OTEL_"))}
    path, off = tmp_path / "knob.jsonl", tmp_path / "off.jsonl"
    for extra in (
        {"MEMRA_OBS_SPANS_FILE": str(path)},
        {"OTEL_SDK_DISABLED": "true"},
        {"MEMRA_OBS_SPANS_FILE": str(off), "OTEL_TRACES_SAMPLER": "always_off"},
    ):
        p = subprocess.run([sys.executable, "-c", script], env={**env, **extra}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert p.returncode == 0 and "Error" not in p.stderr, p.stderr
    assert '"name":"spec.round"' in path.read_text().replace(" ", "")
    assert not (tmp_path / "memra-obs-spans.jsonl").exists()
    assert not off.exists() or "spec.round" not in off.read_text()  # the sampler said no


class _Ok(http.server.BaseHTTPRequestHandler):
    """Answers each POST 200 on a kept-alive connection; ``arrived`` runs before the answer."""

    protocol_version = "HTTP/1.1"

    def arrived(self) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.arrived()
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a: object) -> None:
        pass


@contextlib.contextmanager
def _sender_to(handler: type[_Ok]):
    """An ``HttpSender`` to a loopback server of ``handler``, both closed after."""
    from memra_obs.otel.config import OtlpConfig
    from memra_obs.otel.transport import HttpSender

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/traces"
    sender = HttpSender(OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url}))
    try:
        yield sender
    finally:
        sender.close()
        srv.shutdown()
        srv.server_close()


def test_a_keep_alive_the_receiver_closed_while_idle_is_reopened_at_once():
    """Go's servers (the Collector's) close an idle keep-alive connection: the next request
    failed on it, was counted a retry and waited its backoff (50-100 ms a request after any
    pause). Now a reused connection found closed is reopened and the request sent at once."""

    class Idle(_Ok):
        timeout = 0.2  # closes after 0.2 s idle

    with _sender_to(Idle) as sender:
        for _ in range(3):
            assert sender.send(b"", 5.0) == (0, "")  # no Retry raised on the stale connection
            time.sleep(0.5)


def test_an_abort_on_a_kept_alive_connection_is_not_a_resend():
    """shutdown's ``abort()`` cuts the send in flight: a retry on a reset connection (meant
    for a keep-alive the receiver closed while idle) read the abort as one, sent the request
    again with a fresh timeout and outlived shutdown. A stale connection is found before a
    request goes out, and nothing is sent twice."""
    from memra_obs.otel.transport import Retry

    got: list[float] = []
    gate = threading.Event()

    class Slow(_Ok):
        def arrived(self) -> None:
            got.append(time.monotonic())
            if len(got) > 1:  # the collector turns slow after its first answer
                gate.wait(30)

    with contextlib.ExitStack() as stack:
        sender = stack.enter_context(_sender_to(Slow))
        stack.callback(gate.set)  # first out: its handler thread goes with the test, not 30 s on
        assert sender.send(b"", 5.0) == (0, "")
        out: list[object] = []
        t = threading.Thread(target=lambda: out.append(_attempt(sender, 30.0)))
        t.start()
        # at the receiver: in flight, waiting for its answer
        wait_for("the request at the receiver", lambda: len(got) >= 2, every_s=0.01)
        sender.abort()
        # The abort ends the send at once; one sent again waits out the slow answer (30 s,
        # the send's own timeout too): 10 s is slack for a loaded machine, a third of that.
        t.join(10.0)
        assert not t.is_alive() and isinstance(out[0], Retry), out
        time.sleep(0.2)
        assert len(got) == 2  # the first request and the aborted one: nothing resent


def _attempt(sender, timeout_s: float = 5.0) -> object:
    try:
        return sender.send(b"", timeout_s)
    except Exception as exc:
        return exc
