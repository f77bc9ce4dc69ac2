"""The same requests as OTLP/JSON: what the embedded default writes, one request a line.

Protobuf's JSON mapping with OTLP's exceptions: lowerCamelCase names, ids as lowercase hex,
64-bit integers as decimal strings, enums as numbers. A line is one request, what the
Collector's ``otlpjsonfile`` receiver replays; constant pieces are formatted once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii as _jstr  # the C escaper
from typing import Any

from .otlp_proto import SPAN_FLAGS, Encoder
from .spans import Span

_I64 = 1 << 63
_FLAGS = f',"flags":{SPAN_FLAGS}}}'


def _i64(v: int) -> int:
    """An int as the int64 the protobuf writer sends (two's complement wrap)."""
    return ((v + _I64) & ((1 << 64) - 1)) - _I64


def _any(v: Any) -> str:
    """An ``AnyValue`` object for a Python attribute value."""
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
            return _any(base(v))
    if isinstance(v, (tuple, list)):
        return f'{{"arrayValue":{{"values":[{",".join(map(_any, v))}]}}}}'
    return f'{{"stringValue":{_jstr(str(v))}}}'


class JsonEncoder(Encoder):
    """Span tuples to OTLP/JSON span objects, wrapped into request lines."""

    __slots__ = ()
    _SEP = 1  # the comma

    def _heads(self, resource: Mapping[str, Any], name: str, version: str, schema: str) -> Any:
        kvs = ",".join(f'{{"key":{_jstr(str(k))},"value":{_any(v)}}}' for k, v in resource.items())
        scope = f'{{"name":{_jstr(name)}' + (f',"version":{_jstr(version)}' if version else "")
        head = f'{{"resourceSpans":[{{"resource":{{"attributes":[{kvs}]}},'
        head += f'"scopeSpans":[{{"scope":{scope}}},"spans":['
        return head, "]}]" + (f',"schemaUrl":{_jstr(schema)}' if schema else "") + "}]}"

    def _trace_head(self, tid: int) -> str:
        return f'{{"traceId":"{tid:032x}","spanId":"'

    def span(self, sp: Span) -> str:
        name, tid, sid, pid, start, end, attrs, status = sp
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
                    ent = keys[k] = (kh, [f'{kh}{{"intValue":"{i}"}}}}' for i in range(256)])
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
                    kv.append(f"{ent[0]}{_any(v)}}}")
            parts.append(f',"attributes":[{",".join(kv)}]')
        if status is not None:
            code, msg = status
            st = f'"message":{_jstr(msg)},' if msg else ""
            parts.append(f',"status":{{{st}"code":{code}}}')
        parts.append(_FLAGS)
        return "".join(parts)

    def request(self, fragments: Sequence[str], size: int | None = None) -> str:
        """One ``ExportTraceServiceRequest`` as a single JSON line (no newline)."""
        head, tail = self._head
        return head + ",".join(fragments) + tail
