"""The sink contract, stated once.

A sink receives the observer's records (:mod:`memra_obs.timeline`) **on the loop's thread**.
Every method must return quickly, must not block and must not raise: a sink that needs to
do real work (build spans, encode, send, aggregate) hands the record to something that runs
elsewhere — a bounded queue drained by a background thread (:class:`memra_obs.export.QueueSink`)
or a shared-memory ring read by the agent. The observer still guards every call: an exception
is reported once on stderr and never reaches the loop or the other sinks.

Subclasses override only the methods they care about; the observer decides at configure
time which sinks to call for which record, so a method left as the base no-op costs nothing.
"""

from __future__ import annotations

from ..timeline import (
    BurstRecord,
    FirstTokenRecord,
    ProfRowsRecord,
    ProfSummaryRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

__all__ = ["Sink"]


class Sink:
    """Base class: every hook is a no-op. Called on the loop's thread; never block, never raise."""

    #: Needs trace ids on session records (spans, exemplars): the observer then reads the
    #: caller's current span once per session.
    wants_trace_ids = False

    def on_session(self, rec: SessionRecord) -> None:
        pass

    def on_round(self, rec: RoundRecord) -> None:
        pass

    def on_burst(self, rec: BurstRecord) -> None:
        pass

    def on_first_token(self, rec: FirstTokenRecord) -> None:
        pass

    def on_prof_rows(self, rec: ProfRowsRecord) -> None:
        pass

    def on_prof_summary(self, rec: ProfSummaryRecord) -> None:
        pass

    def on_session_end(self, rec: SessionEndRecord) -> None:
        pass

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Push out what is buffered; True when everything got out in time."""
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush and release resources; later records are ignored."""
