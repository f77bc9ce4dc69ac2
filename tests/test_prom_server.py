"""``/metrics`` over HTTP: content negotiation, methods, basic auth, TLS, the setup wiring."""

from __future__ import annotations

import base64
import gzip
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from memra_obs.environment import ConfigError, Settings
from memra_obs.prom import PrometheusExporter, serve_metrics
from memra_obs.timeline import RoundRecord, SessionRecord

TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)  # what Prometheus 2.42 sends


@pytest.fixture
def reg() -> CollectorRegistry:
    r = CollectorRegistry()
    ex = PrometheusExporter(r)
    t = [
        10**9,
        10**9 + 10**6,
        10**9 + 8 * 10**6,
        10**9 + 9 * 10**6,
        10**9 + 9 * 10**6,
        10**9 + 10**7,
    ]
    ex.export(
        [
            SessionRecord(
                1, "glm5", "t", "tv", "w", 0, 0, 1_700_000_000 * 10**9, TRACE, 1, 0, 1, False
            ),
            RoundRecord(1, 0, 0, tuple(t), 4, 2, 10, 0, None),  # type: ignore[arg-type]
        ]
    )
    return r


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET", ctx=None):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
        return r.status, dict(r.headers), r.read()


def test_content_negotiation(reg):
    """Prometheus' Accept gets OpenMetrics with exemplars; a plain client gets text 0.0.4."""
    with serve_metrics(("127.0.0.1", 0), registry=reg) as srv:
        assert srv.port > 0 and srv.url == f"http://127.0.0.1:{srv.port}/metrics"
        status, h, body = get(srv.url, {"Accept": PROMETHEUS_ACCEPT})
        assert status == 200 and h["Content-Type"].startswith(
            "application/openmetrics-text; version=1.0.0"
        )
        assert body.endswith(b"# EOF\n") and f'# {{trace_id="{TRACE:032x}"}}'.encode() in body
        status, h, body = get(srv.url)
        assert h["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert b"memra_spec_rounds_total" in body and b" # {" not in body and b"# EOF" not in body


def test_gzip_methods_and_string_address(reg):
    """gzip on request; OPTIONS/405 like prometheus_client; "host:port" accepted."""
    with serve_metrics("127.0.0.1:0", registry=reg) as srv:
        _, h, body = get(srv.url, {"Accept-Encoding": "gzip"})
        assert h[
            "Content-Encoding"
        ] == "gzip" and b"memra_spec_round_seconds_bucket" in gzip.decompress(body)
        assert get(srv.url, method="OPTIONS")[1]["Allow"] == "OPTIONS,GET,HEAD"
        with pytest.raises(urllib.error.HTTPError) as e:
            get(srv.url, method="POST")
        assert e.value.code == 405


def test_close_frees_the_port(reg):
    """close() stops the thread and releases the socket."""
    srv = serve_metrics(("127.0.0.1", 0), registry=reg)
    port = srv.port
    srv.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_basic_auth(reg):
    """401 with a challenge unless the right credentials come; then the metrics."""
    with serve_metrics(("127.0.0.1", 0), registry=reg, basic_auth=("prom", "s3cret:x")) as srv:
        for auth in (None, "Basic " + base64.b64encode(b"prom:wrong").decode(), "Bearer abc"):
            with pytest.raises(urllib.error.HTTPError) as e:
                get(srv.url, {"Authorization": auth} if auth else {})
            assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith(
                'Basic realm="memra-obs"'
            )
        good = "basic " + base64.b64encode(b"prom:s3cret:x").decode()
        assert b"memra_spec_rounds_total" in get(srv.url, {"Authorization": good})[2]


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make a self-signed certificate for the TLS test")
    d = tmp_path_factory.mktemp("tls")
    crt, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return str(crt), str(key)


def test_tls_and_basic_auth(reg, cert):
    """HTTPS with a certificate the client trusts, and auth on top; plain HTTP is refused."""
    crt, key = cert
    with serve_metrics(
        ("127.0.0.1", 0), registry=reg, certfile=crt, keyfile=key, basic_auth=("u", "p")
    ) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=crt)
        auth = {
            "Authorization": "Basic " + base64.b64encode(b"u:p").decode(),
            "Accept": PROMETHEUS_ACCEPT,
        }
        status, _, body = get(srv.url, auth, ctx=ctx)
        assert status == 200 and body.endswith(b"# EOF\n")
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            get(srv.url.replace("https", "http"), auth)
        with pytest.raises(urllib.error.URLError):  # an untrusted certificate
            get(srv.url, auth, ctx=ssl.create_default_context())
        assert get(srv.url, auth, ctx=ctx)[0] == 200  # failed handshakes left it serving


