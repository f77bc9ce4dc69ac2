"""NVTX ranges for Nsight Systems: ``spec.burst`` > ``spec.round`` > ``spec.draft`` /
``spec.verify`` / ``spec.accept`` / ``spec.rollback`` / ``spec.maint``, on the ``memra`` domain.

Records arrive too late to sit over a phase's kernels, so this sink takes none: bursts call
its :attr:`NvtxSink.range_hook` right after each boundary's mark. Decided once: the ``nvtx``
package's domain (0.2.12+), else ``torch.cuda.nvtx`` (no domains), else (also with
``NVTX_DISABLE`` or no tool attached: no ``NVTX_INJECTION64_PATH``) a no-op, said once.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace
from typing import Any

from ..diagnostics import say_once
from .base import Sink

__all__ = ["DOMAIN", "RANGE_NAMES", "NvtxSink"]

DOMAIN = "memra"
_RANGES = (  # every range the observer opens (RANGE_NAMES): name, timeline colour, its ARGB
    ("spec.burst", "grey", 0xFF808080),
    ("spec.round", "white", 0xFFE0E0E0),
    ("spec.draft", "green", 0xFF2CA02C),
    ("spec.verify", "blue", 0xFF1F77B4),
    ("spec.accept", "orange", 0xFFFF7F0E),
    ("spec.rollback", "red", 0xFFD62728),
    ("spec.maint", "purple", 0xFF9467BD),
)
RANGE_NAMES: dict[str, str] = {name: colour for name, colour, _ in _RANGES}


class NvtxSink(Sink):
    """Phase / round / burst ranges for Nsight Systems; a no-op where NVTX is absent.
    ``domain``: an ``nvtx`` domain (or a fake) to use instead of looking one up."""

    def __init__(self, domain: Any = None) -> None:
        try:
            found = _find(domain)
        except Exception as exc:
            found = _off("nvtx-error", f"setting up ranges failed ({exc!r}); no NVTX ranges")
        #: ``range_hook``: ``push(name)`` / ``pop()``, called by the observer at each boundary
        #: (None: off); ``backend``: the one in use, ``"nvtx"``, ``"torch"`` or ``"off"``.
        self.range_hook, self.backend = found


_DISABLED = ("nvtx-disabled", "NVTX_DISABLE is set; no NVTX ranges")
_NOTOOL = ("nvtx-notool", "no profiler attached (run under Nsight Systems, `nsys profile`, "
           "to see ranges); no NVTX ranges")  # fmt: skip


def _find(domain: Any) -> tuple[Any, str]:
    if domain is None and (nvtx := _nvtx()) is not None:
        if not hasattr(nvtx, "Domain"):  # < 0.2.12: no domain push/pop, no no-tool dummy
            say_once("nvtx:nvtx-old", "NVTX sink: the nvtx package is older than 0.2.12 "
                     "(pip install -U nvtx); trying torch.cuda.nvtx")  # fmt: skip
        elif not nvtx.enabled():
            return _off(*_DISABLED)
        elif type(domain := nvtx.get_domain(DOMAIN)).__name__ == "DummyDomain":
            return _off(*_NOTOOL)
    if domain is not None:  # push/pop on the domain, with attributes built once per name
        mk, push = domain.get_event_attributes, domain.push_range
        attrs = {name: mk(message=name, color=argb) for name, _, argb in _RANGES}
        return SimpleNamespace(push=lambda name: push(attrs[name]), pop=domain.pop_range), "nvtx"
    if _importable("torch"):
        # torch's NVTX has no switch of its own: the nvtx package's, from the environment
        # (Nsight tools attach through NVTX_INJECTION64_PATH); read before torch is imported
        # and its is_available() starts the CUDA driver in a process no profiler watches
        if os.environ.get("NVTX_DISABLE"):
            return _off(*_DISABLED)
        if not os.environ.get("NVTX_INJECTION64_PATH"):
            return _off(*_NOTOOL)
        import torch

        if torch.cuda.is_available():
            why = "no nvtx package (0.2.12+); using torch.cuda.nvtx (no 'memra' domain)"
            say_once("nvtx:nvtx-torch", f"NVTX sink: {why}")
            nv = torch.cuda.nvtx  # no domain, no colour
            return SimpleNamespace(push=nv.range_push, pop=nv.range_pop), "torch"
    why = "neither the nvtx package nor a CUDA torch is installed; no NVTX ranges"
    return _off("nvtx-absent", why + " (pip install nvtx)")


def _off(key: str, msg: str) -> tuple[None, str]:
    say_once(f"nvtx:{key}", f"NVTX sink: {msg}")
    return None, "off"


def _nvtx() -> Any:
    """The nvtx package, or None (absent, or broken: said once, and torch's ranges tried)."""
    if not _importable("nvtx"):
        return None
    try:
        import nvtx
    except Exception as exc:
        say_once("nvtx:nvtx-broken", f"NVTX sink: importing the nvtx package failed ({exc!r}); "
                 "trying torch.cuda.nvtx")  # fmt: skip
        return None
    return nvtx


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
