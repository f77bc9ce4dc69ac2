"""The span exporter's promises under faults (issue 13): every span ends up exported or
counted as dropped, shutdown keeps its timeout, retries follow the OTLP specification
(jittered exponential backoff inside an overall deadline, Retry-After in both forms, gRPC's
retryable codes), and the default span file rotates at its size limit."""

from __future__ import annotations

import contextlib
import email.utils
import http.server
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from forked import in_child
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from polling import wait_for
from test_otel_export import Receiver, closed_port, grpc_trace_service, make, run_session

from memra_obs import diagnostics
from memra_obs.environment import ConfigError, Settings
from memra_obs.export import ExporterSet
from memra_obs.observer import Observer
from memra_obs.otel import build_span_exporter
from memra_obs.testing import RecordingSink

pytestmark = pytest.mark.integration

SPANS = 1 + 2 + 5 * 6  # run_session(prof=False): session, 2 bursts, 5 rounds of 6 spans


def session_records() -> list:
    """The records of one run_session(prof=False), kept in memory."""
    keep = RecordingSink(wants_trace_ids=True)
    run_session(Observer([keep], level=1, prof=False), prof=False)
    return list(keep.records)


class Scripted:
    """An OTLP/HTTP receiver answering from a script of (status, headers, delay_s); 200 once
    the script runs out. Keeps every request's arrival time; decodes what it accepts."""

    def __init__(self, script: list[tuple[int, dict[str, str], float]]) -> None:
        self.script = list(script)
        self.times: list[float] = []
        self.spans = 0
        rx = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                rx.times.append(time.monotonic())
                status, headers, delay = rx.script.pop(0) if rx.script else (200, {}, 0.0)
                time.sleep(delay)
                if status == 200:
                    msg = ExportTraceServiceRequest.FromString(body)
                    rx.spans += sum(
                        len(ss.spans) for rs in msg.resource_spans for ss in rs.scope_spans
                    )
                headers = {k: v() if callable(v) else v for k, v in headers.items()}
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Silent:
    """A collector that accepts connections, reads, and never answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.got = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._read, args=(c,), daemon=True).start()

    def _read(self, c: socket.socket) -> None:
        try:
            while c.recv(1 << 16):
                self.got += 1
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def recorded_backoffs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, int, float, float]]:
    """Every ``backoff_s(n, cap)`` the exporter draws from now on, as (thread, n, cap, wait):
    the waits it chose, exact, where the gaps a receiver measures carry the machine's load."""
    from memra_obs.otel import exporter

    real, drawn = exporter.backoff_s, []

    def backoff_s(n: int, cap: float = exporter.BACKOFF_CAP_S) -> float:
        wait = real(n, cap)
        drawn.append((threading.current_thread(), n, cap, wait))
        return wait

    monkeypatch.setattr(exporter, "backoff_s", backoff_s)
    return drawn


def drawn_by(ex, drawn: list[tuple[object, int, float, float]]) -> list[tuple[int, float, float]]:
    """(n, cap, wait) of the draws on ``ex``'s sender thread (another test's exporter may be
    retrying still)."""
    return [(n, cap, w) for th, n, cap, w in drawn if th is ex.outputs[0]._thread]


# ------------------------------------------------------------------------------ shutdown


