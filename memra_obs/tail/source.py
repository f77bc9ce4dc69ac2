"""Where the bytes come from: a pipe (or a file read once, gzip'd or not), or a log file
followed through its rotations (the README's "Rotation"). All hand out raw chunks, never lines:
``read(timeout_s)`` returns a chunk, ``b""`` when nothing came in time, or ``None`` at the end
of the input (a followed file never ends; the caller closes it).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import os
import select
import stat
import time
import zlib
from collections.abc import Callable

__all__ = ["CHUNK", "GZIP_MAGIC", "FollowSource", "GzipSource", "PipeSource"]

#: A gzip stream's first bytes: how the tail and the report tell a compressed log.
GZIP_MAGIC = b"\x1f\x8b"

#: Bytes per read: one syscall per ~500 tagged lines at full speed.
CHUNK = 1 << 16


class PipeSource:
    """Standard input, a FIFO, or a file read once to its end (``own``: close the fd at the
    end, else the caller owns it)."""

    def __init__(self, fd: int, name: str, own: bool = False) -> None:
        self.fd, self.name, self.own = fd, name, own
        with contextlib.suppress(OSError):
            os.set_blocking(fd, True)

    def read(self, timeout_s: float) -> bytes | None:
        try:
            ready = select.select([self.fd], [], [], max(timeout_s, 0.0))[0]
        except (OSError, ValueError):
            ready = [self.fd]  # not selectable (some special files): the read blocks
        if not ready:
            return b""
        try:
            return os.read(self.fd, CHUNK) or None  # (EINTR is retried: PEP 475)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        if self.own:
            self.own = False
            os.close(self.fd)


class GzipSource(PipeSource):
    """A gzip'd log read once (a rotated, compressed one, as ``memra-obs report`` reads it):
    its decompressed bytes; damaged data is a read error."""

    def __init__(self, fd: int, name: str, own: bool = True) -> None:
        super().__init__(fd, name, own)
        self._gz = gzip.GzipFile(fileobj=os.fdopen(fd, "rb", closefd=False))

    def read(self, timeout_s: float) -> bytes | None:
        try:
            return self._gz.read1(CHUNK) or None
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise OSError(errno.EIO, f"damaged gzip data ({exc})") from exc


class FollowSource:
    """A growing log file followed by name, as ``tail -F``: at its end, **rename + create** (the
    path names another inode: read it from its start) or **copytruncate** (shorter than our
    offset: read again from the start); ``on_rotate(style)`` comes before the new content.
    ``from_start``: read what it holds (default: its end, as log shippers do)."""

    def __init__(self, path: str, *, from_start: bool = False, poll_s: float = 0.1,
                 on_wait: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.path = self.name = path
        self.poll_s = poll_s
        self.on_rotate: Callable[[str], None] = lambda style: None  # set by the caller
        self._fd, self._ident, self._pos, self._waiting = -1, (0, 0), 0, False
        self._next = 0.0  # at the file's end: the next check (os.read, stat) is due then
        self.on_wait: Callable[[str], None] = on_wait or (lambda msg: None)
        if not self._open(first=True, at_end=not from_start):
            self.on_wait(f"{path} does not exist yet; waiting for it")

    def _open(self, first: bool = False, at_end: bool = False) -> bool:
        try:  # O_NONBLOCK: a FIFO put at the path must not block the open (and the signals)
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if first:
                raise  # unreadable at start: the caller says so and stops
            if not self._waiting:  # the rotated-in file is not readable (yet): said once
                self._waiting = True
                self.on_wait(f"{self.path}: {exc.strerror}; waiting until it can be read")
            return False
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) and not first:  # a directory or FIFO rotated in
            os.close(fd)
            if not self._waiting:  # once, until a file is open again
                self._waiting = True
                self.on_wait(f"{self.path} is not a regular file now; waiting for one")
            return False
        self._fd, self._ident, self._waiting = fd, (st.st_dev, st.st_ino), False
        self._pos = os.lseek(fd, 0, os.SEEK_END) if at_end else 0
        return True

    def read(self, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            now = time.monotonic()
            if now >= self._next:  # at its end, the file is checked once a poll_s at most
                if self._fd >= 0 or self._open():
                    data = os.read(self._fd, CHUNK)
                    if data:
                        self._pos += len(data)
                        return data
                    if self._rotated():
                        continue  # read the new content (or the rest of the old) right away
                self._next = now + self.poll_s
            if now >= deadline:
                return b""
            time.sleep(min(self._next, deadline) - now)

    def _rotated(self) -> bool:
        """At the end of the file: did it rotate? Switch over when it did."""
        fd = self._fd
        if os.fstat(fd).st_size < self._pos:  # copytruncate: our own file got shorter
            os.lseek(fd, 0, os.SEEK_SET)
            self._pos = 0
            self.on_rotate("truncate")
            return True
        try:
            st = os.stat(self.path)
        except OSError:  # renamed away, not created again yet (or a symlink loop put there):
            return False  # the old file may still grow
        if (st.st_dev, st.st_ino) == self._ident:
            return False
        os.close(fd)  # rename+create: the old file is drained (we are at its end)
        self._fd = -1  # the new file: opened by read()'s next turn
        self.on_rotate("rename")
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
