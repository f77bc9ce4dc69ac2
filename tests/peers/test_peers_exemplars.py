"""Grafana's "exemplar -> trace" jump, end to end without Grafana: Prometheus 3 (exemplar
storage on) scrapes the demo and the agent; each exemplar's `trace_id`, taken from
`query_exemplars`, is fetched from Jaeger and is the trace of that very round."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from peerlib import (
    Jaeger,
    Procs,
    Prometheus,
    check_trace,
    clean_env,
    free_ports,
    http_get,
    memra_obs,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PHASE_SPAN = {
    "draft": "spec.draft",
    "verify": "spec.verify",
    "accept": "spec.accept",
    "rollback": "spec.rollback",
    "maint": "spec.maint",
}


def start_workers(mode: str, procs: Procs, jaeger: Jaeger, tmp: Path, addr: str) -> list:
    """The demo in-process (serving /metrics itself), or two agent-mode workers with one
    `memra-obs agent` serving the host's /metrics; spans over OTLP/HTTP to Jaeger."""
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_http, "OTEL_SERVICE_NAME": "peer-ex"}
    demo = memra_obs("demo", "--duration", "120", "--speed", "2")
    if mode == "in-process":
        return [procs.start("demo", demo, clean_env(MEMRA_OBS_METRICS_ADDR=addr, **otlp))]
    rings = tmp / "rings"
    rings.mkdir()
    agent = procs.start(
        "agent",
        memra_obs("agent", "--dir", str(rings)),
        clean_env(MEMRA_OBS_AGENT=str(rings), MEMRA_OBS_METRICS_ADDR=addr, **otlp),
    )
    workers = [
        procs.start(
            f"demo-{w}",
            [*demo, "--seed", str(i)],
            clean_env(
                MEMRA_OBS_AGENT=str(rings),
                MEMRA_OBS_SINKS="otel,prometheus",
                MEMRA_OBS_METRICS_ADDR="",
                MEMRA_OBS_WORKER=w,
            ),
        )
        for i, w in enumerate(("w0", "w1"))
    ]
    return [*workers, agent]  # stopped in this order: the agent drains after the workers


@pytest.mark.parametrize("mode", ["in-process", "agent"])
def test_exemplar_trace_ids_lead_to_their_round_in_jaeger(
    mode: str, peer_bins: dict[str, str], jaeger: Jaeger, procs: Procs, tmp_path: Path
):
    """Every round, phase and token exemplar Prometheus stored names a trace Jaeger holds,
    whole, and a `spec.round` span in it whose duration (or phase child, or k/j) is the
    exemplar's value and whose end is its timestamp; family and worker labels match."""
    (mport,) = free_ports(1)
    addr = f"127.0.0.1:{mport}"
    children = start_workers(mode, procs, jaeger, tmp_path, addr)
    wait_for("/metrics", lambda: http_get(f"http://{addr}/metrics", 2), 30)
    prom = Prometheus(peer_bins["prometheus"], procs, tmp_path, {f"memra-{mode}": addr}).start()
    version = prom.api("status/buildinfo")["version"]
    assert version.startswith("3."), version

    def enough() -> list:
        ex = prom.exemplars("memra_spec_round_seconds_bucket")
        return ex if len({e["labels"]["trace_id"] for e in ex}) >= 3 else []

    wait_for("round exemplars in Prometheus", enough, 60, 1.0)

    def scraped_up() -> bool:
        # Polled: one scrape slower than its timeout (the 1 s interval) on a busy host reads
        # up == 0 until the next one; a /metrics that never answers stays 0 for all 30 s.
        prom_up = prom.query(f'up{{job="memra-{mode}"}}')
        assert prom_up and prom_up[0]["value"][1] == "1", prom_up
        return True

    wait_for(f"up == 1 for job memra-{mode}", scraped_up, 30, 0.5)
    # Workers first (SIGINT: the demo's Ctrl-C path ends the requests in flight and
    # flushes), then the agent (SIGTERM: reads the rings to their end, flushes).
    for p in children:
        procs.end(p, signal.SIGTERM if "agent" in p.args else signal.SIGINT)
    # The last scrape is in; the exporters flushed on the way out.
    rounds = prom.exemplars("memra_spec_round_seconds_bucket")
    phases = prom.exemplars("memra_spec_phase_seconds_bucket")
    tokens = prom.exemplars("memra_spec_drafted_tokens_per_round_bucket") + prom.exemplars(
        "memra_spec_accepted_tokens_per_round_bucket"
    )
    assert rounds and phases and tokens

    traces: dict[str, dict] = {}

    def trace(tid: str) -> dict:
        """The trace once whole: the receiver batches, so a session's last spans (its end,
        flushed at shutdown) may land a moment after the trace's first ones."""
        if tid not in traces:
            traces[tid] = wait_for(
                f"trace {tid} whole in Jaeger",
                lambda: check_trace(jaeger.trace(tid), service="peer-ex").by_id,
                30,
                0.5,
            )
        return traces[tid]

    for ex in rounds + phases + tokens:
        labels, series, value = ex["labels"], ex["series"], float(ex["value"])
        by_id = trace(labels["trace_id"])
        rnd = by_id.get(labels["span_id"])
        assert rnd is not None and rnd.name == "spec.round", (ex, rnd)
        session = next(s for s in by_id.values() if s.name == "spec.session")
        assert series["family"] == session.attrs["memra.spec.family"], (series, session.attrs)
        if mode == "agent":
            assert series["worker"] == session.attrs["memra.spec.worker"], series
        else:
            assert "worker" not in series
        # The exemplar's timestamp is the round's end (Prometheus keeps milliseconds).
        assert abs(float(ex["timestamp"]) * 1e9 - rnd.end) < 1.5e6, (ex, rnd.end)
        assert value <= float(series["le"]), ex
        name = series["__name__"]
        if name == "memra_spec_round_seconds_bucket":
            assert value == rnd.duration / 1e9, (ex, rnd.duration)
        elif name == "memra_spec_phase_seconds_bucket":
            kids = [s for s in by_id.values() if s.parent == rnd.span_id]
            phase = next(s for s in kids if s.name == PHASE_SPAN[series["phase"]])
            assert value == phase.duration / 1e9, (ex, phase.duration)
        else:
            key = "memra.spec.k" if "drafted" in name else "memra.spec.j"
            assert value == rnd.attrs[key], (ex, rnd.attrs)
    assert len(traces) >= 3
    assert prom.warnings() == []