@pytest.mark.parametrize("collector", ["silent", "slow 429"])
def test_shutdown_accounts_for_the_request_in_flight_within_its_timeout(collector, caplog):
    """A request in flight at shutdown (a collector that never answers, or one that answers
    429 slowly): every span is exported or counted dropped, nothing says 'sender raised',
    and the exporter's shutdown takes no longer than its timeout."""
    diagnostics.reset()
    if collector == "silent":
        rx: Silent | Scripted = Silent()
        busy: Callable[[], object] = lambda: rx.got  # noqa: E731
    else:  # the answer comes 5 s in: still in flight when shutdown's 1 s is up
        rx = Scripted([(429, {}, 5.0)] * 50)
        busy = lambda: rx.times  # noqa: E731
    try:
        ex = build_span_exporter(Settings(), env={"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url})
        ex.export(session_records())
        ex.tick()
        wait_for("the request in flight", busy)
        t0 = time.monotonic()
        ex.shutdown(1.0)
        took = time.monotonic() - t0
    finally:
        rx.close()
    assert ex.exported_spans + ex.dropped_spans == SPANS, (ex.exported_spans, ex.dropped_spans)
    assert ex.dropped_spans == SPANS and ex.export_errors >= 1
    assert "sender raised" not in caplog.text
    # ~1 s. A shutdown that ignores its timeout waits for the send: the 429 at 5 s, or the
    # silent collector until the 10 s export timeout; one that waits for it a second time
    # before the abort takes 2 s. 1.8 s: slack for a loaded CI machine, short of both.
    assert took <= 1.8, took


def test_observer_shutdown_keeps_its_timeout_with_a_silent_collector(monkeypatch):
    """The whole chain (queue, worker, exporter) against a collector that never answers:
    shutdown(1) returns in about a second and every span is accounted for."""
    rx = Silent()
    try:
        obs, _q, ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url}, prof=False)
        run_session(obs, prof=False)
        run_session(obs, prof=False)
        wait_for("a request at the collector", lambda: rx.got)
        deadlines: list[float] = []
        real = ExporterSet.shutdown

        def shutdown(self, deadline, *a, **k):
            deadlines.append(deadline)
            return real(self, deadline, *a, **k)

        monkeypatch.setattr(ExporterSet, "shutdown", shutdown)
        t0 = time.monotonic()
        obs.shutdown(1.0)
        took = time.monotonic() - t0
    finally:
        rx.close()
    assert ex.exported_spans + ex.dropped_spans == 2 * SPANS
    # The exporters close by the deadline shutdown(1) began with (no host's load moves it),
    # not a fresh second after the queue's drain took its share.
    assert deadlines and max(deadlines) <= t0 + 1.0 + 1e-3, [d - t0 for d in deadlines]
    # ~1.05 s (export.ExporterSet gives the last exporter a 50 ms floor past the deadline).
    # Waiting out the silent collector takes the 10 s export timeout; 3 s is slack for a
    # loaded CI machine, still a third of the defect's time.
    assert took <= 3.0, took


# ------------------------------------------------------------------------------- retries


def test_retry_after_is_honored_in_seconds_and_as_an_http_date():
    """429 with Retry-After: 2, then 503 with an HTTP-date ~2 s ahead, then 200: the retries
    wait what the collector asked for, and the spans arrive."""
    date = lambda: email.utils.formatdate(time.time() + 2.0, usegmt=True)  # noqa: E731
    rx = Scripted([(429, {"Retry-After": "2"}, 0.0), (503, {"Retry-After": date}, 0.0)])
    try:
        obs, _q, ex = make(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url, "OTEL_EXPORTER_OTLP_TIMEOUT": "9000"},
            prof=False,
        )
        run_session(obs, prof=False)
        obs.shutdown(12)
    finally:
        rx.close()
    t = rx.times
    assert len(t) == 3 and ex.exported_spans == SPANS == rx.spans and ex.dropped_spans == 0
    # The lower bounds catch a Retry-After ignored (our backoff retries within 0.1-0.2 s);
    # the upper ones a wait far past the 2 s asked, with slack for a loaded CI machine.
    assert 1.95 <= t[1] - t[0] <= 4.0, t
    assert 0.95 <= t[2] - t[1] <= 4.0, t  # an HTTP-date has whole seconds


def test_retry_after_that_is_not_ascii_digits_means_back_off():
    """A Retry-After of Unicode digits ('²', Latin-1-decoded) is unreadable (None: our backoff),
    not a ValueError that dropped the request instead of retrying it."""
    from memra_obs.otel.transport import retry_after_s

    assert [retry_after_s(v) for v in ("²", "٣", " 7 ")] == [None, None, 7.0]
    # an HTTP-date past datetime's range raised OverflowError: the request was dropped
    assert retry_after_s("Mon, 01 Jan 99999999999999999999 00:00:00 GMT") is None


def test_retry_after_beyond_the_deadline_drops_at_once():
    """A Retry-After longer than the export timeout: no waiting, no second attempt; the
    spans are counted dropped."""
    rx = Scripted([(503, {"Retry-After": "30"}, 0.0)])
    try:
        obs, _q, ex = make(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url, "OTEL_EXPORTER_OTLP_TIMEOUT": "1000"},
            prof=False,
        )
        run_session(obs, prof=False)
        t0 = time.monotonic()
        obs.shutdown(5)
        assert time.monotonic() - t0 < 0.8
    finally:
        rx.close()
    assert len(rx.times) == 1 and ex.dropped_spans == SPANS and ex.export_errors == 1


