"""The GPU demo workload without a GPU: its kernel sequence run on numpy through the same ops
interface, so shapes, slicing and the demo's call order are checked in CI."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from memra_obs.device import workload as wl
from memra_obs.device.workload import GpuWorkload

np = pytest.importorskip("numpy", reason="numpy stands in for the GPU here")


class NumpyStream:
    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


class NumpyOps(wl._Ops):
    """The workload's ops on numpy: every 'kernel' runs at once on the host; matmul, argmax,
    take and copy are the real ones (``_Ops``) on numpy arrays."""

    name = "numpy"
    m = np

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.host_reads = 0
        self.released = 0

    def stream(self) -> NumpyStream:
        return NumpyStream()

    @contextlib.contextmanager
    def on(self, s: Any) -> Iterator[None]:
        yield

    def empty(self, shape: tuple[int, ...]) -> Any:
        return np.full(shape, np.nan, dtype=np.float32)

    def randn(self, shape: tuple[int, ...], scale: float) -> Any:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def cat(self, parts: list[Any]) -> Any:
        return np.concatenate(parts, 0)

    def host(self, x: Any, s: Any) -> Any:
        self.host_reads += 1
        return np.asarray(x)

    def wait(self, dst: Any, src: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        self.released += 1


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> NumpyOps:
    """Shrink the model so numpy runs it in milliseconds; hand out the numpy ops."""
    ops = NumpyOps()
    monkeypatch.setattr(wl, "_ops", lambda backend, device: ops)
    for name, v in dict(
        HIDDEN=64, FFN=128, LAYERS=3, KV_DIM=16, VOCAB=97, D_HIDDEN=32, D_KV=8, CHUNK=16
    ).items():
        monkeypatch.setattr(GpuWorkload, name, v)
    return ops


@pytest.mark.parametrize("two_streams", [False, True])
def test_a_session_runs_in_the_demo_order(small: NumpyOps, two_streams: bool) -> None:
    """Session creation, rounds and teardown: the cache fills, ctx advances by j+1 per round,
    accept reads back once per round and j stays within k."""
    w = GpuWorkload(two_streams=two_streams)
    assert (w.eh is w.e) is not two_streams
    w.cache_alloc(200)
    w.prime(40)
    assert w.ctx == 40
    assert not np.isnan(w._cache[:, :, :40]).any()
    w.capture()
    w.anchor()
    w.draft_alloc(200)
    w.draft_prime(40)
    assert not np.isnan(w._dkv[:, :, :40]).any()
    reads = small.host_reads
    for k in (4, 1, 4, 3):
        ctx = w.ctx
        w.draft(k)
        w.verify(k)
        j = w.accept(k)
        assert 0 <= j <= k
        w.rollback(k, j)
        assert w.ctx == ctx + j + 1
        assert not np.isnan(w._cache[:, :, ctx : w.ctx]).any()
        w.maint()
    assert small.host_reads == reads + 4
    released = small.released  # once after building (nothing cached), once a session
    w.end_session()
    assert w._cache is None and small.released == released + 1


def test_a_full_cache_wraps_instead_of_overflowing(small: NumpyOps) -> None:
    w = GpuWorkload()
    w.cache_alloc(64)
    w.prime(10_000)  # longer than the cache: clipped, a round's rows left
    assert w.ctx <= w._cap - w.KMAX - 1
    w.draft_alloc(64)
    w.draft_prime(10_000)
    for _ in range(40):
        w.draft(4)
        w.verify(4)
        w.rollback(4, w.accept(4))
        w.maint()
        assert w.ctx <= w._cap


def test_a_small_cache_holds_a_whole_round_of_the_longest_k(small: NumpyOps) -> None:
    """``cache_alloc(64)`` made 64 rows; a k = 64 round with every draft accepted commits 65:
    rollback raised (could not broadcast (3,2,65,16) into (3,2,64,16))."""
    w = GpuWorkload()
    w.cache_alloc(64)
    w.prime(10)
    w.draft_alloc(64)
    w.draft_prime(10)
    w.alpha = 1.0
    for _ in range(3):
        w.draft(64)
        w.verify(64)
        j = w.accept(64)
        w.rollback(64, j)
        assert j == 64 and w.ctx <= w._cap


def test_the_demo_loop_runs_it_under_the_observer(small: NumpyOps) -> None:
    """memra_obs.demo.serve_one drives the workload with every phase boundary in place."""
    from memra_obs.demo import DemoConfig, DemoStats, serve_one
    from memra_obs.testing import capture

    w = GpuWorkload()
    cfg = DemoConfig(requests=1, max_tokens=24, k=4)
    with capture(level=1, prof=True, memory=lambda: [(0, 1)]) as cap:
        serve_one(
            cap.observer,
            w,
            random.Random(1),
            cfg,
            "glm5",
            DemoStats(lock=threading.Lock()),
            eager=True,
        )
    assert cap.rounds and cap.first_tokens
    assert cap.first_tokens[0].prof.prime_ms > 0


def test_every_k_the_demo_allows_is_drafted_verified_and_accepted(small: NumpyOps) -> None:
    """`demo --gpu --k 24` recorded k=24 but drafted, verified and accepted 16 at most: a false
    acceptance cliff at position 16."""
    w = GpuWorkload()
    w.cache_alloc(512)
    w.prime(100)
    w.draft_alloc(512)
    w.draft_prime(100)
    w.alpha = 1.0  # every draft accepted
    w.draft(24)
    assert len(w.toks) == 24
    w.verify(24)
    assert w.accept(24) == 24


def test_a_device_error_in_a_loop_ends_the_demo_with_it_not_a_partial_success(
    small: NumpyOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An out-of-memory inside a loop killed that thread with a traceback; the demo then printed
    'done' for a share of the requests and exited 0."""
    from memra_obs.demo import DemoConfig, GpuUnavailable, run_demo
    from memra_obs.testing import capture

    def oom(self: GpuWorkload, ctx: int) -> None:
        raise MemoryError("Out of memory allocating 3,221,225,472 bytes")

    monkeypatch.setattr(GpuWorkload, "cache_alloc", oom)
    with capture(level=0) as cap, pytest.raises(GpuUnavailable, match="loop failed: Out of"):
        run_demo(DemoConfig(requests=4, gpu=True, concurrency=2), cap.observer)


