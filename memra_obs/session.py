"""A session (one request): its first-token profile, its bursts, its round log's summary and
the k advice over it. Nothing here raises into the loop: misuse is said once. The profile's
buckets cover the wall from the drained start to the first burst's return; the rest is
``unattributed_ms``.
"""

from __future__ import annotations

import contextlib
import operator
import os
import random
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from .analysis import EXPLORE, advise
from .burst import Burst, NoOpBurst, _DiscardingBurst
from .clock import Stream, SyncClock, clock, now_ns
from .diagnostics import say_once
from .fanout import Fanout, fan
from .legacy import advice_line
from .ranged_burst import new_burst
from .records import U16_MAX, SpecFirstTokenProf, SpecRoundsLog
from .requests import request_record
from .timeline import FirstTokenRecord, ProfSummaryRecord, SessionEndRecord, SessionRecord

if TYPE_CHECKING:
    from .observer import Observer

__all__ = ["LAP_BUCKETS", "Session"]

#: First-token buckets the loop measures with ``Session.lap``, in their natural order.
LAP_BUCKETS: tuple[str, ...] = ("cache_alloc", "sink_alloc", "prime", "capture", "anchor")
LAP_BUCKETS += ("draft_alloc", "draft_prime")
_SHARES = frozenset(("prime_tap_dtoh_ms", "draft_prime_h2d_ms", "draft_prime_feat_ms"))
_SHARES |= {"draft_prime_kv_ms", "first_burst_hook_ms"}
_GEOMETRY = frozenset(("draft_prime_rows", "draft_prime_chunks", "draft_prime_arm", "draft_kv_mb"))
_ROUND1 = ("first_draft", "first_verify", "first_accept", "first_roll", "first_maint")


#: Ids from a generator of their own: a loop that seeds ``random`` (vLLM seeds 0 in every
#: worker) gave every session of every run one trace id. A forked child reseeds it from the
#: OS, as ``random`` does its own.
_IDS = random.Random()
_bits = _IDS.getrandbits
#: Forks into this process: a session opened under an earlier count is its parent's (a child
#: that unwinds the ``with`` it inherited must not publish it a second time).
FORKS = [0]


def _in_child() -> None:
    _IDS.seed()
    FORKS[0] += 1


os.register_at_fork(after_in_child=_in_child)


def _trace_ids(sampled: Callable[[int], bool] | None = None) -> tuple[int, int, int, int]:
    """(trace_id, span id, parent span id, the caller's trace id or 0): under the caller's
    current span, or a fresh trace; all but the last 0 when not sampled (no spans, no
    exemplars): by ``sampled(trace_id)`` (``OTEL_TRACES_SAMPLER``), else as
    parentbased_always_on (the caller's decision)."""
    try:
        from opentelemetry import trace

        span = trace.get_current_span()
        ctx = span.get_span_context()
        if ctx.is_valid and getattr(span, "end_time", None) is not None:  # an SDK span, ended
            say_once("ended-parent", "Observer.session() under a span that has ended (a loop "
                     "task started inside a request keeps that request's span current): a "
                     "trace of its own; attach each request's context where its session opens")  # fmt: skip
            with trace.use_span(trace.INVALID_SPAN):  # the sampler's parent too
                return _trace_ids(sampled)
        caller = ctx.trace_id if ctx.is_valid else 0
        tid = caller or _bits(128) or 1
        if not (sampled(tid) if sampled else not ctx.is_valid or ctx.trace_flags.sampled):
            return 0, 0, 0, caller
        return tid, _bits(64) or 1, ctx.span_id if ctx.is_valid else 0, caller
    except Exception:
        return _bits(128) or 1, _bits(64) or 1, 0, 0


def _error_text(exc: BaseException) -> str:
    """``module.Type: message`` (``torch.OutOfMemoryError: ...``; a builtin's type bare), the
    type alone without one."""
    try:
        msg = str(exc)
    except Exception:
        msg = ""
    t = type(exc)  # semconv's error.type: the class qualified by its module (not builtins.)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    return f"{name}: {msg}" if msg else name


