"""The aggregation behind every series, its text, and the bridge to prometheus_client.

Goal (DESIGN §9): a full-set ``GET /metrics`` under 2 ms (``bench/bench_prom.py``).
prometheus_client formats ~5 / ~9 µs a sample (the set has 991: 4.7 / 9.0 ms text /
OpenMetrics, holding the loop's GIL): a child here keeps integer counts and builds its sample
prefixes once, for the same bytes (``tests/test_prom_render.py``).
"""

from __future__ import annotations

import gzip
import re
import threading
import weakref
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from contextvars import ContextVar
from itertools import accumulate
from typing import Any

from prometheus_client import core
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from ..diagnostics import say_once

#: (exemplar labels, observed value in the family's unit, epoch seconds or None)
ExState = tuple[dict[str, str], float, "float | None"]
Snapshot = list[tuple[tuple[str, ...], Any, Any]]
Query = dict[str, list[str]]
#: OpenMetrics 0.0.1 is 1.0.0's text; prometheus_client answers it with text 0.0.4 (no exemplars).
_OM_0_0_1 = re.compile(r"\s*;\s*version=0\.0\.1\b")
#: An OpenMetrics version past 1.0.0 (Prometheus 3's OpenMetricsText2.0.0) is not ours to
#: answer: prometheus_client labelled its 1.0.0 body with it, which Prometheus refused.
_OM_NEXT = re.compile(
    r"application/openmetrics-text\s*;(?:[^,]*;)?\s*version=(?!1\.0\.0\b|0\.0\.1\b)[^,]*,?"
)


class Hist:
    """One histogram child: counts per bucket, an exact sum in the family's unit (ns for time),
    the latest exemplar per bucket; ``observe`` is the hot path: one bisect, two adds."""

    __slots__ = ("bounds", "counts", "ex", "memo", "prefixes", "total")

    def __init__(self, bounds: tuple[float, ...], prefixes: tuple[str, ...] = ()) -> None:
        self.bounds, self.counts = bounds, [0] * (len(bounds) + 1)
        self.ex: list[ExState | None] = [None] * (len(bounds) + 1)
        self.total: float = 0
        self.prefixes = prefixes  # sample names and labels: bucket, count, sum
        self.memo: dict[bool, tuple[int, str]] = {}  # openmetrics -> (n, its text at n)

    def observe(
        self, v: float, ex: dict[str, str] | None = None, ts: float | None = None, n: int = 1
    ) -> None:
        """``n`` observations of ``v`` (``n`` > 1: a run of equal rounds, in one step)."""
        if v < 0:
            v = 0  # a clock that stepped back; _sum never goes down
        i = bisect_left(self.bounds, v)
        self.counts[i] += n
        self.total += v if n == 1 else v * n  # most rounds are single: skip a long multiply
        if ex is not None:
            self.ex[i] = (ex, v, ts)

    def state(self) -> tuple[int, list[int], float, list[ExState | None]]:
        return sum(self.counts), self.counts[:], self.total, self.ex[:]


class Value:
    """A counter or gauge child; ``read`` (when set) supplies the value at scrape time."""

    __slots__ = ("prefix", "read", "v")

    def __init__(self, prefix: str, read: Callable[[], float] | None = None) -> None:
        self.v: float = 0
        self.prefix, self.read = prefix, read

    def state(self) -> float:
        if self.read is not None:
            with suppress(Exception):  # else the last good reading: a counter never goes back
                self.v = self.read()
        return self.v


def _count(n: int) -> str:
    """``floatToGoString(n)`` of a count, without its float round trip below 10**6 (the
    changed-histogram scrape spent half its time there)."""
    return f"{n}.0" if 0 <= n < 1_000_000 else floatToGoString(n)


def _esc(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def labelstr(items: Sequence[tuple[str, str]]) -> str:
    """``{a="x",b="y"}`` sorted by name, as both prometheus_client encoders print labels."""
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in sorted(items)) + "}" if items else ""


