"""A simulated speculative-decoding worker: the whole instrument on a loop with no GPU.

Device work goes to a :class:`SimStream`, done only with time and waited for only by a drain,
so the clock's drains decide where the milliseconds land, as on a GPU. ``--gpu`` runs real
kernels instead (:class:`memra_obs.device.workload.GpuWorkload`).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from threading import Event, Lock, Thread
from typing import Any

from . import flags
from .device.workload import GpuUnavailable, GpuWorkload, _first_line
from .records import SEQ_ROWS, VERIFY_SPLIT

__all__ = ["DemoConfig", "GpuUnavailable", "SimStream", "SimWorkload", "run_demo"]


class SimStream:
    """A pretend device stream: ``enqueue`` returns at once, ``synchronize`` sleeps it out."""

    def __init__(self) -> None:
        self._busy_until, self._lock = 0.0, Lock()

    def enqueue(self, seconds: float) -> None:
        with self._lock:
            self._busy_until = max(self._busy_until, time.perf_counter()) + seconds

    def synchronize(self) -> None:
        self.record_event().synchronize()  # wait for the work queued so far

    def record_event(self, ev: SimEvent | None = None) -> SimEvent:
        """A timing event (torch's duck API: the event clock runs here too)."""
        ev = ev if ev is not None else SimEvent()
        ev.t = max(self._busy_until, time.perf_counter())
        return ev


@dataclass(slots=True)
class SimEvent:
    """A :class:`SimStream` timing event: ``t``, when the work queued before it completes."""

    t: float = 0.0

    def synchronize(self) -> None:
        if (wait := self.t - time.perf_counter()) > 0:
            time.sleep(wait)

    def elapsed_time(self, end: SimEvent) -> float:
        return (end.t - self.t) * 1e3  # ms, as torch's Event.elapsed_time


@dataclass
class SimDevice:
    """Free memory of a pretend 80 GiB device that sessions allocate from."""

    total_mb: int = 81_559
    used_mb: int = 2_048
    lock: Lock = field(default_factory=Lock)

    def snapshot(self) -> list[tuple[int, int]]:
        with self.lock:
            return [(0, self.total_mb - self.used_mb)]

    def take(self, mb: int) -> int:
        with self.lock:
            self.used_mb = min(self.total_mb, max(0, self.used_mb + mb))
        return mb


class SimWorkload:
    """Varied phase times for one loop, loosely a 30B-class target with a small drafter. A
    workload is ``e``, ``eh`` (the streams the clock drains), ``ctx`` and a method a phase."""

    def __init__(self, rng: random.Random, device: SimDevice, speed: float = 1.0) -> None:
        self.rng, self.dev, self.speed = rng, device, speed
        self.e = self.eh = self.stream = SimStream()
        self.ctx, self.alpha, self._held_mb = 0, 0.7, 0

    def _dev(self, ms: float, host: bool = False) -> None:
        """``ms`` of device work queued on the stream (``host``: of host work, done here)."""
        (time.sleep if host else self.stream.enqueue)(max(ms, 0.0) / self.speed / 1000.0)

    def cache_alloc(self, ctx: int) -> None:
        self._held_mb += self.dev.take(max(64, ctx // 16))
        self._dev(0.3 + ctx / 200_000, host=True)

    def prime(self, prompt_tokens: int) -> None:
        self._dev(2.0 + prompt_tokens * self.rng.uniform(0.010, 0.014))
        self._dev(0.2, host=True)  # full-vocab logits readback
        self.ctx = prompt_tokens
        self.alpha = min(0.95, max(0.2, self.rng.betavariate(7, 3)))  # most speculate well

    def capture(self) -> None:
        self._dev(0.05)

    def anchor(self) -> None:
        self._dev(self.rng.uniform(0.05, 0.15), host=True)

    def draft_alloc(self, ctx: int) -> None:
        self._held_mb += self.dev.take(max(16, ctx // 64))
        self._dev(0.1, host=True)

    def draft_prime(self, prompt_tokens: int) -> None:
        self._dev(0.3 + prompt_tokens * 0.0015)

    def draft(self, k: int) -> None:
        self._dev(k * self.rng.uniform(0.18, 0.26))

    def verify(self, k: int) -> None:
        base = 2.0 + (k + 1) * 0.12 + self.ctx / 40_000
        slow = self.rng.random() < 0.03
        ms = base * (self.rng.uniform(2.2, 3.0) if slow else self.rng.uniform(0.92, 1.12))
        self._dev(ms)
        ns = int(ms / self.speed * 1e6)  # the device time it stands for, as _dev queues it
        kda = int(ns * 0.34)  # level-2 shares: the mixer classes, the FFN inside vrest
        VERIFY_SPLIT.add(kda=kda, kda_scan=int(kda * 0.4), mla=int(ns * 0.21), ffn=int(ns * 0.30))
        if slow:
            SEQ_ROWS.add(k + 1)  # the per-row arm took the rows: the slow path names itself

    def accept(self, k: int) -> int:
        self._dev(0.05)
        self.stream.synchronize()  # the accept walk reads back to the host
        self._dev(0.08, host=True)
        j = 0
        while j < k and self.rng.random() < self.alpha:
            j += 1
        return j

    def rollback(self, k: int, j: int) -> None:
        self._dev(0.04 + 0.01 * (k - j))
        self.ctx += j + 1

    def maint(self) -> None:
        self._dev(self.rng.uniform(0.05, 0.12))

    def end_session(self) -> None:
        self.stream.synchronize()
        self.dev.take(-self._held_mb)
        self._held_mb = 0


@dataclass
class DemoConfig:
    duration_s: float | None = None
    requests: int | None = None
    families: tuple[str, ...] = ("glm5",)
    k: int = 4
    concurrency: int = 1
    seed: int | None = None
    speed: float = 1.0
    gpu: bool = False
    max_tokens: int = 256  # new tokens per request, drawn up to this
    burst_rounds: int = 6  # rounds before the loop returns to its caller


@dataclass
class DemoStats:
    sessions: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    lock: Lock = field(default_factory=Lock)

    def add(self, **counts: int) -> None:
        with self.lock:
            self.__dict__.update({k: getattr(self, k) + n for k, n in counts.items()})


def serve_one(
    obs: Any,
    w: Any,
    rng: random.Random,
    cfg: DemoConfig,
    family: str,
    st: DemoStats,
    eager: bool,
    done: Callable[[], bool] = lambda: False,
) -> None:
    """One request through the instrumented loop, the way a spec worker runs it; ``done()``
    (a stop, the deadline) ends it after the burst in flight."""
    prompt = int(min(32_768, max(32, rng.lognormvariate(math.log(1500), 0.9))))  # chat + long docs
    ctx = prompt + cfg.max_tokens + 64
    want = rng.randint(max(8, cfg.max_tokens // 4), cfg.max_tokens)
    n = Counter(tokens=1)  # the anchor token
    with obs.session(family, e=w.e, eh=w.eh) as s:
        s.free_memory("before")
        w.cache_alloc(ctx)
        s.lap("cache_alloc")
        w.prime(prompt)
        s.lap("prime")
        w.capture()
        s.lap("capture")
        w.anchor()
        s.lap("anchor")
        w.draft_alloc(ctx)
        s.lap("draft_alloc")
        s.free_memory("after")
        s.set(draft_prime_rows=prompt, draft_prime_chunks=-(-prompt // 256))
        s.set(draft_prime_arm="eager", draft_kv_mb=round(ctx * 0.0625, 3))
        while n["tokens"] < want and not done():
            b = s.burst(cfg.k)
            for _ in range(cfg.burst_rounds):
                b.begin_round()
                if not n["rounds"]:
                    w.draft_prime(prompt)
                    s.lap("draft_prime")
                k = cfg.k if rng.random() > 0.1 else rng.randint(1, cfg.k)  # confidence gate
                w.draft(k)
                b.end_draft()
                w.verify(k)
                b.end_verify()
                j = w.accept(k)
                b.end_accept()
                w.rollback(k, j)
                b.end_rollback()
                w.maint()
                b.end_round(k=k, j=j, ctx=w.ctx - (j + 1))
                n.update(rounds=1, drafted=k, accepted=j, tokens=j + 1)
                if eager:
                    with b.hook():  # detext + token sends, inside the burst
                        time.sleep(0.00005)
                if n["tokens"] >= want:
                    break
            b.end()
        w.end_session()
    st.add(sessions=1, **n)


def _seeds(cfg: DemoConfig) -> list[int | None]:
    return [None if cfg.seed is None else cfg.seed + i for i in range(cfg.concurrency)]


def gpu_workloads(cfg: DemoConfig) -> list[GpuWorkload]:
    """``--gpu``'s workloads, one per loop ([] without ``gpu``); no GPU raises
    :class:`GpuUnavailable` (the CLI builds them before the observer: nothing bound, no file)."""
    seeds = _seeds(cfg)
    try:
        gpus = [GpuWorkload(seed=seeds[0])] if cfg.gpu else []
        return gpus + [GpuWorkload(seed=sd, weights_of=gpus[0]) for sd in seeds[1:] if gpus]
    except GpuUnavailable:
        raise
    except Exception as exc:  # out of device memory for --concurrency workloads, a CUDA error
        raise GpuUnavailable(f"--gpu: building the workloads failed: {_first_line(exc)}") from exc


def run_demo(
    cfg: DemoConfig,
    obs: Any,
    *,
    stop: Event | None = None,
    device: SimDevice | None = None,
    gpus: list[GpuWorkload] | None = None,
) -> DemoStats:
    """Run the worker under ``obs`` (whose snapshots read ``device``) until ``duration_s`` /
    ``requests`` / ``stop``; returns counts. ``gpu`` without ``gpus`` builds them first."""
    stop = stop or Event()
    dev = device if device is not None else SimDevice()
    seeds = _seeds(cfg)
    gpus = gpu_workloads(cfg) if gpus is None else gpus
    failed: list[BaseException] = []
    st = DemoStats()
    deadline = time.monotonic() + cfg.duration_s if cfg.duration_s else math.inf
    tickets = iter(range(cfg.requests)) if cfg.requests is not None else itertools.count()
    eager = flags.first_token_eager()

    def done() -> bool:
        return stop.is_set() or time.monotonic() >= deadline

    def loop(i: int) -> None:
        rng = random.Random(seeds[i])
        w = gpus[i] if cfg.gpu else SimWorkload(rng, dev, cfg.speed)
        try:
            for n in itertools.count():
                if done() or next(tickets, -1) < 0:
                    return
                serve_one(obs, w, rng, cfg, cfg.families[n % len(cfg.families)], st, eager, done)
        except Exception as exc:  # a device error: stop every loop, say it in the caller
            failed.append(exc)
            stop.set()

    threads = [Thread(target=loop, args=(i,), daemon=True) for i in range(cfg.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)  # a timeout, so that Ctrl-C is handled meanwhile
    if failed:
        raise GpuUnavailable(f"the demo loop failed: {_first_line(failed[0])}") from failed[0]
    return st


def install_stop_handlers(
    stop: Event, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)
) -> dict[int, Any]:
    """Ctrl-C / SIGTERM end the demo after the bursts in flight (then the flush); a second one
    ends it at once, as its default would. Returns the old handlers."""

    def on(n: int, frame: Any) -> None:
        if stop.is_set():
            signal.signal(n, signal.SIG_DFL)
            os.kill(os.getpid(), n)
            os._exit(128 + n)  # PID 1 (a container's): the kernel ignores a default action
        stop.set()

    return {s: signal.signal(s, on) for s in signals}
