"""The span RecordExporter: records -> span tuples -> encoded requests -> a bounded queue -> a
sender thread per output, with the one retry loop all senders share. Building and encoding hold
the GIL, so they run in ``export()`` on the export worker; sending waits on the network, so it
has its own thread. A full queue drops the newest request: nothing waits. Every span is counted
once, exported or dropped; retries and shutdown keep to their deadlines (README, "Promises").
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..diagnostics import say_once
from ..timeline import MAX_OPEN, Record
from .otlp import Encoder
from .spans import Span, SpanBuilder
from .transport import Partial, Retry, SendError

_CUT_S = 0.02  # what shutdown keeps of its time to cut a stuck send off and still be on time
_CHUNK = 128  # spans encoded per call: a request passes max_bytes by one chunk at most
_QUEUE_BYTES = 32 << 20


#: The longest wait before a retry; with no connection (refused: nobody to hammer) 1 s, so a
#: collector back from an outage has the spans within ~1 s (gRPC: its reconnect backoff, 2.4 s
#: at most, first; the two compounded to 8 s with 5 s here).
BACKOFF_CAP_S, REFUSED_CAP_S = 5.0, 1.0


def backoff_s(n: int, cap: float = BACKOFF_CAP_S) -> float:
    """The wait before retry ``n`` (0-based): exponential, capped, jittered to spread clients."""
    return min(0.1 * 2**n, cap) * random.uniform(0.5, 1.0)


class Output:
    """One destination: an encoder (None: span tuples pass through), a sender, and the bounded
    queue and thread between them. A request is sealed at about ``max_spans`` spans or
    ``max_bytes`` bytes (under gRPC's 4 MiB) or at the worker's tick: the cost is per request.
    ``hold``: a full queue waits for room instead of dropping (the tail, to a local output)."""

    hold = False

    def __init__(
        self,
        name: str,
        encoder: Encoder | None,
        sender: Any,  # url, timeout_s, send(payload, timeout_s), abort(), close(): .transport
        *,
        max_spans: int = 2048,
        max_bytes: int = 2 << 20,
        queue_requests: int = 64,
    ) -> None:
        self.name, self.encoder, self.sender = name, encoder, sender
        self.max_spans, self.max_bytes = max_spans, max_bytes
        self._qmax = queue_requests
        self._stop_at = math.inf  # shutdown's deadline (time.monotonic), once it began
        self._closed = False
        self._empty()
        self.parent: SpanExporter  # the exporter it joins sets it, before anything is counted

    def _empty(self) -> None:
        """Nothing pending, queued or in flight; a fresh lock and a sender thread, not started."""
        self._frags: list[Any] = []
        self._size = self._qbytes = 0
        self._q: deque[tuple[int, Any, int, int]] = deque()
        self._cv = threading.Condition()  # guards the queue, _flying and the deadlines
        self._flying = 0  # spans in flight; who zeroes it (sender or shutdown) counts them
        # Delivery marks, in spans added: every span up to _sealed is in a request; one up to
        # _done is sent or counted dropped (requests go in order). See :meth:`settled`.
        self.added = self._sealed = self._done = 0
        self.exported = self.dropped = 0  # this output's spans (the exporter's: every output's)
        name = f"memra-obs-spans-{self.name}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def add(self, spans: list[Span]) -> None:
        """On the export worker, under the exporter's lock (as :meth:`seal`)."""
        enc, step, i = self.encoder, self.max_spans, 0
        while i < len(spans):  # unencoded: requests of max_spans at most (SdkSender's chunks)
            by = min(step, _CHUNK) if enc is not None else step - len(self._frags)
            chunk, i = spans[i : i + by], i + by
            self.added += len(chunk)
            if enc is None:
                self._frags += chunk
            else:
                bad = enc.bad
                self._size += enc.spans(chunk, self._frags)
                if enc.bad != bad:
                    self._count(0, enc.bad - bad, 0, "encode", "a value OTLP cannot carry")
            if len(self._frags) >= step or self._size >= self.max_bytes:
                self.seal()

    def seal(self) -> None:
        frags, n, enc = self._frags, len(self._frags), self.encoder
        if not n:
            with self._cv:
                self._sealed = self.added  # (spans an encoder refused are counted)
            return
        payload = frags if enc is None else enc.request(frags, self._size)
        size = self._size if enc is not None else 256 * n
        self._frags, self._size = [], 0
        with self._cv:
            self._sealed = upto = self.added
            while True:
                late = self._stop_at < math.inf
                full = len(self._q) >= self._qmax or self._qbytes + size > _QUEUE_BYTES
                if not (full and self.hold and not late and self._thread.is_alive()):
                    break
                self._cv.wait(0.05)  # the tail, to a local output: held back, not dropped
            if not (late or full):
                self._q.append((n, payload, size, upto))
                self._qbytes += size
                self._cv.notify_all()
                return
        why = ("stopped", "spans after shutdown") if late else ("queue", "request queue full")
        self._count(0, n, 0, *why)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and self._stop_at == math.inf:
                    self._cv.wait()
                if not self._q:  # shutdown began and the queue is done (or cut off)
                    return
                n, payload, size, upto = self._q.popleft()
                self._qbytes -= size
                self._flying = n
            try:
                rejected, why = self._deliver(payload)
                rejected = min(max(rejected, 0), n)
                got: tuple[Any, ...] = (n - rejected, rejected, 0)
                if rejected:  # said too (once a reason): a worker without /metrics never knew
                    got += (f"rejected:{why}", f"the receiver rejected {rejected} of {n} spans"
                            + f" ({why})" * bool(why))  # fmt: skip
                elif why:  # OTLP: a warning, nothing rejected
                    say_once(f"spans:{id(self.parent)}:warns:{why}",
                             f"spans to {self.sender.url}: the receiver warns: {why}", "receiver")  # fmt: skip
            except SendError as exc:
                got = (0, n, 1, "send", str(exc))
            except Exception as exc:  # a sender bug must not kill the thread
                got = (0, n, 1, "bug", f"sender raised {exc!r}")
            with self._cv:
                mine, self._flying, self._done = self._flying, 0, upto
                self._cv.notify_all()
            if mine:  # else shutdown cut it off and counted it
                self._count(*got)

    def settled(self) -> int:
        """Spans added so far that are sent or counted dropped (a mark of :attr:`added`): what
        the agent may commit its cursors past (the rest would go with a killed process)."""
        with self._cv:
            return self._done if self._q or self._flying else self._sealed

    def _deliver(self, payload: Any) -> Partial:
        """Send, retrying what is retryable after the receiver's wait (at least
        :func:`backoff_s`) while the export timeout and shutdown's deadline allow."""
        s, tries = self.sender, 0
        until = time.monotonic() + s.timeout_s
        while True:
            left = min(until, self._stop_at) - time.monotonic()
            if left <= 0 or self._closed:
                raise SendError("out of time (export timeout or shutdown)")
            try:
                return s.send(payload, left)
            except Retry as exc:
                cap = REFUSED_CAP_S if exc.refused else BACKOFF_CAP_S
                wait = max(exc.after_s or 0.0, backoff_s(tries, cap))  # "0" must not hammer it
                tries += 1
                end = time.monotonic() + wait
                with self._cv:  # a shutdown meanwhile brings the deadline in
                    while (pause := end - time.monotonic()) > 0:
                        if end > min(until, self._stop_at) or self._closed:
                            raise SendError(f"{exc}; no time to retry in {wait:.2g} s") from None
                        self._cv.wait(pause)

    def after_fork(self) -> None:
        """In a forked child: an empty queue, a fresh lock and thread, no parent's connection."""
        self._empty()
        getattr(self.sender, "after_fork", lambda: None)()
        if self.encoder is not None:
            self.encoder.after_fork()
        if self._stop_at == math.inf:  # not shut down
            self._thread.start()

    def wait_idle(self, deadline: float) -> bool:
        with self._cv:
            while self._q or self._flying:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def close(self, deadline: float) -> None:
        """Send what is queued while time lasts, then cut off the rest (counted dropped) and
        close: back by ``deadline``."""
        with self._cv:
            self._stop_at = deadline
            self._cv.notify_all()
        t = self._thread
        if t.is_alive():
            t.join(max(0.0, deadline - time.monotonic() - _CUT_S))
        with self._cv:
            self._closed = True
            flying, self._flying = self._flying, 0
            left = flying + sum(n for n, _, _, _ in self._q)
            self._q.clear()
            self._cv.notify_all()
        if left:
            self._count(0, left, 1 if flying else 0, "shutdown", "shutdown's time ran out")
        if t.is_alive():
            self.sender.abort()
            t.join(max(0.0, deadline - time.monotonic()))
        if not t.is_alive():
            with contextlib.suppress(Exception):
                self.sender.close()

    def _count(self, ok: int, dropped: int, errors: int, kind: str = "", msg: str = "") -> None:
        self.parent._count(exported=ok, dropped=dropped, errors=errors, out=self)
        if kind:
            msg = f"spans to {self.sender.url}: {msg}; dropped (counted in dropped_spans)"
            many = "receiver" if kind.startswith("rejected:") else ""  # (its text: ids, say)
            say_once(f"spans:{id(self.parent)}:{self.name}:{kind}", msg + " (reported once)", many)


class SpanExporter:
    """A :class:`memra_obs.export.RecordExporter` publishing the spans of DESIGN §4."""

    signal = "spans"  #: the label its counters are published under (memra_obs_dropped_total)

    def __init__(
        self, outputs: Sequence[Output], *, round_spans: int = 256, max_open: int = MAX_OPEN
    ) -> None:
        self.builder = SpanBuilder(round_spans, max_open=max_open)
        self.outputs = tuple(outputs)
        self._lock, self._count_lock = threading.Lock(), threading.Lock()
        self.exported_spans = self.dropped_spans = self.export_errors = 0
        self._closed = False
        for o in self.outputs:
            o.parent = self
            o._thread.start()

    def after_fork(self) -> None:
        """In a forked child: fresh locks (one may have been held at the fork); the parent's
        open sessions and counts stay the parent's."""
        self._lock, self._count_lock = threading.Lock(), threading.Lock()
        self.exported_spans = self.dropped_spans = self.export_errors = 0
        self.builder.forget_open()
        for o in self.outputs:
            o.after_fork()

    def forget_open(self) -> None:
        """Forget sessions still open instead of closing them at shutdown (agent hand-over)."""
        with self._lock:
            self.builder.forget_open()

    def export(self, batch: Sequence[Record]) -> None:
        spans: list[Span] = []
        with self._lock:
            if self._closed:
                return
            b, bad = self.builder, self.builder.bad_records
            b.add(batch, spans)
            if b.bad_records != bad:
                self._count(errors=b.bad_records - bad)
            for o in self.outputs if spans else ():
                o.add(spans)

    def mark(self) -> tuple[int, ...]:
        """Where each output's spans end now; :meth:`settled` says when all before it are
        sent or counted dropped (on the export worker's thread, as :meth:`export`)."""
        return tuple(o.added for o in self.outputs)

    def settled(self, mark: tuple[int, ...]) -> bool:
        return all(o.settled() >= m for o, m in zip(self.outputs, mark, strict=True))

    def tick(self) -> None:
        """After each drain: what is pending becomes a request (latency = the worker's wake)."""
        with self._lock:
            for o in self.outputs:
                o.seal()

    def flush(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        self.tick()
        return all([o.wait_idle(deadline) for o in self.outputs])

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Close unended sessions (at their last stamp), send what is left while ``timeout_s``
        lasts, cut off the rest (counted dropped): back within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            spans: list[Span] = []
            self.builder.finish_open(spans)
            for o in self.outputs:
                o.add(spans)
                o.seal()
        for o in self.outputs:
            o.close(deadline)

    def _count(
        self, *, exported: int = 0, dropped: int = 0, errors: int = 0, out: Output | None = None
    ) -> None:
        with self._count_lock:
            self.exported_spans += exported
            self.dropped_spans += dropped
            self.export_errors += errors
            if out is not None:
                out.exported += exported
                out.dropped += dropped
