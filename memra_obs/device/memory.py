"""Free device memory per CUDA ordinal, in MiB — the seed's ``free_mb_before`` / ``free_mb_after``.

The loop numbers devices by **CUDA ordinal**; NVML numbers them its own way and ignores
``CUDA_VISIBLE_DEVICES``. The two are matched by PCI bus id, which the two APIs spell
differently (NVML ``00000000:1B:00.0``, CUDA ``0000:1b:00.0``; :func:`parse_bus_id` reads
both). The CUDA side's bus ids come from CuPy (``runtime.deviceGetPCIBusId``) or torch
(``get_device_properties(i).pci_*_id``) when one is importable; with neither,
``CUDA_VISIBLE_DEVICES`` is parsed the way the CUDA runtime reads it
(:func:`visible_devices`: indices, ``GPU-`` UUID prefixes, ``MIG-`` entries, the first bad entry
ends the list) over the devices in PCI bus order (exact with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``;
the driver's default ``FASTEST_FIRST`` agrees whenever the GPUs are alike).

Where NVML is missing or refuses (containers without the library, MIG instances, which NVML
reports as the whole card), the ordinal is read with ``cudaMemGetInfo`` instead (CuPy
``runtime.memGetInfo`` / ``torch.cuda.mem_get_info``; this creates the CUDA context on a device
that has none). Nothing here raises into the loop; each fallback is said once on stderr. With
no GPU at all the snapshot is ``[]`` and nothing is said.

Hardware is passed in (STYLE rule 4): :class:`FreeMemory` takes ``nvml=`` (a loader returning a
pynvml-like module) and ``cuda=`` (a loader returning a :class:`CudaQuery`), so tests hand in
fakes. pynvml, CuPy and torch are imported on the first snapshot, never at import.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from ..diagnostics import say_once

__all__ = [
    "CudaQuery",
    "CupyQuery",
    "FreeMemory",
    "NvmlDevice",
    "Slot",
    "TorchQuery",
    "default_cuda",
    "format_bus_id",
    "free_mb_snapshot",
    "load_pynvml",
    "parse_bus_id",
    "visible_devices",
]

MIB = 1 << 20

#: (domain, bus, device, function), as integers.
BusId = tuple[int, int, int, int]

# NVML return codes that mean "no GPU / no driver here" (quiet) rather than "refused".
_NVML_NO_GPU = {
    6,  # NVML_ERROR_NOT_FOUND
    9,  # NVML_ERROR_DRIVER_NOT_LOADED
    12,  # NVML_ERROR_LIBRARY_NOT_FOUND
}


def parse_bus_id(value: object) -> BusId | None:
    """Read a PCI bus id in either spelling: NVML's ``00000000:1B:00.0``, CUDA's
    ``0000:1b:00.0``, bytes or str, any case, NUL-padded; torch's ``(domain, bus, device)``
    triple too. None when it cannot be read."""
    if isinstance(value, tuple):
        try:
            parts = [int(x) for x in value]
        except (TypeError, ValueError):
            return None
        if len(parts) == 3:
            parts.append(0)
        return (parts[0], parts[1], parts[2], parts[3]) if len(parts) == 4 else None
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("ascii", "replace")
    if not isinstance(value, str):
        return None
    s = value.strip().rstrip("\x00").strip()
    fields = s.split(":")
    if len(fields) == 3:
        dom, bus, devfn = fields
    elif len(fields) == 2:
        dom, (bus, devfn) = "0", fields
    else:
        return None
    dev, _, fn = devfn.partition(".")
    try:
        return (int(dom, 16), int(bus, 16), int(dev, 16), int(fn or "0", 16))
    except ValueError:
        return None


def format_bus_id(b: BusId | None) -> str:
    """The one spelling used in messages and tests: ``0000:1b:00.0``."""
    if b is None:
        return "?"
    return f"{b[0]:04x}:{b[1]:02x}:{b[2]:02x}.{b[3]:x}"


def _slot_key(b: BusId) -> tuple[int, int, int]:
    # torch reports no PCI function; a GPU is function 0 anyway.
    return b[0], b[1], b[2]


# ============================================================================ the NVML side


class NvmlDevice(NamedTuple):
    """One device as NVML enumerates it."""

    nv_index: int
    handle: Any
    bus: BusId | None
    uuid: str
    name: str
    #: MIG mode is on: NVML's memory info of this handle is the whole card, not an instance.
    mig: bool


def _text(v: object) -> str:
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("ascii", "replace").rstrip("\x00")
    return str(v)


def _nvml_devices(nv: Any) -> list[NvmlDevice]:
    out = []
    for i in range(int(nv.nvmlDeviceGetCount())):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        try:
            bus = parse_bus_id(nv.nvmlDeviceGetPciInfo(h).busId)
        except Exception:
            bus = None
        try:
            uuid = _text(nv.nvmlDeviceGetUUID(h))
        except Exception:
            uuid = ""
        try:
            name = _text(nv.nvmlDeviceGetName(h))
        except Exception:
            name = ""
        try:
            mig = bool(nv.nvmlDeviceGetMigMode(h)[0])
        except Exception:  # NVML_ERROR_NOT_SUPPORTED: not a MIG-capable card
            mig = False
        out.append(NvmlDevice(i, h, bus, uuid, name, mig))
    return out


def load_pynvml() -> Any:
    """Import pynvml (nvidia-ml-py) and initialize NVML; raises what they raise."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def visible_devices(
    value: str | None, devices: Sequence[NvmlDevice], order: str | None = None
) -> list[NvmlDevice | str]:
    """CUDA ordinal -> the device it names, read the way the CUDA runtime reads
    ``CUDA_VISIBLE_DEVICES`` (``value``; None = unset = every device).

    Entries are decimal indices into the devices in PCI bus order (``CUDA_DEVICE_ORDER=
    PCI_BUS_ID``; ``order`` is accepted for the record: the default ``FASTEST_FIRST`` differs
    only on mixed cards), ``GPU-`` UUIDs or unique prefixes of one, or ``MIG-`` instance
    UUIDs (returned as the string: NVML cannot give their free memory by bus id). The first
    entry that names no device, or one already named, ends the list — devices after it are
    invisible, as the runtime has it."""
    base = sorted(devices, key=lambda d: (d.bus is None, d.bus or (0, 0, 0, 0), d.nv_index))
    if value is None:
        return list(base)
    out: list[NvmlDevice | str] = []
    seen: set[object] = set()
    for raw in value.split(","):
        tok = raw.strip()
        up = tok.upper()
        key: object
        if up.startswith("MIG-"):
            key = up
            dev: NvmlDevice | str = tok
        elif up.startswith("GPU-"):
            hits = [d for d in base if d.uuid.upper().startswith(up)]
            if len(hits) != 1:
                break
            dev = hits[0]
            key = dev.nv_index
        else:
            if not tok.isdigit():  # "", "-1", "all", junk: the list ends here
                break
            n = int(tok)
            if n >= len(base):
                break
            dev = base[n]
            key = dev.nv_index
        if key in seen:
            break
        seen.add(key)
        out.append(dev)
    return out


