"""``memra-obs agent``: the exporters the environment asks for around an :class:`Agent`
(:func:`build_agent`), the agent's own health on its ``/metrics``, and the command."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..environment import MEMRA_OBS_AGENT, MEMRA_OBS_SINKS, ConfigError, Settings
from ..export import RecordExporter
from ..wiring import build_exporters
from .loop import Agent, AgentBusy
from .ring import check_cpu, ring_directory

__all__ = ["AgentCollector", "build_agent", "default_directory", "main"]

_COUNTERS = (
    ("memra_obs_agent_records", "Records of a worker the agent read from its ring and published "
     "(context it replays or makes up is not counted)."),
    ("memra_obs_agent_lost_records", "Records of a worker that never reached the exporters: "
     "overwritten in its ring before the agent read them, or refused by the writer."),
    ("memra_obs_agent_written_records", "Records a worker handed its ring, as its ring says "
     "(refused ones included); records + lost_records equals it once the ring is read."),
)  # fmt: skip


def default_directory() -> str:
    """In memory (like a k8s ``emptyDir: {medium: Memory}``) where there is /dev/shm."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "memra-obs")


class AgentCollector(Collector):
    """The agent's own health, from its totals at scrape time (nothing counted twice)."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily("memra_obs_agent_rings", "Worker rings the agent is reading "
                                "(one per worker process).", value=self._agent.rings)  # fmt: skip
        counts = sorted(self._agent.counts().items())
        for i, (name, doc) in enumerate(_COUNTERS):
            c = CounterMetricFamily(name, doc, labels=["worker"])
            for w, n in counts:
                c.add_metric([w], n[i])
            yield c


def build_agent(directory: str | None = None, *, env: Mapping[str, str] | None = None,
                registry: Any = None, exporters: Sequence[RecordExporter] = (),
                **agent_kw: Any) -> tuple[Agent, list[Callable[[], None]], Any]:  # fmt: skip
    """The agent the environment asks for: ``(agent, closers, metrics_server_or_None)``, sinks
    ``MEMRA_OBS_SINKS`` (unset = ``otel,prometheus``): spans where the in-process observer sends
    them, metrics labelled ``worker`` to a fresh registry served on ``MEMRA_OBS_METRICS_ADDR``."""
    check_cpu()
    env = os.environ if env is None else env
    knobs = {} if env.get(MEMRA_OBS_SINKS, "").strip() else {"sinks": "otel,prometheus"}
    st = Settings.resolve(env, **knobs)
    directory = ring_directory(directory or st.agent or default_directory())
    registry = CollectorRegistry() if registry is None else registry
    built = build_exporters(st, worker_label=True, registry=registry, env=env)
    try:
        agent = Agent(directory, [*exporters, *built.all], **agent_kw)
    except BaseException:
        for c in built.all:
            c.shutdown(1.0)
        built.close()
        raise
    prom, spans = built.prom, built.spans
    if prom is not None:  # the instrument's own health, as in-process
        prom.watch("dropped", "ring", agent.lost_total)
        prom.watch("errors", "records", lambda: agent.worker.errors)
        prom.watch("errors", "metrics", lambda: prom.export_errors)
        if spans is not None:
            prom.watch("dropped", "spans", lambda: spans.dropped_spans)
            prom.watch("errors", "spans", lambda: spans.export_errors)
        registry.register(AgentCollector(agent))
    return agent, [built.close], built.server


def set_priority(priority: str) -> None:
    """On a contended core a runnable agent delays a loop's wake-up; ``idle`` may starve it
    instead (the rings then overflow, counted)."""
    if priority == "idle":
        with contextlib.suppress(AttributeError, OSError):  # no SCHED_IDLE here: nice 10
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
    if priority in ("idle", "low"):
        os.nice(10)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memra-obs agent",
        description="Publish every local worker's ring (agent mode): spans as configured by "
        "OTEL_* / MEMRA_OBS_SPANS_FILE, one /metrics on MEMRA_OBS_METRICS_ADDR. SIGTERM "
        "drains, flushes and exits.",
    )
    # fmt: off
    p.add_argument("--dir", default=None,
                   help=f"ring directory (default ${MEMRA_OBS_AGENT}, else {default_directory()})")
    p.add_argument("--poll-ms", type=float, default=20.0,
                   help="sleep between passes once every ring is read (default 20)")
    p.add_argument("--priority", choices=("idle", "low", "normal"), default="idle",
                   help="CPU priority of this process: idle = SCHED_IDLE (runs only on cycles the "
                   "serving loop leaves; the default), low = nice 10, normal = unchanged")
    p.add_argument("--once", action="store_true", help="publish what the rings hold now, then exit")
    p.add_argument("--keep", action="store_true", help="do not remove rings of exited workers")
    # fmt: on
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``memra-obs agent``: runs until SIGTERM/SIGINT (or ``--once``); 0 on a clean exit."""
    args = _parser().parse_args(argv)
    if args.poll_ms <= 0:
        raise ConfigError(f"--poll-ms={args.poll_ms}: expected a positive number")
    stop = threading.Event()  # handlers first: a SIGTERM during start-up still drains
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        set_priority(args.priority)
        agent, closers, server = build_agent(
            args.dir, poll_s=args.poll_ms / 1e3, cleanup=not args.keep
        )
        metrics = "" if server is None else f"; /metrics on {server.url}"
        print(f"[memra-obs agent] publishing rings in {agent.directory}{metrics}", file=sys.stderr)
        try:
            if args.once:
                agent.drain()
            else:
                agent.run(stop)
        finally:
            agent.close()
            for close in closers:
                close()
        published = sum(c[0] for c in agent.counts().values())
        print(f"[memra-obs agent] done: published={published} lost={agent.lost_total()} "
              f"rings_removed={agent.rings_removed}", file=sys.stderr, flush=True)  # fmt: skip
        return 0
    except AgentBusy as exc:
        print(f"memra-obs agent: {exc}", file=sys.stderr)
        return 2
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
