"""Free device memory per CUDA ordinal, in MiB — the seed's ``free_mb_before`` / ``free_mb_after``.

NVML ignores ``CUDA_VISIBLE_DEVICES`` and numbers devices its own way: the two meet at the PCI bus
id, which CuPy or torch give per ordinal (else ``CUDA_VISIBLE_DEVICES`` is read as the runtime
does). Where NVML is missing, refuses, or sees a MIG card whole, ``cudaMemGetInfo`` reads the
ordinal. Nothing raises into the loop; each fallback is said once (README, "Free memory").
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..diagnostics import say_once

MIB = 1 << 20
#: The longest a snapshot or a ``fork()`` waits for a warm-up under way (a stuck ``nvmlInit``
#: must not hold the loop or the fork).
FORK_WAIT_S = 10.0
#: (domain, bus, device, function)
BusId = tuple[int, int, int, int]
#: NVML errors that mean "no GPU or driver here" (stay quiet): NOT_FOUND, DRIVER_NOT_LOADED,
#: LIBRARY_NOT_FOUND.
_NVML_NO_GPU = {6, 9, 12}
_BUS = re.compile(r"(?:([0-9a-f]+):)?([0-9a-f]+):([0-9a-f]+)(?:\.([0-9a-f]+))?", re.IGNORECASE)


def parse_bus_id(value: object) -> BusId | None:
    """A PCI bus id in either spelling (str or bytes, any case, NUL-padded, domain optional),
    or torch's ``(domain, bus, device)``; None when it cannot be read."""
    if isinstance(value, tuple):
        parts = _try(lambda: [int(x) for x in value] + [0] * (len(value) == 3))
        return (parts[0], parts[1], parts[2], parts[3]) if parts and len(parts) == 4 else None
    if not isinstance(value, (str, bytes, bytearray)):
        return None
    if (m := _BUS.fullmatch(_text(value).strip())) is None:
        return None
    return (int(m[1] or "0", 16), int(m[2], 16), int(m[3], 16), int(m[4] or "0", 16))


def format_bus_id(b: BusId | None) -> str:
    """The one spelling of messages and tests: ``0000:1b:00.0`` (``?`` unknown)."""
    return "?" if b is None else f"{b[0]:04x}:{b[1]:02x}:{b[2]:02x}.{b[3]:x}"


def _text(v: object) -> str:
    s = bytes(v).decode("ascii", "replace") if isinstance(v, (bytes, bytearray)) else str(v)
    return s.strip().rstrip("\x00")


def _try(f: Callable[..., Any], *args: Any) -> Any:
    with suppress(Exception):
        return f(*args)
    return None


class NvmlDevice(NamedTuple):
    """One device as NVML enumerates it; ``mig``: NVML's memory info is the whole card's."""

    nv_index: int
    handle: Any
    bus: BusId | None
    uuid: str
    name: str
    mig: bool


def _nvml_devices(nv: Any) -> tuple[list[NvmlDevice], str]:
    """NVML's devices, and the ones it could not open (a lost card is not all cards lost)."""
    out, lost = [], []
    for i in range(int(nv.nvmlDeviceGetCount())):
        try:
            h = nv.nvmlDeviceGetHandleByIndex(i)
        except Exception as exc:
            lost.append(f"device {i} ({exc})")
            continue
        pci, mig = _try(nv.nvmlDeviceGetPciInfo, h), _try(nv.nvmlDeviceGetMigMode, h)
        uuid, name = _try(nv.nvmlDeviceGetUUID, h) or "", _try(nv.nvmlDeviceGetName, h) or ""
        bus = parse_bus_id(getattr(pci, "busId", None))
        out.append(NvmlDevice(i, h, bus, _text(uuid), _text(name), bool(mig and mig[0])))
    return out, ", ".join(lost)


