"""``memra-obs tail``: a worker's legacy stderr lines -> the same metrics and spans.

    memra-obs tail --follow /var/log/worker0.err --worker rank0
    worker 2>&1 >/dev/null | memra-obs tail - --worker rank0

Bytes go through unchanged (:mod:`.passthrough`); legacy lines become records (:mod:`.rebuild`)
for a worker's exporters, with backpressure where the output is local: a span file and the
requests file hold the reading back rather than drop; a network span output that is down drops,
counted, as the worker's would."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import stat
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from ..environment import (
    MAX_WORKER,
    MEMRA_OBS_SINKS,
    MEMRA_OBS_WORKER,
    Settings,
    positive,
    stop_signals,
    utf8,
)
from ..export import QueueSink
from ..wiring import Exporters, build_exporters, sessions_sampled
from .passthrough import Tail
from .rebuild import Rebuilder
from .source import CHUNK, GZIP_MAGIC, FollowSource, GzipSource, PipeSource
from .stats import TailCollector, TailStats

__all__ = ["Rebuilder", "Tail", "TailCollector", "TailStats", "main", "pump"]

_SECONDS = positive(float, 86400)  # past a day (inf, 1e300): a typo, not a wait
_OPTIONS: tuple[tuple[str, Any, Any, str, str], ...] = (
    ("--poll", _SECONDS, None, "S", "--follow: seconds between checks of a file at its end (default 0.1)"),
    ("--linger", _SECONDS, 0.5, "S", "seconds a burst waits for its level-2 line, profile and rows (0.5)"),
    ("--session-gap", _SECONDS, 1.0, "S", "seconds without a line that end a session (default 1.0)"),
    ("--max-bursts", positive(int), 64, "N", "bursts per session when no [spec-prof] line marks requests (64)"),
)  # fmt: skip


def add_options(p: argparse.ArgumentParser) -> None:
    """The tail's own options, on the CLI's ``tail`` subparser (so ``--help`` lists them)."""
    p.add_argument("--from-start", action="store_true",
                   help="--follow: read what the file already holds first (default: its end)")  # fmt: skip
    for flag, kind, default, metavar, text in _OPTIONS:
        p.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    p.add_argument("--quiet", "-q", action="store_true", help="no start/end lines of the tail's own")  # fmt: skip


def _check(rest: Sequence[str], ns: argparse.Namespace) -> None:
    """Refuse what the CLI parsed (``add_options``) but the tail cannot take, and ``rest``."""
    usage = "memra-obs tail [--follow] FILE|- [--worker W] [options] (--help lists them)"
    p = argparse.ArgumentParser(prog="memra-obs tail", usage=usage, add_help=False)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if not ns.path:  # ("$LOG" unset) it was refused as an empty worker label
        p.error("argument FILE|-: must not be empty (- for standard input)")
    if not ns.follow and (ns.from_start or ns.poll is not None):  # read once: meant --follow
        p.error(f"argument {'--from-start' if ns.from_start else '--poll'}: only with --follow")
    if ns.worker is not None and not ns.worker.strip():  # never replaced by the file's name
        p.error("argument --worker: must not be empty (leave it out for the file's name)")
    with contextlib.suppress(OSError):  # `tail log 2>>log`: it read its own copy for ever
        given = os.fstat(0) if ns.path == "-" else os.stat(ns.path)
        if stat.S_ISREG(given.st_mode) and os.path.samestat(given, os.fstat(2)):
            p.exit(2, f"memra-obs tail: {ns.path} is its standard error (its copy of the "
                   "lines): it would read them back for ever\n")  # fmt: skip


def main(args: argparse.Namespace, rest: Sequence[str] = ()) -> int:
    """``memra-obs tail [--follow] FILE|- [--worker W] [options]`` (see ``add_options``)."""
    _check(rest, args)
    path = args.path
    # argument > environment > default, as every knob: --worker, MEMRA_OBS_WORKER (the
    # worker's own label when the tail shares its environment), the file's name / stdin.
    knobs: dict[str, Any] = {}
    if args.worker is not None or MEMRA_OBS_WORKER not in os.environ:
        name = "stdin" if path == "-" else _file_label(path)
        knobs["worker"] = name if args.worker is None else args.worker
    if MEMRA_OBS_SINKS not in os.environ:
        knobs["sinks"] = "otel,prometheus"
    st = Settings.resolve(None, **knobs)
    early: list[str] = []
    try:
        source = _source(args, early.append)
    except OSError as exc:
        print(f"memra-obs tail: {path}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        built = build_exporters(st, worker=st.worker, worker_label=True)
    except BaseException:
        source.close()
        raise
    # Backpressure, not drops: nothing waits on a tail but the input it holds back.
    queue = (
        QueueSink(built.all, capacity=st.queue_size, pause_s=0, stretch_ms=0) if built.all else None
    )
    rb = Rebuilder(st.worker, linger_ns=int(args.linger * 1e9), max_bursts=args.max_bursts,
                   session_gap_ns=int(args.session_gap * 1e9), sampled=sessions_sampled(),
                   max_families=st.max_families)  # fmt: skip
    tail = Tail(rb, queue.put_many if queue is not None else lambda batch: None, name=source.name,
                max_devices=st.max_devices)  # fmt: skip
    if built.prom is not None:
        built.prom.attach_queue(queue)
        built.prom.watch("errors", "lines", lambda: tail.lost_lines)  # passed through: refused
        built.prom.registry.register(collector := TailCollector())
        collector.add(st.worker, tail.stats)
    if not args.quiet:
        where = "; ".join(built.where) or "publishing nothing (MEMRA_OBS_SINKS)"
        mode = "following" if isinstance(source, FollowSource) else "reading"
        tail.note(f"{mode} {source.name} as worker {st.worker!r}; {where}")
    for msg in early:
        tail.note(msg)
    if isinstance(source, FollowSource):
        source.on_wait = tail.note  # later waits (a directory or FIFO rotated in) said there
    try:
        stop = _run(tail, source, queue, built)
    except OSError as exc:  # a read error (EIO, ...): what was read is published, then this
        print(f"memra-obs tail: {path}: {exc.strerror}", file=sys.stderr)
        return 2
    if not args.quiet:
        s, rows, means = tail.stats, rb.rounds_from_rows, rb.rounds_from_means
        tail.note(
            f"{'stopped' if stop else 'end of input'}: {tail.lineno} lines "
            f"({s.total_lines - s.lines['other']} legacy, {s.total_malformed} malformed, "
            f"{s.total_orphans} unplaced), {rb.sessions} sessions, {rows + means} rounds "
            f"({rows} from rows), {queue.dropped if queue is not None else 0} records dropped"
        )
    return 0


def _file_label(path: str) -> str:
    """The file's name as the default worker label, cut to MAX_WORKER bytes: a long name (in a
    legacy encoding, 3 bytes a character) is no mistake of the user's to refuse."""
    return utf8(os.path.basename(path) or path).encode()[:MAX_WORKER].decode(errors="ignore")


