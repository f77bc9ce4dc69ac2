"""The sink contract, stated once.

A sink receives the observer's records (:mod:`memra_obs.timeline`) **on the loop's thread**:
every method returns quickly, never blocks, never raises. Real work (spans, encoding,
sending) is handed elsewhere: a bounded queue drained by a background thread
(:class:`memra_obs.export.QueueSink`) or the agent's shared-memory ring. The observer still
guards every call (an exception is reported once) and calls only the methods a sink
overrides, so one left as the base no-op costs nothing.
"""

from __future__ import annotations

from .. import timeline as tl

__all__ = ["Sink"]


class Sink:
    """Base class: every hook is a no-op. Called on the loop's thread; never block, never raise."""

    #: Needs trace ids on session records (spans, exemplars): the observer then reads the
    #: caller's current span once per session.
    wants_trace_ids = False

    def on_session(self, rec: tl.SessionRecord) -> None: ...
    def on_round(self, rec: tl.RoundRecord) -> None: ...
    def on_burst(self, rec: tl.BurstRecord) -> None: ...
    def on_first_token(self, rec: tl.FirstTokenRecord) -> None: ...
    def on_prof_rows(self, rec: tl.ProfRowsRecord) -> None: ...
    def on_prof_summary(self, rec: tl.ProfSummaryRecord) -> None: ...
    def on_session_end(self, rec: tl.SessionEndRecord) -> None: ...

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Push out what is buffered; True when everything got out in time."""
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush and release resources; later records are ignored."""
