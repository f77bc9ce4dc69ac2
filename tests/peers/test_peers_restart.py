"""Jaeger goes away in the middle of a run (stopped and started again on the same ports, or
hung) and comes back: the serving loop does not notice (its round time does not move), the
losses are counted on `/metrics`, and spans flow again afterwards without restarting the
worker."""

from __future__ import annotations

import os
import signal
import statistics
import time
from pathlib import Path

import pytest
from peerlib import (
    PHASE_LINE,
    Jaeger,
    Procs,
    check_trace,
    clean_env,
    free_ports,
    http_get,
    memra_obs,
    metric_value,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WINDOW_S = 8.0  # each of before / during the outage / after
#: How far a window's median round wall (~4.6 ms at --speed 1) may move: up to this factor
#: either way. Every round is drawn from one distribution; the demo alone gives four windows
#: within 2% (4.30-4.40 ms), but beside Jaeger on the shared 2 cores one window in four has
#: been 20-25% off, faster as often as slower and outage or not, and a loaded CI host moves
#: it more. This catches a loop slowed throughout; a loop that stops now and then keeps its
#: median (one held at each session's end until its spans were sent: unmoved): MAX_GAP_S.
FACTOR = 2.0
#: The longest time without a burst's line during the outage. Lines come every ~30 ms (a burst
#: of 6 rounds), ~0.3 s apart at most across a session's set-up (the longest prime of this
#: seed's first 500 sessions); 0.2 s at most measured, with 6 busy processes on the 2 cores. A
#: loop that waited on its exporter stops for a whole send: 2 s (the OTLP timeout) against a
#: hung Jaeger, 1-2 s of retries of a refused connection against a stopped one, each time it
#: sends (3-5 s measured, a loop held at each session's end).
MAX_GAP_S = 1.0


class LineClock:
    """Timestamps the demo's `[glm5-phase]` lines as they appear in its log."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.pos = 0
        self.buf = b""
        self.per_round_ms: list[tuple[float, float]] = []
        #: (time, bursts read) of every poll: a poll that read none proves the demo wrote none
        #: since the poll before it; a poll that came late (a stalled test process) proves nothing.
        self.polls: list[tuple[float, int]] = []

    def poll(self) -> None:
        with open(self.log, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        self.pos += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        now, n = time.monotonic(), len(self.per_round_ms)
        for ln in lines:
            m = PHASE_LINE.match(ln.decode(errors="replace"))
            if m and m["tag"] == "glm5-phase":
                self.per_round_ms.append((now, float(m["total"]) / int(m["rounds"])))
        self.polls.append((now, len(self.per_round_ms) - n))

    def median(self, t0: float, t1: float) -> tuple[float, int]:
        xs = [v for t, v in self.per_round_ms if t0 <= t < t1]
        assert len(xs) >= 20, f"only {len(xs)} bursts in a window"
        return statistics.median(xs), len(xs)

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest stretch in [t0, t1) the polls prove no burst's line came in: from a poll
        that read some to the last of the empty polls after it (polled every ~50 ms)."""
        longest, since = 0.0, t0
        for t, n in self.polls:
            if t0 <= t < t1:
                if n:
                    since = t
                else:
                    longest = max(longest, t - since)
        return longest


def sleep_polling(clock: LineClock, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        clock.poll()
        time.sleep(0.05)


@pytest.mark.parametrize("outage", ["exit", "hang"])
@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_jaeger_outage_mid_run(
    protocol: str, outage: str, jaeger: Jaeger, procs: Procs, tmp_path: Path
):
    """Jaeger gone for a while (``exit``: the process ends and is started again on the same
    ports, empty; ``hang``: SIGSTOP, the kernel still accepts connections but nothing
    answers, then SIGCONT) leaves the loop's median round wall where it was, shows up as span
    export errors and drops on /metrics, and afterwards new sessions arrive whole without a
    restart of the worker."""
    (mport,) = free_ports(1)
    metrics = f"http://127.0.0.1:{mport}/metrics"
    service = "peer-restart-" + protocol.replace("/", "-")
    endpoint = jaeger.otlp_http if protocol.startswith("http") else f"http://{jaeger.otlp_grpc}"
    demo = procs.start(
        "demo",
        memra_obs("demo", "--duration", "120", "--seed", "5"),
        clean_env(
            MEMRA_OBS_METRICS_ADDR=f"127.0.0.1:{mport}",
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
            # Fail fast on a peer that is gone (the default is 10 s a request).
            OTEL_EXPORTER_OTLP_TIMEOUT="2000",
            OTEL_SERVICE_NAME=service,
        ),
    )
    clock = LineClock(procs.logs[demo.pid])

    def losses() -> tuple[float, float]:
        text = http_get(metrics, 5).decode()
        return (
            metric_value(text, "memra_obs_export_errors_total", signal="spans"),
            metric_value(text, "memra_obs_dropped_total", signal="spans"),
        )

    wait_for("the demo's /metrics", lambda: http_get(metrics, 2), 30)
    wait_for("spans in Jaeger", lambda: service in jaeger.services(), 30)
    sleep_polling(clock, 1.0)  # past start-up
    t_before = time.monotonic()
    sleep_polling(clock, WINDOW_S)
    # No losses with Jaeger up, but for one failed send at most: Jaeger on a busy 2-core host
    # may let one pass the 2 s timeout (its spans counted dropped with it). Sends go out several
    # times a second, so a sender that fails as a rule fails many times in this window; and no
    # drop without a failed send (a full queue, a rejection).
    errors_before, dropped_before = losses()
    assert errors_before <= 1 and (dropped_before > 0) == (errors_before > 0), (
        f"losses before any outage: errors {errors_before}, dropped {dropped_before}"
    )

    assert jaeger.proc is not None
    pid = jaeger.proc.pid
    if outage == "exit":
        jaeger.stop()
    else:
        os.kill(pid, signal.SIGSTOP)
    try:
        t_down = time.monotonic()
        sleep_polling(clock, WINDOW_S)
        t_up = time.monotonic()
        errors_down, dropped_down = losses()
    finally:
        if outage == "hang":
            os.kill(pid, signal.SIGCONT)
    if outage == "exit":
        jaeger.start()
    t_back = time.monotonic()

    # The sender is through again once its error count stops moving; how soon that is,
    # is bounded (HTTP connects per request; gRPC's reconnect backoff is capped at ~2 s).
    last: list[float] = []

    def settled() -> bool:
        clock.poll()
        last.append(losses()[0])
        return len(last) > 8 and last[-1] == last[-8]  # unchanged for ~2 s

    wait_for("span exports to succeed again", settled, 30, 0.25)
    t_ok = time.monotonic()
    ok_ns = time.time_ns() - 2_000_000_000  # when the errors stopped (no later)
    assert t_ok - t_back < 15, f"exports failed for {t_ok - t_back:.1f}s after Jaeger was back"

    # Jaeger's storage is empty after the restart: sessions that started once the sender
    # was through again must all arrive whole, without a restart of the worker.
    def new_sessions() -> bool:
        clock.poll()
        whole = 0
        for tid in jaeger.trace_ids(service):
            spans = jaeger.trace(tid)
            sess = [s for s in spans if s.name == "spec.session"]
            if sess and sess[0].start > ok_ns:
                check_trace(spans, service=service)
                whole += 1
        return whole >= 3

    wait_for("whole new sessions in the restarted Jaeger", new_sessions, 60, 1.0)
    errors_after, dropped_after = losses()
    # The after window starts once this test's own Jaeger queries (and their JSON) are done:
    # on two cores they would otherwise compete with the loop being measured.
    t_after = time.monotonic()
    sleep_polling(clock, WINDOW_S)
    t_end = time.monotonic()
    errors_end, dropped_end = losses()

    assert demo.poll() is None, procs.tail(demo)
    procs.end(demo, signal.SIGINT)

    before, n0 = clock.median(t_before, t_down)
    during, n1 = clock.median(t_down, t_up)
    after, n2 = clock.median(t_after, t_end)
    gaps = [clock.longest_gap(*w) for w in ((t_before, t_down), (t_down, t_up), (t_after, t_end))]
    detail = (
        f"median ms/round before {before:.3f} ({n0} bursts), during {during:.3f} ({n1}), "
        f"after {after:.3f} ({n2}); longest gaps between lines "
        + ", ".join(f"{g:.2f}" for g in gaps)
        + " s"
    )
    # The loop did not wait on the exporter while Jaeger was away: no stop of a send's length.
    assert gaps[1] < MAX_GAP_S, detail
    assert before / FACTOR <= during <= before * FACTOR, detail
    assert before / FACTOR <= after <= before * FACTOR, detail
    # Losses: every failed send is an export error and its spans are counted as dropped.
    assert errors_down > errors_before and dropped_down > dropped_before, (
        (errors_before, dropped_before),
        (errors_down, dropped_down),
    )
    # Once Jaeger is back nothing more is lost.
    assert (errors_end, dropped_end) == (errors_after, dropped_after), (
        f"still losing spans after the restart: errors {errors_after} -> {errors_end}, "
        f"dropped {dropped_after} -> {dropped_end}"
    )
