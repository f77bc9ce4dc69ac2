"""The seed's records (``spec_phase.rs``) as plain data: what a spec loop measured.

Names, defaults and storage widths are the seed's (wrapping u64 ns counters, f32 per-round
ms, u16/u32 counts): the legacy lines are formatted from exactly these values and must match
the Rust worker byte for byte. Bad input is refused at the door, naming the field.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import re
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from .diagnostics import say_once

__all__ = [
    "SEQ_ROWS", "SPEC_PROF_ROUNDS", "U16_MAX", "U32_MAX", "U64_MAX", "VERIFY_SPLIT", "SeqRows",
    "SpecFirstTokenProf", "SpecPhaseNs", "SpecRoundProf", "SpecRoundsLog", "VerifySplit", "f32",
    "round_prof", "round_prof_from_ns", "summary_text",
]  # fmt: skip

#: Rounds the per-round depth log keeps per session (lane/spec-route-depth-20260902).
SPEC_PROF_ROUNDS = 64

U16_MAX = (1 << 16) - 1
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1

_F32 = struct.Struct("<f")
#: A row as the seed stores it: five ms f32, k and j u16, ctx and seq_rows u32. Packing
#: rounds the floats to f32 and refuses a count out of its range (struct.error), in one call.
_ROW = struct.Struct("<5f2H2I")
_INF = math.inf
_tuple_new = tuple.__new__
_PHASE_NS_FIELDS = ("draft", "verify", "accept", "roll", "maint", "rounds")


def f32(x: float) -> float:
    """Round a double to the nearest f32 (as Rust's ``as f32`` does), overflow -> +-inf."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _uint(name: str, v: object, top: int) -> int:
    # bool is an int in Python; a True/False count is always a caller bug. numpy's ints count,
    # numpy's bool not (numpy < 2.3, all of Python 3.10's, still gives it an ``__index__``).
    if type(v) is not int:
        if type(v).__name__ in ("bool", "bool_") or not hasattr(v, "__index__"):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
        v = operator.index(v)
    if v < 0 or v > top:
        raise ValueError(f"{name}={v} is out of range 0..={top}")
    return v


def _added_ns(call: str, vals: tuple[Any, ...]) -> tuple[int, ...] | None:
    """What a loop adds to an accumulator, in ns: ints, floats rounded; else None, said once
    (the loop's instrumentation never raises into it)."""
    try:  # ints (numpy's too) as they are; floats (numpy's float32 too) rounded; never a str
        out = tuple([operator.index(v) if hasattr(v, "__index__") else round(v.__float__())
                     for v in vals])  # fmt: skip
        if min(out) >= 0:
            return out
    except (TypeError, ValueError, OverflowError, AttributeError):
        pass
    say_once(call, f"{call}{vals!r}: expected nanoseconds >= 0; that call is ignored")
    return None


def _ms(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, numbers.Real)):  # numpy's too
        unit = "MB" if name.endswith("_mb") else "milliseconds"
        raise TypeError(f"{name} must be a number of {unit}, got {type(v).__name__} {v!r}")
    x = float(v)
    if not math.isfinite(x) or x < 0.0:
        raise ValueError(f"{name}={v!r} must be a finite, non-negative duration")
    return x


@dataclass(slots=True)
class SpecPhaseNs:
    """Per-burst phase counters (ns), u64 with wrapping adds as in the seed's release build."""

    draft: int = 0
    verify: int = 0
    accept: int = 0
    roll: int = 0
    maint: int = 0
    rounds: int = 0

    def __post_init__(self) -> None:
        for f in _PHASE_NS_FIELDS:
            setattr(self, f, _uint(f"SpecPhaseNs.{f}", getattr(self, f), U64_MAX))

    def add(self, o: SpecPhaseNs) -> None:
        """Fold another accumulator in (wrapping)."""
        for f in _PHASE_NS_FIELDS:
            setattr(self, f, (getattr(self, f) + getattr(o, f)) & U64_MAX)

    def phases(self) -> tuple[int, int, int, int, int]:
        """(draft, verify, accept, roll, maint): the order of ``PHASES`` and the lines."""
        return self.draft, self.verify, self.accept, self.roll, self.maint

    def total(self) -> int:
        """draft + verify + accept + roll + maint, wrapping like the seed's u64 sum."""
        return (self.draft + self.verify + self.accept + self.roll + self.maint) & U64_MAX


