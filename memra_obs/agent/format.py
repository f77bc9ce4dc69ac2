"""The ring file's layout and the binary codec of every record that travels through it.

One file per worker process (``<dir>/ring-<worker>-<pid>-<nonce>.ring``), mmap'd by the worker
(sole writer) and by the host's agent (sole reader)::

    [0, 4096)          header: identity and geometry (written once), the writer's cursor
                       (``head``, ``rec_next``) and the reader's cursor (``read_pos``,
                       ``read_rec``) on separate cache lines
    [4096, +T*256)     session table: the SessionRecord of every session still open, so a
                       restarted agent (or one that lost a SessionRecord to overwrite) can
                       rebuild the context of the rounds it reads next
    [data, +N*128)     N slots of 128 bytes (N a power of two)

A slot is ``seq u64 | meta u64 | payload[112]``. ``seq`` is the slot's absolute position + 1
(0 = never written); ``meta`` packs ``rec << 16 | kind << 8 | span``: ``rec`` is the record's
ordinal in the worker's stream (so a reader counts lost *records* exactly, whatever their
size), ``span`` the number of consecutive slots the record covers (1 for a round, 2 for a
level-2 burst, up to :data:`MAXSPAN` for a first-token profile). Continuation slots carry
kind 0 and their index in the low byte. All integers are little-endian.

Nothing here touches a file; :mod:`.ring` writes, :mod:`.reader` reads.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from ..records import FIRST_TOKEN_FIELDS, FIRST_TOKEN_MS_FIELDS, SpecFirstTokenProf, SpecPhaseNs
from ..timeline import (
    BurstRecord,
    FirstTokenRecord,
    Record,
    RoundRecord,
    SessionEndRecord,
    SessionRecord,
)

__all__ = [
    "HEADER",
    "MAGIC",
    "MAXSPAN",
    "PAYLOAD",
    "SLOT",
    "TABLE_ENTRY",
    "VERSION",
    "Geometry",
    "decode",
    "encode",
]

MAGIC = b"MEMRAOBS"
VERSION = 1
HEADER = 4096
SLOT = 128
SLOT_SHIFT = 7
SLOT_HDR = 16
PAYLOAD = SLOT - SLOT_HDR
#: Largest record, in slots (a first-token profile with 16 devices' free memory fits in 10).
MAXSPAN = 16
#: Smallest ring: a writer in flight never reaches a slot the reader may still be copying.
MIN_SLOTS = 4 * MAXSPAN
TABLE_ENTRY = 256
TABLE_HDR = 24

KIND_CONT = 0
KIND_SESSION = 1
KIND_ROUND = 2
KIND_ROUND_SPLIT = 3
KIND_BURST = 4
KIND_BURST_SPLIT = 5
KIND_FIRST_TOKEN = 6
KIND_SESSION_END = 7

# -- header fields (offsets) -------------------------------------------------------------

#: magic, version, slot size, slots, maxspan, table entries, table entry size, data offset,
#: writer pid, created (epoch ns), worker label (u8 length + 63 bytes).
IDENT = struct.Struct("<8sIIIIIIIIQB63s")
#: Writer-owned, hot: positions published, records published. One store per record.
OFF_HEAD = 192
HEAD = struct.Struct("<QQ")
#: Writer-owned, cold: records refused (could not be encoded), sessions not in the table,
#: clean-shutdown flag.
OFF_WSTAT = 256
WSTAT = struct.Struct("<QQI")
#: Reader-owned: the persisted cursor (next position, next record), records the readers
#: counted as lost, and the pid of the agent that last committed.
OFF_READER = 320
READER = struct.Struct("<QQQQ")

U64 = struct.Struct("<Q")
SLOT_HEAD = struct.Struct("<QQ")
#: seq, meta, then RoundRecord: session, burst, index, t0..t5, k, j, ctx, seq_rows (+ split).
ROUND = struct.Struct("<QQQII6QIIII")
ROUND_SPLIT = struct.Struct("<QQQII6QIIII4Q")
assert ROUND_SPLIT.size <= SLOT
#: Table entry: seq (ring position of the SessionRecord + 1; 0 = free), local session id,
#: payload length, then the SessionRecord payload.
TABLE_ENTRY_HEAD = struct.Struct("<QQQ")


class Geometry:
    """Offsets of one ring, from its slot count and table size."""

    __slots__ = ("data_off", "mask", "size", "slots", "table_entries", "table_off")

    def __init__(self, slots: int, table_entries: int) -> None:
        if slots < MIN_SLOTS or slots & (slots - 1):
            raise ValueError(f"ring slots={slots}: expected a power of two >= {MIN_SLOTS}")
        self.slots = slots
        self.mask = slots - 1
        self.table_entries = table_entries
        self.table_off = HEADER
        # Page-align the slots so the hot stores never share a page with the table.
        self.data_off = -(-(HEADER + table_entries * TABLE_ENTRY) // 4096) * 4096
        self.size = self.data_off + slots * SLOT


# ------------------------------------------------------------------------------- codec
#
# Payloads are what follows the 16-byte slot header, concatenated over a record's slots.
# Rounds are packed straight into the slot by the writer's fast path (ROUND/ROUND_SPLIT
# above); everything else goes through ``encode`` (rare: a few per burst).

_SESSION = struct.Struct("<QQQQQQQQBBB")
_BURST = struct.Struct("<QII QQ 6Q QQQ".replace(" ", ""))
_SPLIT = struct.Struct("<4Q")
_END = struct.Struct("<QQQQQ")
_STR = struct.Struct("<H")
_PAIR = struct.Struct("<QQ")
_IV = struct.Struct("<QQ")
_FT_COUNT_FIELDS = tuple(
    f
    for f in FIRST_TOKEN_FIELDS
    if f not in FIRST_TOKEN_MS_FIELDS
    and f not in ("draft_prime_arm", "draft_kv_mb", "free_mb_before", "free_mb_after")
)
_FT_MS = struct.Struct(f"<{len(FIRST_TOKEN_MS_FIELDS)}d")
_FT_COUNTS = struct.Struct(f"<{len(_FT_COUNT_FIELDS)}Qd")
_MASK64 = (1 << 64) - 1


def _s(text: str) -> bytes:
    b = text.encode("utf-8")
    return _STR.pack(len(b)) + b


def _read_s(buf: bytes | memoryview, off: int) -> tuple[str, int]:
    (n,) = _STR.unpack_from(buf, off)
    off += 2
    return bytes(buf[off : off + n]).decode("utf-8"), off + n


def encode_session(r: SessionRecord, in_table: bool) -> bytes:
    """``in_table`` tells the agent whether this session's end can be inferred from the table."""
    return (
        _SESSION.pack(
            r.session,
            r.start_ns_mono,
            r.anchor_ns_mono,
            r.anchor_ns_epoch,
            (r.trace_id >> 64) & _MASK64,
            r.trace_id & _MASK64,
            r.span_id,
            r.parent_span_id,
            r.level,
            1 if r.prof else 0,
            1 if in_table else 0,
        )
        + _s(r.family)
        + _s(r.tag)
        + _s(r.tag_v)
        + _s(r.worker)
    )


