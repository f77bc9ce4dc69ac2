"""The demo's stderr through the tail: the same metrics as the demo published itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import pytest
from polling import wait_for
from prometheus_client import CollectorRegistry

from memra_obs.demo import DemoConfig, SimDevice, run_demo
from memra_obs.export import QueueSink
from memra_obs.prom import PrometheusExporter
from memra_obs.prom.families import FIRST_TOKEN_PHASES
from memra_obs.records import SPEC_PROF_ROUNDS
from memra_obs.tail import Rebuilder, Tail
from memra_obs.testing import capture
from memra_obs.timeline import BurstRecord, RoundRecord

DEADLINE_S = 60.0
PHASES = ("draft", "verify", "accept", "rollback", "maint")


def _env() -> dict[str, str]:
    """The test's environment without the knobs a test asserts the defaults of."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("MEMRA_OBS_", "OTEL_"))}


@pytest.fixture(scope="module")
def demo_vs_tail() -> tuple[Any, Any, list[Any], list[str]]:
    """The demo run in-process with its own PrometheusExporter, and its stderr lines fed
    through a tail into a second one (worker-labelled, as the tail publishes)."""
    reg_demo = CollectorRegistry()
    q = QueueSink([PrometheusExporter(registry=reg_demo)])
    dev = SimDevice()
    with capture(level=2, prof=True, sinks=[q], memory=dev.snapshot, wants_trace_ids=True) as cap:
        run_demo(DemoConfig(requests=4, seed=11, speed=5), cap.observer, device=dev)
        assert q.flush(10.0)
        records = list(cap.records)
        lines = cap.lines
    reg_tail = CollectorRegistry()
    prom = PrometheusExporter(registry=reg_tail, worker="demo", worker_label=True)
    tail = Tail(Rebuilder("demo"), prom.export, out=None)
    tail.feed(("\n".join(lines) + "\n").encode(), time.perf_counter_ns())
    tail.close(time.perf_counter_ns())
    assert tail.stats.total_malformed == 0 and tail.stats.total_orphans == 0
    return reg_demo, reg_tail, records, lines


def _pair(demo_vs_tail: Any, name: str, **labels: str) -> tuple[float, float]:
    reg_demo, reg_tail = demo_vs_tail[0], demo_vs_tail[1]
    a = reg_demo.get_sample_value(name, labels)
    b = reg_tail.get_sample_value(name, {"worker": "demo", **labels})
    assert a is not None and b is not None, name
    return a, b


def test_counts_are_exact_where_the_lines_carry_them(demo_vs_tail):
    """Rounds exactly; drafted/accepted tokens and per-row-arm rows exactly for the rounds
    the [spec-prof-rounds] rows cover (the first 64 of each session)."""
    rounds = [r for r in demo_vs_tail[2] if type(r) is RoundRecord]
    logged = [r for r in rounds if r.index < SPEC_PROF_ROUNDS]
    assert len(logged) < len(rounds), "the run must have sessions past the round log"
    a, b = _pair(demo_vs_tail, "memra_spec_rounds_total", family="glm5")
    assert a == b == len(rounds)
    a, b = _pair(demo_vs_tail, "memra_spec_round_seconds_count", family="glm5")
    assert a == b
    for metric, field in (
        ("memra_spec_drafted_tokens_total", "k"),
        ("memra_spec_accepted_tokens_total", "j"),
        ("memra_spec_verify_seq_rows_total", "seq_rows"),
    ):
        _, b = _pair(demo_vs_tail, metric, family="glm5")
        assert b == sum(getattr(r, field) for r in logged), metric
    # Rounds without a row (k = j = -1, unknown) are left out of the per-round token
    # histograms, which therefore hold the logged rounds' own distribution.
    for metric, field in (
        ("memra_spec_drafted_tokens_per_round", "k"),
        ("memra_spec_accepted_tokens_per_round", "j"),
    ):
        _, b = _pair(demo_vs_tail, metric + "_count", family="glm5")
        assert b == len(logged), metric
        _, b = _pair(demo_vs_tail, metric + "_bucket", family="glm5", le="0.0")
        assert b == sum(1 for r in logged if getattr(r, field) == 0), metric


