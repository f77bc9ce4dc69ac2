"""The sinks of an observer, grouped per hook: a tuple that is replaced, never edited, so the
loop reads the current one without a lock. A hook a sink leaves as the base no-op is not in
that hook's tuple, so it costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .diagnostics import say_once
from .sinks.base import Sink

__all__ = ["HOOKS", "Fanout", "fan"]

HOOKS: tuple[str, ...] = ("on_session", "on_round", "on_burst", "on_first_token", "on_prof_rows")
HOOKS += ("on_prof_summary", "on_session_end")


class Fanout:
    """Per-hook tuples of the sinks that implement that hook."""

    __slots__ = ("all", "ranges", "wants_trace_ids", *HOOKS)

    on_session: tuple[Sink, ...]
    on_round: tuple[Sink, ...]
    on_burst: tuple[Sink, ...]
    on_first_token: tuple[Sink, ...]
    on_prof_rows: tuple[Sink, ...]
    on_prof_summary: tuple[Sink, ...]
    on_session_end: tuple[Sink, ...]

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.all = tuple(sinks)
        #: Boundary-time range hooks (``push(name)``/``pop()``, e.g. NVTX), if any.
        self.ranges = tuple(h for s in sinks if (h := getattr(s, "range_hook", None)) is not None)
        for hook in HOOKS:
            base = getattr(Sink, hook)
            mine = tuple(
                s for s in sinks if getattr(getattr(s, hook), "__func__", None) is not base
            )
            setattr(self, hook, mine)
        self.wants_trace_ids = any(getattr(s, "wants_trace_ids", False) for s in sinks)


def fan(sinks: tuple[Sink, ...], hook: str, rec: Any) -> None:
    """``rec`` to every sink of ``hook``; a sink that raises is reported once and skipped."""
    for s in sinks:
        try:
            getattr(s, hook)(rec)
        except Exception as exc:
            msg = f"sink {type(s).__name__}.{hook} raised {exc!r}; the loop carries on"
            say_once(f"sink:{id(s)}:{hook}", msg + " (reported once)")
