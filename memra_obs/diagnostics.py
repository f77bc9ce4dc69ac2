"""The instrument's own voice: misuse, failures and fallbacks, each said once, in one place.

Messages go to ``logging.getLogger("memra_obs")`` (WARNING) under a key that passes once per
process, so a call misused a million times is read about once. Routing is the application's;
with no handler anywhere the message still reaches stderr as one ``[memra-obs] ...`` line,
through the package's line writer so it never lands inside a legacy line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading

from .linewriter import forked_set, stderr_writer

__all__ = [
    "LOGGER_NAME",
    "MAX_SAID",
    "PREFIX",
    "forked_set",
    "logger",
    "printable",
    "reset",
    "say_once",
]

LOGGER_NAME = "memra_obs"
PREFIX = "[memra-obs] "  #: in front of a message the fallback writes to stderr

logger = logging.getLogger(LOGGER_NAME)


class _Fallback(logging.Handler):
    """Writes ``[memra-obs] message`` to stderr when no other handler would receive it."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _routed(record.levelno):
            with contextlib.suppress(Exception):  # diagnostics never raise into whoever called
                stderr_writer().write_lines([PREFIX + record.getMessage()], count=False)


def _routed(level: int) -> bool:
    """Some handler other than the fallback sits on the record's way up."""
    lg: logging.Logger | None = logger
    while lg is not None:
        if any(h is not _FALLBACK and level >= h.level for h in lg.handlers):
            return True
        lg = lg.parent if lg.propagate else None
    return False


_FALLBACK = _Fallback()
logger.addHandler(_FALLBACK)
_said: set[str] = set()
_kinds: dict[str, int] = {}  #: new keys seen per kind
PER_KIND = 8
#: Distinct keys said at most (one more says the bound was reached): a loop that misuses a
#: call with a new value each time must not grow memory, or stderr, without end.
MAX_SAID = 1024
_FULL = "said-full"
_said_lock = threading.Lock()


def _unlock_in_child() -> None:  # a thread saying something at fork() held it
    global _said_lock
    _said_lock = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_child)


#: What a terminal acts on (ESC, BEL, NUL, a newline) or no UTF-8 carries (an undecodable
#: byte of a file name): a collector's message, a file name and a log's tag reach stderr and
#: figures as text, never as a forged line, a cleared screen or a broken SVG.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with each such character spelled as its escape (``\\x1b``, ``\\n``)."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)


def say_once(key: str, msg: str, kind: str = "") -> None:
    """Say ``msg`` the first time ``key`` comes up in this process; never raises. A key is
    spent only when the logger takes warnings (a disabled logger says it once re-enabled).
    ``kind``: keys made of values (a family per request, a receiver's message with ids) say
    the first PER_KIND of that kind, then that more are not said; the rest keep MAX_SAID."""
    try:
        if logger.isEnabledFor(logging.WARNING):
            with _said_lock:
                if key in _said:
                    return
                if kind:
                    n = _kinds[kind] = _kinds.get(kind, 0) + 1
                    if n > PER_KIND + 1:
                        return
                    if n > PER_KIND:
                        msg += f" ({PER_KIND + 1} of this kind said: more are not)"
                if len(_said) >= MAX_SAID:  # keys made of callers' values: a bound, said
                    if _FULL in _said:
                        return
                    key, msg = _FULL, (f"{MAX_SAID} different things said; new ones are not from "
                                       "now on (a call misused with a new name each time, as "
                                       "lap(f'step_{i}'), or observers replaced over and over)")  # fmt: skip
                _said.add(key)
            logger.warning(printable(msg), extra={"memra_key": key})
    except Exception:
        pass


def reset() -> None:
    """Forget every key said so far (tests)."""
    with _said_lock:
        _said.clear()
        _kinds.clear()
