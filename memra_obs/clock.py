"""Phase-boundary clocks: where the milliseconds of a round are read.

The seed's contract (``SpecPhaseNs::clock``): at each boundary drain the engine's primary
stream ``e`` and, when it is a different object, the head stream ``eh``, then read a
monotonic clock — so device work lands in the phase that queued it. Streams are duck-typed:
anything with ``.synchronize()`` (a CuPy or torch stream, a test double), or ``None`` for a
loop with no device. Nothing here imports CuPy or torch.

Two clocks implement :class:`PhaseClock` for the observer: :class:`SyncClock` (drain at every
boundary, the default) and the CUDA-event clock in :mod:`memra_obs.device.event_clock`
(``MEMRA_OBS_CLOCK=event``), which records events instead and settles the stamps once per
burst.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["PhaseClock", "ProfClock", "Stream", "SyncClock", "clock", "drain", "now_ns"]

#: The one monotonic clock every ``*_ns_mono`` stamp in this package is read from.
now_ns: Callable[[], int] = time.perf_counter_ns


class Stream(Protocol):
    def synchronize(self) -> Any: ...


def drain(e: Stream | None, eh: Stream | None = None) -> None:
    """Block until the work queued on ``e`` (and ``eh``, when it is another object) is done.

    Like the seed's ``let _ = e.stream().synchronize()``, a failing drain is ignored here:
    the loop's own next call on that stream reports the CUDA error where it belongs.
    """
    if e is not None:
        try:
            e.synchronize()
        except Exception:
            pass
    if eh is not None and eh is not e:
        try:
            eh.synchronize()
        except Exception:
            pass


def clock(e: Stream | None, eh: Stream | None = None) -> int:
    """Drain ``e``/``eh`` and read the monotonic clock (ns): the seed's ``clock(e, eh)``."""
    drain(e, eh)
    return now_ns()


class ProfClock:
    """Phase clock for the first-token profile: ``lap`` drains and returns the ms since the
    previous lap (or ``start``). Only ever built with the profile on."""

    __slots__ = ("e", "eh", "t_ns_mono")

    def __init__(self, e: Stream | None = None, eh: Stream | None = None) -> None:
        self.e = e
        self.eh = eh
        self.t_ns_mono = clock(e, eh)

    @classmethod
    def start(cls, e: Stream | None = None, eh: Stream | None = None) -> ProfClock:
        return cls(e, eh)

    def lap(self, e: Stream | None = None, eh: Stream | None = None) -> float:
        now = clock(self.e if e is None else e, self.eh if eh is None else eh)
        d = now - self.t_ns_mono
        self.t_ns_mono = now
        # ns -> ms in one rounding (the seed's as_secs_f64() * 1e3 rounds twice and prints
        # 0.022442999999999998 where this prints 0.022443).
        return d / 1e6


class PhaseClock(Protocol):
    """What the observer needs of a clock: stamps at boundaries, settled per burst.

    ``mark`` returns a provisional ``ns_mono`` stamp for a boundary (final, for the sync
    clock). ``settle`` takes every stamp marked since ``begin`` (in order) and returns them
    final; the event clock resolves its CUDA events there, once per burst.
    """

    #: True when stamps are final as soon as they are marked.
    immediate: bool

    def begin(self) -> int: ...
    def mark(self) -> int: ...
    def settle(self, stamps: list[int]) -> list[int]: ...


class SyncClock:
    """The seed's clock: every boundary drains the streams; stamps are final at once.

    With no streams at all, ``mark`` *is* ``perf_counter_ns`` — a loop with no device pays
    one clock read per boundary and nothing else.
    """

    immediate = True

    def __init__(self, e: Stream | None = None, eh: Stream | None = None) -> None:
        self.e = e
        self.eh = eh
        if e is None and (eh is None or eh is e):
            self.mark: Callable[[], int] = now_ns
        elif eh is None or eh is e:
            sync = e.synchronize  # type: ignore[union-attr]

            def mark() -> int:
                try:
                    sync()
                except Exception:
                    pass
                return now_ns()

            self.mark = mark
        else:
            self.mark = lambda: clock(e, eh)

    def begin(self) -> int:
        return self.mark()

    def settle(self, stamps: list[int]) -> list[int]:
        return stamps
