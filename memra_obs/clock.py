"""Phase-boundary clocks: where the milliseconds of a round are read.

The seed's contract (``SpecPhaseNs::clock``): at each boundary drain the primary stream ``e``
and, when it is another object, the head stream ``eh``, then read a monotonic clock, so device
work lands in the phase that queued it. Streams are anything with ``.synchronize()``, or
``None``. :class:`SyncClock` drains at every boundary; the CUDA-event clock
(:mod:`memra_obs.device.event_clock`) records events and settles once per burst (and every
``burst.SETTLE_ROUNDS`` rounds of a longer one).
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
    """Block until ``e`` and ``eh`` are done; a failure is ignored (the loop's next call says)."""
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
    """The first-token profile's clock: ``lap`` drains and returns the ms since the last lap."""

    __slots__ = ("e", "eh", "t_ns_mono")

    def __init__(self, e: Stream | None = None, eh: Stream | None = None) -> None:
        self.e = e
        self.eh = eh
        self.t_ns_mono = clock(e, eh)

    @classmethod
    def start(cls, e: Stream | None = None, eh: Stream | None = None) -> ProfClock:
        return cls(e, eh)  # the seed's ProfClock::start(e, eh)

    def lap(self, e: Stream | None = None, eh: Stream | None = None) -> float:
        now = clock(self.e if e is None else e, self.eh if eh is None else eh)
        d = now - self.t_ns_mono
        self.t_ns_mono = now
        return d / 1e6  # one rounding (the seed's as_secs_f64() * 1e3 rounds twice)


class PhaseClock(Protocol):
    """What the observer needs of a clock: ``mark`` a provisional ``ns_mono`` stamp per boundary,
    ``settle`` the stamps marked since the last settle, returned final."""

    #: True when stamps are final as soon as they are marked.
    immediate: bool

    def mark(self) -> int: ...
    def settle(self, stamps: list[int]) -> list[int]: ...


class SyncClock:
    """The seed's clock: every boundary drains the streams; stamps are final at once. With no
    streams, ``mark`` *is* ``perf_counter_ns``: one clock read per boundary."""

    immediate = True

    def __init__(self, e: Stream | None = None, eh: Stream | None = None) -> None:
        if e is None and eh is None:
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

    def settle(self, stamps: list[int]) -> list[int]:
        return stamps