def _pair(d: Path, cn: str) -> tuple[Path, Path]:
    """A fresh self-signed pair for 127.0.0.1 (EC: quick to make)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found: cannot make a self-signed certificate")
    crt, key = d / f"{cn}.crt", d / f"{cn}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", f"/CN={cn}", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(crt)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return crt, key


def test_a_renewed_certificate_is_served_without_a_restart(reg, tmp_path, caplog):
    """The pair is re-read when its files change (a renewed Secret): the first pair was
    served until it expired, every scrape then failing until a restart. A pair that does not
    load (a new certificate beside the old key) keeps the previous one, said once."""
    old, new = _pair(tmp_path, "old"), _pair(tmp_path, "new")
    crt, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(old[0], crt), shutil.copy(old[1], key)

    def scrape(ca: Path) -> int:
        return get(srv.url, ctx=ssl.create_default_context(cafile=str(ca)))[0]

    with serve_metrics(("127.0.0.1", 0), registry=reg, certfile=str(crt), keyfile=str(key)) as srv:
        assert scrape(old[0]) == 200
        shutil.copy(new[0], crt)  # half a renewal: the new certificate, the old key
        time.sleep(1.2)
        assert scrape(old[0]) == 200  # the previous pair still served
        assert "do not load" in caplog.text
        shutil.copy(new[1], key)
        deadline = time.monotonic() + 5
        while True:
            try:
                assert scrape(new[0]) == 200
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the renewed pair was never served"
                time.sleep(0.2)
        with pytest.raises(urllib.error.URLError):
            scrape(old[0])


def test_a_tls_client_gone_mid_answer_prints_nothing(reg, cert, capsys):
    """A TLS client that does not read its answer is hung up at its deadline: quietly, as on
    plain HTTP (main: wsgiref printed ssl.SSLEOFError's traceback on the serving process'
    stderr for each one, a client resetting after its request included, auth or not)."""

    class Big:
        def collect(self):
            yield GaugeMetricFamily("big", "x" * 4_000_000, value=1)

    reg.register(Big())
    ctx = ssl.create_default_context(cafile=cert[0])
    kw = {"certfile": cert[0], "keyfile": cert[1], "timeout_s": 0.3}
    with serve_metrics(("127.0.0.1", 0), registry=reg, **kw) as srv:
        base, clients = threading.active_count(), []
        for _ in range(3):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # it never reads
            s.connect(("127.0.0.1", srv.port))
            clients.append(ctx.wrap_socket(s, server_hostname="127.0.0.1"))
            clients[-1].sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        t0 = time.monotonic()
        while threading.active_count() > base and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        for c in clients:
            c.close()
    assert "Traceback" not in capsys.readouterr().err


def test_tls_needs_cert_and_key(reg, cert):
    """A certificate without its key is refused at start-up."""
    with pytest.raises(ValueError, match="certfile and keyfile"):
        serve_metrics(("127.0.0.1", 0), registry=reg, certfile=cert[0])


def test_knobs(tmp_path: Path, cert):
    """MEMRA_OBS_METRICS_TLS_* and MEMRA_OBS_METRICS_BASIC_AUTH_FILE parse, or fail naming the variable."""
    auth = tmp_path / "auth"
    auth.write_text("prom:pa:ss\n")
    st = Settings.resolve(
        {
            "MEMRA_OBS_METRICS_TLS_CERT": cert[0],
            "MEMRA_OBS_METRICS_TLS_KEY": cert[1],
            "MEMRA_OBS_METRICS_BASIC_AUTH_FILE": str(auth),
        }
    )
    assert (st.metrics_tls_cert, st.metrics_tls_key, st.metrics_basic_auth) == (
        cert[0],
        cert[1],
        ("prom", "pa:ss"),
    )
    assert "pa:ss" not in repr(st)
    with pytest.raises(ConfigError, match="MEMRA_OBS_METRICS_TLS_CERT"):
        Settings.resolve({"MEMRA_OBS_METRICS_TLS_CERT": str(tmp_path / "missing.pem")})
    auth.write_text("no-colon\n")
    with pytest.raises(ConfigError, match="MEMRA_OBS_METRICS_BASIC_AUTH_FILE"):
        Settings.resolve({"MEMRA_OBS_METRICS_BASIC_AUTH_FILE": str(auth)})


def test_basic_auth_over_plain_http_off_loopback_is_said(tmp_path: Path, monkeypatch):
    """``MEMRA_OBS_METRICS_BASIC_AUTH_FILE`` without TLS on an address other hosts reach sent
    the password readable, unsaid; said once (loopback, or with TLS: nothing to say)."""
    import types

    from memra_obs import prom, wiring
    from memra_obs.wiring import build_exporters

    said: list[str] = []
    monkeypatch.setattr(wiring, "say_once", lambda key, msg, kind="": said.append(msg))
    # No socket bound off loopback: the server stands in (its address is all that is read).
    monkeypatch.setattr(prom, "serve_metrics", lambda addr, **kw: types.SimpleNamespace(
        port=addr[1] or 9464, url=f"http://{addr[0]}/metrics", close=lambda: None))  # fmt: skip
    auth = tmp_path / "auth"
    auth.write_text("prom:pw\n")
    for addr, warned in (("0.0.0.0:0", True), ("127.0.0.1:0", False)):
        said.clear()
        env = {"MEMRA_OBS_METRICS_BASIC_AUTH_FILE": str(auth), "MEMRA_OBS_METRICS_ADDR": addr,
               "MEMRA_OBS_SINKS": "prometheus"}  # fmt: skip
        st = Settings.resolve(env)
        built = build_exporters(st, registry=CollectorRegistry(), env=env)
        try:
            plain = [m for m in said if "basic auth over plain HTTP" in m]
            assert len(plain) == int(warned), said
            if warned:
                assert "MEMRA_OBS_METRICS_TLS_CERT" in plain[0]
        finally:
            built.close()


def test_build_observer_serves_and_attaches_the_queue(tmp_path: Path, cert):
    """setup wiring: sinks=prometheus serves /metrics (TLS + auth from knobs) with self-metrics."""
    from memra_obs.wiring import build_observer

    auth = tmp_path / "auth"
    auth.write_text("u:p\n")
    reg = CollectorRegistry()
    env = {
        "MEMRA_OBS_METRICS_TLS_CERT": cert[0],
        "MEMRA_OBS_METRICS_TLS_KEY": cert[1],
        "MEMRA_OBS_METRICS_BASIC_AUTH_FILE": str(auth),
    }
    obs = build_observer(
        level=0, prof=False, registry=reg, env=env, sinks="prometheus", metrics_addr="127.0.0.1:0"
    )
    try:
        url = next(w for w in obs.where if w.startswith("/metrics on ")).split()[-1]
        hdr = {"Authorization": "Basic " + base64.b64encode(b"u:p").decode()}
        body = get(url, hdr, ctx=ssl.create_default_context(cafile=cert[0]))[2]
        assert b'memra_obs_dropped_total{signal="records"} 0.0' in body
        assert b'memra_obs_export_errors_total{signal="metrics"} 0.0' in body
        with pytest.raises(ConfigError, match="MEMRA_OBS_METRICS_TLS_KEY"):
            build_observer(
                registry=CollectorRegistry(), env={"MEMRA_OBS_METRICS_TLS_CERT": cert[0]},
                sinks="prometheus", metrics_addr="127.0.0.1:0",
            )  # fmt: skip
    finally:
        obs.shutdown()


def test_slow_clients_are_bounded_in_time_and_number(reg):
    """Issue 13: slow-drip clients (a byte now and then, never a whole request) are hung up
    timeout_s after they connected, at most max_connections are open (a new one closes the
    oldest), and a scrape still gets through (main: a thread per client, held forever)."""
    import threading
    import time

    def threads_settle_to(most: int, until: float) -> int:
        """The thread count above ``base`` once it is at most ``most`` (polled until ``until``:
        hung-up threads take a moment to end on a busy host), else the last one seen."""
        while (n := threading.active_count() - base) > most and time.monotonic() < until:
            time.sleep(0.01)
        return n

    timeout_s = 2.0
    with serve_metrics(
        ("127.0.0.1", 0), registry=reg, timeout_s=timeout_s, max_connections=4
    ) as srv:
        base = threading.active_count()
        t_first = time.monotonic()  # no drip's timeout ends before t_first + timeout_s
        drips = []
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"G")
            drips.append(s)
        # The scrape's connection is accepted after the 40 drips' (one listening queue): once it
        # is served, each drip has had its thread, and all but the last 4 were hung up at once.
        assert get(srv.url)[0] == 200
        # The cap, plus one hanging up; a server without it holds a thread for each of the 40
        # until their timeout, so this is polled only until well before the first one ends.
        most = threads_settle_to(4 + 1, t_first + timeout_s - 0.5)
        assert most <= 4 + 1, f"{most} connection threads for a cap of 4"
        t0 = time.monotonic()
        for s in drips:
            s.settimeout(0.2)
        open_ = list(drips)
        while open_ and time.monotonic() - t0 < 3 * timeout_s:
            for s in list(open_):
                try:
                    s.sendall(b"E")
                    if s.recv(1) == b"":
                        open_.remove(s)
                except (TimeoutError, OSError) as exc:
                    if not isinstance(exc, TimeoutError):
                        open_.remove(s)
            time.sleep(0.05)
        assert not open_, f"{len(open_)} slow clients still connected after {3 * timeout_s} s"
        # All hung up: their threads end (polled; a server that held a thread per client for
        # ever keeps 40 of them).
        assert threads_settle_to(1, time.monotonic() + 10) <= 1
        for s in drips:
            s.close()


def test_a_request_head_is_capped(reg):
    """A request's line and headers past 128 KiB get 431 (main: http.client's caps alone, 100
    lines of 64 KiB: 64 clients that never end their headers held 0.5 GB of the serving process'
    RSS for their 10 s, and again on reconnecting); an ordinary scrape is served."""
    with serve_metrics(("127.0.0.1", 0), registry=reg) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Big: %4000d\r\n" % 0 * 40 + b"\r\n")
            assert s.recv(64).startswith(b"HTTP/1.0 431 ")
        assert get(srv.url, {"X-Big": "a" * 60_000})[0] == 200


def test_a_handful_of_idle_clients_costs_no_churn(reg):
    """17 idle clients that reconnect when hung up (a mis-pointed health check, a port scanner)
    evicted each other for ever past the old cap of 16 -- ~800 accepts and threads a second,
    the serving loop 12-27% slower. The cap is 64 and the listen backlog 128: twenty idle
    clients all stay connected, and a scrape still gets through."""
    import select

    with serve_metrics(("127.0.0.1", 0), registry=reg) as srv:
        assert srv.max_connections == 64 and srv.request_queue_size == 128
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
        for s in idle:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request line, then nothing
        assert get(srv.url)[0] == 200
        hung_up = select.select(idle, [], [], 0.5)[0]  # readable: a hang-up (b"") or an answer
        assert hung_up == [] and len(srv.open) == 20
        for s in idle:
            s.close()


def test_a_busy_or_unresolvable_address_is_one_clear_error(reg):
    """Issue 13: a taken port (a second worker on the host) or a host that does not resolve
    raises MetricsAddressError (a ConfigError and an OSError) naming the address and the knob,
    and leaves no thread behind (main: a bare OSError)."""
    import errno
    import threading

    from memra_obs.prom import MetricsAddressError

    with serve_metrics(("127.0.0.1", 0), registry=reg) as srv:
        before = threading.active_count()
        with pytest.raises(MetricsAddressError, match=rf"127\.0\.0\.1:{srv.port} .*in use") as e:
            serve_metrics(f"127.0.0.1:{srv.port}", registry=reg)
        assert "MEMRA_OBS_METRICS_ADDR" in str(e.value) and e.value.addr == ("127.0.0.1", srv.port)
        assert isinstance(e.value, ConfigError) and e.value.errno == errno.EADDRINUSE
        assert threading.active_count() == before
    with pytest.raises(MetricsAddressError, match=r"no-such-host\.invalid:9464") as e:
        serve_metrics("no-such-host.invalid:9464", registry=reg)
    assert isinstance(e.value, OSError) and "MEMRA_OBS_METRICS_ADDR" in str(e.value)


def test_bad_limits_and_ports_are_refused_before_serving(reg):
    """max_connections < 1 (every scrape was hung up unanswered), timeout_s <= 0, and a port
    past 65535 (an OverflowError from bind) are refused at once, leaving no thread behind."""
    from memra_obs.prom import MetricsAddressError

    for kw in ({"max_connections": 0}, {"timeout_s": 0.0}):
        with pytest.raises(ValueError, match="max_connections must be >= 1 and timeout_s > 0"):
            serve_metrics(("127.0.0.1", 0), registry=reg, **kw)
    with pytest.raises(MetricsAddressError, match=r"127\.0\.0\.1:70000 \(port not in 0-65535\)"):
        serve_metrics(("127.0.0.1", 70000), registry=reg)


def test_close_returns_within_a_poll_of_50_ms(reg):
    """Closing /metrics waits for the serve loop's poll: 50 ms at most (it was 0.5 s), so an
    observer's ``shutdown(t)`` keeps its ``t`` with /metrics served."""
    import time

    for _ in range(5):
        srv = serve_metrics(("127.0.0.1", 0), registry=reg)
        t0 = time.monotonic()
        srv.close()
        assert time.monotonic() - t0 < 0.15


