"""``/metrics`` on a background thread: loopback by default, optional TLS and basic auth.

The WSGI app answers like prometheus_client's own (any path; GET; ``?name[]=`` filters;
gzip when asked) but renders through :func:`memra_obs.prom.exposition.encode`. TLS is the
standard library's, configured the way prometheus_client's ``start_http_server`` does it,
except that the handshake runs on the request's own thread (not in the accept loop, where
one slow client would stall every scrape) under the connection timeout.
"""

from __future__ import annotations

import base64
import hmac
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY
from prometheus_client.exposition import ThreadingWSGIServer, gzip_accepted

from .exposition import encode

__all__ = ["MetricsServer", "metrics_app", "require_basic_auth", "serve_metrics"]

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

#: Seconds a connection may take to send its request (and finish a TLS handshake).
CONNECTION_TIMEOUT_S = 10.0


def metrics_app(registry: Any = None) -> WSGIApp:
    """A WSGI app serving ``registry``'s exposition, content-negotiated."""
    reg = REGISTRY if registry is None else registry

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method == "OPTIONS":
            start_response("200 OK", [("Allow", "OPTIONS,GET")])
            return [b""]
        if method != "GET":
            start_response("405 Method Not Allowed", [("Allow", "OPTIONS,GET")])
            return [f"# HTTP 405 Method Not Allowed: {method}; use OPTIONS or GET\n".encode()]
        if environ.get("PATH_INFO") == "/favicon.ico":
            start_response("200 OK", [])
            return [b""]
        body, headers = encode(
            reg,
            environ.get("HTTP_ACCEPT"),
            gzip_ok=gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")),
            params=parse_qs(environ.get("QUERY_STRING", "")),
        )
        start_response("200 OK", headers)
        return [body]

    return app


def require_basic_auth(app: WSGIApp, user: str, password: str, realm: str = "memra-obs") -> WSGIApp:
    """Wrap ``app``: 401 unless the request carries these credentials (RFC 7617)."""
    want = base64.b64encode(f"{user}:{password}".encode()).decode("ascii").encode()
    challenge = [
        ("WWW-Authenticate", f'Basic realm="{realm}", charset="UTF-8"'),
        ("Content-Type", "text/plain; charset=utf-8"),
    ]

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        scheme, _, cred = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        # compare_digest: the time taken says nothing about how much of a guess matched.
        if scheme.lower() == "basic" and hmac.compare_digest(cred.strip().encode(), want):
            return app(environ, start_response)
        start_response("401 Unauthorized", challenge)
        return [b"401 Unauthorized\n"]

    return guarded


class _Handler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


class _Server(ThreadingWSGIServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up or failed its TLS handshake; the next scrape retries


class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it and frees the port."""

    def __init__(self, httpd: _Server, thread: threading.Thread, host: str, tls: bool) -> None:
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port: int = httpd.server_address[1]
        self.scheme = "https" if tls else "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(5.0)
        self._httpd.server_close()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tls_context(certfile: str, keyfile: str, client_cafile: str | None = None) -> ssl.SSLContext:
    """Server TLS (1.2+); with ``client_cafile``, clients must present a certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile=certfile, keyfile=keyfile)
    if client_cafile:
        ctx.load_verify_locations(cafile=client_cafile)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def serve_metrics(
    addr: tuple[str, int] | str = ("127.0.0.1", 9464),
    registry: Any = None,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
    client_cafile: str | None = None,
    basic_auth: tuple[str, str] | None = None,
) -> MetricsServer:
    """Serve ``registry`` on ``addr`` (``(host, port)`` or ``"host:port"``; port 0 = any free
    port, read it back from ``.port``) on a daemon thread.

    ``certfile`` + ``keyfile`` turn on TLS (``client_cafile`` adds client-certificate checks);
    ``basic_auth=(user, password)`` requires those credentials. Loopback is the default:
    exposing ``/metrics`` is a decision (``0.0.0.0:9464``), best made with TLS and auth on.
    """
    if isinstance(addr, str):
        from ..environment import parse_addr

        parsed = parse_addr("addr", addr)
        if parsed is None:
            raise ValueError("serve_metrics: empty address")
        addr = parsed
    host, port = addr
    if bool(certfile) != bool(keyfile):
        raise ValueError("serve_metrics: certfile and keyfile go together (TLS needs both)")
    app = metrics_app(registry)
    if basic_auth is not None:
        user, password = basic_auth
        if not user:
            raise ValueError("serve_metrics: basic_auth needs a non-empty user")
        app = require_basic_auth(app, user, password)
    # The address family follows the host (an IPv6 literal binds AF_INET6), as in
    # prometheus_client.
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("_MetricsServer", (_Server,), {"address_family": info[0]})
    httpd: _Server = make_server(str(info[4][0]), port, app, server_class, handler_class=_Handler)
    tls = bool(certfile and keyfile)
    if certfile and keyfile:
        try:
            ctx = tls_context(certfile, keyfile, client_cafile)
        except BaseException:
            httpd.server_close()
            raise
        httpd.socket = ctx.wrap_socket(
            httpd.socket, server_side=True, do_handshake_on_connect=False
        )
    t = threading.Thread(target=httpd.serve_forever, name="memra-obs-metrics", daemon=True)
    t.start()
    return MetricsServer(httpd, t, host, tls)
