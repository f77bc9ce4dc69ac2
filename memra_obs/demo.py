"""A simulated speculative-decoding worker: the whole instrument on a loop with no GPU.

Sessions get realistic prompt lengths; session creation runs the first-token phases (cache
alloc, target prime linear in the prompt, boundary draw, drafter state build); then bursts of
rounds draft ``k`` tokens, verify them in one batched pass, accept a prefix (per-token
acceptance drawn per session, so some requests speculate well and some do not), roll back and
maintain the draft source. A few rounds are slow (a verify that takes the per-row arm at
depth). Device work is simulated by :class:`SimStream`: phases *queue* work on it and return,
and the work completes only when the stream is drained — so the clock's drains decide where
the milliseconds land, exactly as on a GPU. ``--gpu`` swaps in real kernels
(:class:`memra_obs.device.workload.GpuWorkload`).
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from .clock import Stream
from .records import SEQ_ROWS, VERIFY_SPLIT

__all__ = ["DemoConfig", "SimStream", "SimWorkload", "Workload", "run_demo"]


class Workload(Protocol):
    """What one worker does at each phase; ``e``/``eh`` are the streams the clock drains."""

    e: Stream | None
    eh: Stream | None

    def cache_alloc(self, ctx: int) -> None: ...
    def prime(self, prompt_tokens: int) -> None: ...
    def capture(self) -> None: ...
    def anchor(self) -> None: ...
    def draft_alloc(self, ctx: int) -> None: ...
    def draft_prime(self, prompt_tokens: int) -> None: ...
    def draft(self, k: int) -> None: ...
    def verify(self, k: int) -> None: ...
    def accept(self, k: int) -> int: ...
    def rollback(self, k: int, j: int) -> None: ...
    def maint(self) -> None: ...
    def end_session(self) -> None: ...


class SimStream:
    """A pretend device stream: ``enqueue`` queues work and returns at once; ``synchronize``
    blocks (releasing the GIL, as a CUDA drain does) until everything queued has run."""

    def __init__(self) -> None:
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def enqueue(self, seconds: float) -> None:
        with self._lock:
            now = time.perf_counter()
            self._busy_until = max(self._busy_until, now) + seconds

    def synchronize(self) -> None:
        wait = self._busy_until - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

    def query(self) -> bool:
        return time.perf_counter() >= self._busy_until

    def record_event(self, ev: SimEvent | None = None) -> SimEvent:
        """Record a timing event (torch's duck API, so ``MEMRA_OBS_CLOCK=event`` works on
        the simulated device too): it completes when the work queued before it does."""
        ev = ev if ev is not None else SimEvent()
        ev.t = max(self._busy_until, time.perf_counter())
        return ev


class SimEvent:
    """A :class:`SimStream` timing event: the moment the work queued before it completes."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def synchronize(self) -> None:
        wait = self.t - time.perf_counter()
        if wait > 0:
            time.sleep(wait)

    def query(self) -> bool:
        return time.perf_counter() >= self.t

    def elapsed_time(self, end: SimEvent) -> float:
        """Milliseconds from this event to ``end`` (as torch's ``Event.elapsed_time``)."""
        return (end.t - self.t) * 1e3


@dataclass
class SimDevice:
    """Free memory of a pretend 80 GiB device that sessions allocate from."""

    total_mb: int = 81_559
    used_mb: int = 2_048
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[tuple[int, int]]:
        with self.lock:
            return [(0, self.total_mb - self.used_mb)]

    def take(self, mb: int) -> None:
        with self.lock:
            self.used_mb = min(self.total_mb, self.used_mb + mb)

    def give(self, mb: int) -> None:
        with self.lock:
            self.used_mb = max(0, self.used_mb - mb)