_OUT_OF_FDS = """
import os, resource, socket, sys, time
from prometheus_client import CollectorRegistry
from memra_obs.prom import server
calls, get_request = [0], server.MetricsServer.get_request
def counted(self):
    calls[0] += 1
    return get_request(self)
server.MetricsServer.get_request = counted
srv = server.serve_metrics("127.0.0.1:0", registry=CollectorRegistry())
client = socket.socket()  # its descriptor, made while there are some
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4,
                                            resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
client.connect(("127.0.0.1", srv.port))
client.sendall(b"GET /metrics HTTP/1.0\\r\\n\\r\\n")
time.sleep(1.0)
n = calls[0]
for fd in held:
    os.close(fd)
client.settimeout(5)
print(n, client.recv(12).decode())
"""


def test_out_of_descriptors_the_accept_loop_waits_instead_of_spinning():
    """A process out of file descriptors (EMFILE) with a scrape waiting: accept() failed at
    once, select() said ready again, and the server thread spun -- ~30,000 accepts a second,
    a CPU-bound serving loop 4x slower on the GIL. It now retries at the poll's pace (20 Hz),
    and the scrape is answered once descriptors are free."""
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _OUT_OF_FDS], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    calls, status = out.stdout.split(maxsplit=1)
    assert int(calls) < 60, f"{calls} accept attempts in 1 s"
    assert status.strip() == "HTTP/1.0 200"


