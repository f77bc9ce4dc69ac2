"""Where encoded requests go: OTLP/HTTP (stdlib), OTLP/gRPC (grpcio), a JSON-lines file rotated
at a size limit, or an SDK ``SpanExporter`` found by entry point. ``send(payload, timeout_s)`` is
one attempt (the retry loop is the exporter's): it returns the spans the receiver rejected and
its ``error_message`` (a reason, or with 0 rejected a warning), or
raises :class:`Retry` for what the OTLP specification calls retryable (with the receiver's wait),
else :class:`SendError`. ``abort()`` (another thread, at shutdown) cuts the attempt in flight
short. Goal (DESIGN §9): :mod:`.otlp`'s (the SDK's exporters send their span objects, not bytes).
"""

from __future__ import annotations

import contextlib
import email.utils
import gzip
import http.client
import json
import os
import platform
import select
import socket
import ssl
import time
from collections.abc import Sequence
from datetime import timezone
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..diagnostics import say_once
from ..linewriter import AppendFile
from ..version import __version__
from .config import INSTANCE, OtlpConfig, instance_id, shown_url
from .spans import Span

RETRY_HTTP = frozenset((429, 502, 503, 504))
RETRY_GRPC = frozenset(("CANCELLED", "DEADLINE_EXCEEDED", "ABORTED", "OUT_OF_RANGE"))
RETRY_GRPC |= {"UNAVAILABLE", "DATA_LOSS"}  # and RESOURCE_EXHAUSTED with RetryInfo


#: The OTLP exporter specification: a User-Agent naming the exporter and its version.
_AGENT = f"memra-obs-otlp/{__version__} python/{platform.python_version()}"


class SendError(Exception):
    """An export that did not get through (after any retries)."""


class Retry(Exception):
    """A retryable failure; ``after_s`` is the wait the receiver asked for (None: back off);
    ``refused``: there was no connection (refused), so trying again soon hammers nobody."""

    def __init__(self, msg: str, after_s: float | None = None, refused: bool = False) -> None:
        super().__init__(msg)
        self.after_s, self.refused = after_s, refused


def _fields(b: Any) -> list[tuple[int, Any]]:
    """(field number, value) pairs of a protobuf message (not bytes: none), read by hand: varints
    as ints, length-delimited as bytes, fixed skipped; junk raises IndexError or ValueError."""
    out: list[tuple[int, Any]] = []
    i, n = 0, len(b) if isinstance(b, bytes) else 0
    while i < n:
        tag, i = _uvarint(b, i)
        if tag & 7 in (1, 5):
            i += 8 if tag & 7 == 1 else 4
            continue
        v, i = _uvarint(b, i)
        if tag & 7 == 2:
            v, i = b[i : i + v], i + v
        if i > n or tag & 7 not in (0, 2):
            raise ValueError(f"truncated, or wire type {tag & 7}")
        out.append((tag >> 3, v))
    return out


