"""The compact aggregation behind every series: plain lists and ints, no locks of their own.

A :class:`Hist` keeps per-bucket (not cumulative) counts found by one ``bisect`` into the
family's bounds, an integer sum in the family's unit (nanoseconds for every time histogram,
so the sum is exact), the observation count, and the latest exemplar per bucket. A
:class:`Value` is a counter or gauge. A :class:`Family` is one metric name with its children,
keyed by label values. The exporter mutates them under its lock; the collector copies them
under the same lock (:meth:`Family.snapshot`) and renders outside it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.utils import floatToGoString

__all__ = ["ExState", "Family", "Hist", "Value"]

#: (exemplar labels, observed value in the family's unit, epoch seconds or None)
ExState = tuple[dict[str, str], float, "float | None"]


class Hist:
    """One histogram child. ``observe`` is the hot path: one bisect, three adds."""

    __slots__ = ("bounds", "counts", "ex", "n", "prefixes", "render_cache", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.ex: list[ExState | None] = [None] * (len(bounds) + 1)
        self.n = 0
        self.total: float = 0
        #: The renderer's memo (see :mod:`memra_obs.prom.render`): the sample-line prefixes,
        #: and per format (``openmetrics``) the child's text keyed by ``n``.
        self.prefixes: tuple[str, ...] = ()
        self.render_cache: dict[bool, tuple[int, str]] = {}

    def observe(
        self, v: float, ex: dict[str, str] | None = None, ts: float | None = None, n: int = 1
    ) -> None:
        """``n`` observations of ``v`` (``n`` > 1: a run of identical rounds, in one step)."""
        if v < 0:
            v = 0  # a clock that stepped back; never let _sum go down
        i = bisect_left(self.bounds, v)
        self.counts[i] += n
        self.total += v * n
        self.n += n
        if ex is not None:
            self.ex[i] = (ex, v, ts)

    def state(self) -> tuple[int, list[int], float, list[ExState | None]]:
        """A copy, taken under the owner's lock."""
        return self.n, self.counts[:], self.total, self.ex[:]


class Value:
    """A counter or gauge child; ``read`` (when set) supplies the value at scrape time."""

    __slots__ = ("prefixes", "read", "render_cache", "v")

    def __init__(self, read: Callable[[], float] | None = None) -> None:
        self.v: float = 0
        self.read = read
        self.prefixes: tuple[str, ...] = ()
        self.render_cache: dict[bool, tuple[float, str]] = {}

    def state(self) -> float:
        read = self.read
        if read is None:
            return self.v
        try:
            self.v = read()
        except Exception:
            pass  # keep the last good reading: a counter never goes backwards on our account
        return self.v


class Family:
    """One metric name: its metadata, bucket layout and children.

    ``div`` converts the stored unit to the exposed one (1e9: ns -> s). ``kind`` is the
    OpenMetrics type: ``histogram``, ``counter`` or ``gauge``; a counter's ``name`` carries no
    ``_total`` (prometheus_client's convention: the sample is ``name_total``).
    """

    __slots__ = ("bounds", "children", "div", "help", "kind", "labelnames", "les", "name", "unit")

    def __init__(
        self,
        name: str,
        help: str,
        kind: str,
        labelnames: Sequence[str],
        *,
        unit: str = "",
        buckets: Sequence[float] = (),
        div: float = 1.0,
    ) -> None:
        self.name = name
        self.help = help
        self.kind = kind
        self.labelnames = tuple(labelnames)
        self.unit = unit
        self.div = div
        # Bounds in the stored unit; integral units compare as ints (exact, and faster).
        self.bounds = tuple(round(b * div) if div != 1.0 else b for b in buckets)
        self.les = (*(floatToGoString(b) for b in buckets), "+Inf")
        self.children: dict[tuple[str, ...], Any] = {}

    def hist(self, labelvalues: tuple[str, ...]) -> Hist:
        c = self.children.get(labelvalues)
        if c is None:
            c = self.children[labelvalues] = Hist(self.bounds)
        return c

    def value(self, labelvalues: tuple[str, ...]) -> Value:
        c = self.children.get(labelvalues)
        if c is None:
            c = self.children[labelvalues] = Value()
        return c

    def snapshot(self) -> list[tuple[tuple[str, ...], Any, Any]]:
        """(label values, child, copied state) per child; call under the owner's lock."""
        return [(lv, c, c.state()) for lv, c in self.children.items()]