def _stream(name: str, v: Stream | None) -> Stream | None:
    """A stream the clock can drain (``.synchronize()``), or None after saying why."""
    if v is None or callable(getattr(v, "synchronize", None)):
        return v
    say_once(f"stream:{type(v).__name__}", f"Observer.session({name}={type(v).__name__}): "
             "expected a stream with .synchronize() (CuPy, torch) or None; this session's "
             "boundaries do not drain it", "stream")  # fmt: skip
    return None


class Session:
    """One request, used from the loop's thread. ``prof`` is the live
    :class:`SpecFirstTokenProf` (None with the profile off); prefer :meth:`lap`, :meth:`add`
    and :meth:`set`, no-ops on a disabled observer."""

    def __init__(
        self, obs: Observer, family: str, tag: str, tag_v: str, e: Stream | None, eh: Stream | None
    ) -> None:
        self._obs = obs
        self._forks = FORKS[0]
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
        #: (k, j) of each drafting round, the largest burst k and the phase totals: the
        #: per-request record.
        self._ks, self._js, self._k = array("H"), array("H"), 0
        self._phase_ns = [0, 0, 0, 0, 0]
        self._ended = self._first_token_sent = False
        self._advice = ""  # the [spec-advice] line, once summarized
        self._intervals: list[tuple[str, int, int]] = []
        self._round1: tuple[int, ...] | None = None
        self._prime_end = 0
        self._open_burst: Burst | None = None
        fo = obs._fan
        ids = _trace_ids(obs.sampled) if fo.wants_trace_ids else (0, 0, 0, 0)
        # The profile's start (a drain) comes before the anchor pair: later stamps sit after it.
        start = clock(self.e, self.eh) if self.prof is not None else now_ns()
        self._last_ns = start
        self.record = SessionRecord(
            self.id, family, tag, tag_v, obs.worker, start, now_ns(), time.time_ns(), *ids[:3],
            self.level, self.prof is not None, self._clock_name, ids[3],
        )  # fmt: skip
        fan(fo.on_session, "on_session", self.record)

    def lap(self, bucket: str) -> float:
        """Close a first-token bucket (``cache_alloc``, ``prime``, ...): drain, and add the ms
        since the previous boundary to ``prof.<bucket>_ms``; returns them (0.0: profile off, or
        closed by the first burst)."""
        if self.prof is None or self._closed("lap"):
            return 0.0
        if bucket not in LAP_BUCKETS:
            say_once(f"lap:{bucket}",
                     f"Session.lap({bucket!r}): not a bucket of {LAP_BUCKETS}; ignored", "lap-bucket")  # fmt: skip
            return 0.0
        b = self._open_burst
        # Creation buckets run before the first burst, the drafter prime in round 1's draft:
        # elsewhere a lap counted its stretch twice (the TTFT past the wall) or out of place.
        if bucket == "draft_prime":
            placed = b is not None and b._at == 0 and not self._rounds and not b._pending
        else:
            placed = b is None
        if not placed:
            where = "outside round 1's draft" if bucket == "draft_prime" else "inside a burst"
            say_once(f"lap-where:{bucket}", f"Session.lap({bucket!r}) {where}: its time stays "
                     "in first_burst_ms / unattributed_ms; ignored", "lap-where")  # fmt: skip
            if b is None:  # drained: unattributed, not the next bucket's
                with contextlib.suppress(Exception):
                    self._last_ns = clock(self.e, self.eh)
            return 0.0
        try:
            # Inside an open round (round 1's drafter prime) the bucket starts at the round's
            # entry, or at a lap's earlier in it; otherwise at the profile's previous boundary.
            start = self._last_ns
            if b is not None:
                start = max(b._t[b._r0], start)
            end = clock(self.e, self.eh)
            ms = (end - start) / 1e6
            self._intervals.append((bucket, start, end))
            self._last_ns = end
            if bucket == "draft_prime":
                self._prime_end = end
            name = bucket + "_ms"
            setattr(self.prof, name, getattr(self.prof, name) + ms)
            return ms
        except Exception as exc:
            say_once(f"lap:{bucket}:error", f"Session.lap({bucket!r}) failed ({exc!r}); ignored",
                     "lap-error")  # fmt: skip
            return 0.0

    def add(self, **shares_ms: float) -> None:
        """Add ms to share buckets that sit inside others (``prime_tap_dtoh_ms``, ...)."""
        self._put("add", _SHARES, shares_ms)

    def set(self, **fields: object) -> None:
        """Set the drafter-prime geometry (``draft_prime_rows``, ..., ``draft_kv_mb``)."""
        self._put("set", _GEOMETRY, fields)

    def _put(self, call: str, allowed: frozenset[str], values: dict[str, Any]) -> None:
        for name, v in values.items():
            if self.prof is None or self._closed(call):
                return
            if name not in allowed:
                say_once(f"{call}:{name}",
                         f"Session.{call}({name}=...): not one of {sorted(allowed)}", call + "-name")  # fmt: skip
                continue
            try:
                setattr(self.prof, name, getattr(self.prof, name) + v if call == "add" else v)
            except Exception as exc:
                say_once(f"{call}:{name}:bad", f"Session.{call}: {exc}; ignored", call + "-bad")

    def free_memory(self, point: str) -> list[tuple[int, int]]:
        """Free device memory per CUDA ordinal into ``free_mb_<point>`` (``before`` the trunk
        cache, ``after`` the drafter KV); its own time lands in no bucket."""
        if self.prof is None or self._closed("free_memory"):
            return []
        if point not in ("before", "after"):
            say_once(f"mem:{point}", f"Session.free_memory({point!r}): use 'before' or 'after'",
                     "mem")  # fmt: skip
            return []
        snap = self._obs.memory_snapshot()
        self._last_ns = now_ns()  # the next bucket starts after it (a monotonic clock)
        try:
            setattr(self.prof, f"free_mb_{point}", snap)
        except (TypeError, ValueError) as exc:
            say_once("mem:bad", f"free-memory snapshot refused ({exc}); recording none")
        return snap

    def _closed(self, call: str) -> bool:
        """The first burst has returned (the profile is published) or the session has ended
        without one (it never will be): a later change is lost."""
        if self._first_token_sent or self._ended:
            when = "the first burst" if self._first_token_sent else "the session ended"
            say_once(f"closed:{call}", f"Session.{call}(...) after {when}: the first-token "
                     "profile is closed; ignored")  # fmt: skip
            return True
        return False

    def burst(self, k: int) -> Burst | NoOpBurst:
        """Enter a burst drafting ``k`` per round; one still open is ended first (said once).
        An ended session, or a ``k`` no loop drafts, gets a burst that records nothing."""
        if self._parents():
            return _DiscardingBurst(self._obs, self.level >= 2)
        try:
            ok = not self._ended and 0 <= (k := operator.index(k)) <= U16_MAX
        except TypeError:
            ok = False
        if not ok:
            why = "the session has ended" if self._ended else "expected an int in 0..65535"
            say_once(f"burst-bad:{why}", f"Session.burst(k={k!r}): {why}; not recorded")
            return _DiscardingBurst(self._obs, self.level >= 2)
        b = self._open_burst
        if b is not None:
            say_once("burst-open", "Session.burst() while the previous burst was not ended: "
                     "ending it now (call Burst.end() when a burst returns)")  # fmt: skip
            b.end()
        self._k = max(self._k, k)
        # held once built: a cancel from another thread saw a ranged one half made (raised)
        b = self._open_burst = new_burst(self, k, self._obs._fan.ranges)
        return b

    def end(self, error: BaseException | str | None = None) -> None:
        """End the session (an open burst first): the round-log summary, then the end record."""
        if self._ended or self._parents():
            return
        self._ended = True  # first: a cancel racing the loop's own end made two end records
        b = self._open_burst
        if b is not None:
            if error:  # the loop failed mid-burst (an OOM, a cancel): no misuse
                b._abort()
            else:
                say_once("burst-open-end", "Session.end() with a burst not ended: ending it now")
            b.end()
        fo, log = self._obs._fan, self.log
        if log is not None and not log.summarized:
            self._summarize(fo, log)
        # <= 256 characters, a loop's own text too: the same in-process as through the ring
        err = error if isinstance(error, str) else _error_text(error) if error else ""
        err = err.encode("utf-8", "backslashreplace").decode()[:256]  # (a path's lone surrogate)
        rec = SessionEndRecord(self.id, now_ns(), self._rounds, self._bursts, self._tokens, err,
                               self._advice)  # fmt: skip
        fan(fo.on_session_end, "on_session_end", rec)

    def _parents(self) -> bool:
        """Opened before this process was forked: the parent's to end and publish (said once;
        the session and its open burst end here unpublished)."""
        if self._forks == FORKS[0]:
            return False
        self._ended = True
        if self._open_burst is not None:
            self._open_burst._disown()
        say_once("fork-session", f"a session opened before fork() ({self.family!r}) ended in "
                 f"forked process {os.getpid()}: it is its parent's to publish; ignored here")  # fmt: skip
        return True

    def spec_decode(self, detailed: bool = False) -> dict[str, Any]:
        """This request's record so far, for a server's response: vLLM's spec-decode fields,
        the per-step lists with ``detailed``, the phase totals (ms), the first-token profile."""
        try:
            ns, b = self._phase_ns, self._open_burst
            if b is not None:  # an open burst's finished rounds count, as their ks and js do
                ns = list(map(operator.add, ns, b._phases.phases()))
            out = request_record(self._ks, self._js, ns, detailed, self._k)
            # Ended before a first token: no profile was published (the requests file's None)
            prof = None if self._ended and not self._first_token_sent else self.prof
            out["first_token"] = asdict(prof) if prof is not None else None
            return out
        except Exception as exc:
            say_once("spec-decode", f"Session.spec_decode failed ({exc!r})")
            return {}

    def __enter__(self) -> Session:
        return self

    def __exit__(self, et: object, ev: BaseException | None, tb: object) -> None:
        if isinstance(ev, GeneratorExit):  # a stream closed early (the client had enough): no
            if (b := self._open_burst) is not None:  # error, as the SDK's spans have none;
                b._abort()  # a round it cut is dropped and counted, unsaid
                b.end()
            ev = None
        self.end(ev)

    def _summarize(self, fo: Fanout, log: SpecRoundsLog) -> None:
        log.summarized = True
        try:
            plain = getattr(self._obs.settings, "plain_step_ms", None)
            # On the loop thread, once a request: the line names the advised k only, never
            # past the longest draft + EXPLORE, so the curve stops there (~0.35 ms, not 0.55).
            top = min(16, max((r.k for r in log.rounds), default=0) + EXPLORE)
            a = advise(log.rounds, max_k=top, clock=self._clock_name,
                       plain_step_ns=plain and plain * 1e6)  # fmt: skip
            advice = advice_line(a) if a is not None else ""
        except Exception as exc:
            say_once("advice", f"the k advisor failed ({exc!r}); no [spec-advice] line")
            advice = ""
        self._advice = advice
        rec = ProfSummaryRecord(self.id, log.summary(), log.slow_rounds(), advice)
        fan(fo.on_prof_summary, "on_prof_summary", rec)

    def _first_token(self, burst: Burst, end: int, tokens: int) -> None:
        prof = self.prof
        self._first_token_sent = True
        if prof is None:
            return
        start = burst.start_ns_mono
        prof.first_burst_ms = (end - start) / 1e6
        prof.first_burst_hook_ms += burst._hook_ns / 1e6
        prof.first_burst_rounds = burst.rounds
        prof.first_burst_tokens = tokens
        iv, r1 = self._intervals, self._round1
        if r1 is not None:
            bounds = (max(r1[0], self._prime_end), *r1[1:])
            for name, a, b in zip(_ROUND1, bounds, bounds[1:], strict=False):
                setattr(prof, name + "_ms", max(b - a, 0) / 1e6)
                iv.append((name, a, b))
        iv.append(("first_burst", start, end))
        # What no bucket covers (snapshots, burst set-up), in whole ns as every bucket.
        left = end - self.record.start_ns_mono - round(prof.total_ms() * 1e6)
        prof.unattributed_ms = max(left, 0) / 1e6
        fan(self._obs._fan.on_first_token, "on_first_token", FirstTokenRecord(
            self.id, replace(prof), tuple(iv)))  # fmt: skip
