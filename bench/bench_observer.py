"""What the observer costs a spec loop, against a naive OpenTelemetry SDK implementation.

    python bench/bench_observer.py [--rounds 6000] [--tail-rounds 1000]

Per round of five phases (CPU only, no device, sync clock):

  (a) everything off (``NOOP_OBSERVER``) vs the same loop uninstrumented;
  (b) the observer with every sink on: legacy lines (level 2 + profile) to a null stream,
      spans through :func:`memra_obs.otel.build_span_exporter` over OTLP/HTTP to a loopback
      receiver, and ``memra_obs.prom.PrometheusExporter`` when it imports;
  (c) the naive way: the OTel SDK called on the loop (a round span + 5 phase spans with
      explicit timestamps, BatchSpanProcessor + the SDK's OTLP/HTTP exporter to the same
      receiver) plus 8 prometheus_client observations with ``.labels()`` lookups;
  (d) (b) at level 1 with the SDK in place of memra_obs' span writers: the same records,
      on the same export worker, made into SDK spans (session, round, 5 phases: fewer
      than (b) builds) and sent by BatchSpanProcessor + the SDK's OTLP/HTTP exporter. What
      DESIGN §9 asks of ``memra_obs/otel/otlp.py``: does anything else reach the goal? (The
      SDK's ``OTEL_BSP_*`` variables apply to (c) and (d): try smaller export batches.)

"loop" is the loop thread's own CPU per round (``time.thread_time``); "total" is the whole
process's CPU per round (``time.process_time``) including background export, measured
until everything is flushed. The receiver runs in a child process so it is in neither.

Then the tail: rounds that each release the GIL for 2 ms (``time.sleep(0.002)`` standing
in for device work); the round period minus 2 ms, mean and p99, for no telemetry, (c), (b).

Goals (issue 4): (a) within noise; (b) loop >= 20x and total >= 5x below (c); tail (b)
p99 within 0.3 ms of no telemetry (issue 12; issue 4 asked 1 ms). Not a pass/fail test: it
prints a table.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

from memra_obs.environment import Settings
from memra_obs.export import QueueSink
from memra_obs.linewriter import LineWriter
from memra_obs.observer import NOOP_OBSERVER, Observer
from memra_obs.otel import build_span_exporter
from memra_obs.sinks.stderr import StderrSink
from memra_obs.timeline import RoundRecord, SessionEndRecord, SessionRecord, to_epoch_ns

ROUNDS_PER_BURST = 16
BURSTS_PER_SESSION = 16  # 256 rounds a session: every round gets spans (the default cap)

RECEIVER = textwrap.dedent(
    """
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *a):
            pass
    s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(s.server_address[1], flush=True)
    s.serve_forever()
    """
)


def start_receiver() -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    port = int(p.stdout.readline())
    return p, f"http://127.0.0.1:{port}"


def work() -> None:
    """A phase's own Python, as small as it gets (one call)."""
    return None


def work_1us() -> None:
    """A phase with ~1 µs of its own Python (a real phase launches kernels: far more)."""
    sum(range(24))


# ------------------------------------------------------------------------------ the loops


def loop_bare(
    n: int, sleep_s: float = 0.0, stamps: list[float] | None = None, work: Callable[[], None] = work
) -> None:
    """The uninstrumented loop: the observed loops' work, phase for phase (draft, verify's
    sleep, accept, rollback, maint; a fifth work() here gave "everything off" a phase free)."""
    for _ in range(n):
        work()
        if sleep_s:
            time.sleep(sleep_s)
        work()
        work()
        work()
        if stamps is not None:
            stamps.append(time.perf_counter())


def loop_observed(
    obs: Any,
    n: int,
    sleep_s: float = 0.0,
    stamps: list[float] | None = None,
    work: Callable[[], None] = work,
) -> None:
    """The same loop talking to an observer (no-op or real), in sessions of 256 rounds."""
    done = 0
    while done < n:
        s = obs.session("glm5")
        for _ in range(BURSTS_PER_SESSION):
            if done >= n:
                break
            b = s.burst(4)
            for i in range(min(ROUNDS_PER_BURST, n - done)):
                b.begin_round()
                work()
                b.end_draft()
                if sleep_s:
                    time.sleep(sleep_s)
                b.end_verify()
                work()
                b.end_accept()
                work()
                b.end_rollback()
                work()
                b.end_round(4, i & 3, 1000 + done, 0)
                done += 1
                if stamps is not None:
                    stamps.append(time.perf_counter())
            b.end()
        s.end()