def load_pynvml() -> Any:
    """Import pynvml (nvidia-ml-py) and initialise NVML; raises what they raise."""
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def visible_devices(value: str | None, devices: Sequence[NvmlDevice]) -> list[NvmlDevice | str]:
    """CUDA ordinal -> the device ``CUDA_VISIBLE_DEVICES`` (``value``; None: all) names, read as the
    runtime does: indices in PCI bus order, ``GPU-`` UUIDs or prefixes, ``MIG-`` instances (as the
    string); the first entry naming none, or one already named, ends the list; an index given
    twice leaves none (the driver's cuInit fails), and an index is its leading digits."""
    base = sorted(devices, key=lambda d: (d.bus is None, d.bus or (0, 0, 0, 0), d.nv_index))
    if value is None:
        return list(base)
    out: list[NvmlDevice | str] = []
    indices: set[int] = set()
    for tok in (t.strip() for t in value.split(",")):
        up = tok.upper()
        if up.startswith("MIG-"):
            dev: NvmlDevice | str | None = tok
        elif up.startswith("GPU-"):
            hits = [d for d in base if d.uuid.upper().startswith(up)]
            dev = hits[0] if len(hits) == 1 else None
        else:  # "", "-1", "all", junk and out-of-range indices end the list
            m = re.match(r"[0-9]+", tok)
            i = int(m.group()) if m else len(base)
            if i in indices:
                return []
            indices.add(i)
            dev = base[i] if i < len(base) else None
        if dev is None or dev in out:
            break
        out.append(dev)
    return out


@functools.cache
def _libcuda() -> Any:
    return _try(ctypes.CDLL, "libcuda.so.1")


def primary_context(ordinal: int) -> bool | None:
    """Whether this process holds ``ordinal``'s primary CUDA context (CuPy's and torch's), asked
    of the driver (``cuDevicePrimaryCtxGetState``, which creates none); None: it cannot tell."""
    if (cu := _libcuda()) is None:
        return None
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if (rc := cu.cuDeviceGet(ctypes.byref(dev), ordinal)) == 3:  # NOT_INITIALIZED: no context
        return False
    if rc or cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)):
        return None
    return bool(active.value)


@dataclass(frozen=True)
class CudaQuery:
    """The CUDA runtime's view, through CuPy or torch: ordinals, bus ids, ``cudaMemGetInfo``, and
    whether an ordinal has this process's context (``cudaMemGetInfo`` would create one)."""

    name: str
    count: Callable[[], int]
    bus_id: Callable[[int], object]
    free_bytes: Callable[[int], int]
    has_context: Callable[[int], bool | None] = primary_context


def cupy_query() -> CudaQuery:
    import cupy

    rt = cupy.cuda.runtime

    def free_bytes(ordinal: int) -> int:
        with cupy.cuda.Device(ordinal):
            return int(rt.memGetInfo()[0])

    count = lambda: int(_try(rt.getDeviceCount) or 0)  # noqa: E731  # no device, no driver: 0
    return CudaQuery("cupy", count, rt.deviceGetPCIBusId, free_bytes)


def torch_query() -> CudaQuery:
    import torch

    c = torch.cuda

    def bus_id(ordinal: int) -> object:
        p = c.get_device_properties(ordinal)
        return (int(p.pci_domain_id), int(p.pci_bus_id), int(p.pci_device_id))

    count = lambda: int(c.device_count()) if c.is_available() else 0  # noqa: E731
    free = lambda ordinal: int(c.mem_get_info(ordinal)[0])  # noqa: E731
    ctx = lambda ordinal: bool(torch._C._cuda_hasPrimaryContext(ordinal))  # noqa: E731
    return CudaQuery("torch", count, bus_id, free, ctx)


def default_cuda() -> CudaQuery | None:
    """CuPy or torch, the first the process imported that sees a device (a CuPy wheel built for
    another driver, imported by some library, hid a working torch); None when neither (not
    imported here: torch's import takes seconds, the plan is made in a profiled request)."""
    blind: CudaQuery | None = None
    for n in [n for n in ("cupy", "torch") if n in sys.modules]:
        q: CudaQuery | None = _try(cupy_query if n == "cupy" else torch_query)  # import errors too
        if q is not None and _try(q.count):
            return q
        blind = blind or q
    return blind


