"""The suite's one way to wait for what another thread or process does: poll with a deadline.

The deadline is generous for a loaded CI host, never a bound a test's promise rests on (a
promise about time is asserted on what was measured, not on how long the wait took)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: What a peer that is not up yet raises: refused or reset connections (URLError is an
#: OSError), a half-written answer, a key not there yet, a check inside ``cond`` not met yet.
NOT_YET: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, AssertionError)


def wait_for(
    what: str,
    cond: Callable[[], Any],
    timeout_s: float = 30.0,
    every_s: float = 0.05,
    tolerate: tuple[type[BaseException], ...] = NOT_YET,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Poll ``cond()`` until it returns something truthy and return that; an exception in
    ``tolerate`` is a "not yet". Past ``timeout_s``, fail naming ``what``, the last exception
    and ``detail()`` (a log's tail, say)."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while True:
        try:
            got = cond()
            if got:
                return got
        except tolerate as exc:
            last = exc
        if time.monotonic() >= deadline:
            why = f"timed out after {timeout_s}s waiting for {what}"
            why += f" (last: {last!r})" if last is not None else ""
            raise AssertionError(why + (f"\n{detail()}" if detail is not None else ""))
        time.sleep(every_s)