def test_backoff_is_jittered_exponential_within_the_overall_deadline(monkeypatch):
    """503 forever without Retry-After and a 2 s export timeout: attempts keep coming with
    growing, jittered gaps until the deadline, then the request is dropped."""
    from memra_obs.otel.exporter import BACKOFF_CAP_S, backoff_s  # (the real one: unrecorded)

    drawn = recorded_backoffs(monkeypatch)
    rx = Scripted([(503, {}, 0.0)] * 100)
    try:
        obs, _q, ex = make(
            {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url, "OTEL_EXPORTER_OTLP_TIMEOUT": "2000"},
            prof=False,
        )
        run_session(obs, prof=False)
        wait_for("spans counted dropped", lambda: ex.dropped_spans)
        obs.shutdown(1)
    finally:
        rx.close()
    t = rx.times
    gaps = [b - a for a, b in itertools.pairwise(t)]
    chosen = drawn_by(ex, drawn)
    waits = [w for _n, _cap, w in chosen]
    # A draw for each failed attempt, n = 0, 1, 2, ..., with an answer's cap; the last one's
    # wait would have ended past the deadline, so the request was dropped instead.
    assert [(n, cap) for n, cap, _w in chosen] == [(n, BACKOFF_CAP_S) for n in range(len(t))]
    # Within the deadline, exactly: a retry goes only if its wait ends inside the 2 s, and
    # each waited at least its draw, so the waits before the retries sent add up to 2 s at
    # most (a retry past the deadline makes them more). Measured: 2 s, plus slack for a
    # loaded CI machine.
    assert len(t) >= 4 and sum(waits[: len(t) - 1]) <= 2.0, (t, waits)
    assert t[-1] - t[0] <= 2.5, t
    # Growing, exactly: draw n+1 is at least cap n (0.5 * 2 * cap). Measured: each gap holds
    # its wait, and the gaps grow but for 0.1 s of scheduling noise.
    assert all(b >= a for a, b in itertools.pairwise(waits)), waits
    assert all(g >= w for g, w in zip(gaps, waits[:-1], strict=True)), (gaps, waits)
    assert all(b >= 0.9 * a - 0.1 for a, b in itertools.pairwise(gaps)), gaps
    assert ex.dropped_spans == SPANS and ex.exported_spans == 0

    for n in range(6):  # the schedule: exponential, capped, jittered
        draws = [backoff_s(n) for _ in range(400)]
        cap = min(0.1 * 2**n, 5.0)
        assert all(0.5 * cap <= d <= cap for d in draws), n
        assert max(draws) - min(draws) > 0.3 * cap, n  # jittered, not a fixed step


def late_receiver(port: int) -> tuple[Receiver, http.server.ThreadingHTTPServer]:
    """A Receiver that starts now on ``port`` (refused until then); shut the server down."""
    rx = Receiver()
    rx.server.server_close()
    rx.server.shutdown()
    late = http.server.ThreadingHTTPServer(("127.0.0.1", port), rx.server.RequestHandlerClass)
    threading.Thread(target=late.serve_forever, daemon=True).start()
    return rx, late


def test_a_collector_that_comes_up_late_still_gets_the_spans():
    """Connection refused is retried with backoff (OTLP/HTTP Connection): a collector that
    starts half a second late receives everything."""
    port = closed_port()
    obs, _q, ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}, prof=False)
    run_session(obs, prof=False)
    time.sleep(0.5)
    rx, late = late_receiver(port)
    try:
        obs.shutdown(8)
    finally:
        late.shutdown()
        late.server_close()
    assert ex.exported_spans == SPANS == len(rx.spans) and ex.dropped_spans == 0


def test_a_collector_back_from_an_outage_has_the_spans_within_about_a_second(monkeypatch):
    """A refused connection (no connection: a retry hammers nobody) is retried at most 1 s
    apart, so a collector back after a 6 s outage has the spans about a second later (with the
    5 s cap of an answer: up to 5 s; over gRPC, compounded with its reconnect backoff, 8 s)."""
    from memra_obs.otel.exporter import BACKOFF_CAP_S, REFUSED_CAP_S, backoff_s

    assert all(backoff_s(9, REFUSED_CAP_S) <= 1.0 for _ in range(200)) and BACKOFF_CAP_S == 5.0
    drawn = recorded_backoffs(monkeypatch)
    port = closed_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_TIMEOUT": "30000"}  # fmt: skip
    obs, _q, ex = make(env, prof=False)
    run_session(obs, prof=False)
    time.sleep(6.0)
    rx, late = late_receiver(port)
    back = time.monotonic()
    try:
        wait_for("the spans at the collector back", lambda: len(rx.spans) == SPANS, 10.0)
        took = time.monotonic() - back
    finally:
        obs.shutdown(5)
        late.shutdown()
        late.server_close()
    print(f"\nthe spans {took:.2f} s after the collector's return")
    # Exactly: every wait of the outage (refused, 6 s of them) had the 1 s cap; with an
    # answer's 5 s cap they reach 2.5-5 s. Measured: ~1 s, with slack for a loaded machine.
    chosen = drawn_by(ex, drawn)
    assert len(chosen) >= 5, chosen  # 0.1 + 0.2 + 0.4 + 0.8 + 1 s at most: 5 draws in 6 s
    assert all(cap == REFUSED_CAP_S and w <= 1.0 for _n, cap, w in chosen), chosen
    assert took < 3.0 and ex.dropped_spans == 0


