"""The compact aggregation behind every series: plain lists and ints, no locks of their own.

A :class:`Hist` keeps per-bucket (not cumulative) counts found by one ``bisect`` into the
family's bounds, an integer sum in the family's unit (nanoseconds for every time histogram,
so the sum is exact), the observation count, and the latest exemplar per bucket. A
:class:`Value` is a counter or gauge. A :class:`Family` is one metric name with its children,
keyed by label values. The exporter mutates them under its lock; the collector copies them
under the same lock (:meth:`Family.snapshot`) and renders outside it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.utils import floatToGoString

try:  # a batch into buckets in C (setup.py builds it where a compiler is found)
    from ._hist import count as C_COUNT
except ImportError:  # pragma: no cover - a build without it: the sort-based path below
    C_COUNT = None

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

    def observe(self, v: float, ex: dict[str, str] | None = None, ts: float | None = None) -> None:
        if v < 0:
            v = 0  # a clock that stepped back; never let _sum go down
        i = bisect_left(self.bounds, v)
        self.counts[i] += 1
        self.total += v
        self.n += 1
        if ex is not None:
            self.ex[i] = (ex, v, ts)

    def observe_many(
        self,
        vals: Sequence[int],
        ex_at: Callable[[int], tuple[dict[str, str], float | None] | None] | None = None,
    ) -> None:
        """Observe every value of ``vals`` in order: the same state as one :meth:`observe`
        per value, for integer values (every time and token histogram stores integers).

        ``ex_at(p)`` gives the exemplar labels and timestamp of ``vals[p]`` (None: that
        observation carries none); it is asked only about the observations that end up as
        a bucket's latest exemplar. Counts come from one C loop (:data:`C_COUNT`), or, for
        values it does not take and where it was not built, from one sort and a bisect per
        bucket bound the values span, not from one bisect per value.
        """
        n = len(vals)
        if n < 8:
            self._each(vals, ex_at)
            return
        if C_COUNT is not None:
            r = C_COUNT(self.bounds, vals, self.counts)
            if r is not None:
                self.total += r[0]
                self.n += n
                if ex_at is not None:
                    self._latest(vals, r[1], ex_at)
                return
        total = sum(vals)
        if type(total) is not int:  # float values: keep observe()'s order of additions
            self._each(vals, ex_at)
            return
        s = sorted(vals)
        neg = s[0] < 0
        if neg:  # a clock that stepped back, or a saturating difference: observe 0
            k = bisect_left(s, 0)
            total -= sum(s[:k])
            s[:k] = [0] * k
        b = self.bounds
        counts = self.counts
        lo = bisect_left(b, s[0])
        hi = bisect_left(b, s[-1])
        need: set[int] = set()  # the buckets this batch touched
        rare: list[tuple[int, int, int]] = []  # (bucket, first, end) in s of the 1-3 value ones
        if lo == hi:
            counts[lo] += n
        else:
            prev = 0
            for i in range(lo, hi):
                c = bisect_right(s, b[i])
                if c > prev:
                    counts[i] += c - prev
                    need.add(i)
                    if c - prev <= 3:
                        rare.append((i, prev, c))
                    prev = c
            counts[hi] += n - prev
            need.add(hi)  # s[-1] lies there
            if n - prev <= 3:
                rare.append((hi, prev, n))
        self.total += total
        self.n += n
        if ex_at is None:
            return
        exs = self.ex
        if lo == hi:  # one bucket: its exemplar is the latest observation that has one
            for p in range(n - 1, -1, -1):
                e = ex_at(p)
                if e is not None:
                    v = vals[p]
                    exs[lo] = (e[0], v if v > 0 or not neg else 0, e[1])
                    return
            return
        # Each touched bucket gets the exemplar of its latest observation (that has one).
        # A bucket of 1-3 values: their last places, by list.index on the reversed values
        # (C, ~14 ns an element) rather than a Python step (~70 ns) per value scanned back.
        if rare and not neg and len(rare) < len(need):
            rv = vals[::-1]
            for i, a, z in rare:
                p = n - 1 - min([rv.index(x) for x in s[a:z]])
                e = ex_at(p)
                if e is not None:
                    exs[i] = (e[0], vals[p], e[1])
                    need.discard(i)
        for p in range(n - 1, -1, -1):
            v = vals[p]
            if neg and v < 0:
                v = 0
            i = bisect_left(b, v)
            if i in need:
                e = ex_at(p)
                if e is not None:
                    exs[i] = (e[0], v, e[1])
                    need.discard(i)
                    if not need:
                        return

    def _latest(
        self,
        vals: Sequence[int],
        last: list[int],
        ex_at: Callable[[int], tuple[dict[str, str], float | None] | None],
    ) -> None:
        """Each touched bucket's exemplar from its latest observation that has one (``last``:
        per bucket, the index of its latest value, -1 for none)."""
        exs = self.ex
        b = self.bounds
        for i, p in enumerate(last):
            if p < 0:
                continue
            e = ex_at(p)
            while e is None:  # that round has no exemplar: an earlier one of this bucket?
                p -= 1
                while p >= 0 and bisect_left(b, vals[p] if vals[p] > 0 else 0) != i:
                    p -= 1
                if p < 0:
                    break
                e = ex_at(p)
            if e is not None:
                v = vals[p]
                exs[i] = (e[0], v if v > 0 else 0, e[1])

    def _each(
        self,
        vals: Sequence[float],
        ex_at: Callable[[int], tuple[dict[str, str], float | None] | None] | None,
    ) -> None:
        for p in range(len(vals)):
            e = ex_at(p) if ex_at is not None else None
            if e is None:
                self.observe(vals[p])
            else:
                self.observe(vals[p], e[0], e[1])

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
