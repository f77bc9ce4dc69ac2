"""memra_obs: make the time of a speculative-decoding serving loop visible.

The seed's flags, records and legacy lines (``spec_phase.rs``, ported byte for byte), the
observer a loop talks to, and the sinks that publish what it saw: the legacy stderr lines,
OpenTelemetry spans, Prometheus histograms and NVTX ranges.

    import memra_obs
    obs = memra_obs.get_observer()   # no-op unless a flag, MEMRA_OBS_SINKS or MEMRA_OBS_REQUESTS_FILE is set
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from .environment import ConfigError, Settings, check_flags
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

if TYPE_CHECKING:
    from .observer import NoOpObserver, Observer
    from .sinks.base import Sink

__all__ = [
    "SEQ_ROWS", "SPEC_PROF_ROUNDS", "VERIFY_SPLIT", "ConfigError", "SeqRows", "SpecFirstTokenProf",
    "SpecPhaseNs", "SpecRoundProf", "SpecRoundsLog", "VerifySplit", "__version__", "configure",
    "first_token_eager", "get_observer", "parse_level", "spec_prof_on", "spec_trace_level",
    "spec_trace_level_from", "spec_trace_on",
]  # fmt: skip

_observer: Any = None
_lock = threading.Lock()
_KNOBS = frozenset(f.name for f in fields(Settings) if f.compare)  # not Settings.given


def _unlock_in_child() -> None:  # a configure() on another thread at fork() held it
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


def get_observer() -> Observer | NoOpObserver:
    """The process observer, built once from flags and knobs (no-op when nothing is on)."""
    global _observer
    obs = _observer
    if obs is None:
        with _lock:
            if _observer is None:
                from .wiring import build_observer

                _observer = build_observer()
            obs = _observer
    return obs


def configure(
    *,
    level: int | None = None,
    prof: bool | None = None,
    sinks: str | Iterable[str] | None = None,
    metrics_addr: str | None = None,
    spans_file: str | None = None,
    agent: str | None = None,
    clock: str | None = None,
    round_spans: int | None = None,
    queue_size: int | None = None,
    export_interval_ms: int | None = None,
    worker: str | None = None,
    ring_slots: int | None = None,
    metrics_tls_cert: str | None = None,
    metrics_tls_key: str | None = None,
    metrics_basic_auth: str | None = None,
    max_devices: int | None = None,
    max_families: int | None = None,
    requests_file: str | None = None,
    requests_detail: bool | None = None,
    advice_window: int | None = None,
    plain_step_ms: float | None = None,
    spans_file_max_bytes: int | None = None,
    extra_sinks: Sequence[Sink] = (),
    exporters: Sequence[Any] = (),
    registry: Any = None,
    memory: Callable[[], list[tuple[int, int]]] | None = None,
    env: Mapping[str, str] | None = None,
) -> Observer | NoOpObserver:
    """Build the process observer from arguments and make it the one :func:`get_observer`
    returns. Each argument is the knob of the same name (``None``: the environment's, else the
    default); ``level`` (0, 1, 2) and ``prof`` override the seed's flags; ``env`` replaces
    ``os.environ``. A value no loop can use raises :class:`ConfigError` naming the argument.
    The observer it replaces is shut down (its sessions record nothing, said once): take
    :func:`get_observer` after it."""
    global _observer
    from .observer import NOOP_OBSERVER
    from .wiring import build_observer

    check_flags("configure", level, prof)
    if sinks is not None and not isinstance(sinks, str):
        sinks = ",".join(sinks)
    knobs = {k: v for k, v in locals().items() if k in _KNOBS and v is not None}
    with _lock:
        # The old one goes (once: shutdown is idempotent) when what can be refused is built,
        # before /metrics is served (it holds the port); get_observer() hands it out till then
        old = _observer
        retire = old.shutdown if old is not None else NOOP_OBSERVER.shutdown  # (a no-op)
        _observer = build_observer(
            level=level, prof=prof, extra_sinks=extra_sinks, exporters=exporters,
            registry=registry, memory=memory, env=env, retire=retire, **knobs,
        )  # fmt: skip
        retire()
        if old is NOOP_OBSERVER or _observer is NOOP_OBSERVER:  # a loop may still hold it
            NOOP_OBSERVER._replaced = _observer is not NOOP_OBSERVER
        return _observer