def test_a_device_error_building_the_workloads_is_one_line(
    small: NumpyOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A card too small for the model: the weights do not fit."""
    from memra_obs.demo import DemoConfig, GpuUnavailable, run_demo
    from memra_obs.testing import capture

    calls = [0]
    real = NumpyOps.randn

    def randn(self: NumpyOps, shape: tuple[int, ...], scale: float) -> Any:
        calls[0] += 1
        if calls[0] > 5:  # the sixth weight does not fit
            raise MemoryError("Out of memory allocating 469,762,048 bytes")
        return real(self, shape, scale)

    monkeypatch.setattr(NumpyOps, "randn", randn)
    with capture(level=0) as cap, pytest.raises(GpuUnavailable, match="building the workloads"):
        run_demo(DemoConfig(requests=1, gpu=True, concurrency=2), cap.observer)


def test_concurrent_loops_share_one_copy_of_the_weights(
    small: NumpyOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`demo --gpu --concurrency 64` built 64 copies of the model (1.3 GB each): out of memory
    on an 80 GB H100. A server's requests share one model; so do the demo's loops."""
    from memra_obs.demo import DemoConfig, run_demo
    from memra_obs.testing import capture

    built: list[GpuWorkload] = []
    real = GpuWorkload.__init__

    def init(self: GpuWorkload, *a: Any, **kw: Any) -> None:
        real(self, *a, **kw)
        built.append(self)

    monkeypatch.setattr(GpuWorkload, "__init__", init)
    with capture(level=0) as cap:
        st = run_demo(DemoConfig(requests=4, gpu=True, concurrency=3, max_tokens=16), cap.observer)
    assert st.sessions == 4 and len(built) == 3
    for name in GpuWorkload.WEIGHTS:
        assert len({id(getattr(w, name)) for w in built}) == 1, name
    for own in ("scratch", "h_last", "d_ring", "e"):  # each loop's state and stream are its own
        assert len({id(getattr(w, own)) for w in built}) == 3, own
