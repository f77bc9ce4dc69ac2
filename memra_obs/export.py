"""In-process publication: a bounded hand-off queue and a background exporter that works
in short stretches.

The loop's side (:class:`QueueSink`) is an append to a deque: it never blocks, and when the
queue is full it drops the newest record and counts it. The other side (:class:`ExportWorker`)
is one daemon thread that wakes every ``interval_ms`` (or on ``flush``), takes small batches,
hands each batch to every :class:`RecordExporter` (span building, metric aggregation, ...) and
then sleeps a little so the loop gets the GIL back.

Why stretches: the loop and this thread share one GIL. When the loop comes back from device
work (GIL released) while this thread runs Python, the loop waits until this thread lets go
— voluntarily (a sleep, I/O) or when the interpreter's switch interval (5 ms) forces it. So
the loop's tail latency is this thread's longest stretch. The worker sizes its batches to
keep each stretch near ``stretch_ms`` (0.3 ms by default; it measures and adapts, since
the exporters' cost per record varies), then sleeps ``pause_s``: a real sleep, because
``time.sleep(0)`` does not reliably hand the GIL over. Production loads go to the
out-of-process agent instead (``MEMRA_OBS_AGENT``), which shares no GIL.

At interpreter exit every started queue is shut down (bounded, ``EXIT_TIMEOUT_S`` for all
of them), so sessions still open are flushed and what is queued gets out.

Exporters receive records in the order the loop produced them (per process), so they can keep
per-session state; they must keep each ``export`` call short and never raise (the worker
guards them anyway, counting the failure).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from .events import Record
from .linewriter import stderr_writer
from .sinks.base import Sink

__all__ = ["ExportWorker", "ExporterSet", "QueueSink", "RecordExporter"]


class RecordExporter(Protocol):
    """Consumes records off the loop's thread (the export worker, or the agent)."""

    def export(self, batch: Sequence[Record]) -> None: ...

    def flush(self, timeout_s: float = 5.0) -> bool: ...

    def shutdown(self, timeout_s: float = 5.0) -> None: ...


def _say(msg: str) -> None:
    stderr_writer().write_lines([f"[memra-obs] {msg}"])


class ExporterSet:
    """RecordExporters called as one, off the loop (the export worker, the tail, the agent):
    every call is guarded, a failing exporter is counted in ``errors`` and reported once, and
    the others carry on. Deadlines are ``time.monotonic()`` values shared by all of them."""

    __slots__ = ("_report", "_reported", "errors", "exporters")

    def __init__(
        self, exporters: Sequence[RecordExporter], report: Callable[[str], None] | None = None
    ) -> None:
        self.exporters = tuple(exporters)
        self.errors = 0
        self._report = _say if report is None else report
        self._reported: set[int] = set()

    def export(self, batch: Sequence[Record]) -> None:
        for i, ex in enumerate(self.exporters):
            try:
                ex.export(batch)
            except Exception as exc:
                self._fail(i, ex, exc)

    def tick(self) -> None:
        """Time-driven work (an exporter's ``tick``, when it has one)."""
        for i, ex in enumerate(self.exporters):
            tick = getattr(ex, "tick", None)
            if tick is not None:
                try:
                    tick()
                except Exception as exc:
                    self._fail(i, ex, exc)

    def flush(self, deadline: float) -> bool:
        """Flush every exporter; True when all of them got everything out in time."""
        ok = True
        for i, ex in enumerate(self.exporters):
            try:
                ok = ex.flush(max(0.0, deadline - time.monotonic())) is not False and ok
            except Exception as exc:
                self._fail(i, ex, exc)
                ok = False
        return ok

    def shutdown(self, deadline: float, floor_s: float = 0.05) -> None:
        """Shut every exporter down; each gets what is left of ``deadline`` (at least
        ``floor_s``, so the last one is not cut to nothing)."""
        for i, ex in enumerate(self.exporters):
            try:
                ex.shutdown(max(floor_s, deadline - time.monotonic()))
            except Exception as exc:
                self._fail(i, ex, exc)

    def _fail(self, i: int, ex: object, exc: BaseException) -> None:
        self.errors += 1
        if i not in self._reported:
            self._reported.add(i)
            self._report(f"exporter {type(ex).__name__} raised {exc!r}; continuing (reported once)")


