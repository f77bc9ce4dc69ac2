"""``memra-obs agent``: the :class:`Agent` reads a directory's rings in passes, each pass one
batch to the exporters (the RecordSource of an ExportWorker, as in-process queues are), each
cursor persisted once its batch is delivered (at-least-once; exactly once across a graceful
restart); :func:`build_agent` wires the exporters the environment asks for and the agent's own
health on ``/metrics``. Each ring is attached, read and counted on its own: a bad one is dropped."""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import functools
import glob
import itertools
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..diagnostics import say_once
from ..environment import (
    MEMRA_OBS_AGENT,
    MEMRA_OBS_METRICS_ADDR,
    MEMRA_OBS_SINKS,
    MEMRA_OBS_WORKER,
    ConfigError,
    Settings,
    positive,
    stop_signals,
)
from ..export import ExportWorker, RecordExporter
from ..linewriter import stderr_writer
from ..timeline import Record
from ..wiring import Exporters, build_exporters, delivered
from .reader import RingStream
from .ring import check_cpu, own_directory, ring_directory

__all__ = ["Agent", "AgentBusy", "build_agent", "default_directory", "main"]

#: How often to look for new rings and dead writers, and to tick the exporters.
SCAN_S, TICK_S = 0.25, 0.2
#: How long a finished worker's series stay (a few scrapes take their last values) before
#: they are dropped: with pids for labels, each restart would add a set that never goes.
FORGET_S = 300.0
#: Finished rings kept (file and descriptor) until the span exporters deliver their spans;
#: past it the oldest retires at once: a collector down for minutes must not fill /dev/shm.
HELD_RINGS = 4
#: Sessions the agent's exporters keep open at once: every worker's on the host (a process's
#: 4096 lost the lines and spans of 8 ranks of 600 requests in flight). Those of a worker
#: gone, or whose ends its ring lost, the agent ends itself.
OPEN_SESSIONS = 65536


class AgentBusy(RuntimeError):
    """Another agent already publishes this directory."""


