"""The instrument's own health: records it dropped and exports that failed, per signal.

Nothing is counted twice here: the counts already live on the objects that drop or fail
(``QueueSink.dropped``, ``ExportWorker.errors``, a span exporter's ``dropped_spans`` /
``export_errors``); these families read them when scraped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .model import Family, Value

__all__ = ["SelfMetrics"]


class SelfMetrics:
    """``memra_obs_dropped_total{signal}`` and ``memra_obs_export_errors_total{signal}``."""

    def __init__(self) -> None:
        self.dropped = Family(
            "memra_obs_dropped",
            "Telemetry the instrument dropped instead of blocking the loop (signal: records = "
            "the hand-off queue was full; spans = a span exporter's queue was full).",
            "counter",
            ("signal",),
        )
        self.errors = Family(
            "memra_obs_export_errors",
            "Exports that failed (signal: records = an exporter raised on a batch; spans = a "
            "span export failed; metrics = a record this exporter could not aggregate).",
            "counter",
            ("signal",),
        )
        self.all = (self.dropped, self.errors)
        self._readers: dict[tuple[str, str], list[Callable[[], float]]] = {}

    def watch(self, kind: str, signal: str, read: Callable[[], float]) -> None:
        """Publish ``read()`` (a monotonic count) under ``kind`` (``dropped`` / ``errors``);
        several readers of one signal add up. Call under the exporter's lock."""
        fam = {"dropped": self.dropped, "errors": self.errors}[kind]
        readers = self._readers.setdefault((kind, signal), [])
        readers.append(read)
        if (signal,) not in fam.children:
            fam.children[(signal,)] = Value(read=lambda: sum(r() for r in readers))

    def watch_queue(self, qsink: Any) -> None:
        """The queue's drops and its worker's failures, and every exporter behind it that
        counts its own (int ``dropped_spans`` / ``export_errors``; signal: its ``signal``
        attribute, else ``spans``)."""
        self.watch("dropped", "records", lambda: qsink.dropped)
        worker = getattr(qsink, "worker", None)
        if worker is None:
            return
        self.watch("errors", "records", lambda: worker.errors)
        for ex in getattr(worker, "exporters", ()):
            sig = getattr(ex, "signal", None)
            sig = sig if isinstance(sig, str) else "spans"
            for attr, kind in (("dropped_spans", "dropped"), ("export_errors", "errors")):
                if isinstance(getattr(ex, attr, None), int):
                    self.watch(kind, sig, _attr_reader(ex, attr))


def _attr_reader(obj: Any, attr: str) -> Callable[[], float]:
    return lambda: getattr(obj, attr)
