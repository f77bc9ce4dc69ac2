"""Prometheus publication: per-round histograms and counters, exemplars, ``/metrics``.

    prom = PrometheusExporter(registry)  # a RecordExporter behind the QueueSink: export(records)
    server = serve_metrics(("127.0.0.1", 0), registry=prom.registry)  # server.url, .close()

Names, types, labels and buckets (:mod:`.families`) are public interface (DESIGN §5).
"""

from __future__ import annotations

from .exporter import PrometheusExporter
from .families import FIRST_TOKEN_PHASES, SPLIT_PARTS
from .model import encode
from .server import MetricsAddressError, MetricsServer, metrics_app, serve_metrics

__all__ = [
    "FIRST_TOKEN_PHASES", "SPLIT_PARTS", "MetricsAddressError", "MetricsServer",
    "PrometheusExporter", "encode", "metrics_app", "serve_metrics",
]  # fmt: skip
