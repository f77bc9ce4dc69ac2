"""A session (one request) and its bursts: where the loop's boundary marks become records.

A boundary is one clock mark (plus the drain the sync clock's contract asks for); a round end
builds one :class:`~memra_obs.timeline.RoundRecord` and hands it to each sink that wants
rounds. Nothing here raises into the loop: every public method is guarded; misuse is said
once (:mod:`memra_obs.diagnostics`), and a round it spoils is dropped and counted in
``Observer.dropped_rounds`` (published as ``memra_obs_dropped_total{signal="rounds"}``).

Each boundary knows its place (``begin_round``, ``end_draft``, ``end_verify``,
``end_accept``, ``end_rollback``, ``end_round``): one out of order drops the round it
belongs to. A burst left open is closed by the session (at the next ``burst()`` and at
``end()``) and published. Marks are kept per round (the sync clock) or per settle (the event
clock settles every :data:`SETTLE_ROUNDS` rounds), so a long burst holds bounded memory.
"""

from __future__ import annotations

import operator
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .analysis import advise
from .clock import ProfClock, Stream, SyncClock, now_ns
from .diagnostics import say_once
from .fanout import Fanout, fan
from .legacy import advice_line
from .records import (
    SPEC_PROF_ROUNDS,
    U16_MAX,
    U32_MAX,
    SpecFirstTokenProf,
    SpecPhaseNs,
    SpecRoundsLog,
    round_prof_from_ns,
)
from .timeline import (
    BurstRecord,
    FirstTokenRecord,
    ProfRowsRecord,
    ProfSummaryRecord,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

if TYPE_CHECKING:
    from .observer import Observer

__all__ = ["LAP_BUCKETS", "SETTLE_ROUNDS", "Burst", "Session"]

#: First-token buckets the loop measures with ``Session.lap``, in their natural order.
LAP_BUCKETS = ("cache_alloc", "sink_alloc", "prime", "capture", "anchor", "draft_alloc")
LAP_BUCKETS += ("draft_prime",)
_SHARES = frozenset(("prime_tap_dtoh_ms", "draft_prime_h2d_ms", "draft_prime_feat_ms"))
_SHARES |= {"draft_prime_kv_ms", "first_burst_hook_ms"}
_GEOMETRY = frozenset(("draft_prime_rows", "draft_prime_chunks", "draft_prime_arm", "draft_kv_mb"))
_ROUND1 = ("first_draft", "first_verify", "first_accept", "first_roll", "first_maint")
#: The event clock settles (one drain) at least every this many rounds of a burst.
SETTLE_ROUNDS = 1024
#: The boundary each call expects before it (-1: no round open), for the misuse messages.
_ORDER = ("begin_round", "end_draft", "end_verify", "end_accept", "end_rollback", "end_round")
_index = operator.index


def _ms(ns: int) -> float:
    return ns / 1e6


def _trace_ids() -> tuple[int, int]:
    """(trace_id, parent span id) of the caller's current span, or a fresh trace."""
    try:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            return ctx.trace_id, ctx.span_id
    except Exception:
        pass
    return random.getrandbits(128) or 1, 0


def _stream(name: str, v: Stream | None) -> Stream | None:
    """A stream the clock can drain (``.synchronize()``), or None after saying why."""
    if v is None or callable(getattr(v, "synchronize", None)):
        return v
    say_once(
        f"stream:{type(v).__name__}",
        f"Observer.session({name}={type(v).__name__}): expected a stream with .synchronize() "
        "(CuPy, torch) or None; this session's boundaries do not drain it",
    )
    return None


class Session:
    """One request: the first-token profile, its bursts, and their rounds.

    Used from one thread (the loop's). ``prof`` is the live :class:`SpecFirstTokenProf`
    (None with the profile off); prefer :meth:`lap`, :meth:`add` and :meth:`set`, which are
    no-ops on a disabled observer.
    """

    def __init__(
        self, obs: Observer, family: str, tag: str, tag_v: str, e: Stream | None, eh: Stream | None
    ) -> None:
        self._obs = obs
        self.id = next(obs._ids)
        self.family = family
        self.e, self.eh = _stream("e", e), _stream("eh", eh)
        self.level = obs.level
        self.prof: SpecFirstTokenProf | None = SpecFirstTokenProf() if obs.prof else None
        self.log: SpecRoundsLog | None = SpecRoundsLog() if obs.prof else None
        try:
            self._clock = obs._clock_factory(self.e, self.eh)
        except Exception as exc:
            say_once("clock", f"the phase clock failed to start ({exc!r}); using the sync clock")
            self._clock = SyncClock(self.e, self.eh)
        #: Which clock times this session's phases (what the advice was fitted from).
        self._clock_name = (
            "host" if self.e is None and self.eh is None
            else "event" if not self._clock.immediate else "sync"
        )  # fmt: skip
        self._rounds = self._bursts = self._tokens = 0
        self._ended = self._first_token_sent = False
        self._intervals: list[tuple[str, int, int]] = []
        self._round1: tuple[int, ...] | None = None
        self._prime_end = 0
        self._open_burst: Burst | None = None
        fo = obs._fan
        trace_id, parent = _trace_ids() if fo.wants_trace_ids else (0, 0)
        # The profile clock starts (a drain) before the anchor pair: later stamps sit after it.
        self._prof_clock = ProfClock(self.e, self.eh) if self.prof is not None else None
        start = self._prof_clock.t_ns_mono if self._prof_clock is not None else now_ns()
        self._last_ns = start
        self.record = SessionRecord(
            self.id, family, tag, tag_v, obs.worker, start, now_ns(), time.time_ns(), trace_id,
            (random.getrandbits(64) or 1) if fo.wants_trace_ids else 0, parent, self.level,
            self.prof is not None,
        )  # fmt: skip
        fan(fo.on_session, "on_session", self.record)

    # -- first-token profile -------------------------------------------------------------

    def lap(self, bucket: str) -> float:
        """Close a first-token bucket (``cache_alloc``, ``prime``, ``draft_prime``, ...):
        drain, and add the ms since the previous boundary to ``prof.<bucket>_ms``.

        Returns the ms (0.0 with the profile off)."""
        pc = self._prof_clock
        if pc is None:
            return 0.0
        if bucket not in LAP_BUCKETS:
            say_once(
                f"lap:{bucket}", f"Session.lap({bucket!r}): not a bucket of {LAP_BUCKETS}; ignored"
            )
            return 0.0
        try:
            # Inside an open round (round 1's drafter prime) the bucket starts at the round's
            # entry; otherwise at the previous boundary of the profile.
            b = self._open_burst
            start = b._t[b._r0] if b is not None and b._at >= 0 else self._last_ns
            pc.t_ns_mono = start
            ms = pc.lap()
            end = pc.t_ns_mono
            self._intervals.append((bucket, start, end))
            self._last_ns = end
            if bucket == "draft_prime":
                self._prime_end = end
            name = bucket + "_ms"
            setattr(self.prof, name, getattr(self.prof, name) + ms)
            return ms
        except Exception as exc:
            say_once(f"lap:{bucket}:error", f"Session.lap({bucket!r}) failed ({exc!r}); ignored")
            return 0.0

    def add(self, **shares_ms: float) -> None:
        """Add ms to share buckets that sit inside others (``prime_tap_dtoh_ms``,
        ``draft_prime_h2d_ms``, ``draft_prime_feat_ms``, ``draft_prime_kv_ms``)."""
        for name, ms in shares_ms.items():
            self._put("add", name, _SHARES, lambda p, n=name, x=ms: getattr(p, n) + x)

    def set(self, **fields: object) -> None:
        """Set the drafter-prime geometry (``draft_prime_rows``, ``draft_prime_chunks``,
        ``draft_prime_arm``, ``draft_kv_mb``)."""
        for name, v in fields.items():
            self._put("set", name, _GEOMETRY, lambda p, x=v: x)

    def _put(self, call: str, name: str, allowed: frozenset[str], value: Any) -> None:
        if self.prof is None:
            return
        if name not in allowed:
            say_once(f"{call}:{name}", f"Session.{call}({name}=...): not one of {sorted(allowed)}")
            return
        try:
            setattr(self.prof, name, value(self.prof))
        except Exception as exc:
            say_once(f"{call}:{name}:bad", f"Session.{call}: {exc}; ignored")

    def free_memory(self, point: str) -> list[tuple[int, int]]:
        """Snapshot free device memory per CUDA ordinal into ``free_mb_before`` (``point=
        "before"``: before the trunk cache allocation) or ``free_mb_after`` (after the
        drafter KV allocation). The snapshot's own time lands in no bucket (the profile's
        ``unattributed_ms`` carries it)."""
        if self.prof is None:
            return []
        if point not in ("before", "after"):
            say_once(f"mem:{point}", f"Session.free_memory({point!r}): use 'before' or 'after'")
            return []
        snap = self._obs.memory_snapshot()
        self._last_ns = max(self._last_ns, now_ns())  # the next bucket starts after it
        try:
            setattr(self.prof, f"free_mb_{point}", snap)
        except (TypeError, ValueError) as exc:
            say_once("mem:bad", f"free-memory snapshot refused ({exc}); recording none")
        return snap

    # -- bursts --------------------------------------------------------------------------

    def burst(self, k: int) -> Burst:
        """Enter a burst drafting ``k`` tokens per round (the ``k=`` of the phase line).
        A burst still open is ended first (and said once): its rounds are not lost."""
        b = self._open_burst
        if b is not None:
            say_once("burst-open", "Session.burst() while the previous burst was not ended: "
                     "ending it now (call Burst.end() when a burst returns)")  # fmt: skip
            b.end()
        ranges = self._obs._fan.ranges
        return _RangedBurst(self, k, ranges) if ranges else Burst(self, k)

    def end(self, error: BaseException | str | None = None) -> None:
        """End the session (an open burst first): the round-log summary with the profile on,
        then the end record."""
        if self._ended:
            return
        b = self._open_burst
        if b is not None:
            say_once("burst-open-end", "Session.end() with a burst not ended: ending it now")
            b.end()
        self._ended = True
        fo = self._obs._fan
        log = self.log
        if log is not None and not log.summarized:
            self._summarize(fo, log)
        err = error if isinstance(error, str) else type(error).__name__ if error else ""
        rec = SessionEndRecord(self.id, now_ns(), self._rounds, self._bursts, self._tokens, err)
        fan(fo.on_session_end, "on_session_end", rec)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, et: object, ev: BaseException | None, tb: object) -> None:
        self.end(ev)

    def _summarize(self, fo: Fanout, log: SpecRoundsLog) -> None:
        log.summarized = True
        try:
            a = advise(log.rounds, clock=self._clock_name)
            advice = advice_line(a) if a is not None else ""
        except Exception as exc:
            say_once("advice", f"the k advisor failed ({exc!r}); no [spec-advice] line")
            advice = ""
        rec = ProfSummaryRecord(self.id, log.summary(), log.slow_rounds(), advice)
        fan(fo.on_prof_summary, "on_prof_summary", rec)

    def _first_token(self, burst: Burst, end: int, tokens: int) -> None:
        prof = self.prof
        self._first_token_sent = True
        if prof is None:
            return
        start = burst.start_ns_mono
        prof.first_burst_ms = _ms(end - start)
        prof.first_burst_hook_ms += _ms(burst._hook_ns)
        prof.first_burst_rounds = burst.rounds
        prof.first_burst_tokens = tokens
        iv = self._intervals
        r1 = self._round1
        if r1 is not None:
            bounds = (max(r1[0], self._prime_end), *r1[1:])
            for name, a, b in zip(_ROUND1, bounds, bounds[1:], strict=False):
                setattr(prof, name + "_ms", _ms(max(b - a, 0)))
                iv.append((name, a, b))
        iv.append(("first_burst", start, end))
        # What no bucket covers (snapshots, burst set-up): the wall from the session's
        # drained start to the first burst's return, less the buckets.
        prof.unattributed_ms = max(_ms(end - self.record.start_ns_mono) - prof.total_ms(), 0.0)
        fan(self._obs._fan.on_first_token, "on_first_token", FirstTokenRecord(
            self.id, replace(prof), tuple(iv)))  # fmt: skip