class Slot(NamedTuple):
    """How one CUDA ordinal is read: ``source`` ``"nvml"`` (NVML's device ``nvml_index``) or
    ``"cuda"`` (cudaMemGetInfo); ``bus_id`` canonical, ``?`` when unknown."""

    ordinal: int
    bus_id: str
    nvml_index: int | None
    source: str


class FreeMemory:
    """Free MiB per CUDA ordinal. ``nvml``: loader of a pynvml-like module; ``cuda``: loader of
    a :class:`CudaQuery` or None; ``environ``: where ``CUDA_*`` variables are read when neither
    framework is there; ``report(key, message)``: where fallbacks are said (default: once)."""

    def __init__(
        self,
        *,
        nvml: Callable[[], Any] | None = None,
        cuda: Callable[[], CudaQuery | None] | None = None,
        environ: Mapping[str, str] | None = None,
        report: Callable[[str, str], None] | None = None,
    ) -> None:
        self._load_nvml, self._load_cuda = nvml or load_pynvml, cuda or default_cuda
        self._environ = environ
        self._report = report or (lambda key, msg: say_once("memory:" + key, msg))
        self._lock = threading.Lock()
        self._slots: list[Slot] | None = None
        self._nv: Any = None
        self._devices: list[NvmlDevice] = []
        self._loaded, self._why, self._quiet = False, "", False  # NVML tried; why not; no GPU?
        self._lost = ""  # the devices NVML could not open
        self._cuda: CudaQuery | None = None
        #: A warm-up outlived the wait once: snapshots and forks wait no more until it ends.
        self.stuck = False

    def _say(self, key: str, msg: str) -> None:
        with suppress(Exception):
            self._report(key, "free memory: " + msg)

    def warm(self) -> None:
        """Initialise NVML and enumerate its devices now (once; the costly part)."""
        with self._lock:
            self._load()

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            nv = self._load_nvml()
            (self._devices, self._lost), self._nv = _nvml_devices(nv), nv
        except ModuleNotFoundError:
            self._why, self._quiet = "pynvml (nvidia-ml-py) is not installed", True
        except Exception as exc:
            self._why = f"NVML is unavailable ({exc})"
            self._quiet = getattr(exc, "value", None) in _NVML_NO_GPU

    def slots(self) -> list[Slot]:
        """The ordinal -> device plan, made once. A warm-up (``nvmlInit``) still under way is
        waited for at most ``FORK_WAIT_S``, then not at all until it ends: a hung driver held
        every profiled request's loop for as long as it hung."""
        if not self._lock.acquire(timeout=0 if (waited := self.stuck) else FORK_WAIT_S):
            if not waited:
                self.stuck = True
                self._say("stuck", f"NVML did not start within {FORK_WAIT_S:g} s (a hung "
                          "driver, a card off the bus?); none recorded until it does")  # fmt: skip
            return []
        try:
            self.stuck = False
            self._load()  # (a forked child whose restart got no thread: here, once)
            if self._slots is None:
                self._slots = self._plan()
            return self._slots
        finally:
            self._lock.release()

    def _plan(self) -> list[Slot]:
        try:
            cuda = self._load_cuda()
            count = cuda.count() if cuda is not None else 0
        except Exception as exc:
            self._say("cuda", f"the CUDA runtime query failed ({exc!r})")
            cuda, count = None, 0
        if cuda is not None and not count and self._devices:  # a CPU torch, a CuPy with no driver
            self._say(
                "cuda-none",
                f"{cuda.name} sees no CUDA device but NVML sees "
                f"{len(self._devices)}; ordinals read from CUDA_VISIBLE_DEVICES",
            )
            cuda = None
        self._cuda = cuda
        if cuda is not None:
            return self._by_runtime(cuda, count)
        if self._nv is None:
            if not self._quiet:
                self._say("none", f"{self._why} and neither CuPy nor torch loads; none recorded")
            return []
        return self._by_environment()

    def _by_runtime(self, cuda: CudaQuery, count: int) -> list[Slot]:
        by_bus = {d.bus[:3]: d for d in self._devices if d.bus is not None}  # torch has no function
        buses = [parse_bus_id(_try(cuda.bus_id, i)) for i in range(count)]
        keys = [b[:3] for b in buses if b is not None]
        via = f"using cudaMemGetInfo via {cuda.name}"
        if self._nv is None and count:
            self._say("nvml", f"{self._why}; {via}")
        slots = []
        for i, b in enumerate(buses):
            d = by_bus.get(b[:3]) if b is not None else None
            why = ""
            if b is None:
                why = f"{cuda.name} gave no PCI bus id for ordinal {i}"
            elif d is None:
                why = f"NVML has no device at bus id {format_bus_id(b)} (ordinal {i})"
                why += f"; it could not open {self._lost}" if self._lost else ""
            elif d.mig or keys.count(b[:3]) > 1:  # several ordinals on one card: MIG
                why = f"MIG is on at {format_bus_id(b)}: NVML reports the whole card"
            if why and self._nv is not None:
                self._say("fallback:" + why, f"{why}; {via}")
            nv = None if d is None or why or self._nv is None else d.nv_index
            slots.append(Slot(i, format_bus_id(b), nv, "cuda" if nv is None else "nvml"))
        return slots

    def _by_environment(self) -> list[Slot]:
        if self._lost:  # bus order without the lost card would shift every ordinal after it
            self._say(
                "lost", f"NVML could not open {self._lost}, so ordinals are unknown; none recorded"
            )
            return []
        env = os.environ if self._environ is None else self._environ
        pci_order = (env.get("CUDA_DEVICE_ORDER") or "").upper() == "PCI_BUS_ID"
        if not pci_order and len({d.name for d in self._devices}) > 1:
            self._say(
                "order",
                "mixed GPUs and CUDA_DEVICE_ORDER is not PCI_BUS_ID; ordinals assumed in PCI bus "
                "order (set CUDA_DEVICE_ORDER=PCI_BUS_ID, or install CuPy or torch, to be exact)",
            )
        slots = []
        for i, d in enumerate(visible_devices(env.get("CUDA_VISIBLE_DEVICES"), self._devices)):
            if isinstance(d, str) or d.mig:
                name = d if isinstance(d, str) else format_bus_id(d.bus)
                self._say(
                    "mig:" + name,
                    f"ordinal {i} is a MIG instance ({name}); NVML cannot read it and neither "
                    "CuPy nor torch is there for cudaMemGetInfo; skipped",
                )
            else:
                slots.append(Slot(i, format_bus_id(d.bus), d.nv_index, "nvml"))
        return slots

    def _read(self, s: Slot) -> int | None:
        cuda, i = self._cuda, s.ordinal
        if s.nvml_index is not None:
            try:
                handle = next(d.handle for d in self._devices if d.nv_index == s.nvml_index)
                return int(self._nv.nvmlDeviceGetMemoryInfo(handle).free) // MIB
            except Exception as exc:
                via = f"using cudaMemGetInfo via {cuda.name}" if cuda else "skipped"
                self._say(f"nvml-read:{i}", f"NVML refused ordinal {i} ({exc}); {via}")
                if cuda is not None:
                    with self._lock:  # for good
                        self._slots = [
                            x._replace(nvml_index=None, source="cuda") if x is s else x
                            for x in self._slots or []
                        ]
        if cuda is None:
            return None
        if _try(cuda.has_context, i) is False:  # a context is ~500 MiB of a card the loop spares
            self._say("no-context", f"ordinal {i} has no CUDA context in this process, and "
                      "cudaMemGetInfo would create one: skipped, as is any such ordinal (NVML, "
                      "nvidia-ml-py, reads them without)")  # fmt: skip
            return None
        try:
            return int(cuda.free_bytes(i)) // MIB
        except Exception as exc:
            self._say(f"cuda-read:{i}", f"cudaMemGetInfo failed on ordinal {i} ({exc!r}); skipped")
            return None

    def snapshot(self) -> list[tuple[int, int]]:
        """``[(cuda_ordinal, free_mb)]``; never raises."""
        try:
            return [(s.ordinal, v) for s in self.slots() if (v := self._read(s)) is not None]
        except Exception as exc:
            self._say("snapshot", f"snapshot failed ({exc!r}); recording none")
            return []

    __call__ = snapshot