def sdk_tracer(url: str, name: str) -> tuple[Any, Any]:
    """The SDK's provider and a tracer: BatchSpanProcessor + its OTLP/HTTP exporter to ``url``,
    with a queue big enough that nothing is dropped (dropping would flatter the SDK)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    exporter = OTLPSpanExporter(endpoint=url + "/v1/traces")
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 16))
    return provider, provider.get_tracer(name)


class Naive:
    """(c): the SDK on the loop's thread, spans with explicit timestamps, plus 8
    prometheus_client observations with .labels() lookups per round."""

    PHASES = ("draft", "verify", "accept", "rollback", "maint")

    def __init__(self, url: str) -> None:
        import prometheus_client as pc
        from opentelemetry import trace

        self.provider, self.tracer = sdk_tracer(url, "naive")
        self.trace = trace
        reg = pc.CollectorRegistry()
        self.round_h = pc.Histogram("naive_round_seconds", "r", ["family"], registry=reg)
        self.phase_h = pc.Histogram("naive_phase_seconds", "p", ["family", "phase"], registry=reg)
        self.drafted = pc.Histogram("naive_drafted_tokens", "d", ["family"], registry=reg)
        self.accepted = pc.Histogram("naive_accepted_tokens", "a", ["family"], registry=reg)

    def loop(self, n: int, sleep_s: float = 0.0, stamps: list[float] | None = None) -> None:
        pcn = time.perf_counter_ns
        off = time.time_ns() - pcn()
        tracer = self.tracer
        set_in = self.trace.set_span_in_context
        for i in range(n):
            t0 = pcn()
            work()
            t1 = pcn()
            if sleep_s:
                time.sleep(sleep_s)
            t2 = pcn()
            work()
            t3 = pcn()
            work()
            t4 = pcn()
            work()
            t5 = pcn()
            t = (t0, t1, t2, t3, t4, t5)
            parent = tracer.start_span(
                "spec.round",
                start_time=t0 + off,
                attributes={"memra.spec.k": 4, "memra.spec.j": i & 3},
            )
            ctx = set_in(parent)
            for p, name in enumerate(self.PHASES):
                sp = tracer.start_span("spec." + name, context=ctx, start_time=t[p] + off)
                sp.end(end_time=t[p + 1] + off)
            parent.end(end_time=t5 + off)
            self.round_h.labels("glm5").observe((t5 - t0) / 1e9)
            for p, name in enumerate(self.PHASES):
                self.phase_h.labels("glm5", name).observe((t[p + 1] - t[p]) / 1e9)
            self.drafted.labels("glm5").observe(4)
            self.accepted.labels("glm5").observe(i & 3)
            if stamps is not None:
                stamps.append(time.perf_counter())

    def flush(self) -> None:
        self.provider.force_flush()

    def shutdown(self) -> None:
        self.provider.shutdown()


class SdkSpans:
    """(d): a RecordExporter that hands the observer's records to the OTel SDK."""

    PHASES = Naive.PHASES

    def __init__(self, url: str) -> None:
        from opentelemetry import trace

        self.provider, self.tracer = sdk_tracer(url, "sdk-behind-queue")
        self.set_in = trace.set_span_in_context
        self.open: dict[int, tuple[Any, Any, Any]] = {}  # session -> (record, span, context)
        self.spans = 0

    def export(self, batch: Any) -> None:
        tracer = self.tracer
        for r in batch:
            t = type(r)
            if t is RoundRecord:
                s, _, ctx = self.open[r.session]
                b = [to_epoch_ns(s, x) for x in r.t_ns_mono]
                rs = tracer.start_span(
                    "spec.round",
                    context=ctx,
                    start_time=b[0],
                    attributes={"memra.spec.k": r.k, "memra.spec.j": r.j},
                )
                rctx = self.set_in(rs)
                for p, name in enumerate(self.PHASES):
                    sp = tracer.start_span("spec." + name, context=rctx, start_time=b[p])
                    sp.end(end_time=b[p + 1])
                rs.end(end_time=b[5])
                self.spans += 6
            elif t is SessionRecord:
                sp = tracer.start_span("spec.session", start_time=to_epoch_ns(r, r.start_ns_mono))
                self.open[r.session] = (r, sp, self.set_in(sp))
            elif t is SessionEndRecord:
                s, sp, _ = self.open.pop(r.session)
                sp.end(end_time=to_epoch_ns(s, r.end_ns_mono))
                self.spans += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self.provider.shutdown()


def build_sdk(url: str) -> Observer:
    """(d): (b) at level 1 without the profile, the SDK writing the spans."""
    import prometheus_client as pc

    from memra_obs.prom import PrometheusExporter

    null = open(os.devnull, "w")  # noqa: SIM115
    q = QueueSink(
        [SdkSpans(url), PrometheusExporter(registry=pc.CollectorRegistry())], capacity=1 << 16
    )
    sinks = [StderrSink(1, False, writer=LineWriter(null)), q]
    return Observer(sinks, level=1, prof=False, memory=lambda: [(0, 80_000)], queue=q)


