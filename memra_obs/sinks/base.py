"""The sink contract: records (:mod:`memra_obs.timeline`) arrive **on the loop's thread**, so
real work is handed elsewhere (:class:`memra_obs.export.QueueSink`, the agent's ring). The
observer guards every call and calls only the hooks a sink overrides.
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
