"""From flags, knobs and arguments to exporters, and to an observer with its sinks.

:func:`build_exporters` serves all three publishers (in-process via :func:`build_observer`,
``memra-obs agent``, ``memra-obs tail``), so a knob fails the same way everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from . import flags
from .diagnostics import say_once
from .environment import (
    MEMRA_OBS_AGENT,
    MEMRA_OBS_SINKS,
    ConfigError,
    Settings,
    idle_knobs,
    unknown_knobs,
)
from .export import QueueSink, RecordExporter
from .observer import NOOP_OBSERVER, NoOpObserver, Observer
from .sinks.base import Sink
from .sinks.stderr import StderrSink

if TYPE_CHECKING:
    from .agent.ring import RingSink

__all__ = [
    "Exporters",
    "build_exporters",
    "build_observer",
    "delivered",
    "sessions_sampled",
    "span_outputs",
]


@dataclass
class Exporters:
    """What :func:`build_exporters` made; ``close()`` stops the server (not the exporters)."""

    spans: Any = None
    prom: Any = None
    server: Any = None
    where: list[str] = field(default_factory=list)  #: one line per destination, for banners
    requests: Any = None

    @property
    def all(self) -> list[RecordExporter]:
        return [x for x in (self.spans, self.prom, self.requests) if x is not None]

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def abandon(self, shut: bool = True) -> None:
        """A build that failed: its exporters shut down (``shut``: no queue did), its collector
        gone from the registry (a retry was told it "takes its names over"), its server closed."""
        for ex in (self.spans, self.requests) if shut else ():
            if ex is not None:
                ex.shutdown(0.5)
        if self.prom is not None:
            self.prom.unregister()
        self.close()


def build_exporters(
    st: Settings,
    *,
    worker: str = "",
    worker_label: bool = False,
    registry: Any = None,
    env: Mapping[str, str] | None = None,
    strict: bool = True,
    retire: Callable[[], None] | None = None,
    open_sessions: int | None = None,
) -> Exporters:
    """The exporters ``st.sinks`` asks for: spans (``otel``), metrics (``prometheus``, into
    ``registry``, default the global one) and ``/metrics``; ``worker_label`` labels every series
    ``worker``. An unbindable address: ConfigError with ``strict`` (the CLI), else said once.
    ``open_sessions``: how many each keeps open at once (None: one process's bound)."""
    out = Exporters()
    _say_unknown(env)
    cap = {} if open_sessions is None else {"max_open": open_sessions}
    try:
        if st.requests_file:
            out.requests = _requests(st, **cap)
            out.where.append(f"requests -> {out.requests.path}")
        if "otel" in st.sinks:
            from .otel import build_span_exporter

            out.spans = build_span_exporter(st, env=env, **cap)
            if out.spans is not None:
                urls = [getattr(o.sender, "url", "?") for o in out.spans.outputs]
                out.where.append("spans -> " + ", ".join(urls))
        if "prometheus" in st.sinks:
            if retire is not None:  # what can be refused is built: the observer replaced
                retire()  # gives up the registry's names unsaid (and the /metrics port)
            out.prom = _prometheus(
                st, registry, worker, worker_label, out.spans is not None, strict, **cap
            )
            if out.prom is not None and st.metrics_addr is None:
                out.where.append(f"metrics -> the registry only ({st.named('metrics_addr')} empty)")
            elif out.prom is not None:
                out.server = _serve(st, out.prom, strict)
                if out.server is not None:
                    out.where.append(f"/metrics on {out.server.url}")
    except BaseException:
        out.abandon()
        raise
    return out


def span_outputs(exporters: Sequence[Any]) -> list[Any]:
    """The span outputs of ``exporters`` (each with ``name``, ``exported`` and ``dropped``)."""
    return [o for x in exporters if getattr(x, "signal", "") == "spans" for o in x.outputs]


def delivered(exporters: Sequence[Any]) -> str:
    """What each span output of ``exporters`` did, for a closing line (``; spans to NAME: N
    exported, M dropped``): a banner that said where spans go does not say they arrived."""
    return "".join(
        f"; spans to {o.name}: {o.exported} exported, {o.dropped} dropped"
        for o in span_outputs(exporters)
    )


def _say_unknown(env: Mapping[str, str] | None, st: Settings | None = None) -> None:
    """Names no knob reads; with ``st``, knobs only its off sinks read (in agent mode: those
    only the agent reads)."""
    env = os.environ if env is None else env
    for note in unknown_knobs(env) + (idle_knobs(st, env) if st is not None else []):
        say_once(f"knob:{note.split()[0]}", note)


def _requests(st: Settings, **cap: int) -> RecordExporter:
    from .requests import RequestsExporter

    try:
        return RequestsExporter(st.requests_file or "", detailed=st.requests_detail, **cap)
    except OSError as exc:  # a missing directory, a directory, no permission
        var = st.named("requests_file")
        raise ConfigError(f"{var}={st.requests_file!r}: {exc.strerror}") from None


def sessions_sampled(env: Mapping[str, str] | None = None) -> Callable[[int], bool] | None:
    """``OTEL_TRACES_SAMPLER``'s decision on a session's trace id, for whoever makes the ids:
    a loop (in agent mode the worker, not the agent) or the tail's rebuild."""
    from .otel.config import traces_sampler

    return traces_sampler(os.environ if env is None else env)


def _prometheus(
    st: Settings,
    registry: Any,
    worker: str,
    worker_label: bool,
    traced: bool,
    strict: bool,
    max_open: int = 8192,
) -> Any:
    """The Prometheus exporter, or None (said once) when the registry has its names already
    (an app's own ``memra_*`` metric, a second copy of memra_obs, a reload): the observer's
    spans and lines go on, as without a port (strict, the CLI: raised)."""
    from .otel.spans import round_span_ids
    from .prom import PrometheusExporter

    try:
        return PrometheusExporter(
            registry=registry,
            worker=worker,
            worker_label=worker_label,
            round_span_id=round_span_ids(st.round_spans) if traced else None,
            advice_window=st.advice_window,
            max_families=st.max_families,
            plain_step_ns=None if st.plain_step_ms is None else st.plain_step_ms * 1e6,
            traced=traced,
            max_sessions=max_open,
        )
    except ValueError as exc:
        if strict or "Duplicated timeseries" not in str(exc):
            raise
        say_once("prom-clash", f"{MEMRA_OBS_SINKS}: the prometheus sink cannot join the registry "
                 f"({exc}); carrying on without it (rename the other metrics, or leave "
                 "prometheus out of the sinks)")  # fmt: skip
        return None


_LOOPBACK = frozenset(("127.0.0.1", "::1", "localhost"))


def _serve(st: Settings, prom: Any, strict: bool) -> Any:
    """``/metrics`` for ``prom`` (the note its forked children say), or None (said once)."""
    from prometheus_client import REGISTRY

    from .prom import serve_metrics

    host, port = st.metrics_addr  # type: ignore[misc]
    var = st.named("metrics_addr")  # the argument, when configure() was given one
    try:
        server = serve_metrics(
            (host, port),
            registry=prom.registry,
            certfile=st.metrics_tls_cert,
            keyfile=st.metrics_tls_key,
            basic_auth=st.metrics_basic_auth,
        )
    except OSError as exc:
        why = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or exc
        hint = (  # labelled by worker: the agent's or a tail's, where agent mode is no answer
            f"set {var} to another port, or port 0 for any free one (another memra-obs agent or "
            "tail may hold this one)" if prom.worker_label
            else f"several workers on one host: agent mode ({MEMRA_OBS_AGENT}) or one port per rank"
        )  # fmt: skip
        msg = f"{var}={host}:{port}: cannot serve /metrics there ({why}); {hint}"
        if strict:
            raise ConfigError(msg) from None
        if exc.errno == errno.EADDRINUSE and prom.registry is REGISTRY:  # the app's own server?
            msg += (f"; if this process serves prometheus_client's REGISTRY there itself "
                    f"(opentelemetry-exporter-prometheus's default port is 9464), that /metrics "
                    f"has memra_obs's metrics already: set {var} empty")  # fmt: skip
        say_once(f"metrics-addr:{host}:{port}", msg + "; carrying on without /metrics")
        return None
    if st.metrics_basic_auth and not st.metrics_tls_cert and host not in _LOOPBACK:
        say_once("metrics-auth-plain", f"{var}={host}:{server.port} asks basic auth over plain "
                 f"HTTP: the password crosses the network readable; set {st.named('metrics_tls_cert')}"
                 f" and {st.named('metrics_tls_key')}")  # fmt: skip
    prom.fork_note = (
        f"{var}={host}:{server.port}: a forked process cannot serve /metrics "
        f"there (its parent does); several workers on one host: agent mode ({MEMRA_OBS_AGENT}) "
        "or one port per rank; carrying on without /metrics"
    )
    return server


def _ring(st: Settings, registry: Any) -> RingSink | None:
    """This process's ring (agent mode): the agent publishes, so a ``registry`` goes unused.
    None without ``MEMRA_OBS_AGENT``, or (said once) with no sink for the agent to publish."""
    from .agent.ring import RingSink

    if not st.agent:
        return None
    if not st.sinks & {"otel", "prometheus"}:
        say_once("agent-no-sinks", f"{st.named('agent')}={st.agent}: no ring is written, since "
                 f"{st.named('sinks')} names neither otel nor prometheus (set "
                 f"{st.named('sinks')}=otel,prometheus)")  # fmt: skip
        return None
    if registry is not None and "prometheus" in st.sinks:
        say_once("agent-registry", f"{st.named('agent')}={st.agent}: the registry argument is "
                 "not used: in agent mode memra-obs agent publishes the metrics")  # fmt: skip
    return RingSink.create(st.agent, worker=st.worker, slots=st.ring_slots)


def _seed_flags(
    env: Mapping[str, str] | None, level: int | None, prof: bool | None
) -> tuple[int, bool]:
    """The seed's flags: the arguments, else read from ``env``, else (once) from ``os.environ``."""
    if env is not None:
        if level is None:
            level = flags.spec_trace_level_from(
                env.get(flags.MEMRA_SPEC_TRACE), env.get(flags.MEMRA_GLM5_SPEC_TRACE)
            )
        if prof is None:
            prof = env.get(flags.MEMRA_SPEC_PROF) == "1"
    lvl = flags.spec_trace_level() if level is None else level
    return lvl, flags.spec_prof_on() if prof is None else prof


#: DESIGN §2's ecosystem variable, answered: that mode's /metrics cannot show this collector.
_MULTIPROC = (
    "PROMETHEUS_MULTIPROC_DIR is set: prometheus_client's multiprocess /metrics "
    "(MultiProcessCollector) does not reach memra_obs's metrics, and drops exemplars; one "
    f"/metrics for the host's workers: agent mode ({MEMRA_OBS_AGENT}, memra-obs agent)"
)


def _nvtx(st: Settings) -> list[Sink]:
    """The NVTX sink where asked for and a profiler attached (none: no sink, nothing to pay)."""
    if "nvtx" not in st.sinks:
        return []
    from .sinks.nvtx import NvtxSink

    nv = NvtxSink()
    return [nv] if nv.range_hook is not None else []


def _undo(*closers: Callable[[], object] | None) -> None:
    """Close what a build made before it failed: none of it is left running."""
    for close in closers:
        if close is not None:
            with contextlib.suppress(Exception):
                close()


def build_observer(
    *,
    level: int | None = None,
    prof: bool | None = None,
    extra_sinks: Sequence[Sink] = (),
    exporters: Sequence[RecordExporter] = (),
    registry: Any = None,
    memory: Callable[[], list[tuple[int, int]]] | None = None,
    env: Mapping[str, str] | None = None,
    strict: bool = False,
    retire: Callable[[], None] | None = None,
    **knobs: Any,
) -> Observer | NoOpObserver:
    """An observer: ``level``/``prof`` override the seed's flags (else read from ``env``, or once
    from ``os.environ``), ``knobs`` are :class:`Settings` fields, ``exporters`` extra consumers
    behind the queue, ``strict`` as in :func:`build_exporters`. Nothing on: NOOP_OBSERVER."""
    st = Settings.resolve(env, **knobs)
    _say_unknown(env, st)  # before a silent no-op observer
    lvl, prf = _seed_flags(env, level, prof)
    sinks: list[Sink] = [lines := StderrSink(lvl, prf)] if lvl >= 1 or prf else []
    ring = _ring(st, registry)  # agent mode: the agent publishes; here, the requests file only
    built, qsink = Exporters(), None  # first: an address that cannot be served is the one line said
    try:  # (a knob refused, a thread under a pids limit: none of what was built is left running)
        here = st if ring is None else replace(st, sinks=frozenset())  # what this process publishes
        if here.sinks & {"otel", "prometheus"} or st.requests_file:
            built = build_exporters(here, worker=st.worker, registry=registry, env=env,
                                    strict=strict, retire=retire)  # fmt: skip
        if ring is not None:
            sinks.append(ring)
            built.where.append(f"records -> agent rings in {ring.directory}")
        elif built.prom is not None and (os.environ if env is None else env).get(
            "PROMETHEUS_MULTIPROC_DIR"
        ):
            say_once("multiproc", _MULTIPROC)
        sinks.extend(_nvtx(st))
        if consumers := [*exporters, *built.all]:
            qsink = QueueSink(consumers, capacity=st.queue_size, interval_ms=st.export_interval_ms)
            sinks.append(qsink)
        sinks.extend(extra_sinks)
        if not sinks:
            return NOOP_OBSERVER
        obs = Observer(sinks, level=lvl, prof=prf, clock=st.clock, memory=memory, worker=st.worker,
                       settings=st, queue=qsink, closers=(built.close,), where=built.where,
                       sampled=sessions_sampled(env))  # fmt: skip
    except BaseException:
        shut = getattr(qsink, "shutdown", None)  # (it shuts the exporters down, else abandon)
        _undo(shut, partial(built.abandon, shut is None), getattr(ring, "shutdown", None))
        raise
    if built.prom is not None:
        built.prom.attach_queue(qsink)
        built.prom.watch("dropped", "rounds", lambda: obs.dropped_rounds)
        if lvl >= 1 or prf:  # the legacy lines a closed stderr refused (said once)
            built.prom.watch("errors", "lines", lambda: lines.writer.errors)
    if ring is not None:  # the agent publishes it
        ring.dropped_rounds = lambda: obs.dropped_rounds
    return obs
