"""Bursts whose boundaries also move named ranges (NVTX): ``spec.burst`` > ``spec.round`` >
one per phase, pushed and popped right after each boundary's clock mark. NVTX ranges are a
stack per thread, so this module keeps which burst's ranges are on each thread's stack."""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

from .burst import Burst
from .diagnostics import say_once

if TYPE_CHECKING:
    from .session import Session

__all__ = ["new_burst"]


def new_burst(s: Session, k: int, ranges: tuple[Any, ...]) -> Burst:
    """A plain :class:`Burst`, or one with ranges when a sink offers a hook and this thread's
    range stack is free. NVTX push/pop is a stack per thread: two bursts open at once on one
    thread (asyncio tasks interleaving sessions) would pop each other's ranges, so the later
    one goes without, said once."""
    if not ranges:
        return Burst(s, k)
    held = _RANGE_OWNER.get(threading.get_ident())
    if held is not None and held.thread is threading.current_thread():  # not a dead thread's
        own = held.burst()
        if own is None:  # dropped unended (a request that raised outside `with`): its
            _pop(held.ranges, held.depth, 0)  # ranges close here, and this burst gets its own
        elif own._ended:  # ended from another thread (a cancel): its ranges close here
            own._close_ranges()
        else:
            say_once("range-interleaved", "two bursts open at once on one thread (asyncio "
                     "tasks, or a burst never ended): NVTX ranges are a stack per thread, so "
                     "a burst begun while another is open gets none")  # fmt: skip
            return Burst(s, k)
    return _RangedBurst(s, k, ranges)


class _Held(NamedTuple):
    """A thread's ranges: whose (weakly: a burst dropped unended is not kept alive by them),
    how deep (a one-item list the burst updates), on which hooks."""

    burst: weakref.ref[_RangedBurst]
    depth: list[int]
    thread: threading.Thread
    ranges: tuple[Any, ...]


#: thread id -> the ranges on that thread's stack (a forked child's thread may reuse its
#: parent's id: its stacks start empty; so may a new thread, whose stack a burst its dead
#: predecessor left open does not hold)
_RANGE_OWNER: dict[int, _Held] = {}
os.register_at_fork(after_in_child=_RANGE_OWNER.clear)


class _RangedBurst(Burst):
    """A :class:`Burst` that also moves named ranges (NVTX) at each boundary:
    ``spec.burst`` > ``spec.round`` > one per phase. Its mark is wrapped, so a range closes
    right after the clock's mark (a sync clock's drain inside the phase it ends) and before any
    sink sees the round; the base class sets ``_at`` just before marking, which says which
    boundary it is. Only when a sink offers a ``range_hook``, so the plain hot path is
    untouched; its own depth keeps misused rounds balanced."""

    __slots__ = ("__weakref__", "_clock_mark", "_depth", "_ranges", "_thread", "_tid")
    _NEXT = ("spec.verify", "spec.accept", "spec.rollback", "spec.maint")

    def __init__(self, s: Session, k: int, ranges: tuple[Any, ...]) -> None:
        super().__init__(s, k)
        self._ranges = ranges
        self._depth = [0]
        self._clock_mark, self._mark = self._mark, self._ranged_mark
        self._tid, self._thread = threading.get_ident(), threading.current_thread()
        _RANGE_OWNER[self._tid] = _Held(weakref.ref(self), self._depth, self._thread, ranges)
        self._push("spec.burst")

    def _ranged_mark(self) -> int:
        t = self._clock_mark()
        at = self._at  # 0: a round begins; 1..4: that phase ended; -1: the round closed
        if at > 0:
            self._pop_to(2)
            self._push(self._NEXT[at - 1])
        else:
            self._pop_to(1)
            if at == 0:
                self._push("spec.round")
                self._push("spec.draft")
        return t

    def _push(self, name: str) -> None:
        self._depth[0] += 1
        for h in self._ranges:
            try:
                h.push(name)
            except Exception as exc:
                _range_failed(h, exc)

    def _pop_to(self, depth: int) -> None:
        _pop(self._ranges, self._depth, depth)

    def end_round(
        self, k: int | None = None, j: int | None = None, ctx: int = 0, seq_rows: int | None = None
    ) -> None:
        super().end_round(k, j, ctx, seq_rows)
        if self._depth[0] > 1:  # a misused round (no mark): its ranges close all the same
            self._pop_to(1)

    def end(self, tokens: int | None = None) -> None:
        # A stack per thread: ended from another (a cancel), its ranges wait for their own
        # thread's end() or next burst (they popped the canceller's stack).
        if self._thread is threading.current_thread():
            self._close_ranges()
        super().end(tokens)

    def _disown(self) -> None:
        if self._thread is threading.current_thread():
            self._close_ranges()
        super()._disown()

    def _close_ranges(self) -> None:
        self._pop_to(0)
        self._mark = self._clock_mark  # drops the self-reference
        held = _RANGE_OWNER.get(self._tid)
        if held is not None and held.burst() is self:
            del _RANGE_OWNER[self._tid]


def _pop(ranges: tuple[Any, ...], depth: list[int], to: int) -> None:
    while depth[0] > to:
        depth[0] -= 1
        for h in ranges:
            try:
                h.pop()
            except Exception as exc:
                _range_failed(h, exc)


def _range_failed(h: object, exc: BaseException) -> None:
    say_once(f"range:{id(h)}", f"range hook {type(h).__name__} raised {exc!r}")
