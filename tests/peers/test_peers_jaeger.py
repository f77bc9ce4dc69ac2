"""`memra-obs demo` straight into a real Jaeger v2 over each OTLP protocol the project
speaks; every trace is fetched back by id from Jaeger's query API and checked whole against
DESIGN §4, and against the demo's own `[glm5-phase]` lines."""

from __future__ import annotations

import pytest
from peerlib import (
    PHASES,
    Jaeger,
    Procs,
    check_against_legacy,
    clean_env,
    collect_traces,
    demo_result,
    memra_obs,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

REQUESTS = 4


def run_demo(procs: Procs, env: dict[str, str], requests: int = REQUESTS, seed: int = 7):
    """A bounded demo run (a fifth of real time); returns what it said."""
    p = procs.start(
        "demo",
        memra_obs("demo", "--requests", str(requests), "--seed", str(seed), "--speed", "5"),
        clean_env(MEMRA_OBS_METRICS_ADDR="127.0.0.1:0", **env),
    )
    assert procs.wait(p, 120) == 0, procs.tail(p)
    return demo_result(procs.log(p))


@pytest.mark.parametrize("protocol", ["http/protobuf", "http/json", "grpc"])
def test_demo_traces_arrive_whole_over_each_protocol(protocol: str, jaeger: Jaeger, procs: Procs):
    """Over OTLP/HTTP protobuf, OTLP/HTTP JSON and OTLP/gRPC, Jaeger stores every session
    of the demo as one whole trace: the tree, its attributes, the resource."""
    service = "peer-" + protocol.replace("/", "-")
    endpoint = jaeger.otlp_http if protocol.startswith("http") else f"http://{jaeger.otlp_grpc}"
    run = run_demo(
        procs,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_SERVICE_NAME": service,
        },
    )
    traces = collect_traces(jaeger, service, run.sessions)
    assert run.sessions == REQUESTS
    assert sum(t.rounds for t in traces) == sum(t.round_spans for t in traces) == run.rounds
    assert sum(t.tokens for t in traces) == run.tokens
    check_against_legacy(traces, run)
    assert service in jaeger.services()
    assert {"spec.session", "spec.burst", "spec.round", *PHASES, "spec.first_token"} <= (
        jaeger.operations(service)
    )


def test_round_cap_is_said_on_the_burst_spans(jaeger: Jaeger, procs: Procs):
    """With MEMRA_OBS_ROUND_SPANS=8, each session has spans for its first 8 rounds only, and
    each burst says how many of its rounds have none; the totals still count every round."""
    service = "peer-round-cap"
    run = run_demo(
        procs,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_http,
            "OTEL_SERVICE_NAME": service,
            "MEMRA_OBS_ROUND_SPANS": "8",
        },
        requests=2,
    )
    traces = collect_traces(jaeger, service, run.sessions, round_cap=8)
    assert all(t.round_spans == min(8, t.rounds) for t in traces)
    assert sum(t.rounds for t in traces) == run.rounds > 16
    check_against_legacy(traces, run)


def test_trace_level_1_without_profile(jaeger: Jaeger, procs: Procs):
    """At MEMRA_SPEC_TRACE=1 without the first-token profile, verify spans carry no
    sub-split and there is no spec.first_token subtree; the rest of the tree is unchanged."""
    service = "peer-level-1"
    run = run_demo(
        procs,
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_http,
            "OTEL_SERVICE_NAME": service,
            "MEMRA_SPEC_TRACE": "1",
            "MEMRA_SPEC_PROF": "0",
        },
        requests=2,
    )
    traces = collect_traces(jaeger, service, run.sessions, level=1, prof=False)
    check_against_legacy(traces, run)