class Agent:
    """Publishes every ring in ``directory`` to ``exporters``: ``batch_slots`` slots a ring a
    pass, ``poll_s`` asleep after a pass that caught up; ``cleanup`` removes finished rings;
    their workers' series go ``forget_s`` later."""

    def __init__(self, directory: str, exporters: Sequence[RecordExporter], *,
                 batch_slots: int = 4096, poll_s: float = 0.02, cleanup: bool = True,
                 forget_s: float = FORGET_S, lock_fd: int | None = None) -> None:  # fmt: skip
        self.directory, self.batch_slots = directory, batch_slots
        self.poll_s, self.cleanup, self.forget_s = poll_s, cleanup, forget_s
        # Its thread never starts: each pass is one batch, driven by step().
        self.worker = ExportWorker(self, exporters, tick_s=TICK_S)
        self._streams: dict[str, RingStream] = {}
        #: Rings not to attach again: read to the end but kept, or dropped as bad.
        self._skip: set[str] = set()
        self._ids, self._next_scan = itertools.count(1), 0.0
        self._polled: list[RingStream] = []
        self._done: list[RingStream] = []
        #: Exporters that deliver later, on a thread of theirs (spans): marks say when.
        self._late: list[Any] = [x for x in self.worker.exporters if hasattr(x, "settled")]
        #: Passes out but not yet delivered: (the span exporters' marks, cursors, finished rings).
        self._unsettled: deque[tuple[list[Any], dict[RingStream, Any], list[RingStream]]] = deque()
        self._held: dict[RingStream, None] = {}  # their finished rings, oldest first
        #: worker -> (records read, lost, written) over every ring so far (a scrape reads it).
        self.totals: dict[str, tuple[int, int, int]] = {}
        #: Over every ring, forgotten workers' too: records published, lost; loops' dropped rounds.
        self.published = self._lost = self.dropped_rounds = 0
        self._retired: list[tuple[float, set[str]]] = []  # (when to forget, worker labels)
        self.rings_removed = self.rings_retired = 0  # retired: read to the end, worker gone
        self.where: list[str] = []  #: where build_agent's exporters publish, for the banner
        self._lock_fd = _lock(directory) if lock_fd is None else lock_fd  # build_agent's

    @property
    def rings(self) -> int:
        return len(self._streams)

    def lost_total(self) -> int:
        """Records that never reached the exporters, over every ring (the dropped counter)."""
        return self._lost

    def counts(self) -> dict[str, tuple[int, int, int]]:
        """worker -> (read, lost, written); ``read + lost == written`` once a ring is read."""
        return dict(self.totals)

    def _account(self, s: RingStream, now: tuple[int, int, int, int]) -> None:
        r, lost, w = self.totals.get(s.worker, (0, 0, 0))
        d = [x - y for x, y in zip(now, s.accounted, strict=True)]
        # One tuple swapped in: a scrape sees a worker's three counts from one moment.
        self.totals[s.worker] = (r + d[0], lost + d[1], w + d[2])
        self.published, self._lost = self.published + d[0], self._lost + d[1]
        self.dropped_rounds += d[3]
        s.accounted = now
        if d[1] <= 0:  # (an agent publishing spans only has no /metrics to show the count)
            return
        later = 'and every later loss counted in memra_obs_dropped_total{signal="ring"}'
        if s.overwritten:
            say_once(f"ring-lost:{s.worker}", f"agent: worker {s.worker!r}'s ring lapped the "
                     f"agent: {s.overwritten} records lost, {later} (a stopped or slow agent, "
                     "or MEMRA_OBS_RING_SLOTS too small)", "ring-lost")  # fmt: skip
        if s.last.refused:  # the writer's count: never overwritten, not the agent's pace
            say_once(f"ring-refused:{s.worker}", f"agent: worker {s.worker!r}'s ring refused "
                     f"{s.last.refused} records, {later}: records the ring format cannot hold, "
                     "or writes its file refused (the worker says those)", "ring-lost")  # fmt: skip

    def _still_ours(self) -> bool:
        """The directory's lock file is the one this agent holds (or is taken again): a ring
        directory removed and made again let a second agent start, both publishing its rings."""
        lock = os.path.join(self.directory, ".agent.lock")
        with contextlib.suppress(OSError):
            if os.path.samestat(os.stat(lock), os.fstat(self._lock_fd)):
                return True
        try:
            fd = _lock(self.directory)
        except (ConfigError, AgentBusy) as exc:
            say_once(f"agent-lock:{lock}", f"agent: {lock} is no longer this agent's ({exc}); "
                     "it reads the rings it holds and no new one")  # fmt: skip
            return False
        os.close(self._lock_fd)
        self._lock_fd = fd
        return True

    def _discover(self) -> None:
        if not self._still_ours():
            return
        # glob skips dot names (rings being created) and says nothing of a directory gone
        paths = glob.glob(os.path.join(glob.escape(self.directory), "*.ring"))
        self._skip.intersection_update(paths)  # a refused ring removed: its name is free again
        known = self._streams.keys() | self._skip
        for path in paths:
            if path in known:
                continue
            try:
                self._streams[path] = RingStream(path, self._ids)
            except FileNotFoundError:
                continue  # removed meanwhile
            except Exception as exc:
                if not isinstance(exc, OSError):  # a file may become readable; a bad ring stays bad
                    self._skip.add(path)
                say_once(f"agent-ring:{path}", f"agent: skipping {path}: {exc}", "agent-skip")

    def _drop(self, s: RingStream, exc: BaseException) -> None:
        # A kind of its own: never hidden behind refused rings' reports, and a crash loop's new
        # ring names never spend the process's reports.
        say_once(f"agent-drop:{s.path}", f"agent: dropping {s.path} ({exc}); what it holds "
                 "from here on is neither published nor counted", "agent-drop")  # fmt: skip
        r, lost, written, rounds = s.accounted  # what it published counts; no claim of it does
        self._account(s, (s.read, lost, written + s.read - r, rounds))
        del self._streams[s.path]
        self._skip.add(s.path)
        self._retired.append((time.monotonic() + self.forget_s, s.workers))  # frozen: they go
        s.close()

    # -- the RecordSource side -----------------------------------------------------------

    def take(self, limit: int = 0) -> list[Record]:
        """One pass (a batch: ``limit`` is not used); finished rings retire once it is out."""
        now = time.monotonic()
        scan = now >= self._next_scan
        if scan:
            self._next_scan = now + SCAN_S
            self._discover()
            self._forget(now)
        batch: list[Record] = []
        self._polled, self._done = [], []
        for s in list(self._streams.values()):
            try:
                if scan:
                    s.writer_gone()  # sticky; read to the end below before retiring
                if s.publish(batch, self.batch_slots):
                    self._done.append(s)
            except Exception as exc:  # a damaged ring (or a bug): drop it, keep the rest
                self._drop(s, exc)
                continue
            self._polled.append(s)
        if scan:
            self._shared_labels()
        if not batch:
            self.taken()  # nothing to export: commit and retire now
        return batch

    def _shared_labels(self) -> None:
        """Say once per label two live rings that published carry (ranks given one label): their
        series are summed under one ``worker``, which a scrape cannot tell from a busy worker."""
        seen: dict[str, RingStream] = {}
        for s in self._streams.values():
            if s.gone or not s.read:
                continue
            other = seen.setdefault(s.worker, s)
            if other is not s:
                say_once(f"agent-label:{s.worker}", f"agent: two live rings carry the worker "
                         f"label {s.worker!r} ({os.path.basename(other.path)}, "
                         f"{os.path.basename(s.path)}): their series are summed under one "
                         f"worker; give each process its own {MEMRA_OBS_WORKER} (unset, it is "
                         "$RANK or the pid)", "agent-label")  # fmt: skip

    def taken(self) -> None:
        """The pass is exported: count it. Its cursors are persisted, and finished rings
        retired, once the span exporters have delivered it (sent, or dropped and counted):
        spans still queued when an agent is killed are read again by the next one."""
        marks = [(x, x.mark()) for x in self._late]
        cursors = {s: s.cursor() for s in self._polled}
        for s in self._polled:
            if not s.trouble:  # a ring in doubt is counted once it reads clean again
                self._account(s, (s.read, s.lost, s.written, s.last.dropped_rounds))
        for s in self._done:  # read no more, retired below
            del self._streams[s.path]
            self._skip.add(s.path)
            self._held[s] = None
        last = self._unsettled[-1] if self._unsettled else None
        if last is not None and last[0] == marks:  # nothing exported since: one pass
            last[1].update(cursors)
            last[2].extend(self._done)
        else:
            self._unsettled.append((marks, cursors, self._done))
        self._polled, self._done = [], []
        self._settle()
        while len(self._held) > HELD_RINGS:  # the oldest go, their spans still queued
            s = next(iter(self._held))
            s.commit(s.cursor())  # kept (--keep): the next agent does not publish it again
            self._retire(s)

    def _settle(self, all_of_it: bool = False) -> None:
        """Persist the cursors and retire the rings of each pass now delivered, in order."""
        while self._unsettled and (
            all_of_it or all(x.settled(m) for x, m in self._unsettled[0][0])
        ):
            _, cursors, done = self._unsettled.popleft()
            for s, cursor in cursors.items():
                s.commit(cursor)
            for s in done:
                self._retire(s)

    def _retire(self, s: RingStream) -> None:
        """Close (and remove) a finished ring; its workers' series go ``forget_s`` later."""
        if s not in self._held:  # retired already, past the cap
            return
        del self._held[s]
        self._retired.append((time.monotonic() + self.forget_s, s.workers))
        self.rings_retired += 1
        s.clear_table()
        s.close(unlink=self.cleanup)
        if self.cleanup and not os.path.exists(s.path):
            self._skip.discard(s.path)
            self.rings_removed += 1

    def _forget(self, now: float) -> None:
        """Drop the series of workers retired ``forget_s`` ago that no live ring carries."""
        while self._retired and self._retired[0][0] <= now:
            live = {w for s in self._streams.values() for w in s.workers}
            for w in self._retired.pop(0)[1] - live:
                self.totals.pop(w, None)
                self.worker.set.each("forget", w)

    def pending(self) -> bool:
        """Some ring holds more than its last pass read (the batch limit was hit)."""
        return any(not s.caught_up() for s in self._streams.values())

    def step(self) -> int:
        """One pass, exported: returns records handed to the exporters."""
        return self.worker.drain_once()

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Publish what every ring holds now (live writers are not chased: a busy host would
        keep a stopping agent forever), retiring finished rings; True if done in time."""
        deadline, self._next_scan = time.monotonic() + timeout_s, 0.0
        self.step()
        marks = {s: s.last.head for s in self._streams.values()}
        while any(s.pos < m or s.trouble for s, m in marks.items() if s.path in self._streams):
            if time.monotonic() >= deadline:
                return False
            self.step()
        return True

    def run(self, stop: threading.Event) -> None:
        """Until ``stop``: read everything there is, then sleep ``poll_s``. Few wake-ups, big
        batches: on a host whose loops want every core, each wake-up can delay a loop's."""
        while not stop.is_set():
            self.step()
            if not self.pending():
                stop.wait(self.poll_s)
        self.drain()

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and shut the exporters down, and release the directory. Sessions still open
        in a live worker are not ended (the next agent resumes them), and span exporters
        forget them rather than close them as unfinished: no span appears twice."""
        if self._lock_fd < 0:
            return
        deadline = time.monotonic() + timeout_s
        self.worker.set.flush(max(deadline, time.monotonic() + 0.1))
        self.worker.set.each("forget_open")
        self.worker.set.shutdown(deadline, floor_s=0.1)
        self._settle(all_of_it=True)  # shut down: every span is sent or counted dropped
        for s in self._streams.values():
            s.close()
        self._streams.clear()
        os.close(self._lock_fd)
        self._lock_fd = -1

    def stats(self) -> list[dict[str, Any]]:
        return [s.stats() for s in self._streams.values()]

    def collect(self) -> Iterator[Any]:
        """The agent's own health, from its totals at scrape time (a prometheus_client collector)."""
        doc = "Worker rings the agent is reading (one per worker process)."
        yield GaugeMetricFamily("memra_obs_agent_rings", doc, value=self.rings)
        counts = sorted(self.counts().items())
        for i, (name, doc) in enumerate(_COUNTERS):
            c = CounterMetricFamily(name, doc, labels=["worker"])
            for w, n in counts:
                c.add_metric([w], n[i])
            yield c


