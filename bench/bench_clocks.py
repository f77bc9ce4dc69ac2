"""What the phase clocks cost on a GPU. Run on a machine with one (CuPy and/or torch):

    python bench/bench_clocks.py [--backend cupy|torch|all] [--bursts 40]

Prints three tables per backend:

1. cost of one phase boundary (``clock.mark()``) on idle streams — host clock only, the sync
   clock (drain e / e+eh), the event clock (record on e / e+eh) and its settle per burst;
2. the same with the stream busy (a ~0.4 ms matmul just queued): the sync clock blocks for
   the device, the event clock does not;
3. per-round wall of the spec-shaped :class:`memra_obs.device.workload.GpuWorkload` round
   (draft k=4, batched verify, accept readback, rollback, maint) uninstrumented, through the
   no-op observer, and under each clock — overhead against the uninstrumented round — plus
   the sync and event clocks' per-phase buckets side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memra_obs.clock import SyncClock
from memra_obs.device.event_clock import EventClock
from memra_obs.device.workload import GpuWorkload, _ops
from memra_obs.observer import NOOP_OBSERVER, Observer

PHASES = ("draft", "verify", "accept", "rollback", "maint")
BURST_MARKS = 48  # 8 rounds x 6 boundaries


def table(title: str, head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(
            "  ".join(
                str(c).rjust(w) if i else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )


def per_call_us(
    fn: Callable[[], Any], n: int, before: Callable[[], None] | None = None
) -> tuple[float, float]:
    """(median, mean) µs of ``fn`` over ``n`` calls, ``before`` run untimed ahead of each."""
    ts = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3, statistics.fmean(ts) / 1e3


def boundary_costs(x: Any, n: int) -> None:
    e, eh = x.stream(), x.stream()
    with x.on(e):
        a = x.randn((8192, 8192), 0.01)
        b = x.randn((8192, 2048), 0.01)
        c = x.empty((8192, 2048))
    x.synchronize()

    def busy() -> None:
        with x.on(e):
            x.mm(a, b, out=c)

    t_busy = []
    for _ in range(20):
        e.synchronize()
        t0 = time.perf_counter_ns()
        busy()
        e.synchronize()
        t_busy.append(time.perf_counter_ns() - t0)
    busy_us = statistics.median(t_busy) / 1e3

    rows_idle: list[list[str]] = []
    rows_busy: list[list[str]] = []
    cases: list[tuple[str, Any]] = [
        ("host clock only (no stream)", SyncClock(None)),
        ("sync, e", SyncClock(e)),
        ("sync, e+eh", SyncClock(e, eh)),
        ("event, e", EventClock(e)),
        ("event, e+eh", EventClock(e, eh)),
    ]
    for name, clk in cases:
        # warm the event pool and the streams
        for _ in range(BURST_MARKS):
            clk.mark()
        clk.settle([0] * BURST_MARKS)
        med, mean = per_call_us(clk.mark, n)
        settle = ""
        amort = med
        if isinstance(clk, EventClock) and not clk.immediate:
            clk.settle([0] * n)  # drop the marks above
            st = []
            for _ in range(30):
                for _ in range(BURST_MARKS):
                    clk.mark()
                t0 = time.perf_counter_ns()
                clk.settle([0] * BURST_MARKS)
                st.append(time.perf_counter_ns() - t0)
            s_us = statistics.median(st) / 1e3
            settle = f"{s_us:.1f}"
            amort = med + s_us / BURST_MARKS
        rows_idle.append([name, f"{med:.2f}", f"{mean:.2f}", settle, f"{amort:.2f}"])
        bmed, bmean = per_call_us(clk.mark, 200, before=lambda: (e.synchronize(), busy()))
        if isinstance(clk, EventClock) and not clk.immediate:
            clk.settle([0] * 200)
        rows_busy.append([name, f"{bmed:.1f}", f"{bmean:.1f}"])
    table(
        f"1. one phase boundary, idle streams (µs per clock.mark(); {n} calls; settle per {BURST_MARKS}-mark burst)",
        ["clock", "median", "mean", "settle/burst", "per boundary incl. settle"],
        rows_idle,
    )
    table(
        f"2. one phase boundary right after queuing a {busy_us:.0f} µs matmul on e (µs the host spends in mark())",
        ["clock", "median", "mean"],
        rows_busy,
    )


def spec_round(w: Any, b: Any, k: int = 4) -> None:
    b.begin_round()
    w.draft(k)
    b.end_draft()
    w.verify(k)
    b.end_verify()
    j = w.accept(k)
    b.end_accept()
    w.rollback(k, j)
    b.end_rollback()
    w.maint()
    b.end_round(k=k, j=j, ctx=w.ctx)


def bare_round(w: Any, k: int = 4) -> None:
    """The same round with no observer calls at all: the loop as it runs uninstrumented."""
    w.draft(k)
    w.verify(k)
    j = w.accept(k)
    w.rollback(k, j)
    w.maint()


def round_overhead(backend: str, bursts: int, two_streams: bool) -> None:
    w = GpuWorkload(backend, two_streams=two_streams)
    w.cache_alloc(16384)
    w.prime(2048)
    w.draft_alloc(16384)
    w.draft_prime(2048)
    w.e.synchronize()
    rounds = 8
    variants = {
        "uninstrumented": None,
        "no-op observer": NOOP_OBSERVER,
        "sync clock": Observer((), level=1, prof=False, clock="sync"),
        "event clock": Observer((), level=1, prof=False, clock="event"),
    }
    walls: dict[str, list[float]] = {v: [] for v in variants}
    buckets: dict[str, list[tuple[int, ...]]] = {"sync clock": [], "event clock": []}

    def one(name: str, obs: Any) -> None:
        if obs is None:
            w.e.synchronize()
            w.eh.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(rounds):
                bare_round(w)
            w.e.synchronize()
            w.eh.synchronize()
            walls[name].append((time.perf_counter_ns() - t0) / rounds / 1e6)
            return
        s = obs.session("bench", e=w.e, eh=w.eh)
        w.e.synchronize()
        w.eh.synchronize()
        t0 = time.perf_counter_ns()
        b = s.burst(4)
        for _ in range(rounds):
            spec_round(w, b)
        b.end()
        w.e.synchronize()
        w.eh.synchronize()
        walls[name].append((time.perf_counter_ns() - t0) / rounds / 1e6)
        phases = getattr(b, "_phases", None)
        if phases is not None and name in buckets:
            buckets[name].append(
                (phases.draft, phases.verify, phases.accept, phases.roll, phases.maint)
            )
        s.end()

    for _ in range(2):  # warm-up
        for name, obs in variants.items():
            one(name, obs)
    for v in walls:
        walls[v].clear()
    for b in buckets.values():
        b.clear()
    names = list(variants)
    for i in range(bursts):
        # Rotate the order each time: the GPU's speed drifts (power, clocks), and a fixed
        # order would hand that drift to whichever variant runs last.
        for name in names[i % len(names) :] + names[: i % len(names)]:
            one(name, variants[name])
    w.end_session()
    base = statistics.median(walls["uninstrumented"])
    rows = []
    for name, ws in walls.items():
        med = statistics.median(ws)
        rows.append(
            [
                name,
                f"{med:.3f}",
                f"{min(ws):.3f}",
                f"{(med - base) * 1e3:+.1f}",
                f"{100 * (med - base) / base:+.1f}%",
            ]
        )
    streams = "e+eh" if two_streams else "e"
    table(
        f"3. per-round wall, {backend} spec workload on {streams} (k=4, {rounds}-round bursts x {bursts}, drained at burst end)",
        ["variant", "median ms", "min ms", "overhead µs", "overhead"],
        rows,
    )
    rows = []
    for i, ph in enumerate(PHASES):
        sv = statistics.median(x[i] for x in buckets["sync clock"]) / rounds / 1e6
        ev = statistics.median(x[i] for x in buckets["event clock"]) / rounds / 1e6
        d = ev - sv
        rows.append(
            [
                ph,
                f"{sv:.3f}",
                f"{ev:.3f}",
                f"{d * 1e3:+.1f}",
                f"{100 * d / sv:+.1f}%" if sv else "-",
            ]
        )
    table(
        f"   per-phase ms per round (median of bursts), sync vs event clock ({streams})",
        ["phase", "sync", "event", "diff µs", "diff"],
        rows,
    )


def describe(x: Any) -> str:
    try:
        if x.name == "cupy":
            cp = x.m
            props = cp.cuda.runtime.getDeviceProperties(0)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            return f"cupy {cp.__version__}, {name}, runtime {cp.cuda.runtime.runtimeGetVersion()}, driver {cp.cuda.runtime.driverGetVersion()}"
        t = x.m
        return f"torch {t.__version__}, {t.cuda.get_device_name(0)}, CUDA {t.version.cuda}"
    except Exception as exc:
        return f"{x.name} ({exc!r})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--backend", default="cupy", choices=["cupy", "torch", "all"])
    p.add_argument("--bursts", type=int, default=40)
    p.add_argument("--marks", type=int, default=2000)
    args = p.parse_args(argv)
    backends = ["cupy", "torch"] if args.backend == "all" else [args.backend]
    for be in backends:
        x = _ops(be, 0)
        print(f"\n===== {describe(x)} =====", flush=True)
        boundary_costs(x, args.marks)
        round_overhead(be, args.bursts, two_streams=False)
        round_overhead(be, args.bursts, two_streams=True)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