def test_time_sums_agree_within_the_lines_precision(demo_vs_tail):
    """Phase and round histogram sums: rows are exact to the f32, bursts without rows to
    the phase line's printed precision (each phase total to 0.005 ms)."""
    bursts = sum(1 for r in demo_vs_tail[2] if type(r) is BurstRecord)
    for phase in PHASES:
        a, b = _pair(demo_vs_tail, "memra_spec_phase_seconds_sum", family="glm5", phase=phase)
        assert b == pytest.approx(a, abs=bursts * 5e-6), phase
    a, b = _pair(demo_vs_tail, "memra_spec_round_seconds_sum", family="glm5")
    assert b == pytest.approx(a, abs=bursts * 5 * 5e-6)
    rounds = sum(1 for r in demo_vs_tail[2] if type(r) is RoundRecord)
    for part in ("kda", "kda_scan", "mla", "ffn"):
        a, b = _pair(demo_vs_tail, "memra_spec_verify_split_seconds_sum", family="glm5", part=part)
        assert b == pytest.approx(a, abs=rounds * 0.5e-6), part


def test_first_token_metrics_are_exact(demo_vs_tail):
    """The [spec-prof] line carries every bucket exactly: histograms and gauges match to
    the bucket and the byte."""
    a, b = _pair(demo_vs_tail, "memra_spec_first_token_seconds_count")
    assert a == b == 4
    a, b = _pair(demo_vs_tail, "memra_spec_first_token_seconds_sum")
    assert a == b
    for phase in FIRST_TOKEN_PHASES:
        if demo_vs_tail[0].get_sample_value(
            "memra_spec_first_token_phase_seconds_count", {"phase": phase}
        ):
            a, b = _pair(demo_vs_tail, "memra_spec_first_token_phase_seconds_sum", phase=phase)
            assert a == b, phase
    for point in ("before", "after"):
        a, b = _pair(demo_vs_tail, "memra_gpu_free_bytes", device="0", point=point)
        assert a == b


# ---------------------------------------------------------------------------- processes


class _Pump:
    """Collects a pipe's bytes on a thread, so waits on it are bounded."""

    def __init__(self, stream: Any) -> None:
        self.data = bytearray()
        self._t = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._t.start()

    def _run(self, stream: Any) -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):
            self.data += chunk

    def join(self) -> None:
        self._t.join(DEADLINE_S)


def _metric(url: str, name: str, **labels: str) -> float | None:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if m and sorted(m.group(1).split(",")) == want:
            return float(m.group(2))
    return None


@pytest.mark.integration
def test_demo_stderr_piped_through_the_cli(tmp_path):
    """``memra-obs demo`` (its own /metrics on a free port) -> ``memra-obs tail -``: every
    byte passes through, and the tail's /metrics counts the demo's rounds and sessions."""
    base = {**_env(), "MEMRA_OBS_SINKS": "prometheus", "MEMRA_OBS_METRICS_ADDR": "127.0.0.1:0"}
    tail = subprocess.Popen(
        [sys.executable, "-m", "memra_obs.cli", "tail", "-", "--worker", "demo0"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=base,
    )
    err = _Pump(tail.stderr)
    try:
        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "memra_obs.cli",
                "demo",
                "--requests",
                "3",
                "--seed",
                "5",
                "--speed",
                "3",
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={**base, "MEMRA_OBS_SPANS_FILE": str(tmp_path / "demo-spans.jsonl")},
            timeout=DEADLINE_S,
        )
        assert demo.returncode == 0, demo.stderr[-2000:]
        done = re.search(rb"demo done: sessions=(\d+) rounds=(\d+)", demo.stderr)
        assert done is not None
        sessions, rounds = int(done.group(1)), int(done.group(2))
        assert tail.stdin is not None
        tail.stdin.write(demo.stderr)
        tail.stdin.flush()
        wait_for("the tail's start line", lambda: b"/metrics on " in err.data, DEADLINE_S)
        url = re.search(rb"/metrics on (\S+)", bytes(err.data)).group(1).decode()  # type: ignore[union-attr]
        wait_for(
            f"{rounds} rounds on the tail's /metrics",
            lambda: (
                _metric(url, "memra_spec_rounds_total", worker="demo0", family="glm5") == rounds
            ),
            DEADLINE_S,
        )
        assert _metric(url, "memra_spec_first_token_seconds_count", worker="demo0") == sessions
        assert _metric(url, "memra_obs_tail_sessions_total", worker="demo0") == sessions
        assert (
            _metric(url, "memra_obs_tail_malformed_lines_total", worker="demo0", kind="phase") == 0
        )
        tail.stdin.close()
        assert tail.wait(DEADLINE_S) == 0
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait(DEADLINE_S)
    err.join()
    ours = re.compile(rb"^\[memra-obs\] tail: .*\n", re.M)
    assert ours.sub(b"", bytes(err.data)) == demo.stderr