def test_head_answers_gets_headers_and_a_405_says_its_type(reg):
    """HEAD (uptime checks, ``curl -I``) got 405; RFC 9110 asks a general server for it: GET's
    headers, its length, no body. A 405 had no Content-Type."""
    with serve_metrics(("127.0.0.1", 0), registry=reg) as srv:
        _, h, body = get(srv.url)
        status, hh, empty = get(srv.url, method="HEAD")
        assert status == 200 and empty == b"" and hh["Content-Type"] == h["Content-Type"]
        assert int(hh["Content-Length"]) == len(body)
        with pytest.raises(urllib.error.HTTPError) as e:
            get(srv.url, method="POST")
        assert e.value.code == 405 and e.value.headers["Content-Type"].startswith("text/plain")


def test_openmetrics_2_asked_first_gets_1_0_0_labelled_so():
    """Prometheus 3 with OpenMetricsText2.0.0 first in scrape_protocols: the 1.0.0 body came
    labelled version=2.0.0 (prometheus_client copies the version asked), and Prometheus
    refused the scrape (its openmetrics2 parser off) though 1.0.0 was listed next."""
    from memra_obs.prom.model import encode

    r = CollectorRegistry()
    PrometheusExporter(r)
    accept = ("application/openmetrics-text;version=2.0.0;escaping=allow-utf-8;q=0.6,"
              "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
              "text/plain;version=0.0.4;q=0.4")  # fmt: skip
    body, headers = encode(r, accept)
    ctype = dict(headers)["Content-Type"]
    assert ctype.startswith("application/openmetrics-text; version=1.0.0") and "2.0.0" not in ctype
    assert body.endswith(b"# EOF\n")
    _, headers = encode(r, "application/openmetrics-text;version=2.0.0")
    assert dict(headers)["Content-Type"].startswith("text/plain; version=0.0.4")
    for kept in ("application/openmetrics-text;version=1.0.0;x-version=2",
                 "application/openmetrics-text;schemaversion=2;version=1.0.0"):  # fmt: skip
        _, headers = encode(r, kept)  # another parameter's name ending in "version"
        assert dict(headers)["Content-Type"].startswith(
            "application/openmetrics-text; version=1.0.0"
        )


