"""A session (one request) and its bursts: where the loop's boundary marks become records.

A boundary is one clock mark appended to a list (plus the drain the sync clock's contract
asks for); a round end builds one :class:`~memra_obs.timeline.RoundRecord` and hands it to
each sink that wants rounds. Nothing here raises into the loop: misuse is said once
(:mod:`memra_obs.diagnostics`) and the round or call is dropped.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .clock import ProfClock, Stream, now_ns
from .diagnostics import say_once
from .fanout import Fanout, fan
from .records import (
    SPEC_PROF_ROUNDS,
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

__all__ = ["LAP_BUCKETS", "Burst", "Session"]

#: First-token buckets the loop measures with ``Session.lap``, in their natural order.
LAP_BUCKETS = (
    "cache_alloc",
    "sink_alloc",
    "prime",
    "capture",
    "anchor",
    "draft_alloc",
    "draft_prime",
)
_SHARE_FIELDS = frozenset(
    (
        "prime_tap_dtoh_ms",
        "draft_prime_h2d_ms",
        "draft_prime_feat_ms",
        "draft_prime_kv_ms",
        "first_burst_hook_ms",
    )
)
_SET_FIELDS = frozenset(
    ("draft_prime_rows", "draft_prime_chunks", "draft_prime_arm", "draft_kv_mb")
)


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
        self.e = e
        self.eh = eh
        self.level = obs.level
        self.prof: SpecFirstTokenProf | None = SpecFirstTokenProf() if obs.prof else None
        self.log: SpecRoundsLog | None = SpecRoundsLog() if obs.prof else None
        self._clock = obs._clock_factory(e, eh)
        self._rounds = 0
        self._bursts = 0
        self._tokens = 0
        self._ended = False
        self._first_token_sent = False
        self._intervals: list[tuple[str, int, int]] = []
        self._round1: tuple[int, ...] | None = None
        self._prime_end = 0
        self._open_burst: Burst | None = None
        fo = obs._fan
        trace_id, parent = _trace_ids() if fo.wants_trace_ids else (0, 0)
        # Start the profile clock (a drain) before the anchor pair, so every later stamp
        # sits after it.
        self._prof_clock = ProfClock(e, eh) if self.prof is not None else None
        start = self._prof_clock.t_ns_mono if self._prof_clock is not None else now_ns()
        anchor_mono, anchor_epoch = now_ns(), time.time_ns()
        self._last_ns = start
        self.record = SessionRecord(
            session=self.id,
            family=family,
            tag=tag,
            tag_v=tag_v,
            worker=obs.worker,
            start_ns_mono=start,
            anchor_ns_mono=anchor_mono,
            anchor_ns_epoch=anchor_epoch,
            trace_id=trace_id,
            span_id=(random.getrandbits(64) or 1) if fo.wants_trace_ids else 0,
            parent_span_id=parent,
            level=self.level,
            prof=self.prof is not None,
        )
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
                f"lap:{bucket}",
                f"Session.lap({bucket!r}): not a first-token bucket {LAP_BUCKETS}; ignored",
            )
            return 0.0
        # Inside an open round (round 1's drafter prime) the bucket starts at the round's
        # entry; otherwise at the previous boundary of the profile.
        b = self._open_burst
        start = b._t[b._r0] if b is not None and b._r0 >= 0 else self._last_ns
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

    def add(self, **shares_ms: float) -> None:
        """Add ms to share buckets that sit inside others (``prime_tap_dtoh_ms``,
        ``draft_prime_h2d_ms``, ``draft_prime_feat_ms``, ``draft_prime_kv_ms``)."""
        if self.prof is None:
            return
        for name, ms in shares_ms.items():
            if name not in _SHARE_FIELDS:
                say_once(f"add:{name}", f"Session.add({name}=...): not a share bucket; ignored")
                continue
            try:
                setattr(self.prof, name, getattr(self.prof, name) + ms)
            except (TypeError, ValueError) as exc:
                say_once(f"add:{name}:bad", f"Session.add: {exc}; ignored")

    def set(self, **fields: object) -> None:
        """Set the drafter-prime geometry (``draft_prime_rows``, ``draft_prime_chunks``,
        ``draft_prime_arm``, ``draft_kv_mb``)."""
        if self.prof is None:
            return
        for name, v in fields.items():
            if name not in _SET_FIELDS:
                say_once(f"set:{name}", f"Session.set({name}=...): not a geometry field; ignored")
                continue
            try:
                setattr(self.prof, name, v)
            except (TypeError, ValueError) as exc:
                say_once(f"set:{name}:bad", f"Session.set: {exc}; ignored")

    def free_memory(self, point: str) -> list[tuple[int, int]]:
        """Snapshot free device memory per CUDA ordinal into ``free_mb_before`` (``point=
        "before"``: before the trunk cache allocation) or ``free_mb_after`` (after the
        drafter KV allocation)."""
        if self.prof is None:
            return []
        if point not in ("before", "after"):
            say_once(f"mem:{point}", f"Session.free_memory({point!r}): use 'before' or 'after'")
            return []
        snap = self._obs.memory_snapshot()
        setattr(self.prof, f"free_mb_{point}", snap)
        return snap

    # -- bursts --------------------------------------------------------------------------

    def burst(self, k: int) -> Burst:
        """Enter a burst drafting ``k`` tokens per round (the ``k=`` of the phase line)."""
        ranges = self._obs._fan.ranges
        return _RangedBurst(self, k, ranges) if ranges else Burst(self, k)

    def end(self, error: BaseException | str | None = None) -> None:
        """End the session: the round-log summary (with the profile on), then the end record."""
        if self._ended:
            return
        self._ended = True
        fo = self._obs._fan
        log = self.log
        if log is not None and not log.summarized:
            self._summarize(fo, log)
        err = (
            error if isinstance(error, str) else (type(error).__name__ if error is not None else "")
        )
        fan(
            fo.on_session_end,
            "on_session_end",
            SessionEndRecord(self.id, now_ns(), self._rounds, self._bursts, self._tokens, err),
        )

    def __enter__(self) -> Session:
        return self

    def __exit__(self, et: object, ev: BaseException | None, tb: object) -> None:
        self.end(ev)

    def _summarize(self, fo: Fanout, log: SpecRoundsLog) -> None:
        log.summarized = True
        fan(
            fo.on_prof_summary,
            "on_prof_summary",
            ProfSummaryRecord(self.id, log.summary(), log.slow_rounds()),
        )

    def _first_token(self, burst: Burst, start: int, end: int, tokens: int, hook_ns: int) -> None:
        prof = self.prof
        self._first_token_sent = True
        if prof is None:
            return
        prof.first_burst_ms = _ms(end - start)
        prof.first_burst_hook_ms += _ms(hook_ns)
        prof.first_burst_rounds = burst.rounds
        prof.first_burst_tokens = tokens
        iv = self._intervals
        r1 = self._round1
        if r1 is not None:
            d0 = max(r1[0], self._prime_end) if self._prime_end else r1[0]
            bounds = (d0, *r1[1:])
            for name, a, b in zip(
                ("first_draft", "first_verify", "first_accept", "first_roll", "first_maint"),
                bounds,
                bounds[1:],
                strict=False,
            ):
                setattr(prof, name + "_ms", _ms(max(b - a, 0)))
                iv.append((name, a, b))
        iv.append(("first_burst", start, end))
        rec = FirstTokenRecord(self.id, replace(prof), tuple(iv))
        fan(self._obs._fan.on_first_token, "on_first_token", rec)


# ================================================================================== burst


class Burst:
    """A run of rounds between two returns to the caller.

    Boundaries: ``begin_round``, then ``end_draft``, ``end_verify``, ``end_accept``,
    ``end_rollback``, and ``end_round(k, j, ctx)`` closing maintenance. Each is one clock
    mark appended to a list; ``end_round`` turns the six marks into a record.
    """

    __slots__ = (
        "_clock",
        "_ended",
        "_hook_ns",
        "_mark",
        "_pending",
        "_phases",
        "_r0",
        "_s",
        "_split",
        "_t",
        "_tokens",
        "first_round",
        "index",
        "k",
        "rounds",
        "start_ns_mono",
    )

    def __init__(self, s: Session, k: int) -> None:
        self._s = s
        self.k = k
        self.index = s._bursts
        s._bursts += 1
        self.first_round = s._rounds
        self.rounds = 0
        self._clock = s._clock
        self._mark = s._clock.mark
        self._t: list[int] = []
        self._r0 = -1
        self._phases = SpecPhaseNs()
        self._split = [0, 0, 0, 0] if s.level >= 2 else None
        self._pending: list[tuple[int, int, int, int, int, tuple[int, int, int, int] | None]] = []
        self._tokens = 0
        self._hook_ns = 0
        self._ended = False
        self.start_ns_mono = now_ns()
        s._open_burst = self

    # -- the hot path --------------------------------------------------------------------

    def begin_round(self) -> None:
        t = self._t
        self._r0 = len(t)
        t.append(self._mark())

    def end_draft(self) -> None:
        self._t.append(self._mark())

    def end_verify(self) -> None:
        self._t.append(self._mark())

    def end_accept(self) -> None:
        self._t.append(self._mark())

    def end_rollback(self) -> None:
        self._t.append(self._mark())

    def end_round(self, k: int, j: int, ctx: int = 0, seq_rows: int | None = None) -> None:
        """Close maintenance and the round: ``k`` drafted, ``j`` accepted, ``ctx`` trunk rows
        at round entry; ``seq_rows`` defaults to what the walk added to ``SEQ_ROWS``."""
        t = self._t
        t.append(self._mark())
        r0 = self._r0
        if r0 < 0 or len(t) - r0 != 6:
            self._misuse(len(t) - r0 if r0 >= 0 else 0)
            return
        self._r0 = -1
        s = self._s
        if seq_rows is None:
            seq_rows = s._obs.seq_rows.take()
        split = s._obs.verify_split.drain() if self._split is not None else None
        p = (r0, k, j, ctx, seq_rows, split)
        if self._clock.immediate:
            self._finish_round(t[r0 : r0 + 6], *p[1:])
        else:
            self._pending.append(p)

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
            if self._pending:
                settled = self._clock.settle(self._t)
                for r0, k, j, ctx, seq, split in self._pending:
                    self._finish_round(settled[r0 : r0 + 6], k, j, ctx, seq, split)
                self._pending.clear()
        except Exception as exc:
            say_once("settle", f"clock settle failed ({exc!r}); the burst's rounds are dropped")
            self._pending.clear()
        first = not s._first_token_sent
        if tokens is None:
            tokens = self._tokens + (1 if first else 0)
        s._tokens += tokens
        fo = s._obs._fan
        split = self._split
        rec = BurstRecord(
            session=s.id,
            index=self.index,
            k=self.k,
            start_ns_mono=self.start_ns_mono,
            end_ns_mono=end,
            phases=self._phases,
            split_ns=(split[0], split[1], split[2], split[3]) if split is not None else None,
            tokens=tokens,
            hook_ns=self._hook_ns,
            first_round=self.first_round,
        )
        fan(fo.on_burst, "on_burst", rec)
        if first:
            s._first_token(self, self.start_ns_mono, end, tokens, self._hook_ns)
        log = s.log
        if log is not None:
            fresh = log.fresh()
            if fresh:
                fan(
                    fo.on_prof_rows,
                    "on_prof_rows",
                    ProfRowsRecord(s.id, log.printed - len(fresh), tuple(fresh)),
                )
            if not log.wants_more() and not log.summarized:
                s._summarize(fo, log)

    def __enter__(self) -> Burst:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    # -- the rest ------------------------------------------------------------------------

    def _finish_round(
        self,
        b: list[int],
        k: int,
        j: int,
        ctx: int,
        seq_rows: int,
        split: tuple[int, int, int, int] | None,
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
            acc[0] += split[0]  # type: ignore[index]
            acc[1] += split[1]  # type: ignore[index]
            acc[2] += split[2]  # type: ignore[index]
            acc[3] += split[3]  # type: ignore[index]
        index = s._rounds
        s._rounds += 1
        self.rounds += 1
        self._tokens += j + 1
        rec = RoundRecord(
            s.id, self.index, index, (t0, t1, t2, t3, t4, t5), k, j, ctx, seq_rows, split
        )
        fo = s._obs._fan
        if fo.on_round:
            fan(fo.on_round, "on_round", rec)
        log = s.log
        if log is not None:
            if index == 0:
                s._round1 = (t0, t1, t2, t3, t4, t5)
                s.prof.first_round_tokens = j + 1  # type: ignore[union-attr]
            if len(log.rounds) < SPEC_PROF_ROUNDS:
                try:
                    row = round_prof_from_ns(
                        t5 - t0, t1 - t0, t2 - t1, t3 - t2, t5 - t3, k, j, ctx, seq_rows
                    )
                    log.rounds.append(row)
                except (TypeError, ValueError) as exc:
                    say_once("roundprof", f"round log row refused: {exc}")

    def _misuse(self, marks: int) -> None:
        say_once(
            "round-marks",
            f"end_round after {marks} boundary marks (expected begin_round + 4 end_* calls); "
            "rounds with missing boundaries are dropped",
        )
        self._r0 = -1


class _RangedBurst(Burst):
    """A :class:`Burst` that also opens and closes named ranges (NVTX) at each boundary, right
    after the clock's mark: ``spec.burst`` > ``spec.round`` > one range per phase. Chosen per
    burst only when a sink offers a ``range_hook``; the plain Burst's hot path is untouched.
    Tracks its own depth so a misused round never leaves ranges unbalanced."""

    __slots__ = ("_depth", "_ranges")

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
                say_once(f"{id(h)}:push", f"range hook {type(h).__name__}.push raised {exc!r}")

    def _pop_to(self, depth: int) -> None:
        while self._depth > depth:
            self._depth -= 1
            for h in self._ranges:
                try:
                    h.pop()
                except Exception as exc:
                    say_once(f"{id(h)}:pop", f"range hook {type(h).__name__}.pop raised {exc!r}")

    def _next(self, name: str) -> None:
        if self._depth == 3:
            self._pop_to(2)
            self._push(name)

    def begin_round(self) -> None:
        super().begin_round()
        self._pop_to(1)
        self._push("spec.round")
        self._push("spec.draft")

    def end_draft(self) -> None:
        super().end_draft()
        self._next("spec.verify")

    def end_verify(self) -> None:
        super().end_verify()
        self._next("spec.accept")

    def end_accept(self) -> None:
        super().end_accept()
        self._next("spec.rollback")

    def end_rollback(self) -> None:
        super().end_rollback()
        self._next("spec.maint")

    def end_round(self, k: int, j: int, ctx: int = 0, seq_rows: int | None = None) -> None:
        super().end_round(k, j, ctx, seq_rows)
        self._pop_to(1)

    def end(self, tokens: int | None = None) -> None:
        self._pop_to(0)
        super().end(tokens)
