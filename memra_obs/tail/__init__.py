"""``memra-obs tail``: a worker's legacy stderr lines -> the same metrics and spans.

    memra-obs tail --follow /var/log/worker0.err --worker rank0
    worker 2>&1 >/dev/null | memra-obs tail - --worker rank0

Every byte read goes on to the tail's own stderr unchanged (grep keeps working); the legacy
lines are parsed (:func:`memra_obs.legacy.parse_line`), turned back into the observer's
records (:mod:`.rebuild`) and published through the same exporters a worker uses in-process:
``/metrics`` on ``MEMRA_OBS_METRICS_ADDR`` (every series labelled ``worker``), spans to the
``OTEL_*`` exporter or ``MEMRA_OBS_SPANS_FILE``. ``MEMRA_OBS_SINKS`` picks them as for a
worker; unset, the tail publishes both (publishing is what it is for).

Records go to the exporters through the in-process queue and its export worker
(:class:`memra_obs.export.QueueSink`), filled with backpressure: when the exporters fall
behind, the tail holds back its reading (the writer's pipe fills, or the file waits) rather
than dropping, so every round read is published and the end line and ``/metrics`` agree.

Modules: :mod:`.source` (pipe / followed file with rotation), :mod:`.passthrough` (bytes ->
pass-through + records), :mod:`.rebuild` (lines -> records), :mod:`.stats` (the tail's own
counters).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..environment import MEMRA_OBS_SINKS, MEMRA_OBS_WORKER, Settings
from ..export import QueueSink
from ..wiring import build_exporters
from .passthrough import Tail
from .rebuild import Rebuilder
from .source import FollowSource, PipeSource
from .stats import TailCollector, TailStats

__all__ = ["Rebuilder", "Tail", "TailCollector", "TailStats", "main", "pump"]


def add_options(p: argparse.ArgumentParser) -> None:
    """The tail's own options, on the CLI's ``tail`` subparser (so ``--help`` lists them)."""
    p.add_argument(
        "--from-start",
        action="store_true",
        help="--follow: read what the file already holds first (default: its end)",
    )
    p.add_argument(
        "--poll",
        type=float,
        default=0.1,
        metavar="S",
        help="--follow: seconds between checks of a file at its end (default 0.1)",
    )
    p.add_argument(
        "--linger",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds a burst waits for its level-2 line, profile and rows (0.5)",
    )
    p.add_argument(
        "--session-gap",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds without a line that end a session (default 1.0)",
    )
    p.add_argument(
        "--max-bursts",
        type=int,
        default=64,
        metavar="N",
        help="bursts per session when no [spec-prof] line marks requests (64)",
    )
    p.add_argument(
        "--quiet", "-q", action="store_true", help="no start/end lines of the tail's own"
    )


def _options(rest: Sequence[str], given: argparse.Namespace | None = None) -> argparse.Namespace:
    """The options: from the CLI's parse when it registered them, else parsed from ``rest``."""
    p = argparse.ArgumentParser(prog="memra-obs tail", add_help=False)
    add_options(p)
    if given is not None and hasattr(given, "linger") and not rest:
        ns = given
    else:
        ns, unknown = p.parse_known_args(list(rest))
        if unknown:
            p.error(f"unrecognized arguments: {' '.join(unknown)}")
    for name in ("poll", "linger", "session_gap"):
        if not getattr(ns, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if ns.max_bursts < 1:
        p.error("--max-bursts must be at least 1")
    return ns


def main(args: argparse.Namespace, rest: Sequence[str] = ()) -> int:
    """``memra-obs tail [--follow] FILE|- [--worker W] [options]`` (see ``_options``)."""
    opts = _options(rest, args)
    path: str = args.path
    # argument > environment > default, as every knob: --worker, MEMRA_OBS_WORKER (the
    # worker's own label when the tail shares its environment), the file's name / stdin.
    worker = (
        args.worker
        or os.environ.get(MEMRA_OBS_WORKER)
        or ("stdin" if path == "-" else os.path.basename(path) or path)
    )
    knobs: dict[str, Any] = {"worker": worker}
    if MEMRA_OBS_SINKS not in os.environ:
        knobs["sinks"] = "otel,prometheus"
    st = Settings.resolve(None, **knobs)

    early: list[str] = []
    source: PipeSource | FollowSource
    try:
        if path == "-":
            source = PipeSource(sys.stdin.fileno(), "stdin")
        elif args.follow:
            source = FollowSource(
                path, from_start=opts.from_start, poll_s=opts.poll, on_wait=early.append
            )
        else:
            source = PipeSource(os.open(path, os.O_RDONLY), path)
    except OSError as exc:
        print(f"memra-obs tail: {path}: {exc.strerror}", file=sys.stderr)
        return 2

    built = build_exporters(st, worker=worker, worker_label=True)
    queue: QueueSink | None = None
    if built.all:
        # Backpressure, not drops: nothing waits on a tail but the input it holds back.
        queue = QueueSink(built.all, capacity=st.queue_size, pause_s=0, stretch_ms=0)
    rb = Rebuilder(
        worker,
        linger_ns=int(opts.linger * 1e9),
        session_gap_ns=int(opts.session_gap * 1e9),
        max_bursts=opts.max_bursts,
    )
    publish = queue.put_many if queue is not None else _discard
    tail = Tail(rb, publish, out=2, name=source.name, max_devices=st.max_devices)
    if built.prom is not None:
        built.prom.attach_queue(queue)
        collector = TailCollector()
        collector.add(worker, tail.stats)
        built.prom.registry.register(collector)
    if not opts.quiet:
        mode = "following" if args.follow and path != "-" else "reading"
        where = "; ".join(built.where) or "publishing nothing (MEMRA_OBS_SINKS)"
        tail.note(f"{mode} {source.name} as worker {worker!r}; {where}")
    for msg in early:
        tail.note(msg)

    stop: list[int] = []
    old = {
        s: signal.signal(s, lambda n, f: stop.append(n)) for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        pump(tail, source, stop=lambda: bool(stop))
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if queue is not None:
            queue.shutdown(10.0)
        built.close()
        source.close()
    if not opts.quiet:
        st_ = tail.stats
        rows, means = rb.rounds_from_rows, rb.rounds_from_means
        tail.note(
            f"{'stopped' if stop else 'end of input'}: {tail.lineno} lines "
            f"({st_.total_lines - st_.lines['other']} legacy, {st_.total_malformed} malformed, "
            f"{st_.total_orphans} unplaced), {rb.sessions} sessions, {rows + means} rounds "
            f"({rows} from rows), {queue.dropped if queue else 0} records dropped"
        )
    return 0


def pump(
    tail: Tail, source: PipeSource | FollowSource, *, stop: Callable[[], bool], read_s: float = 0.1
) -> None:
    """Read ``source`` into ``tail`` until the input ends or ``stop()``, then close the tail
    (its partial line, open bursts and sessions). A followed file's rotations are counted,
    settle the partial line, and are noted on the output."""
    if isinstance(source, FollowSource):

        def rotated(style: str) -> None:
            tail.stats.rotations[style] += 1
            tail.settle(time.perf_counter_ns())
            tail.note(f"{source.path} rotated ({style}); reading the new content from its start")

        source.on_rotate = rotated
    while not stop():
        data = source.read(read_s)
        now = time.perf_counter_ns()
        if data is None:
            break
        if data:
            tail.feed(data, now)
        tail.tick(now)
    tail.close(time.perf_counter_ns())


def _discard(batch: list[Any]) -> None:
    pass
