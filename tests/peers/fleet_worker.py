"""A worker for the fleet test that needs sessions the demo never makes: a failed request, a
slow request, fast ones, each in a trace the test chose (so it knows which sampling policy
must keep or drop it), plus one slow trace with no `spec.session` span at all.

    python fleet_worker.py PLAN.json

PLAN: ``{"sessions": [{"trace_id": hex32, "kind": "fast"|"slow"|"error"}], "other":
[hex32, ...], "slow_s": 5.6}``. Spans go where ``OTEL_EXPORTER_OTLP_ENDPOINT`` says.

The project is used only through its public API (README "Instrumenting a loop"): a session
joins the caller's current span, so the test's trace id is put in the context as a remote
parent, exactly as a serving framework's request span would be.
"""

from __future__ import annotations

import json
import sys
import time

from opentelemetry import context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

import memra_obs


def run_session(obs, trace_id: int, kind: str, slow_s: float) -> None:
    parent = SpanContext(trace_id, 0x1234ABCD, is_remote=True, trace_flags=TraceFlags(1))
    token = context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))
    try:
        with obs.session("glm5") as s:
            s.lap("cache_alloc")
            s.lap("prime")
            bursts = 4
            for _ in range(bursts):
                b = obs_burst(s)
                if kind == "slow":
                    time.sleep(slow_s / bursts)
                b.end()
            if kind == "error":
                raise RuntimeError("request failed")
    except RuntimeError:
        pass
    finally:
        context.detach(token)


def obs_burst(s):
    b = s.burst(k=4)
    for j in (4, 2, 0):
        b.begin_round()
        b.end_draft()
        b.end_verify()
        b.end_accept()
        b.end_rollback()
        b.end_round(k=4, j=j, ctx=1000)
    return b


def fixed_ids(trace_ids: list[int]):
    """An SDK id generator handing out the planned trace ids (span ids: a counter)."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class FixedIds(IdGenerator):
        def __init__(self) -> None:
            self.trace_ids = list(trace_ids)
            self.n = 0

        def generate_trace_id(self) -> int:
            return self.trace_ids.pop(0)

        def generate_span_id(self) -> int:
            self.n += 1
            return 0xABC000 + self.n

        def is_trace_id_random(self) -> bool:
            return False

    return FixedIds()


def run_other(trace_ids: list[int], seconds: float) -> None:
    """Slow traces made with the plain OpenTelemetry SDK: one 'other.work' span each."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(id_generator=fixed_ids(trace_ids))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter()))
    tracer = provider.get_tracer("fleet-test")
    t0 = time.time_ns()
    for _ in trace_ids[:]:
        span = tracer.start_span("other.work", start_time=t0)
        span.end(end_time=t0 + int(seconds * 1e9))
    provider.shutdown()


def main() -> int:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    obs = memra_obs.get_observer()
    slow_s = float(plan.get("slow_s", 5.6))
    # The slow session first: its spans take slow_s to come; the others meanwhile.
    order = sorted(plan["sessions"], key=lambda x: x["kind"] != "slow")
    for item in order:
        run_session(obs, int(item["trace_id"], 16), item["kind"], slow_s)
    if plan.get("other"):
        run_other([int(t, 16) for t in plan["other"]], slow_s)
    obs.shutdown(10.0)
    print(f"fleet worker done: sessions={len(order)} other={len(plan.get('other', []))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