def _uvarint(b: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while b[i] & 128:
        v, i, shift = v | (b[i] & 127) << shift, i + 1, shift + 7
    return v | b[i] << shift, i + 1


#: A response's ``partial_success``: the spans rejected, and why (or a warning, with 0).
Partial = tuple[int, str]


def partial_success(resp: bytes) -> Partial:
    """``partial_success`` {1: rejected_spans, 2: error_message} of an
    ``ExportTraceServiceResponse`` ((0, "") if none or unreadable)."""
    with contextlib.suppress(IndexError, ValueError, TypeError):
        ps = dict(_fields(dict(_fields(resp)).get(1)))
        n, why = ps.get(1, 0), ps.get(2, b"")
        return (n if isinstance(n, int) else 0), _text(why)
    return 0, ""


def _text(b: object) -> str:
    """A receiver's message as one short line ("" for anything but bytes)."""
    if not isinstance(b, bytes):
        return ""
    return " ".join(b.decode("utf-8", "replace").split())[:300]


def status_message(body: bytes, json_body: bool) -> str:
    """``google.rpc.Status.message`` of an error response (OTLP: the body MUST be a Status),
    else the body's first bytes as they are."""
    with contextlib.suppress(ValueError, TypeError, IndexError, AttributeError, RecursionError):
        msg = json.loads(body)["message"] if json_body else dict(_fields(body)).get(2)
        if isinstance(msg, str) and msg.strip():
            return _text(msg.encode())
        if isinstance(msg, bytes) and msg.strip():
            return _text(msg)
    return repr(body[:200])


def retry_info_s(details: bytes) -> float | None:
    """The delay of the RetryInfo in a ``grpc-status-details-bin`` trailer (google.rpc.Status
    {3: Any {1: type_url, 2: RetryInfo {1: Duration {1: s, 2: ns}}}*}), or None."""
    with contextlib.suppress(IndexError, ValueError, TypeError, AttributeError):
        for a in (dict(_fields(v)) for f, v in _fields(details) if f == 3):
            if a.get(1, b"").endswith(b"/google.rpc.RetryInfo"):
                d = dict(_fields(dict(_fields(a.get(2))).get(1)))
                return max(0.0, d.get(1, 0) + d.get(2, 0) / 1e9)
    return None


def retry_after_s(value: str | None) -> float | None:
    """An HTTP ``Retry-After``: delay-seconds or an HTTP-date (RFC 9110); None if unreadable."""
    v = (value or "").strip()
    if v.isascii() and v.isdigit():  # "²" is a digit to str.isdigit(), not to float()
        return float(v)
    try:
        when = email.utils.parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError, OverflowError):  # year 99999999999999999999
        return None
    if when.tzinfo is None:  # "-0000": UTC, no zone said
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - time.time())


#: TLS errors that are a connection cut short (retried, as a reset is); any other (a certificate
#: not trusted, a protocol the receiver does not speak) is the configuration's.
_TLS_CUT = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)

#: grpcio's words (under UNAVAILABLE) for a handshake that fails: a certificate not trusted, and
#: one for another host (its own check; retried, it held each export for the whole timeout).
_GRPC_TLS = ("SSL_ERROR_SSL", "Hostname Verification Check failed", "is not in peer certificate")

#: The most of an answer read: an OTLP response is a few bytes; an endpoint that streams on
#: (not a collector) held the sender, and with it every span after, for good.
_BODY_MAX = 1 << 20


def _readable(sock: socket.socket) -> bool:
    """Data or EOF waiting on an idle keep-alive (poll: select() refuses an fd past 1023)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(0))


class HttpSender:
    """OTLP/HTTP on one keep-alive ``http.client`` connection (protobuf or JSON bodies)."""

    def __init__(self, cfg: OtlpConfig, *, json: bool = False) -> None:
        u = urlsplit(cfg.endpoint)
        self.url, self.timeout_s, self._json = shown_url(cfg.endpoint), cfg.timeout_s, json
        addr = (u.hostname or "localhost", u.port or (443 if u.scheme == "https" else 80))
        self._path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        self._connect: Any = partial(http.client.HTTPConnection, *addr)
        if u.scheme == "https":
            ctx = ssl.create_default_context(cafile=cfg.certificate)
            if cfg.client_certificate:
                ctx.load_cert_chain(cfg.client_certificate, cfg.client_key)
            self._connect = partial(http.client.HTTPSConnection, *addr, context=ctx)
        self._gzip = cfg.compression == "gzip"
        ct = "application/json" if json else "application/x-protobuf"
        gz = {"Content-Encoding": "gzip"} if self._gzip else {}
        mine = {k.lower() for k, _ in cfg.headers}  # a name of theirs, in any case, replaces ours
        ours = {"Content-Type": ct, "User-Agent": _AGENT, **gz}
        self._headers = {
            **{k: v for k, v in ours.items() if k.lower() not in mine},
            **dict(cfg.headers),
        }
        self._conn: http.client.HTTPConnection | None = None

    def _post(self, body: bytes, timeout_s: float) -> tuple[http.client.HTTPResponse, bytes]:
        c = self._conn
        if c is not None and c.sock is not None and _readable(c.sock):
            self.close()  # readable while idle: the receiver closed it (Go's servers do), so a
            c = None  # new one now, not a failed send and a backoff (nothing is sent twice)
        if c is None:
            c = self._conn = self._connect(timeout=timeout_s)
        elif c.sock is not None:
            c.sock.settimeout(timeout_s)
        c.request("POST", self._path, body=body, headers=self._headers)
        r = c.getresponse()
        return r, r.read(_BODY_MAX)

    def send(self, payload: bytes, timeout_s: float) -> Partial:
        body = gzip.compress(payload, compresslevel=5) if self._gzip else payload
        try:
            r, data = self._post(body, timeout_s)
        except BaseException as exc:
            self.close()
            if isinstance(exc, ssl.SSLError) and not isinstance(exc, _TLS_CUT):  # a certificate
                raise SendError(repr(exc)) from None
            if isinstance(exc, (OSError, http.client.HTTPException)):  # refused, reset, closed
                raise Retry(repr(exc), refused=isinstance(exc, ConnectionRefusedError)) from None
            raise
        if r.will_close or not r.isclosed():  # not closed: more left unread, cannot carry another
            self.close()
        if 200 <= r.status < 300:
            if not self._json:
                return partial_success(data)
            try:
                ps = json.loads(data or b"{}")["partialSuccess"]
                return int(ps.get("rejectedSpans", 0)), _text(
                    str(ps.get("errorMessage", "")).encode()
                )
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                return 0, ""
        msg = f"HTTP {r.status} {status_message(data, self._json)}"
        if r.status in (301, 302, 303, 307, 308):  # an ingress sending http to https, say
            msg += (
                f" to {shown_url(r.getheader('Location') or '?')} (not followed: set the endpoint)"
            )
        if r.status in RETRY_HTTP:
            raise Retry(msg, retry_after_s(r.getheader("Retry-After")))
        raise SendError(msg)

    def abort(self) -> None:
        """Shut the socket down: the sender's own thread sees the error and closes it."""
        with contextlib.suppress(AttributeError, OSError):  # no connection (yet), or closed
            getattr(self._conn, "sock").shutdown(socket.SHUT_RDWR)  # noqa: B009

    def close(self) -> None:
        c, self._conn = self._conn, None
        if c is not None:
            c.close()

    def after_fork(self) -> None:
        """In a forked child: the next request opens its own connection."""
        self._conn = None


