"""The hand-written OTLP writers against opentelemetry-proto: every shape we emit decodes to
the span we meant, and the JSON lines are the same requests in OTLP/JSON."""

from __future__ import annotations

import base64
import json
import math
import os

from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from memra_obs.otel.otlp import JsonEncoder, ProtoEncoder, varint
from memra_obs.otel.transport import partial_success, status_message

RESOURCE = {"service.name": "memra-test", "host.name": "h1", "pid": 42}

texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)
int64s = st.integers(-(2**63), 2**63 - 1)
scalars = st.one_of(
    st.booleans(),
    int64s,
    st.integers(0, 300),  # the small-int cache
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)
values = st.one_of(
    scalars,
    st.lists(int64s, max_size=4).map(tuple),
    st.lists(texts, max_size=4).map(tuple),
    st.lists(st.floats(allow_nan=False), max_size=3).map(tuple),
)
keys = st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30)
spans = st.tuples(
    st.sampled_from(["spec.round", "spec.draft", "spec.session", "x" * 200, "ünï"]),
    st.integers(1, 2**128 - 1),
    st.integers(1, 2**64 - 1),
    st.one_of(st.just(0), st.integers(1, 2**64 - 1)),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**64 - 1),
    st.lists(st.tuples(keys, values), max_size=12).map(tuple),
    st.one_of(st.none(), st.tuples(st.sampled_from([1, 2]), texts)),
)


def _proto(spans_, resource=RESOURCE) -> ExportTraceServiceRequest:
    enc = ProtoEncoder(resource, "memra_obs", "9.9")
    frags: list[bytes] = []
    size = enc.spans(spans_, frags)
    msg = ExportTraceServiceRequest()
    msg.ParseFromString(enc.request(frags, size))
    return msg


def _value(av):
    which = av.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in av.array_value.values)
    return getattr(av, which)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _check(sp, got) -> None:
    name, tid, sid, pid, start, end, attrs, status = sp
    assert got.name == name
    assert got.trace_id == tid.to_bytes(16, "big")
    assert got.span_id == sid.to_bytes(8, "big")
    assert got.parent_span_id == (pid.to_bytes(8, "big") if pid else b"")
    assert got.kind == 1  # SPAN_KIND_INTERNAL
    assert (got.start_time_unix_nano, got.end_time_unix_nano) == (start, end)
    assert got.flags == 0x101
    assert [a.key for a in got.attributes] == [k for k, _ in attrs]
    for (_, v), a in zip(attrs, got.attributes, strict=True):
        assert _same(v, _value(a.value)), (v, a)
    if status is None:
        assert not got.HasField("status")
    else:
        assert (got.status.code, got.status.message) == status


@given(st.lists(spans, min_size=1, max_size=6))
def test_proto_spans_decode_to_what_was_encoded(spans_):
    """Ids, names, times, every attribute type and status round-trip through protobuf."""
    msg = _proto(spans_)
    (rs,) = msg.resource_spans
    (ss,) = rs.scope_spans
    assert (ss.scope.name, ss.scope.version) == ("memra_obs", "9.9")
    assert {a.key: _value(a.value) for a in rs.resource.attributes} == RESOURCE
    assert len(ss.spans) == len(spans_)
    for sp, got in zip(spans_, ss.spans, strict=True):
        _check(sp, got)


