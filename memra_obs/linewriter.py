"""Whole lines, never interleaved: to a text stream under one lock per stream, in writes of
at most PIPE_BUF bytes so processes sharing a pipe never tear a line (:class:`LineWriter`, every
legacy line's way out), and appended to a file that processes share (:class:`AppendFile`).
:func:`forked_set` (objects to reset in a forked child) lives here, the package's lowest module,
because these are its first users (a lock held across ``fork()``); the rest share it."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import select
import stat
import sys
import threading
import time
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
        # Absolute: a relative path followed the process's later chdir() to a new file.
        self.path, self.max_bytes = os.path.abspath(path), max_bytes
        #: The open descriptor, if any: list.pop() hands it to exactly one closer. ``close()``
        #: from another thread while an append waits for the lock leaves it to that append,
        #: which writes nothing more (its fd number could be another file's by then).
        self._fds: list[int] = []
        self.closed = self._busy = False
        _FILES.add(self)

    def open(self) -> None:
        """Opens (creates) the file, taking no lock: the start-up check that the path takes
        appends never waits on another process's append. Raises OSError."""
        if not self._fds:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as exc:  # ENXIO: "No such device or address" (a socket, no tty too)
                if exc.errno == errno.ENXIO and stat.S_ISFIFO(os.stat(self.path).st_mode):
                    raise OSError(exc.errno, "a FIFO nobody reads (start a reader)") from None
                raise
            self._fds.append(fd)
            os.set_blocking(fd, True)

    def append(self, data: bytes) -> None:
        """Raises OSError (a missing directory, no permission, a full disk, closed)."""
        self._busy = True  # (before the check: close() sees it, or it sees close()'s mark)
        deadline = time.monotonic() + 2.0
        try:
            for tries in itertools.count(1):  # moved by another process between our open and
                if self.closed:  # lock (it made progress): again, for 2 s and 8 tries at least
                    raise OSError(errno.EBADF, f"{self.path}: closed by shutdown; not written")
                self.open()
                if self._put(self._fds[0], data):
                    return
                self._drop()
                if tries >= 8 and time.monotonic() > deadline:
                    raise OSError(errno.EAGAIN, f"{self.path} kept moving under the append")
        finally:
            self._busy = False
            if self.closed:
                self._drop()

    def _put(self, fd: int, data: bytes) -> bool:
        """One append under the lock; False when the path names another file by then."""
        with contextlib.suppress(OSError):  # a filesystem without locks: appends still go
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if self.closed:  # shut down while this waited for the lock
                raise OSError(errno.EBADF, f"{self.path}: closed by shutdown; not written")
            mine = os.fstat(fd)
            try:
                here = os.path.samestat(os.stat(self.path), mine)
            except FileNotFoundError:
                here = False  # moved or removed: a new file at the path
            if not here:
                return False
            if (
                mine.st_size > 0
                and mine.st_size + len(data) > self.max_bytes > 0
                and self.rotates()
            ):
                os.replace(self.path, self.path + ".1")
                return False
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:  # a full disk mid-line: no torn line for the next to join
                if len(view) < len(data):
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, mine.st_size)
                raise
            return True
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)

    def rotates(self) -> bool:
        """Rotation renames the path: only a regular file's, never a link's (``/dev/stdout``,
        a link into a data volume: the link was replaced by a file and the target abandoned)."""
        with contextlib.suppress(OSError):
            return self.max_bytes > 0 and stat.S_ISREG(os.lstat(self.path).st_mode)
        return False

    def close(self) -> None:
        self.closed = True
        if not self._busy:
            self._drop()

    def _drop(self) -> None:
        with contextlib.suppress(IndexError, OSError):
            os.close(self._fds.pop())

    def _in_child(self) -> None:
        self._busy = False  # (the parent's thread that was appending is not here)
        self._drop()


def forked_set(hook: Callable[[Any], object]) -> weakref.WeakSet[Any]:
    """A set of live objects; in a forked child, ``hook(obj)`` runs on each (another thread of
    the parent may have held their locks at ``fork()``; threads and ports are the parent's)."""
    live: weakref.WeakSet[Any] = weakref.WeakSet()
    os.register_at_fork(after_in_child=lambda: [hook(x) for x in list(live)])
    return live


# flock belongs to the open file, which the parent shares: the child closes its copy
_FILES = forked_set(AppendFile._in_child)


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

    def write_lines(self, lines: Sequence[str], count: bool = True) -> None:
        """``count``: a refusal is a lost legacy line (False for the library's own messages)."""
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
                self.errors += len(lines) if count else 0  # export_errors_total{signal="lines"}

    def _after_fork(self) -> None:  # a child counts its own losses, as its queue
        self._lock, self.errors = threading.Lock(), 0


_WRITERS = forked_set(LineWriter._after_fork)
_STDERR = LineWriter(None)


def stderr_writer() -> LineWriter:
    """The process-wide writer for sys.stderr (one lock for everyone who prints there)."""
    return _STDERR
