"""On real kernels: where asynchronously queued device time lands under each clock.

(1) sync clock: verify's queued matmuls land in verify; (2) a no-drain control puts them in the
next phase that waits (accept's readback) — so (1) can fail; (3) the event clock's buckets agree
with the sync clock's, on a plain loop and on the spec-shaped GpuWorkload (one and two streams),
while its boundaries do not wait for the device.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from memra_obs.clock import SyncClock
from memra_obs.device.event_clock import EventClock
from memra_obs.testing import capture

PHASES = ("draft", "verify", "accept", "rollback", "maint")
VERIFY_MATMULS = 12


def no_drain(e: Any, eh: Any) -> SyncClock:
    return SyncClock(None, None)


def loop(obs: Any, rig: Any, rounds: int = 4, timed: list[float] | None = None) -> None:
    """draft = 1 big matmul, verify = 12 more (queued, not waited), accept = a readback."""
    with obs.session("gpu", e=rig.e) as s:
        b = s.burst(4)
        for _ in range(rounds):
            b.begin_round()
            rig.heavy(1)
            b.end_draft()
            rig.heavy(VERIFY_MATMULS)
            t0 = time.perf_counter()
            b.end_verify()
            if timed is not None:
                timed.append((time.perf_counter() - t0) * 1e3)
            rig.readback()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=1)
        b.end()


def per_round_ms(rounds: list[Any]) -> dict[str, float]:
    return {
        n: statistics.median(r.phase_ns()[i] for r in rounds) / 1e6 for i, n in enumerate(PHASES)
    }


def test_sync_clock_puts_queued_verify_work_in_verify(rig: Any) -> None:
    """(1) The boundary after verify drains: verify's device time is in verify."""
    dev = rig.device_ms(VERIFY_MATMULS)
    with capture(level=1, clock="sync") as cap:
        loop(cap.observer, rig)
    ms = per_round_ms(cap.rounds)
    print(f"\n[gpu] {rig.x.name} sync: verify work alone {dev:.2f} ms; buckets {ms}")
    assert 0.9 * dev <= ms["verify"] <= 1.15 * dev + 0.5, (dev, ms)
    assert ms["accept"] < 0.1 * dev, (dev, ms)


def test_no_drain_control_moves_it_to_the_next_phase(rig: Any) -> None:
    """(2) Without drains the same work shows up where the loop next waits."""
    dev = rig.device_ms(VERIFY_MATMULS)
    with capture(level=1, clock=no_drain) as cap:
        loop(cap.observer, rig)
    ms = per_round_ms(cap.rounds)
    print(f"\n[gpu] {rig.x.name} no-drain: verify work alone {dev:.2f} ms; buckets {ms}")
    assert ms["verify"] < 0.1 * dev, (dev, ms)
    assert ms["accept"] >= 0.85 * dev, (dev, ms)


def abba(n: int) -> list[tuple[str, str]]:
    """Clock order per iteration, alternating (sync, event), (event, sync), ...: the GPU's
    speed drifts under sustained matmuls (power and clocks), and a fixed order would hand
    that drift to whichever clock runs second."""
    return [("sync", "event") if i % 2 == 0 else ("event", "sync") for i in range(n)]