class VerifySplit:
    """Level-2 verify sub-split accumulators (ns): kda (with its scan share), mla, the ffn share
    of vrest. The seed's atomics; one lock here, so ``drain`` reads-and-zeroes all four at once."""

    __slots__ = ("_lock", "_v")

    def __init__(self, kda: int = 0, kda_scan: int = 0, mla: int = 0, ffn: int = 0) -> None:
        vals = {"kda": kda, "kda_scan": kda_scan, "mla": mla, "ffn": ffn}
        self._v = [_uint(f"VerifySplit.{n}", v, U64_MAX) for n, v in vals.items()]
        self._lock = threading.Lock()

    def add(self, kda: float = 0, kda_scan: float = 0, mla: float = 0, ffn: float = 0) -> None:
        """Add nanoseconds (floats rounded) to the buckets (wrapping u64, like ``fetch_add``)."""
        v: tuple[Any, ...] = (kda, kda_scan, mla, ffn)  # ints here, or _added_ns rounds them
        fast = type(kda) is type(kda_scan) is type(mla) is type(ffn) is int and min(v) >= 0
        if (d := v if fast else _added_ns("VerifySplit.add", v)) is None:
            return
        with self._lock:
            self._v = [(a + b) & U64_MAX for a, b in zip(self._v, d, strict=True)]

    def drain(self) -> tuple[int, int, int, int]:
        """Read and zero all four buckets at once: ``(kda, kda_scan, mla, ffn)``."""
        v = self._v  # replaced, never edited: all zero needs no lock (most rounds' case)
        if not (v[0] or v[1] or v[2] or v[3]):
            return (0, 0, 0, 0)
        with self._lock:
            out, self._v = self._v, [0, 0, 0, 0]
        return (out[0], out[1], out[2], out[3])

    def peek(self) -> tuple[int, int, int, int]:
        """The current values, without zeroing (the list is replaced, never edited: no lock)."""
        v = self._v
        return (v[0], v[1], v[2], v[3])

    def __repr__(self) -> str:
        return "VerifySplit(kda={}, kda_scan={}, mla={}, ffn={})".format(*self.peek())

    def __eq__(self, other: object) -> bool:
        return self.peek() == other.peek() if isinstance(other, VerifySplit) else NotImplemented


class SeqRows:
    """Verify rows that took the per-row arm (the seed's ``V_SEQ_ROWS``), taken per round."""

    __slots__ = ("_lock", "_n")

    def __init__(self, n: int = 0) -> None:
        self._n = _uint("SeqRows", n, U64_MAX)
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if type(n) is not int or n < 0:
            if (d := _added_ns("SeqRows.add", (n,))) is None:
                return
            n = d[0]
        with self._lock:
            self._n = (self._n + n) & U64_MAX

    def take(self) -> int:
        if not self._n:  # nothing added (most loops' case): no lock
            return 0
        with self._lock:
            n, self._n = self._n, 0
        return n


class _PerThread:
    """An accumulator per calling thread, so sessions on different threads never mix. The hot
    calls (``add``, ``take``, ``drain``) are spelled out: ``__getattr__`` costs ~0.45 µs each."""

    __slots__ = ("_local", "_make")

    def __init__(self, make: Any) -> None:
        self._local = threading.local()
        self._make = make

    def _acc(self) -> Any:
        try:
            return self._local.acc
        except AttributeError:
            acc = self._local.acc = self._make()
            return acc

    def add(self, *args: Any, **kw: Any) -> None:
        self._acc().add(*args, **kw)

    def take(self) -> int:
        return self._acc().take()

    def drain(self) -> tuple[int, int, int, int]:
        return self._acc().drain()

    def __getattr__(self, name: str) -> Any:  # peek, and anything else of this thread's
        return getattr(self._acc(), name)