def build_full(url: str, level: int = 1, prof: bool = True) -> tuple[Observer, Any, list[str]]:
    """(b): every sink on — legacy lines at ``level`` (+ the profile), spans, Prometheus."""
    notes = []
    span_ex = build_span_exporter(
        Settings(round_spans=1 << 20), env={"OTEL_EXPORTER_OTLP_ENDPOINT": url}
    )
    consumers: list[Any] = [span_ex]
    try:
        import prometheus_client as pc

        from memra_obs.prom import PrometheusExporter

        consumers.append(PrometheusExporter(registry=pc.CollectorRegistry()))
        notes.append("prometheus: on")
    except Exception as exc:  # another engineer's module, maybe not there yet
        notes.append(f"prometheus: skipped ({exc!r})")
    null = open(os.devnull, "w")  # noqa: SIM115
    q = QueueSink(consumers, capacity=1 << 16)
    sinks = [StderrSink(level, prof, writer=LineWriter(null)), q]
    obs = Observer(sinks, level=level, prof=prof, memory=lambda: [(0, 80_000)], queue=q)
    return obs, span_ex, notes


# ------------------------------------------------------------------------------ measuring


def per_round(
    run: Callable[[int], None], n: int, block: int, flush: Callable[[], object] | None
) -> tuple[float, float]:
    """(loop µs/round from thread CPU, total process CPU µs/round incl. the final flush)."""
    loop = 0.0
    c0 = time.process_time()
    done = 0
    while done < n:
        m = min(block, n - done)
        t0 = time.thread_time()
        run(m)
        loop += time.thread_time() - t0
        done += m
        if flush is not None:
            flush()
    total = time.process_time() - c0
    return loop / n * 1e6, total / n * 1e6


def tail(run: Callable[[int, float, list[float]], None], n: int) -> tuple[float, float]:
    """Mean and p99 of (round period - 2 ms), in ms."""
    stamps: list[float] = [time.perf_counter()]
    run(n, 0.002, stamps)
    d = sorted((b - a - 0.002) * 1e3 for a, b in itertools.pairwise(stamps))
    return statistics.fmean(d), d[math.ceil(len(d) * 0.99) - 1]


