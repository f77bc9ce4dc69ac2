"""The loop API under random use: observers at levels 0-2 with the profile on and off, several
sessions and bursts interleaved, boundaries in any order, counts of any type. A model of the
README's rules says which rounds are published, which are dropped (and counted), what each
round's level-2 split and ``seq_rows`` are, and what each burst's tokens are; after every step
nothing has raised, and the records, ``spec_decode()`` and the said-once channel agree with it;
at the end every line parses back and the exporters hold no open session."""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from prometheus_client import CollectorRegistry

from memra_obs import diagnostics
from memra_obs.legacy import parse_line
from memra_obs.observer import NOOP_OBSERVER
from memra_obs.otel.spans import SpanBuilder
from memra_obs.prom import PrometheusExporter
from memra_obs.records import SEQ_ROWS, U16_MAX, U32_MAX, U64_MAX, VERIFY_SPLIT
from memra_obs.requests import RequestsExporter
from memra_obs.sinks.base import Sink
from memra_obs.testing import capture

try:
    import numpy as np
except ImportError:  # numpy is optional: its scalars are then left out
    np = None  # type: ignore[assignment]

JUNK: list[Any] = [None, -1, -(2**70), 2**16, 2**32, 2**64, 2**80, 1.5, 4.0, float("nan")]
JUNK += [float("inf"), True, False, "4", "", b"4", [], 65535]
if np is not None:
    JUNK += [np.int64(3), np.uint16(2), np.int32(-1), np.float32(2.0), np.float64(1.0)]
    JUNK += [np.uint64(2**64 - 1), np.array(2)]
#: What a name (a bucket, a point) may be by mistake; an array is no name (it raises on ``in``).
NAMES = ["x", *JUNK]
if np is not None:
    JUNK += [np.array([1, 2])]
small = st.integers(0, 6)
counts = st.one_of(small, small, st.sampled_from(JUNK))
#: (k, j) of a round: mostly what a loop produces, at times anything
kj = st.one_of(small.flatmap(lambda k: st.tuples(st.just(k), st.integers(0, k))),
               small.flatmap(lambda k: st.tuples(st.just(k), st.integers(0, k))),
               st.tuples(counts, counts))  # fmt: skip
ns = st.one_of(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(JUNK))
families = st.sampled_from(["glm5", "glm5", "spec", "a b", "x]", "spec-prof", "", None, 7, b"g"])
errors = st.sampled_from([None, "boom", ""] + ["exc"] * 3)


class _Stream:
    """A device stream; ``fails``: its synchronize raises (a CUDA error the loop's next call
    will raise itself)."""

    def __init__(self, fails: bool) -> None:
        self.fails = fails

    def synchronize(self) -> None:
        if self.fails:
            raise RuntimeError("cudaErrorLaunchFailure")


streams = st.sampled_from([None, None, _Stream(False), _Stream(True), object(), 3])


class _LateClock:
    """Stamps settled later, as the CUDA-event clock's; a failing stream fails the settle."""

    immediate = False

    def __init__(self, e: Any, eh: Any) -> None:
        self.fails = isinstance(e, _Stream) and e.fails

    def mark(self) -> int:
        return time.perf_counter_ns()

    def settle(self, stamps: list[int]) -> list[int]:
        if self.fails:
            raise RuntimeError("cudaErrorLaunchFailure")
        return list(stamps)


class LoopError(Exception):
    """What the loop raises (an OOM, a cancel): re-raised unchanged, never misuse."""


def _index(x: Any) -> int | None:
    try:
        return operator.index(x)
    except Exception:
        return None


def _ok_counts(k: Any, j: Any, ctx: Any, seq: Any) -> bool:
    k, j, ctx, seq = _index(k), _index(j), _index(ctx), seq
    if k is None or j is None or ctx is None or seq is None:
        return False
    return 0 <= j <= k <= U16_MAX and 0 <= ctx <= U32_MAX and 0 <= seq <= U32_MAX


def _added(vals: tuple[Any, ...]) -> tuple[int, ...] | None:
    """What an accumulator takes of ``add(*vals)`` (the README: ints, floats rounded, >= 0)."""
    try:
        out = tuple(operator.index(v) if hasattr(v, "__index__") else round(v.__float__())
                    for v in vals)  # fmt: skip
    except Exception:
        return None
    return out if min(out) >= 0 else None


