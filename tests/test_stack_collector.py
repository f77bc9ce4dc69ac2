"""exporters/: the OpenTelemetry Collector pipelines, checked structurally (no collector binary
here): every component a pipeline names is defined and of a type the contrib distribution
ships, connectors are wired both ways, and the sampling and replay choices hold."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
import yaml
from otelcol_env import with_defaults

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "exporters").rglob("*.yaml"))

# Component types used here that otelcol-contrib ships (a typo fails here, not at startup).
# Current names only: the Collector (v0.144+) renamed otlp/otlphttp exporters to
# otlp_grpc/otlp_http, and contrib spanmetrics, loadbalancing and otlpjsonfile to
# span_metrics, load_balancing and otlp_json_file; the old names are deprecated aliases that
# log a warning at every start (found by tests/peers/, which runs these files).
KNOWN = {
    "receivers": {"otlp", "otlp_json_file", "prometheus"},
    "processors": {
        "batch",
        "memory_limiter",
        "tail_sampling",
        "resourcedetection",
        "k8sattributes",
    },
    "exporters": {"otlp_grpc", "otlp_http", "load_balancing", "debug"},
    "connectors": {"span_metrics", "forward"},
    "extensions": {"health_check", "file_storage"},
}
KINDS = ("receivers", "processors", "exporters")


def load(path: Path) -> dict:
    return with_defaults(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_pipelines_reference_defined_components(path: Path):
    """Each pipeline's receivers/processors/exporters exist, types are known, a connector is an
    exporter of one pipeline and a receiver of another, memory_limiter comes first."""
    cfg = load(path)
    for section, types in KNOWN.items():
        for name in cfg.get(section, {}) or {}:
            assert name.split("/")[0] in types, f"{section}: unknown component type {name}"
    connectors = set(cfg.get("connectors") or {})
    used_as = {"receivers": set(), "exporters": set()}
    pipelines = cfg["service"]["pipelines"]
    assert pipelines
    for pname, p in pipelines.items():
        assert p.get("receivers") and p.get("exporters"), pname
        for kind in KINDS:
            for comp in p.get(kind, []):
                if kind != "processors" and comp in connectors:
                    used_as[kind].add(comp)
                    continue
                assert comp in (cfg.get(kind) or {}), f"{pname}: {kind[:-1]} {comp} is not defined"
        procs = p.get("processors", [])
        if "memory_limiter" in procs:
            assert procs[0] == "memory_limiter", f"{pname}: memory_limiter must run first"
    assert used_as["receivers"] == used_as["exporters"] == connectors, used_as
    for ext in cfg["service"].get("extensions", []):
        assert ext in cfg["extensions"]


def test_single_host_collector_routes():
    """OTLP in; traces to Jaeger; span metrics to Prometheus' OTLP receiver."""
    cfg = load(ROOT / "exporters" / "collector.yaml")
    p = cfg["service"]["pipelines"]
    assert "otlp_grpc/jaeger" in p["traces"]["exporters"]
    assert cfg["exporters"]["otlp_http/prometheus"]["metrics_endpoint"].endswith(
        "/api/v1/otlp/v1/metrics"
    )
    assert "otlp_http/prometheus" in p["metrics"]["exporters"]


def test_gateway_keeps_failed_and_slow_requests():
    """Tail sampling keeps ERROR traces and slow spec.session traces (threshold well under
    decision_wait), plus a baseline; span metrics come from all spans, before sampling."""
    cfg = load(ROOT / "exporters" / "fleet" / "gateway.yaml")
    ts = cfg["processors"]["tail_sampling"]
    policies = {p["type"]: p for p in ts["policies"]}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    subs = {s["type"]: s for s in policies["and"]["and"]["and_sub_policy"]}
    assert any(
        'name == "spec.session"' in c for c in subs["ottl_condition"]["ottl_condition"]["span"]
    )
    wait_s = int(re.fullmatch(r"(\d+)s", ts["decision_wait"]).group(1))
    assert subs["latency"]["latency"]["threshold_ms"] < wait_s * 1000 / 2
    assert 0 < policies["probabilistic"]["probabilistic"]["sampling_percentage"] < 100
    for name, p in cfg["service"]["pipelines"].items():
        if "span_metrics" in p.get("exporters", []):
            assert "tail_sampling" not in p.get("processors", []), (
                f"{name}: span metrics after sampling"
            )


def test_node_agent_routes_by_trace_id():
    """The node collector forwards whole traces to one gateway each."""
    cfg = load(ROOT / "exporters" / "fleet" / "agent.yaml")
    assert cfg["exporters"]["load_balancing"]["routing_key"] == "traceID"


def test_replay_reads_the_default_span_file():
    """The otlp_json_file receiver's pattern matches memra-obs' default span file name (DESIGN §6)
    from the start of the file."""
    rcv = load(ROOT / "exporters" / "replay.yaml")["receivers"]["otlp_json_file"]
    assert rcv["start_at"] == "beginning"
    for name in ("memra-obs-spans.jsonl", "memra-obs-spans.jsonl.1"):  # and the rotated file
        assert any(fnmatch.fnmatch(f"/data/{name}", pat) for pat in rcv["include"]), name
