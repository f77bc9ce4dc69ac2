"""Device truth behind the clocks: stream adapters, the CUDA-event clock, free memory, the GPU
demo workload. CuPy, torch and pynvml load only when used (README, "Device truth")."""

__all__ = ["event_clock", "memory", "workload"]
