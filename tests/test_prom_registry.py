"""Your own registry: an application that serves its own prometheus_client registry gets every
memra_obs family by passing that registry in — through prometheus_client's own servers
(start_http_server, make_wsgi_app under wsgiref, make_asgi_app), with exemplars in OpenMetrics."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    generate_latest,
    make_asgi_app,
    make_wsgi_app,
    start_http_server,
)
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_om
from prometheus_client.parser import text_string_to_metric_families as parse_text

import memra_obs
from memra_obs.export import QueueSink
from memra_obs.prom import PrometheusExporter
from memra_obs.records import FIRST_TOKEN_MS_FIELDS, SpecFirstTokenProf
from memra_obs.timeline import FirstTokenRecord, RoundRecord, SessionRecord

OM = "application/openmetrics-text; version=1.0.0"
TRACE = 0x5B8EFFF798038103D269B633813FC60C


@pytest.fixture
def app_registry() -> CollectorRegistry:
    """The application's registry, with its own metric and every memra_obs series in it."""
    reg = CollectorRegistry()
    Counter("app_requests", "The app's own requests.", registry=reg).inc()
    prom = PrometheusExporter(reg)  # the one thing an app does: pass its registry
    prom.attach_queue(QueueSink([prom], start=False))
    t = [10**9 + i * 10**6 for i in range(6)]
    prof = SpecFirstTokenProf(
        **{f: 1.0 for f in FIRST_TOKEN_MS_FIELDS}, free_mb_before=[(0, 8)], free_mb_after=[(0, 4)]
    )
    prom.export(
        [
            SessionRecord(1, "glm5", "t", "tv", "w", 0, 0, 1_700_000_000 * 10**9, TRACE, 2, 0, 2, True),
            RoundRecord(1, 0, 0, tuple(t), 4, 2, 100, 1, (10**5, 10**4, 10**5, 10**4)),  # type: ignore[arg-type]
            FirstTokenRecord(1, prof, (("prime", 0, 10**9),)),
        ]
    )  # fmt: skip
    # Enough drafting rounds for the k advisor's gauges (MIN_ROUNDS), k varying.
    more = []
    for i in range(1, 41):
        k, b = 1 + i % 4, 10**9 + i * 10**7
        t = (
            b,
            b + 10**5 * k,
            b + 10**6 + 10**5 * k,
            *(b + 10**6 + 10**5 * k + d for d in (1, 2, 3)),
        )
        more.append(RoundRecord(1, 0, i, t, k, i % (k + 1), 100, 0, None))
    prom.export(more)
    prom.flush()
    return reg


def expected_samples(reg: CollectorRegistry) -> set[str]:
    """Every sample name of every memra_obs family, and the app's own counter."""
    prom = PrometheusExporter(CollectorRegistry())
    out = {"app_requests_total"}
    for f in prom.families.values():
        if f.kind == "histogram":
            out |= {f.name + "_bucket", f.name + "_count", f.name + "_sum"}
        else:
            out.add(f.name + "_total" if f.kind == "counter" else f.name)
    return out


def samples(text: str, om: bool = False) -> set[str]:
    fams = parse_om(text) if om else parse_text(text)
    return {s.name for f in fams for s in f.samples}


def get(url: str, accept: str = "") -> str:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def test_start_http_server_serves_every_family(app_registry: CollectorRegistry) -> None:
    """prometheus_client's start_http_server on the app's registry: all families, exemplars."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=app_registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert expected_samples(app_registry) <= samples(get(url))
        om = get(url, OM)
        assert expected_samples(app_registry) <= samples(om, om=True)
        assert f'trace_id="{TRACE:032x}"' in om
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def wsgi_url(app_registry: CollectorRegistry) -> Iterator[str]:
    httpd = make_server("127.0.0.1", 0, make_wsgi_app(app_registry), handler_class=_Quiet)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/metrics"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_make_wsgi_app_under_wsgiref_serves_every_family(
    app_registry: CollectorRegistry, wsgi_url: str
) -> None:
    """make_wsgi_app (what Flask/Django mount) under wsgiref: all families, both formats."""
    assert expected_samples(app_registry) <= samples(get(wsgi_url))
    om = get(wsgi_url, OM)
    assert expected_samples(app_registry) <= samples(om, om=True)
    assert f'trace_id="{TRACE:032x}"' in om


def asgi_get(app: object, accept: str = "") -> tuple[int, str]:
    """One GET through an ASGI app, called directly (what uvicorn would do for FastAPI)."""
    sent: list[dict[str, object]] = []
    scope = {
        "type": "http", "method": "GET", "path": "/metrics", "query_string": b"",
        "headers": [(b"accept", accept.encode())] if accept else [],
    }  # fmt: skip

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))  # type: ignore[operator]
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")  # type: ignore[misc]
    return int(status), body.decode()  # type: ignore[call-overload]


def test_make_asgi_app_serves_every_family(app_registry: CollectorRegistry) -> None:
    """make_asgi_app (FastAPI: app.mount("/metrics", make_asgi_app(registry))): all families."""
    app = make_asgi_app(app_registry)
    status, text = asgi_get(app)
    assert status == 200 and expected_samples(app_registry) <= samples(text)
    status, om = asgi_get(app, OM)
    assert status == 200 and expected_samples(app_registry) <= samples(om, om=True)
    assert f'trace_id="{TRACE:032x}"' in om


@pytest.mark.parametrize("addr", ["", "127.0.0.1:0"])
def test_configure_replacing_an_observer_on_the_registry_says_nothing(addr, caplog, monkeypatch):
    """``configure(sinks="prometheus", registry=reg)`` again (README, "Your own registry")
    built the new exporter while the old observer was still live, so the take-over warning
    meant for two live observers on one registry was said for the one configure() replaces."""
    monkeypatch.setattr(memra_obs, "_observer", None)
    reg = CollectorRegistry()
    try:
        for _ in range(3):
            memra_obs.configure(level=0, prof=False, sinks="prometheus", metrics_addr=addr,
                                registry=reg, env={})  # fmt: skip
        assert "no longer published" not in caplog.text
        assert b"memra_spec_rounds_total" in generate_latest(reg)
    finally:
        memra_obs.get_observer().shutdown()


def test_a_registry_that_has_the_names_costs_the_metrics_only(monkeypatch, caplog):
    """A registry with a ``memra_*`` name already (an app's own metric, a second copy of
    memra_obs, ``importlib.reload``): ``configure()`` raised DuplicateTimeseries and the process
    lost its spans and lines too. Said once; the observer runs without the prometheus sink."""
    from memra_obs.observer import Observer

    monkeypatch.setattr(memra_obs, "_observer", None)
    reg = CollectorRegistry()
    Counter("memra_spec_rounds", "an app's own, by chance", registry=reg)
    try:
        obs = memra_obs.configure(level=1, prof=False, sinks="prometheus", metrics_addr="",
                                  registry=reg, env={})  # fmt: skip
        assert type(obs) is Observer and obs.level == 1  # its lines go on
        assert caplog.text.count("the prometheus sink cannot join the registry") == 1
        assert "memra_spec_rounds_total" in caplog.text
    finally:
        memra_obs.get_observer().shutdown()