_COUNTERS = (
    ("memra_obs_agent_records", "Records of a worker the agent read from its ring and published "
     "(context it replays or makes up is not counted)."),
    ("memra_obs_agent_lost_records", "Records of a worker that never reached the exporters: "
     "overwritten in its ring before the agent read them, or refused by the writer."),
    ("memra_obs_agent_written_records", "Records a worker handed its ring, as its ring says "
     "(refused ones included); records + lost_records equals it once the ring is read."),
)  # fmt: skip


def _lock(directory: str) -> int:
    """``directory``'s ``.agent.lock``, locked: one agent per directory, held for life."""
    lock = os.path.join(directory, ".agent.lock")
    try:
        own_directory(directory)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        if os.fstat(fd).st_uid != os.geteuid():  # another user's: it could hold it forever
            os.close(fd)
            raise PermissionError(errno.EPERM, f"{lock} is another user's")
    except OSError as exc:
        why = f"ring directory {directory!r} (--dir, {MEMRA_OBS_AGENT}): {exc.strerror or exc}"
        if exc.errno == errno.EROFS:  # a k8s readOnly: true mount
            why += "; the agent writes there: mount it read-write"
        raise ConfigError(why) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AgentBusy(f"another memra-obs agent is publishing {directory}") from None
    return fd