_default: FreeMemory | None = None  # the process's; loads nothing until warmed or read
_default_lock = threading.Lock()


def _process() -> FreeMemory:
    global _default
    with _default_lock:
        _default = _default or FreeMemory()
        return _default


_held: list[threading.Lock] = []


def _before_fork() -> None:
    """A child forked mid-warm-up got its lock held by a thread it has not (and NVML half
    started): its first snapshot waited for ever. The fork waits for it, as ``logging`` does."""
    fm = _default
    if fm is not None:  # (one wait: a pool of 8 forked 80 s behind one hung nvmlInit)
        if fm._lock.acquire(timeout=0 if fm.stuck else FORK_WAIT_S):
            _held.append(fm._lock)
        else:
            fm.stuck = True


def _after_fork(child: bool = False) -> None:
    global _default_lock
    while _held:
        _held.pop().release()
    if child:
        _default_lock = threading.Lock()
        if _default is not None:  # the parent's wait is not the child's (its NVML starts anew)
            _default.stuck = False
        if _default is not None and _default._lock.locked():  # NVML stuck in the parent
            _default._lock, _default._slots = threading.Lock(), []
            say_once("memory:fork", "free memory: NVML was still starting when this process "
                     "forked; none recorded here")  # fmt: skip
        elif _default is not None and _default._nv is not None:
            # NVML is uninitialised in a forked child, the parent's handles invalid (measured:
            # every read failed, then a CUDA context of the child's own for cudaMemGetInfo).
            # Started again on a thread, as the warm-up; a snapshot waits for it.
            _default._lock.acquire()
            try:
                threading.Thread(target=_restart, args=(_default,), name="memra-obs-nvml",
                                 daemon=True).start()  # fmt: skip
            except RuntimeError:  # no thread to be had (a pids limit): the first snapshot does it
                # (unbounded there if nvmlInit hangs, as in a process that never warmed up)
                _default._loaded = False
                _default._lock.release()


def _restart(fm: FreeMemory) -> None:
    try:
        fm._loaded = False
        fm._load()  # nvmlInit() and the devices' handles again; the ordinal plan stands
    finally:
        fm._lock.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork,
                    after_in_child=lambda: _after_fork(child=True))  # fmt: skip


def free_mb_snapshot() -> list[tuple[int, int]]:
    """Free MiB per CUDA ordinal for this process (NVML by bus id, cudaMemGetInfo fallback)."""
    return _process().snapshot()


def warm(wait: bool = False) -> None:
    """Start NVML for :func:`free_mb_snapshot` now, on a daemon thread (``wait``: here), so no
    profiled snapshot pays for it (one that comes first waits); after any fork, in the child."""
    fm = _process()
    if fm._loaded:
        return
    if wait:
        fm.warm()
        return
    if fm._load_nvml is load_pynvml:  # the import is Python, under the GIL (~17 ms): here, at
        with suppress(Exception):  # start-up, not on a thread the first request's loop waits on
            import pynvml  # noqa: F401
    with suppress(RuntimeError):  # no thread to be had (a pids limit): the first snapshot does it
        threading.Thread(target=fm.warm, name="memra-obs-nvml", daemon=True).start()
