"""Prometheus publication: per-round histograms and counters, exemplars, ``/metrics``.

    prom = PrometheusExporter(registry)          # a RecordExporter behind the QueueSink
    prom.export([session_record, round_record, ...])
    server = serve_metrics(("127.0.0.1", 0), registry=prom.registry)
    server.url, server.close()

Metric names, types, labels and buckets are public interface (DESIGN §5; the README's "Prometheus metrics").
"""

from __future__ import annotations

from .buckets import (
    FIRST_TOKEN_PHASE_BUCKETS,
    PHASE_BUCKETS,
    ROUND_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
)
from .exporter import PrometheusExporter
from .exposition import encode
from .families import FIRST_TOKEN_PHASES, SPLIT_PARTS
from .server import MetricsServer, metrics_app, require_basic_auth, serve_metrics

__all__ = [
    "FIRST_TOKEN_PHASES",
    "FIRST_TOKEN_PHASE_BUCKETS",
    "PHASE_BUCKETS",
    "ROUND_BUCKETS",
    "SPLIT_PARTS",
    "TOKEN_BUCKETS",
    "TTFT_BUCKETS",
    "MetricsServer",
    "PrometheusExporter",
    "encode",
    "metrics_app",
    "require_basic_auth",
    "serve_metrics",
]
