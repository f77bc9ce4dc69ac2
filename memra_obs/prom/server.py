"""``/metrics`` on a background thread: loopback by default, optional TLS and basic auth. No
client holds the server: TLS handshakes run on the connection's thread, a connection is closed
``timeout_s`` after it was accepted (a slow drip included), and one past ``max_connections``
closes the oldest. Goal (DESIGN §9): a full-set ``GET /metrics`` under 2 ms
(``bench/bench_prom.py``): prometheus_client's own servers would run its 4.7 / 9.0 ms encoders.
"""

from __future__ import annotations

import base64
import errno
import hmac
import http.client
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import Any, cast
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY
from prometheus_client.exposition import ThreadingWSGIServer, gzip_accepted

from ..diagnostics import forked_set, say_once
from ..environment import MEMRA_OBS_METRICS_ADDR, NOT_THIS_HOST, ConfigError, bind_order, parse_addr
from .model import encode

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
#: Seconds a connection may stay open, all told (TLS handshake, request, response).
TIMEOUT_S = 10.0
#: Connections open at once.
MAX_CONNECTIONS = 64
#: Bytes of a request's line and headers, all told (Prometheus sends under 1 KiB).
MAX_HEAD = 131072


class MetricsAddressError(ConfigError, OSError):
    """``/metrics`` cannot listen on ``addr`` (in use, unresolvable, not this host's): a
    ConfigError naming the address and ``MEMRA_OBS_METRICS_ADDR``, and an OSError (``errno``)."""

    def __init__(self, addr: tuple[str, int], exc: OSError) -> None:
        host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or exc
        super().__init__(
            f"/metrics cannot listen on {host}:{addr[1]} ({why}); set {MEMRA_OBS_METRICS_ADDR} "
            "to a free host:port (port 0: any free one) or to empty for no /metrics"
        )
        self.addr, self.errno = addr, exc.errno


def metrics_app(registry: Any = None, basic_auth: tuple[str, str] | None = None) -> WSGIApp:
    """A WSGI app serving ``registry``'s exposition, content-negotiated; with ``basic_auth=
    (user, password)``, 401 unless the request carries these credentials (RFC 7617)."""
    reg = REGISTRY if registry is None else registry
    want = base64.b64encode(":".join(basic_auth).encode()) if basic_auth else None

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method, status, headers, out = environ.get("REQUEST_METHOD", "GET"), "200 OK", [], b""
        scheme, _, cred = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        # compare_digest: the time taken says nothing about how much of a guess matched.
        if want and not (
            scheme.lower() == "basic" and hmac.compare_digest(cred.strip().encode(), want)
        ):
            status, out = "401 Unauthorized", b"401 Unauthorized\n"
            headers = [
                ("WWW-Authenticate", 'Basic realm="memra-obs", charset="UTF-8"'),
                ("Content-Type", "text/plain; charset=utf-8"),
            ]
        elif method == "OPTIONS":
            headers = [("Allow", "OPTIONS,GET,HEAD")]
        elif method not in ("GET", "HEAD"):  # (HEAD: uptime checks, curl -I; RFC 9110 9.1)
            status, out = "405 Method Not Allowed", f"# HTTP 405: {method}; use GET\n".encode()
            headers = [("Allow", "OPTIONS,GET,HEAD"), ("Content-Type", "text/plain; charset=utf-8")]
        elif environ.get("PATH_INFO") != "/favicon.ico":  # an empty answer for browsers
            accept, gz = environ.get("HTTP_ACCEPT"), environ.get("HTTP_ACCEPT_ENCODING", "")
            query = parse_qs(environ.get("QUERY_STRING", ""))
            out, headers = encode(reg, accept, gzip_ok=gzip_accepted(gz), params=query)
        if method == "HEAD":  # GET's headers, its length included, and no body
            headers = [*headers, ("Content-Length", str(len(out)))]
            out = b""
        start_response(status, headers)
        return [out]

    return app


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None: ...  # a scrape is not news

    def setup(self) -> None:
        super().setup()
        self.wfile = cast(Any, _QuietWriter(self.wfile))
        self.rfile = cast(Any, _HeadCap(self.rfile))


