"""Run a function in a forked child and read back what it said (the fork tests)."""

from __future__ import annotations

import os
from collections.abc import Callable


def in_child(fn: Callable[[], bytes]) -> bytes:
    """``fn()`` in a forked child; its bytes come back through a pipe (b"" if it raised)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.close(r)
            os.write(w, fn())
        finally:
            os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 64):
        got += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return got
