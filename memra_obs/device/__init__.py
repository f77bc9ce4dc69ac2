"""Device truth behind the clocks: stream adapters, the CUDA-event clock, free-memory snapshots,
and the GPU demo workload.

Nothing here imports CuPy, torch or pynvml at import time: :mod:`.streams` reads a stream's
framework off its type, :mod:`.event_clock` builds events only for streams it is given,
:mod:`.memory` loads NVML / the CUDA runtime on the first snapshot, and :mod:`.workload`
loads its framework when a :class:`~memra_obs.device.workload.GpuWorkload` is built.
The README's "Device truth" section says what each clock measures.
"""

from __future__ import annotations

__all__ = ["event_clock", "memory", "streams", "workload"]
