"""``PrometheusExporter``: records in, histogram and counter children updated, nothing else.

It runs where every :class:`~memra_obs.export.RecordExporter` runs — the in-process export
worker, the agent, the tail — never on the loop's thread. Per round it does one bisect and
a few integer adds per histogram on children bound once per ``(worker,) family``; a record
standing for a run of identical rounds (``RoundRecord.repeat``, from the tail) costs the same
as one round. Rendering waits for a scrape (:mod:`memra_obs.prom.collector`).

Slow rounds are judged online with the seed's summary rule applied to a sliding window: a
round is slow when its wall exceeds ``slow_factor`` (1.5) times the median wall of the
session's last ``slow_window`` (64, = ``SPEC_PROF_ROUNDS``) rounds, itself included (so a
session's first two rounds never are).
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import REGISTRY

from ..records import FIRST_TOKEN_MS_FIELDS, SPEC_PROF_ROUNDS
from ..timeline import FirstTokenRecord, Record, RoundRecord, SessionEndRecord, SessionRecord
from .collector import SpecCollector
from .exposition import fast_collectors, register_fast, unregister_fast
from .families import FirstTokenChildren, LoopChildren, SpecFamilies
from .selfmetrics import SelfMetrics

__all__ = ["PrometheusExporter"]

#: ``family`` of rounds whose SessionRecord never arrived (dropped by a full queue).
UNKNOWN_FAMILY = "unknown"


class _Session:
    __slots__ = ("ex", "ft", "loop", "off", "rec", "srt", "win")

    def __init__(
        self,
        rec: SessionRecord | None,
        loop: LoopChildren,
        ft: FirstTokenChildren,
        ex: dict[str, str] | None,
    ) -> None:
        self.rec = rec
        self.loop = loop
        self.ft = ft
        self.ex = ex
        #: epoch_ns - mono_ns of this session's anchor pair (exemplar timestamps).
        self.off = rec.anchor_ns_epoch - rec.anchor_ns_mono if rec is not None else 0
        self.win: deque[int] = deque()  # walls in arrival order
        self.srt: list[int] = []  # the same walls, sorted


class PrometheusExporter:
    """Aggregates the record stream into the DESIGN §5 metrics, served from ``registry``.

    ``registry``: a prometheus_client registry (default: the global ``REGISTRY``).
    ``worker_label``: label every series with ``worker`` (``SessionRecord.worker``, else
    ``worker``) — for the agent, which publishes several workers; off for one in-process
    worker, whose scrape target Prometheus already labels (``instance``).
    ``round_span_id``: optional ``(session, round) -> span id`` of the round's span (0: the
    round has none), added to round exemplars as ``span_id``; exemplars always carry the
    session's ``trace_id`` (when it is non-zero).

    Registering takes over the names from another PrometheusExporter already in
    ``registry`` (an observer being replaced); any other clash raises.
    """

    signal = "metrics"

    def __init__(
        self,
        registry: Any = None,
        *,
        worker: str = "",
        worker_label: bool = False,
        slow_factor: float = 1.5,
        slow_window: int = SPEC_PROF_ROUNDS,
        max_sessions: int = 65536,
        round_span_id: Callable[[SessionRecord, RoundRecord], int] | None = None,
    ) -> None:
        if slow_window < 1:
            raise ValueError(f"slow_window={slow_window}: expected >= 1")
        self.registry = REGISTRY if registry is None else registry
        self.worker = worker
        self.worker_label = worker_label
        #: Records this exporter could not aggregate (published as signal="metrics").
        self.export_errors = 0
        self._factor = slow_factor
        self._window = slow_window
        self._max_sessions = max_sessions
        self._span_id = round_span_id
        self._lock = threading.Lock()
        self.families = SpecFamilies(worker_label)
        self.self_metrics = SelfMetrics()
        self._loops: dict[tuple[str, ...], LoopChildren] = {}
        self._fts: dict[tuple[str, ...], FirstTokenChildren] = {}
        self._sessions: dict[int, _Session] = {}
        self._dispatch: dict[type, Callable[[Any], None]] = {
            RoundRecord: self._round,
            SessionRecord: self._session,
            FirstTokenRecord: self._first_token,
            SessionEndRecord: self._session_end,
        }
        self.collector = SpecCollector((*self.families.all, *self.self_metrics.all), self._lock)
        self._register()

    # -- RecordExporter ------------------------------------------------------------------

    def export(self, batch: Sequence[Record]) -> None:
        get = self._dispatch.get
        with self._lock:
            for rec in batch:
                handle = get(type(rec))
                if handle is not None:
                    try:
                        handle(rec)
                    except Exception:
                        self.export_errors += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True  # nothing buffered: the children are the state

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Nothing to push: the series stay in the registry for a last scrape (a later
        exporter on the same registry takes their names over; :meth:`unregister` frees
        them now)."""

    def unregister(self) -> None:
        """Leave the registry."""
        unregister_fast(self.registry, self.collector)
        try:
            self.registry.unregister(self.collector)
        except KeyError:
            pass  # taken over, or never registered

    # -- wiring --------------------------------------------------------------------------

    def attach_queue(self, qsink: Any) -> None:
        """Publish the queue's drops and its exporters' failures (read at scrape time)."""
        with self._lock:
            self.self_metrics.watch_queue(qsink)

    def watch(self, kind: str, signal: str, read: Callable[[], float]) -> None:
        """Publish any monotonic count as ``memra_obs_{kind}_total{signal}`` (``kind``:
        ``dropped`` or ``errors``), e.g. the agent's ring overruns."""
        with self._lock:
            self.self_metrics.watch(kind, signal, read)

    def render(self, openmetrics: bool = False) -> bytes:
        """This exporter's exposition alone (no ``# EOF``); ``/metrics`` uses it."""
        return self.collector.render(openmetrics).encode()

    def _register(self) -> None:
        reg = self.registry
        try:
            reg.register(self.collector)
        except ValueError:
            for old in fast_collectors(reg):
                if isinstance(old, SpecCollector):
                    unregister_fast(reg, old)
                    try:
                        reg.unregister(old)
                    except KeyError:
                        pass
            reg.register(self.collector)  # still clashing: someone else's metric; raise
        register_fast(reg, self.collector)

    # -- records (under the lock) --------------------------------------------------------

    def _children(self, worker: str, family: str) -> tuple[LoopChildren, FirstTokenChildren]:
        w = (worker,) if self.worker_label else ()
        key = (*w, family)
        loop = self._loops.get(key)
        if loop is None:
            loop = self._loops[key] = LoopChildren(self.families, key)
        ft = self._fts.get(w)
        if ft is None:
            ft = self._fts[w] = FirstTokenChildren(self.families, w)
        return loop, ft

    def _session(self, rec: SessionRecord) -> None:
        loop, ft = self._children(rec.worker or self.worker, rec.family)
        ex = {"trace_id": format(rec.trace_id, "032x")} if rec.trace_id else None
        sessions = self._sessions
        sessions[rec.session] = _Session(rec, loop, ft, ex)
        if len(sessions) > self._max_sessions:  # their end records were dropped
            del sessions[next(iter(sessions))]

    def _orphan(self, session: int) -> _Session:
        loop, ft = self._children(self.worker, UNKNOWN_FAMILY)
        s = self._sessions[session] = _Session(None, loop, ft, None)
        return s

    def _round(self, r: RoundRecord) -> None:
        s = self._sessions.get(r.session) or self._orphan(r.session)
        L = s.loop
        t0, t1, t2, t3, t4, t5 = r.t_ns_mono
        n = r.repeat
        ex = s.ex
        ts = None
        if ex is not None:
            ts = (t5 + (n - 1) * (t5 - t0) + s.off) / 1e9
            if self._span_id is not None and s.rec is not None:
                # a run's exemplar is its last round
                sid = self._span_id(s.rec, r if n == 1 else r._replace(index=r.index + n - 1))
                if sid:
                    ex = {**ex, "span_id": format(sid, "016x")}
        wall = t5 - t0
        L.round.observe(wall, ex, ts, n)
        draft, verify, accept, roll, maint = L.phases
        draft.observe(t1 - t0, ex, ts, n)
        verify.observe(t2 - t1, ex, ts, n)
        accept.observe(t3 - t2, ex, ts, n)
        roll.observe(t4 - t3, ex, ts, n)
        maint.observe(t5 - t4, ex, ts, n)
        k = r.k
        if k >= 0:  # k = j = -1: counts unknown (a round rebuilt without its row)
            j = r.j
            L.drafted.observe(k, ex, ts, n)
            L.accepted.observe(j, ex, ts, n)
            L.drafted_total.v += k * n
            L.accepted_total.v += j * n
            L.seq_rows.v += r.seq_rows * n
        L.rounds.v += n
        split = r.split_ns
        if split is not None:
            kda, scan, mla, ffn = split
            sp = L.split or L.bind_split()
            sp[0].observe(kda, ex, ts, n)
            sp[1].observe(scan, ex, ts, n)
            sp[2].observe(mla, ex, ts, n)
            sp[3].observe(t2 - t1 - (kda + mla), ex, ts, n)  # vrest; observe() saturates at 0
            sp[4].observe(ffn, ex, ts, n)
        self._slow(s, wall, n)

    def _slow(self, s: _Session, wall: int, n: int) -> None:
        """The sliding-window slow-round rule for ``n`` rounds of ``wall``, in order. Once
        the window holds only such rounds, none of the rest is slow (``w > 1.5 w`` never
        holds), so a run costs at most one window of steps."""
        win = s.win
        srt = s.srt
        slow = 0
        for _ in range(min(n, self._window)):
            if len(win) >= self._window:
                del srt[bisect_left(srt, win.popleft())]
            win.append(wall)
            insort(srt, wall)
            if wall > self._factor * srt[len(srt) >> 1]:
                slow += 1
        if slow:
            s.loop.slow.v += slow

    def _first_token(self, rec: FirstTokenRecord) -> None:
        s = self._sessions.get(rec.session) or self._orphan(rec.session)
        ft = s.ft
        prof = rec.prof
        ex = s.ex
        ts = None
        if ex is not None and rec.intervals:
            ts = (max(end for _, _, end in rec.intervals) + s.off) / 1e9
        for i, name in enumerate(FIRST_TOKEN_MS_FIELDS):
            ms = getattr(prof, name)
            if ms > 0.0:
                ft.phase(i).observe(round(ms * 1e6), ex, ts)
        ft.total.observe(round(prof.total_ms() * 1e6), ex, ts)
        for point, snap in (("before", prof.free_mb_before), ("after", prof.free_mb_after)):
            for device, free_mb in snap:
                ft.gpu(device, point).v = free_mb << 20

    def _session_end(self, rec: SessionEndRecord) -> None:
        self._sessions.pop(rec.session, None)
