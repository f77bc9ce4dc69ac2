"""``PrometheusExporter``: records in, children updated, off the loop's thread. Slow rounds:
the seed's rule on a sliding window. At most ``max_sessions`` sessions are kept (lost end
records cost no memory) and ``max_families`` families get series."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from prometheus_client import REGISTRY

from ..analysis import MIN_ROUNDS, advise
from ..diagnostics import say_once
from ..records import FIRST_TOKEN_MS_FIELDS, SPEC_PROF_ROUNDS
from ..timeline import FirstTokenRecord, Record, RoundRecord, SessionEndRecord, SessionRecord
from .advice import ADVICE_EVERY_S, MAX_K
from .families import FIRST_TOKEN_PHASES, LoopChildren, spec_families
from .model import SpecCollector

#: ``family`` of rounds whose SessionRecord never arrived (dropped by a full queue), and of
#: sessions of a family past ``max_families``.
UNKNOWN_FAMILY = "unknown"


class _Session:
    __slots__ = ("ex", "loop", "off", "rec", "srt", "w", "win")

    def __init__(self, rec: SessionRecord | None, loop: LoopChildren, w: tuple[str, ...],
                 traced: bool) -> None:  # fmt: skip
        self.rec, self.loop, self.w = rec, loop, w  # w: the worker label value, or ()
        # An exemplar names a trace some backend receives: ours, or the caller's it joined.
        tid = rec.trace_id if rec is not None and (traced or rec.parent_span_id) else 0
        self.ex = {"trace_id": format(tid, "032x")} if tid else None
        #: epoch_ns - mono_ns of the session's anchor pair (exemplar timestamps).
        self.off = rec.anchor_ns_epoch - rec.anchor_ns_mono if rec is not None else 0
        self.win: deque[int] = deque()  # recent walls in arrival order
        self.srt: list[int] = []  # the same, sorted


class PrometheusExporter:
    """The DESIGN §5 metrics in ``registry`` (default the global ``REGISTRY``); an exporter
    already publishing there is taken over, any other name clash raises. ``worker_label``: a
    ``worker`` label on loop series (agent, tail). ``round_span_id``: for round exemplars.
    ``traced=False``: no span exporter runs, so only sessions that joined a caller's trace
    carry exemplars."""

    signal = "metrics"

    def __init__(
        self,
        registry: Any = None,
        *,
        worker: str = "",
        worker_label: bool = False,
        slow_factor: float = 1.5,
        slow_window: int = SPEC_PROF_ROUNDS,
        max_sessions: int = 8192,
        max_families: int = 64,
        round_span_id: Callable[[SessionRecord, RoundRecord], int] | None = None,
        advice_window: int = 2048,
        plain_step_ns: float | None = None,
        traced: bool = True,
    ) -> None:
        if min(slow_window, max_sessions, max_families) < 1 or advice_window < 0:
            raise ValueError("slow_window, max_sessions, max_families >= 1, advice_window >= 0")
        if 0 < advice_window < MIN_ROUNDS:  # advise() would answer None for ever: no gauges
            raise ValueError(
                f"advice_window={advice_window}: 0 or at least MIN_ROUNDS={MIN_ROUNDS}"
            )
        self.registry = REGISTRY if registry is None else registry
        self.worker, self.worker_label = worker, worker_label
        self._factor, self._window, self._max_sessions = slow_factor, slow_window, max_sessions
        self._max_families, self._span_id, self._traced = max_families, round_span_id, traced
        self._advice_window, self._plain_step_ns = advice_window, plain_step_ns
        #: Said once by a forked child, whose parent serves this /metrics (set where it is).
        self.fork_note = self._unserved = ""
        self.families = spec_families(worker_label)
        self._readers: dict[tuple[str, str], list[Callable[[], float]]] = {}
        self._reset()
        self._dispatch: dict[type, Callable[[Any], Any]] = {
            RoundRecord: self._round,
            SessionRecord: lambda rec: self._open(rec.session, rec),
            FirstTokenRecord: self._first_token,
            SessionEndRecord: lambda rec: self._sessions.pop(rec.session, None),
        }
        self.collector = SpecCollector(self.families.values(), self._lock)
        self.collector.register(self.registry)

    def _reset(self) -> None:
        """Series-free state, and a fresh lock (a forked child: the parent's thread may have
        held it)."""
        self._lock = threading.Lock()
        self._loops: dict[tuple[str, ...], LoopChildren] = {}
        self._sessions: dict[int, _Session] = {}
        self._families = set[str]()
        #: Records this exporter could not aggregate (published as signal="metrics").
        self.export_errors = 0
        self._advised = -ADVICE_EVERY_S  # monotonic time of the last advice

    def export(self, batch: Sequence[Record]) -> None:
        if self._unserved and batch:
            say_once(f"fork-metrics:{id(self)}", self._unserved)  # (a grandchild: key spent)
            self._unserved = ""
        get = self._dispatch.get
        with self._lock:
            for rec in batch:
                handle = get(type(rec))
                if handle is not None:
                    try:
                        handle(rec)
                    except Exception as exc:  # (the ExportErrors alert sends one here)
                        self.export_errors += 1
                        say_once(f"prom-record:{type(rec).__name__}", f"/metrics could not "
                                 f"take a {type(rec).__name__} ({type(exc).__name__}); counted in "
                                 'memra_obs_export_errors_total{signal="metrics"}')  # fmt: skip
        self.tick()

    def tick(self) -> None:
        """Advice at most once a second, idle too (its worker ticks): a tail that read its
        backlog, or a loop between requests, publishes the fit of every round it has."""
        if time.monotonic() - self._advised >= ADVICE_EVERY_S:
            self.advise()

    def flush(self, timeout_s: float = 5.0) -> bool:
        self.advise()  # nothing else buffered: the children are the state
        return True

    def advise(self) -> None:
        """Recompute the advisor's gauges of every label set with new rounds (the exporter's
        thread: the loop never waits for it, a scrape only reads the result)."""
        self._advised = time.monotonic()
        with self._lock:
            # A label set with no clock (legacy lines) is fitted as sync; its info series says so.
            advisors = list(self._loops.values())
            work = [(a, a.clock or "sync", w) for a in advisors if (w := a.take()) is not None]
        for a, clock, rounds in work:
            try:
                adv = advise(rounds, max_k=MAX_K, plain_step_ns=self._plain_step_ns, clock=clock)
            except Exception as exc:
                say_once("prom.advice", f"the k advisor failed ({exc!r}); gauges left as they were")
                continue
            with self._lock:
                a.publish(adv)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """The series stay for a last scrape (:meth:`unregister` frees the names now)."""
        self.collector.live = False

    def after_fork(self) -> None:
        """In a forked child: series from zero: the parent's rounds are the parent's to publish
        (else N workers forked from a master each count its warm-up again). The self-metrics
        keep their readers."""
        self._reset()
        self.collector._lock = self._lock
        for f in self.families.values():
            if not f.name.startswith("memra_obs_"):
                f.children.clear()
        # The parent's server thread (and its port) did not come along: said at the child's
        # first records (a child that only execs, or never records, serves no one).
        self._unserved = self.fork_note

    def unregister(self) -> None:
        self.collector.unregister(self.registry)

    def forget(self, worker: str) -> None:
        """Drop a ``worker`` label value's series and state: the agent's exited workers (with
        pids for labels, each restart would add a set that never goes)."""
        if not self.worker_label:
            return
        with self._lock:
            for f in self.families.values():
                if f.labelnames[:1] == ("worker",):
                    f.children = {lv: c for lv, c in f.children.items() if lv[0] != worker}
            self._loops = {key: L for key, L in self._loops.items() if key[0] != worker}
            # Its families no longer count toward max_families (a worker that named one per
            # request made every family after it "unknown" for the agent's life).
            self._families = {key[1] for key in self._loops} - {UNKNOWN_FAMILY}
            self._sessions = {i: s for i, s in self._sessions.items() if s.w != (worker,)}

    def watch(self, kind: str, signal: str, read: Callable[[], float]) -> None:
        """Publish a monotonic count as ``memra_obs_{kind}_total{signal}`` (``kind``:
        ``dropped`` or ``errors``); readers of one signal add up. E.g. the agent's overruns."""
        name = {"dropped": "memra_obs_dropped", "errors": "memra_obs_export_errors"}[kind]
        with self._lock:
            readers = self._readers.setdefault((kind, signal), [])
            readers.append(read)
            self.families[name].child((signal,), lambda: sum(r() for r in readers))

    def attach_queue(self, qsink: Any) -> None:
        self.watch("dropped", "records", lambda: qsink.dropped)
        self.attach_worker(qsink.worker)

    def attach_worker(self, worker: Any) -> None:
        """An export worker's failures and its exporters' int ``dropped_spans`` / ``export_errors``
        (under their ``signal``, else ``spans``): the same self-metrics in every publisher."""
        self.watch("errors", "records", lambda: worker.errors)
        for ex in worker.exporters:
            sig = ex.signal if isinstance(getattr(ex, "signal", None), str) else "spans"
            for attr, kind in (("dropped_spans", "dropped"), ("export_errors", "errors")):
                if isinstance(getattr(ex, attr, None), int):
                    self.watch(kind, sig, partial(getattr, ex, attr))

    def _open(self, sid: int, rec: SessionRecord | None) -> _Session:
        w = ((rec.worker if rec else "") or self.worker,) if self.worker_label else ()
        key = (*w, self._family(rec.family) if rec else UNKNOWN_FAMILY)
        if (loop := self._loops.get(key)) is None:
            loop = self._loops[key] = LoopChildren(self.families, key, self._advice_window)
        if rec is not None and rec.clock:
            loop.clock = rec.clock
        self.families["memra_spec_first_token_seconds"].child(w)  # from the worker's first session
        s = self._sessions[sid] = _Session(rec, loop, w, self._traced)
        over = len(self._sessions) > self._max_sessions  # end records lost, or many open
        if over and self._sessions.pop(next(iter(self._sessions))).rec is not None:
            say_once("prom-open", f"metrics: over {self._max_sessions} sessions open at "
                     "once (or their ends lost); the oldest is forgotten, its later rounds "
                     f"counted under family={UNKNOWN_FAMILY!r}")  # fmt: skip
        return s

    def _family(self, fam: str) -> str:
        """``fam``, or past ``max_families`` new ones (said once) ``unknown``: each family is
        ~200-300 series, and ``session(f"req_{i}")`` made a million (80 MB /metrics, 0.5 GB)."""
        fams = self._families
        if fam not in fams and fam != UNKNOWN_FAMILY:
            if len(fams) >= self._max_families:
                say_once("prom-families", f"metrics: over {self._max_families} "
                         f"families (MEMRA_OBS_MAX_FAMILIES); {fam!r} and every new one are "
                         f"counted under family={UNKNOWN_FAMILY!r}")  # fmt: skip
                return UNKNOWN_FAMILY
            fams.add(fam)
        return fam

    def _round(self, r: RoundRecord) -> None:
        # One unpacking: a NamedTuple's fields read by name are a descriptor call each.
        sid, _, _, t, k, j, _, seq_rows, split_ns, n = r
        s = self._sessions.get(sid) or self._open(sid, None)
        L, ex = s.loop, s.ex
        t0, t1, t2, t3, t4, t5 = t
        ts = None
        if ex is not None:
            ts = (t5 + (n - 1) * (t5 - t0) + s.off) / 1e9  # a run's exemplar is its last round
            if self._span_id is not None and s.rec is not None:
                span = self._span_id(s.rec, r if n == 1 else r._replace(index=r.index + n - 1))
                if span:
                    ex = {**ex, "span_id": format(span, "016x")}
        wall = t5 - t0
        L.round.observe(wall, ex, ts, n)
        draft, verify, accept, roll, maint = L.phases
        draft.observe(t1 - t0, ex, ts, n)
        verify.observe(t2 - t1, ex, ts, n)
        accept.observe(t3 - t2, ex, ts, n)
        roll.observe(t4 - t3, ex, ts, n)
        maint.observe(t5 - t4, ex, ts, n)
        if 0 <= j <= k:  # k = j = -1: counts unknown (a round rebuilt without its row)
            L.drafted.observe(k, ex, ts, n)
            L.accepted.observe(j, ex, ts, n)
            L.seq_rows.v += seq_rows * n
            L.add(r, k, j, n)
        elif k >= 0:  # j outside 0..k, which no loop counts: kept from the advisor's window
            self.export_errors += 1  # (its every refit would fail and freeze the gauges)
            say_once("prom-j", f"a round of {L.lv[-1]!r} accepted j={j} of k={k} drafted (j "
                     "outside 0..k): kept from acceptance and the advice, counted in "
                     'memra_obs_export_errors_total{signal="metrics"}')  # fmt: skip
        if split_ns is not None:
            kda, scan, mla, ffn = split_ns
            sp = L.split or L.bind_split()
            sp[0].observe(kda, ex, ts, n)
            sp[1].observe(scan, ex, ts, n)
            sp[2].observe(mla, ex, ts, n)
            sp[3].observe(t2 - t1 - (kda + mla), ex, ts, n)  # vrest; observe() saturates at 0
            sp[4].observe(ffn, ex, ts, n)
        # Slow rounds: n of wall are a window of steps at most (then w > 1.5 w is false).
        win, srt, top, slow = s.win, s.srt, self._window, 0
        for _ in range(n if n < top else top):  # (not min(): a builtin call costs more)
            if len(win) >= top:
                del srt[bisect_left(srt, win.popleft())]
            win.append(wall)
            insort(srt, wall)
            slow += wall > self._factor * srt[len(srt) >> 1]
        L.slow.v += slow

    def _first_token(self, rec: FirstTokenRecord) -> None:
        s = self._sessions.get(rec.session) or self._open(rec.session, None)
        f, w, prof, ex, ts = self.families, s.w, rec.prof, s.ex, None
        phases, gpu = f["memra_spec_first_token_phase_seconds"], f["memra_gpu_free_bytes"]
        if ex is not None and rec.intervals:
            ts = (max(end for _, _, end in rec.intervals) + s.off) / 1e9
        # Once a session, so label lookups are fine; a phase the route never ran gets no series.
        for name, phase in zip(FIRST_TOKEN_MS_FIELDS, FIRST_TOKEN_PHASES, strict=True):
            if (ms := getattr(prof, name)) > 0.0:
                phases.child((*w, phase)).observe(round(ms * 1e6), ex, ts)
        f["memra_spec_first_token_seconds"].child(w).observe(round(prof.total_ms() * 1e6), ex, ts)
        for point, snap in (("before", prof.free_mb_before), ("after", prof.free_mb_after)):
            now = {(*w, str(device), point): free_mb << 20 for device, free_mb in snap}
            for lv in [lv for lv in gpu.children if lv[-1] == point and lv[:-2] == w]:
                if lv not in now:  # a card this session did not read (lost, skipped): no
                    del gpu.children[lv]  # series, not an older session's free memory
            for lv, free in now.items():
                gpu.child(lv).v = free
