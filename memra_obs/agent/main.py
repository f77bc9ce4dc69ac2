"""``memra-obs agent``: the exporters the environment asks for around an :class:`Agent`
(:func:`build_agent`), the agent's own health on its ``/metrics``, and the command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..environment import MEMRA_OBS_AGENT, MEMRA_OBS_SINKS, ConfigError, Settings
from ..export import RecordExporter
from ..wiring import build_exporters
from .loop import Agent, AgentBusy
from .metrics import AgentCollector
from .ring import RingSink, ring_directory

__all__ = ["Agent", "AgentBusy", "RingSink", "build_agent", "default_directory", "main"]


def default_directory() -> str:
    """``/dev/shm/memra-obs`` (RAM-backed, like a k8s ``emptyDir: {medium: Memory}``), or
    the temp directory where there is no /dev/shm."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, "memra-obs")


def build_agent(
    directory: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    registry: Any = None,
    exporters: Sequence[RecordExporter] = (),
    serve: bool = True,
    **agent_kw: Any,
) -> tuple[Agent, list[Callable[[], None]], Any]:
    """The agent the environment asks for: ``(agent, closers, metrics_server_or_None)``.

    Sinks: ``MEMRA_OBS_SINKS`` (``otel``/``prometheus``; unset = both). Spans go where the
    in-process observer would send them; metrics to a fresh registry served on
    ``MEMRA_OBS_METRICS_ADDR``, every series labelled ``worker`` (:func:`build_exporters`).
    """
    from prometheus_client import CollectorRegistry

    env = os.environ if env is None else env
    knobs = {} if env.get(MEMRA_OBS_SINKS, "").strip() else {"sinks": "otel,prometheus"}
    st = Settings.resolve(env, **knobs)
    directory = ring_directory(directory or st.agent or default_directory())
    registry = CollectorRegistry() if registry is None else registry
    built = build_exporters(st, worker_label=True, registry=registry, env=env, serve=serve)
    try:
        agent = Agent(directory, [*exporters, *built.all], **agent_kw)
    except BaseException:
        for c in built.all:
            c.shutdown(1.0)
        built.close()
        raise
    if built.prom is not None:
        wire_metrics(agent, built.prom, built.spans)
        registry.register(AgentCollector(agent))
    return agent, [built.close], built.server


def wire_metrics(agent: Agent, prom: Any, span_ex: Any = None) -> None:
    """The instrument's own health, as in-process: ring losses are ``dropped{signal="ring"}``."""
    prom.watch("dropped", "ring", agent.lost_total)
    prom.watch("errors", "records", lambda: agent.export_errors)
    prom.watch("errors", "metrics", lambda: prom.export_errors)
    if span_ex is not None:
        prom.watch("dropped", "spans", lambda: span_ex.dropped_spans)
        prom.watch("errors", "spans", lambda: span_ex.export_errors)


def set_priority(priority: str) -> None:
    """Yield the CPU to the loop: a wake-up of this process must never delay a loop thread's
    (on a contended core, a runnable agent does). ``idle`` trades that for the risk of
    starving under a host that keeps every core busy; the rings then overflow, counted."""
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            priority = "low"
    if priority in ("idle", "low"):
        os.nice(10)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memra-obs agent",
        description="Publish every local worker's ring (agent mode): spans as configured by "
        "OTEL_* / MEMRA_OBS_SPANS_FILE, one /metrics on MEMRA_OBS_METRICS_ADDR. SIGTERM "
        "drains, flushes and exits.",
    )
    p.add_argument(
        "--dir",
        default=None,
        help=f"ring directory (default ${MEMRA_OBS_AGENT}, else {default_directory()})",
    )
    p.add_argument(
        "--poll-ms",
        type=float,
        default=20.0,
        help="sleep between passes once every ring is read (default 20)",
    )
    p.add_argument(
        "--priority",
        choices=("idle", "low", "normal"),
        default="idle",
        help="CPU priority of this process: idle = SCHED_IDLE (runs only on cycles the "
        "serving loop leaves; the default), low = nice 10, normal = unchanged",
    )
    p.add_argument("--once", action="store_true", help="publish what the rings hold now, then exit")
    p.add_argument("--keep", action="store_true", help="do not remove rings of exited workers")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``memra-obs agent``: runs until SIGTERM/SIGINT (or ``--once``); 0 on a clean exit."""
    args = _parser().parse_args(argv)
    if args.poll_ms <= 0:
        raise ConfigError(f"--poll-ms={args.poll_ms}: expected a positive number")
    # Handlers first: a SIGTERM during start-up still means "drain, flush, exit 0".
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    set_priority(args.priority)
    try:
        agent, closers, server = build_agent(
            args.dir, poll_s=args.poll_ms / 1000.0, cleanup=not args.keep
        )
    except AgentBusy as exc:
        print(f"memra-obs agent: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        for sig, h in old.items():
            signal.signal(sig, h)
        raise
    where = [f"rings in {agent.directory}"]
    if server is not None:
        where.append(f"/metrics on {server.url}")
    print(f"[memra-obs agent] publishing {'; '.join(where)}", file=sys.stderr, flush=True)
    try:
        if args.once:
            agent.drain()
        else:
            agent.run(stop)
    finally:
        agent.close()
        for close in closers:
            close()
        for sig, h in old.items():
            signal.signal(sig, h)
    print(
        f"[memra-obs agent] done: published={agent.published} lost={agent.lost_total()} "
        f"rings_removed={agent.rings_removed}",
        file=sys.stderr,
        flush=True,
    )
    return 0
