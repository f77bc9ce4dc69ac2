"""Stream adapters: what the clocks need of a CuPy stream, a torch stream, or any object with
``.synchronize()`` — without importing CuPy or torch until such a stream is actually seen.

The framework is read off the *module of the stream's type* (``cupy.cuda.stream`` /
``torch.cuda.streams``), never by importing it: a CPU-only install never loads either.

Two things live here:

* :func:`pair` — the ``(e, eh)`` of the seed's ``clock(e, eh)`` with ``eh`` folded into ``e``
  when both name the same CUDA stream (the same object, or two Python wrappers of one handle,
  as ``torch.cuda.current_stream()`` hands out), so a boundary drains each stream once.
* :class:`EventOps` and :func:`event_ops` — make / record / wait / elapsed of timing-capable
  CUDA events for the stream's framework, used by :class:`memra_obs.device.event_clock.EventClock`.
  A stream of another kind that offers torch's duck API (``record_event()`` returning events
  with ``synchronize()`` and ``elapsed_time(other)`` in ms) is served by
  :class:`DuckEvents` — that is how test doubles and simulated streams take part.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from ..clock import Stream

__all__ = [
    "CupyEvents",
    "DuckEvents",
    "EventOps",
    "TorchEvents",
    "as_stream",
    "event_ops",
    "framework",
    "pair",
    "same_stream",
    "stream_device",
    "stream_handle",
]


def framework(stream: object) -> str | None:
    """``"cupy"``, ``"torch"`` or None, from the module of the stream's type (no import)."""
    if stream is None:
        return None
    mod = type(stream).__module__ or ""
    root = mod.split(".", 1)[0]
    if root in ("cupy", "cupy_backends"):
        return "cupy"
    if root == "torch":
        return "torch"
    return None


def as_stream(obj: object) -> Stream | None:
    """Check that ``obj`` is something a clock can drain (``None`` = no device).

    Raises TypeError at session start rather than failing silently at every boundary."""
    if obj is None:
        return None
    if not callable(getattr(obj, "synchronize", None)):
        raise TypeError(
            f"{type(obj).__module__}.{type(obj).__qualname__} is not a stream: the clocks need "
            "an object with .synchronize() (a CuPy or torch stream), or None for no device"
        )
    return obj  # type: ignore[return-value]


def stream_handle(stream: object) -> int | None:
    """The raw ``cudaStream_t`` of a CuPy (``.ptr``) or torch (``.cuda_stream``) stream."""
    fw = framework(stream)
    try:
        if fw == "cupy":
            return int(stream.ptr)  # type: ignore[attr-defined]
        if fw == "torch":
            return int(stream.cuda_stream)  # type: ignore[attr-defined]
    except Exception:
        return None
    return None


def stream_device(stream: object) -> int | None:
    """The CUDA ordinal a CuPy or torch stream belongs to (None when unknown)."""
    fw = framework(stream)
    try:
        if fw == "cupy":
            dev = getattr(stream, "device_id", None)
            return None if dev is None else int(dev)
        if fw == "torch":
            d = stream.device  # type: ignore[attr-defined]
            return None if d is None or d.index is None else int(d.index)
    except Exception:
        return None
    return None


def same_stream(a: object, b: object) -> bool:
    """True when ``a`` and ``b`` are one CUDA stream: the same object, or wrappers of the same
    handle on the same device (handle 0, the legacy default stream, exists once per device)."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    ha = stream_handle(a)
    if ha is None or ha != stream_handle(b):
        return False
    return stream_device(a) == stream_device(b)


def pair(e: Stream | None, eh: Stream | None) -> tuple[Stream | None, Stream | None]:
    """``(e, eh)`` with ``eh`` replaced by ``e`` when it is the same stream (or None).

    Clocks compare with ``is``; after this, "the same stream given twice" drains once."""
    if eh is None or same_stream(e, eh):
        return e, e
    if e is None:
        return eh, eh
    return e, eh


# ======================================================================== CUDA events


class EventOps(Protocol):
    """Timing events for one kind of stream. ``new`` may be slow (it allocates); ``recorder``
    pre-binds the hot-path call (record ``ev`` on ``stream``, never blocking) so a boundary is
    one call per stream; ``wait`` and ``elapsed_ns`` run only at settle."""

    def new(self, stream: Any) -> Any: ...
    def recorder(self, ev: Any, stream: Any) -> Callable[[], Any]: ...
    def record(self, ev: Any, stream: Any) -> None: ...
    def wait(self, ev: Any) -> None: ...
    def elapsed_ns(self, start: Any, end: Any) -> int: ...


def _ms_to_ns(ms: float) -> int:
    return round(ms * 1e6)


class CupyEvents:
    """``cupy.cuda.Event`` (timing on) created on the stream's device."""

    def __init__(self) -> None:
        import cupy

        self._cp = cupy

    def new(self, stream: Any) -> Any:
        cp = self._cp
        dev = stream_device(stream)
        if dev is None:
            return cp.cuda.Event()
        with cp.cuda.Device(dev):
            return cp.cuda.Event()

    def recorder(self, ev: Any, stream: Any) -> Callable[[], Any]:
        return partial(ev.record, stream)

    def record(self, ev: Any, stream: Any) -> None:
        ev.record(stream)

    def wait(self, ev: Any) -> None:
        ev.synchronize()

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return _ms_to_ns(self._cp.cuda.get_elapsed_time(start, end))


class TorchEvents:
    """``torch.cuda.Event(enable_timing=True)``; the device binds at first record."""

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def new(self, stream: Any) -> Any:
        return self._torch.cuda.Event(enable_timing=True)

    def recorder(self, ev: Any, stream: Any) -> Callable[[], Any]:
        return partial(ev.record, stream)

    def record(self, ev: Any, stream: Any) -> None:
        ev.record(stream)

    def wait(self, ev: Any) -> None:
        ev.synchronize()

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return _ms_to_ns(start.elapsed_time(end))


class DuckEvents:
    """Streams of no known framework that speak torch's duck API: ``stream.record_event(ev=None)``
    returns an event with ``synchronize()`` and ``elapsed_time(end)`` (ms)."""

    def new(self, stream: Any) -> Any:
        return stream.record_event()

    def recorder(self, ev: Any, stream: Any) -> Callable[[], Any]:
        return partial(stream.record_event, ev)

    def record(self, ev: Any, stream: Any) -> None:
        stream.record_event(ev)

    def wait(self, ev: Any) -> None:
        ev.synchronize()

    def elapsed_ns(self, start: Any, end: Any) -> int:
        return _ms_to_ns(start.elapsed_time(end))


_ops_cache: dict[str, EventOps] = {}


def event_ops(stream: object) -> EventOps | None:
    """The event operations for ``stream``'s kind, or None when it has no timing events."""
    fw = framework(stream)
    if fw is None:
        return DuckEvents() if callable(getattr(stream, "record_event", None)) else None
    ops = _ops_cache.get(fw)
    if ops is None:
        ops = CupyEvents() if fw == "cupy" else TorchEvents()
        _ops_cache[fw] = ops
    return ops
