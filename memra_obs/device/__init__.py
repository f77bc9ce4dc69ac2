"""Device truth behind the clocks: stream adapters, the CUDA-event clock, free-memory snapshots,
the GPU demo workload. Nothing here imports CuPy, torch or pynvml until a stream of that kind, a
snapshot or ``demo --gpu`` needs it (docs/METRICS_DEVICE.md, "Device truth").
"""

from __future__ import annotations

__all__ = ["event_clock", "memory", "workload"]
