"""The event-timed phase clock (``MEMRA_OBS_CLOCK=event``) and the stream adapters it needs:
device truth without a drain per phase. ``mark`` records a CUDA event on ``e`` (and ``eh``) and
reads the host clock, never waiting; ``settle``, at burst end (and every ``SETTLE_ROUNDS`` rounds
of a longer burst), drains once, records an anchor on each idle stream, waits for it and
resolves every boundary (the sync clock's definition)::

    dev_s(i)   = anchor_host - elapsed(event_i on s, anchor on s)     # s = e, eh
    boundary_i = max(host_i, dev_e(i), dev_eh(i), boundary_{i-1})

Events are pooled per stream across bursts and sessions (README, "Device truth").
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import partial
from operator import attrgetter
from typing import Any

from ..clock import Stream, clock, drain, now_ns
from ..diagnostics import say_once


def framework(stream: object) -> str | None:
    """``"cupy"``, ``"torch"`` or None, from the module of the stream's type or of a base of it
    (an engine's own ``torch.cuda.Stream`` subclass is torch's: no import)."""
    for t in type(stream).__mro__:
        root = (t.__module__ or "").split(".", 1)[0]  # None's is "builtins"
        if root in _FRAMEWORKS:
            return _FRAMEWORKS[root]
    return None


_FRAMEWORKS = {"cupy": "cupy", "cupy_backends": "cupy", "torch": "torch"}


def stream_handle(stream: object, fw: str | None = None) -> int | None:
    """The raw ``cudaStream_t`` of a CuPy (``.ptr``) or torch (``.cuda_stream``) stream."""
    attr = _HANDLE.get(fw or framework(stream) or "")
    try:
        return None if attr is None else int(getattr(stream, attr))
    except Exception:
        return None


def stream_device(stream: object, fw: str | None = None) -> int | None:
    """The CUDA ordinal of a CuPy (``.device_id``) or torch (``.device.index``) stream, or None.
    CuPy's -1 (``Stream.null``, ``.ptds``, ``ExternalStream``: the current device's) is the
    current device: as an ordinal, every event failed to make (host stamps only, unsaid why)."""
    attr = _DEVICE.get(fw or framework(stream) or "")
    try:
        d = None if attr is None else int(attrgetter(attr)(stream))
        if d is not None and d < 0:
            import cupy

            d = int(cupy.cuda.runtime.getDevice())
        return d
    except Exception:
        return None


_HANDLE = {"cupy": "ptr", "torch": "cuda_stream"}
_DEVICE = {"cupy": "device_id", "torch": "device.index"}


def same_stream(a: object, b: object) -> bool:
    """One CUDA stream: the same object, or one handle on one device (0 exists on each)."""
    if a is b:
        return True
    fa, fb = framework(a), framework(b)  # (a torch stream and CuPy's ExternalStream of it: one)
    if fa is None or fb is None or (ha := stream_handle(a, fa)) is None:
        return False
    return ha == stream_handle(b, fb) and stream_device(a, fa) == stream_device(b, fb)


def pair(e: Stream | None, eh: Stream | None) -> tuple[Stream | None, Stream | None]:
    """``(e, eh)``, ``eh`` made ``e`` when it is the same stream (or None): clocks use ``is``."""
    if eh is None or same_stream(e, eh):
        return e, e
    return (eh, eh) if e is None else (e, eh)


class DuckEvents:
    """Timing events for one kind of stream; this base: torch's duck API (``record_event()``) on
    streams of no known framework (test doubles, simulations). ``new`` may allocate; ``recorder``
    pre-binds the hot-path record (never blocking); ``wait`` and ``elapsed_ns`` run at settle."""

    def new(self, stream: Any) -> Any:
        return stream.record_event()

    def recorder(self, ev: Any, stream: Any) -> Callable[[], Any]:
        return partial(stream.record_event, ev)

    def wait(self, ev: Any) -> None:
        ev.synchronize()

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return round(start.elapsed_time(end) * 1e6)


class TorchEvents(DuckEvents):
    """``torch.cuda.Event(enable_timing=True)``; the device binds at the first record."""

    def __init__(self) -> None:
        import torch

        self._event = torch.cuda.Event

    def new(self, stream: Any) -> Any:
        return self._event(enable_timing=True)

    def recorder(self, ev: Any, stream: Any) -> Callable[[], Any]:
        return partial(ev.record, stream)


class CupyEvents(TorchEvents):
    """``cupy.cuda.Event`` (timing on) made on the stream's device."""

    def __init__(self) -> None:
        import cupy

        self._cuda = cupy.cuda

    def new(self, stream: Any) -> Any:
        with self._cuda.Device(stream_device(stream)):  # None: the current device
            return self._cuda.Event()

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return round(self._cuda.get_elapsed_time(start, end) * 1e6)


_ops: dict[str, DuckEvents] = {}
EventsOf = Callable[[Any], DuckEvents | None]


def event_ops(stream: object) -> DuckEvents | None:
    """The event operations for ``stream``'s kind; None when it has no timing events."""
    fw = framework(stream)
    if fw is None:
        return DuckEvents() if callable(getattr(stream, "record_event", None)) else None
    if fw not in _ops:
        _ops[fw] = CupyEvents() if fw == "cupy" else TorchEvents()
    return _ops[fw]


MAX_PENDING = 1 << 16  # unsettled marks kept at most: bursts that never settle stay bounded