class SimWorkload:
    """Plausible, varied phase times for one loop thread, on a :class:`SimStream`.

    Times are loosely shaped on a 30B-class target with a small drafter: verify grows with
    context and rows, the prime is linear in the prompt, accept reads back to the host.
    """

    def __init__(self, rng: random.Random, device: SimDevice, speed: float = 1.0) -> None:
        self.rng = rng
        self.dev = device
        self.speed = speed
        self.stream = SimStream()
        self.e: Stream | None = self.stream
        self.eh: Stream | None = self.stream
        self.ctx = 0
        self.alpha = 0.7
        self._held_mb = 0

    def _dev(self, ms: float) -> None:
        self.stream.enqueue(max(ms, 0.0) * self.speed / 1000.0)

    def _host(self, ms: float) -> None:
        time.sleep(max(ms, 0.0) * self.speed / 1000.0)

    def cache_alloc(self, ctx: int) -> None:
        self.ctx = 0
        mb = max(64, ctx // 16)
        self.dev.take(mb)
        self._held_mb += mb
        self._host(0.3 + ctx / 200_000)

    def prime(self, prompt_tokens: int) -> None:
        self._dev(2.0 + prompt_tokens * self.rng.uniform(0.010, 0.014))
        self._host(0.2)  # full-vocab logits readback
        self.ctx = prompt_tokens
        # Per-session acceptance: most requests speculate well, a few poorly.
        self.alpha = min(0.95, max(0.2, self.rng.betavariate(7, 3)))

    def capture(self) -> None:
        self._dev(0.05)

    def anchor(self) -> None:
        self._host(self.rng.uniform(0.05, 0.15))

    def draft_alloc(self, ctx: int) -> None:
        mb = max(16, ctx // 64)
        self.dev.take(mb)
        self._held_mb += mb
        self._host(0.1)

    def draft_prime(self, prompt_tokens: int) -> None:
        self._dev(0.3 + prompt_tokens * 0.0015)

    def draft(self, k: int) -> None:
        self._dev(k * self.rng.uniform(0.18, 0.26))

    def verify(self, k: int) -> None:
        base = 2.0 + (k + 1) * 0.12 + self.ctx / 40_000
        slow = self.rng.random() < 0.03
        ms = base * (self.rng.uniform(2.2, 3.0) if slow else self.rng.uniform(0.92, 1.12))
        self._dev(ms)
        ns = int(ms * 1e6)
        # Level-2 shares of the verify walk: the mixer classes and the FFN inside vrest.
        kda = int(ns * 0.34)
        VERIFY_SPLIT.add(kda=kda, kda_scan=int(kda * 0.4), mla=int(ns * 0.21), ffn=int(ns * 0.30))
        if slow:
            SEQ_ROWS.add(k + 1)  # the per-row arm took the rows: the slow path names itself

    def accept(self, k: int) -> int:
        self._dev(0.05)
        self.stream.synchronize()  # the accept walk reads back to the host
        self._host(0.08)
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
        self.dev.give(self._held_mb)
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
    #: Max new tokens per request (drawn per request up to this).
    max_tokens: int = 256
    #: Rounds per burst (the loop returns to the caller after this many).
    burst_rounds: int = 6


@dataclass
class DemoStats:
    sessions: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _prompt_len(rng: random.Random) -> int:
    # Log-normal around ~1.5k tokens, clipped to [32, 32k]: chat turns plus a long-doc tail.
    return int(min(32_768, max(32, rng.lognormvariate(math.log(1500), 0.9))))


def serve_one(
    obs: Any, w: Any, rng: random.Random, cfg: DemoConfig, family: str, st: DemoStats, eager: bool
) -> None:
    """One request through the instrumented loop, the way a spec worker runs it."""
    prompt = _prompt_len(rng)
    ctx = prompt + cfg.max_tokens + 64
    want = rng.randint(max(8, cfg.max_tokens // 4), cfg.max_tokens)
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
        s.set(
            draft_prime_rows=prompt,
            draft_prime_chunks=-(-prompt // 256),
            draft_prime_arm="eager",
            draft_kv_mb=round(ctx * 0.0625, 3),
        )
        produced = 1  # the anchor token
        first = True
        rounds = drafted = accepted = 0
        while produced < want:
            b = s.burst(cfg.k)
            for _ in range(cfg.burst_rounds):
                b.begin_round()
                if first:
                    w.draft_prime(prompt)
                    s.lap("draft_prime")
                    first = False
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
                produced += j + 1
                rounds += 1
                drafted += k
                accepted += j
                if eager:
                    with b.hook():  # detext + token sends, inside the burst
                        time.sleep(0.00005)
                if produced >= want:
                    break
            b.end()
        w.end_session()
    with st.lock:
        st.sessions += 1
        st.rounds += rounds
        st.drafted += drafted
        st.accepted += accepted
        st.tokens += produced


def run_demo(
    cfg: DemoConfig,
    obs: Any = None,
    *,
    stop: threading.Event | None = None,
    device: SimDevice | None = None,
) -> DemoStats:
    """Run the simulated worker until ``duration_s``/``requests``/``stop``; returns counts.

    ``obs`` defaults to an observer built from the environment; ``device`` is the simulated
    device whose free memory that observer should snapshot (build both with the same one).
    """
    from . import flags

    stop = stop or threading.Event()
    dev = device if device is not None else SimDevice()
    if obs is None:
        from .wiring import build_observer

        obs = build_observer(memory=None if cfg.gpu else dev.snapshot)
    st = DemoStats()
    deadline = time.monotonic() + cfg.duration_s if cfg.duration_s else None
    budget = [cfg.requests]
    lock = threading.Lock()
    eager = flags.first_token_eager()

    def take() -> bool:
        if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
            return False
        with lock:
            if budget[0] is None:
                return True
            if budget[0] <= 0:
                return False
            budget[0] -= 1
            return True

    def loop(i: int) -> None:
        rng = random.Random(None if cfg.seed is None else cfg.seed + i)
        if cfg.gpu:
            from .device.workload import GpuWorkload

            w: Any = GpuWorkload(seed=None if cfg.seed is None else cfg.seed + i)
        else:
            w = SimWorkload(rng, dev, cfg.speed)
        n = 0
        while take():
            serve_one(obs, w, rng, cfg, cfg.families[n % len(cfg.families)], st, eager)
            n += 1

    threads = [
        threading.Thread(target=loop, args=(i,), name=f"demo-loop-{i}", daemon=True)
        for i in range(cfg.concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
    return st


def install_stop_handlers(stop: threading.Event) -> None:
    """Ctrl-C / SIGTERM end the demo after the requests in flight."""

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
