"""The NVTX sink: ranges pushed and popped at the boundaries, on a fake domain."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from memra_obs.observer import Burst
from memra_obs.sinks import nvtx as nvtx_mod
from memra_obs.sinks.nvtx import RANGE_NAMES, NvtxSink
from memra_obs.testing import capture


class FakeDomain:
    """Stands in for ``nvtx.get_domain('memra')``: keeps the push/pop sequence."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.attrs_built: list[str] = []

    def get_event_attributes(self, message: str | None = None, color: Any = None, **kw: Any) -> Any:
        self.attrs_built.append(str(message))
        return ("attrs", message, color)

    def push_range(self, attributes: Any) -> None:
        self.ops.append("+" + attributes[1])

    def pop_range(self) -> None:
        self.ops.append("-")


def one_round(b: Any) -> None:
    b.begin_round()
    b.end_draft()
    b.end_verify()
    b.end_accept()
    b.end_rollback()
    b.end_round(k=4, j=2)


def test_ranges_nest_burst_round_phase_at_the_boundaries() -> None:
    """A burst of two rounds: spec.burst > spec.round > the five phases, balanced."""
    d = FakeDomain()
    sink = NvtxSink(domain=d)
    assert sink.backend == "nvtx"
    assert sorted(d.attrs_built) == sorted(RANGE_NAMES)  # built once, up front
    with capture(level=1, sinks=[sink]) as cap, cap.observer.session("t") as s:
        b = s.burst(4)
        assert type(b) is not Burst
        assert d.ops == ["+spec.burst"]
        b.begin_round()
        assert d.ops[-2:] == ["+spec.round", "+spec.draft"]  # pushed at the boundary itself
        b.end_draft()
        assert d.ops[-2:] == ["-", "+spec.verify"]
        b.end_verify()
        b.end_accept()
        b.end_rollback()
        b.end_round(k=4, j=2)
        one_round(b)
        b.end()
    phases = [
        "+spec.draft",
        "-",
        "+spec.verify",
        "-",
        "+spec.accept",
        "-",
        "+spec.rollback",
        "-",
        "+spec.maint",
        "-",
    ]
    rnd = ["+spec.round", *phases, "-"]
    assert d.ops == ["+spec.burst", *rnd, *rnd, "-"]
    assert len(cap.rounds) == 2


def test_misuse_never_unbalances_the_ranges() -> None:
    """A round begun twice, or a burst ended mid-round, still pops everything it pushed."""
    d = FakeDomain()
    with capture(level=1, sinks=[NvtxSink(domain=d)]) as cap, cap.observer.session("t") as s:
        b = s.burst(4)
        b.begin_round()
        b.end_draft()
        b.begin_round()  # the loop restarted the round
        one_round(b)
        b.begin_round()
        b.end_draft()
        b.end()  # returned mid-round
        b.end_verify()  # late boundary after the end: no range opened
        b = s.burst(4)
        b.begin_round()
        b.end_accept()  # out of order: the round is dropped
        b.end_round(k=4, j=2)
        depth = sum(1 if op.startswith("+") else -1 for op in d.ops)
        assert depth == 1  # its round's ranges closed at its end_round, spec.burst left
        b.end()
    pushes = sum(op.startswith("+") for op in d.ops)
    assert pushes == d.ops.count("-")
    depth = 0
    for op in d.ops:
        depth += 1 if op.startswith("+") else -1
        assert depth >= 0


@pytest.mark.parametrize("op", ["push_range", "pop_range"])
def test_a_raising_domain_never_reaches_the_loop(op: str, caplog: pytest.LogCaptureFixture) -> None:
    """NVTX failures are reported once and the loop's rounds still come out, as a plain
    burst's: ``ctx`` and ``seq_rows`` left out are 0, as ``Burst.end_round`` has them."""

    def broke(*args: Any) -> None:
        raise RuntimeError("nvtx broke")

    Bad = type("Bad", (FakeDomain,), {op: broke})

    with capture(level=1, sinks=[NvtxSink(domain=Bad())]) as cap, cap.observer.session("t") as s:
        b = s.burst(4)
        one_round(b)
        one_round(b)
        b.end()
    assert [(r.k, r.j, r.ctx, r.seq_rows) for r in cap.rounds] == [(4, 2, 0, 0)] * 2
    assert caplog.text.count("raised RuntimeError('nvtx broke')") == 1