class _Lane:
    """One stream's event pool, with a pre-bound record call per event, and its anchor."""

    __slots__ = ("anchor", "calls", "key", "ops", "pool", "stream")

    def __init__(self, key: object, stream: Any, ops: DuckEvents) -> None:
        self.key, self.stream, self.ops = key, stream, ops
        self.pool: list[Any] = []
        self.calls: list[Callable[[], None]] = []
        self.anchor: Any = None

    def grow(self, size: int) -> None:
        while len(self.pool) < size:
            ev = self.ops.new(self.stream)
            self.pool.append(ev)
            self.calls.append(self.ops.recorder(ev, self.stream))


# A finished session's lanes wait here for the next session on their stream, keyed by the CUDA
# stream (fresh wrappers of one stream share) or else by identity (the lane holds its stream).
_free: dict[object, list[_Lane]] = {}
_free_lock = threading.Lock()
_MAX_KEYS, _MAX_PER_KEY = 256, 16


def _take_lane(stream: Any, ops: DuckEvents) -> _Lane:
    h = stream_handle(stream)
    cuda = (framework(stream), stream_device(stream), h) if h is not None else id(stream)
    key = (cuda, type(ops))
    with _free_lock:
        if lanes := _free.get(key):
            return lanes.pop()
    return _Lane(key, stream, ops)


def _give_back(lanes: tuple[_Lane, ...]) -> None:
    with _free_lock:
        for lane in lanes:
            kept = _free.get(lane.key)
            if kept is None and len(_free) < _MAX_KEYS:
                kept = _free[lane.key] = []
            if kept is not None and len(kept) < _MAX_PER_KEY:
                kept.append(lane)


class EventClock:
    """:class:`memra_obs.clock.PhaseClock` on CUDA events: ``mark`` records, ``settle`` resolves.
    ``events``: ``stream -> DuckEvents | None`` (default :func:`event_ops`; tests hand in fakes)."""

    immediate = False

    def __init__(
        self, e: Stream | None = None, eh: Stream | None = None, *, events: EventsOf = event_ops
    ) -> None:
        self.e, self.eh = e, eh = pair(e, eh)
        #: Host ns from before the last anchor's record to after its wait: the bound on the
        #: anchor's uncertainty (0 before the first settle).
        self.anchor_window_ns = 0
        self._n, self._cap, self._broken = 0, 0, False
        self._lanes: tuple[_Lane, ...] = ()
        self._calls: tuple[list[Callable[[], None]], ...] = ()
        streams = [s for s in (e, None if eh is e else eh) if s is not None]
        if not streams:  # no device: host stamps are the truth, final at once
            self.immediate = True
            self.mark = now_ns  # type: ignore[method-assign]
            return
        ops = [(s, events(s)) for s in streams]
        for s, o in ops:
            if o is None:
                t = type(s)
                why = "has no CUDA events; draining at every boundary (the sync clock's numbers)"
                _say(f"noevents:{t.__qualname__}", f"{t.__module__}.{t.__qualname__} {why}")
                self.immediate = True
                self.mark = partial(clock, e, eh)  # type: ignore[method-assign]
                return
        self._lanes = tuple(_take_lane(s, o) for s, o in ops if o is not None)
        self._calls = tuple(lane.calls for lane in self._lanes)
        self._cap = min(len(c) for c in self._calls)
        # Not a bound ``mark`` on the instance: that cycle would delay the lanes' return.
        weakref.finalize(self, _give_back, self._lanes)

    def mark(self) -> int:
        """Record an event on each stream (never waits); the host stamp, provisional."""
        i = self._n
        if i >= self._cap:
            i = self._grow(i)
        try:
            for calls in self._calls:
                calls[i]()
        except Exception as exc:  # never into the loop: this burst keeps its host stamps
            self._broken = True
            _say("record", f"recording an event failed ({exc!r}); that burst keeps host stamps")
        self._n = i + 1
        return now_ns()

    def _grow(self, i: int) -> int:
        if i >= MAX_PENDING:  # marks nobody settled (bursts with no complete round): start over
            self._n, self._broken = 0, True
            return 0
        try:
            for lane in self._lanes:
                lane.grow(min(max(8, 2 * i), MAX_PENDING))
        except Exception as exc:
            self._broken = True
            _say("grow", f"making CUDA events failed ({exc!r}); host stamps kept")
        self._cap = min(len(lane.calls) for lane in self._lanes)
        return i if i < self._cap else 0

    def settle(self, stamps: list[int]) -> list[int]:
        """The last ``len(stamps)`` marks' host stamps resolved to device truth with one drain
        (earlier unsettled marks dropped); a burst in which a record failed keeps its stamps."""
        n, lanes = len(stamps), self._lanes
        base, broken = self._n - n, self._broken
        self._n, self._broken = 0, False  # (0 stamps: the marks no round reads are forgotten)
        if not lanes or n == 0:
            return list(stamps)
        drain(self.e, self.eh)
        if base < 0:
            _say("settle-count", f"settle got {n} stamps for {base + n} marks; host stamps kept")
        if broken or base < 0:
            return list(stamps)
        h0 = now_ns()
        for lane in lanes:
            if lane.anchor is None:
                lane.anchor = lane.ops.new(lane.stream)
            lane.ops.recorder(lane.anchor, lane.stream)()
        for lane in lanes:
            lane.ops.wait(lane.anchor)
        h1 = now_ns()
        self.anchor_window_ns = h1 - h0
        out = list(stamps)
        for lane in lanes:
            pool, anchor, elapsed = lane.pool, lane.anchor, lane.ops.elapsed_ns
            for i in range(n):
                out[i] = max(out[i], h1 - elapsed(pool[base + i], anchor))
        for i in range(1, n):
            out[i] = max(out[i], out[i - 1])
        return out


def _say(key: str, msg: str) -> None:
    say_once("event-clock:" + key, "event clock: " + msg)
