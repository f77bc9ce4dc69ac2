"""The compose stack's collector (exporters/collector.yaml) run for real between the demo and
the peers: OTLP in, traces to Jaeger whole, span metrics into Prometheus 3's OTLP receiver."""

from __future__ import annotations

from pathlib import Path

import pytest
from peerlib import (
    ROOT,
    Collector,
    Jaeger,
    Procs,
    Prometheus,
    check_against_legacy,
    clean_env,
    collect_traces,
    demo_result,
    memra_obs,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_single_host_collector_forwards_whole_traces_and_span_metrics(
    protocol: str, peer_bins: dict[str, str], jaeger: Jaeger, procs: Procs, tmp_path: Path
):
    """Through exporters/collector.yaml every demo session reaches Jaeger as a whole trace,
    and its span metrics reach Prometheus: one spec.session call per session."""
    prom = Prometheus(peer_bins["prometheus"], procs, tmp_path, otlp=True).start()
    col = Collector(
        peer_bins["otelcol"],
        procs,
        ROOT / "exporters" / "collector.yaml",
        OTELCOL_JAEGER_ENDPOINT=jaeger.otlp_grpc,
        OTELCOL_PROMETHEUS_OTLP_ENDPOINT=prom.otlp_metrics,
    ).start()
    service = "peer-host-" + protocol.replace("/", "-")
    endpoint = col.otlp_http if protocol.startswith("http") else f"http://{col.otlp_grpc}"
    p = procs.start(
        "demo",
        memra_obs("demo", "--requests", "4", "--seed", "3", "--speed", "5"),
        clean_env(
            MEMRA_OBS_METRICS_ADDR="127.0.0.1:0",
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
            OTEL_SERVICE_NAME=service,
        ),
    )
    assert procs.wait(p, 120) == 0, procs.tail(p)
    run = demo_result(procs.log(p))
    check_against_legacy(collect_traces(jaeger, service, run.sessions), run)

    def sessions() -> float:
        q = f'sum(traces_span_metrics_calls_total{{span_name="spec.session",service_name="{service}"}})'
        res = prom.query(q)
        return float(res[0]["value"][1]) if res else 0.0

    # The connector flushes every 15 s (metrics_flush_interval).
    assert wait_for("span metrics in Prometheus", lambda: sessions() >= run.sessions, 60, 1.0)
    assert sessions() == run.sessions
    assert col.self_metric("otelcol_exporter_send_failed_spans") == 0
    assert prom.warnings() == []