def decode_session(buf: bytes | memoryview) -> tuple[SessionRecord, bool]:
    (sid, start, am, ae, thi, tlo, span, parent, level, prof, in_table) = _SESSION.unpack_from(buf)
    off = _SESSION.size
    family, off = _read_s(buf, off)
    tag, off = _read_s(buf, off)
    tag_v, off = _read_s(buf, off)
    worker, off = _read_s(buf, off)
    rec = SessionRecord(
        session=sid,
        family=family,
        tag=tag,
        tag_v=tag_v,
        worker=worker,
        start_ns_mono=start,
        anchor_ns_mono=am,
        anchor_ns_epoch=ae,
        trace_id=(thi << 64) | tlo,
        span_id=span,
        parent_span_id=parent,
        level=level,
        prof=bool(prof),
    )
    return rec, bool(in_table)


def _encode_burst(r: BurstRecord) -> tuple[int, bytes]:
    p = r.phases
    body = _BURST.pack(
        r.session, r.index, r.k, r.start_ns_mono, r.end_ns_mono,
        p.draft, p.verify, p.accept, p.roll, p.maint, p.rounds,
        r.tokens, r.hook_ns, r.first_round,
    )  # fmt: skip
    if r.split_ns is None:
        return KIND_BURST, body
    return KIND_BURST_SPLIT, body + _SPLIT.pack(*r.split_ns)


def _decode_burst(buf: bytes | memoryview, split: bool) -> BurstRecord:
    (sid, index, k, start, end, d, v, a, ro, m, n, tokens, hook, first) = _BURST.unpack_from(buf)
    return BurstRecord(
        session=sid,
        index=index,
        k=k,
        start_ns_mono=start,
        end_ns_mono=end,
        phases=SpecPhaseNs(d, v, a, ro, m, n),
        split_ns=_SPLIT.unpack_from(buf, _BURST.size) if split else None,
        tokens=tokens,
        hook_ns=hook,
        first_round=first,
    )


def _encode_first_token(r: FirstTokenRecord) -> bytes:
    p = r.prof
    parts = [
        U64.pack(r.session),
        _FT_MS.pack(*(getattr(p, f) for f in FIRST_TOKEN_MS_FIELDS)),
        _FT_COUNTS.pack(*(getattr(p, f) for f in _FT_COUNT_FIELDS), p.draft_kv_mb),
        _s(p.draft_prime_arm),
    ]
    for pairs in (p.free_mb_before, p.free_mb_after):
        parts.append(_STR.pack(len(pairs)))
        parts.extend(_PAIR.pack(o, mb) for o, mb in pairs)
    parts.append(_STR.pack(len(r.intervals)))
    for name, a, b in r.intervals:
        parts.append(_s(name) + _IV.pack(a, b))
    return b"".join(parts)