class GrpcSender:
    """OTLP/gRPC through grpcio's generic unary call: our bytes go out as they are."""

    def __init__(self, cfg: OtlpConfig) -> None:
        import grpc  # lazily: only the gRPC protocol needs it

        self._grpc = grpc
        self.url, self.timeout_s = cfg.endpoint, cfg.timeout_s
        # grpcio's retries off (ours run); its reconnect backoff capped (~2.4 s): grown to 120 s,
        # every export failed fast until the next attempt (12 s of drops after a 30 s outage).
        opt: list[tuple[str, Any]] = [("grpc.max_send_message_length", 64 << 20)]
        opt += [("grpc.enable_retries", 0), ("grpc.primary_user_agent", _AGENT)]  # spec's UA
        opt += [("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]
        opt += [("grpc.min_reconnect_backoff_ms", 500)]  # before grpcio 1.80 its 20 s held too
        comp = grpc.Compression.Gzip if cfg.compression == "gzip" else None  # None: uncompressed
        if cfg.secure:
            pems = (cfg.certificate, cfg.client_key, cfg.client_certificate)
            creds = grpc.ssl_channel_credentials(*(p and Path(p).read_bytes() for p in pems))
            ch = grpc.secure_channel(cfg.endpoint, creds, options=opt, compression=comp)
        else:
            ch = grpc.insecure_channel(cfg.endpoint, options=opt, compression=comp)
        self._channel, method = ch, "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
        self._call = ch.unary_unary(method)  # no (de)serializer: bytes in, bytes out
        self._metadata = tuple((k.lower(), v) for k, v in cfg.headers) or None

    def send(self, payload: bytes, timeout_s: float) -> Partial:
        try:
            return partial_success(self._call(payload, timeout=timeout_s, metadata=self._metadata))
        except self._grpc.RpcError as exc:
            code = exc.code()
            trailers = dict(exc.trailing_metadata() or ())
            after = retry_info_s(trailers.get("grpc-status-details-bin", b""))
            msg = f"grpc {code} {exc.details()}"
            if any(m in msg for m in _GRPC_TLS):  # UNAVAILABLE to grpcio; to OTLP a failed TLS
                raise SendError(msg + " (a TLS handshake: not retried)") from None
            if code.name in RETRY_GRPC or (code.name == "RESOURCE_EXHAUSTED" and after is not None):
                # No connection (grpcio 1.60..1.85 word it alike; a relay that forwards these words
                # has no upstream either). Not the channel's state: subscribe()'s thread raised
                # into threading.excepthook when the channel closed under it.
                refused = "failed to connect to all addresses" in msg
                raise Retry(msg, after or None, refused) from None  # RetryInfo 0: back off
            raise SendError(msg) from None

    def abort(self) -> None:
        self._channel.close()  # cancels the call in flight

    def after_fork(self) -> None:
        why = "grpcio channels survive fork only with GRPC_ENABLE_FORK_SUPPORT=1 set before grpc"
        why += " is imported; http/protobuf has no such limit (OTEL_EXPORTER_OTLP_PROTOCOL)"
        say_once("otlp-grpc-fork", f"OTLP/gRPC in a forked child: {why}")

    close = abort


class _Local:
    timeout_s = float("inf")  # no network deadline

    def abort(self) -> None:
        """Nothing to cut short."""


class FileSender(_Local):
    """Appends each request as one line to a file (:class:`memra_obs.linewriter.AppendFile`:
    shared by workers, rotated at ``max_bytes`` to ``<path>.1``, one previous file kept)."""

    def __init__(self, path: str, max_bytes: int = 0) -> None:
        self.path = os.path.abspath(path)
        mib = f"{max_bytes >> 20} MiB" if max_bytes % (1 << 20) == 0 else f"{max_bytes} bytes"
        self._file = AppendFile(self.path, max_bytes)
        self._file.open()  # OSError now (no directory, no permission); no lock: never waits
        rotates = f" (rotates at {mib}, keeps one previous file)" if max_bytes else ""
        if max_bytes and not self._file.rotates():
            rotates = " (a link or not a regular file: never rotated)"
        self.url = self.path + rotates

    def send(self, payload: bytes, timeout_s: float = 0.0) -> Partial:
        try:
            self._file.append(payload + b"\n")
        except OSError as exc:
            raise SendError(repr(exc)) from None
        return 0, ""

    def close(self) -> None:
        self._file.close()


class SdkSender(_Local):
    """The slow, universal path: ReadableSpans handed to an SDK ``SpanExporter`` (its own
    retries), built on the sender thread, one ``export()`` a request of at most :attr:`chunk`
    spans after a short sleep (the loop's GIL): its result is that request's, whole."""

    chunk = 64

    def __init__(
        self, exporter: Any, resource: Any, scope: Any, renew_instance: bool = True
    ) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self.url, self.exporter = type(exporter).__name__, exporter
        flags = TraceFlags(TraceFlags.SAMPLED)
        same = {"resource": resource, "kind": SpanKind.INTERNAL, "instrumentation_scope": scope}

        def readable(sp: Span) -> Any:
            name, tid, sid, pid, start, end, attrs, st = sp  # st: None or (STATUS_ERROR, msg)
            return ReadableSpan(
                name,
                context=SpanContext(tid, sid, False, flags),
                parent=SpanContext(tid, pid, False, flags) if pid else None,
                attributes=dict(attrs),
                status=Status(StatusCode.ERROR, st[1] or None) if st else Status(),
                start_time=start,
                end_time=end,
                **same,
            )

        self.readable, self._ok, self._same = readable, SpanExportResult.SUCCESS, same
        self._renew = renew_instance and INSTANCE in resource.attributes

    def after_fork(self) -> None:
        """A forked child's spans under a ``service.instance.id`` of its own, as the encoders'."""
        if self._renew:
            res = self._same["resource"]
            attrs = {**res.attributes, INSTANCE: instance_id()}
            self._same["resource"] = type(res)(attrs, res.schema_url)

    def send(self, payload: Sequence[Span], timeout_s: float = 0.0) -> Partial:
        time.sleep(0.0005)
        res = self.exporter.export([self.readable(sp) for sp in payload])
        if res != self._ok:
            raise SendError(f"export() returned {res}")
        return 0, ""

    def close(self) -> None:
        self.exporter.shutdown()