def _json_to_proto(line: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON carries ids as hex; protobuf's JSON mapping wants base64. Convert, parse. The
    URL-safe alphabet: protobuf decodes with it, and Python 3.15 warns it will drop "+" and "/"."""
    doc = json.loads(line)
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for sp in ss["spans"]:
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in sp:
                        sp[k] = base64.urlsafe_b64encode(bytes.fromhex(sp[k])).decode()
    return json_format.Parse(json.dumps(doc), ExportTraceServiceRequest())


@given(st.lists(spans, min_size=1, max_size=6))
def test_json_line_is_the_same_request_as_the_protobuf(spans_):
    """The JSON writer says exactly what the protobuf writer says (OTLP/JSON rules)."""
    enc = JsonEncoder(RESOURCE, "memra_obs", "9.9")
    frags: list[str] = []
    line = enc.request(frags, enc.spans(spans_, frags))
    assert b"\n" not in line
    json_format.Parse(line, ExportTraceServiceRequest())  # accepted as it is
    # Compared as dicts, where NaN == NaN ("NaN").
    assert json_format.MessageToDict(_json_to_proto(line)) == json_format.MessageToDict(
        _proto(spans_)
    )


def test_lone_surrogates_are_the_same_question_mark_in_both_writers():
    """A str that is not valid Unicode (``os.fsdecode`` of a non-UTF-8 file name, in an
    exception's message or an environment value) is ``?`` in the JSON line, as in the
    protobuf: escaped as ``\\udcff`` it made protobuf's JSON parser refuse the whole line."""
    bad = "/data/" + os.fsdecode(b"\xff") + ".bin \U0001f600"
    res = {"service.name": bad, bad: 1}
    sp = ("spec.session", 0xAB, 0xCD, 0, 10, 20, ((bad, bad), ("t", (bad,))), (2, bad))
    enc = JsonEncoder(res, "memra_obs", "9.9")
    frags: list[str] = []
    line = enc.request(frags, enc.spans([sp], frags))
    json_format.Parse(line, ExportTraceServiceRequest())  # accepted as it is
    want = json_format.MessageToDict(_proto([sp], res))
    assert json_format.MessageToDict(_json_to_proto(line)) == want
    (span,) = json.loads(line)["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert span["status"]["message"] == "/data/?.bin \U0001f600"  # a valid pair kept


def _breaking(field: int, limit: int):
    """(field, a value out of its range: negative or >= ``limit``)."""
    return st.tuples(st.just(field), st.integers(max_value=-1) | st.integers(min_value=limit))


breaks = st.none() | _breaking(1, 2**128) | st.one_of(*(_breaking(i, 2**64) for i in range(2, 6)))


@given(st.lists(st.tuples(spans, breaks), min_size=1, max_size=6))
def test_both_writers_refuse_the_same_spans(cases):
    """A trace id, span id, parent id or time out of range is skipped and counted in ``bad`` by
    both writers: JSON does not write it as text that fails the whole request at the receiver."""
    spans_ = [sp if b is None else (*sp[: b[0]], b[1], *sp[b[0] + 1 :]) for sp, b in cases]
    good = [sp for sp, (_, b) in zip(spans_, cases, strict=True) if b is None]
    for cls in (ProtoEncoder, JsonEncoder):
        enc = cls(RESOURCE, "memra_obs", "9.9")
        frags: list = []
        size = enc.spans(spans_, frags)
        assert (enc.bad, len(frags)) == (len(spans_) - len(good), len(good)), cls
        if cls is JsonEncoder:
            json_format.Parse(enc.request(frags, size), ExportTraceServiceRequest())


def test_json_uses_hex_ids_string_int64s_and_camel_case():
    """The OTLP/JSON specifics a file receiver depends on."""
    enc = JsonEncoder({"service.name": "s"}, "memra_obs")
    sp = ("spec.round", 0xAB, 0xCD, 0xEF, 10, 20, (("memra.spec.k", 4), ("r", 0.5)), (2, "boom"))
    frags: list[str] = []
    doc = json.loads(enc.request(frags, enc.spans([sp], frags)))
    (s,) = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    assert s["traceId"] == f"{0xAB:032x}" and s["spanId"] == f"{0xCD:016x}"
    assert s["parentSpanId"] == f"{0xEF:016x}"
    assert s["startTimeUnixNano"] == "10" and s["endTimeUnixNano"] == "20"
    assert s["attributes"][0] == {"key": "memra.spec.k", "value": {"intValue": "4"}}
    assert s["attributes"][1] == {"key": "r", "value": {"doubleValue": 0.5}}
    assert s["status"] == {"message": "boom", "code": 2} and s["kind"] == 1


def test_root_span_has_no_parent_and_big_requests_keep_their_length_prefix():
    """A root span omits parent_span_id; a request over 16 KiB (multi-byte lengths) decodes."""
    big = [("spec.maint", 7, i + 1, 0, i, i + 1, (("k", "v" * 200),), None) for i in range(300)]
    msg = _proto(big)
    ss = msg.resource_spans[0].scope_spans[0]
    assert len(ss.spans) == 300 and ss.spans[0].parent_span_id == b""
    assert ss.spans[299].attributes[0].value.string_value == "v" * 200


@given(st.integers(0, 2**64 - 1))
def test_varint_matches_protobuf(n):
    """Our varint is protobuf's (checked through a uint64 field)."""
    m = ExportTraceServiceResponse()
    m.partial_success.rejected_spans = n & (2**63 - 1)
    raw = m.SerializeToString()
    assert varint(n & (2**63 - 1)) in raw


def test_partial_success_is_read_without_opentelemetry_proto():
    """rejected_spans and error_message come out of a real ExportTraceServiceResponse (the
    reason was never read: the user was told spans were dropped, never why); junk reads as 0."""
    m = ExportTraceServiceResponse()
    m.partial_success.rejected_spans = 7
    m.partial_success.error_message = "too old:\n  spans dropped"
    assert partial_success(m.SerializeToString()) == (7, "too old: spans dropped")
    m.partial_success.rejected_spans = 0  # OTLP: a warning
    assert partial_success(m.SerializeToString()) == (0, "too old: spans dropped")
    assert partial_success(b"") == (0, "")
    assert partial_success(b"\xff\xff") == (0, "")


def test_an_error_bodys_status_message_is_read():
    """OTLP's 4xx/5xx body is a google.rpc.Status: its message was shown as protobuf bytes."""
    from google.rpc.status_pb2 import Status

    body = Status(code=3, message="bad span: trace_id is invalid").SerializeToString()
    assert status_message(body, False) == "bad span: trace_id is invalid"
    assert status_message(b'{"code": 3, "message": "bad"}', True) == "bad"
    assert status_message(b"<html>nope</html>", False) == "b'<html>nope</html>'"
    assert status_message(b"[" * 200_000, True).startswith("b'[[[")  # (a 503 stays retryable)


_EDGES = [0, 127, 128, 255, 256, 16383, 16384, 2097151, 2097152, 268435455, 268435456]
_EDGES += [2**35 - 1, 2**35, 2**63 - 1]


def test_varint_at_every_length_boundary():
    """Each unrolled size and the loop, at both sides of its edge (the random draw's misses)."""
    m = ExportTraceServiceResponse()
    for n in _EDGES[1:]:  # 0 is the default: not on the wire
        m.partial_success.rejected_spans = n
        assert m.SerializeToString() == b"\x0a" + varint(len(varint(n)) + 1) + b"\x08" + varint(n)


def test_int_edges_and_u64s_are_the_same_in_both_writers():
    """Ints at the small-int cache's and each varint size's edge, and a u64 past int64 (a hash,
    an address) in a span, an array and the resource: int64 two's complement in both writers."""
    big = 2**64 - 1
    attrs = tuple((f"a{i}", v) for i, v in enumerate([*_EDGES, 2**63, big, -1]))
    sp = ("spec.round", 0xAB, 0xCD, 0xEF, 10, 20, (*attrs, ("arr", (big, 3))), None)
    res = {**RESOURCE, "u64": big}
    want = (*attrs[:-3], ("a14", -(2**63)), ("a15", -1), ("a16", -1), ("arr", (-1, 3)))
    msg = _proto([sp], res)
    _check((*sp[:6], want, None), msg.resource_spans[0].scope_spans[0].spans[0])
    enc = JsonEncoder(res, "memra_obs", "9.9")
    frags: list[str] = []
    line = enc.request(frags, enc.spans([sp], frags))
    assert enc.bad == 0
    json_format.Parse(line, ExportTraceServiceRequest())  # accepted as it is
    assert json_format.MessageToDict(_json_to_proto(line)) == json_format.MessageToDict(msg)


def test_a_resource_schema_url_keeps_the_request_well_formed():
    """The SDK resource's schema_url (a detector sets one) is written in both writers and the
    protobuf request's lengths still add up."""
    url = "https://opentelemetry.io/schemas/1.21.0"
    sp = ("spec.round", 0xAB, 0xCD, 0, 10, 20, (("k", 4),), None)
    protos = []
    for cls in (ProtoEncoder, JsonEncoder):
        enc = cls(RESOURCE, "memra_obs", "9.9", schema_url=url)
        frags: list = []
        raw = enc.request(frags, enc.spans([sp, sp], frags))
        msg = _json_to_proto(raw) if cls is JsonEncoder else ExportTraceServiceRequest()
        if cls is ProtoEncoder:
            msg.ParseFromString(raw)
        (rs,) = msg.resource_spans
        assert rs.schema_url == url and len(rs.scope_spans[0].spans) == 2
        protos.append(json_format.MessageToDict(msg))
    assert protos[0] == protos[1]


def test_a_new_attribute_key_costs_its_values_not_a_table(monkeypatch):
    """Each new key built its fields for every int 0..255 at once (~0.3 ms a key): a first
    export's dozens of keys held the GIL 5-11 ms, a slow round in the loop it measures. A
    key's field for a value is made when that value comes, and encodes the same bytes."""
    from memra_obs.otel import otlp

    made = [0]
    field = otlp._field

    def counted(tag: int, body: bytes) -> bytes:
        made[0] += 1
        return field(tag, body)

    monkeypatch.setattr(otlp, "_field", counted)
    enc = ProtoEncoder({"service.name": "s"}, "memra_obs", "9.9")
    attrs = tuple((f"memra.spec.k{i}", i) for i in range(40))
    frag = enc.span(("spec.round", 1, 2, 3, 10, 20, attrs, None))
    assert made[0] < 40 * 4  # a handful a key, not 256
    req = ExportTraceServiceRequest.FromString(enc.request([frag], len(frag)))
    got = req.resource_spans[0].scope_spans[0].spans[0].attributes
    assert [(a.key, a.value.int_value) for a in got] == list(attrs)
