"""Records to exporters, off the loop: the one worker loop, and the in-process queue it drains.

The in-process worker, ``memra-obs agent`` and ``memra-obs tail`` all publish through one
:class:`ExportWorker`. In-process its source is a :class:`QueueSink`: the loop appends to a
deque, never blocking (full: the newest record drops, counted). The loop shares the GIL with
this thread, so batches are sized to about ``stretch_ms`` of work, then a real ``pause_s``
sleep (``time.sleep(0)`` does not reliably hand the GIL over).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .diagnostics import say_once
from .sinks.base import Sink
from .timeline import Record

__all__ = ["ExportWorker", "ExporterSet", "QueueSink", "RecordExporter", "RecordSource"]


class RecordExporter(Protocol):
    """Consumes records off the loop's thread (in the export worker)."""

    def export(self, batch: Sequence[Record]) -> None: ...
    def flush(self, timeout_s: float = 5.0) -> bool: ...
    def shutdown(self, timeout_s: float = 5.0) -> None: ...


class RecordSource(Protocol):
    """An :class:`ExportWorker`'s records: ``take`` up to ``limit``, oldest first (``[]``: none
    now); ``taken``: the latest take is exported; ``pending``: more wait."""

    def take(self, limit: int) -> list[Record]: ...
    def taken(self) -> None: ...
    def pending(self) -> bool: ...


