"""One scrape's body: content negotiation by prometheus_client, our families rendered fast.

:func:`encode` picks the format exactly as prometheus_client's own WSGI app does
(``choose_encoder``: OpenMetrics, with exemplars, when the scraper asks for it — Prometheus
does — and the classic text format otherwise), lets prometheus_client render whatever else
the registry holds (process metrics, other libraries' collectors), and appends the
collectors registered through :func:`register_fast` from their memoized text.
"""

from __future__ import annotations

import gzip
import threading
import weakref
from typing import Any

from prometheus_client.exposition import choose_encoder

from .collector import SKIP, SpecCollector

__all__ = ["encode", "register_fast", "unregister_fast"]

_fast: weakref.WeakKeyDictionary[Any, tuple[SpecCollector, ...]] = weakref.WeakKeyDictionary()
_fast_lock = threading.Lock()
_EOF = b"# EOF\n"


def register_fast(registry: Any, collector: SpecCollector) -> None:
    """``collector`` is in ``registry``: scrapes of it may render ``collector`` directly."""
    with _fast_lock:
        try:
            _fast[registry] = (*_fast.get(registry, ()), collector)
        except TypeError:
            pass  # a registry without weak references: served by prometheus_client alone


def unregister_fast(registry: Any, collector: SpecCollector) -> None:
    with _fast_lock:
        left = tuple(c for c in fast_collectors(registry) if c is not collector)
        try:
            if left:
                _fast[registry] = left
            else:
                _fast.pop(registry, None)
        except TypeError:
            pass


class _Rest:
    """The registry minus the fast collectors (they return nothing while SKIP names them)."""

    def __init__(self, registry: Any, skip: frozenset[int]) -> None:
        self._registry = registry
        self._skip = skip

    def collect(self) -> list[Any]:
        token = SKIP.set(self._skip)
        try:
            return list(self._registry.collect())
        finally:
            SKIP.reset(token)


def encode(
    registry: Any,
    accept: str | None,
    *,
    gzip_ok: bool = False,
    params: dict[str, list[str]] | None = None,
) -> tuple[bytes, list[tuple[str, str]]]:
    """The body and headers answering one ``GET /metrics``."""
    encoder, content_type = choose_encoder(accept or "")
    fast = fast_collectors(registry)
    if params and "name[]" in params:
        body = encoder(registry.restricted_registry(params["name[]"]))  # rare: the slow path
    elif not fast:
        body = encoder(registry)
    else:
        om = content_type.startswith("application/openmetrics-text")
        rest = encoder(_Rest(registry, frozenset(id(c) for c in fast)))
        if om and rest.endswith(_EOF):
            rest = rest[: -len(_EOF)]
        ours = "".join(c.render(om) for c in fast).encode()
        body = rest + ours + (_EOF if om else b"")
    headers = [("Content-Type", content_type)]
    if gzip_ok:
        # Level 1: ~5x smaller for a fraction of level 9's CPU, which the loop would pay.
        body = gzip.compress(body, compresslevel=1)
        headers.append(("Content-Encoding", "gzip"))
    return body, headers


def fast_collectors(registry: Any) -> tuple[SpecCollector, ...]:
    try:
        return _fast.get(registry, ())
    except TypeError:
        return ()
