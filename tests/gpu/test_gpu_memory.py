"""On real GPUs: (4) NVML and cudaMemGetInfo agree on free memory and both see a large
allocation; (5) CUDA ordinals map to the right NVML device under CUDA_VISIBLE_DEVICES.
Plus the GPU workload's KV cache moving free_mb_before/after in a profiled session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from memra_obs.device.memory import (
    MIB,
    FreeMemory,
    _text,
    cupy_query,
    format_bus_id,
    load_pynvml,
    parse_bus_id,
    torch_query,
)
from memra_obs.testing import capture

ROOT = Path(__file__).resolve().parents[2]
ALLOC_MIB = 4096


def query(backend: str) -> Any:
    return cupy_query() if backend == "cupy" else torch_query()


def nvml_only(backend: str) -> FreeMemory:
    return FreeMemory(cuda=lambda: query(backend), report=lambda k, m: print("[nvml-path]", m))


def cuda_only(backend: str) -> FreeMemory:
    def no_nvml() -> Any:
        raise ModuleNotFoundError("forced: cudaMemGetInfo path")

    return FreeMemory(nvml=no_nvml, cuda=lambda: query(backend), report=lambda k, m: None)


def alloc(backend: str, mib: int) -> Any:
    """A plain cudaMalloc of ``mib`` MiB on ordinal 0 (outside any pool)."""
    if backend == "cupy":
        import cupy

        with cupy.cuda.Device(0):
            return cupy.cuda.Memory(mib * MIB)
    import torch

    return torch.empty(mib * MIB, dtype=torch.uint8, device="cuda:0")


def release(backend: str) -> None:
    if backend == "torch":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def test_nvml_and_cudamemgetinfo_agree_and_see_an_allocation(backend: str) -> None:
    """(4) Both paths read the same free MiB (within a few), and both drop by a 4 GiB cudaMalloc."""
    nv, cu = nvml_only(backend), cuda_only(backend)
    assert all(s.source == "nvml" for s in nv.slots()), nv.slots()
    assert all(s.source == "cuda" for s in cu.slots())
    q = query(backend)
    for i in range(q.count()):  # contexts on every device before anything is compared (the
        q.free_bytes(i)  # cudaMemGetInfo path reads only an ordinal with this process's context)
    a0, n0, b0 = cu.snapshot(), nv.snapshot(), cu.snapshot()
    buf = alloc(backend, ALLOC_MIB)
    a1, n1 = cu.snapshot(), nv.snapshot()
    del buf
    release(backend)
    print(
        f"\n[gpu] {backend} free MiB cudaMemGetInfo {a0} NVML {n0} | after {ALLOC_MIB} MiB: cuda {a1} NVML {n1}"
    )
    for (o, f_nv), (_, f_a), (_, f_b) in zip(n0, a0, b0, strict=True):
        assert min(abs(f_nv - f_a), abs(f_nv - f_b)) <= 8, (o, f_nv, f_a, f_b)
    drop_nv = n0[0][1] - n1[0][1]
    drop_cu = a0[0][1] - a1[0][1]
    assert abs(drop_nv - ALLOC_MIB) <= 8, drop_nv
    assert abs(drop_cu - ALLOC_MIB) <= 8, drop_cu


def test_free_mb_snapshot_default_is_nvml_by_bus_id(backend: str) -> None:
    """The process default finds every ordinal through NVML (no fallback on a plain host)."""
    fm = FreeMemory(report=lambda k, m: print("[default]", m))
    slots = fm.slots()
    assert slots and all(s.source == "nvml" for s in slots), slots
    nv = load_pynvml()
    for s in slots:
        h = nv.nvmlDeviceGetHandleByIndex(s.nvml_index)
        assert format_bus_id(parse_bus_id(nv.nvmlDeviceGetPciInfo(h).busId)) == s.bus_id


CHILD = textwrap.dedent(
    """
    import json, sys
    from memra_obs.device.memory import FreeMemory, cupy_query, torch_query, load_pynvml, parse_bus_id, format_bus_id
    mode = sys.argv[1]
    cuda = {"cupy": cupy_query, "torch": torch_query, "env": lambda: None}[mode]
    said = []
    fm = FreeMemory(cuda=cuda, report=lambda k, m: said.append(m))
    nv = load_pynvml()
    out = []
    for s in fm.slots():
        h = nv.nvmlDeviceGetHandleByIndex(s.nvml_index)
        out.append([s.ordinal, s.bus_id, format_bus_id(parse_bus_id(nv.nvmlDeviceGetPciInfo(h).busId)), s.source])
    snap = fm.snapshot()
    print("CHILD" + json.dumps({"slots": out, "snap": snap, "said": said}))
    """
)


NO_CONTEXT = textwrap.dedent(
    """
    import json, sys
    from memra_obs.device.memory import FreeMemory, cupy_query, torch_query
    q = {"cupy": cupy_query, "torch": torch_query}[sys.argv[1]]()
    def no_nvml():
        raise ModuleNotFoundError("forced: cudaMemGetInfo path")
    said = []
    fm = FreeMemory(nvml=no_nvml, cuda=lambda: q, report=lambda k, m: said.append(m))
    first = fm.snapshot()
    ctx = [q.has_context(i) for i in range(q.count())]
    q.free_bytes(0)  # the loop's context on ordinal 0 (this call creates it)
    then, ctx0 = fm.snapshot(), q.has_context(0)
    print("CHILD" + json.dumps({"first": first, "ctx": ctx, "then": then, "ctx0": ctx0, "said": said}))
    """
)


def test_cudamemgetinfo_creates_no_context(backend: str) -> None:
    """A fresh process on the cudaMemGetInfo path: no ordinal has its context, so none is read
    (and none created); once ordinal 0 has one, it alone is read."""
    got = child(backend, code=NO_CONTEXT)
    print(f"\n[gpu] {backend} no-context child: {got}")
    assert got["first"] == [] and not any(got["ctx"]), got
    assert [o for o, _ in got["then"]] == [0] and got["ctx0"] is True, got


def parent_buses(backend: str) -> list[str]:
    q = query(backend)
    return [format_bus_id(parse_bus_id(q.bus_id(i))) for i in range(q.count())]


def child(mode: str, code: str = CHILD, **env: str) -> dict[str, Any]:
    e = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        e.pop(k, None)
    e.update(env)
    r = subprocess.run(
        [sys.executable, "-c", code, mode], capture_output=True, text=True, env=e, timeout=300
    )
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("CHILD"))
    return json.loads(line[5:])


@pytest.mark.parametrize("mode", ["runtime", "env"])
def test_ordinals_map_right_under_cuda_visible_devices(backend: str, mode: str) -> None:
    """(5) CUDA_VISIBLE_DEVICES=1 in a child: its ordinal 0 is NVML's device with GPU 1's bus
    id; "1,0" swaps them; a GPU- UUID names the same card — through CuPy/torch bus ids and
    through parsing the variable alone (no framework in the child's plan)."""
    buses = parent_buses(backend)
    if len(buses) < 2:
        pytest.skip("needs two GPUs")
    nv = load_pynvml()
    uuid1 = next(
        _text(nv.nvmlDeviceGetUUID(h))
        for h in (nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount()))
        if format_bus_id(parse_bus_id(nv.nvmlDeviceGetPciInfo(h).busId)) == buses[1]
    )
    m = backend if mode == "runtime" else "env"
    cases = [
        ({"CUDA_VISIBLE_DEVICES": "1"}, [buses[1]]),
        ({"CUDA_VISIBLE_DEVICES": "1,0"}, [buses[1], buses[0]]),
        ({"CUDA_VISIBLE_DEVICES": uuid1}, [buses[1]]),
        ({"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, [buses[1]]),
    ]
    for env, want in cases:
        got = child(m, **env)
        print(f"\n[gpu] {backend}/{mode} {env} -> {got['slots']} snap {got['snap']}")
        assert [s[1] for s in got["slots"]] == want, (env, got)
        assert [s[2] for s in got["slots"]] == want, (env, got)  # NVML's own bus id of the pick
        assert [s[0] for s in got["snap"]] == list(range(len(want)))
        assert all(s[3] == "nvml" for s in got["slots"])


def test_gpu_workload_kv_cache_moves_free_memory(backend: str) -> None:
    """A profiled session on the GPU workload: free_mb_after is lower by about the KV cache."""
    from memra_obs.device.workload import GpuWorkload

    w = GpuWorkload(backend)
    ctx = 16384
    per_token = w.layers * 2 * w.KV_DIM * 2
    with (
        capture(level=1, prof=True, memory=FreeMemory(report=lambda k, m: None)) as cap,
        cap.observer.session("gpu", e=w.e, eh=w.eh) as s,
    ):
        s.free_memory("before")
        w.cache_alloc(ctx)
        s.lap("cache_alloc")
        w.prime(2048)
        s.lap("prime")
        w.draft_alloc(ctx)
        s.lap("draft_alloc")
        s.free_memory("after")
        prof = s.prof
        assert prof is not None
        before, after = dict(prof.free_mb_before), dict(prof.free_mb_after)
        w.end_session()
    cache_mib = ctx * per_token / MIB
    print(
        f"\n[gpu] {backend} workload: before {prof.free_mb_before} after {prof.free_mb_after}; KV cache {cache_mib:.0f} MiB"
    )
    assert before[0] - after[0] >= 0.95 * cache_mib
    assert prof.prime_ms > 0 and prof.cache_alloc_ms >= 0