def test_only_a_refused_connection_is_retried_within_a_second() -> None:
    """A failure with no connection (HTTP's refused one; gRPC's "failed to connect to all
    addresses") is the one whose retries wait at most 1 s; an answer (a 503) keeps the 5 s cap."""
    from memra_obs.otel.config import OtlpConfig
    from memra_obs.otel.transport import HttpSender, Retry

    port = closed_port()
    for proto in ("http/protobuf", "grpc"):
        if proto == "grpc":
            pytest.importorskip("grpc")
            from memra_obs.otel.transport import GrpcSender as Sender
        else:
            Sender = HttpSender  # type: ignore[assignment]
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": proto}  # fmt: skip
        sender = Sender(OtlpConfig.from_env(env))
        try:
            with pytest.raises(Retry) as refused:
                sender.send(b"", 2.0)
        finally:
            sender.close()
        assert refused.value.refused, (proto, refused.value)
    rx = Receiver(statuses=[503])
    sender = HttpSender(OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url}))
    try:
        with pytest.raises(Retry) as answered:
            sender.send(b"", 2.0)
    finally:
        sender.close()
        rx.close()
    assert not answered.value.refused


class Streaming:
    """An endpoint that answers every POST ``200`` and then streams a chunked body for as long
    as the client reads (not a collector: a proxy or a mistyped endpoint)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(
                    target=self._serve, args=(self.sock.accept()[0],), daemon=True
                ).start()

    def _serve(self, c: socket.socket) -> None:
        with c, c.makefile("rb") as f, contextlib.suppress(OSError):
            while head := list(iter(lambda: f.readline().rstrip(b"\r\n"), b"")):  # EOF ends too
                size = next(
                    int(h.split(b":")[1]) for h in head if h.lower().startswith(b"content-length")
                )
                f.read(size)
                self.requests += 1
                c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for _ in range(100_000):  # 6 GiB: ends the test's thread if the client reads on
                    c.sendall(b"10000\r\n" + bytes(1 << 16) + b"\r\n")

    def close(self) -> None:
        self.sock.close()


def test_an_answer_that_streams_on_does_not_hold_the_exporter():
    """A 200 whose body never ends: its status is the answer, the rest is not read (1 MiB at
    most) and its connection is dropped, so the next batch goes on a new one (it read on for
    good, holding every span after it)."""
    rx = Streaming()
    obs, _q, ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url}, prof=False)
    try:
        run_session(obs, prof=False)
        wait_for("the first session exported", lambda: ex.exported_spans == SPANS)
        run_session(obs, prof=False)
        wait_for("the second session exported", lambda: ex.exported_spans == 2 * SPANS)
        assert rx.requests == 2 and ex.dropped_spans == 0
    finally:
        obs.shutdown(2)
        rx.close()


def _grpc_collector(script: list[tuple[str, float | None]]):
    """A gRPC TraceService failing with (code, RetryInfo delay or None) from the script,
    then answering OK; returns (server, port, call times)."""
    grpc = pytest.importorskip("grpc")
    from google.protobuf.duration_pb2 import Duration
    from google.rpc import error_details_pb2, status_pb2

    times: list[float] = []

    def export(req: ExportTraceServiceRequest, ctx) -> ExportTraceServiceResponse:
        times.append(time.monotonic())
        if script:
            name, delay = script.pop(0)
            code = getattr(grpc.StatusCode, name)
            st = status_pb2.Status(code=code.value[0], message="not now")
            if delay is not None:
                info = error_details_pb2.RetryInfo(
                    retry_delay=Duration(seconds=int(delay), nanos=int(delay % 1 * 1e9))
                )
                st.details.add().Pack(info)
            ctx.set_trailing_metadata((("grpc-status-details-bin", st.SerializeToString()),))
            ctx.abort(code, "not now")
        return ExportTraceServiceResponse()

    server, port = grpc_trace_service(export)
    return server, port, times


def _one_grpc_session(server, port: int):
    """One session's spans over gRPC to ``server`` on ``port``, shut down in 5 s; its exporter."""
    try:
        env = {
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        }
        obs, _q, ex = make(env, prof=False)
        run_session(obs, prof=False)
        obs.shutdown(5)
    finally:
        server.stop(0)
    return ex


