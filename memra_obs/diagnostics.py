"""The instrument's own voice: misuse, failures and fallbacks, each said once, in one place.

Messages go to ``logging.getLogger("memra_obs")`` (WARNING) under a key that passes once per
process, so a call misused a million times is read about once. Routing is the application's;
with no handler anywhere the message still reaches stderr as one ``[memra-obs] ...`` line,
through the package's line writer so it never lands inside a legacy line.
"""

from __future__ import annotations

import logging
import threading

from .linewriter import stderr_writer

__all__ = ["LOGGER_NAME", "PREFIX", "logger", "reset", "say_once"]

LOGGER_NAME = "memra_obs"
#: What a message carries in front when it goes to stderr by the fallback.
PREFIX = "[memra-obs] "

logger = logging.getLogger(LOGGER_NAME)


class _Once(logging.Filter):
    """Passes a keyed record the first time its key is seen (unkeyed records always)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "memra_key", None)
        if key is None:
            return True
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True


class _Fallback(logging.Handler):
    """Writes ``[memra-obs] message`` to stderr when no other handler would receive it."""

    def emit(self, record: logging.LogRecord) -> None:
        if _routed(record.levelno):
            return
        try:
            stderr_writer().write_lines([PREFIX + record.getMessage()])
        except Exception:
            pass  # diagnostics never raise into whoever called


def _routed(level: int) -> bool:
    """Some handler other than the fallback sits on the record's way up."""
    lg: logging.Logger | None = logger
    while lg is not None:
        if any(h is not _FALLBACK and level >= h.level for h in lg.handlers):
            return True
        if not lg.propagate:
            return False
        lg = lg.parent
    return False


_ONCE = _Once()
_FALLBACK = _Fallback()
logger.addFilter(_ONCE)
logger.addHandler(_FALLBACK)


def say_once(key: str, msg: str) -> None:
    """Say ``msg`` the first time ``key`` comes up in this process; never raises."""
    try:
        logger.warning(msg, extra={"memra_key": key})
    except Exception:
        pass


def reset() -> None:
    """Forget every key said so far (tests)."""
    with _ONCE._lock:
        _ONCE._seen.clear()
