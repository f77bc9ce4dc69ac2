"""The seed's trace flags (the constants below): pure resolution, each read once per process.

They follow the seed's law, not the project's knob law: junk means off, never an error, because
a typo in a diagnostic flag must not stop a worker. The project's own knobs (``MEMRA_OBS_*``)
live in :mod:`memra_obs.environment`, the ``OTEL_*`` variables in :mod:`memra_obs.otel.config`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import TextIO

__all__ = [
    "MEMRA_GLM5_SPEC_TRACE", "MEMRA_SPEC_FIRST_TOKEN_EAGER", "MEMRA_SPEC_PROF", "MEMRA_SPEC_TRACE",
    "first_token_eager", "override_line", "parse_level", "spec_prof_on", "spec_trace_level",
    "spec_trace_level_from", "spec_trace_on",
]  # fmt: skip

#: Per-burst phase lines; ``2`` adds the level-2 verify sub-split. Anything else is off.
MEMRA_SPEC_TRACE = "MEMRA_SPEC_TRACE"
#: The glm5 loop's legacy name for MEMRA_SPEC_TRACE; honored alone, loses loudly on conflict.
MEMRA_GLM5_SPEC_TRACE = "MEMRA_GLM5_SPEC_TRACE"
#: Exactly ``1``: the once-per-request first-token profile and the per-round log.
MEMRA_SPEC_PROF = "MEMRA_SPEC_PROF"
#: Default on; ``0`` turns the round-cadence commit hook inside the first burst off.
MEMRA_SPEC_FIRST_TOKEN_EAGER = "MEMRA_SPEC_FIRST_TOKEN_EAGER"


def parse_level(v: str | None) -> int | None:
    """``"1"`` -> 1, ``"2"`` -> 2, anything else (unset, ``"0"``, junk) -> None."""
    return 1 if v == "1" else 2 if v == "2" else None


def override_line(gv: int, av: int) -> str:
    """The one stderr line printed when both names are set to different valid levels."""
    return (
        f"[spec-trace] MEMRA_SPEC_TRACE={gv} overrides MEMRA_GLM5_SPEC_TRACE={av} "
        "(the general flag wins; unset one to silence this)"
    )


def spec_trace_level_from(
    general: str | None, glm5_alias: str | None, err: TextIO | None = None
) -> int:
    """Pure resolution over the general name and the glm5 alias: either alone is honored; set to
    different levels, the general wins, said on ``err`` (stderr). Junk never masks a valid alias."""
    g, a = parse_level(general), parse_level(glm5_alias)
    if g is not None and a is not None and g != a:
        out = sys.stderr if err is None else err
        with contextlib.suppress(Exception):  # closed (None at `2>&-`): the flag still holds
            out.write(override_line(g, a) + "\n")
            out.flush()
    return g or a or 0


# Read once, like the seed's OnceLock statics; `_reset` (tests, the demo) forgets them.
_level: list[int] = []
_level_lock = threading.Lock()  # functools.cache would let two threads print the override


def spec_trace_level() -> int:
    """Trace level (0, 1, 2), read once per process (its override line said once)."""
    if not _level:
        with _level_lock:
            if not _level:
                env = os.environ
                _level.append(
                    spec_trace_level_from(env.get(MEMRA_SPEC_TRACE), env.get(MEMRA_GLM5_SPEC_TRACE))
                )
    return _level[0]


def spec_trace_on() -> bool:
    """``MEMRA_SPEC_TRACE=1`` (or the glm5 alias): per-burst phase attribution is on."""
    return spec_trace_level() >= 1


@functools.cache
def spec_prof_on() -> bool:
    """``MEMRA_SPEC_PROF``, exactly ``1``: the first-token profile and per-round log, read once."""
    return os.environ.get(MEMRA_SPEC_PROF) == "1"


@functools.cache
def first_token_eager() -> bool:
    """``MEMRA_SPEC_FIRST_TOKEN_EAGER``: on unless exactly ``0``, read once."""
    return os.environ.get(MEMRA_SPEC_FIRST_TOKEN_EAGER) != "0"


def _reset() -> None:
    _level.clear()
    for f in (spec_prof_on, first_token_eager):
        f.cache_clear()
