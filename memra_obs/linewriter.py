"""Whole lines to a text stream, one lock per stream, so threads never interleave a line.

Every legacy line goes out through here. Writing never raises into the caller: a broken pipe
or a closed stderr is counted in ``errors`` and the loop carries on.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import TextIO

__all__ = ["LineWriter", "stderr_writer"]


class LineWriter:
    """Writes lists of lines to one stream with a single ``write`` under one lock."""

    __slots__ = ("__weakref__", "_lock", "_stream", "errors")

    def __init__(self, stream: TextIO | None = None) -> None:
        # None = whatever sys.stderr is at write time (pytest's capsys swaps it).
        self._stream = stream
        self._lock = threading.Lock()
        self.errors = 0
        _WRITERS.add(self)

    def write_lines(self, lines: Sequence[str]) -> None:
        if not lines:
            return
        text = "\n".join(lines) + "\n"
        stream = self._stream if self._stream is not None else sys.stderr
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except Exception:
                self.errors += 1


_WRITERS: weakref.WeakSet[LineWriter] = weakref.WeakSet()


def _unlock_in_child() -> None:  # another thread of the parent may have held one at fork()
    for w in list(_WRITERS):
        w._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unlock_in_child)

_STDERR = LineWriter(None)


def stderr_writer() -> LineWriter:
    """The process-wide writer for sys.stderr (one lock for everyone who prints there)."""
    return _STDERR
