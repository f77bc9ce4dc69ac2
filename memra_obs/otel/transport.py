"""Where encoded span requests go: OTLP/HTTP (stdlib), OTLP/gRPC (grpcio), a JSON-lines
file, or an SDK ``SpanExporter`` found by entry point.

Senders run on the span exporter's own sender thread, never the loop's. Each ``send`` is
bounded: retryable answers (HTTP 429/502/503/504, gRPC UNAVAILABLE & co.) get at most
``attempts`` tries with short backoff (``Retry-After`` honored up to ``max_backoff_s``),
and the backoff waits on the exporter's stop event so shutdown never waits for it. Network
calls release the GIL; the Python around them is a few hundred µs per request.
"""

from __future__ import annotations

import gzip
import http.client
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from .config import OtlpConfig
from .spans import Span

__all__ = [
    "FileSender",
    "GrpcSender",
    "HttpSender",
    "SdkSender",
    "SendError",
    "rejected_spans",
]

RETRY_HTTP = frozenset((429, 502, 503, 504))
TRACE_SERVICE_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
#: gRPC reconnect backoff bounds (ms): a peer that comes back is reached within ~2.4 s
#: (the bound plus gRPC's 20% jitter) however long it was gone.
RECONNECT_INITIAL_MS = 500
RECONNECT_MAX_MS = 2000


class SendError(Exception):
    """An export that did not get through (after any retries)."""


def rejected_spans(resp: bytes) -> int:
    """``partial_success.rejected_spans`` of an ``ExportTraceServiceResponse`` (0 if none).

    A hand-rolled read of two fields, so the core never imports opentelemetry-proto."""
    try:
        i, n = 0, len(resp)
        while i < n:
            tag, i = _uvarint(resp, i)
            wt = tag & 7
            if tag >> 3 == 1 and wt == 2:  # partial_success
                ln, i = _uvarint(resp, i)
                j, end = i, i + ln
                while j < end:
                    t2, j = _uvarint(resp, j)
                    if t2 == 0x08:  # rejected_spans, varint
                        v, j = _uvarint(resp, j)
                        return v
                    j = _skip(resp, j, t2 & 7)
                return 0
            i = _skip(resp, i, wt)
    except (IndexError, ValueError):
        return 0
    return 0


def _uvarint(b: bytes, i: int) -> tuple[int, int]:
    shift = v = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 127) << shift
        if c < 128:
            return v, i
        shift += 7


def _skip(b: bytes, i: int, wt: int) -> int:
    if wt == 0:
        return _uvarint(b, i)[1]
    if wt == 1:
        return i + 8
    if wt == 2:
        ln, i = _uvarint(b, i)
        return i + ln
    if wt == 5:
        return i + 4
    raise ValueError(f"wire type {wt}")


def _json_rejected(resp: bytes) -> int:
    import json

    try:
        v = json.loads(resp or b"{}").get("partialSuccess", {}).get("rejectedSpans", 0)
        return int(v)
    except (ValueError, AttributeError, TypeError):
        return 0


def _ssl_context(cfg: OtlpConfig) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cfg.certificate)
    if cfg.client_certificate:
        ctx.load_cert_chain(cfg.client_certificate, cfg.client_key)
    return ctx