#: The level-2 verify accumulators (the seed's V_KDA_NS ... V_FFN_NS), one per thread.
VERIFY_SPLIT: VerifySplit = _PerThread(VerifySplit)  # type: ignore[assignment]
#: The per-row-arm verify row counter (the seed's V_SEQ_ROWS), one per thread.
SEQ_ROWS: SeqRows = _PerThread(SeqRows)  # type: ignore[assignment]


@dataclass
class SpecFirstTokenProf:
    """One session's first-token buckets (ms), the ``[spec-prof]`` line: wall intervals between
    stream drains (device-inclusive, additive), checked on assignment so bad values fail there."""

    cache_alloc_ms: float = 0.0  #: creation: the trunk cache allocation
    prime_ms: float = 0.0  #: creation: the target prime over the prompt (tap DtoHs included)
    capture_ms: float = 0.0  #: creation: the prompt-boundary prefix capture
    anchor_ms: float = 0.0  #: creation: the boundary token draw
    draft_alloc_ms: float = 0.0  #: creation: the draft-source state build
    draft_prime_ms: float = 0.0  #: round 1: the drafter's ingest of the whole prompt
    first_draft_ms: float = 0.0  #: round 1: draft production after the ingest
    first_verify_ms: float = 0.0  #: round 1: the t=K+1 verify walk
    first_accept_ms: float = 0.0  #: round 1: the accept walk
    first_roll_ms: float = 0.0  #: round 1: the trunk rollback to the accepted prefix
    first_maint_ms: float = 0.0  #: round 1: draft-source maintenance
    first_round_tokens: int = 0  #: round 1: tokens committed (j accepted + the bonus)
    first_burst_ms: float = 0.0  #: first burst: entry to return, no extra drains
    first_burst_hook_ms: float = 0.0  #: first burst: inside the caller's commit hook
    first_burst_rounds: int = 0  #: first burst: rounds it ran
    first_burst_tokens: int = 0  #: first burst: tokens it returned (anchor included)
    sink_alloc_ms: float = 0.0  #: creation: the prime tap sink's host allocation
    prime_tap_dtoh_ms: float = 0.0  #: inside the prime: the host-staged tap DtoHs
    draft_prime_h2d_ms: float = 0.0  #: drafter prime split: host->device tap rows
    draft_prime_feat_ms: float = 0.0  #: drafter prime split: the fc feature GEMM
    draft_prime_kv_ms: float = 0.0  #: drafter prime split: the k/v ingest
    draft_prime_rows: int = 0  #: drafter prime geometry: rows ingested
    draft_prime_chunks: int = 0  #: drafter prime geometry: chunks
    draft_prime_arm: str = ""  #: which arm ran (``eager`` / ``chunked``; "" when none)
    draft_kv_mb: float = 0.0  #: the drafter ctx KV allocation at the session ctx, MB
    #: Free MB per CUDA ordinal before the trunk cache / after the drafter KV allocation.
    free_mb_before: list[tuple[int, int]] = field(default_factory=list)
    free_mb_after: list[tuple[int, int]] = field(default_factory=list)
    #: Not in the seed: what no bucket covers up to the first burst's return, so they add up.
    unattributed_ms: float = 0.0

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, _check_first_token(name, value))

    def total_ms(self) -> float:
        """Creation plus the first burst (shares and round-1 buckets sit inside others)."""
        return (
            self.cache_alloc_ms + self.sink_alloc_ms + self.prime_ms + self.capture_ms
            + self.anchor_ms + self.draft_alloc_ms + self.first_burst_ms + self.unattributed_ms
        )  # fmt: skip


#: Every field of SpecFirstTokenProf in declaration order (the [spec-prof] line's order).
FIRST_TOKEN_FIELDS = tuple(f.name for f in fields(SpecFirstTokenProf))
#: Its ms buckets, in that order.
FIRST_TOKEN_MS_FIELDS = tuple(f for f in FIRST_TOKEN_FIELDS if f.endswith("_ms"))
_FT_FLOAT = frozenset((*FIRST_TOKEN_MS_FIELDS, "draft_kv_mb"))
_FT_FREE = frozenset(("free_mb_before", "free_mb_after"))
_FT_COUNT = frozenset(FIRST_TOKEN_FIELDS) - _FT_FLOAT - _FT_FREE - {"draft_prime_arm"}
_ARM = re.compile(r"[A-Za-z0-9_.:+-]*")


