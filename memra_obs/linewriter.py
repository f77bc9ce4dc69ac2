"""Whole lines, never interleaved: to a text stream under one lock per stream, in writes of
at most PIPE_BUF bytes so processes sharing a pipe never tear a line (:class:`LineWriter`, every
legacy line's way out), and appended to a file that processes share (:class:`AppendFile`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TextIO

__all__ = ["AppendFile", "LineWriter", "forked_set", "stderr_writer"]

#: A pipe write up to this many bytes is atomic; a longer one may take another process's
#: bytes mid-line (ranks sharing one stderr pipe, a slow reader).
PIPE_BUF: int = getattr(select, "PIPE_BUF", 4096)


class AppendFile:
    """Appends to a file other processes may share (workers started in one directory, forked
    children): one ``write`` on an ``O_APPEND`` descriptor under ``flock``, no user-space
    buffer (no lock a fork could leave held). ``max_bytes``: an append that would pass it first
    moves the file to ``<path>.1`` (the next append, in any process, follows): two files, each
    within the limit but for one longer append."""

    def __init__(self, path: str, max_bytes: int = 0) -> None:
        self.path, self.max_bytes, self._fd = path, max_bytes, -1
        _FILES.add(self)

    def open(self) -> None:
        """Opens (creates) the file, taking no lock: the start-up check that the path takes
        appends never waits on another process's append. Raises OSError."""
        if self._fd < 0:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
            self._fd = os.open(self.path, flags, 0o644)  # a FIFO with no reader: ENXIO
            os.set_blocking(self._fd, True)

    def append(self, data: bytes) -> None:
        """Raises OSError (a missing directory, no permission, a full disk)."""
        for _ in range(8):  # another process moved it between our open and our lock: again
            self.open()
            fd = self._fd
            with contextlib.suppress(OSError):  # a filesystem without locks: appends still go
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                mine = os.fstat(fd)
                try:
                    here = os.path.samestat(os.stat(self.path), mine)
                except FileNotFoundError:
                    here = False  # moved or removed: a new file at the path
                full = mine.st_size > 0 and mine.st_size + len(data) > self.max_bytes > 0
                if here and full:
                    os.replace(self.path, self.path + ".1")
                elif here:
                    view = memoryview(data)
                    try:
                        while view:
                            view = view[os.write(fd, view) :]
                    except OSError:  # a full disk mid-line: no torn line for the next to join
                        if len(view) < len(data):
                            with contextlib.suppress(OSError):
                                os.ftruncate(fd, mine.st_size)
                        raise
                    return
            finally:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_UN)
            self.close()
        raise OSError(errno.EAGAIN, f"{self.path} kept moving under the append")

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def forked_set(hook: Callable[[Any], object]) -> weakref.WeakSet[Any]:
    """A set of live objects; in a forked child, ``hook(obj)`` runs on each (another thread of
    the parent may have held their locks at ``fork()``; threads and ports are the parent's)."""
    live: weakref.WeakSet[Any] = weakref.WeakSet()
    os.register_at_fork(after_in_child=lambda: [hook(x) for x in list(live)])
    return live


# flock belongs to the open file, which the parent shares: the child closes its copy
_FILES = forked_set(AppendFile.close)


def _chunks(lines: Sequence[str]) -> list[str]:
    """Whole lines in groups of at most PIPE_BUF UTF-8 bytes (a longer line alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for line in lines:
        n = len(line.encode("utf-8", "backslashreplace")) + 1
        if groups[-1] and size + n > PIPE_BUF:
            groups.append([])
            size = 0
        groups[-1].append(line)
        size += n
    return ["\n".join(group) + "\n" for group in groups]


class LineWriter:
    """Writes lists of lines to one stream under one lock, one ``write`` (and flush) per
    PIPE_BUF bytes of whole lines. Never raises: lines that a broken pipe or a closed stderr
    refused are counted in ``errors``."""

    __slots__ = ("__weakref__", "_lock", "_stream", "errors")

    def __init__(self, stream: TextIO | None = None) -> None:
        # None = whatever sys.stderr is at write time (pytest's capsys swaps it).
        self._stream, self._lock, self.errors = stream, threading.Lock(), 0
        _WRITERS.add(self)

    def write_lines(self, lines: Sequence[str]) -> None:
        if not lines:
            return
        text = "\n".join(lines) + "\n"
        chunks = [text] if len(text) <= PIPE_BUF and text.isascii() else _chunks(lines)
        stream = self._stream if self._stream is not None else sys.stderr
        with self._lock:
            try:
                for chunk in chunks:
                    stream.write(chunk)
                    stream.flush()
            except Exception:
                self.errors += len(lines)  # export_errors_total{signal="lines"}

    def _after_fork(self) -> None:  # a child counts its own losses, as its queue
        self._lock, self.errors = threading.Lock(), 0


_WRITERS = forked_set(LineWriter._after_fork)
_STDERR = LineWriter(None)


def stderr_writer() -> LineWriter:
    """The process-wide writer for sys.stderr (one lock for everyone who prints there)."""
    return _STDERR