class ExporterSet:
    """RecordExporters called as one: a failing call is counted in ``errors`` and said once,
    and the others carry on. Deadlines are ``time.monotonic()`` values shared by all."""

    __slots__ = ("errors", "exporters")

    def __init__(self, exporters: Sequence[RecordExporter | None]) -> None:
        # None: build_span_exporter's "spans are off" (OTEL_SDK_DISABLED): no exporter
        self.exporters = tuple(ex for ex in exporters if ex is not None)
        self.errors = 0

    def export(self, batch: Sequence[Record]) -> None:
        for ex in self.exporters:
            self._call(ex, ex.export, batch)

    def each(self, hook: str, *args: Any) -> None:
        """Each exporter's ``hook(*args)`` where it has one: ``tick`` (time-driven work),
        ``after_fork`` (in a forked child: fresh locks and threads), ``forget`` (a worker)."""
        for ex in self.exporters:
            if (fn := getattr(ex, hook, None)) is not None:
                self._call(ex, fn, *args)

    def flush(self, deadline: float) -> bool:
        """Flush every exporter; True when all of them got everything out in time."""
        ok = True
        for ex in self.exporters:
            ok = self._call(ex, ex.flush, max(0.0, deadline - time.monotonic())) is not False and ok
        return ok

    def shutdown(self, deadline: float, floor_s: float = 0.05) -> None:
        """Shut each exporter down with what is left of ``deadline`` (at least ``floor_s``)."""
        for ex in self.exporters:
            self._call(ex, ex.shutdown, max(floor_s, deadline - time.monotonic()))

    def _call(self, ex: object, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``; False (counted, said once) when it raises."""
        try:
            return fn(*args)
        except Exception as exc:
            self.errors += 1
            msg = f"exporter {type(ex).__name__} raised {exc!r}; continuing (reported once)"
            say_once(f"exporter:{id(ex)}", msg)
            return False


class ExportWorker:
    """The daemon thread that drains a :class:`RecordSource` into exporters: every
    ``interval_ms`` (or :meth:`wake`) until the source is empty, then a tick (at most every
    ``tick_s``). With ``stretch_ms`` > 0 batches (from 16, 1 to ``max_batch``) are sized
    toward that much work, ``pause_s`` apart; ``stretch_ms=0``: ``max_batch``, no pause."""

    def __init__(
        self,
        source: RecordSource,
        exporters: Sequence[RecordExporter | None],
        *,
        interval_ms: float = 200,
        pause_s: float = 0.0002,
        stretch_ms: float = 0.3,
        max_batch: int = 256,
        tick_s: float = 0.0,
    ) -> None:
        self.source = source
        self._tick_s = tick_s
        self._next_tick = 0.0
        self.set = ExporterSet(exporters)
        self.exporters = self.set.exporters  # never changes (rearm keeps the set)
        self._interval = interval_ms / 1000.0
        self.batch = 16 if stretch_ms > 0 else max(1, max_batch)
        self._max_batch = max(self.batch, max_batch)
        self._stretch = stretch_ms / 1000.0
        self._pause = pause_s
        self._arm()

    def _arm(self) -> None:
        self.held = 0  # records in the exporters' hands now
        self._hold = threading.Lock()  # a take and its ``held`` are one step for stop()
        self._sealed = False  # stop() counted ``held``: no batch is taken after it
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="memra-obs-export", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def errors(self) -> int:
        """Exporter calls that raised (published as memra_obs_export_errors_total)."""
        return self.set.errors

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait(self._interval)
                self._wake.clear()
                if self._stop:  # (stop() drained: what came after is the queue's to count)
                    return
                self.drain()
        finally:
            self._idle.set()  # a flush() waiting on this thread is answered, not timed out

    def _one(self, n: int) -> int:
        with self._hold:  # (once a batch, never a record: the loop never takes this lock)
            batch = [] if self._sealed else self.source.take(n)
            if not batch:
                return 0
            self.held = len(batch)
        self.set.export(batch)
        self.held = 0
        self.source.taken()
        return len(batch)

    def _tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + self._tick_s
            self.set.each("tick")

    def drain_once(self) -> int:
        """One batch, then maybe a tick: the records out (the agent's pass)."""
        n = self._one(self.batch)
        self._tick()
        return n

    def drain(self) -> int:
        """Export until the source has nothing more right now, then tick; the records out."""
        clock = time.perf_counter
        target = self._stretch
        out = 0
        self._idle.clear()
        try:
            while True:
                n = self.batch
                t0 = clock()
                got = self._one(n) if not self._stop else 0
                if not got:
                    break
                out += got
                if target > 0:
                    took = clock() - t0
                    if got == n:  # aim the next stretch: shrink at once, grow gently
                        if took > target:
                            self.batch = max(1, int(n * target / took))
                        elif took < target / 2:
                            self.batch = min(self._max_batch, n + (n >> 1) + 1)
                    if self._pause:
                        time.sleep(self._pause)  # a real sleep: the loop re-takes the GIL here
            self._tick()
        finally:
            self._idle.set()
        return out

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what the source holds and flush every exporter; True when all got out in time."""
        deadline = time.monotonic() + timeout_s
        if self._thread.is_alive():
            while (left := deadline - time.monotonic()) > 0 and self._thread.is_alive():
                if self.source.pending():
                    self._idle.clear()
                    self._wake.set()
                elif self._idle.is_set():
                    break
                self._idle.wait(min(left, 0.05))  # (a stop() meanwhile: answered within 50 ms)
            idle = self._idle.is_set()
        else:
            self.drain()
            idle = True
        ok = idle and not self.source.pending()  # (not idle: a batch still in an exporter's hands)
        return self.set.flush(deadline) and ok

    def stop(self, timeout_s: float = 5.0) -> int:
        """Drain, stop the thread and shut the exporters down, all within ``timeout_s``; the
        drain gets half (busy loop threads keep the queue from ever emptying), the rest stops
        the thread before its exporters close. Returns the records an exporter call still held
        when the time ran out (the closed exporters after it never see them)."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s / 2)
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._hold:  # a batch taken after this would reach closed exporters, uncounted
            self._sealed = True
            late = self.held if self._thread.is_alive() else 0
        self.set.shutdown(deadline)
        return late

    def rearm(self) -> None:
        """After ``fork()``, in the child: a new thread (the parent's did not come along), and
        its own error count (the parent's are the parent's to publish)."""
        self._arm()
        self.set.errors = 0
        self.set.each("after_fork")


class QueueSink(Sink):
    """Hands every record to a bounded queue drained by an :class:`ExportWorker` (``tuning``:
    its ``interval_ms``, ``pause_s``, ``stretch_ms``, ``max_batch``)."""

    wants_trace_ids = True

    def __init__(
        self,
        exporters: Sequence[RecordExporter | None],
        *,
        capacity: int = 8192,
        start: bool = True,
        **tuning: Any,
    ) -> None:
        self._q: deque[Record] = deque()
        self._cap = capacity
        self._room = threading.Condition()
        self.dropped = 0
        self._closed = self._stopping = False
        self.worker = ExportWorker(self, exporters, **tuning)
        if start:
            self.worker.start()
            _LIVE.add(self)
            _exit_with_multiprocessing()

    def _put(self, rec: Record) -> None:
        q = self._q
        if len(q) < self._cap and not self._closed:
            q.append(rec)
            return
        with self._room:
            self.dropped += 1
        if self._closed:
            say_once(f"queue-closed:{id(self)}", "records of a session still open when its "
                     "observer was shut down (by configure(), shutdown() or the exit): dropped, counted "
                     "in that observer's queue only; end sessions before replacing it")  # fmt: skip
        else:  # without prometheus no /metrics shows the count: spans went missing unsaid
            say_once(f"queue-full:{id(self)}", f"record queue full ({self._cap} records, "
                     "MEMRA_OBS_QUEUE_SIZE; the exporters are behind): the newest are dropped, "
                     "counted in memra_obs_dropped_total{signal=\"records\"}")  # fmt: skip

    on_session = on_round = on_burst = on_first_token = on_session_end = _put

    def put_many(self, recs: Sequence[Record], block: bool = True) -> None:
        """Queue records in order; ``block``: wait for room instead of dropping (the tail)."""
        q = self._q
        for rec in recs:
            if len(q) >= self._cap and block and not self._closed and self.worker.alive:
                self.worker.wake()
                with self._room:
                    while len(q) >= self._cap and not self._closed and self.worker.alive:
                        self._room.wait(0.05)
            self._put(rec)
        self.worker.wake()

    def take(self, limit: int) -> list[Record]:
        q = self._q  # the worker is its only consumer: what len() counted is there
        out = [q.popleft() for _ in range(min(limit, len(q)))]
        if out:
            with self._room:
                self._room.notify_all()
        return out

    def taken(self) -> None: ...

    def pending(self) -> bool:
        return bool(self._q)

    def __len__(self) -> int:
        return len(self._q)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.worker.flush(timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        with self._room:  # one shutdown (atexit and configure() at once counted a batch twice)
            if self._stopping:
                return
            self._stopping = True
        late = self.worker.stop(timeout_s)
        with self._room:  # what came in while the exporters shut down: counted, not lost
            self._closed = True
            late += len(self._q)
            self.dropped += late
            self._q.clear()
            self._room.notify_all()
        _LIVE.discard(self)
        if late:  # said: no /metrics is left to show this count (at exit, nothing else is)
            say_once(f"queue-late:{id(self)}", f"shutdown: {late} records not exported in its "
                     "time (loop threads still running, or a stuck exporter): dropped")  # fmt: skip

    def _after_fork(self) -> None:
        """In a forked child: the parent's queued records (and counts) are the parent's."""
        self._q.clear()
        self.dropped = 0
        self._room = threading.Condition()
        self._stopping = self._closed
        self.worker.rearm()
        if not self._closed:
            self.worker.start()


#: Total time the interpreter-exit shutdown may take, for all queues together.
EXIT_TIMEOUT_S = 3.0

_LIVE: weakref.WeakSet[QueueSink] = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    """Shut down every started queue still open (daemon threads would just stop)."""
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    for qs in list(_LIVE):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with contextlib.suppress(Exception):
            qs.shutdown(left)


_MP_HOOKED = [0]  # the pid whose multiprocessing exit runs _shutdown_at_exit


def _exit_with_multiprocessing(_: object = None) -> None:
    """multiprocessing's children (fork, forkserver, Pool workers) end in ``os._exit``, past
    atexit: its own exit function runs its finalizers, so the flush joins them."""
    mpu = sys.modules.get("multiprocessing.util")
    if mpu is not None and _MP_HOOKED[0] != os.getpid():
        _MP_HOOKED[0] = os.getpid()
        mpu.Finalize(None, _shutdown_at_exit, exitpriority=10)


def _rearm_in_child() -> None:
    for qs in list(_LIVE):
        try:
            qs._after_fork()
        except Exception as exc:
            say_once("fork", f"re-arming the export queue after fork failed: {exc!r}")
    if _LIVE and (mpu := sys.modules.get("multiprocessing.util")) is not None:
        # A multiprocessing child clears its finalizers after this hook, then runs these.
        mpu.register_after_fork(_shutdown_at_exit, _exit_with_multiprocessing)


os.register_at_fork(after_in_child=_rearm_in_child)
