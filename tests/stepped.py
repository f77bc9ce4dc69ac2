"""A stepped host clock and streams on it: a bucket or a lap holds exactly the time the code
put in it, and a stalled CI host moves no stamp (a wall clock under load stretched them)."""

from __future__ import annotations


class SteppingClock:
    """A ``now_ns`` stand-in, stepped: a read is 1 µs of host time, ``advance(s)`` the time
    a sleep (or a snapshot) takes."""

    def __init__(self) -> None:
        self.t = 10**12

    def __call__(self) -> int:
        self.t += 1_000
        return self.t

    def advance(self, s: float) -> None:
        self.t += int(s * 1e9)


class SteppedStream:
    """demo.SimStream on a :class:`SteppingClock`: queued work runs back to back from when it is
    queued; ``synchronize`` (counted in ``syncs``) moves the clock to the end of it."""

    def __init__(self, clock: SteppingClock) -> None:
        self.clock, self.busy_until, self.syncs = clock, 0, 0

    def enqueue(self, s: float) -> None:
        self.busy_until = max(self.busy_until, self.clock.t) + int(s * 1e9)

    def synchronize(self) -> None:
        self.syncs += 1
        self.clock.t = max(self.clock.t, self.busy_until)
