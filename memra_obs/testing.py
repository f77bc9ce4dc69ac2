"""Helpers for testing a loop that uses memra_obs: an in-memory sink and a capture block.

from memra_obs.testing import capture

with capture(level=2, prof=True) as cap:
    my_loop(cap.observer)
assert cap.rounds[0].k == 4
assert cap.lines[0].startswith("[glm5-phase] ")
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from . import timeline as tl
from .environment import check_flags
from .linewriter import LineWriter
from .observer import Observer
from .sinks.base import Sink
from .sinks.stderr import StderrSink

__all__ = ["Capture", "RecordingSink", "capture"]

_R = TypeVar("_R")


class RecordingSink(Sink):
    """Keeps every record it is given, in order (thread-safe: list.append)."""

    def __init__(self, wants_trace_ids: bool = False) -> None:
        self.records: list[tl.Record] = []
        self.wants_trace_ids = wants_trace_ids

    def _keep(self, rec: Any) -> None:
        self.records.append(rec)

    on_session = on_round = on_burst = on_first_token = on_prof_rows = _keep
    on_prof_summary = on_session_end = _keep

    def of(self, kind: type[_R]) -> list[_R]:
        return [r for r in self.records if isinstance(r, kind)]


class _Of(Generic[_R]):
    """A :class:`Capture` attribute: the records of one type, in order."""

    def __init__(self, kind: type[_R]) -> None:
        self.kind = kind

    def __get__(self, cap: Capture, owner: object = None) -> list[_R]:
        return cap.sink.of(self.kind)


class Capture:
    """What :func:`capture` yields: the observer, its records and its legacy lines."""

    sessions = _Of(tl.SessionRecord)
    rounds = _Of(tl.RoundRecord)
    bursts = _Of(tl.BurstRecord)
    first_tokens = _Of(tl.FirstTokenRecord)
    prof_rows = _Of(tl.ProfRowsRecord)
    summaries = _Of(tl.ProfSummaryRecord)
    ends = _Of(tl.SessionEndRecord)

    def __init__(self, observer: Observer, sink: RecordingSink, stream: io.StringIO) -> None:
        self.observer = observer
        self.sink = sink
        self._stream = stream

    @property
    def records(self) -> list[tl.Record]:
        return self.sink.records

    @property
    def lines(self) -> list[str]:
        """The legacy lines the loop would have printed on stderr."""
        return self._stream.getvalue().splitlines()


@contextmanager
def capture(level: int = 1, prof: bool = False, **observer_kw: Any) -> Iterator[Capture]:
    """An observer whose records and legacy lines are kept in memory for assertions; ``level``
    and ``prof`` are checked as :func:`memra_obs.configure` checks them (a test passing with
    ``level=3`` or ``prof="no"`` passed with settings production refuses)."""
    check_flags("capture", level, prof)
    stream = io.StringIO()
    sink = RecordingSink(wants_trace_ids=observer_kw.pop("wants_trace_ids", False))
    sinks = [StderrSink(level, prof, LineWriter(stream)), sink, *observer_kw.pop("sinks", ())]
    obs = Observer(sinks, level=level, prof=prof, **observer_kw)
    try:
        yield Capture(obs, sink, stream)
    finally:
        obs.shutdown()
