"""Where the bytes come from: a pipe (or a file read once), or a log file followed through
its rotations.

Both hand out raw chunks (``bytes``), never lines: the tail passes bytes through untouched and
splits lines itself. ``read(timeout_s)`` returns a chunk, ``b""`` when nothing came within the
timeout, or ``None`` at the end of the input (a pipe's writer closed it; a file read without
``--follow`` reached its end). A followed file never ends; it is closed by the caller.

Rotation, as ``tail -F`` and log shippers follow it, checked whenever the file is at its end:

* **rename + create** (logrotate ``create``, most loggers): the path names another inode.
  What is left in the old file is read first, then the new file from its start.
* **copytruncate**: the file we hold got shorter than our offset. Read again from its start.
  Lines written between logrotate's copy and its truncate are lost (the method's own gap),
  and a truncation followed by more new bytes than we had read before the next poll is
  indistinguishable from growth (as for every follower that polls sizes).
"""

from __future__ import annotations

import errno
import os
import select
import time
from collections.abc import Callable

__all__ = ["CHUNK", "FollowSource", "PipeSource"]

#: Bytes per read: one syscall per ~500 tagged lines at full speed.
CHUNK = 1 << 16


class PipeSource:
    """Standard input, a FIFO, or a file read once to its end."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        try:
            os.set_blocking(fd, True)
        except OSError:
            pass

    def read(self, timeout_s: float) -> bytes | None:
        try:
            ready, _, _ = select.select([self.fd], [], [], max(timeout_s, 0.0))
        except (OSError, ValueError):
            ready = [self.fd]  # not selectable (e.g. some special files): read blocks
        if not ready:
            return b""
        try:
            data = os.read(self.fd, CHUNK)
        except InterruptedError:
            return b""
        except OSError as exc:
            if exc.errno == errno.EAGAIN:
                return b""
            raise
        return data if data else None

    def close(self) -> None:
        pass  # the caller owns the descriptor


class FollowSource:
    """A growing log file, followed by name through rename+create and copytruncate rotation.

    ``from_start``: read what the file already holds (default: start at its end, as log
    shippers do, so a restarted tail does not publish old lines again). A file that does not
    exist yet is waited for. ``on_rotate(style)`` is called on each rotation (``"rename"`` /
    ``"truncate"``) before the first byte of the new content is returned.
    """

    def __init__(
        self,
        path: str,
        *,
        from_start: bool = False,
        poll_s: float = 0.1,
        on_rotate: Callable[[str], None] | None = None,
        on_wait: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.name = path
        self.poll_s = poll_s
        self.on_rotate = on_rotate
        self._on_wait = on_wait
        self._fd = -1
        self._ident: tuple[int, int] = (0, 0)
        self._pos = 0
        self._from_start = from_start
        self._open(first=True)

    def _open(self, first: bool = False) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            if first and self._on_wait is not None:
                self._on_wait(f"{self.path} does not exist yet; waiting for it")
            return False
        except OSError:
            if first:
                raise  # unreadable at start: the caller says so and stops
            return False  # the rotated-in file is not readable (yet): keep polling
        st = os.fstat(fd)
        self._fd = fd
        self._ident = (st.st_dev, st.st_ino)
        self._pos = 0
        if first and not self._from_start:
            self._pos = os.lseek(fd, 0, os.SEEK_END)
        return True

    def read(self, timeout_s: float) -> bytes | None:
        deadline = time.monotonic() + max(timeout_s, 0.0)
        while True:
            if self._fd < 0 and not self._open():
                if not self._sleep(deadline):
                    return b""
                continue
            data = os.read(self._fd, CHUNK)
            if data:
                self._pos += len(data)
                return data
            if self._rotated():
                continue  # read the new content (or the rest of the old) right away
            if not self._sleep(deadline):
                return b""

    def _sleep(self, deadline: float) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(self.poll_s, left))
        return True

    def _rotated(self) -> bool:
        """At the end of the file: did it rotate? Switch over when it did."""
        fd = self._fd
        if os.fstat(fd).st_size < self._pos:  # copytruncate: our own file got shorter
            os.lseek(fd, 0, os.SEEK_SET)
            self._pos = 0
            self._rotation("truncate")
            return True
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False  # renamed away, not created again yet: the old file may still grow
        if (st.st_dev, st.st_ino) == self._ident:
            return False
        # rename+create: the old file is drained (we are at its end); switch to the new one.
        os.close(fd)
        self._fd = -1
        self._rotation("rename")
        self._open()
        return True

    def _rotation(self, style: str) -> None:
        if self.on_rotate is not None:
            self.on_rotate(style)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