class _Wrapped:
    def __init__(self, f: Any) -> None:
        self.f = f

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


class _QuietWriter(_Wrapped):
    """The answer's writer: a TLS peer gone mid-answer (hung up at its deadline, or reset)
    raises what wsgiref drops quietly for a plain socket, not an SSLError it prints a traceback
    of on the serving process' stderr."""

    def write(self, b: bytes) -> int:
        try:
            return int(self.f.write(b))
        except ssl.SSLError as exc:
            raise ConnectionAbortedError(str(exc)) from exc


class _HeadCap(_Wrapped):
    """The request's reader: a head (request line and headers) past MAX_HEAD bytes gets 431
    (http.client alone lets each connection hold 100 lines of 64 KiB: 6.5 MB, 0.4 GB for 64)."""

    left = MAX_HEAD

    def readline(self, size: int = -1) -> bytes:
        line = bytes(self.f.readline(size))
        self.left -= len(line)
        if self.left < 0:
            raise http.client.LineTooLong("request head")
        return line


class _Tls:
    """The certificate pair as its files hold it now, for each new connection: re-read when
    they change (checked at most once a second), so a renewed Secret (cert-manager, a
    rotated pair) is served without a restart (the first pair was served until it expired);
    a pair that does not load keeps the previous one, said once."""

    def __init__(self, certfile: str, keyfile: str, cafile: str | None) -> None:
        self.files, self.cafile, self.due = (certfile, keyfile), cafile, 0.0
        self.seen, self.ctx = self._stamp(), self._load()  # raises at start-up

    def _stamp(self) -> tuple[Any, ...]:
        """What changes when a file is rewritten or replaced (a Secret swaps a link)."""
        out: list[Any] = []
        for f in self.files:
            try:
                st = os.stat(f)
                out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def _load(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(*self.files, b"")  # an encrypted key: an error, never a prompt
        if self.cafile:
            ctx.load_verify_locations(cafile=self.cafile)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def context(self) -> ssl.SSLContext:
        if (now := time.monotonic()) >= self.due:
            self.due, stamp = now + 1.0, self._stamp()
            if stamp != self.seen:
                self.seen = stamp
                try:
                    self.ctx = self._load()
                except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                    say_once(f"tls-reload:{self.files}:{stamp}", f"/metrics: {self.files[0]} / "
                             f"{self.files[1]} changed but do not load as a PEM chain and its key "
                             f"({exc}); serving the previous pair until they do")  # fmt: skip
        return self.ctx


class MetricsServer(ThreadingWSGIServer):
    """A running ``/metrics`` endpoint: ``.port``, ``.url``, ``close()`` (or ``with``); the accept
    loop hangs up connections past their deadline every ``poll_interval`` (0.05 s)."""

    timeout_s, max_connections, scheme, host = TIMEOUT_S, MAX_CONNECTIONS, "http", ""
    request_queue_size = 128  # the listen backlog (socketserver's 5 dropped scrapes' SYNs)
    thread: threading.Thread | None = None
    tls: _Tls | None = None

    def get_request(self) -> tuple[Any, Any]:
        """A connection, wrapped in TLS (the handshake runs on its own thread) with the pair
        the files hold now. Out of descriptors, the pending one waits a poll (select() says
        ready at once: the thread spun, and a CPU-bound serving loop ran 4x slower)."""
        try:
            conn, addr = self.socket.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                time.sleep(0.05)
            raise
        if self.tls is not None:
            try:
                conn = self.tls.context().wrap_socket(
                    conn, server_side=True, do_handshake_on_connect=False
                )
            except BaseException:
                conn.close()
                raise
        return conn, addr

    def server_activate(self) -> None:
        self.open: dict[Any, float] = {}  # connection -> deadline (monotonic), oldest first
        self.open_lock = threading.Lock()
        super().server_activate()
        _SERVERS.add(self)

    def after_fork(self) -> None:
        """In a forked child: the port and the connections are the parent's. Our copies are
        closed (a scrape then reaches no one once the parent is gone), never shut down (which
        would cut the parent's)."""
        for conn in list(self.open):
            with suppress(OSError):
                conn.close()
        self.open, self.open_lock, self.thread = {}, threading.Lock(), None
        with suppress(OSError):
            self.socket.close()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.open_lock:
            while len(self.open) >= self.max_connections:
                oldest = next(iter(self.open))
                del self.open[oldest]
                _hang_up(oldest)
            self.open[request] = time.monotonic() + self.timeout_s
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.open_lock:
            self.open.pop(request, None)
        super().shutdown_request(request)

    def service_actions(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self.open_lock:
            late = [c for c, deadline in self.open.items() if deadline <= now]
            for c in late:
                del self.open[c]
        for c in late:
            _hang_up(c)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up, failed its handshake or ran out of time

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, hang up every connection, free the port."""
        if self.thread is not None and self.thread.is_alive():
            self.shutdown()
            self.thread.join(5.0)
        self.service_actions(now=float("inf"))
        self.server_close()

    def __exit__(self, *exc: object) -> None:
        self.close()


_SERVERS = forked_set(MetricsServer.after_fork)


def _hang_up(conn: Any) -> None:
    """Unblock whatever the connection's thread waits on; it then closes the socket."""
    with suppress(OSError):
        socket.socket.shutdown(conn, socket.SHUT_RDWR)  # the plain socket's, TLS or not


def serve_metrics(
    addr: tuple[str, int] | str = ("127.0.0.1", 9464),
    registry: Any = None,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
    client_cafile: str | None = None,
    basic_auth: tuple[str, str] | None = None,
    timeout_s: float = TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> MetricsServer:
    """Serve ``registry`` on ``addr`` (``(host, port)`` or ``"host:port"``; port 0: any free port,
    read back from ``.port``) on a daemon thread. ``certfile`` + ``keyfile`` turn on TLS 1.2+,
    re-read when the files change (``client_cafile`` requires client certificates it signed);
    ``basic_auth=(user, password)`` requires those credentials. An address it cannot listen on
    raises :class:`MetricsAddressError`, leaving no thread behind."""
    # A string is parsed, not checked: binding below says why it cannot.
    parsed = parse_addr("addr", addr, check=False) if isinstance(addr, str) else addr
    if parsed is None:
        raise ValueError("serve_metrics: empty address")
    host, port = parsed
    if bool(certfile) != bool(keyfile):
        raise ValueError("serve_metrics: certfile and keyfile go together (TLS needs both)")
    if basic_auth is not None and not basic_auth[0]:
        raise ValueError("serve_metrics: basic_auth needs a non-empty user")
    if not (max_connections >= 1 and timeout_s > 0):
        raise ValueError("serve_metrics: max_connections must be >= 1 and timeout_s > 0")
    if not 0 <= port <= 65535:  # else an OverflowError from bind()
        raise MetricsAddressError((host, port), OSError(errno.EINVAL, "port not in 0-65535"))
    app = metrics_app(registry, basic_auth)
    tls = _Tls(certfile, keyfile, client_cafile) if certfile and keyfile else None
    try:  # the address family follows the host (an IPv6 literal binds AF_INET6)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        first: OSError | None = None
        for info in bind_order(infos):  # the first address of this host's that binds
            cls = type("MetricsServer", (MetricsServer,), {"address_family": info[0]})
            try:
                srv = cast(MetricsServer, make_server(str(info[4][0]), port, app, cls, _Handler))
                break
            except OSError as exc:  # in use: said, never another family's port instead
                if exc.errno not in NOT_THIS_HOST:
                    raise
                first = first or exc
        else:
            raise first or OSError(errno.EADDRNOTAVAIL, f"{host!r}: no address")
    except OSError as exc:
        raise MetricsAddressError((host, port), exc) from exc
    srv.host, srv.timeout_s, srv.max_connections = host, timeout_s, max_connections
    try:
        if tls is not None:
            srv.scheme, srv.tls = "https", tls
        srv.thread = threading.Thread(  # polls at 20 Hz: close() (and a shutdown) within ~50 ms
            target=srv.serve_forever, args=(0.05,), name="memra-obs-metrics", daemon=True
        )
        srv.thread.start()
    except BaseException:
        srv.server_close()
        raise
    return srv