@pytest.mark.parametrize(
    ("code", "delay", "retried"),
    [
        ("RESOURCE_EXHAUSTED", None, False),  # no RetryInfo: the server cannot recover
        ("RESOURCE_EXHAUSTED", 0.4, True),
        ("UNAVAILABLE", 0.4, True),  # RetryInfo's delay is waited
        ("OUT_OF_RANGE", None, True),
        ("ABORTED", None, True),
        ("INVALID_ARGUMENT", None, False),
        ("UNKNOWN", None, False),
    ],
)
def test_grpc_retries_the_specification_codes(code, delay, retried):
    """gRPC: the specification's retryable codes are retried, RESOURCE_EXHAUSTED only with
    RetryInfo (whose delay is honored); the others drop the request at once."""
    server, port, times = _grpc_collector([(code, delay)])
    ex = _one_grpc_session(server, port)
    if retried:
        assert len(times) == 2 and ex.exported_spans == SPANS and ex.dropped_spans == 0
        if delay is not None:
            assert times[1] - times[0] >= delay - 0.02, times
    else:
        assert len(times) == 1 and ex.dropped_spans == SPANS and ex.export_errors == 1


def test_a_collectors_message_reaches_stderr_as_one_inert_line(caplog, tmp_path):
    """A collector's (or a man in the middle's) error text went to stderr as it came: a newline
    in a gRPC status forged a ``[glm5-phase] rounds=999`` line that ``memra-obs tail`` of that
    stderr then published, and ESC sequences retitled and cleared the operator's terminal. Every
    said-once message spells them out (a file name in a tail note too)."""
    import grpc

    forged = "bad\n[glm5-phase] rounds=999 k=4 total=9999.00ms\n\x1b]0;PWNED\x07\x1b[2J"

    def export(req: ExportTraceServiceRequest, ctx) -> ExportTraceServiceResponse:
        ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, forged)

    _one_grpc_session(*grpc_trace_service(export))
    (said,) = [r.getMessage() for r in caplog.records if "PWNED" in r.getMessage()]
    assert "\n" not in said and "\x1b" not in said and "\x07" not in said, said
    assert "bad\\n[glm5-phase] rounds=999" in said and "\\x1b]0;PWNED\\x07" in said, said
    name = tmp_path / "w\x1b[2J.log"
    name.write_text("")
    p = subprocess.run([sys.executable, "-m", "memra_obs.cli", "tail", str(name)],
                       capture_output=True, timeout=60, env={**os.environ, "MEMRA_OBS_SINKS": ""})  # fmt: skip
    assert p.returncode == 0 and b"\x1b" not in p.stderr and b"w\\x1b[2J.log" in p.stderr


# ------------------------------------------------------------------------- the span file


