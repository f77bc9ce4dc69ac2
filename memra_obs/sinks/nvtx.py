"""NVTX ranges for Nsight Systems: ``spec.burst`` > ``spec.round`` > ``spec.draft`` /
``spec.verify`` / ``spec.accept`` / ``spec.rollback`` / ``spec.maint``, on the ``memra`` domain.

Ranges are pushed and popped on the loop's thread *at the boundaries*, right after the
clock's mark, so on a timeline they sit over the kernels each phase launched (under the sync
clock they also cover the drain, i.e. the phase's device time). Records arrive too late for
that, so this sink is not fed records: it hands the observer a :attr:`NvtxSink.range_hook`
(``push(name)`` / ``pop()``), and the observer gives bursts that hook only when one exists —
with no NVTX sink, or no profiler attached, a boundary stays one clock mark.

Decided once at construction (the NVTX way): the ``nvtx`` package's ``memra`` domain with one
pre-built attribute set per range name; without ``nvtx``, ``torch.cuda.nvtx`` (no domains);
without either — or with ``NVTX_DISABLE`` set, or no tool attached (``nvtx`` then hands back
its dummy domain) — the sink is a no-op and says so once.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ..diagnostics import say_once
from .base import Sink

__all__ = ["DOMAIN", "RANGE_NAMES", "NvtxSink"]

DOMAIN = "memra"
#: Every range the observer opens, with its timeline colour.
RANGE_NAMES: dict[str, str] = {
    "spec.burst": "grey",
    "spec.round": "white",
    "spec.draft": "green",
    "spec.verify": "blue",
    "spec.accept": "orange",
    "spec.rollback": "red",
    "spec.maint": "purple",
}
_ARGB = {
    "grey": 0xFF808080,
    "white": 0xFFE0E0E0,
    "green": 0xFF2CA02C,
    "blue": 0xFF1F77B4,
    "orange": 0xFFFF7F0E,
    "red": 0xFFD62728,
    "purple": 0xFF9467BD,
}


def _say_once(key: str, msg: str) -> None:
    say_once(f"nvtx:{key}", msg)


class _DomainRanges:
    """push/pop on an ``nvtx`` domain with attributes built once per name."""

    __slots__ = ("_attrs", "_pop", "_push")

    def __init__(self, domain: Any) -> None:
        self._attrs = {
            name: domain.get_event_attributes(message=name, color=_ARGB[color])
            for name, color in RANGE_NAMES.items()
        }
        self._push = domain.push_range
        self._pop = domain.pop_range

    def push(self, name: str) -> None:
        self._push(self._attrs[name])

    def pop(self) -> None:
        self._pop()


class _TorchRanges:
    """push/pop through ``torch.cuda.nvtx`` (no domain, no colour)."""

    __slots__ = ("pop", "push")

    def __init__(self, nvtx: Any) -> None:
        self.push = nvtx.range_push
        self.pop = nvtx.range_pop


class NvtxSink(Sink):
    """Phase / round / burst ranges for Nsight Systems; a no-op where NVTX is absent.

    ``domain``: an ``nvtx`` domain (or anything with ``get_event_attributes``, ``push_range``,
    ``pop_range``) to use instead of looking one up — tests hand in a fake.
    """

    def __init__(self, domain: Any = None) -> None:
        #: ``push(name)`` / ``pop()`` called by the observer at each boundary; None = off.
        self.range_hook: Any = None
        #: Which backend is in use: ``"nvtx"``, ``"torch"`` or ``"off"``.
        self.backend = "off"
        try:
            if domain is not None:
                self.range_hook = _DomainRanges(domain)
                self.backend = "nvtx"
            else:
                self._find()
        except Exception as exc:
            self.range_hook = None
            self.backend = "off"
            _say_once(
                "nvtx-error", f"NVTX sink: setting up ranges failed ({exc!r}); no NVTX ranges"
            )

    def _find(self) -> None:
        if _importable("nvtx"):
            import nvtx

            if not nvtx.enabled():
                _say_once("nvtx-disabled", "NVTX sink: NVTX_DISABLE is set; no NVTX ranges")
                return
            domain = nvtx.get_domain(DOMAIN)
            if type(domain).__name__ == "DummyDomain":
                _say_once(
                    "nvtx-notool",
                    "NVTX sink: no profiler attached (run under Nsight Systems, "
                    "`nsys profile`, to see ranges); no NVTX ranges",
                )
                return
            self.range_hook = _DomainRanges(domain)
            self.backend = "nvtx"
            return
        if _importable("torch"):
            import torch

            if torch.cuda.is_available():
                self.range_hook = _TorchRanges(torch.cuda.nvtx)
                self.backend = "torch"
                _say_once(
                    "nvtx-torch",
                    "NVTX sink: the nvtx package is not installed; using "
                    "torch.cuda.nvtx (no 'memra' domain)",
                )
                return
        _say_once(
            "nvtx-absent",
            "NVTX sink: neither the nvtx package nor a CUDA torch is installed; "
            "no NVTX ranges (pip install nvtx)",
        )


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