class Family:
    """One metric name, its children keyed by label values; a counter's ``name`` has no
    ``_total`` (prometheus_client's convention); ``_seconds`` are stored as integer ns."""

    __slots__ = ("bounds", "children", "div", "help", "kind", "labelnames", "les", "name", "unit")

    def __init__(
        self, name: str, help: str, kind: str, labels: Sequence[str], buckets: Sequence[float] = ()
    ) -> None:
        self.name, self.help, self.kind, self.labelnames = name, help, kind, tuple(labels)
        self.unit = next((u for u in ("seconds", "bytes") if name.endswith("_" + u)), "")
        self.div = 1e9 if self.unit == "seconds" else 1.0
        # Bounds in the stored unit; integral ns compare as ints (exact, and faster).
        self.bounds = tuple(round(b * 1e9) if self.div != 1.0 else b for b in buckets)
        self.les = (*(floatToGoString(b) for b in buckets), "+Inf")
        self.children: dict[tuple[str, ...], Any] = {}

    def child(self, lv: tuple[str, ...], read: Callable[[], float] | None = None) -> Any:
        """The child of label values ``lv`` (made at the first call: the series appears)."""
        c = self.children.get(lv)
        if c is None:
            base = list(zip(self.labelnames, lv, strict=True))
            if self.kind == "histogram":
                buckets = (f"{self.name}_bucket{labelstr([*base, ('le', le)])} " for le in self.les)
                ends = (f"{self.name}_{s}{labelstr(base)} " for s in ("count", "sum"))
                c = Hist(self.bounds, (*buckets, *ends))
            else:
                total = "_total" if self.kind == "counter" else ""
                c = Value(f"{self.name}{total}{labelstr(base)} ", read)
            self.children[lv] = c
        return c

    def snapshot(self) -> Snapshot:
        """(label values, child, copied state) per child; under the owner's lock."""
        return [(lv, c, c.state()) for lv, c in self.children.items()]

    def text(self, snap: Snapshot, om: bool) -> str:
        """This family's exposition (header and samples) from a :meth:`snapshot`."""
        if om:
            head = f"# HELP {self.name} {_esc(self.help)}\n# TYPE {self.name} {self.kind}\n"
            head += f"# UNIT {self.name} {self.unit}\n" if self.unit else ""
        else:
            name = self.name + "_total" if self.kind == "counter" else self.name
            doc = self.help.replace("\\", r"\\").replace("\n", r"\n")
            head = f"# HELP {name} {doc}\n# TYPE {name} {self.kind}\n"
        if self.kind != "histogram":
            return head + "".join(f"{c.prefix}{floatToGoString(v)}\n" for _, c, v in snap)
        return head + "".join(self._hist(c, st, om) for _, c, st in snap)

    def _hist(self, c: Hist, st: Any, om: bool) -> str:
        n, counts, total, ex = st
        memo = c.memo.get(om)
        if memo is not None and memo[0] == n:
            return memo[1]  # unchanged since the last scrape
        pre, lines, cum = c.prefixes, [], 0
        for i, cum in enumerate(accumulate(counts)):
            x, e = "", (ex[i] if om else None)  # x: the bucket's exemplar, if any
            if e is not None:
                ts = "" if e[2] is None else f" {e[2]}"
                x = f" # {labelstr(list(e[0].items()))} {floatToGoString(e[1] / self.div)}{ts}"
            lines.append(f"{pre[i]}{_count(cum)}{x}\n")
        lines.append(f"{pre[-2]}{_count(cum)}\n{pre[-1]}{floatToGoString(total / self.div)}\n")
        c.memo[om] = (n, "".join(lines))
        return c.memo[om][1]


#: Set by :func:`encode` while prometheus_client renders: our collectors add themselves here.
_FAST: ContextVar[list[SpecCollector] | None] = ContextVar("memra_prom_fast", default=None)
#: The collector of the exporter currently publishing into each registry (for take-over).
_owner: weakref.WeakKeyDictionary[Any, SpecCollector] = weakref.WeakKeyDictionary()
_owner_lock = threading.Lock()


