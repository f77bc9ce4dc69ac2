"""Record batches to the exporters, on a thread of their own.

The tail's reading thread must keep passing lines through while an exporter waits on the
network, so exporting happens here, behind a bounded queue of batches. When the queue is full
the policy depends on who would wait: reading a pipe, the writer is a live worker whose
stderr must never block, so the newest batch is dropped and counted (``dropped``, published
as ``memra_obs_dropped_total{signal="records"}``); reading a file (replay, ``--follow``),
nobody waits on us, so the reader waits for room instead and nothing is lost.

Shaped like :class:`memra_obs.export.QueueSink` + ``ExportWorker`` (``dropped``, ``errors``,
``exporters``), so an exporter's ``attach_queue`` can publish its counts the same way.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from ..events import Record
from ..export import ExporterSet, RecordExporter

__all__ = ["Publisher"]


class Publisher:
    """A bounded queue of record batches and the daemon thread that exports them."""

    def __init__(
        self,
        exporters: Sequence[RecordExporter],
        *,
        capacity: int = 65536,
        block: bool = False,
        tick_s: float = 0.2,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.set = ExporterSet(exporters, report=report or (lambda msg: None))
        self.capacity = capacity
        self.block = block
        self.tick_s = tick_s
        self._report = report
        self._q: deque[tuple[list[Record], int]] = deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._busy = False
        self._stop = False
        self.dropped = 0
        self.exported = 0
        #: ``attach_queue`` looks for ``qsink.worker.errors`` / ``.exporters``: this is both.
        self.worker = self
        self._thread = threading.Thread(target=self._run, name="memra-obs-tail-export", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return self._queued

    def put(self, batch: list[Record]) -> None:
        """Queue one batch (in order); drops it, or waits for room, when the queue is full.
        A batch counts as the records it stands for (``RecordBatch.records``: a RoundBlock
        is its rounds), for the capacity and for ``dropped``."""
        n = getattr(batch, "records", None) or len(batch)
        with self._cond:
            if self._queued + n > self.capacity and self._queued:
                if not self.block:
                    self.dropped += n
                    return
                while self._queued + n > self.capacity and self._queued and not self._stop:
                    self._cond.wait(0.5)
            if self._stop:
                self.dropped += n
                return
            self._q.append((batch, n))
            self._queued += n
            self._cond.notify_all()

    def _run(self) -> None:
        last_tick = time.monotonic()
        while True:
            with self._cond:
                while not self._q and not self._stop:
                    if not self._cond.wait(self.tick_s):
                        break
                batches = list(self._q)
                self._q.clear()
                self._busy = bool(batches)
                stop = self._stop
            if batches:
                merged: list[Record] = (
                    batches[0][0] if len(batches) == 1 else [r for b, _ in batches for r in b]
                )
                n = sum(k for _, k in batches)
                self._export(merged, n)
                with self._cond:
                    self._queued -= n
                    self._busy = False
                    self._cond.notify_all()
            now = time.monotonic()
            if now - last_tick >= self.tick_s or stop:
                last_tick = now
                self._tick()
            if stop:
                with self._cond:
                    if not self._q:
                        return

    def _export(self, batch: list[Record], n: int) -> None:
        self.set.export(batch)
        self.exported += n

    def _tick(self) -> None:
        self.set.tick()

    @property
    def exporters(self) -> tuple[RecordExporter, ...]:
        return self.set.exporters

    @property
    def errors(self) -> int:
        return self.set.errors

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued batch is exported, then flush the exporters."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (self._q or self._busy) and time.monotonic() < deadline:
                self._cond.notify_all()
                self._cond.wait(max(0.0, min(0.05, deadline - time.monotonic())))
            ok = not self._q and not self._busy
        return self.set.flush(deadline) and ok

    def close(self, timeout_s: float = 5.0) -> None:
        """Export what is queued (within ``timeout_s``), stop the thread, shut exporters down."""
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self.set.shutdown(deadline, floor_s=0.1)