@dataclass
class Obs:
    cap: Any
    level: int
    prof: bool
    closed: bool = False
    dropped: int = 0
    late: bool = False  # an event-like clock: rounds are settled at the burst's end

    @property
    def observer(self) -> Any:
        return NOOP_OBSERVER if self.cap is None else self.cap.observer


@dataclass
class Sess:
    obs: Obs
    s: Any
    real: bool
    ended: bool = False
    open: Burst | None = None
    first_sent: bool = False
    burst_k: int = 0
    error: str = ""


@dataclass
class Burst:
    sess: Sess
    b: Any
    kind: str  # "real", "discard" (a refused k, an ended session) or "noop"
    index: int = -1
    at: Any = -1  # -1 none open, 0..4 the open round's last boundary, -2 dropped, "E" ended
    cut: bool = False
    tokens: int = 0
    seq: int = 0
    vsplit: tuple[int, ...] = (0, 0, 0, 0)
    expect_tokens: list[int] = field(default_factory=list)
    pending: list[tuple[Any, ...]] = field(default_factory=list)  # rounds not yet settled


class LoopMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        diagnostics.reset()
        VERIFY_SPLIT.drain()
        SEQ_ROWS.take()
        self.said: list[str] = []
        self.handler = _Keys(self.said)
        diagnostics.logger.addHandler(self.handler)
        self.stack = contextlib.ExitStack()
        self.obs: list[Obs] = []
        self.sessions: list[Sess] = []
        self.bursts: list[Burst] = []
        self.split = [0, 0, 0, 0]  # what the walk added, not yet drained (one thread: one set)
        self.rows = 0
        self.last_obs: Any = None  # the observer whose burst drained the sets last
        #: (observer, session, burst, k, j, seq_rows, split) of each round the model publishes
        self.published: list[tuple[Any, ...]] = []
        self.order_drops = 0

    # -- the model ---------------------------------------------------------------------
    def _take(self, level2: bool) -> tuple[int, tuple[int, ...]]:
        rows, self.rows = self.rows, 0
        split = (0, 0, 0, 0)
        if level2:
            split, self.split = tuple(self.split), [0, 0, 0, 0]
        return rows, split

    def _lose(self, m: Burst, said: bool = True) -> None:
        m.at = -2
        m.sess.obs.dropped += 1
        self.order_drops += said
        self._take(m.sess.obs.level >= 2)

    def _step(self, m: Burst, at: int) -> None:
        if m.at == at - 1:
            m.at = at
        elif m.at == -1 or (isinstance(m.at, int) and m.at >= 0):
            self._lose(m)

    def _end_model(self, m: Burst, tokens: Any) -> None:
        if m.at == "E":
            return
        if isinstance(m.at, int) and m.at >= 0:
            self._lose(m)
        m.at = "E"
        s = m.sess
        if s.open is m:
            s.open = None
        fails = isinstance(s.s.e, _Stream) and s.s.e.fails
        for row in m.pending:
            if fails:  # the clock could not settle them: dropped, counted
                s.obs.dropped += 1
            else:
                self._publish(m, row)
        first = not s.first_sent and not (m.cut and not m.tokens)
        t = _index(tokens)
        if t is None or not 0 <= t <= U64_MAX:
            t = m.tokens + first
        if first:
            s.first_sent = True
        m.expect_tokens.append(t)

    # -- observers and sessions --------------------------------------------------------
    @initialize(level=st.sampled_from([0, 1, 2]), prof=st.booleans(), k=small, late=st.booleans())
    def start(self, level: int, prof: bool, k: int, late: bool) -> None:
        """A loop under way: an observer, a session, a burst."""
        self.new_observer(level, prof, True, late)
        self.open_session(0, "glm5", False)
        self.burst(0, k)

    @rule(
        level=st.sampled_from([0, 1, 2]),
        prof=st.booleans(),
        memory=st.booleans(),
        late=st.booleans(),
    )
    @precondition(lambda self: len(self.obs) < 4)
    def new_observer(self, level: int, prof: bool, memory: bool, late: bool = False) -> None:
        """``memory=False``: NVML and a sink that fail (said once, the loop carries on);
        ``late``: a clock that settles at the burst's end, as the CUDA-event one."""
        mem = (lambda: [(0, 1024)]) if memory else _failing_memory
        sinks = () if memory else (_FailingSink(),)
        kw: dict[str, Any] = {"clock": _LateClock} if late else {}
        cap = self.stack.enter_context(
            capture(level=level, prof=prof, wants_trace_ids=True, memory=mem, sinks=sinks, **kw)
        )
        self.obs.append(Obs(cap, level, prof, late=late))

    @rule()
    @precondition(lambda self: len(self.obs) < 5)
    def noop_observer(self) -> None:
        self.obs.append(Obs(None, 0, False, closed=True))

    @rule(i=st.integers(0, 9))
    @precondition(lambda self: self.obs)
    def shutdown_observer(self, i: int) -> None:
        o = self.obs[i % len(self.obs)]
        o.observer.shutdown()
        o.closed = True

    @rule(i=st.integers(0, 9), family=families, unknown=st.booleans(), e=streams, eh=streams)
    @precondition(lambda self: self.obs and len(self.sessions) < 8)
    def open_session(
        self, i: int, family: Any, unknown: bool, e: Any = None, eh: Any = None
    ) -> None:
        o = self.obs[i % len(self.obs)]
        kw = {"stream": object()} if unknown else {}
        s = o.observer.session(family, e=e, eh=eh, **kw)
        self.sessions.append(Sess(o, s, real=not o.closed))

    def _sess(self, i: int) -> Sess:
        return self.sessions[i % len(self.sessions)]

    @rule(i=st.integers(0, 9), error=errors)
    @precondition(lambda self: self.sessions)
    def end_session(self, i: int, error: Any) -> None:
        m, said = self._sess(i), len(self.said)
        exc = LoopError("cut") if error == "exc" else error
        m.s.end(exc)
        self._end_session_model(m, exc)
        if exc:
            _unsaid(self.said[said:])

    def _end_session_model(self, m: Sess, exc: Any) -> None:
        if m.ended or not m.real:
            m.ended = True
            return
        if m.open is not None:
            if exc:
                self._abort(m.open)
            self._end_model(m.open, None)
        m.ended = True
        m.error = exc if isinstance(exc, str) else f"{__name__}.LoopError: {exc}" if exc else ""

    def _abort(self, b: Burst) -> None:
        b.cut = True
        if isinstance(b.at, int) and b.at >= 0:
            self._lose(b, said=False)

    @rule(i=st.integers(0, 9), raises=st.booleans())
    @precondition(lambda self: self.sessions)
    def with_session(self, i: int, raises: bool) -> None:
        """``with s:`` around the loop: its own exception comes out unchanged."""
        m, exc, said = self._sess(i), LoopError("oom"), len(self.said)
        try:
            with m.s:
                if raises:
                    raise exc
        except LoopError as got:
            assert raises and got is exc
        self._end_session_model(m, exc if raises else None)
        if raises:
            _unsaid(self.said[said:])

    @rule(
        i=st.integers(0, 9), name=st.sampled_from(["cache_alloc", "prime", "draft_prime", *NAMES])
    )
    @precondition(lambda self: self.sessions)
    def lap(self, i: int, name: str) -> None:
        assert isinstance(self._sess(i).s.lap(name), float)

    @rule(i=st.integers(0, 9), name=st.sampled_from(["prime_tap_dtoh_ms", "first_burst_hook_ms",
          "draft_prime_rows", "draft_prime_arm", "draft_kv_mb", "nope"]), v=counts)  # fmt: skip
    @precondition(lambda self: self.sessions)
    def add_set(self, i: int, name: str, v: Any) -> None:
        s = self._sess(i).s
        s.add(**{name: v})
        s.set(**{name: v})

    @rule(i=st.integers(0, 9), point=st.sampled_from(["before", "after", "during", *NAMES]))
    @precondition(lambda self: self.sessions)
    def free_memory(self, i: int, point: Any) -> None:
        assert isinstance(self._sess(i).s.free_memory(point), list)

    # -- bursts --------------------------------------------------------------------------
    @rule(i=st.integers(0, 9), k=counts)
    @precondition(lambda self: self.sessions and len(self.bursts) < 16)
    def burst(self, i: int, k: Any) -> None:
        m = self._sess(i)
        b = m.s.burst(k)
        kk = _index(k)
        if not m.real:
            self.bursts.append(Burst(m, b, "noop", at="E"))
            return
        if m.ended or kk is None or not 0 <= kk <= U16_MAX:
            self.bursts.append(Burst(m, b, "discard", at="E"))
            return
        if m.open is not None:
            self._end_model(m.open, None)
        obs = m.obs.observer
        if self.last_obs is not obs:
            self.last_obs = obs
            self.rows, self.split = 0, [0, 0, 0, 0]
        m.burst_k = max(m.burst_k, kk)
        index = sum(x.sess is m and x.kind == "real" for x in self.bursts)
        self.bursts.append(Burst(m, b, "real", index=index))
        m.open = self.bursts[-1]

    def _burst(self, i: int) -> Burst:
        return self.bursts[i % len(self.bursts)]

    @rule(i=st.integers(0, 99))
    @precondition(lambda self: self.bursts)
    def begin_round(self, i: int) -> None:
        m = self._burst(i)
        m.b.begin_round()
        if m.kind == "real" and m.at != "E":
            if m.at in (0, 1, 2, 3, 4):
                self._lose(m)
            m.at = 0

    @rule(i=st.integers(0, 99), at=st.sampled_from([1, 3, 4]))
    @precondition(lambda self: self.bursts)
    def end_phase(self, i: int, at: int) -> None:
        m = self._burst(i)
        getattr(m.b, ["", "end_draft", "", "end_accept", "end_rollback"][at])()
        if m.kind == "real":
            self._step(m, at)

    @rule(i=st.integers(0, 99))
    @precondition(lambda self: self.bursts)
    def end_verify(self, i: int) -> None:
        m = self._burst(i)
        m.b.end_verify()
        level2 = m.sess.obs.level >= 2
        if m.kind == "discard":
            self._take(level2)
        elif m.kind == "real" and m.at == 1:
            m.at = 2
            m.seq, split = self._take(level2)
            m.vsplit = split
        elif m.kind == "real":
            self._step(m, 2)
            if m.at in (-2, "E"):
                self._take(level2)

    @rule(i=st.integers(0, 99), k=counts, j=counts, ctx=counts, seq=st.one_of(st.none(), counts))
    @precondition(lambda self: self.bursts)
    def end_round(self, i: int, k: Any, j: Any, ctx: Any, seq: Any) -> None:
        m = self._burst(i)
        m.b.end_round(k, j, ctx, seq)
        self._end_round_model(m, k, j, ctx, seq)

    def _end_round_model(self, m: Burst, k: Any, j: Any, ctx: Any, seq: Any) -> None:
        level2 = m.sess.obs.level >= 2
        if m.kind != "real":
            if m.kind == "discard":
                self._take(level2)
            return
        if m.at != 4:
            if m.at == -1 or (isinstance(m.at, int) and m.at >= 0):
                self._lose(m)
            elif m.at in (-2, "E"):
                self._take(level2)
            m.at = -1 if m.at != "E" else "E"
            return
        m.at = -1
        rows = m.seq + self._take(False)[0] if seq is None else _index(seq)
        if not _ok_counts(k, j, ctx, rows):
            self._lose(m)
            m.at = -1
            return
        split = None
        if level2:
            late = self._take(True)[1]
            split = tuple((a + b) & U64_MAX for a, b in zip(m.vsplit, late, strict=True))
        row = (m.sess.s.id, m.index, _index(k), _index(j), rows, split)
        if m.sess.obs.late:
            m.pending.append(row)
        else:
            self._publish(m, row)

    def _publish(self, m: Burst, row: tuple[Any, ...]) -> None:
        m.tokens += row[3] + 1
        self.published.append((id(m.sess.obs), *row))

    @rule(i=st.integers(0, 99), kj=kj, ctx=st.one_of(small, counts), add=st.booleans())
    @precondition(lambda self: self.bursts)
    def full_round(self, i: int, kj: tuple[Any, Any], ctx: Any, add: bool) -> None:
        (k, j), i = kj, -1 if i % 2 else i  # the latest burst half the time
        self.begin_round(i)
        self.end_phase(i, 1)
        if add:
            self.add_split(3, 1, 2, 4)
            self.add_rows(2)
        self.end_verify(i)
        for at in (3, 4):
            self.end_phase(i, at)
        if type(ctx) is int and ctx == 1:  # the walk adds after verify too (no await between)
            self.add_split(0, 0, 0, 7)
            self.add_rows(1)
        self.end_round(i, k, j, ctx, None)

    @rule(rounds=st.lists(st.tuples(kj, small), min_size=1, max_size=8))
    @precondition(lambda self: self.bursts)
    def good_rounds(self, rounds: list[tuple[tuple[Any, Any], int]]) -> None:
        """A run of rounds as a loop makes them, on the latest burst."""
        for r, ctx in rounds:
            self.full_round(-1, r, ctx, ctx % 2 == 0)

    @rule(i=st.integers(0, 99), tokens=st.one_of(st.none(), counts))
    @precondition(lambda self: self.bursts)
    def end_burst(self, i: int, tokens: Any) -> None:
        m = self._burst(i)
        m.b.end(tokens)
        if m.kind == "real":
            self._end_model(m, tokens)

    @rule(i=st.integers(0, 99), raises=st.booleans(), hook=st.booleans())
    @precondition(lambda self: self.bursts)
    def with_burst(self, i: int, raises: bool, hook: bool) -> None:
        """``with b:`` / ``with b.hook():`` around the loop: its exception comes out unchanged."""
        m, exc, said = self._burst(i), LoopError("cancel"), len(self.said)
        try:
            with m.b.hook() if hook else m.b:
                if raises:
                    raise exc
        except LoopError as got:
            assert raises and got is exc
        if m.kind == "real" and not hook:
            if raises:
                self._abort(m)
                _unsaid(self.said[said:])
            self._end_model(m, None)

    @rule(kda=ns, scan=ns, mla=ns, ffn=ns)
    def add_split(self, kda: Any, scan: Any, mla: Any, ffn: Any) -> None:
        VERIFY_SPLIT.add(kda=kda, kda_scan=scan, mla=mla, ffn=ffn)
        if (d := _added((kda, scan, mla, ffn))) is not None:
            self.split = [(a + b) & U64_MAX for a, b in zip(self.split, d, strict=True)]

    @rule(n=ns)
    def add_rows(self, n: Any) -> None:
        SEQ_ROWS.add(n)
        if (d := _added((n,))) is not None:
            self.rows = (self.rows + d[0]) & U64_MAX

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def said_once(self) -> None:
        assert len(self.said) == len(set(self.said)), self.said
        if self.order_drops:
            assert any(k.startswith(("round-order:", "round-counts")) for k in self.said)

    @invariant()
    def rounds_as_the_model_says(self) -> None:
        got = []
        for o in self.obs:
            assert o.observer.dropped_rounds == o.dropped
            index: dict[int, int] = {}
            for r in o.cap.rounds if o.cap is not None else ():
                assert r.index == index.get(r.session, 0)  # a session's rounds, in order
                index[r.session] = r.index + 1
                t = r.t_ns_mono
                assert 0 <= r.j <= r.k <= U16_MAX and list(t) == sorted(t)
                got.append((id(o), r.session, r.burst, r.k, r.j, r.seq_rows, r.split_ns))
        assert got == [p for o in self.obs for p in self.published if p[0] == id(o)]

    @invariant()
    def spec_decode_agrees(self) -> None:
        for m in self.sessions:
            d = m.s.spec_decode(detailed=True)
            if not m.real:
                assert d == {}
                continue
            mine = [p[3:5] for p in self.published if p[:2] == (id(m.obs), m.s.id)]
            steps = [(k, j) for k, j in mine if k > 0]
            assert d.get("per_step_drafted", []) == [k for k, _ in steps]  # (none: no key)
            assert d.get("per_step_accepted", []) == [j for _, j in steps]
            assert ("per_step_drafted" in d) == bool(steps)
            assert d["num_spec_tokens"] == max([m.burst_k, *(k for k, _ in steps)])

    def teardown(self) -> None:
        try:
            for m in self.sessions:
                m.s.end()
                self._end_session_model(m, None)
            for o in self.obs:
                if o.cap is not None:
                    _check_records(o, [b for b in self.bursts if b.sess.obs is o], self.sessions)
            assert len(self.said) == len(set(self.said))
        finally:
            self.stack.close()
            diagnostics.logger.removeHandler(self.handler)


