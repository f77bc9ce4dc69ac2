"""The embedded default (the OTLP-JSON span file, no `OTEL_*` exporter set) replayed by the
real Collector's otlpjsonfile receiver into Jaeger, exactly as README "Viewing spans in
Jaeger" tells users to: exporters/replay.yaml, the files found by its glob, read from the
beginning and followed while a demo appends."""

from __future__ import annotations

from pathlib import Path

import pytest
from peerlib import (
    ROOT,
    Collector,
    Jaeger,
    Procs,
    check_against_legacy,
    clean_env,
    collect_traces,
    demo_result,
    memra_obs,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def file_demo(procs: Procs, cwd: Path, service: str, requests: int, seed: int, **env: str):
    """A demo with no OTEL_* exporter: spans go to MEMRA_OBS_SPANS_FILE (default
    memra-obs-spans.jsonl in its working directory)."""
    p = procs.start(
        f"demo-{service}",
        memra_obs("demo", "--requests", str(requests), "--seed", str(seed), "--speed", "5"),
        clean_env(MEMRA_OBS_METRICS_ADDR="127.0.0.1:0", OTEL_SERVICE_NAME=service, **env),
        cwd=cwd,
    )
    assert procs.wait(p, 120) == 0, procs.tail(p)
    return demo_result(procs.log(p))


def from_file(path: Path) -> dict[str, str]:
    """What the otlp_json_file receiver adds to each span it reads: the file's name."""
    return {"log.file.name": path.name}


def test_span_file_replayed_through_the_collector_arrives_whole(
    peer_bins: dict[str, str], jaeger: Jaeger, procs: Procs, tmp_path: Path
):
    """A span file written before the collector starts and one appended while it runs both
    reach Jaeger through exporters/replay.yaml, every session one whole trace."""
    spans_dir = tmp_path / "spans"
    spans_dir.mkdir()
    before = file_demo(procs, spans_dir, "peer-replay", requests=3, seed=11)
    default_file = spans_dir / "memra-obs-spans.jsonl"
    assert default_file.stat().st_size > 0
    # Under the otlp_json_file receiver's default max_log_size (1 MiB; replay.yaml raises
    # it to 64 MiB, README's standalone snippet keeps the default).
    assert max(map(len, default_file.read_bytes().splitlines())) < 1 << 20

    Collector(
        peer_bins["otelcol"],
        procs,
        ROOT / "exporters" / "replay.yaml",
        name="otelcol-replay",
        MEMRA_OBS_SPANS_DIR=str(spans_dir),
        OTELCOL_JAEGER_ENDPOINT=jaeger.otlp_grpc,
    ).start()
    check_against_legacy(
        collect_traces(jaeger, "peer-replay", before.sessions, added=from_file(default_file)),
        before,
    )

    live = file_demo(
        procs,
        spans_dir,
        "peer-replay-live",
        requests=2,
        seed=12,
        MEMRA_OBS_SPANS_FILE=str(spans_dir / "memra-obs-spans-live.jsonl"),
    )
    traces = collect_traces(
        jaeger,
        "peer-replay-live",
        live.sessions,
        added=from_file(spans_dir / "memra-obs-spans-live.jsonl"),
    )
    check_against_legacy(traces, live)
    assert sum(t.rounds for t in traces) == live.rounds


# README "Viewing spans in Jaeger", the snippet for "any otelcol-contrib binary" (with the
# Collector's current component names; the endpoint is this test's Jaeger).
README_SNIPPET = """
receivers:
  otlp_json_file:
    include: [./memra-obs-spans.jsonl]
    start_at: beginning
exporters:
  otlp_grpc:
    endpoint: {jaeger}
    tls: {{insecure: true}}
service:
  telemetry: {{metrics: {{level: none}}}}
  pipelines:
    traces: {{receivers: [otlp_json_file], exporters: [otlp_grpc]}}
"""


def test_readme_standalone_snippet_replays_the_default_file(
    peer_bins: dict[str, str], jaeger: Jaeger, procs: Procs, tmp_path: Path
):
    """The README's minimal collector config, run in the directory where the demo wrote its
    default span file, puts every session into Jaeger whole (default 1 MiB line limit)."""
    run = file_demo(procs, tmp_path, "peer-snippet", requests=3, seed=13)
    cfg = tmp_path / "replay-snippet.yaml"
    cfg.write_text(README_SNIPPET.format(jaeger=jaeger.otlp_grpc))
    p = procs.start(
        "otelcol-snippet", [peer_bins["otelcol"], f"--config=file:{cfg}"], clean_env(), cwd=tmp_path
    )
    traces = collect_traces(
        jaeger, "peer-snippet", run.sessions, added=from_file(tmp_path / "memra-obs-spans.jsonl")
    )
    check_against_legacy(traces, run)
    assert p.poll() is None, procs.tail(p)


def test_agent_backlog_file_replays_within_the_default_line_limit(
    peer_bins: dict[str, str], jaeger: Jaeger, procs: Procs, tmp_path: Path
):
    """A backlog (workers fill their rings, then `memra-obs agent --once` publishes it all to
    the span file) makes the file's biggest lines; the README's snippet, with the receiver's
    default 1 MiB line limit, still replays every session whole."""
    rings = tmp_path / "rings"
    rings.mkdir()
    ring_env = {"MEMRA_OBS_AGENT": str(rings), "MEMRA_OBS_METRICS_ADDR": ""}
    worker = procs.start(
        "demo-backlog",
        memra_obs("demo", "--requests", "30", "--seed", "14", "--speed", "20"),
        clean_env(MEMRA_OBS_SINKS="otel,prometheus", MEMRA_OBS_WORKER="w0", **ring_env),
    )
    assert procs.wait(worker, 120) == 0, procs.tail(worker)
    run = demo_result(procs.log(worker))
    agent = procs.start(
        "agent-once",
        memra_obs("agent", "--once", "--dir", str(rings)),
        clean_env(OTEL_SERVICE_NAME="peer-backlog", **ring_env),
        cwd=tmp_path,
    )
    assert procs.wait(agent, 120) == 0, procs.tail(agent)
    lines = (tmp_path / "memra-obs-spans.jsonl").read_bytes().splitlines()
    assert max(map(len, lines)) < 1 << 20
    cfg = tmp_path / "replay-snippet.yaml"
    cfg.write_text(README_SNIPPET.format(jaeger=jaeger.otlp_grpc))
    p = procs.start(
        "otelcol-snippet", [peer_bins["otelcol"], f"--config=file:{cfg}"], clean_env(), cwd=tmp_path
    )
    traces = collect_traces(
        jaeger,
        "peer-backlog",
        run.sessions,
        worker="w0",
        added=from_file(tmp_path / "memra-obs-spans.jsonl"),
    )
    assert sum(t.rounds for t in traces) == run.rounds
    check_against_legacy(traces, run)
    assert p.poll() is None, procs.tail(p)
