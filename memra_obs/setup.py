"""Wiring: from flags, knobs and arguments to an observer with its sinks.

This is the only module that knows every sink. Argument > environment > default; a bad
knob raises :class:`memra_obs.environment.ConfigError` here, at start-up, naming the variable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import flags
from .environment import (
    MEMRA_OBS_METRICS_TLS_CERT,
    MEMRA_OBS_METRICS_TLS_KEY,
    ConfigError,
    Settings,
)
from .export import QueueSink, RecordExporter
from .observer import NOOP_OBSERVER, NoOpObserver, Observer
from .sinks.base import Sink
from .sinks.stderr import StderrSink

__all__ = ["build_observer"]


def build_observer(
    *,
    level: int | None = None,
    prof: bool | None = None,
    extra_sinks: Sequence[Sink] = (),
    exporters: Sequence[RecordExporter] = (),
    registry: Any = None,
    memory: Callable[[], list[tuple[int, int]]] | None = None,
    env: Mapping[str, str] | None = None,
    **knobs: Any,
) -> Observer | NoOpObserver:
    """Build an observer.

    ``level``/``prof`` override the seed's flags; ``knobs`` are the :class:`Settings` fields
    (``sinks``, ``metrics_addr``, ``spans_file``, ``agent``, ``clock``, ``round_spans``,
    ``queue_size``, ``export_interval_ms``, ``worker``). ``exporters`` are extra off-loop
    consumers behind the queue; ``registry`` is the prometheus_client registry to use
    (default: the global one). Nothing on -> :data:`NOOP_OBSERVER`.
    """
    st = Settings.resolve(env, **knobs)
    lvl = flags.spec_trace_level() if level is None else level
    prf = flags.spec_prof_on() if prof is None else prof
    sinks: list[Sink] = []
    closers: list[Callable[[], None]] = []
    if lvl >= 1 or prf:
        sinks.append(StderrSink(lvl, prf))
    if "nvtx" in st.sinks:
        from .sinks.nvtx import NvtxSink

        sinks.append(NvtxSink())
    consumers: list[RecordExporter] = list(exporters)
    if st.sinks & {"otel", "prometheus"}:
        if st.agent:
            from .agent.ring import RingSink

            sinks.append(RingSink.create(st.agent, worker=st.worker, slots=st.ring_slots))
        else:
            if "otel" in st.sinks:
                from .otel import build_span_exporter

                span_ex = build_span_exporter(st, env=env)
                if span_ex is not None:
                    consumers.append(span_ex)
            if "prometheus" in st.sinks:
                from .prom import PrometheusExporter, serve_metrics

                prom = PrometheusExporter(
                    registry=registry, worker=st.worker, round_span_id=round_span_ids(st)
                )
                consumers.append(prom)
                if st.metrics_addr is not None:
                    if bool(st.metrics_tls_cert) != bool(st.metrics_tls_key):
                        raise ConfigError(
                            f"{MEMRA_OBS_METRICS_TLS_CERT} and {MEMRA_OBS_METRICS_TLS_KEY} go "
                            "together: set both (HTTPS) or neither"
                        )
                    server = serve_metrics(
                        st.metrics_addr,
                        registry=prom.registry,
                        certfile=st.metrics_tls_cert,
                        keyfile=st.metrics_tls_key,
                        basic_auth=st.metrics_basic_auth,
                    )
                    closers.append(server.close)
    qsink: QueueSink | None = None
    if consumers:
        qsink = QueueSink(consumers, capacity=st.queue_size, interval_ms=st.export_interval_ms)
        sinks.append(qsink)
        for c in consumers:
            attach = getattr(c, "attach_queue", None)
            if attach is not None:
                attach(qsink)
    sinks.extend(extra_sinks)
    if not sinks:
        return NOOP_OBSERVER
    obs = Observer(sinks, level=lvl, prof=prf, clock=st.clock, memory=memory, worker=st.worker)
    obs.settings = st
    obs.queue = qsink
    obs.closers = closers
    return obs


def round_span_ids(st: Settings) -> Callable[[Any, Any], int] | None:
    """The PrometheusExporter's ``round_span_id`` hook for ``st``: round exemplars name the
    round's span when spans are on and the round has one (a worker, the agent, the tail)."""
    if "otel" not in st.sinks or st.round_spans == 0:
        return None
    from .otel.spans import round_span_id

    cap = st.round_spans

    def span_of(s: Any, r: Any) -> int:
        return round_span_id(s.span_id, r.index) if r.index < cap else 0

    return span_of