class HttpSender:
    """OTLP/HTTP on one keep-alive ``http.client`` connection (protobuf or JSON bodies)."""

    def __init__(
        self,
        cfg: OtlpConfig,
        stop: threading.Event,
        *,
        json: bool = False,
        attempts: int = 3,
        max_backoff_s: float = 1.0,
    ) -> None:
        u = urlsplit(cfg.endpoint)
        self.url = cfg.endpoint
        self._https = u.scheme == "https"
        self._host = u.hostname or "localhost"
        self._port = u.port or (443 if self._https else 80)
        self._path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        self._timeout = cfg.timeout_s
        self._ctx = _ssl_context(cfg) if self._https else None
        self._gzip = cfg.compression == "gzip"
        self._json = json
        h = {
            "Content-Type": "application/json" if json else "application/x-protobuf",
            "User-Agent": "memra-obs-otlp",
        }
        if self._gzip:
            h["Content-Encoding"] = "gzip"
        h.update(cfg.headers)
        self._headers = h
        self._stop = stop
        self._attempts = max(1, attempts)
        self._max_backoff = max_backoff_s
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        c = self._conn
        if c is None:
            if self._https:
                c = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout, context=self._ctx
                )
            else:
                c = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            self._conn = c
        return c

    def _post(self, body: bytes) -> tuple[int, str | None, bytes]:
        fresh = self._conn is None
        c = self._connection()
        try:
            c.request("POST", self._path, body=body, headers=self._headers)
            r = c.getresponse()
            data = r.read()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            self.abort()
            if fresh:
                raise
            # The server closed an idle keep-alive connection: one immediate retry.
            c = self._connection()
            try:
                c.request("POST", self._path, body=body, headers=self._headers)
                r = c.getresponse()
                data = r.read()
            except BaseException:
                self.abort()
                raise
        except BaseException:
            self.abort()
            raise
        if r.will_close:
            self.abort()
        return r.status, r.getheader("Retry-After"), data

    def send(self, payload: bytes | str) -> int:
        """POST one request; returns the spans the receiver said it rejected."""
        body = payload.encode() if isinstance(payload, str) else payload
        if self._gzip:
            body = gzip.compress(body, compresslevel=5)
        delay = 0.05
        for attempt in range(1, self._attempts + 1):
            try:
                status, retry_after, data = self._post(body)
            except (OSError, http.client.HTTPException) as exc:
                raise SendError(f"{self.url}: {exc!r}") from None
            if 200 <= status < 300:
                return _json_rejected(data) if self._json else rejected_spans(data)
            if status not in RETRY_HTTP or attempt == self._attempts:
                raise SendError(f"{self.url}: HTTP {status} {data[:200]!r}")
            wait = delay
            if retry_after and retry_after.strip().isdigit():
                wait = float(retry_after.strip())
            if self._stop.wait(min(wait, self._max_backoff)):
                raise SendError(f"{self.url}: HTTP {status}; shutting down, not retried")
            delay *= 2
        raise SendError(f"{self.url}: gave up")  # not reached

    def abort(self) -> None:
        """Close the connection (also from another thread, to cut a stuck call short)."""
        c, self._conn = self._conn, None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass

    close = abort


class GrpcSender:
    """OTLP/gRPC through grpcio's generic unary call: our bytes go out as they are."""

    RETRY_CODES = (
        "UNAVAILABLE",
        "RESOURCE_EXHAUSTED",
        "DEADLINE_EXCEEDED",
        "ABORTED",
        "CANCELLED",
        "DATA_LOSS",
    )

    def __init__(
        self,
        cfg: OtlpConfig,
        stop: threading.Event,
        *,
        attempts: int = 3,
        max_backoff_s: float = 1.0,
    ) -> None:
        import grpc  # lazily: only the gRPC protocol needs it

        self._grpc = grpc
        self.url = cfg.endpoint
        opts = [
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.enable_retries", 0),
            # gRPC's own reconnect backoff grows to 120 s while the collector is down, and
            # every export fails fast until the next attempt: after a 30 s outage a worker
            # went on dropping spans for 12 s with the collector back (found against a
            # restarted Jaeger). Nothing is queued across failures here, so reconnect soon.
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_MS),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
        ]
        comp = (
            grpc.Compression.Gzip if cfg.compression == "gzip" else grpc.Compression.NoCompression
        )
        if cfg.secure:

            def _read(p: str | None) -> bytes | None:
                if p is None:
                    return None
                with open(p, "rb") as f:
                    return f.read()

            creds = grpc.ssl_channel_credentials(
                _read(cfg.certificate), _read(cfg.client_key), _read(cfg.client_certificate)
            )
            self._channel = grpc.secure_channel(cfg.endpoint, creds, options=opts, compression=comp)
        else:
            self._channel = grpc.insecure_channel(cfg.endpoint, options=opts, compression=comp)
        ident: Callable[[bytes], bytes] = _identity
        self._call = self._channel.unary_unary(
            TRACE_SERVICE_METHOD, request_serializer=ident, response_deserializer=ident
        )
        self._metadata = tuple((k.lower(), v) for k, v in cfg.headers)
        self._timeout = cfg.timeout_s
        self._retry = frozenset(getattr(grpc.StatusCode, c) for c in self.RETRY_CODES)
        self._stop = stop
        self._attempts = max(1, attempts)
        self._max_backoff = max_backoff_s

    def send(self, payload: bytes | str) -> int:
        body = payload.encode() if isinstance(payload, str) else payload
        delay = 0.05
        for attempt in range(1, self._attempts + 1):
            try:
                resp = self._call(body, timeout=self._timeout, metadata=self._metadata or None)
                return rejected_spans(resp or b"")
            except self._grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if code not in self._retry or attempt == self._attempts:
                    raise SendError(
                        f"grpc {self.url}: {code} {exc.details() if hasattr(exc, 'details') else ''}"
                    ) from None
                if self._stop.wait(min(delay, self._max_backoff)):
                    raise SendError(
                        f"grpc {self.url}: {code}; shutting down, not retried"
                    ) from None
                delay *= 2
        raise SendError(f"grpc {self.url}: gave up")  # not reached

    def abort(self) -> None:
        self._channel.close()

    close = abort


