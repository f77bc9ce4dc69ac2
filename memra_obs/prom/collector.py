"""The bridge to prometheus_client: a Collector over our families, plus the fast path.

``collect()`` builds ordinary ``*MetricFamily`` objects, so everything prometheus_client does
with a registry (``get_sample_value``, ``generate_latest``, push gateways, restricted
registries) works unchanged. ``render()`` produces the same bytes without building them
(:mod:`memra_obs.prom.render`); :mod:`memra_obs.prom.exposition` uses it for scrapes and
asks ``collect()`` to stand aside meanwhile (:data:`SKIP`), so nothing is rendered twice.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Exemplar

from .model import Family
from .render import family_text

__all__ = ["SKIP", "SpecCollector"]

#: Collectors whose ``collect()`` yields nothing in this context: the fast exposition renders
#: them itself and lets prometheus_client render the rest of the registry.
SKIP: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "memra_prom_skip", default=frozenset()
)


class SpecCollector:
    """Exposes ``families``, whose writers hold ``lock``; a scrape holds it only to copy."""

    def __init__(self, families: Sequence[Family], lock: threading.Lock) -> None:
        self._families = tuple(families)
        self._lock = lock

    def _snapshot(self) -> list[tuple[Family, list[tuple[tuple[str, ...], Any, Any]]]]:
        with self._lock:
            return [(f, f.snapshot()) for f in self._families]

    # -- prometheus_client's side --------------------------------------------------------

    def describe(self) -> list[Metric]:
        """Names only, so registering never walks the data (and clashes are caught early).

        Each name once: DESIGN §5 has a histogram and a counter sharing a stem
        (``memra_spec_drafted_tokens`` and ``memra_spec_drafted_tokens_total``), and the
        registry cannot unregister a collector that lists a name twice.
        """
        out: list[Metric] = []
        stems: set[str] = set()
        for f in self._families:
            if f.kind == "counter" and f.name in stems:
                out.append(Metric(f.name + "_total", f.help, "unknown"))
            else:
                out.append(_metric(f, []))
            stems.add(f.name)
        return out

    def collect(self) -> Iterable[Metric]:
        if id(self) in SKIP.get():
            return []
        return [_metric(f, snap) for f, snap in self._snapshot()]

    # -- the fast path -------------------------------------------------------------------

    def render(self, openmetrics: bool) -> str:
        """The exposition of every family, without ``# EOF``."""
        return "".join(family_text(f, snap, openmetrics) for f, snap in self._snapshot())


def _metric(f: Family, snap: list[tuple[tuple[str, ...], Any, Any]]) -> Metric:
    m: Any
    if f.kind == "histogram":
        m = HistogramMetricFamily(f.name, f.help, labels=f.labelnames, unit=f.unit)
        for lv, _c, (_n, counts, total, ex) in snap:
            buckets: list[Any] = []
            cum = 0
            for le, k, e in zip(f.les, counts, ex, strict=True):
                cum += k
                if e is None:
                    buckets.append((le, cum))
                else:
                    buckets.append((le, cum, Exemplar(e[0], e[1] / f.div, e[2])))
            m.add_metric(list(lv), buckets, total / f.div)
    elif f.kind == "counter":
        m = CounterMetricFamily(f.name, f.help, labels=f.labelnames, unit=f.unit)
        for lv, _c, v in snap:
            m.add_metric(list(lv), v)
    else:
        m = GaugeMetricFamily(f.name, f.help, labels=f.labelnames, unit=f.unit)
        for lv, _c, v in snap:
            m.add_metric(list(lv), v)
    return m
