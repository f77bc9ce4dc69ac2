"""The OTLP ``ExportTraceServiceRequest`` writers, protobuf and JSON, fast enough to run beside
a serving loop: wire bytes straight from span tuples, every constant piece (resource, scope,
span names, attribute keys, small integers) encoded once; the tests decode every shape with
``opentelemetry.proto``. The JSON is protobuf's mapping with OTLP's exceptions (lowerCamelCase,
hex ids, 64-bit integers as strings, enums as numbers), a request a line: what the embedded
default writes and the Collector's ``otlpjsonfile`` receiver replays. Goal (DESIGN §9): the
loop's p99 within 0.3 ms of none with spans on. The same records through the SDK on the same
worker give +1.8 to +5.1 ms: its span objects and encoder hold the loop's GIL (README, "How
they are built"; ``bench/bench_observer.py`` (d)). Field numbers::

    ExportTraceServiceRequest { 1: ResourceSpans { 1: Resource, 2: ScopeSpans {
        1: InstrumentationScope, 2: Span* }, 3: schema_url } }
    Span { 1 trace_id, 2 span_id, 4 parent_span_id, 5 name, 6 kind, 7 start (fixed64),
           8 end (fixed64), 9 attributes*, 15 status, 16 flags (fixed32) }
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from json.encoder import encode_basestring_ascii as _jascii  # the C escaper
from typing import Any

from .config import INSTANCE, instance_id
from .spans import Span

_M64 = (1 << 64) - 1
_I64 = 1 << 63
_B1 = [bytes((i,)) for i in range(128)]
_TIMES = struct.Struct("<BQBQ")  # 0x39 start_time_unix_nano, 0x41 end_time_unix_nano
_F64 = struct.Struct("<d")
_RANGE = struct.Struct("<QQQQ")  # JSON: refuse the times and ids the protobuf writer refuses
#: Span.flags: W3C sampled + "has is_remote" (the parent is local), as the SDK writes it.
SPAN_FLAGS = 0x101
_FLAGS = b"\x85\x01" + struct.pack("<I", SPAN_FLAGS)  # field 16, wire type 5
_JFLAGS = f',"flags":{SPAN_FLAGS}}}'
_KIND_INTERNAL = b"\x30\x01"


def _jstr(s: str) -> str:
    """``s`` as a JSON string of valid UTF-8: a lone surrogate (an undecodable file name in an
    exception's message) is ``?``, as the protobuf writer's; escaped as ``\\udcff``, protobuf's
    JSON parser refused the whole line."""
    return _jascii(s if s.isascii() else s.encode("utf-8", "replace").decode())


def varint(n: int) -> bytes:
    """Base-128 varint of a non-negative int (negative int64s: pass ``n & (2**64-1)``)."""
    if n < 128:
        return _B1[n]
    if n < 16384:  # unrolled for the common sizes (ctx, durations): a third of the cost
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
    return varint(tag) + varint(len(body)) + body


def _text(tag: int, s: str) -> bytes:
    return _field(tag, s.encode("utf-8", "replace"))


def _any(v: Any) -> bytes:
    """The body of an ``AnyValue`` message for a Python attribute value."""
    tv = type(v)
    if tv is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if tv is int:
        return b"\x18" + varint(v & _M64)
    if tv is float:
        return b"\x21" + _F64.pack(v)
    if tv is str:
        return _text(0x0A, v)
    for base in (bool, int, float, str):  # subclasses (IntEnum, str enums, ...)
        if isinstance(v, base):
            return _any(base(v))
    if isinstance(v, (tuple, list)):  # ArrayValue { 1: AnyValue* }
        return _field(0x2A, b"".join(_field(0x0A, _any(x)) for x in v))
    return _text(0x0A, str(v))


def _i64(v: int) -> int:
    """An int as the int64 the protobuf writer sends (two's complement wrap)."""
    return ((v + _I64) & _M64) - _I64


def _jany(v: Any) -> str:
    """An ``AnyValue`` JSON object for a Python attribute value."""
    tv = type(v)
    if tv is bool:
        return '{"boolValue":true}' if v else '{"boolValue":false}'
    if tv is int:
        return f'{{"intValue":"{_i64(v)}"}}'
    if tv is float:
        if math.isfinite(v):
            return f'{{"doubleValue":{v!r}}}'
        s = "NaN" if v != v else "Infinity" if v > 0 else "-Infinity"
        return f'{{"doubleValue":"{s}"}}'
    if tv is str:
        return f'{{"stringValue":{_jstr(v)}}}'
    for base in (bool, int, float, str):  # subclasses (IntEnum, str enums, ...)
        if isinstance(v, base):
            return _jany(base(v))
    if isinstance(v, (tuple, list)):
        return f'{{"arrayValue":{{"values":[{",".join(map(_jany, v))}]}}}}'
    return f'{{"stringValue":{_jstr(str(v))}}}'


class Encoder:
    """What both writers share: ``spans()`` (a span the format cannot carry is skipped and
    counted in ``bad``) and caches of names, keys (a fixed vocabulary) and live trace ids."""

    __slots__ = ("_head", "_keys", "_last_parent", "_made", "_names", "_traces", "bad")
    _SEP = 0  # bytes between fragments in a request
    max_traces = 4096
    span: Callable[[Span], Any]
    request: Callable[[Sequence[Any], int], bytes]  # fragments and the size spans() added
    _heads: Callable[[Mapping[str, Any], str, str, str], Any]
    _trace_head: Callable[[int], Any]
    _made: tuple[Mapping[str, Any], str, str, str] | None

    def __init__(
        self, resource: Mapping[str, Any], scope: str, version: str = "", *, schema_url: str = "",
        renew_instance: bool = False,
    ) -> None:  # fmt: skip
        self._head = self._heads(resource, scope, version, schema_url)
        self._made = (resource, scope, version, schema_url) if renew_instance else None
        self._names: dict[str, Any] = {}
        self._keys: dict[str, Any] = {}
        self._traces: dict[int, Any] = {}
        self.bad = 0
        self._last_parent: Any = (0, b"")  # phase spans come in fives under one round

    def after_fork(self) -> None:
        """In a forked child: a ``service.instance.id`` of its own where the SDK made the
        parent's (``renew_instance``), as the SDK's providers renew theirs: one per instance."""
        if self._made is not None and INSTANCE in self._made[0]:
            res, scope, version, schema = self._made
            self._made = ({**res, INSTANCE: instance_id()}, scope, version, schema)
            self._head = self._heads(*self._made)

    def spans(self, spans: Sequence[Span], out: list[Any]) -> int:
        """Append one fragment per span to ``out``; returns the size added."""
        enc, sep, n = self.span, self._SEP, 0
        for sp in spans:
            try:
                b = enc(sp)
            except Exception:  # a value the wire cannot carry (negative time, ...)
                self.bad += 1
                continue
            n += len(b) + sep
            out.append(b)
        return n

    def _trace(self, tid: int) -> Any:
        if len(self._traces) >= self.max_traces:
            self._traces.clear()
        return self._traces.setdefault(tid, self._trace_head(tid))


class _PerInt(dict[int, Any]):
    """A key's whole attribute for ints 0..255 (both writers'), each made at its first use:
    all 256 at once took ~0.3 ms a key on the export thread, and a first export's dozens of
    new keys held the GIL the loop needs for 5-11 ms (a slow round in Jaeger at +200 ms)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[int], Any]) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, i: int) -> Any:
        v = self[i] = self.make(i)
        return v


def _json_int(kh: str, i: int) -> str:
    """An OTLP/JSON attribute of int ``i`` under the key head ``kh``."""
    return f'{kh}{{"intValue":"{i}"}}}}'


def _key_entry(key: str) -> tuple[_PerInt, list[bytes], bytes, bytes]:
    """What of attribute ``key`` does not depend on the value: whole fields for ints 0..255;
    field heads for an int of each varint length and for a double; the key field."""
    kb = _text(0x0A, key)
    small = _PerInt(lambda i: _field(0x4A, kb + _field(0x12, b"\x18" + varint(i))))
    heads = [b"\x4a" + varint(len(kb) + 3 + n) + kb + b"\x12" + _B1[n + 1] for n in range(1, 11)]
    ints = [b""] + [h + b"\x18" for h in heads]
    return small, ints, b"\x4a" + varint(len(kb) + 11) + kb + b"\x12\x09\x21", kb


class ProtoEncoder(Encoder):
    """Span tuples to ``ScopeSpans.spans`` fields: a request joins precomputed heads and them."""

    __slots__ = ()

    def _heads(self, resource: Mapping[str, Any], name: str, version: str, schema: str) -> Any:
        kv = (_text(0x0A, k) + _field(0x12, _any(v)) for k, v in resource.items())
        scope = _field(0x0A, name.encode()) + (_field(0x12, version.encode()) if version else b"")
        tail = _field(0x1A, schema.encode()) if schema else b""
        return _field(0x0A, b"".join(_field(0x0A, x) for x in kv)), _field(0x0A, scope), tail

    def _trace_head(self, tid: int) -> bytes:
        return b"\x0a\x10" + tid.to_bytes(16, "big") + b"\x12\x08"

    def span(self, sp: Span) -> bytes:
        name, tid, sid, pid, start, end, attrs, status = sp
        head = self._traces.get(tid) or self._trace(tid)
        nm = self._names.get(name)
        if nm is None:
            nm = self._names[name] = _field(0x2A, name.encode()) + _KIND_INTERNAL
        times = _TIMES.pack(0x39, start, 0x41, end)
        if pid:
            lp = self._last_parent
            if lp[0] != pid:
                lp = self._last_parent = (pid, b"\x22\x08" + pid.to_bytes(8, "big"))
            parts = [head, sid.to_bytes(8, "big"), lp[1], nm, times]
        else:
            parts = [head, sid.to_bytes(8, "big"), nm, times]
        kvc = self._keys
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
                body = ent[3] + _field(0x12, _any(v))
                parts += (b"\x4a", varint(len(body)), body)
        if status is not None:
            code, msg = status
            st = _text(0x12, msg) if msg else b""
            parts.append(_field(0x7A, st + b"\x18" + varint(code)))  # field 15
        parts.append(_FLAGS)
        body = b"".join(parts)
        ln = len(body)
        return (b"\x12" + _B1[ln] if ln < 128 else b"\x12" + varint(ln)) + body

    def request(self, fragments: Sequence[bytes], size: int) -> bytes:
        """One request (one resource, one scope) of fragments whose lengths add up to ``size``."""
        res, scope, schema = self._head
        ss_len = len(scope) + size
        ss_head = b"\x12" + varint(ss_len)
        rs_len = len(res) + len(ss_head) + ss_len + len(schema)
        return b"".join((b"\x0a", varint(rs_len), res, ss_head, scope, *fragments, schema))


class JsonEncoder(Encoder):
    """Span tuples to OTLP/JSON span objects, wrapped into request lines."""

    __slots__ = ()
    _SEP = 1  # the comma

    def _heads(self, resource: Mapping[str, Any], name: str, version: str, schema: str) -> Any:
        kvs = ",".join(f'{{"key":{_jstr(str(k))},"value":{_jany(v)}}}' for k, v in resource.items())
        scope = f'{{"name":{_jstr(name)}' + (f',"version":{_jstr(version)}' if version else "")
        head = f'{{"resourceSpans":[{{"resource":{{"attributes":[{kvs}]}},'
        head += f'"scopeSpans":[{{"scope":{scope}}},"spans":['
        return head, "]}]" + (f',"schemaUrl":{_jstr(schema)}' if schema else "") + "}]}"

    def _trace_head(self, tid: int) -> str:  # to_bytes refuses what ProtoEncoder's refuses
        return f'{{"traceId":"{tid.to_bytes(16, "big").hex()}","spanId":"'

    def span(self, sp: Span) -> str:
        name, tid, sid, pid, start, end, attrs, status = sp
        _RANGE.pack(start, end, sid, pid)  # struct.error: a time or id the wire cannot carry
        head = self._traces.get(tid) or self._trace(tid)
        nm = self._names.get(name)
        if nm is None:
            nm = self._names[name] = f',"name":{_jstr(name)},"kind":1,"startTimeUnixNano":"'
        parts = [head, f"{sid:016x}", f'","parentSpanId":"{pid:016x}"' if pid else '"', nm]
        parts.append(f'{start}","endTimeUnixNano":"{end}"')
        if attrs:
            keys, kv = self._keys, []
            for k, v in attrs:
                ent = keys.get(k)
                if ent is None:  # the '{"key":..,"value":' head, whole pairs for ints 0..255
                    kh = f'{{"key":{_jstr(k)},"value":'
                    ent = keys[k] = (kh, _PerInt(partial(_json_int, kh)))
                tv = type(v)
                if tv is int:
                    if 0 <= v < 256:
                        kv.append(ent[1][v])
                    else:
                        i = v if -_I64 <= v < _I64 else _i64(v)
                        kv.append(f'{ent[0]}{{"intValue":"{i}"}}}}')
                elif tv is float and math.isfinite(v):
                    kv.append(f'{ent[0]}{{"doubleValue":{v!r}}}}}')
                else:
                    kv.append(f"{ent[0]}{_jany(v)}}}")
            parts.append(f',"attributes":[{",".join(kv)}]')
        if status is not None:
            code, msg = status
            st = f'"message":{_jstr(msg)},' if msg else ""
            parts.append(f',"status":{{{st}"code":{code}}}')
        parts.append(_JFLAGS)
        return "".join(parts)

    def request(self, fragments: Sequence[str], size: int) -> bytes:
        """One ``ExportTraceServiceRequest``, a JSON line (no newline), ASCII; ``size`` unused."""
        head, tail = self._head
        return (head + ",".join(fragments) + tail).encode()
