"""``PrometheusExporter``: records in, histogram and counter children updated, nothing else.

It runs where every :class:`~memra_obs.export.RecordExporter` runs — the in-process export
worker, or the agent — never on the loop's thread. Per round it does one bisect and a few
integer adds per histogram on children bound once per ``(worker,) family``; rendering waits
for a scrape (:mod:`memra_obs.prom.collector`).

Slow rounds are judged online with the seed's summary rule applied to a sliding window: a
round is slow when its wall exceeds ``slow_factor`` (1.5) times the median wall of the
session's last ``slow_window`` (64, = ``SPEC_PROF_ROUNDS``) rounds, itself included (so a
session's first two rounds never are).

Large batches (the tail's, a backlog) are aggregated per histogram rather than per round:
the batch's rounds are gathered into one column per histogram and each column is counted
with one sort and a bisect per bucket bound it spans (:meth:`Hist.observe_many`), exemplars
taken from each bucket's latest observation. The state afterwards is exactly the one the
round-by-round path leaves (counts, sums, exemplars, slow rounds); small batches (an
in-process worker's few records a stretch) keep the round-by-round path. A producer that
has many rounds at hand can hand over a :class:`RoundBlock` (a burst's rounds laid back to
back) instead of one RoundRecord per round.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable, Sequence
from itertools import accumulate, chain, repeat
from operator import add, gt, sub
from typing import Any, NamedTuple

from prometheus_client import REGISTRY

from ..events import FirstTokenRecord, Record, RoundRecord, SessionEndRecord, SessionRecord
from ..records import FIRST_TOKEN_MS_FIELDS, SPEC_PROF_ROUNDS
from .collector import SpecCollector
from .exposition import fast_collectors, register_fast, unregister_fast
from .families import FirstTokenChildren, LoopChildren, SpecFamilies
from .selfmetrics import SelfMetrics

__all__ = ["PrometheusExporter", "RoundBlock"]

#: ``family`` of rounds whose SessionRecord never arrived (dropped by a full queue).
UNKNOWN_FAMILY = "unknown"

#: Batches with fewer records than this take the round-by-round path.
BULK_MIN = 48


class RoundBlock(NamedTuple):
    """Consecutive rounds of one burst, as columns, laid back to back from
    ``start_ns_mono``: what a producer with many rounds at hand (``memra-obs tail``) gives
    :meth:`PrometheusExporter.export` instead of one :class:`RoundRecord` per round. It
    aggregates exactly as the records :meth:`records` expands it to."""

    session: int
    burst: int
    #: Index (within the session) of the block's first round.
    first: int
    #: Entry of the first round, ns mono; each round starts where the previous one ended.
    start_ns_mono: int
    #: Five columns, one value a round: draft, verify, accept, rollback, maint ns.
    phases: tuple[Sequence[int], ...]
    #: (k, j, ctx, seq_rows) of the first ``len(counts)`` rounds, in order; the other
    #: rounds' counts are unknown (their records: k = j = -1, ctx = seq_rows = 0).
    counts: Sequence[tuple[int, int, int, int]]
    #: The level-2 split of every round, (kda, kda_scan, mla, ffn) ns; None below level 2.
    split_ns: tuple[int, int, int, int] | None

    def record(self, i: int) -> RoundRecord:
        """Round ``i`` of the block as a :class:`RoundRecord`."""
        ph = self.phases
        t0 = self.start_ns_mono + sum(sum(col[:i]) for col in ph)
        t1 = t0 + ph[0][i]
        t2 = t1 + ph[1][i]
        t3 = t2 + ph[2][i]
        t4 = t3 + ph[3][i]
        k, j, ctx, seq = self.counts[i] if i < len(self.counts) else (-1, -1, 0, 0)
        return RoundRecord(
            self.session, self.burst, self.first + i, (t0, t1, t2, t3, t4, t4 + ph[4][i]),
            k, j, ctx, seq, self.split_ns,
        )  # fmt: skip

    def records(self) -> list[RoundRecord]:
        """Every round of the block as a :class:`RoundRecord`."""
        out = []
        t0 = self.start_ns_mono
        counts = self.counts
        nc = len(counts)
        split = self.split_ns
        for i, (d, v, a, r, m) in enumerate(zip(*self.phases, strict=True)):
            t1 = t0 + d
            t2 = t1 + v
            t3 = t2 + a
            t4 = t3 + r
            t5 = t4 + m
            k, j, ctx, seq = counts[i] if i < nc else (-1, -1, 0, 0)
            t = (t0, t1, t2, t3, t4, t5)
            out.append(
                RoundRecord(self.session, self.burst, self.first + i, t, k, j, ctx, seq, split)
            )
            t0 = t5
        return out


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


class _Acc:
    """One export call's rounds of one ``(worker,) family``, gathered per histogram.

    Slots number the rounds in arrival order; ``segs`` says whose they are (a run of
    RoundRecords or a RoundBlock, of one session), so an exemplar is built only for the
    few observations that end up as a bucket's latest. Blocks wait in ``blocks`` and are
    turned into columns all together (:meth:`materialize`), with C-level maps and zips
    instead of a Python step per block."""

    __slots__ = (
        "blocks",
        "cache",
        "cols",
        "ex_any",
        "ex_of",
        "hook",
        "jv",
        "kpos",
        "kv",
        "loop",
        "n",
        "segs",
        "slow",
        "sp",
        "spos",
        "starts",
    )

    def __init__(
        self,
        loop: LoopChildren,
        ex_of: Callable[[_Session, Any], dict[str, str] | None],
        slow: Callable[[_Session, Sequence[int]], None],
        hook: bool,
    ) -> None:
        self.loop = loop
        self.ex_of = ex_of  # (session, round record) -> exemplar labels with the span id
        self.hook = hook  # a round_span_id hook is set: ex_of must see the round
        self.slow = slow  # the slow-round window, fed a session's walls in order
        self.n = 0
        #: wall, draft, verify, accept, rollback, maint: one value per slot.
        self.cols: tuple[list[int], ...] = ([], [], [], [], [], [])
        self.kv: list[int] = []
        self.jv: list[int] = []
        self.kpos: list[int] = []  # the slots of kv/jv (rounds whose counts are known)
        #: kda, kda_scan, mla, rest, ffn of the level-2 rounds, and their slots.
        self.sp: tuple[list[int], ...] = ([], [], [], [], [])
        self.spos: list[int] = []
        self.starts: list[int] = []
        self.segs: list[tuple[int, _Session, Any]] = []
        self.blocks: list[tuple[_Session, RoundBlock]] = []
        self.ex_any = False
        self.cache: dict[int, Any] = {}

    def segment(self, s: _Session, src: Any) -> None:
        self.starts.append(self.n)
        self.segs.append((self.n, s, src))
        if s.ex is not None:
            self.ex_any = True

    def materialize(self) -> None:
        """The waiting blocks into the columns, in order (and their walls through the
        slow-round window, a session's rounds in order)."""
        pend = self.blocks
        if not pend:
            return
        self.blocks = []
        blks = [b for _, b in pend]
        phs = [b.phases for b in blks]
        sizes = [len(p[0]) for p in phs]
        base = self.n
        bases = list(accumulate(sizes, initial=base))
        total = bases.pop() - base
        if not total:
            return
        new = [list(chain.from_iterable(c)) for c in zip(*phs, strict=True)]
        if len(new) != 5 or any(len(col) != total for col in new):
            raise ValueError("a block's phase columns differ in length")
        d, v, a, r, m = new
        walls = list(map(add, map(add, map(add, map(add, d, v), a), r), m))
        cnts = [b.counts for b in blks]
        clens = list(map(len, cnts))
        known = sum(clens)
        if known:
            if any(map(gt, clens, sizes)):
                raise ValueError("a block has more counts than rounds")
            kc, jc, _, qc = zip(*chain.from_iterable(cnts), strict=True)
            if min(kc) < 0:
                raise ValueError("a block's known counts are never negative")
            sums = (sum(kc), sum(jc), sum(qc))
        splits = [b.split_ns for b in blks]
        nosplit = splits.count(None)
        if nosplit < len(blks):
            if nosplit:
                keep = [p for p in range(len(blks)) if splits[p] is not None]
                ssizes = [sizes[p] for p in keep]
                sbases = [bases[p] for p in keep]
                splits = [splits[p] for p in keep]
                vv: Sequence[int] = list(chain.from_iterable(phs[p][1] for p in keep))
            else:
                ssizes, sbases, vv = sizes, bases, v
            kda, scan, mla, ffn = zip(*splits, strict=True)
            rest = list(map(sub, vv, chain.from_iterable(map(repeat, map(add, kda, mla), ssizes))))
            split = (
                *(
                    list(chain.from_iterable(map(repeat, part, ssizes)))
                    for part in (kda, scan, mla)
                ),
                rest,
                list(chain.from_iterable(map(repeat, ffn, ssizes))),
            )
        # -- nothing below raises on values that got this far
        for (s, b), start in zip(pend, bases, strict=True):
            self.starts.append(start)
            self.segs.append((start, s, b))
            if s.ex is not None:
                self.ex_any = True
        cols = self.cols
        cols[0].extend(walls)
        for col, vals in zip(cols[1:], new, strict=True):
            col.extend(vals)
        L = self.loop
        if known:
            self.kv.extend(kc)
            self.jv.extend(jc)
            self.kpos.extend(chain.from_iterable(map(range, bases, map(add, bases, clens))))
            L.drafted_total.v += sums[0]
            L.accepted_total.v += sums[1]
            L.seq_rows.v += sums[2]
        if nosplit < len(blks):
            for col, vals in zip(self.sp, split, strict=True):
                col.extend(vals)
            self.spos.extend(chain.from_iterable(map(range, sbases, map(add, sbases, ssizes))))
        self.n = base + total
        L.rounds.v += total
        # The slow-round window: each run of one session's blocks at once.
        slow = self.slow
        i = 0
        nb = len(pend)
        while i < nb:
            s = pend[i][0]
            j = i + 1
            while j < nb and pend[j][0] is s:
                j += 1
            a0 = bases[i] - base
            slow(s, walls[a0 : (bases[j] - base) if j < nb else total])
            i = j

    def ex_at(self, slot: int) -> tuple[dict[str, str], float] | None:
        """The exemplar (labels, epoch seconds) the round in ``slot`` carries, if any."""
        cache = self.cache
        if slot in cache:
            return cache[slot]  # type: ignore[no-any-return]
        start, s, src = self.segs[bisect_right(self.starts, slot) - 1]
        out: tuple[dict[str, str], float] | None = None
        ex = s.ex
        if ex is not None:
            i = slot - start
            block = type(src) is RoundBlock
            if block:
                t5 = src.start_ns_mono + sum(self.cols[0][start : slot + 1])
            else:
                t5 = src[i].t_ns_mono[5]
            if self.hook and s.rec is not None:  # the round's span, when spans name one
                ex = self.ex_of(s, src.record(i) if block else src[i])
            out = (ex, (t5 + s.off) / 1e9)
        cache[slot] = out
        return out

    def flush(self) -> None:
        self.materialize()
        if not self.n:
            return
        L = self.loop
        exf = self.ex_at if self.ex_any else None
        cols = self.cols
        L.round.observe_many(cols[0], exf)
        for h, vals in zip(L.phases, cols[1:], strict=True):
            h.observe_many(vals, exf)
        if self.kv:
            f = exf if len(self.kpos) == self.n or exf is None else _through(self.kpos, exf)
            L.drafted.observe_many(self.kv, f)
            L.accepted.observe_many(self.jv, f)
        if self.spos:
            f = exf if len(self.spos) == self.n or exf is None else _through(self.spos, exf)
            for h, vals in zip(L.split, self.sp, strict=True):
                h.observe_many(vals, f)


def _through(pos: list[int], f: Callable[[int], Any]) -> Callable[[int], Any]:
    return lambda p: f(pos[p])


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
            RoundBlock: self._block_rounds,
            SessionRecord: self._session,
            FirstTokenRecord: self._first_token,
            SessionEndRecord: self._session_end,
        }
        self.collector = SpecCollector((*self.families.all, *self.self_metrics.all), self._lock)
        self._register()

    # -- RecordExporter ------------------------------------------------------------------

    #: ``export`` takes :class:`RoundBlock` items beside records (``memra-obs tail`` hands
    #: them over when every exporter it feeds does).
    takes_round_blocks = True

    def export(self, batch: Sequence[Record | RoundBlock]) -> None:
        with self._lock:
            if len(batch) < BULK_MIN:
                get = self._dispatch.get
                for rec in batch:
                    handle = get(type(rec))
                    if handle is not None:
                        try:
                            handle(rec)
                        except Exception:
                            self.export_errors += 1
            else:
                self._bulk(batch)

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
        ex = s.ex
        ts = None
        if ex is not None:
            ts = (t5 + s.off) / 1e9
            if self._span_id is not None and s.rec is not None:
                sid = self._span_id(s.rec, r)
                if sid:
                    ex = {**ex, "span_id": format(sid, "016x")}
        wall = t5 - t0
        L.round.observe(wall, ex, ts)
        draft, verify, accept, roll, maint = L.phases
        draft.observe(t1 - t0, ex, ts)
        verify.observe(t2 - t1, ex, ts)
        accept.observe(t3 - t2, ex, ts)
        roll.observe(t4 - t3, ex, ts)
        maint.observe(t5 - t4, ex, ts)
        k = r.k
        if k >= 0:  # k = j = -1: counts unknown (a round rebuilt without its row)
            j = r.j
            L.drafted.observe(k, ex, ts)
            L.accepted.observe(j, ex, ts)
            L.drafted_total.v += k
            L.accepted_total.v += j
            L.seq_rows.v += r.seq_rows
        L.rounds.v += 1
        split = r.split_ns
        if split is not None:
            kda, scan, mla, ffn = split
            sp = L.split or L.bind_split()
            sp[0].observe(kda, ex, ts)
            sp[1].observe(scan, ex, ts)
            sp[2].observe(mla, ex, ts)
            sp[3].observe(t2 - t1 - (kda + mla), ex, ts)  # vrest; observe() saturates at 0
            sp[4].observe(ffn, ex, ts)
        win = s.win
        srt = s.srt
        if len(win) >= self._window:
            del srt[bisect_left(srt, win.popleft())]
        win.append(wall)
        insort(srt, wall)
        if wall > self._factor * srt[len(srt) >> 1]:
            L.slow.v += 1

    def _block_rounds(self, blk: RoundBlock) -> None:
        for r in blk.records():
            self._round(r)

    # -- large batches: one column per histogram (under the lock) ------------------------

    def _bulk(self, batch: Sequence[Any]) -> None:
        accs: dict[int, _Acc] = {}
        sessions = self._sessions
        get = self._dispatch.get
        n = len(batch)
        i = 0
        while i < n:
            rec = batch[i]
            t = type(rec)
            if t is RoundRecord:
                # The session's rounds up to its next record that matters here (burst
                # records, which add nothing, may sit between them).
                sid = rec[0]
                run = [rec]
                j = i + 1
                while j < n:
                    r = batch[j]
                    tr = type(r)
                    if tr is RoundRecord:
                        if r[0] != sid:
                            break
                        run.append(r)
                    elif tr in self._dispatch:
                        break
                    j += 1
                s = sessions.get(sid) or self._orphan(sid)
                try:
                    self._gather_run(self._acc(accs, s), s, run)
                except Exception:  # a malformed record among them: one at a time, in order
                    for a in accs.values():
                        try:
                            a.flush()
                        except Exception:
                            self.export_errors += 1
                    accs.clear()
                    for r in run:
                        try:
                            self._round(r)
                        except Exception:
                            self.export_errors += 1
                i = j
                continue
            if t is RoundBlock:
                s = sessions.get(rec[0]) or self._orphan(rec[0])
                if rec.split_ns is not None and not s.loop.split and rec.phases[0]:
                    s.loop.bind_split()  # now: series appear in the order rounds bind them
                self._acc(accs, s).blocks.append((s, rec))
            else:
                handle = get(t)
                if handle is not None:
                    try:
                        handle(rec)
                    except Exception:
                        self.export_errors += 1
            i += 1
        for a in accs.values():
            try:
                a.flush()
            except Exception:  # a malformed block: its whole family's share of the batch
                self.export_errors += 1

    def _acc(self, accs: dict[int, _Acc], s: _Session) -> _Acc:
        a = accs.get(id(s.loop))
        if a is None:
            a = accs[id(s.loop)] = _Acc(s.loop, self._ex_of, self._slow, self._span_id is not None)
        return a

    def _ex_of(self, s: _Session, r: Any) -> dict[str, str] | None:
        """The exemplar labels of round ``r`` of session ``s`` (with its span, when the
        ``round_span_id`` hook names one)."""
        ex = s.ex
        if ex is not None and self._span_id is not None and s.rec is not None:
            sid = self._span_id(s.rec, r)
            if sid:
                ex = {**ex, "span_id": format(sid, "016x")}
        return ex

    def _gather_run(self, acc: _Acc, s: _Session, run: Sequence[RoundRecord]) -> None:
        """RoundRecords of one session into ``acc``. Everything is computed (and every
        value checked) before anything changes, so a bad record leaves no trace."""
        acc.materialize()  # blocks that came first keep their place
        n = len(run)
        cols = tuple(zip(*run, strict=True))
        tt = tuple(zip(*cols[3], strict=True))
        if len(tt) != 6:
            raise ValueError("t_ns_mono must hold six bounds")
        t0, t1, t2, t3, t4, t5 = tt
        walls = list(map(sub, t5, t0))
        verify = list(map(sub, t2, t1))
        ph = (list(map(sub, t1, t0)), verify, list(map(sub, t3, t2)),
              list(map(sub, t4, t3)), list(map(sub, t5, t4)))  # fmt: skip
        kcol, jcol, seqcol = cols[4], cols[5], cols[7]
        if min(kcol) >= 0:
            kv, jv, known = list(kcol), list(jcol), None
            sums = (sum(kv), sum(jv), sum(seqcol))
        else:  # k = j = -1: counts unknown
            known = [p for p in range(n) if kcol[p] >= 0]
            kv = [kcol[p] for p in known]
            jv = [jcol[p] for p in known]
            sums = (sum(kv), sum(jv), sum(seqcol[p] for p in known))
        spcol = cols[8]
        nosplit = spcol.count(None)
        split: tuple[list[Any], ...] | None = None
        spos: Any = None
        if nosplit < n:
            if nosplit:
                spos = [p for p in range(n) if spcol[p] is not None]
                parts = [spcol[p] for p in spos]
                vv = [verify[p] for p in spos]
            else:
                parts, vv = list(spcol), verify
            kda, scan, mla, ffn = zip(*parts, strict=True)
            rest = list(map(sub, vv, map(add, kda, mla)))  # observe_many saturates at 0
            split = (list(kda), list(scan), list(mla), rest, list(ffn))
        # -- nothing below raises on values that got this far
        base = acc.n
        acc.segment(s, run)
        for col, vals in zip(acc.cols, (walls, *ph), strict=True):
            col.extend(vals)
        if kv:
            acc.kv.extend(kv)
            acc.jv.extend(jv)
            acc.kpos.extend(range(base, base + n) if known is None else [base + p for p in known])
        L = s.loop
        if split is not None:
            if not L.split:
                L.bind_split()
            for col, vals in zip(acc.sp, split, strict=True):
                col.extend(vals)
            acc.spos.extend(range(base, base + n) if spos is None else [base + p for p in spos])
        acc.n = base + n
        L.rounds.v += n
        if kv:
            L.drafted_total.v += sums[0]
            L.accepted_total.v += sums[1]
            L.seq_rows.v += sums[2]
        self._slow(s, walls)

    def _slow(self, s: _Session, walls: Sequence[int]) -> None:
        """The sliding-window slow-round rule over ``walls``, in order."""
        win = s.win
        srt = s.srt
        factor = self._factor
        slow = 0
        room = self._window - len(win)
        if room > 0:  # the window fills: nothing leaves it yet
            head = walls[:room] if len(walls) > room else walls
            for w in head:
                insort(srt, w)
                if w > factor * srt[len(srt) >> 1]:
                    slow += 1
            win.extend(head)
            walls = walls[room:] if len(walls) > room else ()
        if walls:
            pop = win.popleft
            push = win.append
            mid = len(srt) >> 1  # the window stays full: its median's place is fixed
            for w in walls:
                del srt[bisect_left(srt, pop())]
                push(w)
                insort(srt, w)
                if w > factor * srt[mid]:
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