# ============================================================================ the CUDA side


class CudaQuery(Protocol):
    """The CUDA runtime's view: ordinals, their bus ids, and ``cudaMemGetInfo``."""

    name: str

    def count(self) -> int: ...
    def bus_id(self, ordinal: int) -> object: ...
    def free_bytes(self, ordinal: int) -> int: ...


class CupyQuery:
    name = "cupy"

    def __init__(self) -> None:
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime

    def count(self) -> int:
        try:
            return int(self._rt.getDeviceCount())
        except self._rt.CUDARuntimeError:  # no device / no driver
            return 0

    def bus_id(self, ordinal: int) -> object:
        return self._rt.deviceGetPCIBusId(ordinal)

    def free_bytes(self, ordinal: int) -> int:
        with self._cp.cuda.Device(ordinal):
            return int(self._rt.memGetInfo()[0])


class TorchQuery:
    name = "torch"

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def count(self) -> int:
        return int(self._torch.cuda.device_count()) if self._torch.cuda.is_available() else 0

    def bus_id(self, ordinal: int) -> object:
        p = self._torch.cuda.get_device_properties(ordinal)
        return (int(p.pci_domain_id), int(p.pci_bus_id), int(p.pci_device_id))

    def free_bytes(self, ordinal: int) -> int:
        return int(self._torch.cuda.mem_get_info(ordinal)[0])


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def default_cuda() -> CudaQuery | None:
    """CuPy or torch, preferring one the process already imported; None when neither loads."""
    order = [n for n in ("cupy", "torch") if n in sys.modules]
    order += [n for n in ("cupy", "torch") if n not in order and _importable(n)]
    for n in order:
        try:
            return CupyQuery() if n == "cupy" else TorchQuery()
        except Exception:
            continue
    return None