def _spans_in(path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        json_format.Parse(line, ExportTraceServiceRequest())
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                out.extend(ss["spans"])
    return out


def test_span_file_rotates_at_its_limit_keeping_one_previous_file(tmp_path):
    """MEMRA_OBS_SPANS_FILE_MAX_BYTES: the file never grows past the limit; at the limit it
    becomes FILE.1 (replacing an older one) and a new FILE starts, so the disk holds at most
    twice the limit; every line in both is a whole OTLP-JSON request; the newest spans are
    in FILE."""
    path = tmp_path / "spans.jsonl"
    limit = 1 << 20  # the least: requests sealed past 256 KiB (a busy worker's) fit in it
    st = Settings.resolve({"MEMRA_OBS_SPANS_FILE_MAX_BYTES": str(limit)}, spans_file=str(path))
    obs, _q, ex = make(
        {}, prof=False, spans_file=str(path), spans_file_max_bytes=st.spans_file_max_bytes
    )
    for i in range(240):
        run_session(obs, prof=False)
        if i % 40 == 39:  # 1,320 spans a flush: requests sealed by size
            obs.flush(5)
    last = obs.session("glm5")
    last.end()
    obs.shutdown(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spans.jsonl", "spans.jsonl.1"]
    old = tmp_path / "spans.jsonl.1"
    longest = max(map(len, old.read_bytes().splitlines(True) + path.read_bytes().splitlines(True)))
    assert 200_000 < longest < limit // 2  # sealed past 256 KiB; two lines a file at least
    # FILE.1 was full: the line that rotated it would not fit
    assert path.stat().st_size <= limit and limit - longest < old.stat().st_size <= limit
    kept = _spans_in(old) + _spans_in(path)
    assert 0 < len(kept) < ex.exported_spans == 240 * SPANS + 1  # older files rotated away
    assert _spans_in(path)[-1]["name"] == "spec.session"


def test_a_span_file_that_is_a_link_is_never_rotated(tmp_path):
    """Rotation renamed the path: ``MEMRA_OBS_SPANS_FILE=/dev/stdout`` (a link) or a link into
    a data volume was replaced by a regular file, its target abandoned (as root in a container,
    /dev/stdout itself). A link is appended to as it is, said on the banner."""
    from memra_obs.otel.transport import FileSender

    (tmp_path / "data").mkdir()
    target, link = tmp_path / "data" / "spans.jsonl", tmp_path / "spans.jsonl"
    link.symlink_to(target)
    sender = FileSender(str(link), max_bytes=100)
    for i in range(3):
        sender.send(b'{"line": %d, "pad": "%s"}' % (i, b"x" * 40))
    sender.close()
    assert link.is_symlink() and not (tmp_path / "spans.jsonl.1").exists()
    assert len(target.read_text().splitlines()) == 3
    assert sender.url.endswith("(a link or not a regular file: never rotated)")
    plain = FileSender(str(tmp_path / "plain.jsonl"), max_bytes=100)
    for i in range(3):
        plain.send(b'{"line": %d, "pad": "%s"}' % (i, b"x" * 40))
    plain.close()
    assert (tmp_path / "plain.jsonl.1").exists()  # a regular file still rotates


def test_workers_sharing_a_span_file_follow_each_others_rotations(tmp_path):
    """Workers started in one directory share the default span file. Each kept its own size
    and, after another rotated the file, appended to the moved FILE.1, which the next rotation
    replaced: spans counted exported were in neither file. Two senders (two open files, as two
    processes have) taking turns: FILE.1 + FILE hold an unbroken run of the newest lines."""
    from memra_obs.otel.transport import FileSender

    path = tmp_path / "spans.jsonl"
    a, b = FileSender(str(path), 1000), FileSender(str(path), 1000)
    for i in range(100):
        (a, b)[i % 2].send(b"%03d" % i + b"." * 95)
    a.close()
    b.close()
    old, new = (p.read_bytes().splitlines() for p in (tmp_path / "spans.jsonl.1", path))
    got = [int(line[:3]) for line in old + new]
    assert got == list(range(100 - len(got), 100)) and len(got) >= 11  # 10 a file at least
    assert max(len(x) for x in (old, new)) == 10 and path.stat().st_size <= 1000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_mid_append_still_appends(tmp_path):
    """A parent's sender thread mid-write at fork() (here: blocked on a FIFO nobody reads yet):
    the child appends through an open file of its own once that write ends, and the parent's
    write lands whole. (The sender wrote through a buffered file, whose lock a fork taken
    mid-write left held in the child for ever: 1 child in 40-150 never wrote a span again.)"""
    import threading

    from memra_obs.otel.transport import FileSender

    fifo = tmp_path / "spans.fifo"
    os.mkfifo(fifo)
    keep = os.open(fifo, os.O_RDWR)  # a reader end, so opening for writing does not block
    sender = FileSender(str(fifo))
    big = b"p" * (1 << 20)  # past the FIFO's 64 KiB: the write blocks until it is read
    t = threading.Thread(target=sender.send, args=(big,), daemon=True)
    t.start()
    time.sleep(0.2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one line of its own, or a timeout
        os.close(r)
        signal.alarm(10)
        sender.send(b"child")
        os.write(w, b"ok")
        os._exit(0)
    os.close(w)
    import select

    got, deadline = bytearray(), time.monotonic() + 12
    while len(got) < len(big) + 2 + len(b"child") and time.monotonic() < deadline:
        if select.select([keep], [], [], 0.5)[0]:  # drain: the parent's write, the child's
            got += os.read(keep, 1 << 16)
    os.waitpid(pid, 0)
    assert os.read(r, 2) == b"ok"
    t.join(5)
    assert bytes(got).endswith(b"child\n") and got.count(b"p") == len(big)
    sender.close()
    os.close(keep)
    os.close(r)


def test_span_file_limit_knob(tmp_path):
    """The knob: 64 MiB by default, 0 = never rotate, junk is a ConfigError naming it; the
    demo's banner line says where the file is and how large it may grow."""
    from memra_obs.wiring import build_exporters

    assert Settings.resolve({}).spans_file_max_bytes == 64 << 20
    # 64 meant MiB: one request kept; below 1 MiB one request (up to ~0.3 MiB) passes the limit
    for bad in ("lots", "-1", "1.5", "64", "65536", "1048575"):
        with pytest.raises(ConfigError, match="MEMRA_OBS_SPANS_FILE_MAX_BYTES"):
            Settings.resolve({"MEMRA_OBS_SPANS_FILE_MAX_BYTES": bad})
    path = tmp_path / "s.jsonl"
    built = build_exporters(Settings.resolve({}, sinks="otel", spans_file=str(path)), env={})
    try:
        assert built.where == [f"spans -> {path} (rotates at 64 MiB, keeps one previous file)"]
    finally:
        built.spans.shutdown(1)
    obs, _q, _ex = make({}, prof=False, spans_file=str(path), spans_file_max_bytes=0)
    for _ in range(5):
        run_session(obs, prof=False)
        obs.flush(5)
    obs.shutdown(5)
    assert [p.name for p in tmp_path.iterdir()] == ["s.jsonl"]


# ------------------------------------------------------------------------------ fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_sends_its_own_spans():
    """After fork() the child's span exporter has its own sender thread and connection: its
    spans reach the collector; the parent's keep going over the parent's."""
    rx = Scripted([])
    obs, q, ex = make({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.url, "OTEL_BSP_SCHEDULE_DELAY": "20"})
    try:
        run_session(obs, prof=False)
        assert q.flush(5.0) and ex.flush(5.0)
        one = rx.spans  # the parent's session; its connection is open now
        assert one > 0

        def child() -> bytes:
            run_session(obs, prof=False)
            ok = q.flush(5.0) and ex.flush(5.0)
            return f"{int(ok)} {ex.exported_spans} {ex.dropped_spans}".encode()

        got = in_child(child)
        assert got == f"1 {one} 0".encode()  # the child counted only its own session
        run_session(obs, prof=False)
        assert q.flush(5.0) and ex.flush(5.0)
        wait_for("three sessions at the collector", lambda: rx.spans == 3 * one)
        assert ex.exported_spans == 2 * one and ex.dropped_spans == 0
    finally:
        q.shutdown(2.0)
        rx.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_sends_under_its_own_service_instance_id(tmp_path):
    """The SDK's ``service.instance.id`` is one per process (its providers renew it at fork, as
    the specification wants one per instance): every gunicorn worker forked from the master
    sent under the master's, one instance in Jaeger for them all. One the user set stays."""
    for env in ({}, {"OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=mine"}):
        path = tmp_path / f"spans{len(env)}.jsonl"
        obs, q, _ex = make(env, prof=False, spans_file=str(path))
        try:
            run_session(obs, prof=False)
            assert q.flush(5.0)
            in_child(lambda o=obs, q=q: b"%d" % (run_session(o, prof=False) or q.flush(5.0)))
            run_session(obs, prof=False)
            assert q.flush(5.0)
        finally:
            q.shutdown(2.0)
        ids = []
        for line in path.read_text().splitlines():
            for rs in json.loads(line)["resourceSpans"]:
                kvs = {a["key"]: a["value"]["stringValue"] for a in rs["resource"]["attributes"]}
                ids.append(kvs["service.instance.id"])
        if env:
            assert set(ids) == {"mine"}
        else:
            assert len(set(ids)) == 2 and ids[0] == ids[-1] != ids[1]


def test_an_sdk_exporter_in_a_forked_child_sends_under_its_own_service_instance_id():
    """An entry-point exporter (``OTEL_TRACES_EXPORTER=console``, any SDK ``SpanExporter``) got
    spans under the parent's ``service.instance.id`` in every forked child (the encoders'
    renewed theirs); one the user set stays."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from memra_obs.otel.transport import SdkSender

    span = ("spec.session", 1, 2, 0, 10, 20, (), None)
    for renew in (True, False):
        mem = InMemorySpanExporter()
        res = Resource({"service.name": "s", "service.instance.id": "parent"})
        sender = SdkSender(mem, res, InstrumentationScope("x"), renew_instance=renew)

        def child(sender=sender, mem=mem) -> bytes:
            sender.after_fork()
            sender.send([span])
            return mem.get_finished_spans()[-1].resource.attributes["service.instance.id"].encode()

        got = in_child(child)
        assert (got != b"parent") if renew else (got == b"parent")
        assert got
        sender.send([span])
        assert mem.get_finished_spans()[-1].resource.attributes["service.instance.id"] == "parent"


def self_signed(tmp_path, san="IP:127.0.0.1"):
    """(certificate, key) for 127.0.0.1 (or ``san``), self-signed, one day; skips without the
    openssl CLI."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make a self-signed certificate")
    crt, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", f"subjectAltName={san}",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True,
                   timeout=60)  # fmt: skip
    return crt, key


def test_a_certificate_the_exporter_does_not_trust_is_not_retried(tmp_path):
    """An https endpoint whose certificate fails verification (no OTEL_EXPORTER_OTLP_CERTIFICATE
    for a self-signed one): retrying cannot fix it, so the request is dropped at once and said
    (it was retried for the whole export timeout, holding shutdown as long)."""
    from prometheus_client import CollectorRegistry

    from memra_obs.otel.transport import SendError
    from memra_obs.prom import serve_metrics

    crt, key = self_signed(tmp_path)
    with serve_metrics(("127.0.0.1", 0), registry=CollectorRegistry(), certfile=str(crt),
                       keyfile=str(key)) as srv:  # fmt: skip
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"https://127.0.0.1:{srv.port}/v1/traces",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "20000"}  # fmt: skip
        ex = build_span_exporter(Settings(), env=env)
        assert ex is not None
        try:
            t0 = time.monotonic()
            with pytest.raises(SendError, match="CERTIFICATE_VERIFY_FAILED"):
                ex.outputs[0].sender.send(b"", 20.0)
            assert time.monotonic() - t0 < 5
        finally:
            ex.shutdown(1.0)


