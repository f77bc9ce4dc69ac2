"""Acceptance by position and the k advisor on ``/metrics``, per loop label set. A round adds
two counts (rounds by k, by j); the by-position counters are their tail sums, read at scrape
(Σ over positions = the totals, exactly). The exporter's thread refits the advice at most once
a second (or at ``flush``), never the loop or a scrape.
"""

from __future__ import annotations

import copy
import struct
from functools import partial
from typing import Any

from ..analysis import Kept, Ring, Stats
from ..diagnostics import say_once
from ..timeline import RoundRecord
from .model import Family

#: By-position series per label set at most (their cardinality): a round drafting more than
#: this counts at positions 0..POSITIONS-1 only (said once).
POSITIONS = 64
#: The advisor's gauges are recomputed at most this often (seconds) while rounds arrive.
ADVICE_EVERY_S = 1.0
#: The curve's bound: ``memra_spec_estimated_tokens_per_second{k}`` for k = 1..MAX_K.
MAX_K = 16
_U64 = (1 << 64) - 1  # a window's ring holds unsigned 64-bit phases


def _tail_sum(counts: list[int], start: int) -> float:
    return float(sum(counts[start:]))


class LoopAdvisor:
    """One ``(worker,) family`` label set's counts by k and j, and its window of rounds."""

    __slots__ = ("by_j", "by_k", "clock", "dirty", "f", "gone", "info", "lv", "new", "st", "top",
                 "win")  # fmt: skip

    def __init__(self, f: dict[str, Family], lv: tuple[str, ...], window: int) -> None:
        self.f, self.lv = f, lv
        self.by_k, self.by_j = [0] * (POSITIONS + 1), [0] * (POSITIONS + 1)
        self.top, self.dirty = 0, False  # top: positions with series so far
        self.win = Ring(window) if window else None  # 56 B a round
        #: The window's sums, kept up to date at each ``take`` from what came and went since
        #: (the refit rebuilt them from every round: ~8 ms a family a second, on the GIL the
        #: loop shares; 64 families slowed the loop ~30%); None: built anew at the next take.
        self.st: Stats | None = None
        self.gone: list[Kept] = []  # rounds the window dropped since the last take
        self.new = 0  # rounds it took since then
        self.clock = ""  # the clock that timed this label set's phases ("" until a session says)
        self.info: tuple[str, ...] = ()  # the info series' label values (none yet: ())

    def add(self, r: RoundRecord, k: int, j: int, n: int) -> None:
        """A round (``n``: a run of them) with known counts ``k`` and ``j`` (the caller has
        them unpacked); under the exporter's lock."""
        if k > self.top:  # new positions: their series (bounded, said once past POSITIONS)
            if k > POSITIONS:
                say_once(
                    "prom.positions",
                    f"a round drafted k={k}: the by-position counters stop at position "
                    f"{POSITIONS - 1} (their series are bounded; the totals count every token)",
                )
            drafted = self.f["memra_spec_drafted_tokens_by_position"]
            accepted = self.f["memra_spec_accepted_tokens_by_position"]
            for p in range(self.top, min(k, POSITIONS)):
                drafted.child((*self.lv, str(p)), partial(_tail_sum, self.by_k, p + 1))
                accepted.child((*self.lv, str(p)), partial(_tail_sum, self.by_j, p + 1))
            self.top = min(k, POSITIONS)
        # (a conditional, not min(): a builtin call costs more, on every round)
        self.by_k[k if k < POSITIONS else POSITIONS] += n
        self.by_j[j if j < POSITIONS else POSITIONS] += n
        if (win := self.win) is not None:  # a run is n rounds for the fit too
            ph: tuple[int, ...] = r.phase_ns()
            for _ in range(min(n, win.size)):
                if self.st is not None and (old := win.oldest()) is not None:
                    self.gone.append(old)
                try:
                    win.push(k, j, ph)
                except struct.error:  # stamps out of order: 0, as the phase's histogram has it
                    ph = tuple(0 if p < 0 else p if p < _U64 else _U64 for p in ph)
                    k, j = min(k, _U64), min(j, _U64)  # (past 64 bits: a record no loop made)
                    win.push(k, j, ph)
            self.new += n
            if self.st is not None and self.new * 4 > win.size:  # many came: cheaper built anew
                self.st, self.gone = None, []
            self.dirty = True

    def take(self) -> Stats | None:
        """The window's sums when they changed since the last advice (a copy: the fit runs
        outside the lock); under the lock."""
        if not self.dirty or self.win is None:
            return None
        st, win = self.st, self.win
        if st is None:
            st = self.st = Stats(win.last(len(win)))
        else:  # what went, and what came: the window's newest ``new``
            for r in self.gone:
                st.add(r.k, r.j, r.ph, -1)
            for r in win.last(self.new):
                st.add(r.k, r.j, r.ph)
        self.dirty, self.new, self.gone = False, 0, []
        return copy.deepcopy(st)

    def publish(self, a: Any) -> None:
        """Set the gauges from an :class:`memra_obs.analysis.Advice` (None: the window gives
        none, e.g. speculation turned off: no series, not a stale fit); under the lock."""
        f, lv = self.f, self.lv
        if a is None:
            for name in ("recommended_k", "estimated_speedup", "expected_tokens_per_round"):
                f[f"memra_spec_{name}"].children.pop(lv, None)
            for k in range(1, MAX_K + 1):
                f["memra_spec_estimated_tokens_per_second"].children.pop((*lv, str(k)), None)
            f["memra_spec_advice_info"].children.pop(self.info, None)
            self.info = ()
            return
        f["memra_spec_recommended_k"].child(lv).v = a.recommended_k
        f["memra_spec_estimated_speedup"].child(lv).v = a.estimated_speedup.value
        f["memra_spec_expected_tokens_per_round"].child(lv).v = a.expected_tokens.value
        tps = f["memra_spec_estimated_tokens_per_second"]
        for p in a.curve:
            tps.child((*lv, str(p.k))).v = p.tokens_per_s.value
        info = (*lv, self.clock or "unknown", a.plain_step_source)
        if info != self.info:
            infos = f["memra_spec_advice_info"]
            infos.children.pop(self.info, None)
            infos.child(info).v = 1
            self.info = info