def test_event_clock_agrees_with_sync_without_waiting(rig: Any) -> None:
    """(3a) Event buckets match the sync clock's; end_verify returns while the GPU is busy."""
    dev = rig.device_ms(VERIFY_MATMULS)
    rounds: dict[str, list[Any]] = {"sync": [], "event": []}
    ratio: dict[str, list[float]] = {"draft": [], "verify": []}  # event / sync, pair by pair
    waits: list[float] = []
    # ~1 s of the loop first: on a machine's first run (a cold H100) the sync clock's pairs
    # ran 5-7% slower than the event clock's (its drains idle the GPU between phases).
    with capture(level=1, clock="sync") as warm:
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            loop(warm.observer, rig, rounds=4)
    for pair in abba(8):
        ms = {}
        for clock in pair:
            with capture(level=1, clock=clock) as cap:
                loop(cap.observer, rig, rounds=2, timed=waits if clock == "event" else None)
            rounds[clock].extend(cap.rounds)
            ms[clock] = per_round_ms(cap.rounds)
        for p in ratio:
            ratio[p].append(ms["event"][p] / ms["sync"][p])
    sync, ev = per_round_ms(rounds["sync"]), per_round_ms(rounds["event"])
    r = {p: statistics.median(v) for p, v in ratio.items()}
    print(
        f"\n[gpu] {rig.x.name} sync {sync}\n[gpu] {rig.x.name} event {ev}\n"
        f"[gpu] event/sync per pair, median {r}\n"
        f"[gpu] event end_verify host ms (median) {statistics.median(waits):.4f} vs {dev:.2f} ms queued"
    )
    # Per adjacent pair: an H100's speed wandered 8% between pairs (power and clocks), both
    # clocks alike, and the means over all pairs then differed by that much.
    assert abs(r["verify"] - 1) <= 0.05, (ratio, sync, ev)
    assert abs(r["draft"] - 1) <= 0.10, (ratio, sync, ev)
    assert ev["accept"] < 0.1 * dev
    assert statistics.median(waits) < 0.5  # a mark records events; it never waits for the device


def spec_bursts(w: Any, obs: Any, bursts: int, rounds: int = 8) -> Any:
    """The demo's round on the GPU workload (k = 4), ``bursts`` bursts in one session;
    returns the session's clock."""
    with obs.session("gpu", e=w.e, eh=w.eh) as s:
        for _ in range(bursts):
            b = s.burst(4)
            for _ in range(rounds):
                b.begin_round()
                w.draft(4)
                b.end_draft()
                w.verify(4)
                b.end_verify()
                j = w.accept(4)
                b.end_accept()
                w.rollback(4, j)
                b.end_rollback()
                w.maint()
                b.end_round(k=4, j=j, ctx=w.ctx)
            b.end()
    return s._clock


@pytest.mark.parametrize("two_streams", [False, True], ids=["e", "e+eh"])
def test_event_clock_matches_sync_on_the_spec_workload(backend: str, two_streams: bool) -> None:
    """(3b) Draft = small matmuls, verify = a large batched pass, accept = a readback: the event
    clock's per-phase shares agree with the sync clock's within a few percent."""
    from memra_obs.device.workload import GpuWorkload

    w = GpuWorkload(backend, two_streams=two_streams)
    w.cache_alloc(8192)
    w.prime(2048)
    w.draft_alloc(8192)
    w.draft_prime(2048)
    w.e.synchronize()
    out: dict[str, list[Any]] = {"sync": [], "event": []}
    with capture(level=1, clock="sync") as warm:
        spec_bursts(w, warm.observer, 4)
    window, walls = [], []
    for pair in abba(12):  # cache depth and GPU speed drift alike for both clocks
        wall = {}
        for clock in pair:
            with capture(level=1, clock=clock) as cap:
                c = spec_bursts(w, cap.observer, 1)
            out[clock].extend(cap.rounds)
            wall[clock] = sum(per_round_ms(cap.rounds).values())
            if clock == "event":
                window.append(c.anchor_window_ns / 1e3)
        walls.append(wall["event"] / wall["sync"])
    w.end_session()
    sync, ev = per_round_ms(out["sync"]), per_round_ms(out["event"])
    ws, we = sum(sync.values()), sum(ev.values())
    share = {n: (100 * sync[n] / ws, 100 * ev[n] / we) for n in PHASES}
    print(
        f"\n[gpu] {backend} spec {'e+eh' if two_streams else 'e'} per-round ms sync {sync} (wall {ws:.3f})"
        f"\n[gpu] {backend} spec {'e+eh' if two_streams else 'e'} per-round ms event {ev} (wall {we:.3f})"
        f"\n[gpu] shares % (sync, event) "
        + " ".join(f"{n}=({a:.1f},{b:.1f})" for n, (a, b) in share.items())
        + f"\n[gpu] event clock anchor window µs (median of bursts) {statistics.median(window):.1f}"
        + f"\n[gpu] event/sync wall per pair, median {statistics.median(walls):.3f}"
    )
    # Absolute times may differ: the sync clock's drains serialize launches behind device work
    # and slow the round (on the H200, CuPy on one stream: verify 5.26 ms sync, 4.76 event).
    # Where the time goes agrees, and the undrained loop is never the slower one: per adjacent
    # pair (one slow stretch of the card, 18% on a whole half once on an H100, is not the clock).
    assert statistics.median(walls) <= 1.05, (walls, sync, ev)
    for n, (a, b) in share.items():
        assert abs(a - b) <= 3.0, (n, share)