def test_no_nvtx_anywhere_is_a_noop_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Neither nvtx nor torch: no range hook (bursts stay plain) and one stderr line."""
    monkeypatch.setattr(nvtx_mod, "_importable", lambda name: False)
    a, b2 = NvtxSink(), NvtxSink()
    assert a.range_hook is None and b2.range_hook is None and a.backend == "off"
    assert caplog.text.count("no NVTX ranges") == 1
    with capture(level=1, sinks=[a]) as cap, cap.observer.session("t") as s:
        assert type(s.burst(4)) is Burst


def test_the_real_nvtx_package_without_a_profiler_is_off() -> None:
    """With nvtx installed but no tool attached, nvtx hands back its dummy domain: off, no hook."""
    nvtx = pytest.importorskip("nvtx")
    if type(nvtx.get_domain("memra")).__name__ != "DummyDomain":
        pytest.skip("a profiler is attached")
    sink = NvtxSink()
    assert sink.range_hook is None and sink.backend == "off"


def test_setup_wires_the_sink_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """MEMRA_OBS_SINKS=nvtx builds an observer with an NvtxSink when ranges are on."""
    from memra_obs.wiring import build_observer

    monkeypatch.setattr(nvtx_mod, "_find", lambda domain: (object(), "nvtx"))
    obs = build_observer(
        level=0, prof=False, env={"MEMRA_OBS_SINKS": "nvtx", "MEMRA_OBS_METRICS_ADDR": ""}
    )
    try:
        assert any(isinstance(s, NvtxSink) for s in obs.sinks)
    finally:
        obs.shutdown()


def test_nvtx_alone_with_ranges_off_is_the_noop_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    """MEMRA_OBS_SINKS=nvtx with no profiler attached (or no nvtx): nothing else is on, so the
    loop gets the no-op observer, not a full one whose rounds feed no one."""
    from memra_obs.observer import NOOP_OBSERVER
    from memra_obs.wiring import build_observer

    monkeypatch.setattr(nvtx_mod, "_importable", lambda name: False)
    obs = build_observer(
        level=0, prof=False, env={"MEMRA_OBS_SINKS": "nvtx", "MEMRA_OBS_METRICS_ADDR": ""}
    )
    assert obs is NOOP_OBSERVER


class MarkingClock:
    """A clock whose marks land in the domain's op list, to see ranges move after them."""

    immediate = True

    def __init__(self, ops: list[str]) -> None:
        self.ops, self.t = ops, 0

    def mark(self) -> int:
        self.ops.append("mark")
        self.t += 1000
        return self.t

    def settle(self, stamps: list[int]) -> list[int]:
        return stamps


def test_a_range_closes_right_after_its_mark_before_any_sink_sees_the_round() -> None:
    """Each range moves right after its boundary's mark (a sync clock's drain inside the phase
    it ends), and spec.maint and spec.round are closed before the round reaches the sinks."""
    from memra_obs.sinks.base import Sink

    d = FakeDomain()

    class Seen(Sink):
        def on_round(self, rec: Any) -> None:
            d.ops.append("on_round")

    sinks = [NvtxSink(domain=d), Seen()]
    with capture(level=1, sinks=sinks, clock=lambda e, eh: MarkingClock(d.ops)) as cap:
        s = cap.observer.session("t")
        b = s.burst(4)
        one_round(b)
        b.end()
        s.end()
    ph = ["+spec.draft"] + [x for n in ("verify", "accept", "rollback", "maint")
                            for x in ("mark", "-", f"+spec.{n}")]  # fmt: skip
    assert d.ops == ["+spec.burst", "mark", "+spec.round", *ph, "mark", "-", "-", "on_round", "-"]


