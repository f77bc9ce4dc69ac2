"""The event-timed phase clock (``MEMRA_OBS_CLOCK=event``): device truth without a drain per
phase, so the per-round metrics can stay on while serving.

At each boundary :meth:`EventClock.mark` records one CUDA event on ``e`` (and one on ``eh``
when it is another stream) and reads the host clock; it never waits. At burst end
:meth:`EventClock.settle` drains once, records an *anchor* event on each idle stream, waits for
it and reads the host clock right after, then resolves every boundary::

    dev_s(i)   = anchor_host - elapsed(event_i on s, anchor on s)     # device time, host base
    boundary_i = max(host_i, dev_e(i), dev_eh(i), boundary_{i-1})

so a boundary is "the host got there *and* everything queued before it on both streams was
done" — what the sync clock's drain-then-read measures, minus the serialization.

What each clock measures, and when they differ (the README's "Device truth" section says it at length):

* **Device-bound phases** (the usual case: queue kernels, move on) land in the same bucket
  under both clocks, within the drain/record latencies (a few µs per boundary).
* **Host-only work** (detext, sampling on the host, Python glue) under the sync clock starts
  after the previous phase's device tail is drained, so it adds on top; under the event clock it
  overlaps that tail and only what sticks out past it is charged to its phase. Event buckets sum
  to the real round wall; sync buckets sum to the serialized (slower) wall.
* **e / eh overlap**: both clocks close a phase when *both* streams are done with it. Under the
  sync clock the next phase cannot start earlier; under the event clock the next phase's work on
  one stream can run beside the previous phase's tail on the other, and the overlap is charged to
  the earlier phase.
* **The anchor**: the host reading is taken just after the anchor event is seen complete, so
  every mapped device stamp carries the same offset — the wake-up latency of that wait, bounded
  by :attr:`EventClock.anchor_window_ns` (host time from before the anchor's record to after its
  wait, typically a few µs). A constant offset cancels in every bucket but the first boundary's
  ``max`` with its host stamp. Event timestamps resolve to about 0.5 µs.

Events are pooled per stream and reused by every burst and every later session on that stream:
in steady state a boundary allocates nothing. Streams of no known kind (no CUDA events, no torch-style ``record_event``) cannot be
timed this way: the clock then drains at every boundary like the sync clock, and says so once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..clock import Stream, drain, now_ns
from ..diagnostics import say_once
from .streams import EventOps, event_ops, framework, pair, stream_device, stream_handle

__all__ = ["EventClock"]


def _say_once(key: str, msg: str) -> None:
    say_once(f"event-clock:{key}", msg)


#: Unsettled marks kept at most (a loop whose bursts never settle must not grow without bound).
MAX_PENDING = 1 << 16


class _Lane:
    """One stream's event pool (with a pre-bound record call per event) and its anchor."""

    __slots__ = ("anchor", "calls", "key", "ops", "pool", "stream")

    def __init__(self, key: object, stream: Any, ops: EventOps) -> None:
        self.key = key
        self.stream = stream
        self.ops = ops
        self.pool: list[Any] = []
        self.calls: list[Callable[[], None]] = []
        self.anchor: Any = None

    def grow(self, size: int) -> None:
        ops, stream = self.ops, self.stream
        while len(self.pool) < size:
            ev = ops.new(stream)
            self.pool.append(ev)
            self.calls.append(ops.recorder(ev, stream))


# Lanes outlive their clock (one clock per session): a finished session's lanes go back here
# and the next session on the same stream takes them, events and all. Keyed by the CUDA
# stream (framework, device, handle) so fresh wrappers of one stream share; other streams by
# identity (the lane holds its stream, so the id stays unique while the lane is kept).
_free: dict[object, list[_Lane]] = {}
_free_lock = threading.Lock()
_MAX_KEYS = 256
_MAX_PER_KEY = 16


def _lane_key(stream: Any, ops: EventOps) -> object:
    h = stream_handle(stream)
    if h is None:
        return ("id", id(stream), type(ops))
    return (framework(stream), stream_device(stream), h, type(ops))


def _take_lane(stream: Any, ops: EventOps) -> _Lane:
    key = _lane_key(stream, ops)
    with _free_lock:
        lanes = _free.get(key)
        if lanes:
            return lanes.pop()
    return _Lane(key, stream, ops)


def _give_back(lanes: tuple[_Lane, ...]) -> None:
    with _free_lock:
        for lane in lanes:
            kept = _free.get(lane.key)
            if kept is None:
                if len(_free) >= _MAX_KEYS:
                    continue
                kept = _free[lane.key] = []
            if len(kept) < _MAX_PER_KEY:
                kept.append(lane)