class Burst:
    """A run of rounds between two returns to the caller.

    Boundaries: ``begin_round``, then ``end_draft``, ``end_verify``, ``end_accept``,
    ``end_rollback``, and ``end_round(k, j, ctx)`` closing maintenance: one clock mark each;
    ``end_round`` turns the round's six marks into a record.
    """

    __slots__ = (
        "_at", "_clock", "_ended", "_hook_ns", "_mark", "_pending", "_phases", "_r0", "_s",
        "_split", "_t", "_tokens", "first_round", "index", "k", "rounds", "start_ns_mono",
    )  # fmt: skip

    def __init__(self, s: Session, k: int) -> None:
        self._s = s
        self.k = k
        self.index = s._bursts
        s._bursts += 1
        self.first_round = s._rounds
        self.rounds = self._tokens = self._hook_ns = 0
        self._clock = s._clock
        self._mark = s._clock.mark
        #: This round's marks (sync clock), or every mark since the last settle (event).
        self._t: list[int] = []
        #: The boundary reached in the open round (an index of _ORDER); -1: none open; -2: the
        #: open round was dropped (its remaining boundaries are ignored until begin_round).
        self._at = -1
        self._r0 = 0  # where the open round's marks start in _t
        self._phases = SpecPhaseNs()
        self._split = [0, 0, 0, 0] if s.level >= 2 else None
        self._pending: list[tuple[int, int, int, int, int, Any]] = []
        self._ended = False
        self.start_ns_mono = now_ns()
        s._open_burst = self

    # -- the hot path --------------------------------------------------------------------

    def begin_round(self) -> None:
        if self._at >= 0:
            self._drop("begin_round")
        if self._clock.immediate:
            self._t = []
        self._at = 0
        self._r0 = len(self._t)
        self._t.append(self._mark())

    def _step(self, at: int) -> None:
        if self._at != at - 1:
            if self._at != -2:
                self._drop(_ORDER[at])
            return
        self._at = at
        self._t.append(self._mark())

    def end_draft(self) -> None:
        self._step(1)

    def end_verify(self) -> None:
        self._step(2)

    def end_accept(self) -> None:
        self._step(3)

    def end_rollback(self) -> None:
        self._step(4)

    def end_round(self, k: int, j: int, ctx: int = 0, seq_rows: int | None = None) -> None:
        """Close maintenance and the round: ``k`` drafted, ``j`` accepted (0 <= j <= k),
        ``ctx`` trunk rows at round entry; ``seq_rows`` defaults to what the walk added to
        ``SEQ_ROWS``. Bad counts drop the round (said once), as missing boundaries do."""
        if self._at != 4:
            if self._at == -2:
                self._at = -1
            else:
                self._drop("end_round")
                self._at = -1
            return
        t = self._t
        t.append(self._mark())
        self._at = -1
        try:
            obs = self._s._obs
            seq = obs.seq_rows.take() if seq_rows is None else _index(seq_rows)
            k, j, ctx = _index(k), _index(j), _index(ctx)
            if not (0 <= j <= k <= U16_MAX and 0 <= ctx <= U32_MAX and 0 <= seq <= U32_MAX):
                raise ValueError
        except (TypeError, ValueError):
            self._drop("end_round", f"k={k!r}, j={j!r}, ctx={ctx!r}, seq_rows={seq_rows!r}")
            self._at = -1
            return
        split = obs.verify_split.drain() if self._split is not None else None
        if self._clock.immediate:
            self._finish_round(t, k, j, ctx, seq, split)
            return
        self._pending.append((self._r0, k, j, ctx, seq, split))
        if len(self._pending) >= SETTLE_ROUNDS:
            self._settle()

    @contextmanager
    def hook(self) -> Iterator[None]:
        """Time the caller's commit hook (detext + token sends) inside this burst."""
        t0 = now_ns()
        try:
            yield
        finally:
            self._hook_ns += now_ns() - t0

    def add_hook_ns(self, ns: int) -> None:
        self._hook_ns += ns

    def end(self, tokens: int | None = None) -> None:
        """Return to the caller: settle the clock, emit the burst (and, after the session's
        first burst, the first-token profile). ``tokens`` defaults to the rounds' tokens
        (plus the anchor token on the first burst)."""
        end = now_ns()
        if self._ended:
            say_once("burst-end", "Burst.end called twice; the second call is ignored")
            return
        self._ended = True
        s = self._s
        if s._open_burst is self:
            s._open_burst = None
        try:
            if self._at >= 0:
                self._drop("end")
            self._settle()
            self._publish(end, tokens)
        except Exception as exc:
            say_once("burst-end-error", f"Burst.end failed ({exc!r}); the burst is dropped")

    def __enter__(self) -> Burst:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    # -- the rest ------------------------------------------------------------------------

    def _settle(self) -> None:
        if not self._pending:
            return
        try:
            settled = self._clock.settle(self._t)
            for r0, k, j, ctx, seq, split in self._pending:
                self._finish_round(settled[r0 : r0 + 6], k, j, ctx, seq, split)
        except Exception as exc:
            say_once("settle", f"clock settle failed ({exc!r}); those rounds are dropped")
            self._s._obs.dropped_rounds += len(self._pending)
        self._pending.clear()
        self._t = []

    def _publish(self, end: int, tokens: int | None) -> None:
        s = self._s
        first = not s._first_token_sent
        if tokens is None:
            tokens = self._tokens + (1 if first else 0)
        s._tokens += tokens
        fo = s._obs._fan
        split = tuple(self._split) if self._split is not None else None
        rec = BurstRecord(s.id, self.index, self.k, self.start_ns_mono, end, self._phases,
                          split, tokens, self._hook_ns, self.first_round)  # type: ignore[arg-type]  # fmt: skip
        fan(fo.on_burst, "on_burst", rec)
        if first:
            s._first_token(self, end, tokens)
        log = s.log
        if log is not None:
            fresh = log.fresh()
            if fresh:
                rows = ProfRowsRecord(s.id, log.printed - len(fresh), tuple(fresh))
                fan(fo.on_prof_rows, "on_prof_rows", rows)
            if not log.wants_more() and not log.summarized:
                s._summarize(fo, log)

    def _finish_round(
        self, b: list[int], k: int, j: int, ctx: int, seq_rows: int, split: Any
    ) -> None:
        s = self._s
        t0, t1, t2, t3, t4, t5 = b
        ph = self._phases
        ph.draft += t1 - t0
        ph.verify += t2 - t1
        ph.accept += t3 - t2
        ph.roll += t4 - t3
        ph.maint += t5 - t4
        ph.rounds += 1
        if split is not None:
            acc = self._split
            for i in range(4):
                acc[i] += split[i]  # type: ignore[index]
        index = s._rounds
        s._rounds += 1
        self.rounds += 1
        self._tokens += j + 1
        t = (t0, t1, t2, t3, t4, t5)
        fo = s._obs._fan
        if fo.on_round:
            rec = RoundRecord(s.id, self.index, index, t, k, j, ctx, seq_rows, split)
            fan(fo.on_round, "on_round", rec)
        log = s.log
        if log is not None:
            if index == 0:
                s._round1 = t
                s.prof.first_round_tokens = j + 1  # type: ignore[union-attr]
            if len(log.rounds) < SPEC_PROF_ROUNDS:
                try:
                    row = round_prof_from_ns(
                        t5 - t0, t1 - t0, t2 - t1, t3 - t2, t5 - t3, k, j, ctx, seq_rows
                    )
                    log.rounds.append(row)
                except (TypeError, ValueError) as exc:
                    say_once("roundprof", f"round log row refused: {exc}")

    def _drop(self, call: str, bad: str = "") -> None:
        """The open round is spoiled: drop it, count it, say so once (per kind of misuse).
        Its remaining boundaries are ignored (``_at`` -2) until the next ``begin_round``; its
        marks, if any, stay where they are (the event clock settles them with the rest)."""
        at = self._at
        self._at = -2
        self._s._obs.dropped_rounds += 1
        if bad:
            say_once("round-counts", f"Burst.end_round({bad}): expected integers with "
                     "0 <= j <= k <= 65535, ctx and seq_rows >= 0; the round is dropped "
                     "(memra_obs_dropped_total{signal=\"rounds\"})")  # fmt: skip
            return
        after = "no open round" if at < 0 else f"{_ORDER[at]}()"
        want = "begin_round()" if at < 0 else f"{_ORDER[at + 1]}()"
        say_once(f"round-order:{call}:{at}", f"Burst.{call}() after {after} (expected {want}); "
                 "the round is dropped (memra_obs_dropped_total{signal=\"rounds\"})")  # fmt: skip