def test_event_clock_reuses_its_events_across_sessions(rig: Any) -> None:
    """Steady state allocates no events: a second session on the stream takes the first's pool."""
    with capture(level=1, clock="event") as cap:
        loop(cap.observer, rig, rounds=2)
        c1 = EventClock(rig.e)
        for _ in range(12):
            c1.mark()
        c1.settle([0] * 12)
        pool = c1._lanes[0].pool
        del c1
        c2 = EventClock(rig.e)
        assert c2._lanes[0].pool is pool


def test_event_clock_times_cupys_default_stream() -> None:
    """CuPy's ``Stream.null`` and ``.ptds`` say device_id -1 (the current device's): the event
    clock made its events on "device -1", failed, and kept host stamps (53 ms of queued matmuls
    a mark read 0.35 ms on an H100). Their device time now lands between the marks."""
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.runtime.getDeviceCount():
        pytest.skip("no CUDA device through CuPy")
    a = cupy.ones((4096, 4096), dtype=cupy.float32)
    a @ a  # cuBLAS starts (tens of ms of host time) before any mark: queueing is then fast
    cupy.cuda.Device().synchronize()
    for s in (cupy.cuda.Stream.null, cupy.cuda.Stream.ptds):
        with s:
            c = EventClock(s)
            host = [c.mark()]
            for _ in range(2):
                for _ in range(10):
                    a @ a
                host.append(c.mark())
            dev = c.settle(host)
        gaps = [(dev[i + 1] - dev[i]) / 1e6 for i in range(2)]
        queued = (host[2] - host[0]) / 1e6
        print(f"\n[gpu] cupy {s!r}: device ms between marks {gaps}; host ms to queue {queued:.3f}")
        assert min(gaps) > 1.0 and sum(gaps) > 3 * queued, (gaps, queued)


def test_event_clock_times_an_engines_torch_stream_subclass() -> None:
    """An engine's own ``class EngineStream(torch.cuda.Stream)`` (its module the engine's): read
    off the type alone it was no framework, its ``record_event()`` events had no timing, and
    every round was dropped. Its device time now lands between the marks, as a torch stream's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device through torch")
    EngineStream = type("EngineStream", (torch.cuda.Stream,), {"__module__": "engine.streams"})
    s = EngineStream()
    a = torch.ones((4096, 4096), device="cuda")
    a @ a  # cuBLAS starts before any mark
    torch.cuda.synchronize()
    with (
        capture(level=1, clock="event") as cap,
        cap.observer.session("t", e=s, eh=s) as sess,
        torch.cuda.stream(s),
    ):
        b = sess.burst(4)
        for _ in range(2):
            b.begin_round()
            b.end_draft()
            for _ in range(10):
                a @ a
            b.end_verify()
            b.end_accept()
            b.end_rollback()
            b.end_round(k=4, j=2)
        b.end()
    verify = [(r.t_ns_mono[2] - r.t_ns_mono[1]) / 1e6 for r in cap.rounds]
    print(
        f"\n[gpu] torch subclass {type(s).__module__}: verify ms {verify}, "
        f"dropped {cap.observer.dropped_rounds}"
    )
    assert len(verify) == 2 and cap.observer.dropped_rounds == 0 and min(verify) > 1.0
