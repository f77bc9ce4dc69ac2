"""memra_obs: make the time of a speculative-decoding serving loop visible.

The seed's flags, records and legacy lines (``spec_phase.rs``, ported byte for byte), the
observer a loop talks to, and the sinks that publish what it saw: the legacy stderr lines,
OpenTelemetry spans, Prometheus histograms and NVTX ranges.

    import memra_obs
    obs = memra_obs.get_observer()   # no-op unless a flag or MEMRA_OBS_SINKS turns it on
"""

from __future__ import annotations

import threading

from .flags import (
    first_token_eager,
    parse_level,
    spec_prof_on,
    spec_trace_level,
    spec_trace_level_from,
    spec_trace_on,
)
from .records import (
    SEQ_ROWS,
    SPEC_PROF_ROUNDS,
    VERIFY_SPLIT,
    SeqRows,
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundProf,
    SpecRoundsLog,
    VerifySplit,
)
from .version import __version__

__all__ = [
    "SEQ_ROWS",
    "SPEC_PROF_ROUNDS",
    "VERIFY_SPLIT",
    "SeqRows",
    "SpecFirstTokenProf",
    "SpecPhaseNs",
    "SpecRoundProf",
    "SpecRoundsLog",
    "VerifySplit",
    "__version__",
    "configure",
    "first_token_eager",
    "get_observer",
    "parse_level",
    "spec_prof_on",
    "spec_trace_level",
    "spec_trace_level_from",
    "spec_trace_on",
]


_observer = None
_lock = threading.Lock()


def get_observer():  # type: ignore[no-untyped-def]
    """The process observer, built once from the flags and ``MEMRA_OBS_*`` knobs.

    Returns the no-op observer when nothing is on, so a loop can always call it.
    """
    global _observer
    obs = _observer
    if obs is None:
        with _lock:
            if _observer is None:
                from .wiring import build_observer

                _observer = build_observer()
            obs = _observer
    return obs


def configure(**kwargs):  # type: ignore[no-untyped-def]
    """Build the process observer from arguments (argument > environment > default) and
    make it the one :func:`get_observer` returns. See :func:`memra_obs.wiring.build_observer`."""
    global _observer
    from .wiring import build_observer

    with _lock:
        # The old observer goes first: it holds resources the new one takes (the /metrics port).
        old, _observer = _observer, None
        if old is not None:
            old.shutdown()
        _observer = build_observer(**kwargs)
        return _observer