def _source(opts: argparse.Namespace, on_wait: Callable[[str], None]) -> PipeSource | FollowSource:
    path = opts.path
    if path == "-":  # fd 0 closed (tail - <&-): EBADF now, before /metrics's socket takes fd 0
        return GzipSource(0, "stdin", own=False) if _gzipped(0) else PipeSource(0, "stdin")
    if os.path.isdir(path):  # open() takes one; its reads would fail
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
    follow = partial(FollowSource, path, from_start=opts.from_start, poll_s=opts.poll or 0.1,
                     on_wait=on_wait)  # fmt: skip
    if opts.follow and not os.path.exists(path):
        return follow()
    fd = os.open(path, os.O_RDONLY)  # (a FIFO: once a writer opens it)
    gz = _gzipped(fd)  # a compressed file does not grow: read once, with --follow too
    if opts.follow and not gz and stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return follow()
    # read to its end: a file (gzip'd or not), or a FIFO (which has no rotations to follow)
    return GzipSource(fd, path) if gz else PipeSource(fd, path, own=True)


def _gzipped(fd: int) -> bool:
    """A regular file whose bytes from here are gzip's (a rotated ``FILE.1.gz``, or standard
    input redirected from one). Raises EBADF for a closed fd."""
    st = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and os.pread(fd, 2, os.lseek(fd, 0, os.SEEK_CUR)) == GZIP_MAGIC


def _run(
    tail: Tail, source: PipeSource | FollowSource, queue: QueueSink | None, built: Exporters
) -> bool:
    """Pump until the input ends or a stop signal (SIGTERM, ...), then flush the exporters
    (bounded: 10 s). Returns whether a signal stopped it."""
    # A local span output (file, console) and the requests file hold the reading back too; a
    # network output drops (down). A stop signal lets go: what they then lose is counted.
    held = [o for o in getattr(built.spans, "outputs", ()) if o.sender.timeout_s == float("inf")]
    held += [built.requests] if built.requests is not None else []
    for x in held:
        x.hold = True
    stop: list[int] = []

    def on_signal(n: int, _: object) -> None:
        stop.append(n)
        for x in held:  # (a reader stopped for good held it past SIGTERM)
            x.hold = False

    old = {s: signal.signal(s, on_signal) for s in stop_signals()}
    try:
        pump(tail, source, stop=lambda: bool(stop))
    finally:
        stopped = bool(stop)
        try:  # a signal during the flush waits for it (bounded), as one before it does
            if queue is not None:
                queue.shutdown(10.0)
            built.close()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            source.close()
    return stopped


def pump(
    tail: Tail, source: PipeSource | FollowSource, *, stop: Callable[[], bool], read_s: float = 0.1
) -> None:
    """Read ``source`` into ``tail`` until the input ends or ``stop()``, then close the tail
    (its partial line, open bursts and sessions; a read error is raised after that). A followed
    file's rotations are counted, settle the partial line, and are noted on the output."""
    if isinstance(source, FollowSource):

        def rotated(style: str) -> None:
            tail.stats.rotations[style] += 1
            tail.settle(time.perf_counter_ns(), end_line=True)
            tail.note(f"{source.path} rotated ({style}); reading the new content from its start")

        source.on_rotate = rotated
    # a pipe or a followed file: two short reads in a row are the writer's pace (a file read
    # once, a gzip, a full read and the end of a backlog are not); laid out live, interleaved
    # loops keep to the clock
    live = isinstance(source, FollowSource) or not (
        isinstance(source, GzipSource) or stat.S_ISREG(os.fstat(source.fd).st_mode)
    )
    short = False
    try:
        while not stop():
            data = source.read(read_s)
            now = time.perf_counter_ns()
            if data is None:
                break
            if data:
                was, short = short, live and len(data) < CHUNK
                tail.rebuilder.live = was and short
                tail.feed(data, now)
            tail.tick(now)
    finally:  # the end, a stop or a read error: what was read is published
        tail.close(time.perf_counter_ns())