def default_directory() -> str:
    """In memory (like a k8s ``emptyDir: {medium: Memory}``) where there is /dev/shm."""
    return ring_directory("memra-obs")


def build_agent(directory: str | None = None, *, env: Mapping[str, str] | None = None,
                registry: Any = None, exporters: Sequence[RecordExporter] = (),
                **agent_kw: Any) -> tuple[Agent, list[Callable[[], None]], Any]:  # fmt: skip
    """The agent the environment asks for: ``(agent, closers, metrics_server_or_None)``, sinks
    ``MEMRA_OBS_SINKS`` (unset = ``otel,prometheus``): spans where the in-process observer sends
    them, metrics labelled ``worker`` to a fresh registry served on ``MEMRA_OBS_METRICS_ADDR``."""
    check_cpu()
    env = os.environ if env is None else env
    knobs = {} if MEMRA_OBS_SINKS in env else {"sinks": "otel,prometheus"}  # set "": none
    st = Settings.resolve(env, **knobs)
    directory = ring_directory(directory or st.agent or default_directory())
    # First: a bad directory, or another agent's, is said before a port is bound or a file made.
    lock_fd = _lock(directory)
    unread = registry is None  # a registry of its own, read only through /metrics
    registry = CollectorRegistry() if registry is None else registry
    built: Exporters | None = None
    try:
        built = build_exporters(st, worker_label=True, registry=registry, env=env,
                                open_sessions=OPEN_SESSIONS)  # fmt: skip
        read = [x for x in built.all if not (x is built.prom and unread and built.server is None)]
        if not (read or exporters):  # it would read the rings, remove them, and publish nothing
            raise ConfigError(f"{MEMRA_OBS_SINKS}={','.join(sorted(st.sinks)) or '(none)'}: "
                              "nothing for the agent to publish (it publishes otel, and prometheus "
                              "on /metrics; OTEL_* may have turned spans off, "
                              f"{MEMRA_OBS_METRICS_ADDR}= serves no /metrics); the rings are left "
                              "as they are")  # fmt: skip
        agent = Agent(directory, [*exporters, *built.all], lock_fd=lock_fd, **agent_kw)
    except BaseException:
        os.close(lock_fd)
        if built is not None:
            for c in built.all:
                c.shutdown(1.0)
            built.close()
        raise
    agent.where = [w for w in built.where if not w.startswith(("/metrics on ", "metrics -> "))]
    if built.prom is not None:  # the instrument's own health, as in-process
        built.prom.watch("dropped", "ring", agent.lost_total)
        built.prom.watch("dropped", "rounds", lambda: agent.dropped_rounds)
        built.prom.attach_worker(agent.worker)
        registry.register(agent)
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