def _identity(b: bytes) -> bytes:
    return b


class FileSender:
    """Appends each request as one line to a file (opened on first use, kept open)."""

    def __init__(self, path: str) -> None:
        self.url = path
        self._f: Any = None

    def send(self, payload: bytes | str) -> int:
        try:
            f = self._f
            if f is None:
                f = self._f = open(self.url, "a", encoding="utf-8")  # noqa: SIM115
            f.write(payload if isinstance(payload, str) else payload.decode())
            f.write("\n")
            f.flush()
        except OSError as exc:
            raise SendError(f"{self.url}: {exc!r}") from None
        return 0

    def abort(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass

    close = abort


class SdkSender:
    """The slow, universal path: ReadableSpans handed to an SDK ``SpanExporter``.

    Spans are built here, on the sender thread, in chunks with a short sleep between, so
    even this path leaves the loop its GIL.
    """

    def __init__(
        self, exporter: Any, resource: Any, scope: Any, *, chunk: int = 64, pause_s: float = 0.0005
    ) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self.url = type(exporter).__name__
        self.exporter = exporter
        self._resource = resource
        self._scope = scope
        self._chunk = chunk
        self._pause = pause_s
        self._RS = ReadableSpan
        self._SC = SpanContext
        self._flags = TraceFlags(TraceFlags.SAMPLED)
        self._kind = SpanKind.INTERNAL
        self._unset = Status(StatusCode.UNSET)
        self._status = Status
        self._codes = {0: StatusCode.UNSET, 1: StatusCode.OK, 2: StatusCode.ERROR}
        self._ok = SpanExportResult.SUCCESS

    def readable(self, sp: Span) -> Any:
        name, tid, sid, pid, start, end, attrs, status = sp
        return self._RS(
            name,
            context=self._SC(tid, sid, False, self._flags),
            parent=self._SC(tid, pid, False, self._flags) if pid else None,
            resource=self._resource,
            attributes=dict(attrs),
            kind=self._kind,
            status=self._unset
            if status is None
            else self._status(self._codes.get(status[0], self._codes[2]), status[1] or None),
            start_time=start,
            end_time=end,
            instrumentation_scope=self._scope,
        )

    def send(self, payload: Sequence[Span]) -> int:
        for i in range(0, len(payload), self._chunk):
            if i:
                time.sleep(self._pause)
            res = self.exporter.export([self.readable(sp) for sp in payload[i : i + self._chunk]])
            if res != self._ok:
                raise SendError(f"{self.url}.export returned {res}")
        return 0

    def abort(self) -> None:
        pass

    def close(self) -> None:
        try:
            self.exporter.shutdown()
        except Exception:
            pass
