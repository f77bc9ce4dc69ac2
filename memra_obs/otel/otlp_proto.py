"""A small protobuf writer for OTLP ``ExportTraceServiceRequest``, fast enough to run
beside a serving loop.

The SDK's encoder builds a message object per span and per attribute (and hashes the
resource per span): ~23 µs a span here. This writes the wire bytes directly from span
tuples (:mod:`memra_obs.otel.spans`), with every constant piece — resource, scope, span
names, attribute keys, small integer values — encoded once and reused: a few µs a span.
Only the fields we emit are written; the tests decode every shape with
``opentelemetry.proto`` to hold it to the schema.

Wire layout (field numbers from ``opentelemetry/proto/trace/v1/trace.proto``)::

    ExportTraceServiceRequest { 1: ResourceSpans { 1: Resource, 2: ScopeSpans {
        1: InstrumentationScope, 2: Span* } } }
    Span { 1 trace_id, 2 span_id, 4 parent_span_id, 5 name, 6 kind, 7 start (fixed64),
           8 end (fixed64), 9 attributes*, 15 status, 16 flags (fixed32) }
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

from .spans import Span

__all__ = ["ProtoEncoder", "encode_any_value", "varint"]

_M64 = (1 << 64) - 1
_B1 = [bytes((i,)) for i in range(128)]
_TIMES = struct.Struct("<BQBQ")  # 0x39 start_time_unix_nano, 0x41 end_time_unix_nano
_DOUBLE = struct.Struct("<Bd")
_F64 = struct.Struct("<d")
#: Span.flags: W3C sampled + "has is_remote" (the parent is known to be local), as the SDK
#: writes for a span whose parent is in-process.
SPAN_FLAGS = 0x101
_FLAGS = b"\x85\x01" + struct.pack("<I", SPAN_FLAGS)  # field 16, wire type 5
_KIND_INTERNAL = b"\x30\x01"


def varint(n: int) -> bytes:
    """Base-128 varint of a non-negative int (negative int64s: pass ``n & (2**64-1)``)."""
    if n < 128:
        return _B1[n]
    # Unrolled for the common sizes (ctx, durations in ns): a third of the loop's cost.
    if n < 16384:
        return bytes(((n & 127) | 128, n >> 7))
    if n < 2097152:
        return bytes(((n & 127) | 128, ((n >> 7) & 127) | 128, n >> 14))
    if n < 268435456:
        return bytes(((n & 127) | 128, ((n >> 7) & 127) | 128, ((n >> 14) & 127) | 128, n >> 21))
    out = bytearray()
    while n > 127:
        out.append((n & 127) | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, body: bytes) -> bytes:
    """A length-delimited field: tag byte(s), length, body."""
    return varint(tag) + varint(len(body)) + body


def encode_any_value(v: Any) -> bytes:
    """The body of an ``AnyValue`` message for a Python attribute value."""
    tv = type(v)
    if tv is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if tv is int:
        return b"\x18" + varint(v & _M64)
    if tv is float:
        return _DOUBLE.pack(0x21, v)
    if tv is str:
        return _field(0x0A, v.encode("utf-8", "replace"))
    if tv is bytes:
        return _field(0x3A, v)
    for base in (bool, int, float, str):  # subclasses (IntEnum, str enums, ...)
        if isinstance(v, base):
            return encode_any_value(base(v))
    if isinstance(v, Sequence):  # ArrayValue { 1: AnyValue* }
        inner = b"".join(_field(0x0A, encode_any_value(x)) for x in v)
        return _field(0x2A, inner)
    if isinstance(v, Mapping):  # KeyValueList { 1: KeyValue* }
        inner = b"".join(_field(0x0A, _kv_body(str(k), x)) for k, x in v.items())
        return _field(0x32, inner)
    return _field(0x0A, str(v).encode("utf-8", "replace"))


def _kv_body(key: str, v: Any) -> bytes:
    return _field(0x0A, key.encode("utf-8", "replace")) + _field(0x12, encode_any_value(v))


def _kv_list(attrs: Mapping[str, Any], tag: int) -> bytes:
    return b"".join(_field(tag, _kv_body(k, v)) for k, v in attrs.items())


def _key_entry(key: str) -> tuple[list[bytes], list[bytes], bytes, bytes]:
    """Everything about attribute ``key`` that does not depend on the value, encoded once:
    whole ``Span.attributes`` fields for ints 0..255; the head of the field for an int of
    each varint length (1..10 bytes; the varint follows); the head for a double (8 bytes
    follow); and the ``KeyValue.key`` field for any other value."""
    kb = _field(0x0A, key.encode("utf-8", "replace"))
    small = [_field(0x4A, kb + _field(0x12, b"\x18" + varint(i))) for i in range(256)]
    ints = [b""] + [
        b"\x4a" + varint(len(kb) + 3 + n) + kb + b"\x12" + _B1[n + 1] + b"\x18"
        for n in range(1, 11)
    ]
    dbl = b"\x4a" + varint(len(kb) + 11) + kb + b"\x12\x09\x21"
    return small, ints, dbl, kb


class ProtoEncoder:
    """Encodes span tuples to ``Span`` fields and wraps them into requests.

    ``span(sp)`` returns one complete ``ScopeSpans.spans`` field (tag + length + body), so a
    request is only a join of precomputed headers and those fragments. Caches are bounded
    by what they hold: span names and attribute keys (a fixed vocabulary), trace ids of the
    sessions in flight (cleared past ``max_traces``).
    """

    __slots__ = ("_head", "_kv", "_last_parent", "_names", "_traces", "bad", "max_traces")

    def __init__(
        self,
        resource: Mapping[str, Any],
        scope_name: str,
        scope_version: str = "",
        *,
        resource_schema_url: str = "",
        max_traces: int = 4096,
    ) -> None:
        res = _kv_list(resource, 0x0A)  # Resource { 1: KeyValue* }
        scope = _field(0x0A, scope_name.encode())
        if scope_version:
            scope += _field(0x12, scope_version.encode())
        self._head = (_field(0x0A, res), _field(0x0A, scope), resource_schema_url.encode())
        self._names: dict[str, bytes] = {}
        self._kv: dict[str, tuple[list[bytes], list[bytes], bytes, bytes]] = {}
        self._traces: dict[int, bytes] = {}
        self.max_traces = max_traces
        #: Spans skipped because a value could not be encoded.
        self.bad = 0
        # Phase spans come in fives under one round: reuse the parent's encoded id.
        self._last_parent = (0, b"")

    # -- spans ---------------------------------------------------------------------------

    def spans(self, spans: Sequence[Span], out: list[bytes]) -> int:
        """Append one encoded fragment per span to ``out``; returns the bytes added."""
        enc = self.span
        n = 0
        for sp in spans:
            try:
                b = enc(sp)
            except Exception:  # a value the wire cannot carry (negative time, ...)
                self.bad += 1
                continue
            n += len(b)
            out.append(b)
        return n

    def span(self, sp: Span) -> bytes:
        name, tid, sid, pid, start, end, attrs, status = sp
        head = self._traces.get(tid)
        if head is None:
            if len(self._traces) >= self.max_traces:
                self._traces.clear()
            head = self._traces[tid] = b"\x0a\x10" + tid.to_bytes(16, "big") + b"\x12\x08"
        nm = self._names.get(name)
        if nm is None:
            nm = self._names[name] = _field(0x2A, name.encode()) + _KIND_INTERNAL
        if pid:
            lp = self._last_parent
            if lp[0] == pid:
                pfield = lp[1]
            else:
                pfield = b"\x22\x08" + pid.to_bytes(8, "big")
                self._last_parent = (pid, pfield)
            parts = [head, sid.to_bytes(8, "big"), pfield, nm]
        else:
            parts = [head, sid.to_bytes(8, "big"), nm]
        parts.append(_TIMES.pack(0x39, start, 0x41, end))
        if attrs:
            kvc = self._kv
            for k, v in attrs:
                ent = kvc.get(k)
                if ent is None:
                    ent = kvc[k] = _key_entry(k)
                tv = type(v)
                if tv is int:
                    if 0 <= v < 256:
                        parts.append(ent[0][v])
                    else:
                        vi = varint(v & _M64)
                        parts.append(ent[1][len(vi)])
                        parts.append(vi)
                elif tv is float:
                    parts.append(ent[2])
                    parts.append(_F64.pack(v))
                else:
                    body = ent[3] + _field(0x12, encode_any_value(v))
                    parts.append(b"\x4a" + varint(len(body)) + body)
        if status is not None:
            code, msg = status
            st = _field(0x12, msg.encode("utf-8", "replace")) if msg else b""
            st += b"\x18" + varint(code)
            parts.append(_field(0x7A, st))  # field 15
        parts.append(_FLAGS)
        body = b"".join(parts)
        ln = len(body)
        return (b"\x12" + _B1[ln] if ln < 128 else b"\x12" + varint(ln)) + body

    # -- requests ------------------------------------------------------------------------

    def request(self, fragments: Sequence[bytes], size: int | None = None) -> bytes:
        """One ``ExportTraceServiceRequest`` holding the encoded spans (one resource, one
        scope). ``size`` is ``sum(map(len, fragments))`` when the caller kept it."""
        res, scope, schema = self._head
        if size is None:
            size = sum(map(len, fragments))
        ss_len = len(scope) + size
        ss_head = b"\x12" + varint(ss_len)
        rs_tail = _field(0x1A, schema) if schema else b""
        rs_len = len(res) + len(ss_head) + ss_len + len(rs_tail)
        return b"".join((b"\x0a", varint(rs_len), res, ss_head, scope, *fragments, rs_tail))
