"""The fleet layout of exporters/fleet/ run for real: workers -> the node (agent) collector
-> the gateway collector (tail sampling) -> Jaeger, and the gateway's span metrics ->
Prometheus 3's OTLP receiver. The test chooses trace ids, so it knows which sampling policy
must keep or drop each trace, and asserts exactly that."""

from __future__ import annotations

import json
import secrets
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import yaml
from peerlib import (
    HERE,
    ROOT,
    Collector,
    Jaeger,
    Procs,
    Prometheus,
    check_trace,
    clean_env,
    demo_result,
    memra_obs,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GATEWAY = ROOT / "exporters" / "fleet" / "gateway.yaml"
AGENT = ROOT / "exporters" / "fleet" / "agent.yaml"
M64 = (1 << 64) - 1
#: The caller span fleet_worker.py puts its sessions under (a remote parent).
CALLER = f"{0x1234ABCD:016x}"


def _policies() -> dict[str, dict]:
    ts = yaml.safe_load(GATEWAY.read_text())["processors"]["tail_sampling"]
    return {p["name"]: p for p in ts["policies"]}


def baseline_keeps(trace_id: str) -> bool:
    """The gateway's probabilistic policy's decision for a trace id: FNV-1a 64 of the hash
    salt (its default, "default-hash-seed") and the 16 id bytes, at most pct% of 2^64-1
    (tailsamplingprocessor/internal/sampling/probabilistic.go)."""
    pct = _policies()["baseline"]["probabilistic"]["sampling_percentage"]
    h = 0xCBF29CE484222325
    for byte in b"default-hash-seed" + bytes.fromhex(trace_id):
        h = ((h ^ byte) * 0x100000001B3) & M64
    return h <= int(Fraction(M64) * Fraction(str(pct)) / 100)


def trace_ids(n: int, kept: bool) -> list[str]:
    """``n`` random trace ids the baseline policy keeps (or drops)."""
    out: list[str] = []
    while len(out) < n:
        t = secrets.token_hex(16)
        if baseline_keeps(t) is kept:
            out.append(t)
    return out


def test_fleet_tail_sampling_keeps_and_drops_what_each_policy_says(
    peer_bins: dict[str, str], jaeger: Jaeger, procs: Procs, tmp_path: Path
):
    """failed-requests keeps the ERROR session, slow-sessions keeps the session over the
    threshold but not a slow trace without spec.session, the 5% baseline keeps exactly the
    trace ids its hash picks and drops the rest; span metrics count every session."""
    threshold_s = (
        _policies()["slow-sessions"]["and"]["and_sub_policy"][1]["latency"]["threshold_ms"] / 1000
    )
    prom = Prometheus(peer_bins["prometheus"], procs, tmp_path, otlp=True).start()
    gateway = Collector(
        peer_bins["otelcol"],
        procs,
        GATEWAY,
        name="otelcol-gateway",
        OTELCOL_JAEGER_ENDPOINT=jaeger.otlp_grpc,
        OTELCOL_PROMETHEUS_OTLP_ENDPOINT=prom.otlp_metrics,
    ).start()
    host, port = gateway.otlp_grpc.rsplit(":", 1)
    agent = Collector(
        peer_bins["otelcol"],
        procs,
        AGENT,
        name="otelcol-agent",
        OTELCOL_GATEWAY_HOSTNAME=host,
        OTELCOL_GATEWAY_PORT=port,
    ).start()

    error_id, slow_id, other_id = trace_ids(3, kept=False)
    fast_kept, fast_dropped = trace_ids(3, kept=True), trace_ids(6, kept=False)
    plan = {
        "sessions": [{"trace_id": error_id, "kind": "error"}, {"trace_id": slow_id, "kind": "slow"}]
        + [{"trace_id": t, "kind": "fast"} for t in fast_kept + fast_dropped],
        "other": [other_id],
        "slow_s": threshold_s + 0.6,
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    to_agent = {"OTEL_EXPORTER_OTLP_ENDPOINT": agent.otlp_http, "MEMRA_OBS_METRICS_ADDR": ""}
    script = procs.start(
        "fleet-worker",
        [sys.executable, str(HERE / "fleet_worker.py"), str(tmp_path / "plan.json")],
        clean_env(MEMRA_OBS_SINKS="otel", OTEL_SERVICE_NAME="peer-fleet", **to_agent),
    )
    demos = [
        procs.start(
            f"demo-{i}",
            memra_obs("demo", "--requests", "15", "--seed", str(20 + i), "--speed", "20"),
            clean_env(OTEL_SERVICE_NAME=f"peer-fleet-demo{i}", **to_agent),
        )
        for i in range(2)
    ]
    runs = []
    for p in demos:
        assert procs.wait(p, 120) == 0, procs.tail(p)
        runs.append(demo_result(procs.log(p)))
    assert procs.wait(script, 120) == 0, procs.tail(script)
    sessions = sum(r.sessions for r in runs) + len(plan["sessions"])
    traces = sessions + len(plan["other"])

    # Every trace decided (decision_wait after its first span): the gateway's own count.
    def decided() -> float:
        n = gateway.self_metric("otelcol_processor_tail_sampling_global_count_traces_sampled")
        return n if n >= traces else 0

    wait_for(f"the gateway to decide {traces} traces", decided, 90, 1.0)
    assert decided() == traces

    def held(tid: str) -> bool:
        return bool(jaeger.trace(tid))

    must_keep = [error_id, slow_id, *fast_kept]
    wait_for("the kept traces in Jaeger", lambda: all(map(held, must_keep)), 30, 0.5)
    for tid in (other_id, *fast_dropped):
        assert not held(tid), f"trace {tid} should have been dropped"

    # What was kept is whole, and kept for the right reason.
    mine = {"service": "peer-fleet", "level": 0, "prof": False, "parent": CALLER}
    err = check_trace(jaeger.trace(error_id), status=2, **mine)
    assert err.session.attrs["error.type"] == "RuntimeError"
    slow = check_trace(jaeger.trace(slow_id), **mine)
    assert slow.session.duration / 1e9 > threshold_s
    for tid in fast_kept:
        fast = check_trace(jaeger.trace(tid), **mine)
        assert fast.session.duration / 1e9 < threshold_s
    # The demo workers' traces (random ids): kept only where the baseline hash says so.
    demo_kept = 0
    for i, run in enumerate(runs):
        kept = jaeger.trace_ids(f"peer-fleet-demo{i}")
        assert all(baseline_keeps(t) for t in kept), kept
        assert len(kept) < run.sessions
        for t in kept:
            check_trace(jaeger.trace(t), service=f"peer-fleet-demo{i}")
        demo_kept += len(kept)

    # Per policy, the gateway's own counters agree.
    def policy(name: str) -> float:
        return gateway.self_metric(
            "otelcol_processor_tail_sampling_count_traces_sampled",
            policy=name,
            sampled="true",
        )

    assert policy("failed-requests") == 1
    assert policy("slow-sessions") == 1
    # Every trace the baseline picked is in Jaeger (ours and the demos' alike).
    assert policy("baseline") == len(fast_kept) + demo_kept

    # Span metrics (before sampling) reach Prometheus through its OTLP receiver: every
    # session is counted, kept or not.
    def counted() -> float:
        res = prom.query('sum(traces_span_metrics_calls_total{span_name="spec.session"})')
        n = float(res[0]["value"][1]) if res else 0.0
        return n if n >= sessions else 0

    assert wait_for("span metrics for every session", counted, 60, 1.0) == sessions
    assert prom.warnings() == []