def _check_first_token(name: str, value: object) -> object:
    label = f"SpecFirstTokenProf.{name}"
    if name in _FT_FLOAT:
        return _ms(label, value)
    if name in _FT_COUNT:
        return _uint(label, value, U64_MAX)
    if name == "draft_prime_arm":
        if not isinstance(value, str) or not _ARM.fullmatch(value):
            raise ValueError(f"{label} must be a word like 'eager' or 'chunked', got {value!r}")
        return value
    if name in _FT_FREE:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{label} must be a list of (cuda_ordinal, free_mb) pairs: {value!r}")
        out = []
        for i, pair in enumerate(value):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"{label}[{i}] must be a (cuda_ordinal, free_mb) pair: {pair!r}")
            out.append((_uint(f"{label}[{i}].ordinal", pair[0], U64_MAX),
                        _uint(f"{label}[{i}].free_mb", pair[1], U64_MAX)))  # fmt: skip
        return out
    raise AttributeError(f"SpecFirstTokenProf has no field {name!r}")


class _RoundProfFields(NamedTuple):
    wall_ms: float = 0.0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    accept_ms: float = 0.0
    rest_ms: float = 0.0
    k: int = 0
    j: int = 0
    ctx: int = 0
    seq_rows: int = 0


class SpecRoundProf(_RoundProfFields):
    """A round's row of the log, stored as the seed does (ms f32, ``k``/``j`` u16, ``ctx``/
    ``seq_rows`` u32; out of range raises naming the field). A tuple: :func:`round_prof` is fast."""

    __slots__ = ()

    def phase_ns(self) -> tuple[int, int, int, int, int]:
        """(draft, verify, accept, rollback + maint, 0) ns: a row as a round for analysis."""
        return (round(self.draft_ms * 1e6), round(self.verify_ms * 1e6),
                round(self.accept_ms * 1e6), round(self.rest_ms * 1e6), 0)  # fmt: skip

    def __new__(cls, wall_ms: float = 0.0, draft_ms: float = 0.0, verify_ms: float = 0.0,
                accept_ms: float = 0.0, rest_ms: float = 0.0, k: int = 0, j: int = 0,
                ctx: int = 0, seq_rows: int = 0) -> SpecRoundProf:  # fmt: skip
        ms, vals = [], (wall_ms, draft_ms, verify_ms, accept_ms, rest_ms)
        for name, v in zip(cls._fields[:5], vals, strict=True):
            x = _ms(f"SpecRoundProf.{name}", v)
            if math.isinf(y := f32(x)):
                raise ValueError(f"SpecRoundProf.{name}={x!r} does not fit in an f32")
            ms.append(y)
        counts = [_uint(f"SpecRoundProf.{n}", v, top) for n, v, top in
                  (("k", k, U16_MAX), ("j", j, U16_MAX), ("ctx", ctx, U32_MAX),
                   ("seq_rows", seq_rows, U32_MAX))]  # fmt: skip
        return _tuple_new(cls, (*ms, *counts))


def round_prof(wall_ms: float, draft_ms: float, verify_ms: float, accept_ms: float,
               rest_ms: float, k: int, j: int, ctx: int, seq_rows: int) -> SpecRoundProf:  # fmt: skip
    """A row, the fast way: floats and ints in range (``0 <= x < inf`` is False for NaN); the
    rest (a bool, a str, an int of ms) goes through the constructor, which names the field."""
    if (
        type(k) is int and type(j) is int and type(ctx) is int and type(seq_rows) is int
        and type(wall_ms) is float and type(draft_ms) is float and type(verify_ms) is float
        and type(accept_ms) is float and type(rest_ms) is float
        and 0 <= wall_ms < _INF and 0 <= draft_ms < _INF and 0 <= verify_ms < _INF
        and 0 <= accept_ms < _INF and 0 <= rest_ms < _INF
    ):  # fmt: skip
        try:  # the counts' ranges are the struct's (U16_MAX, U32_MAX)
            row = _ROW.pack(wall_ms, draft_ms, verify_ms, accept_ms, rest_ms, k, j, ctx, seq_rows)
            return _tuple_new(SpecRoundProf, _ROW.unpack(row))
        except (OverflowError, struct.error):  # past an f32, a count out of range
            pass
    return SpecRoundProf(wall_ms, draft_ms, verify_ms, accept_ms, rest_ms, k, j, ctx, seq_rows)