D_LABEL = "(d) (b) with SDK spans behind the queue"
B_CONFIGS = (
    ("(b) all sinks on (legacy lines level 1)", 1, False),
    ("(b+prof) ... + MEMRA_SPEC_PROF=1 profile", 1, True),
    ("(b+L2+prof) ... level 2 + profile", 2, True),
)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6000, help="rounds per CPU measurement")
    ap.add_argument("--tail-rounds", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3, help="measurements per config (median)")
    args = ap.parse_args(argv)
    n, reps = args.rounds, args.repeats

    receiver, url = start_receiver()
    fulls: dict[str, tuple[Observer, Any]] = {}
    naive: Naive | None = None
    sdk: Observer | None = None
    try:
        for label, level, prof in B_CONFIGS:
            obs, span_ex, notes = build_full(url, level, prof)
            fulls[label] = (obs, span_ex)
        naive = Naive(url)
        sdk = build_sdk(url)

        # warm every path once
        loop_bare(1000)
        loop_observed(NOOP_OBSERVER, 1000)
        for obs, _ in fulls.values():
            loop_observed(obs, 512)
            obs.flush(30)
        naive.loop(300)
        naive.flush()
        loop_observed(sdk, 512)
        sdk.flush(30)
        gc.collect()

        # (a): interleaved repeats, so drift hits both alike
        a_rows = []
        for wlabel, w in (("empty phases", work), ("~1 µs of Python per phase", work_1us)):
            bare, noop = [], []
            for _ in range(max(5, reps * 3)):
                bare.append(per_round(lambda m, w=w: loop_bare(m, work=w), n * 5, n * 5, None)[0])
                noop.append(
                    per_round(
                        lambda m, w=w: loop_observed(NOOP_OBSERVER, m, work=w), n * 5, n * 5, None
                    )[0]
                )
            a_rows.append((wlabel, bare, noop))
        b_rows = []
        for label, (obs, _) in fulls.items():
            res = [
                per_round(lambda m, o=obs: loop_observed(o, m), n, 512, lambda o=obs: o.flush(30))
                for _ in range(reps)
            ]
            b_rows.append(
                (label, statistics.median(x[0] for x in res), statistics.median(x[1] for x in res))
            )
        d_res = [
            per_round(lambda m: loop_observed(sdk, m), n, 512, lambda: sdk.flush(30))
            for _ in range(reps)
        ]
        d_loop = statistics.median(x[0] for x in d_res)
        d_tot = statistics.median(x[1] for x in d_res)
        c_res = [per_round(naive.loop, n, 512, naive.flush) for _ in range(reps)]
        c_loop = statistics.median(x[0] for x in c_res)
        c_tot = statistics.median(x[1] for x in c_res)

        # the tail: configs interleaved, `reps` runs each, the median run's figures; each
        # run's export backlog is flushed after it, outside the timing: left to run on, it
        # lands in the next config's first rounds (~10 ms of CPU: a p99 of 1000 rounds moves)
        tails: dict[str, list[tuple[float, float]]] = {}
        b0, b1 = fulls[B_CONFIGS[0][0]][0], fulls[B_CONFIGS[1][0]][0]
        runs: tuple[
            tuple[str, Callable[[int, float, list[float]], None], Callable[[], object]], ...
        ] = (
            ("no telemetry", loop_bare, lambda: None),
            ("(c) naive SDK + prometheus_client", naive.loop, naive.flush),
            (B_CONFIGS[0][0], lambda k, s, st: loop_observed(b0, k, s, st), lambda: b0.flush(30)),
            (B_CONFIGS[1][0], lambda k, s, st: loop_observed(b1, k, s, st), lambda: b1.flush(30)),
            (D_LABEL, lambda k, s, st: loop_observed(sdk, k, s, st), lambda: sdk.flush(30)),
        )
        for _ in range(reps):
            for label, run, settle in runs:
                tails.setdefault(label, []).append(tail(run, args.tail_rounds))
                settle()
    finally:
        try:
            if naive is not None:
                naive.shutdown()
            if sdk is not None:
                sdk.shutdown(10)
            for obs, _ in fulls.values():
                obs.shutdown(10)
        finally:
            receiver.kill()
            receiver.wait()

    def median_run(xs: list[tuple[float, float]]) -> tuple[float, float]:
        return sorted(xs, key=lambda x: x[1])[len(xs) // 2]

    print(
        f"memra_obs observer benchmark — Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
        f"{n} rounds x {reps} (median); sessions of 256 rounds, every round spanned"
    )
    exp = sum(ex.exported_spans for _, ex in fulls.values())
    drop = sum(ex.dropped_spans for _, ex in fulls.values())
    qdrop = sum(o.queue.dropped for o, _ in fulls.values())
    print(
        f"  {'; '.join(notes)}; spans over OTLP/HTTP: {exp} exported, {drop} dropped; "
        f"records dropped at the queue: {qdrop}"
    )
    if sdk is not None:
        d_ex = sdk.queue.worker.exporters[0]
        print(
            f"  (d): {d_ex.spans} SDK spans ended; exporter errors {sdk.queue.worker.errors}, "
            f"records dropped at the queue {sdk.queue.dropped}"
        )
    print()
    print(f"  {'per round (5 phases)':46s} {'loop µs':>9s} {'total CPU µs':>13s}")
    for wlabel, bare, noop in a_rows:
        bm, nm = statistics.median(bare), statistics.median(noop)
        sd = max(statistics.pstdev(bare), statistics.pstdev(noop))
        print(f"  {'uninstrumented, ' + wlabel:46s} {bm:9.3f}")
        print(
            f"  {'(a) everything off (NOOP_OBSERVER)':46s} {nm:9.3f}"
            f"   delta {nm - bm:+.3f} µs ({(nm - bm) / bm:+.0%}); run-to-run sd {sd:.3f}"
        )
    for label, bl, bt in b_rows:
        print(
            f"  {label:46s} {bl:9.2f} {bt:13.2f}   (c)/this: {c_loop / bl:5.1f}x loop, "
            f"{c_tot / bt:4.1f}x total"
        )
    print(f"  {'(c) naive SDK + prometheus_client':46s} {c_loop:9.2f} {c_tot:13.2f}")
    print(f"  {D_LABEL:46s} {d_loop:9.2f} {d_tot:13.2f}")
    print(f"  {'goals, (c)/(b)':46s} {'>= 20x':>9s} {'>= 5x':>13s}")
    print()
    print(
        f"  tail: {args.tail_rounds} rounds releasing the GIL 2 ms each; round period - 2 ms "
        f"(median of {reps} interleaved runs)"
    )
    print(f"  {'':46s} {'mean ms':>9s} {'p99 ms':>9s}")
    none_p99 = median_run(tails["no telemetry"])[1]
    for label, *_ in runs:
        mean, p99 = median_run(tails[label])
        extra = f"   p99 {p99 - none_p99:+.3f} vs none" if label != "no telemetry" else ""
        print(f"  {label:46s} {mean:9.3f} {p99:9.3f}{extra}")
    print(f"  {'goal for (b): p99 within 0.3 ms of no telemetry':46s}")


if __name__ == "__main__":
    main()