def test_a_name_with_ipv4_and_ipv6_binds_ipv4(reg, monkeypatch):
    """``localhost`` resolving ::1 first (Docker's /etc/hosts): bound to ::1 alone, a scrape of
    127.0.0.1 was refused, unsaid. A name with both binds its IPv4 address."""
    from memra_obs.prom import server as server_mod

    real = socket.getaddrinfo

    def v6_first(host, port, *a, **kw):
        if host == "localhost":
            six = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))
            return [six, *real("127.0.0.1", port, *a, **kw)]
        return real(host, port, *a, **kw)

    monkeypatch.setattr(server_mod.socket, "getaddrinfo", v6_first)
    with serve_metrics(("localhost", 0), registry=reg) as srv:
        assert get(f"http://127.0.0.1:{srv.port}/metrics")[0] == 200

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")

    def nat(host, port, *a, **kw):  # a cloud VM's name: its IPv4 a NAT's, not this host's
        six = (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))
        return [six, (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("203.0.113.5", port))]

    monkeypatch.setattr(server_mod.socket, "getaddrinfo", nat)
    assert Settings.resolve(env={"MEMRA_OBS_METRICS_ADDR": "vm.example:0"}).metrics_addr
    with serve_metrics(("vm.example", 0), registry=reg) as srv:  # the one that binds: ::1
        assert get(f"http://[::1]:{srv.port}/metrics")[0] == 200
    # a port in use on the IPv4 address is said, not served on ::1 instead (another rank's)
    monkeypatch.setattr(server_mod.socket, "getaddrinfo", v6_first)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(server_mod.MetricsAddressError, match="in use"):
            serve_metrics(("localhost", taken.getsockname()[1]), registry=reg)
