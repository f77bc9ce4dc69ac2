"""Agent mode into a real Jaeger: several `memra-obs demo` workers write shared-memory rings,
one `memra-obs agent` publishes all of them over OTLP; Jaeger holds every worker's sessions
as whole traces, each labelled with its worker."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from peerlib import (
    Jaeger,
    Procs,
    check_against_legacy,
    check_trace,
    clean_env,
    demo_result,
    memra_obs,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKERS = ("w0", "w1", "w2")


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_agent_publishes_every_workers_spans_to_jaeger(
    protocol: str, jaeger: Jaeger, procs: Procs, tmp_path: Path
):
    """Three workers, one agent: per worker, Jaeger's traces carry exactly the sessions,
    rounds and tokens that worker's demo reported, each trace whole."""
    rings = tmp_path / "rings"
    rings.mkdir()
    service = "peer-agent-" + protocol.replace("/", "-")
    endpoint = jaeger.otlp_http if protocol.startswith("http") else f"http://{jaeger.otlp_grpc}"
    agent = procs.start(
        "agent",
        memra_obs("agent", "--dir", str(rings), "--poll-ms", "10"),
        clean_env(
            MEMRA_OBS_AGENT=str(rings),
            MEMRA_OBS_METRICS_ADDR="",
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
            OTEL_SERVICE_NAME=service,
        ),
    )
    workers = [
        procs.start(
            f"demo-{w}",
            memra_obs("demo", "--requests", "3", "--seed", str(i), "--speed", "5"),
            clean_env(
                MEMRA_OBS_AGENT=str(rings),
                MEMRA_OBS_SINKS="otel,prometheus",
                MEMRA_OBS_METRICS_ADDR="",
                MEMRA_OBS_WORKER=w,
            ),
        )
        for i, w in enumerate(WORKERS)
    ]
    runs = {}
    for w, p in zip(WORKERS, workers, strict=True):
        assert procs.wait(p, 120) == 0, procs.tail(p)
        runs[w] = demo_result(procs.log(p))
    # SIGTERM: the agent reads every ring to its end, publishes, flushes, exits 0.
    assert procs.end(agent, signal.SIGTERM, timeout_s=60) == 0, procs.tail(agent)

    want_sessions = sum(r.sessions for r in runs.values())

    def per_worker() -> dict[str, list]:
        ids = jaeger.trace_ids(service)
        assert len(ids) == want_sessions, (len(ids), want_sessions)
        out: dict[str, list] = {w: [] for w in WORKERS}
        for tid in ids:
            spans = jaeger.trace(tid)
            # the receiver batches: a session's own span (ended last) may land a moment later
            w = next((s.attrs["memra.spec.worker"] for s in spans if s.name == "spec.session"), "")
            assert w, f"trace {tid}: its spec.session span is not in Jaeger yet"
            out[w].append(check_trace(spans, service=service, worker=w))
        return out

    try:
        got = wait_for("every worker's traces, whole", per_worker, 30, 0.5)
    except AssertionError:
        got = per_worker()
    for w, run in runs.items():
        traces = got[w]
        assert len(traces) == run.sessions, (w, len(traces), run)
        assert sum(t.rounds for t in traces) == sum(t.round_spans for t in traces) == run.rounds
        assert sum(t.tokens for t in traces) == run.tokens, w
        check_against_legacy(traces, run)