def _unsaid(keys: list[str]) -> None:
    """The loop's own exception cut the round: no misuse said."""
    assert not [k for k in keys if k.startswith(("round-order:", "burst-open"))], keys


class _Keys(logging.Handler):
    """The said-once channel's keys, in the order said."""

    def __init__(self, keys: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.keys = keys

    def emit(self, record: logging.LogRecord) -> None:
        self.keys.append(getattr(record, "memra_key", record.getMessage()))


class _FailingSink(Sink):
    """A sink whose every hook raises: said once per hook, skipped."""

    def _raise(self, rec: Any) -> None:
        raise OSError("disk full")

    on_session = on_round = on_burst = on_first_token = on_prof_rows = _raise
    on_prof_summary = on_session_end = _raise


def _failing_memory() -> list[tuple[int, int]]:
    raise RuntimeError("NVML gone")


def _check_records(o: Obs, bursts: list[Burst], sessions: list[Sess]) -> None:
    """Every session of ``o`` ended: totals add up, lines parse, exporters hold nothing open."""
    cap = o.cap
    ends = {e.session: e for e in cap.ends}
    assert set(ends) == {r.session for r in cap.sessions}
    by_burst = {(b.session, b.index): b for b in cap.bursts}
    for m in bursts:
        if m.kind == "real":
            rec = by_burst[(m.sess.s.id, m.index)]
            assert [rec.tokens] == m.expect_tokens
    for sid, end in ends.items():
        bs = [b for b in cap.bursts if b.session == sid]
        rs = [r for r in cap.rounds if r.session == sid]
        assert (end.rounds, end.bursts, end.tokens) == (len(rs), len(bs), sum(b.tokens for b in bs))
        for b in bs:
            mine = [r for r in rs if r.burst == b.index]
            assert b.phases.rounds == len(mine)
            assert all(b.start_ns_mono <= r.t_ns_mono[0] <= r.t_ns_mono[5] <= b.end_ns_mono
                       for r in mine)  # fmt: skip
            sums = [sum(r.phase_ns()[i] for r in mine) & U64_MAX for i in range(5)]
            assert list(b.phases.phases()) == sums
    for m in sessions:
        if m.obs is o and m.real:
            assert ends[m.s.id].error == m.error
            firsts = [f for f in cap.first_tokens if f.session == m.s.id]
            assert len(firsts) == (1 if o.prof and m.first_sent else 0)
    for line in cap.lines:
        parse_line(line)
    assert not cap.observer.sinks[0]._tags  # the stderr sink: no session left open
    lines = _check_exporters(cap.records, cap.rounds)
    for m in sessions:
        if m.obs is o and m.real:  # the requests file holds the record spec_decode() gave
            end = ends[m.s.id]
            want = json.loads(json.dumps(m.s.spec_decode()))  # (0, mb) pairs as JSON has them
            want.update(rounds=end.rounds, tokens=end.tokens)
            got = lines[m.s.id]
            assert {k: got[k] for k in want} == want


def _check_exporters(records: list[Any], rounds: list[Any]) -> dict[int, dict[str, Any]]:
    """Spans, metrics and the requests file of ``records``: nothing refused, nothing open, the
    counters the rounds' sums; returns the requests file's lines by session."""
    spans: list[Any] = []
    builder = SpanBuilder(round_spans=8)
    builder.add(records, spans)
    assert builder.bad_records == 0 and builder.orphans == 0 and not builder._open
    reg = CollectorRegistry()
    prom = PrometheusExporter(reg)
    prom.export(records)
    assert prom.export_errors == 0 and not prom._sessions
    samples = [x for m in reg.collect() for x in m.samples]
    for name, want in (("rounds", len(rounds)), ("accepted_tokens", sum(r.j for r in rounds)),
                       ("drafted_tokens", sum(r.k for r in rounds))):  # fmt: skip
        assert sum(x.value for x in samples if x.name == f"memra_spec_{name}_total") == want
    with tempfile.TemporaryDirectory() as d:
        req = RequestsExporter(f"{d}/r.jsonl")
        req.export(records)
        req.shutdown(30)  # returns once appended (ms); a loaded host's stall loses none
        assert req.export_errors == 0 and not req._open
        with open(f"{d}/r.jsonl") as f:
            return {(x := json.loads(line))["session"]: x for line in f}


def test_the_loop_api_under_random_use_never_raises_and_keeps_its_books():
    """~150 runs of up to 40 steps, the same ones every time (derandomized, no database):
    a few seconds, never a flake."""
    run_state_machine_as_test(
        LoopMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
