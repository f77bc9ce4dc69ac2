"""The span RecordExporter: records -> span tuples -> encoded fragments -> requests ->
a bounded queue -> a sender thread.

Where the time goes, and why it is split this way: building and encoding hold the GIL, so
they run inside ``export()`` on the export worker, a few µs per span, in the worker's
short stretches (:mod:`memra_obs.export`). Sending mostly waits on the network with the
GIL released, so it gets its own daemon thread and never delays the worker. Between the
two, a bounded deque of finished requests: when the sender cannot keep up (collector down,
slow network) the newest request is dropped and its spans counted — nothing ever waits.

Counters are plain ints (read them from anywhere): ``exported_spans`` (acknowledged by the
receiver), ``dropped_spans`` (never delivered: full queue, failed send, rejected by the
receiver, a value the wire cannot carry, or still queued at shutdown) and ``export_errors``
(failed sends, and records that could not be turned into spans). With several outputs
(``OTEL_TRACES_EXPORTER=otlp,console``) each output counts its own spans.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from ..diagnostics import say_once
from ..timeline import Record
from .spans import Span, SpanBuilder
from .transport import SendError

__all__ = ["Output", "SpanExporter"]


class Sender(Protocol):
    url: str

    def send(self, payload: Any) -> int: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


class Encoder(Protocol):
    bad: int

    def spans(self, spans: Sequence[Span], out: list[Any]) -> int: ...
    def request(self, fragments: Sequence[Any], size: int | None = None) -> Any: ...


class Output:
    """One destination: an encoder (None: pass span tuples through) and a sender, with the
    pending fragments of the next request and the bounded queue of sealed ones.

    A request is sealed at ``max_spans`` spans or ``max_bytes`` encoded bytes (whichever
    first; 2 MiB stays under gRPC's default 4 MiB message limit), or at the worker's tick.
    The queue holds at most ``queue_requests`` requests and ``queue_bytes`` bytes.
    Few big requests: the sender's Python cost is per request, and the socket write
    releases the GIL.
    """

    def __init__(
        self,
        name: str,
        encoder: Encoder | None,
        sender: Sender,
        *,
        max_spans: int = 2048,
        max_bytes: int = 2 << 20,
        queue_requests: int = 64,
        queue_bytes: int = 32 << 20,
        stop: threading.Event | None = None,
    ) -> None:
        self.name = name
        self.encoder = encoder
        self.sender = sender
        self.max_spans = max_spans
        self.max_bytes = max_bytes
        self._frags: list[Any] = []
        self._size = 0
        self._q: deque[tuple[int, Any, int]] = deque()
        self._qlock = threading.Lock()
        self._qmax = queue_requests
        self._qbytes_max = queue_bytes
        self._qbytes = 0
        #: Set at shutdown; the sender's backoff waits on it.
        self.stop = stop if stop is not None else threading.Event()
        self._wake = threading.Event()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.parent: SpanExporter | None = None

    # -- the export worker's side (under the exporter's lock) ----------------------------

    def add(self, spans: list[Span]) -> None:
        enc = self.encoder
        bad = enc.bad if enc is not None else 0
        i, n = 0, len(spans)
        while i < n:
            frags = self._frags
            room = max(1, self.max_spans - len(frags))
            chunk = spans if i == 0 and n <= room else spans[i : i + room]
            i += len(chunk)
            if enc is None:
                frags.extend(chunk)
            else:
                self._size += enc.spans(chunk, frags)
            if len(frags) >= self.max_spans or self._size >= self.max_bytes:
                self.seal()
        if enc is not None and enc.bad != bad and self.parent is not None:
            self.parent._count(dropped=enc.bad - bad)
            self.parent._report(self, "encode", "a span had a value OTLP cannot carry; skipped")

    def seal(self) -> None:
        frags = self._frags
        if not frags:
            return
        n = len(frags)
        payload = frags if self.encoder is None else self.encoder.request(frags, self._size)
        size = self._size if self.encoder is not None else 256 * n
        self._frags = []
        self._size = 0
        if (
            len(self._q) >= self._qmax
            or self._qbytes + size > self._qbytes_max
            or self.stop.is_set()
        ):
            if self.parent is not None:
                self.parent._count(dropped=n)
                if self.stop.is_set():
                    self.parent._report(self, "stopped", "spans after shutdown; dropped")
                else:
                    self.parent._report(self, "queue", "request queue full; dropping spans")
            return
        with self._qlock:
            self._qbytes += size
        self._q.append((n, payload, size))
        self._wake.set()

    # -- the sender thread -----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"memra-obs-spans-{self.name}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        q = self._q
        parent = self.parent
        assert parent is not None
        while True:
            if not q:
                if self.stop.is_set():
                    return
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            self._busy = True
            try:
                n, payload, size = q.popleft()
                with self._qlock:
                    self._qbytes -= size
                try:
                    rejected = self.sender.send(payload)
                except SendError as exc:
                    parent._count(dropped=n, errors=1)
                    parent._report(self, "send", str(exc))
                except Exception as exc:  # a sender bug must not kill the thread
                    parent._count(dropped=n, errors=1)
                    parent._report(self, "bug", f"sender raised {exc!r}")
                else:
                    rejected = min(max(rejected, 0), n)
                    parent._count(exported=n - rejected, dropped=rejected)
            finally:
                self._busy = False

    def wait_idle(self, deadline: float) -> bool:
        self._wake.set()
        while self._q or self._busy:
            if self._thread is None or not self._thread.is_alive() or time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, deadline: float) -> None:
        """Stop the sender thread (after what is queued, while time is left), then close."""
        self.stop.set()
        self._wake.set()
        t = self._thread
        if t is not None:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():  # stuck in a network call: cut it short
                self.sender.abort()
                t.join(0.5)
        left = sum(n for n, _, _ in self._q)
        self._q.clear()
        if left and self.parent is not None:
            self.parent._count(dropped=left)
        try:
            self.sender.close()
        except Exception:
            pass


class SpanExporter:
    """A :class:`memra_obs.export.RecordExporter` publishing the spans of DESIGN §4."""

    #: The ``signal`` label its counters are published under (``memra_obs_dropped_total``).
    signal = "spans"

    def __init__(self, outputs: Sequence[Output], *, round_spans: int = 256) -> None:
        self.builder = SpanBuilder(round_spans)
        self.outputs = tuple(outputs)
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self.exported_spans = 0
        self.dropped_spans = 0
        self.export_errors = 0
        self._closed = False
        for o in self.outputs:
            o.parent = self
            o.start()

    def forget_open(self) -> None:
        """Forget sessions still open instead of closing them at shutdown (agent hand-over)."""
        with self._lock:
            self.builder.forget_open()

    def export(self, batch: Sequence[Record]) -> None:
        spans: list[Span] = []
        with self._lock:
            if self._closed:
                return
            b = self.builder
            bad = b.bad_records
            b.add(batch, spans)
            if b.bad_records != bad:
                self._count(errors=b.bad_records - bad)
            if spans:
                for o in self.outputs:
                    o.add(spans)

    def tick(self) -> None:
        """After each drain: whatever is pending becomes a request now (latency bound =
        the worker's wake interval)."""
        with self._lock:
            for o in self.outputs:
                o.seal()

    def flush(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        self.tick()
        ok = True
        for o in self.outputs:
            ok = o.wait_idle(deadline) and ok
        return ok

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Close sessions that never ended (end = last stamp seen), send what is left while
        ``timeout_s`` lasts, and stop. Bounded: a stuck send is cut off."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return
            spans: list[Span] = []
            self.builder.finish_open(spans)
            for o in self.outputs:
                if spans:
                    o.add(spans)
                o.seal()
            self._closed = True
        for o in self.outputs:
            o.close(deadline)

    # -- accounting ----------------------------------------------------------------------

    def _count(self, *, exported: int = 0, dropped: int = 0, errors: int = 0) -> None:
        with self._count_lock:
            self.exported_spans += exported
            self.dropped_spans += dropped
            self.export_errors += errors

    def _report(self, out: Output, kind: str, msg: str) -> None:
        say_once(
            f"spans:{id(self)}:{out.name}:{kind}",
            f"spans to {out.sender.url}: {msg} (counted in dropped_spans; reported once)",
        )