def test_interleaved_bursts_on_one_thread_never_cross_ranges(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two sessions' bursts open at once on one thread (asyncio tasks): push/pop is a stack per
    thread, so the later burst goes without ranges, said once; the stack stays balanced and the
    first burst's ranges nest as if alone. Once the thread's stack is free, ranges come back."""
    d = FakeDomain()
    with capture(level=1, sinks=[NvtxSink(domain=d)]) as cap:
        s1, s2 = cap.observer.session("a"), cap.observer.session("b")
        b1 = s1.burst(4)
        b1.begin_round()
        b2 = s2.burst(4)  # task 2 runs while task 1 is inside its draft
        assert type(b2) is Burst
        one_round(b2)
        b1.end_draft()
        b2.end()
        b1.end_verify()
        b1.end_accept()
        b1.end_rollback()
        b1.end_round(k=4, j=2)
        b1.end()
        alone = list(d.ops)
        b3 = s2.burst(4)
        assert type(b3) is not Burst
        b3.end()
        s1.end()
        s2.end()
    assert len(cap.rounds) == 2
    phases = [
        x for n in ("draft", "verify", "accept", "rollback", "maint") for x in (f"+spec.{n}", "-")
    ]
    assert alone == ["+spec.burst", "+spec.round", *phases, "-", "-"]
    assert caplog.text.count("two bursts open at once on one thread") == 1


def test_bursts_on_other_threads_each_get_ranges() -> None:
    """Another thread has its own range stack: its burst gets ranges while this one's is open."""
    import threading

    d = FakeDomain()
    kinds: list[type] = []
    with capture(level=1, sinks=[NvtxSink(domain=d)]) as cap:
        s1 = cap.observer.session("a")
        b1 = s1.burst(4)

        def other() -> None:
            with cap.observer.session("b") as s2, s2.burst(4) as b2:
                kinds.append(type(b2))

        th = threading.Thread(target=other)
        th.start()
        th.join()
        b1.end()
        s1.end()
    assert kinds and kinds[0] is not Burst


def test_a_thread_that_died_with_a_burst_open_leaves_later_threads_their_ranges() -> None:
    """A thread gone with its burst open (its session abandoned): the threads that reuse its
    id got no ranges, for good."""
    kinds: list[type] = []
    with capture(level=1, sinks=[NvtxSink(domain=FakeDomain())]) as cap:

        def abandon() -> None:
            cap.observer.session("a").burst(4).begin_round()

        def other() -> None:
            with cap.observer.session("b") as s, s.burst(4) as b:
                kinds.append(type(b))

        for target in (abandon, other) * 20:  # a joined thread's id goes to the next one
            th = threading.Thread(target=target)
            th.start()
            th.join()
    assert Burst not in kinds


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_gets_ranges_though_its_parent_had_a_burst_open() -> None:
    """fork() mid-burst: the child's thread may carry its parent's id, but its range stack is
    its own, so the child's bursts get ranges."""
    from forked import in_child

    d = FakeDomain()
    with capture(level=1, sinks=[NvtxSink(domain=d)]) as cap:
        b = cap.observer.session("a").burst(4)  # open across the fork
        got = in_child(lambda: type(cap.observer.session("b").burst(4)).__name__.encode())
        b.end()
    assert got == b"_RangedBurst"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_that_ends_its_parents_session_closes_its_ranges_either_way() -> None:
    """A child unwinding the session it inherited closes the parent's open ranges whether it
    ends the burst first or only the session (that left them on its stack, under its own)."""
    from forked import in_child

    for burst_first in (True, False):
        d = FakeDomain()
        with capture(level=1, sinks=[NvtxSink(domain=d)]) as cap:
            s = cap.observer.session("a")
            b = s.burst(4)
            b.begin_round()
            b.end_draft()  # open: spec.burst > spec.round > spec.verify

            def child(s=s, b=b, d=d, burst_first=burst_first) -> bytes:
                n = len(d.ops)
                if burst_first:
                    b.end()
                s.end()
                return "".join(d.ops[n:]).encode()

            got = in_child(child)
            s.end()
        assert got == b"---", burst_first


class ThreadStacks(FakeDomain):
    """A range stack per thread, as NVTX keeps them; counts pops on an empty one."""

    def __init__(self) -> None:
        super().__init__()
        self.stacks: dict[str, list[str]] = {}
        self.underflows = 0

    def push_range(self, attributes: Any) -> None:
        self.stacks.setdefault(threading.current_thread().name, []).append(attributes[1])

    def pop_range(self) -> None:
        stack = self.stacks.setdefault(threading.current_thread().name, [])
        if stack:
            stack.pop()
        else:
            self.underflows += 1


def test_a_session_ended_from_another_thread_leaves_each_thread_its_own_ranges() -> None:
    """A cancel (``s.end()`` from a server thread) mid-burst popped the canceller's stack and
    left three ranges on the loop thread's for ever, one more nest at every cancel."""
    d = ThreadStacks()
    with capture(level=1, sinks=[NvtxSink(domain=d)]) as cap:

        def loop() -> None:
            for i in range(4):
                s = cap.observer.session("a")
                b = s.burst(4)
                b.begin_round()
                b.end_draft()
                th = threading.Thread(target=s.end, name="server")
                th.start()
                th.join()
                b.end_verify()
                if i % 2:  # the loop ends its burst, or goes straight to its next request
                    b.end()

        th = threading.Thread(target=loop, name="loop")
        th.start()
        th.join()
        with cap.observer.session("b") as s, s.burst(4) as b:  # a ranged burst still comes
            assert type(b) is not Burst
    assert d.underflows == 0
    assert d.stacks == {"loop": [], "MainThread": []}


def test_a_cancelled_burst_ended_late_leaves_the_next_its_ranges() -> None:
    """A burst ended from another thread, ended again by its loop after the loop's next burst
    took the thread's ranges: that burst keeps them (one begun while it is open gets none)."""
    with capture(level=1, sinks=[NvtxSink(domain=FakeDomain())]) as cap:
        s1 = cap.observer.session("a")
        b1 = s1.burst(4)
        th = threading.Thread(target=s1.end)
        th.start()
        th.join()
        s2 = cap.observer.session("b")
        b2 = s2.burst(4)
        b1.end()  # the loop's own end, late
        s3 = cap.observer.session("c")
        assert type(b2) is not Burst and type(s3.burst(4)) is Burst
        s3.end()
        s2.end()


def test_a_cancel_while_the_loop_builds_its_burst_raises_nowhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session held a ranged burst before it was built: a thread ending the session
    then (a cancel) got an AttributeError from ``s.end()``."""
    from memra_obs import ranged_burst as burst_mod

    raised: list[BaseException] = []
    calls: list[int] = []
    with capture(level=1, sinks=[NvtxSink(domain=ThreadStacks())]) as cap:
        s = cap.observer.session("a")

        def cancel() -> None:
            try:
                s.end()
            except BaseException as exc:
                raised.append(exc)

        class Hooked:  # the cancel lands where the burst is being built
            def __getattr__(self, name: str) -> Any:
                return getattr(threading, name)

            def get_ident(self) -> int:
                calls.append(1)
                if len(calls) == 2:
                    th = threading.Thread(target=cancel)
                    th.start()
                    th.join()
                return threading.get_ident()

        monkeypatch.setattr(burst_mod, "threading", Hooked())
        b = s.burst(4)
        one_round(b)
        b.end()
    assert len(calls) >= 2
    assert raised == []


def fake_torch(monkeypatch: pytest.MonkeyPatch, ops: list[str]) -> None:
    """A CUDA torch whose ``torch.cuda.nvtx`` keeps the push/pop sequence."""
    import types

    nv = types.SimpleNamespace(
        range_push=lambda n: ops.append("+" + n), range_pop=lambda: ops.append("-")
    )
    cuda = types.SimpleNamespace(is_available=lambda: True, nvtx=nv)
    monkeypatch.setitem(__import__("sys").modules, "torch", types.SimpleNamespace(cuda=cuda))


def test_torch_nvtx_with_no_profiler_attached_is_the_noop_observer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No nvtx package, a CUDA torch, no Nsight tool (NVTX_INJECTION64_PATH unset): off, so
    MEMRA_OBS_SINKS=nvtx gives the no-op observer (a full one drained the streams at every
    boundary for ranges no one records); NVTX_DISABLE is honoured too."""
    from memra_obs.observer import NOOP_OBSERVER
    from memra_obs.wiring import build_observer

    ops: list[str] = []
    fake_torch(monkeypatch, ops)
    monkeypatch.setattr(nvtx_mod, "_importable", lambda name: name == "torch")
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    env = {"MEMRA_OBS_SINKS": "nvtx", "MEMRA_OBS_METRICS_ADDR": ""}
    assert build_observer(level=0, prof=False, env=env) is NOOP_OBSERVER
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsys/libToolsInjection64.so")
    sink = NvtxSink()
    assert sink.backend == "torch"
    with capture(level=1, sinks=[sink]) as cap, cap.observer.session("t") as s:
        b = s.burst(4)
        one_round(b)
        b.end()
    assert ops[:3] == ["+spec.burst", "+spec.round", "+spec.draft"] and ops.count("-") == 7
    monkeypatch.setenv("NVTX_DISABLE", "1")
    assert NvtxSink().backend == "off"


def test_an_nvtx_older_than_0_2_12_falls_back_to_torch_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """nvtx 0.2.10 has no get_domain, 0.2.11 no Domain.push_range: setting up failed (no
    ranges at all, an AttributeError named) though torch.cuda.nvtx was there."""
    import types

    class Domain011:  # nvtx 0.2.11's Domain: attributes, but no push_range of its own
        def get_event_attributes(self, message: Any = None, color: Any = None) -> Any:
            return message

    old = types.SimpleNamespace(enabled=lambda: True, get_domain=lambda name: Domain011())
    monkeypatch.setitem(__import__("sys").modules, "nvtx", old)
    fake_torch(monkeypatch, [])
    monkeypatch.setattr(nvtx_mod, "_importable", lambda name: True)
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsys/libToolsInjection64.so")
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    assert NvtxSink().backend == "torch" and NvtxSink().backend == "torch"
    assert caplog.text.count("older than 0.2.12") == 1
    assert "failed" not in caplog.text


def test_a_burst_dropped_unended_gives_the_thread_its_ranges_back() -> None:
    """A request that raised outside ``with`` drops its session and burst unended. The thread's
    table held the burst strongly: it stayed alive, its 3 ranges open, and every later burst on
    the thread got none. Held weakly, its ranges close at the next burst, which gets its own."""
    import gc
    import weakref

    d = FakeDomain()
    with capture(level=1, sinks=[NvtxSink(domain=d)]) as cap:
        s = cap.observer.session("t")
        b = s.burst(4)
        one_round(b)
        b.begin_round()  # raised here: s and b dropped
        gone = weakref.ref(s)
        del s, b
        gc.collect()
        assert gone() is None
        with cap.observer.session("t") as s2:
            b2 = s2.burst(4)
            one_round(b2)
            b2.end()
        assert type(b2) is not Burst
    opened = [op for op in d.ops if op != "-"]
    assert len(opened) == d.ops.count("-")  # balanced: the dropped burst's ranges closed
    assert opened.count("+spec.round") == 3


def test_no_profiler_attached_imports_no_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVTX_INJECTION64_PATH unset (or NVTX_DISABLE): off before torch is imported, whose
    ``is_available()`` would start the CUDA driver in, e.g., a server's pre-fork master."""
    import sys
    import types

    probes: list[str] = []
    cuda = types.SimpleNamespace(is_available=lambda: probes.append("is_available") or True)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(nvtx_mod, "_importable", lambda name: name == "torch")
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    assert NvtxSink().backend == "off"
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsys/libToolsInjection64.so")
    monkeypatch.setenv("NVTX_DISABLE", "1")
    assert NvtxSink().backend == "off" and probes == []


def test_an_nvtx_package_that_fails_to_import_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An installed nvtx whose import raises (a wheel built for another Python): NVTX was off
    ("setting up ranges failed"), though torch.cuda.nvtx was there. Said once, torch used."""
    import importlib.abc
    import sys

    class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            if name == "nvtx":
                raise ImportError("libnvToolsExt.so.1: cannot open shared object file")
            return None

    monkeypatch.delitem(sys.modules, "nvtx", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    ops: list[str] = []
    fake_torch(monkeypatch, ops)
    monkeypatch.setattr(nvtx_mod, "_importable", lambda name: True)
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nsys/libToolsInjection64.so")
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    assert NvtxSink().backend == "torch" and NvtxSink().backend == "torch"
    assert caplog.text.count("importing the nvtx package failed") == 1
