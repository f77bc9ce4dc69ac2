"""``memra-obs agent``'s engine: find every ring in the directory, read them in batches,
publish through the RecordExporters, persist each cursor after its batch is published.

The :class:`Agent` is a :class:`~memra_obs.export.RecordSource` (``take`` reads every ring
once, ``taken`` commits the cursors), drained by the same
:class:`~memra_obs.export.ExportWorker` loop that publishes an in-process queue.

Delivery: at-least-once per record, exactly-once across a graceful restart (SIGTERM drains,
publishes, commits, exits). A crash between an export and its commit republishes at most
that one batch. Sessions open across a restart have their SessionRecord replayed to the
new agent's exporters (context, not a second session: the metrics count rounds, not
sessions). Records lost in a ring (overwritten before the agent read them, or refused by the
writer) are counted exactly and published as ``memra_obs_dropped_total{signal="ring"}``.

One agent per directory: it holds ``flock`` on ``<dir>/.agent.lock``.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..diagnostics import say
from ..export import ExportWorker, RecordExporter
from ..timeline import Record
from .reader import FormatError, RingReader
from .stream import RingStream

__all__ = ["Agent", "AgentBusy"]

LOCK_NAME = ".agent.lock"


class AgentBusy(RuntimeError):
    """Another agent already publishes this directory."""


def _say(msg: str) -> None:
    say(f"agent: {msg}")


class Agent:
    """Publishes every ring in ``directory`` to ``exporters``.

    ``batch_slots``: slots read per ring per pass (a pass exports one batch for all rings);
    ``poll_s``: sleep after a pass that caught up; ``scan_s``: how often to look for new rings
    and dead writers; ``cleanup``: remove a ring once its writer is gone and it is read;
    ``exclusive``: take the directory's agent lock.
    """

    def __init__(
        self,
        directory: str,
        exporters: Sequence[RecordExporter],
        *,
        batch_slots: int = 4096,
        poll_s: float = 0.02,
        scan_s: float = 0.25,
        tick_s: float = 0.2,
        cleanup: bool = True,
        exclusive: bool = True,
    ) -> None:
        self.directory = directory
        self.worker = ExportWorker(
            self, exporters, interval_ms=poll_s * 1000, stretch_ms=0, max_batch=1, tick_s=tick_s
        )
        self.batch_slots = batch_slots
        self.poll_s = poll_s
        self.scan_s = scan_s
        self.tick_s = tick_s
        self.cleanup = cleanup
        self._ids = itertools.count(1)
        self._streams: dict[str, RingStream] = {}
        self._bad: set[str] = set()
        #: Rings read to the end (kept only with cleanup off, or when removal failed).
        self._done: set[str] = set()
        self._lock_fd = -1
        os.makedirs(directory, exist_ok=True)
        if exclusive:
            self._take_lock()
        self._next_scan = 0.0
        self._polled: list[RingStream] = []
        self._finished: list[RingStream] = []
        self._batch = 0
        # Totals over every ring this agent has read, including rings already removed.
        self.published = 0
        self.lost_removed = 0
        self.published_by_worker: dict[str, int] = {}
        self.lost_by_worker: dict[str, int] = {}
        self.rings_removed = 0
        self._closed = False
        #: Guards the totals against a scrape while a ring moves from live to removed.
        self._count_lock = threading.Lock()

    def _take_lock(self) -> None:
        path = os.path.join(self.directory, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AgentBusy(f"another memra-obs agent is publishing {self.directory}") from None
        self._lock_fd = fd

    # -- counts --------------------------------------------------------------------------

    @property
    def rings(self) -> int:
        return len(self._streams)

    def lost_total(self) -> int:
        """Records that never reached the exporters, over every ring (the dropped counter)."""
        with self._count_lock:
            return self.lost_removed + sum(s.lost for s in self._streams.values())

    def worker_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(published, lost) per worker label, over rings read so far."""
        with self._count_lock:
            pub = dict(self.published_by_worker)
            lost = dict(self.lost_by_worker)
            streams = tuple(self._streams.values())
        for s in streams:
            pub[s.worker] = pub.get(s.worker, 0) + s.published
            lost[s.worker] = lost.get(s.worker, 0) + s.lost
        return pub, lost

    # -- rings ---------------------------------------------------------------------------

    def discover(self) -> int:
        """Attach to rings not seen yet; returns how many were added."""
        added = 0
        try:
            names = [
                e.name
                for e in os.scandir(self.directory)
                if e.name.endswith(".ring") and not e.name.startswith(".")
            ]
        except FileNotFoundError:
            return 0
        for name in names:
            path = os.path.join(self.directory, name)
            if path in self._streams or path in self._bad or path in self._done:
                continue
            try:
                reader = RingReader(path)
            except FileNotFoundError:
                continue  # removed meanwhile
            except (FormatError, OSError) as exc:
                self._bad.add(path)
                _say(f"skipping {path}: {exc}")
                continue
            stream = RingStream(reader, self._ids)
            with self._count_lock:
                self._streams[path] = stream
            added += 1
        return added

    # -- the loop ------------------------------------------------------------------------

    def take(self, limit: int = 0) -> list[Record]:
        """One pass (the RecordSource side): maybe discover, read every ring once (up to
        ``batch_slots`` slots each); rings whose writer is gone and that are fully read are
        retired once the batch is out (:meth:`taken`). ``limit`` is not used: a pass is a
        batch."""
        now = time.monotonic()
        housekeeping = now >= self._next_scan
        if housekeeping:
            self._next_scan = now + self.scan_s
            self.discover()
        batch: list[Record] = []
        done: list[RingStream] = []
        polled: list[RingStream] = []
        for s in list(self._streams.values()):
            if housekeeping and not s.reader.gone:
                s.reader.writer_gone()  # sticky; read to the end below before retiring
            try:
                s.poll(batch, self.batch_slots)
            except Exception as exc:  # a bug or a damaged file: drop this ring, keep the rest
                _say(f"reading {s.reader.path} failed ({exc!r}); leaving it alone")
                self._bad.add(s.reader.path)
                self._retire(s, unlink=False)
                continue
            polled.append(s)
            if s.reader.gone and s.reader.caught_up():
                s.reader.finish()
                s.close_open(batch)
                done.append(s)
        self._polled, self._finished = polled, done
        self._batch = len(batch)
        if not batch:
            self.taken()  # nothing to export: commit and retire now
        return batch

    def taken(self) -> None:
        """The pass's records are exported: persist each cursor, retire finished rings."""
        for s in self._polled:
            s.reader.commit()
        for s in self._finished:
            self._retire(s)
        self.published += self._batch
        self._polled, self._finished, self._batch = [], [], 0

    def pending(self) -> bool:
        return self.behind()

    def step(self) -> int:
        """One pass, exported: returns records published."""
        return self.worker.drain_once()

    def _retire(self, s: RingStream, unlink: bool = True) -> None:
        with self._count_lock:
            del self._streams[s.reader.path]
            pub, lost = self.published_by_worker, self.lost_by_worker
            pub[s.worker] = pub.get(s.worker, 0) + s.published
            n_lost = s.lost
            lost[s.worker] = lost.get(s.worker, 0) + n_lost
            self.lost_removed += n_lost
            self.rings_removed += 1
        s.reader.close(unlink=unlink and self.cleanup)
        if unlink and (not self.cleanup or os.path.exists(s.reader.path)):
            self._done.add(s.reader.path)

    @property
    def exporters(self) -> tuple[RecordExporter, ...]:
        return self.worker.exporters

    @property
    def export_errors(self) -> int:
        """Exporter calls that raised (published as memra_obs_export_errors_total)."""
        return self.worker.errors

    def drain(self, timeout_s: float = 10.0) -> bool:
        """Read until every ring is caught up (and retire finished ones); True if done in time."""
        deadline = time.monotonic() + timeout_s
        self._next_scan = 0.0
        while time.monotonic() < deadline:
            n = self.step()
            if n == 0 and all(s.reader.caught_up() for s in self._streams.values()):
                return True
        return False

    def run(self, stop: threading.Event, *, drain_timeout_s: float = 10.0) -> None:
        """Until ``stop`` is set: read everything there is, then sleep ``poll_s`` (at once
        again only while a ring has more than one batch waiting). Few wake-ups, big
        batches: on a host where the loop's threads want every core, each wake-up of this
        process can delay a loop thread's."""
        while not stop.is_set():
            self.step()
            if not self.behind():
                stop.wait(self.poll_s)
        self.drain(drain_timeout_s)

    def behind(self) -> bool:
        """Some ring has records past what the last pass read (its batch limit was hit)."""
        return any(not s.reader.caught_up() for s in self._streams.values())

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and shut the exporters down, and release the directory. Sessions still
        open in a live worker are not closed: the next agent resumes them."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        for s in self._streams.values():
            s.reader.commit()
        self.worker.set.flush(max(deadline, time.monotonic() + 0.1))
        for ex in self.exporters:
            _forget_open_sessions(ex)
        self.worker.set.shutdown(deadline, floor_s=0.1)
        for s in list(self._streams.values()):
            self._retire(s, unlink=False)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def stats(self) -> list[dict[str, Any]]:
        return [s.stats() for s in self._streams.values()]


def _forget_open_sessions(ex: object) -> None:
    """A span exporter closes sessions still open at shutdown as 'unfinished'; in the agent
    they are not finished — the next agent resumes them and ends their spans — so the
    spans would appear twice. Have it forget them first."""
    forget = getattr(ex, "forget_open", None)
    if callable(forget):
        forget()