class QueueSink(Sink):
    """Hands every record to a bounded queue drained by an :class:`ExportWorker`."""

    wants_trace_ids = True

    def __init__(
        self,
        exporters: Sequence[RecordExporter],
        *,
        capacity: int = 8192,
        interval_ms: int = 200,
        batch: int = 16,
        pause_s: float = 0.0002,
        stretch_ms: float = 0.3,
        start: bool = True,
    ) -> None:
        self._q: deque[Record] = deque()
        self._cap = capacity
        self._drop_lock = threading.Lock()
        self.dropped = 0
        self.worker = ExportWorker(
            self,
            exporters,
            interval_ms=interval_ms,
            batch=batch,
            pause_s=pause_s,
            stretch_ms=stretch_ms,
        )
        self._closed = False
        if start:
            self.worker.start()
            _LIVE.add(self)

    def _put(self, rec: Record) -> None:
        q = self._q
        if len(q) < self._cap and not self._closed:
            q.append(rec)
        else:
            with self._drop_lock:
                self.dropped += 1

    on_session = _put
    on_round = _put
    on_burst = _put
    on_first_token = _put
    on_session_end = _put

    def __len__(self) -> int:
        return len(self._q)

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.worker.flush(timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self.worker.stop(timeout_s)
        self._closed = True
        _LIVE.discard(self)


class ExportWorker:
    """The daemon thread behind a :class:`QueueSink`.

    ``batch`` is the first batch size; after each batch the size is scaled toward
    ``stretch_ms`` of work (between 1 and ``max_batch`` records).
    """

    def __init__(
        self,
        sink: QueueSink,
        exporters: Sequence[RecordExporter],
        *,
        interval_ms: int = 200,
        batch: int = 16,
        pause_s: float = 0.0002,
        stretch_ms: float = 0.3,
        max_batch: int = 256,
    ) -> None:
        self._sink = sink
        self.set = ExporterSet(exporters)
        self._interval = interval_ms / 1000.0
        self.batch = max(1, batch)
        self._max_batch = max(self.batch, max_batch)
        self._stretch = stretch_ms / 1000.0
        self._pause = pause_s
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self.exported = 0
        self._thread = threading.Thread(target=self._run, name="memra-obs-export", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            self._drain()
            if self._stop:
                self._drain()
                return

    def _drain(self) -> None:
        q = self._sink._q
        pop = q.popleft
        clock = time.perf_counter
        target = self._stretch
        self._idle.clear()
        try:
            while q:
                n = self.batch
                batch = []
                try:
                    for _ in range(n):
                        batch.append(pop())
                except IndexError:
                    pass
                t0 = clock()
                self._export(batch)
                took = clock() - t0
                if target > 0 and len(batch) == n:
                    # Aim the next stretch at the target: shrink at once, grow gently.
                    if took > target:
                        self.batch = max(1, int(n * target / took))
                    elif took < target / 2:
                        self.batch = min(self._max_batch, n + (n >> 1) + 1)
                if self._pause:
                    time.sleep(self._pause)  # a real sleep: the loop re-takes the GIL here
            self.set.tick()
        finally:
            self._idle.set()

    def _export(self, batch: list[Record]) -> None:
        self.set.export(batch)
        self.exported += len(batch)

    @property
    def exporters(self) -> tuple[RecordExporter, ...]:
        return self.set.exporters

    @property
    def errors(self) -> int:
        """Exporter calls that raised (published as memra_obs_export_errors_total)."""
        return self.set.errors

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Drain the queue and flush every exporter; True when all of it got out in time."""
        deadline = time.monotonic() + timeout_s
        if self._thread.is_alive():
            while self._sink._q and time.monotonic() < deadline:
                self._idle.clear()
                self._wake.set()
                self._idle.wait(max(0.0, deadline - time.monotonic()))
            self._idle.wait(max(0.0, deadline - time.monotonic()))
        else:
            self._drain()
        ok = not self._sink._q
        return self.set.flush(deadline) and ok

    def stop(self, timeout_s: float = 5.0) -> None:
        """Drain, stop the thread and shut the exporters down, all within ``timeout_s``
        (the exporters share what the drain left of it)."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        self.set.shutdown(deadline)


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
        try:
            qs.shutdown(left)
        except Exception:
            pass
