"""GPU tests: skipped unless a CUDA device is found through CuPy or torch.

``backend`` runs a test once per installed framework; ``rig`` gives it a non-blocking stream
and a known chunk of asynchronous device work to queue on it.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _count(name: str) -> int:
    if importlib.util.find_spec(name) is None:
        return 0
    try:
        if name == "cupy":
            import cupy

            return int(cupy.cuda.runtime.getDeviceCount())
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


BACKENDS = [n for n in ("cupy", "torch") if _count(n) > 0]
GPUS = max((_count(n) for n in BACKENDS), default=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="no CUDA device found through CuPy or torch")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not BACKENDS:
                item.add_marker(skip)


@pytest.fixture(params=BACKENDS or ["none"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Rig:
    """One framework's ops, a stream, and ``heavy()``: big matmuls queued without waiting."""

    def __init__(self, backend: str) -> None:
        from memra_obs.device.workload import _ops

        self.x = _ops(backend, 0)
        self.e = self.x.stream()
        with self.x.on(self.e):
            self.a = self.x.randn((8192, 8192), 0.01)
            self.b = self.x.randn((8192, 8192), 0.01)
            self.c = self.x.empty((8192, 8192))
            self.one = self.x.empty((1, 8))
        self.x.synchronize()
        self.heavy(2)
        self.e.synchronize()

    def heavy(self, n: int) -> None:
        """Queue ``n`` 8192^3 fp16 matmuls on ``e`` (about 1.5 ms each on an H200)."""
        with self.x.on(self.e):
            for _ in range(n):
                self.x.mm(self.a, self.b, out=self.c)

    def readback(self) -> None:
        """What an accept walk does: a small device->host copy, which waits for the stream."""
        with self.x.on(self.e):
            self.x.host(self.one, self.e)

    def device_ms(self, n: int) -> float:
        """Wall of ``n`` heavy matmuls, measured by draining around them."""
        self.e.synchronize()
        t0 = time.perf_counter()
        self.heavy(n)
        self.e.synchronize()
        return (time.perf_counter() - t0) * 1e3


@pytest.fixture
def rig(backend: str) -> Rig:
    return Rig(backend)


def pytest_report_header(config: pytest.Config) -> str:
    return f"gpu: backends={BACKENDS or 'none'} devices={GPUS} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"