# ================================================================================ snapshot


class Slot(NamedTuple):
    """How one CUDA ordinal is read."""

    ordinal: int
    #: Canonical bus id (``0000:1b:00.0``), "?" when unknown.
    bus_id: str
    #: NVML's index of the device read, or None when read with cudaMemGetInfo.
    nvml_index: int | None
    #: ``"nvml"`` or ``"cuda"``.
    source: str


def _say(key: str, msg: str) -> None:
    say_once(f"memory:{key}", msg)


class FreeMemory:
    """Free MiB per CUDA ordinal: NVML matched by bus id, ``cudaMemGetInfo`` where it can't.

    ``nvml``: loader of a pynvml-like module (default :func:`load_pynvml`); ``cuda``: loader of
    a :class:`CudaQuery` or None (default :func:`default_cuda`); ``environ``: where
    ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` are read when neither CuPy nor torch is
    there; ``report(key, message)``: where fallbacks are said (default: the package's
    diagnostics, once per key).
    The ordinal -> device plan is made on the first snapshot and kept.
    """

    def __init__(
        self,
        *,
        nvml: Callable[[], Any] | None = None,
        cuda: Callable[[], CudaQuery | None] | None = None,
        environ: Mapping[str, str] | None = None,
        report: Callable[[str, str], None] | None = None,
    ) -> None:
        self._load_nvml = load_pynvml if nvml is None else nvml
        self._load_cuda = default_cuda if cuda is None else cuda
        self._environ = environ
        self._report = _say if report is None else report
        self._lock = threading.Lock()
        self._slots: list[Slot] | None = None
        self._nv: Any = None
        self._cuda: CudaQuery | None = None
        self._handles: dict[int, Any] = {}

    def _once(self, key: str, msg: str) -> None:
        try:
            self._report(key, msg)
        except Exception:
            pass

    # -- plan ----------------------------------------------------------------------------

    def slots(self) -> list[Slot]:
        """The ordinal -> device plan (made once)."""
        slots = self._slots
        if slots is None:
            with self._lock:
                if self._slots is None:
                    self._slots = self._plan()
                slots = self._slots
        return slots

    def _plan(self) -> list[Slot]:
        nv: Any = None
        nvml_why = ""
        no_gpu = False
        try:
            nv = self._load_nvml()
        except ModuleNotFoundError:
            nvml_why = "pynvml (nvidia-ml-py) is not installed"
            no_gpu = True  # can't tell; stay quiet unless CUDA shows a device
        except Exception as exc:
            code = getattr(exc, "value", None)
            no_gpu = code in _NVML_NO_GPU
            nvml_why = f"NVML init failed ({exc})"
        devices: list[NvmlDevice] = []
        if nv is not None:
            try:
                devices = _nvml_devices(nv)
            except Exception as exc:
                nvml_why = f"NVML enumeration failed ({exc})"
                nv = None
        self._nv = nv
        self._handles = {d.nv_index: d.handle for d in devices}

        cuda: CudaQuery | None = None
        try:
            cuda = self._load_cuda()
        except Exception as exc:
            self._once("cuda-load", f"free memory: CUDA runtime query unavailable ({exc!r})")
        count = 0
        if cuda is not None:
            try:
                count = cuda.count()
            except Exception as exc:
                self._once("cuda-count", f"free memory: {cuda.name} device count failed ({exc!r})")
                cuda = None
        self._cuda = cuda

        if cuda is not None:
            if count == 0:
                return []
            return self._plan_by_runtime(cuda, count, devices, nv is not None, nvml_why)
        if nv is None:
            if not no_gpu:
                self._once(
                    "none",
                    f"free memory: {nvml_why} and neither CuPy nor torch is importable; "
                    "free_mb is not recorded",
                )
            return []
        return self._plan_by_environment(devices)

    def _plan_by_runtime(
        self, cuda: CudaQuery, count: int, devices: list[NvmlDevice], have_nvml: bool, nvml_why: str
    ) -> list[Slot]:
        by_bus = {_slot_key(nd.bus): nd for nd in devices if nd.bus is not None}
        buses: list[BusId | None] = []
        for i in range(count):
            try:
                buses.append(parse_bus_id(cuda.bus_id(i)))
            except Exception:
                buses.append(None)
        keys = [_slot_key(b) for b in buses if b is not None]
        shared = {k for k in keys if keys.count(k) > 1}  # several ordinals on one card: MIG
        slots = []
        for i, b in enumerate(buses):
            d: NvmlDevice | None = by_bus.get(_slot_key(b)) if b is not None else None
            why = ""
            if not have_nvml:
                why = nvml_why
            elif b is None:
                why = f"{cuda.name} gave no PCI bus id for ordinal {i}"
            elif d is None:
                why = f"NVML has no device at bus id {format_bus_id(b)} (ordinal {i})"
            elif d.mig or _slot_key(b) in shared:
                why = f"MIG is on at {format_bus_id(b)}: NVML reports the whole card, not the instance"
            if why:
                self._once(
                    f"fallback:{why}", f"free memory: {why}; using cudaMemGetInfo via {cuda.name}"
                )
                slots.append(Slot(i, format_bus_id(b), None, "cuda"))
            else:
                assert d is not None
                slots.append(Slot(i, format_bus_id(b), d.nv_index, "nvml"))
        return slots

    def _plan_by_environment(self, devices: list[NvmlDevice]) -> list[Slot]:
        env = os.environ if self._environ is None else self._environ
        order = env.get("CUDA_DEVICE_ORDER")
        if (order or "FASTEST_FIRST").upper() != "PCI_BUS_ID" and len(
            {d.name for d in devices}
        ) > 1:
            self._once(
                "order",
                "free memory: mixed GPUs and CUDA_DEVICE_ORDER is not PCI_BUS_ID; "
                "ordinals assumed in PCI bus order (set CUDA_DEVICE_ORDER=PCI_BUS_ID, or "
                "install CuPy or torch, to be exact)",
            )
        slots = []
        for i, d in enumerate(visible_devices(env.get("CUDA_VISIBLE_DEVICES"), devices, order)):
            if isinstance(d, str) or d.mig:
                name = d if isinstance(d, str) else format_bus_id(d.bus)
                self._once(
                    f"mig:{name}",
                    f"free memory: ordinal {i} is a MIG instance ({name}); NVML "
                    "cannot read it and neither CuPy nor torch is there for cudaMemGetInfo; skipped",
                )
                continue
            slots.append(Slot(i, format_bus_id(d.bus), d.nv_index, "nvml"))
        return slots

    # -- reading -------------------------------------------------------------------------

    def _read(self, s: Slot) -> int | None:
        if s.nvml_index is not None:
            try:
                return (
                    int(self._nv.nvmlDeviceGetMemoryInfo(self._handles[s.nvml_index]).free) // MIB
                )
            except Exception as exc:
                cuda = self._cuda
                if cuda is None:
                    self._once(
                        f"nvml-read:{s.ordinal}",
                        f"free memory: NVML refused ordinal {s.ordinal} ({exc}); skipped",
                    )
                    return None
                self._once(
                    f"nvml-read:{s.ordinal}",
                    f"free memory: NVML refused ordinal {s.ordinal} "
                    f"({exc}); using cudaMemGetInfo via {cuda.name}",
                )
                with self._lock:
                    if self._slots is not None:
                        self._slots = [
                            x._replace(nvml_index=None, source="cuda") if x is s else x
                            for x in self._slots
                        ]
        cuda = self._cuda
        if cuda is None:
            return None
        try:
            return int(cuda.free_bytes(s.ordinal)) // MIB
        except Exception as exc:
            self._once(
                f"cuda-read:{s.ordinal}",
                f"free memory: cudaMemGetInfo failed on ordinal {s.ordinal} ({exc!r}); skipped",
            )
            return None

    def snapshot(self) -> list[tuple[int, int]]:
        """``[(cuda_ordinal, free_mb)]``; never raises."""
        try:
            out = []
            for s in self.slots():
                v = self._read(s)
                if v is not None:
                    out.append((s.ordinal, v))
            return out
        except Exception as exc:
            self._once("snapshot", f"free memory: snapshot failed ({exc!r}); recording none")
            return []

    __call__ = snapshot


_default: FreeMemory | None = None
_default_lock = threading.Lock()


def free_mb_snapshot() -> list[tuple[int, int]]:
    """Free MiB per CUDA ordinal for this process (NVML by bus id, cudaMemGetInfo fallback)."""
    global _default
    fm = _default
    if fm is None:
        with _default_lock:
            if _default is None:
                _default = FreeMemory()
            fm = _default
    return fm.snapshot()