def main(argv: Sequence[str] | None = None) -> int:
    """``memra-obs agent``: runs until SIGTERM, SIGINT or SIGHUP (or ``--once``); 0 then."""
    p = argparse.ArgumentParser(
        prog="memra-obs agent",
        description="Publish every local worker's ring (agent mode): spans as configured by "
        "OTEL_* / MEMRA_OBS_SPANS_FILE, one /metrics on MEMRA_OBS_METRICS_ADDR. SIGTERM "
        "drains, flushes and exits.",
    )
    # fmt: off
    p.add_argument("--dir", default=None,
                   help=f"ring directory (default ${MEMRA_OBS_AGENT}, else {default_directory()})")
    p.add_argument("--poll-ms", type=positive(float, 60_000), default=20.0,
                   help="sleep between passes once every ring is read (default 20)")
    p.add_argument("--priority", choices=("idle", "low", "normal"), default="idle",
                   help="CPU priority of the ring reader thread (/metrics keeps normal): idle = SCHED_IDLE (runs only on cycles the "
                   "serving loop leaves; the default), low = nice 10, normal = unchanged")
    p.add_argument("--once", action="store_true", help="publish what the rings hold now, then exit")
    p.add_argument("--keep", action="store_true", help="do not remove rings of exited workers")
    # fmt: on
    args = p.parse_args(argv)  # --poll-ms nan spun, inf was a traceback
    if args.dir is not None and not args.dir.strip():  # "" was $MEMRA_OBS_AGENT or the default
        p.error("argument --dir: must not be empty (leave it out for the default)")
    stop = threading.Event()  # handlers first: a SIGTERM during start-up still drains

    # set from a thread: the handler may interrupt stop.wait() here, holding the lock set() takes
    def on_signal(*_: object) -> None:
        threading.Thread(target=stop.set, daemon=True).start()

    old = {s: signal.signal(s, on_signal) for s in stop_signals()}
    try:
        agent, closers, server = build_agent(
            args.dir, poll_s=args.poll_ms / 1e3, cleanup=not args.keep
        )
        # This thread only (Linux: per thread), after /metrics' and the senders' threads
        # started: an idle server thread made a scrape wait seconds on a busy host.
        set_priority(args.priority)
        out = "" if server is None else f"; /metrics on {server.url}"
        out += "".join(f"; {w}" for w in agent.where)  # spans and requests: where they go
        say = functools.partial(stderr_writer().write_lines, count=False)  # never raises: a
        # closed stderr stops no agent; its own lines are no lost legacy lines
        say([f"[memra-obs agent] publishing rings in {agent.directory}{out}"])
        try:
            if args.once:
                agent.drain()
            else:
                agent.run(stop)
        finally:
            agent.close()
            for close in closers:
                close()
        say([f"[memra-obs agent] done: published={agent.published} lost={agent.lost_total()} "
             f"rings_removed={agent.rings_removed}{delivered(agent.worker.exporters)}"])  # fmt: skip
        return 0
    except AgentBusy as exc:
        print(f"memra-obs agent: {exc}", file=sys.stderr)
        return 2
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