def _decode_first_token(buf: bytes | memoryview) -> FirstTokenRecord:
    (sid,) = U64.unpack_from(buf)
    off = 8
    ms = _FT_MS.unpack_from(buf, off)
    off += _FT_MS.size
    *counts, kv_mb = _FT_COUNTS.unpack_from(buf, off)
    off += _FT_COUNTS.size
    arm, off = _read_s(buf, off)
    lists: list[list[tuple[int, int]]] = []
    for _ in range(2):
        (n,) = _STR.unpack_from(buf, off)
        off += 2
        lists.append([_PAIR.unpack_from(buf, off + 16 * i) for i in range(n)])
        off += 16 * n
    (n,) = _STR.unpack_from(buf, off)
    off += 2
    ivs = []
    for _ in range(n):
        name, off = _read_s(buf, off)
        a, b = _IV.unpack_from(buf, off)
        off += 16
        ivs.append((name, a, b))
    kw: dict[str, Any] = dict(zip(FIRST_TOKEN_MS_FIELDS, ms, strict=True))
    kw.update(zip(_FT_COUNT_FIELDS, counts, strict=True))
    kw.update(
        draft_kv_mb=kv_mb, draft_prime_arm=arm, free_mb_before=lists[0], free_mb_after=lists[1]
    )
    return FirstTokenRecord(sid, SpecFirstTokenProf(**kw), tuple(ivs))


def _encode_end(r: SessionEndRecord) -> bytes:
    return _END.pack(r.session, r.end_ns_mono, r.rounds, r.bursts, r.tokens) + _s(r.error)


def _decode_end(buf: bytes | memoryview) -> SessionEndRecord:
    sid, end, rounds, bursts, tokens = _END.unpack_from(buf)
    err, _ = _read_s(buf, _END.size)
    return SessionEndRecord(sid, end, rounds, bursts, tokens, err)


def _encode_round(r: RoundRecord) -> tuple[int, bytes]:
    # The writer packs rounds in place; this is the same layout minus the slot header,
    # for tests and for a round that reaches the generic path.
    sid, burst, index, t, k, j, ctx, seq_rows, split, _ = r
    body = ROUND.pack(0, 0, sid, burst, index, *t, k, j, ctx, seq_rows)[SLOT_HDR:]
    if split is None:
        return KIND_ROUND, body
    return KIND_ROUND_SPLIT, body + _SPLIT.pack(*split)


_ROUND_BODY = struct.Struct(ROUND.format[0] + ROUND.format[3:])


def _decode_round(buf: bytes | memoryview, split: bool) -> RoundRecord:
    sid, burst, index, t0, t1, t2, t3, t4, t5, k, j, ctx, seq = _ROUND_BODY.unpack_from(buf)
    sp = _SPLIT.unpack_from(buf, _ROUND_BODY.size) if split else None
    return RoundRecord(sid, burst, index, (t0, t1, t2, t3, t4, t5), k, j, ctx, seq, sp)


def encode(rec: Record, in_table: bool = False) -> tuple[int, bytes]:
    """``(kind, payload)`` of a record; raises ``struct.error``/``TypeError`` on a value the
    format cannot hold (the writer counts those as refused)."""
    if isinstance(rec, RoundRecord):
        return _encode_round(rec)
    if isinstance(rec, BurstRecord):
        return _encode_burst(rec)
    if isinstance(rec, SessionRecord):
        return KIND_SESSION, encode_session(rec, in_table)
    if isinstance(rec, FirstTokenRecord):
        return KIND_FIRST_TOKEN, _encode_first_token(rec)
    if isinstance(rec, SessionEndRecord):
        return KIND_SESSION_END, _encode_end(rec)
    raise TypeError(f"{type(rec).__name__} does not travel through the ring")


_DECODERS: dict[int, Callable[[bytes | memoryview], Any]] = {
    KIND_SESSION: decode_session,
    KIND_ROUND: lambda b: _decode_round(b, False),
    KIND_ROUND_SPLIT: lambda b: _decode_round(b, True),
    KIND_BURST: lambda b: _decode_burst(b, False),
    KIND_BURST_SPLIT: lambda b: _decode_burst(b, True),
    KIND_FIRST_TOKEN: _decode_first_token,
    KIND_SESSION_END: _decode_end,
}


def decode(kind: int, payload: bytes | memoryview) -> Any:
    """The record of ``kind`` in ``payload``; a SessionRecord comes back as
    ``(record, in_table)``. Raises ``KeyError`` on an unknown kind."""
    return _DECODERS[kind](payload)
