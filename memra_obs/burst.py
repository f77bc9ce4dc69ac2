"""A burst (a run of rounds between two returns to the caller): boundary marks -> round records.

A boundary out of order, a missing one or counts no loop produces drop their round, said once
and counted in ``Observer.dropped_rounds``. Marks are kept per round (sync clock) or per settle
(the event clock settles every :data:`SETTLE_ROUNDS` rounds): a long burst holds bounded memory.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import TYPE_CHECKING, Any

from .clock import now_ns
from .diagnostics import say_once
from .fanout import fan
from .records import SPEC_PROF_ROUNDS, U16_MAX, U32_MAX, U64_MAX, SpecPhaseNs, round_prof_from_ns
from .timeline import BurstRecord, ProfRowsRecord, RoundRecord

if TYPE_CHECKING:
    from .session import Session

__all__ = ["SETTLE_ROUNDS", "Burst", "NoOpBurst"]

#: The event clock settles (one drain) at least every this many rounds of a burst.
SETTLE_ROUNDS = 1024
_NO_SPLIT = (0, 0, 0, 0)
#: An event-clock burst's unsettled marks, dropped rounds' included, stay below this.
_MAX_MARKS = 6 * SETTLE_ROUNDS
#: The boundaries of a round, in order (misuse messages name the one expected).
_ORDER = ("begin_round", "end_draft", "end_verify", "end_accept", "end_rollback", "end_round")
_index = operator.index
_ENDED = -3  # Burst._at after end(): its boundaries are ignored (said once)
#: Per thread: the observer whose burst ran on it last (weakly). What the walk added to SEQ_ROWS and
#: VERIFY_SPLIT before this thread's first burst of an observer belongs to no round of it
#: (the no-op observer's rounds, or a level below 2, never drain them).
_drained_for = threading.local()


_NULL = nullcontext()  # reusable: one shared no-op hook


class NoOpBurst:
    """Everything off, or a burst that cannot be recorded: a no-op per boundary, each taking
    what the real one takes, no more (a call written with everything off raised TypeError
    into the loop once telemetry was on)."""

    __slots__ = ()
    rounds = k = 0

    def begin_round(self) -> None: ...

    end_draft = end_verify = end_accept = end_rollback = begin_round

    def end_round(
        self, k: int | None = None, j: int | None = None, ctx: int = 0, seq_rows: int | None = None
    ) -> None: ...

    def end(self, tokens: int | None = None) -> None: ...

    def __exit__(self, et: object, ev: BaseException | None, tb: object) -> None: ...

    def hook(self) -> nullcontext[None]:
        return _NULL

    def __enter__(self) -> NoOpBurst:
        return self


_NOOP_BURST = NoOpBurst()


def _discard(self: Burst | _DiscardingBurst, *args: object, **kw: object) -> None:
    """A round nothing records: what its walk added to SEQ_ROWS and (level 2) the verify
    split goes with it, not to the next recorded round."""
    self._obs.seq_rows.take()
    if self._split is not None:
        self._obs.verify_split.drain()


class _DiscardingBurst(NoOpBurst):
    """A burst a live session cannot record: each round's walk is discarded at ``end_round``,
    and at ``end_verify`` (its walk so far: another asyncio task's round must not take it)."""

    __slots__ = ("_obs", "_split")

    def __init__(self, obs: Any, level2: bool) -> None:
        self._obs, self._split = obs, () if level2 else None

    end_round = end_verify = _discard


class Burst:
    """A run of rounds between two returns to the caller: ``begin_round``, ``end_draft``,
    ``end_verify``, ``end_accept``, ``end_rollback``, ``end_round(k, j, ctx)`` (closing
    maintenance), one clock mark each."""

    __slots__ = (
        "_at", "_clock", "_cut", "_ended", "_hook_ns", "_mark", "_obs", "_pending", "_phases", "_r0",
        "_s", "_seq", "_split", "_t", "_tokens", "_vsplit", "first_round", "index", "k", "rounds",
        "start_ns_mono",
    )  # fmt: skip

    def __init__(self, s: Session, k: int) -> None:
        self._s = s
        self._obs = obs = s._obs
        last = getattr(_drained_for, "obs", None)
        if last is None or last() is not obs:  # a weak reference: the observer may go
            _drained_for.obs = weakref.ref(obs)
            obs.seq_rows.take()
            obs.verify_split.drain()
        self.k = k
        self.index = s._bursts
        s._bursts += 1
        self.first_round = s._rounds
        self.rounds = self._tokens = self._hook_ns = 0
        self._clock = s._clock
        self._mark = s._clock.mark
        #: This round's marks (sync clock), or every mark since the last settle (event).
        self._t: list[int] = []
        #: The open round's last boundary (an index of _ORDER); -1: none open; -2: dropped.
        self._at = -1
        self._r0 = 0  # where the open round's marks start in _t
        self._phases = SpecPhaseNs()
        self._split = [0, 0, 0, 0] if s.level >= 2 else None
        #: What the open round's verify walk added to SEQ_ROWS and the split, at end_verify.
        self._seq, self._vsplit = 0, _NO_SPLIT
        self._pending: list[tuple[int, int, int, int, int, Any]] = []
        self._ended = self._cut = False
        self.start_ns_mono = now_ns()

    def begin_round(self) -> None:
        if self._at != -1 and self._at != -2:  # a round left open, or the burst ended
            if self._at == _ENDED:
                say_once("burst-ended", "a Burst's boundaries after its end(): ignored; a new "
                         "burst is Session.burst(k)")  # fmt: skip
                return
            self._drop("begin_round")
        if self._clock.immediate:
            self._t = []
        self._at = 0
        self._r0 = len(self._t)
        self._t.append(self._mark())

    def _step(self, at: int) -> None:
        if self._at != at - 1:
            if self._at >= -1:
                self._drop(_ORDER[at])
            return
        self._at = at
        self._t.append(self._mark())

    def end_draft(self) -> None:
        self._step(1)

    def end_verify(self) -> None:
        """Close verify and take what its walk added to SEQ_ROWS and the level-2 split for this
        round: asyncio tasks share their thread's sets, so after an ``await`` before
        ``end_round`` another task's round would take them."""
        if self._at != 1:
            self._step(2)
            if self._at < -1:  # a dropped round, or the burst ended: its walk goes with it
                self._discard()
            return
        self._at = 2
        self._t.append(self._mark())
        obs = self._obs
        self._seq = obs.seq_rows.take()
        if self._split is not None:
            self._vsplit = obs.verify_split.drain()

    def end_accept(self) -> None:
        self._step(3)

    def end_rollback(self) -> None:
        self._step(4)

    def end_round(
        self, k: int | None = None, j: int | None = None, ctx: int = 0, seq_rows: int | None = None
    ) -> None:
        """Close the round: ``k`` drafted, ``j`` accepted (0 <= j <= k), ``ctx`` trunk rows at
        entry; ``seq_rows`` defaults to what the walk added to ``SEQ_ROWS``. A count left out
        is None (as with the no-op burst, it never raises): the round is dropped, said once."""
        if self._at != 4:
            if self._at == _ENDED:
                self._discard()
                return
            if self._at != -2:
                self._drop("end_round")
            else:  # what the dropped round's walk added after the drop goes with it too
                self._discard()
            self._at = -1
            return
        t = self._t
        self._at = -1  # before the mark: a ranged burst's mark reads it as "the round closed"
        t.append(self._mark())
        if self._ended:  # a cancel ended the session while the mark drained: the cut round
            self._obs.dropped_rounds += 1  # is dropped and counted, not published after its
            self._discard()  # session's end (family "unknown" on /metrics, no span)
            return
        try:
            obs = self._obs
            seq = self._seq + obs.seq_rows.take() if seq_rows is None else _index(seq_rows)
            k, j, ctx = _index(k), _index(j), _index(ctx)  # type: ignore[arg-type]  # None: drop
            if not (0 <= j <= k <= U16_MAX and 0 <= ctx <= U32_MAX and 0 <= seq <= U32_MAX):
                raise ValueError
        except (TypeError, ValueError):
            bad = f"k={k!r}, j={j!r}, ctx={ctx!r}, seq_rows={seq_rows!r}"
            self._drop("end_round", bad, "left out" if any(x is None for x in (k, j, ctx)) else "")
            self._at = -1
            return
        split: tuple[int, ...] | None = None
        if self._split is not None:
            split, late = self._vsplit, obs.verify_split.drain()
            if late != _NO_SPLIT:  # what the walk added after verify too (no await before)
                split = tuple((a + b) & U64_MAX for a, b in zip(split, late, strict=True))
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

    def end(self, tokens: int | None = None) -> None:
        """Return to the caller: settle the clock, emit the burst (and after the first, the
        first-token profile). ``tokens`` defaults to the rounds' (+1 anchor on the first)."""
        end = now_ns()
        if self._ended:
            if not self._cut:  # (cut: ended by a cancel from another thread, not misuse)
                say_once("burst-end", "Burst.end called twice; the second call is ignored")
            return
        s = self._s
        if s._parents():
            return
        self._ended = True
        if s._open_burst is self:
            s._open_burst = None
        given = tokens
        try:
            tokens = None if tokens is None else _index(tokens) if 0 <= tokens <= U64_MAX else -1
        except Exception:  # a float, an array: anything the loop passes, never raised
            tokens = -1
        if tokens == -1:
            say_once("burst-tokens", f"Burst.end(tokens={given!r}): expected an int in 0.."
                     f"{U64_MAX} (the seed's usize); counting the rounds' tokens instead")  # fmt: skip
            tokens = None
        try:
            if self._at >= 0:
                self._drop("end")
            self._at = _ENDED
            # settled device time (event clock) can run past the host stamp: the burst holds it
            end = max(end, self._settle())
            self._publish(end, tokens)
        except Exception as exc:
            say_once("burst-end-error", f"Burst.end failed ({exc!r}); the rest is dropped")

    def __enter__(self) -> Burst:
        return self

    def __exit__(self, et: object, ev: BaseException | None, tb: object) -> None:
        if ev is not None:
            self._abort()
        self.end()

    def _abort(self) -> None:
        """An exception left the burst: its open round dropped and counted, unsaid (no misuse)."""
        if self._s._parents():  # (a forked child's copy: the parent counts its own)
            return
        self._cut = True
        if self._at >= 0:
            self._lose()

    def _disown(self) -> None:
        """A forked child's copy of its parent's open burst: ended here, unpublished."""
        self._ended = self._cut = True

    def _lose(self) -> None:
        """Drop the round: its remaining boundaries are ignored until ``begin_round``. The
        event clock's marks of rounds dropped one after another go at a bound (a burst that
        drops every round would otherwise keep them all until its end)."""
        self._at = -2
        self._obs.dropped_rounds += 1
        self._discard()
        if len(self._t) >= _MAX_MARKS:
            if self._pending:
                self._settle()
            else:  # marks no round will read: dropped (the event clock's count of them too)
                self._forget()

    def _forget(self) -> None:
        """Drop the marks no round reads, and the clock's count of them (a failing clock's
        settle is its own next settle's to say: nothing raises into the loop)."""
        self._t = []
        with suppress(Exception):
            self._clock.settle([])

    def _settle(self) -> int:
        """Settle the pending rounds; the last settled stamp (0: none). A clock that fails to
        settle leaves the rounds their host stamps (a stream it cannot time), said once."""
        if not self._pending:
            if self._t and not self._clock.immediate:  # only dropped rounds' marks
                self._forget()
            return 0
        last = done = 0
        try:
            settled = self._clock.settle(self._t)
        except Exception as exc:
            say_once("settle", f"clock settle failed ({exc!r}); those rounds keep host stamps")
            settled = self._t
        try:
            for r0, k, j, ctx, seq, split in self._pending:
                self._finish_round(settled[r0 : r0 + 6], k, j, ctx, seq, split)
                done += 1
            last = settled[-1]
        except Exception as exc:  # the rounds before the failing one are out: not dropped
            say_once("finish", f"finishing rounds failed ({exc!r}); those rounds are dropped")
            self._obs.dropped_rounds += len(self._pending) - done
        self._pending.clear()
        self._t = []
        return last

    def _publish(self, end: int, tokens: int | None) -> None:
        s = self._s
        ph = self._phases.phases()
        s._phase_ns = [(a + b) & U64_MAX for a, b in zip(s._phase_ns, ph, strict=True)]
        # A first burst cut before any round (a cancel, an OOM) sent no token: no TTFT, no
        # anchor token; the session's next burst, if any, is its first.
        first = not s._first_token_sent and not (self._cut and not self.rounds)
        if tokens is None:
            tokens = self._tokens + (1 if first else 0)
        s._tokens += tokens
        fo = self._obs._fan
        # u64 sums wrap, as the seed's fetch_add: a split past 2**64 is not a refused record
        split = tuple(x & U64_MAX for x in self._split) if self._split is not None else None
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
        ph = self._phases  # u64 sums wrap, as the seed's fetch_add
        ph.draft = (ph.draft + t1 - t0) & U64_MAX
        ph.verify = (ph.verify + t2 - t1) & U64_MAX
        ph.accept = (ph.accept + t3 - t2) & U64_MAX
        ph.roll = (ph.roll + t4 - t3) & U64_MAX
        ph.maint = (ph.maint + t5 - t4) & U64_MAX
        ph.rounds += 1
        if split is not None:
            acc = self._split
            for i in range(4):
                acc[i] += split[i]  # type: ignore[index]
        index = s._rounds
        s._rounds += 1
        self.rounds += 1
        self._tokens += j + 1
        s._ks.append(k)  # a k = 0 round is no spec step: spec_decode_record skips it
        s._js.append(j)
        t = (t0, t1, t2, t3, t4, t5)
        fo = self._obs._fan
        if fo.on_round:
            rec = RoundRecord(s.id, self.index, index, t, k, j, ctx, seq_rows, split)
            fan(fo.on_round, "on_round", rec)
        log = s.log
        if log is not None:
            if index == 0 and not s._first_token_sent:  # a first burst of no round closed it
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

    def _drop(self, call: str, bad: str = "", kind: str = "") -> None:
        """Drop the open round, count it, say so once per kind of misuse (counts left out and
        counts out of range apart); its remaining boundaries are ignored until ``begin_round``
        (its marks settle with the rest)."""
        at = self._at
        self._lose()
        if bad:
            say_once(f"round-counts{kind}", f"Burst.end_round({bad}): expected integers with "
                     "0 <= j <= k <= 65535, ctx and seq_rows in 0..4294967295; the round is "
                     "dropped (memra_obs_dropped_total{signal=\"rounds\"})")  # fmt: skip
            return
        after = "no open round" if at < 0 else f"{_ORDER[at]}()"
        want = "begin_round()" if at < 0 else f"{_ORDER[at + 1]}()"
        say_once(f"round-order:{call}:{at}", f"Burst.{call}() after {after} (expected {want}); "
                 "the round is dropped (memra_obs_dropped_total{signal=\"rounds\"})")  # fmt: skip

    _discard = _discard