class EventClock:
    """:class:`memra_obs.clock.PhaseClock` on CUDA events: ``mark`` records, ``settle`` resolves.

    ``events`` overrides how events are made for a stream (``stream -> EventOps | None``;
    default :func:`memra_obs.device.streams.event_ops`) — tests hand in fakes.
    """

    immediate = False

    def __init__(
        self,
        e: Stream | None = None,
        eh: Stream | None = None,
        *,
        events: Callable[[Any], EventOps | None] = event_ops,
    ) -> None:
        e, eh = pair(e, eh)
        self.e = e
        self.eh = eh
        #: Host ns from before the last anchor's record to after its wait: the bound on the
        #: anchor's uncertainty (0 before the first settle).
        self.anchor_window_ns = 0
        self._n = 0
        self._cap = 0
        self._broken = False
        self._lanes: tuple[_Lane, ...] = ()
        self._calls: tuple[list[Callable[[], None]], ...] = ()
        streams = [s for s in (e, eh) if s is not None]
        if len(streams) == 2 and streams[1] is streams[0]:
            streams.pop()
        if not streams:
            # No device: host stamps are the truth and final at once.
            self.immediate = True
            self.mark = now_ns  # type: ignore[method-assign]
            return
        lanes = []
        for s in streams:
            ops = events(s)
            if ops is None:
                _say_once(
                    f"noevents:{type(s).__qualname__}",
                    f"event clock: {type(s).__module__}.{type(s).__qualname__} has no CUDA events; "
                    "draining at every boundary instead (the sync clock's numbers)",
                )
                self.immediate = True
                self.mark = lambda: _drain_then_read(e, eh)  # type: ignore[method-assign]
                return
            lanes.append(_take_lane(s, ops))
        self._lanes = tuple(lanes)
        self._calls = tuple(lane.calls for lane in lanes)
        self._cap = min(len(lane.calls) for lane in lanes)
        weakref.finalize(self, _give_back, self._lanes)
        # (``mark`` is the method below: binding it onto the instance would make a cycle and
        # delay the lanes' return to the pool until a GC pass.)

    # -- the hot path --------------------------------------------------------------------

    def mark(self) -> int:
        """Record an event on each stream (never waits); the host stamp, provisional."""
        i = self._n
        if i >= self._cap:
            i = self._grow(i)
        try:
            for calls in self._calls:
                calls[i]()
        except Exception as exc:
            # Never into the loop: this burst keeps its host stamps (see settle).
            self._broken = True
            _say_once(
                "record",
                f"event clock: recording a CUDA event failed ({exc!r}); "
                "bursts with a failed record keep host stamps",
            )
        self._n = i + 1
        return now_ns()

    def _grow(self, i: int) -> int:
        if i >= MAX_PENDING:
            # Marks nobody settled (bursts with no complete round): start the pool over.
            self._n = 0
            self._broken = True
            return 0
        size = min(max(8, 2 * i), MAX_PENDING)
        try:
            for lane in self._lanes:
                lane.grow(size)
        except Exception as exc:
            self._broken = True
            _say_once("grow", f"event clock: making CUDA events failed ({exc!r}); host stamps kept")
        self._cap = min(len(lane.calls) for lane in self._lanes)
        return i if i < self._cap else 0

    # -- the protocol --------------------------------------------------------------------

    def begin(self) -> int:
        """Forget unsettled marks and mark the first boundary."""
        self._n = 0
        self._broken = False
        return self.mark()

    def settle(self, stamps: list[int]) -> list[int]:
        """Resolve the last ``len(stamps)`` marks to device truth (one drain for the burst).

        ``stamps`` are the host stamps :meth:`mark` returned, in order; marks made before them
        and never settled are dropped. A burst in which a record failed keeps its host stamps."""
        n = len(stamps)
        lanes = self._lanes
        if not lanes or n == 0:
            return list(stamps)
        marked, broken = self._n, self._broken
        self._n = 0
        self._broken = False
        # One drain per burst, then an anchor on each idle stream.
        for lane in lanes:
            try:
                lane.stream.synchronize()
            except Exception:
                pass
        base = marked - n
        if broken or base < 0:
            if base < 0:
                _say_once(
                    "settle-count",
                    f"event clock: settle got {n} stamps for {marked} marks; "
                    "host stamps kept for that burst",
                )
            return list(stamps)
        h0 = now_ns()
        for lane in lanes:
            if lane.anchor is None:
                lane.anchor = lane.ops.new(lane.stream)
            lane.ops.record(lane.anchor, lane.stream)
        for lane in lanes:
            lane.ops.wait(lane.anchor)
        h1 = now_ns()
        self.anchor_window_ns = h1 - h0
        out = list(stamps)
        for lane in lanes:
            pool, anchor, elapsed = lane.pool, lane.anchor, lane.ops.elapsed_ns
            for i in range(n):
                dev = h1 - elapsed(pool[base + i], anchor)
                if dev > out[i]:
                    out[i] = dev
        prev = out[0]
        for i in range(1, n):
            if out[i] < prev:
                out[i] = prev
            else:
                prev = out[i]
        return out


def _drain_then_read(e: Stream | None, eh: Stream | None) -> int:
    drain(e, eh)
    return now_ns()