class _RangedBurst(Burst):
    """A :class:`Burst` that also opens and closes named ranges (NVTX) at each boundary, right
    after the clock's mark: ``spec.burst`` > ``spec.round`` > one range per phase. Chosen per
    burst only when a sink offers a ``range_hook``; the plain Burst's hot path is untouched.
    Tracks its own depth so a misused round never leaves ranges unbalanced."""

    __slots__ = ("_depth", "_ranges")
    _NEXT = ("spec.verify", "spec.accept", "spec.rollback", "spec.maint")

    def __init__(self, s: Session, k: int, ranges: tuple[Any, ...]) -> None:
        super().__init__(s, k)
        self._ranges = ranges
        self._depth = 0
        self._push("spec.burst")

    def _push(self, name: str) -> None:
        self._depth += 1
        for h in self._ranges:
            try:
                h.push(name)
            except Exception as exc:
                say_once(f"range:{id(h)}", f"range hook {type(h).__name__} raised {exc!r}")

    def _pop_to(self, depth: int) -> None:
        while self._depth > depth:
            self._depth -= 1
            for h in self._ranges:
                try:
                    h.pop()
                except Exception as exc:
                    say_once(f"range:{id(h)}", f"range hook {type(h).__name__} raised {exc!r}")

    def begin_round(self) -> None:
        super().begin_round()
        self._pop_to(1)
        self._push("spec.round")
        self._push("spec.draft")

    def _step(self, at: int) -> None:
        super()._step(at)
        if self._depth == 3 and self._at == at:
            self._pop_to(2)
            self._push(self._NEXT[at - 1])

    def end_round(self, k: int, j: int, ctx: int = 0, seq_rows: int | None = None) -> None:
        super().end_round(k, j, ctx, seq_rows)
        self._pop_to(1)

    def end(self, tokens: int | None = None) -> None:
        self._pop_to(0)
        super().end(tokens)
