"""The same requests as OTLP/JSON: what the embedded default writes, one request a line.

Follows the OTLP JSON encoding (protobuf JSON mapping with OTLP's exceptions): lowerCamelCase
field names, trace and span ids as lowercase hex (not base64), 64-bit integers as decimal
strings, enums as numbers. A line is one ``ExportTraceServiceRequest``, which is what the
Collector's ``otlpjsonfile`` receiver (and the ``file`` exporter that writes the same
format) replays. Like :mod:`memra_obs.otel.otlp_proto`, constant pieces are formatted
once: span names, attribute keys, the resource and scope head.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii as _jstr  # the C escaper
from typing import Any

from .otlp_proto import SPAN_FLAGS
from .spans import Span

__all__ = ["JsonEncoder", "json_any_value"]

_I64 = 1 << 63
_M64 = (1 << 64) - 1


def _i64(v: int) -> int:
    """An int as the int64 the protobuf writer sends (two's complement wrap)."""
    v &= _M64
    return v - (1 << 64) if v >= _I64 else v


def _double(v: float) -> str:
    if math.isfinite(v):
        return repr(v)
    if math.isnan(v):
        return '"NaN"'
    return '"Infinity"' if v > 0 else '"-Infinity"'


def json_any_value(v: Any) -> str:
    """An ``AnyValue`` object for a Python attribute value."""
    tv = type(v)
    if tv is bool:
        return '{"boolValue":true}' if v else '{"boolValue":false}'
    if tv is int:
        return f'{{"intValue":"{_i64(v)}"}}'
    if tv is float:
        return f'{{"doubleValue":{_double(v)}}}'
    if tv is str:
        return f'{{"stringValue":{_jstr(v)}}}'
    if tv is bytes:
        return f'{{"bytesValue":"{base64.b64encode(v).decode()}"}}'
    for base in (bool, int, float, str):  # subclasses (IntEnum, str enums, ...)
        if isinstance(v, base):
            return json_any_value(base(v))
    if isinstance(v, Sequence):
        return f'{{"arrayValue":{{"values":[{",".join(json_any_value(x) for x in v)}]}}}}'
    if isinstance(v, Mapping):
        return f'{{"kvlistValue":{{"values":[{_kv_list(v)}]}}}}'
    return f'{{"stringValue":{_jstr(str(v))}}}'


def _kv_list(attrs: Mapping[Any, Any]) -> str:
    return ",".join(
        f'{{"key":{_jstr(str(k))},"value":{json_any_value(v)}}}' for k, v in attrs.items()
    )


class JsonEncoder:
    """Encodes span tuples to OTLP/JSON span objects and wraps them into request lines."""

    __slots__ = ("_head", "_keys", "_names", "_tail", "_traces", "bad", "max_traces")

    def __init__(
        self,
        resource: Mapping[str, Any],
        scope_name: str,
        scope_version: str = "",
        *,
        resource_schema_url: str = "",
        max_traces: int = 4096,
    ) -> None:
        scope = f'{{"name":{_jstr(scope_name)}'
        if scope_version:
            scope += f',"version":{_jstr(scope_version)}'
        scope += "}"
        self._head = (
            f'{{"resourceSpans":[{{"resource":{{"attributes":[{_kv_list(resource)}]}},'
            f'"scopeSpans":[{{"scope":{scope},"spans":['
        )
        schema = f',"schemaUrl":{_jstr(resource_schema_url)}' if resource_schema_url else ""
        self._tail = f"]}}]{schema}}}]}}"
        self._names: dict[str, str] = {}
        #: attribute key -> (its '{"key":..,"value":' head, whole pairs for ints 0..255)
        self._keys: dict[str, tuple[str, list[str]]] = {}
        self._traces: dict[int, str] = {}
        self.max_traces = max_traces
        #: Spans skipped because a value could not be encoded.
        self.bad = 0

    def spans(self, spans: Sequence[Span], out: list[str]) -> int:
        """Append one encoded span object per span to ``out``; returns the characters added."""
        enc = self.span
        n = 0
        for sp in spans:
            try:
                s = enc(sp)
            except Exception:  # a value the format cannot carry
                self.bad += 1
                continue
            n += len(s) + 1
            out.append(s)
        return n

    def span(self, sp: Span) -> str:
        name, tid, sid, pid, start, end, attrs, status = sp
        head = self._traces.get(tid)
        if head is None:
            if len(self._traces) >= self.max_traces:
                self._traces.clear()
            head = self._traces[tid] = f'{{"traceId":"{tid:032x}","spanId":"'
        nm = self._names.get(name)
        if nm is None:
            nm = self._names[name] = f',"name":{_jstr(name)},"kind":1,"startTimeUnixNano":"'
        parts = [head, f"{sid:016x}"]
        parts.append(f'","parentSpanId":"{pid:016x}"' if pid else '"')
        parts.append(nm)
        parts.append(f'{start}","endTimeUnixNano":"{end}"')
        if attrs:
            keys = self._keys
            kv = []
            for k, v in attrs:
                ent = keys.get(k)
                if ent is None:
                    kh = f'{{"key":{_jstr(k)},"value":'
                    ent = keys[k] = (kh, [f'{kh}{{"intValue":"{i}"}}}}' for i in range(256)])
                tv = type(v)
                if tv is int:
                    if 0 <= v < 256:
                        kv.append(ent[1][v])
                    else:
                        kv.append(
                            f'{ent[0]}{{"intValue":"{v if -_I64 <= v < _I64 else _i64(v)}"}}}}'
                        )
                elif tv is float and math.isfinite(v):
                    kv.append(f'{ent[0]}{{"doubleValue":{v!r}}}}}')
                else:
                    kv.append(f"{ent[0]}{json_any_value(v)}}}")
            parts.append(f',"attributes":[{",".join(kv)}]')
        if status is not None:
            code, msg = status
            parts.append(
                f',"status":{{"message":{_jstr(msg)},"code":{code}}}'
                if msg
                else f',"status":{{"code":{code}}}'
            )
        parts.append(_FLAGS)
        return "".join(parts)

    def request(self, fragments: Sequence[str], size: int | None = None) -> str:
        """One ``ExportTraceServiceRequest`` as a single JSON line (no newline)."""
        return self._head + ",".join(fragments) + self._tail


_FLAGS = f',"flags":{SPAN_FLAGS}}}'