class SpecCollector:
    """Exposes ``families``, whose writers hold ``lock``; a scrape holds it only to copy."""

    def __init__(self, families: Iterable[Family], lock: threading.Lock) -> None:
        self._families, self._lock = tuple(families), lock
        self.live = True  #: until its exporter is shut down (a successor then takes over)

    def _snapshot(self) -> list[tuple[Family, Snapshot]]:
        with self._lock:
            return [(f, f.snapshot()) for f in self._families]

    def describe(self) -> list[core.Metric]:
        """Names only: registering never walks the data, and name clashes are caught."""
        return [_metric(f, []) for f in self._families]

    def collect(self) -> list[core.Metric]:
        fast = _FAST.get()
        if fast is not None:
            fast.append(self)
            return []
        return [_metric(f, snap) for f, snap in self._snapshot()]

    def render(self, om: bool) -> str:
        """Every family's exposition, without ``# EOF``."""
        return "".join(f.text(snap, om) for f, snap in self._snapshot())

    def register(self, registry: Any) -> None:
        """Join ``registry``, taking the names over from an exporter's collector already
        there (an observer being replaced; said once if it was not shut down, as its series
        stop there); any other clash raises ValueError."""
        with _owner_lock:
            if (old := _owner.pop(registry, None)) is not None:
                if old.live:
                    say_once("prom-takeover", "a second PrometheusExporter on one registry takes "
                             "its names over: the first one's series are no longer published (one "
                             "observer a process, its family label tells models apart; or one "
                             "registry each)")  # fmt: skip
                with suppress(KeyError):  # its exporter unregistered it meanwhile
                    registry.unregister(old)
            registry.register(self)
            _owner[registry] = self

    def unregister(self, registry: Any) -> None:
        with _owner_lock, suppress(KeyError):  # taken over, or never registered
            if _owner.get(registry) is self:
                del _owner[registry]
            registry.unregister(self)


def encode(
    registry: Any, accept: str | None, *, gzip_ok: bool = False, params: Query | None = None
) -> tuple[bytes, list[tuple[str, str]]]:
    """The body and headers answering one ``GET /metrics`` (``params``: its parsed query)."""
    try:
        encoder, content_type = choose_encoder(_OM_0_0_1.sub("", _OM_NEXT.sub("", accept or "")))
    except Exception:  # its parser raises on a quoted (RFC 9110) or junk version=: text 0.0.4
        encoder, content_type = choose_encoder("")
    if params and "name[]" in params:
        body = encoder(registry.restricted_registry(params["name[]"]))  # rare: the slow path
    elif "escaping=dots" in content_type:  # rare: every "_" spelt "__", by prometheus_client
        body = encoder(registry)
    else:
        fast: list[SpecCollector] = []
        token = _FAST.set(fast)
        try:
            body = encoder(registry)
        finally:
            _FAST.reset(token)
        if fast:
            om = content_type.startswith("application/openmetrics-text")
            ours = "".join(c.render(om) for c in fast).encode()
            body = body.removesuffix(b"# EOF\n") + ours + b"# EOF\n" if om else body + ours
    headers = [("Content-Type", content_type)]
    if gzip_ok:
        # Level 1: ~5x smaller for a fraction of level 9's CPU, which the loop's process pays.
        body = gzip.compress(body, compresslevel=1)
        headers.append(("Content-Encoding", "gzip"))
    return body, headers


def _metric(f: Family, snap: Snapshot) -> core.Metric:
    if f.kind != "histogram":
        cls = core.CounterMetricFamily if f.kind == "counter" else core.GaugeMetricFamily
        m = cls(f.name, f.help, labels=f.labelnames, unit=f.unit)
        for lv, _c, v in snap:
            m.add_metric(list(lv), v)
        return m
    h = core.HistogramMetricFamily(f.name, f.help, labels=f.labelnames, unit=f.unit)
    for lv, _c, (_n, counts, total, ex) in snap:
        buckets = [
            (le, k) if e is None else (le, k, core.Exemplar(e[0], e[1] / f.div, e[2]))
            for le, k, e in zip(f.les, accumulate(counts), ex, strict=True)
        ]
        h.add_metric(list(lv), buckets, total / f.div)
    return h