def test_a_grpc_tls_handshake_that_fails_is_not_retried(tmp_path):
    """OTLP/gRPC to a server whose certificate is not trusted, and TLS to a plaintext port:
    grpcio calls both UNAVAILABLE (retryable), but retrying cannot fix a handshake, so the
    request is dropped at once, as over HTTP (it was retried for the whole export timeout)."""
    from concurrent import futures

    grpc = pytest.importorskip("grpc")
    from memra_obs.otel.config import OtlpConfig
    from memra_obs.otel.transport import GrpcSender, SendError

    crt, key = self_signed(tmp_path)
    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"")},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    tls = server.add_secure_port(
        "127.0.0.1:0", grpc.ssl_server_credentials([(key.read_bytes(), crt.read_bytes())])
    )
    plain = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for port, ca, why in ((tls, {}, "CERTIFICATE_VERIFY_FAILED"),
                              (plain, {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(crt)}, "SSL_ERROR_SSL"),
                              (tls, {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(crt)}, "")):  # fmt: skip
            env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                   "OTEL_EXPORTER_OTLP_ENDPOINT": f"https://127.0.0.1:{port}", **ca}  # fmt: skip
            sender = GrpcSender(OtlpConfig.from_env(env))
            try:
                if not why:  # the same server, trusted: delivered
                    assert sender.send(b"", 10.0) == (0, "")
                    continue
                with pytest.raises(SendError, match=why):
                    sender.send(b"", 10.0)
            finally:
                sender.close()
    finally:
        server.stop(0)


def test_a_grpc_certificate_for_another_host_is_not_retried(tmp_path):
    """OTLP/gRPC to a trusted certificate made out to another host (a Collector's certificate
    for its service name, reached by IP): grpcio says UNAVAILABLE, but no retry can fix it, so
    the request is dropped at once, as over HTTP (it was retried for the whole export timeout)."""
    from concurrent import futures

    grpc = pytest.importorskip("grpc")
    from memra_obs.otel.config import OtlpConfig
    from memra_obs.otel.transport import GrpcSender, SendError

    crt, key = self_signed(tmp_path, san="DNS:collector.example")
    handler = grpc.method_handlers_generic_handler(
        "opentelemetry.proto.collector.trace.v1.TraceService",
        {"Export": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"")},
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    creds = grpc.ssl_server_credentials([(key.read_bytes(), crt.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_CERTIFICATE": str(crt),
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"https://127.0.0.1:{port}"}  # fmt: skip
    sender = GrpcSender(OtlpConfig.from_env(env))
    try:
        with pytest.raises(SendError, match=r"Hostname|peer certificate"):
            sender.send(b"", 10.0)
    finally:
        sender.close()
        server.stop(0)