def round_prof_from_ns(
    wall: int, draft: int, verify: int, accept: int, rest: int, k: int, j: int, ctx: int, seq: int
) -> SpecRoundProf:
    """:func:`round_prof` from nanosecond phase lengths."""
    return round_prof(
        wall / 1e6, draft / 1e6, verify / 1e6, accept / 1e6, rest / 1e6, k, j, ctx, seq
    )


@dataclass
class SpecRoundsLog:
    """The per-session round log behind ``[spec-prof-rounds]`` / ``[spec-prof-summary]``."""

    rounds: list[SpecRoundProf] = field(default_factory=list)
    printed: int = 0  #: rows already handed to the printer
    summarized: bool = False

    def wants_more(self) -> bool:
        return len(self.rounds) < SPEC_PROF_ROUNDS

    def push(self, r: SpecRoundProf) -> None:
        if not isinstance(r, SpecRoundProf):
            raise TypeError(f"SpecRoundsLog.push takes a SpecRoundProf, got {type(r).__name__}")
        if self.wants_more():
            self.rounds.append(r)

    def fresh(self) -> list[SpecRoundProf]:
        """Rows not yet printed; marks them printed."""
        start, self.printed = self.printed, len(self.rounds)
        return self.rounds[start:]

    def summary(self) -> str:
        """The seed's one-line summary, computed its way: left folds of f64 from -0.0, the mean
        over the *sorted* walls, the slow threshold ``1.5 * med`` an f32 product."""
        rs, n = self.rounds, len(self.rounds)
        if n == 0:
            return "rounds=0"
        nf = float(n)
        k, j = _fsum(float(r.k) for r in rs), _fsum(float(r.j) for r in rs)
        walls = sorted(r.wall_ms for r in rs)  # stable, like slice::sort_by
        return summary_text(
            n, k / nf, j / nf, j / k if k > 0.0 else 0.0, (j + nf) / nf, _fsum(walls) / nf,
            walls[0], walls[n // 2], walls[n - 1], _slow(walls),
            _fsum(r.draft_ms for r in rs) / nf, _fsum(r.verify_ms for r in rs) / nf,
            sum(r.seq_rows for r in rs), rs[0].ctx, rs[n - 1].ctx,
        )  # fmt: skip

    def slow_rounds(self) -> int:
        """Rounds past 1.5x the median wall (the summary's bimodality count)."""
        return _slow(sorted(r.wall_ms for r in self.rounds)) if self.rounds else 0


def _slow(walls: list[float]) -> int:
    """Sorted walls past the seed's f32 threshold ``1.5 * med`` (``med = walls[n / 2]``)."""
    threshold = f32(1.5 * walls[len(walls) // 2])
    return sum(1 for w in walls if w > threshold)


def summary_text(n: int, k_mean: float, j_mean: float, accept: float, tok_per_round: float,
                 wall_mean: float, wall_min: float, wall_med: float, wall_max: float, slow: int,
                 draft_mean: float, verify_mean: float, seq_rows_total: int, ctx_first: int,
                 ctx_last: int) -> str:  # fmt: skip
    """The summary's text (the seed's format string), from its values."""
    return (
        f"rounds={n} k_mean={k_mean:.2f} j_mean={j_mean:.2f} accept={accept:.3f} "
        f"tok_per_round={tok_per_round:.2f} wall_ms mean={wall_mean:.1f} min={wall_min:.1f} "
        f"med={wall_med:.1f} max={wall_max:.1f} slow_rounds(>1.5x med)={slow} "
        f"draft_mean={draft_mean:.1f} verify_mean={verify_mean:.1f} "
        f"seq_rows_total={seq_rows_total} ctx_first={ctx_first} ctx_last={ctx_last}"
    )


def _fsum(xs: Iterable[float]) -> float:
    """Rust's ``Iterator::sum::<f64>()``: a left fold from -0.0 (builtins.sum compensates)."""
    return functools.reduce(operator.add, xs, -0.0)
