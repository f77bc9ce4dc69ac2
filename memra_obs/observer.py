"""The one object a spec loop talks to: clock laps in, plain records out to the sinks.

With everything off, :func:`memra_obs.get_observer` returns :data:`NOOP_OBSERVER`, whose
sessions and bursts are no-op methods: the loop pays a call per boundary and never writes
``if enabled:``. Sinks run on the loop's thread and must not block; nothing here raises into the
loop (misuse and sink failures are said once, :mod:`memra_obs.diagnostics`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from . import flags
from .burst import _NOOP_BURST, Burst, NoOpBurst
from .clock import PhaseClock, Stream, SyncClock
from .device.event_clock import pair
from .diagnostics import forked_set, say_once
from .fanout import Fanout
from .legacy.parse import MAX_TAG, RESERVED, taggable
from .records import SEQ_ROWS, VERIFY_SPLIT, SeqRows, VerifySplit
from .session import Session
from .sinks.base import Sink

__all__ = [
    "NOOP_OBSERVER", "Burst", "NoOpBurst", "NoOpObserver", "NoOpSession", "Observer", "Session",
]  # fmt: skip

_ClockFactory = Callable[[Stream | None, Stream | None], PhaseClock]


# Everything off (like the OTel API's NoOpTracer): one call per boundary to a no-op.
class NoOpSession:
    __slots__ = ()
    prof = log = None
    id = 0

    def add(self, **shares_ms: float) -> None: ...

    def set(self, **fields: object) -> None: ...

    def end(self, error: BaseException | str | None = None) -> None: ...

    def __exit__(self, et: object, ev: BaseException | None, tb: object) -> None: ...

    def lap(self, bucket: str) -> float:
        return 0.0

    def free_memory(self, point: str) -> list[tuple[int, int]]:
        return []

    def burst(self, k: int) -> NoOpBurst:
        return _NOOP_BURST

    def spec_decode(self, detailed: bool = False) -> dict[str, Any]:
        return {}

    def __enter__(self) -> NoOpSession:
        return self


_NOOP_SESSION = NoOpSession()


class NoOpObserver:
    """Everything off: every call is a method that does nothing."""

    enabled = False
    sinks: tuple[Sink, ...] = ()
    level = dropped_rounds = 0
    prof = False
    where: tuple[str, ...] = ()

    def shutdown(self, timeout_s: float = 5.0) -> None: ...

    def remove_sink(self, sink: Sink) -> None: ...

    #: Set by configure() while another observer is the process's: a session here goes nowhere.
    _replaced = False

    def session(self, family: str = "spec", **kw: object) -> NoOpSession:
        if self._replaced:
            _say_replaced("this no-op observer was replaced by configure()")
        return _NOOP_SESSION

    def add_sink(self, sink: Sink) -> None:
        raise RuntimeError("the no-op observer takes no sinks; build one (memra_obs.configure)")

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def memory_snapshot(self) -> list[tuple[int, int]]:
        return []


NOOP_OBSERVER = NoOpObserver()


#: Session ids, one count per process: observers built one after another (configure() again)
#: wrote "session": 1 again into one requests file, under one worker label.
_IDS = itertools.count(1)


class Observer:
    """Per process: owns the sinks and hands out sessions. ``clock``: ``"sync"``, ``"event"``
    or a factory ``(e, eh) -> PhaseClock``; ``memory`` returns ``[(cuda_ordinal, free_mb)]``
    (default: NVML); ``settings``, ``queue``, ``closers``, ``where`` and ``sampled`` come from
    :func:`memra_obs.wiring.build_observer`."""

    enabled = True

    def __init__(
        self,
        sinks: Sequence[Sink] = (),
        *,
        level: int | None = None,
        prof: bool | None = None,
        clock: str | _ClockFactory = "sync",
        memory: Callable[[], list[tuple[int, int]]] | None = None,
        worker: str = "",
        verify_split: VerifySplit | None = None,
        seq_rows: SeqRows | None = None,
        settings: Any = None,
        queue: Any = None,
        closers: Sequence[Callable[[], None]] = (),
        where: Sequence[str] = (),
        sampled: Callable[[int], bool] | None = None,
    ) -> None:
        self.level = flags.spec_trace_level() if level is None else int(level)
        self.prof = flags.spec_prof_on() if prof is None else bool(prof)
        self.worker = worker
        self._pid_worker = worker == str(os.getpid())  # a forked child's is its own pid
        self.verify_split = VERIFY_SPLIT if verify_split is None else verify_split
        self.seq_rows = SEQ_ROWS if seq_rows is None else seq_rows
        self._clock_factory = _clock_factory(clock)
        if memory is None:
            from .device.memory import free_mb_snapshot, warm

            memory = free_mb_snapshot
            if self.prof:  # NVML's start-up ahead of the first profile
                warm()
        self._memory = memory
        # session() reads the caller's span with opentelemetry.trace: imported here, not in a
        # loop's first session, where a fork() from another thread could leave its lock held.
        with contextlib.suppress(ImportError):
            import opentelemetry.trace  # noqa: F401
        self._lock = threading.Lock()
        self._fan = Fanout(sinks)
        self._ids = _IDS
        self._closed = False
        #: Rounds dropped for misuse (memra_obs_dropped_total{signal="rounds"}).
        self.dropped_rounds = 0
        _LIVE.add(self)
        self.settings, self.queue = settings, queue
        self._closers, self.where = tuple(closers), tuple(where)
        self.sampled = sampled  # OTEL_TRACES_SAMPLER's decision on a session's trace id

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return self._fan.all

    def add_sink(self, sink: Sink) -> None:
        """Add a sink. Sessions already running reach it from their next record, as sessions
        it never saw start (no tag: the stderr lines say ``spec-phase``; no spans)."""
        with self._lock:
            self._fan = Fanout((*self._fan.all, sink))

    def remove_sink(self, sink: Sink) -> None:
        with self._lock:
            self._fan = Fanout(tuple(s for s in self._fan.all if s is not sink))

    def flush(self, timeout_s: float = 5.0) -> bool:
        return _each_sink(self._fan.all, "flush", timeout_s)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        _each_sink(self._fan.all, "shutdown", timeout_s)
        for close in self._closers:
            try:
                close()
            except Exception as exc:
                say_once(f"close:{id(close)}", f"closing {close!r} raised {exc!r}")

    def session(
        self,
        family: str = "spec",
        *,
        tag: str | None = None,
        tag_v: str | None = None,
        e: Stream | None = None,
        eh: Stream | None = None,
        **unknown: object,
    ) -> Session | NoOpSession:
        """One request's session; ``tag``/``tag_v`` default to ``{family}-phase``/``-phase-v``.
        An unknown keyword is said once and ignored, as the no-op observer takes any; after
        :meth:`shutdown` the session is a no-op, said once."""
        if self._closed:
            _say_replaced("this observer was shut down (by configure(), shutdown() or the exit)")
            return _NOOP_SESSION
        for name in unknown:
            say_once(f"session-kw:{name}", f"Observer.session({name}=...): not a keyword of "
                     "session() (tag, tag_v, e, eh); ignored", "session-kw")  # fmt: skip
        if not (isinstance(family, str) and family):
            say_once(f"session-family:{family!r}", f"Observer.session(family={family!r}): expected a "
                     "non-empty str; recording under the default family 'spec'", "rename")  # fmt: skip
            family = "spec"
        family = _taggable("family", family) or "spec"
        tag, tag_v = _taggable("tag", tag), _taggable("tag_v", tag_v)
        if e is not None and eh is not None and e is not eh:  # two wrappers of one stream
            e, eh = pair(e, eh)  # (torch.cuda.current_stream() twice): drained once
        return Session(self, family, tag or f"{family}-phase", tag_v or f"{family}-phase-v", e, eh)

    def memory_snapshot(self) -> list[tuple[int, int]]:
        try:
            return list(self._memory())
        except Exception as exc:
            say_once("memory", f"free-memory snapshot raised {exc!r}; recording none")
            return []


def _each_sink(sinks: tuple[Sink, ...], method: str, timeout_s: float) -> bool:
    """``method(timeout_s)`` of every sink; one that raises is said once and makes it False."""
    ok = True
    for s in sinks:
        try:
            ok = getattr(s, method)(timeout_s) and ok
        except Exception as exc:
            say_once(f"sink:{id(s)}:{method}", f"sink {type(s).__name__}.{method} raised {exc!r}")
            ok = False
    return ok


def _taggable(name: str, t: object) -> str | None:
    """A family or tag its own lines can carry: ``[tag] `` parses back (legacy.parse), the
    family's longest tag (``-phase-v``) included."""
    if not isinstance(t, str):
        if t is not None:  # bytes: '[b'glm5']' lines that parse back to nothing
            say_once(f"session-{name}-type:{t!r}", f"Observer.session({name}={t!r}): expected a str; "
                     "using the default", "rename")  # fmt: skip
        return None
    room = MAX_TAG - len("-phase-v") if name == "family" else MAX_TAG
    fixed = taggable(t, room)
    if fixed != t:
        fam = f" (a family at most {room}: its tags add '-phase-v')" if room < MAX_TAG else ""
        say_once(f"session-{name}:{t}", f"Observer.session({name}={t!r}): a legacy tag holds no "
                 f"space, control character, bracket or undecodable byte, starts with none of "
                 f"{', '.join(RESERVED)}, and has at most {MAX_TAG} characters{fam}, or its "
                 f"lines would not parse back (nor /metrics encode "
                 f"them); recorded as {fixed!r}", "rename")  # fmt: skip
    return fixed


def _own_counts_in_child(obs: Observer) -> None:
    """A forked child counts its own dropped rounds, as its queue its own drops (and its ring,
    which starts from zero), under its own pid where the worker label was the pid by default."""
    obs.dropped_rounds = 0
    if obs._pid_worker:
        obs.worker = str(os.getpid())


_LIVE = forked_set(_own_counts_in_child)


def _say_replaced(what: str) -> None:
    say_once(f"session-on:{what}", f"Observer.session(): {what}, so its sessions record "
             "nothing; memra_obs.get_observer() returns the current one (take it after "
             "configure())")  # fmt: skip


def _clock_factory(clock: str | _ClockFactory) -> _ClockFactory:
    if callable(clock):
        return clock
    if clock == "sync":
        return SyncClock
    if clock == "event":
        from .device.event_clock import EventClock

        return EventClock
    raise ValueError(f"clock={clock!r}: expected 'sync', 'event' or a clock factory")
