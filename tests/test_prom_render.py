"""The fast exposition: byte-identical to prometheus_client's encoders, memo invalidation,
composition with other collectors, and promtool's verdict."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.exposition import generate_latest as om_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.utils import floatToGoString

from memra_obs.prom import PrometheusExporter, encode
from memra_obs.prom.model import _count
from memra_obs.records import FIRST_TOKEN_MS_FIELDS, SpecFirstTokenProf
from memra_obs.timeline import FirstTokenRecord, RoundRecord, SessionRecord

OM = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def session(sid: int, family: str, trace: int, worker: str = "w") -> SessionRecord:
    return SessionRecord(
        sid, family, "t", "tv", worker, 0, 0, 1_700_000_000 * 10**9, trace, 1, 0, 2, True
    )


def rounds(
    sid: int, durations: list[tuple[int, ...]], k: int = 4, split: bool = True
) -> list[RoundRecord]:
    out = []
    t = 5 * 10**9
    for i, d in enumerate(durations):
        b = [t]
        for x in d:
            t += x
            b.append(t)
        sp = (d[1] // 3, d[1] // 9, d[1] // 2, d[1] // 7) if split else None
        out.append(RoundRecord(sid, 0, i, tuple(b), k, i % (k + 1), 50 + i, i % 3, sp))  # type: ignore[arg-type]
    return out


def full_set(ex: PrometheusExporter, families=("glm5", "qwen3")) -> None:
    """Every kind of series: two families, all phases/parts, all first-token phases, 8 GPUs."""
    for s, fam in enumerate(families, start=1):
        ex.export(
            [
                session(s, fam, 0xABC + s),
                *rounds(s, [(10**6, 7 * 10**6, 10**5, 4 * 10**4, 3 * 10**5)] * 20),
            ]
        )
        prof = SpecFirstTokenProf(
            **{f: 0.5 + i for i, f in enumerate(FIRST_TOKEN_MS_FIELDS)},
            free_mb_before=[(d, 80_000 - d) for d in range(8)],
            free_mb_after=[(d, 60_000 - d) for d in range(8)],
        )
        ex.export([FirstTokenRecord(s, prof, (("prime", 5 * 10**9, 6 * 10**9),))])


def both_equal(reg: CollectorRegistry) -> None:
    assert encode(reg, "")[0] == generate_latest(reg)
    assert encode(reg, OM)[0] == om_latest(reg)


durations = st.tuples(*[st.integers(0, 3 * 10**9)] * 5)
label = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)


@given(
    fams=st.lists(label, min_size=1, max_size=3, unique=True),
    walls=st.lists(durations, min_size=0, max_size=30),
    trace=st.integers(0, (1 << 128) - 1),
    worker_label=st.booleans(),
    split=st.booleans(),
)
@example(fams=['a\\b"c\nd'], walls=[(1, 2, 3, 4, 5)], trace=1, worker_label=True, split=True)
def test_fast_exposition_is_byte_identical(fams, walls, trace, worker_label, split):
    """Any stream, any label text (quotes, backslashes, newlines): same bytes as prometheus_client."""
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg, worker_label=worker_label)
    for s, fam in enumerate(fams, start=1):
        ex.export([session(s, fam, trace, worker=fam[::-1]), *rounds(s, walls, split=split)])
    both_equal(reg)


def test_memo_follows_every_change():
    """Scrape, observe, scrape: the memoized children are re-rendered when they change."""
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    full_set(ex)
    both_equal(reg)
    both_equal(reg)  # all memoized
    ex.export(rounds(1, [(1, 2, 3, 4, 5)]))
    both_equal(reg)
    full_set(ex, families=("glm5", "other"))
    both_equal(reg)


def test_other_collectors_in_the_registry_are_kept():
    """Registry = our families + someone else's + target_info: all served, one # EOF."""
    reg = CollectorRegistry(target_info={"service": "x"})
    Counter("app_requests", "app requests", registry=reg).inc(3)
    full_set(PrometheusExporter(reg))
    text = encode(reg, "")[0].decode()
    assert sorted(text.splitlines()) == sorted(generate_latest(reg).decode().splitlines())
    om = encode(reg, OM)[0].decode()
    assert sorted(om.splitlines()) == sorted(om_latest(reg).decode().splitlines())
    assert om.endswith("\n# EOF\n") and om.count("# EOF") == 1
    assert "app_requests_total 3.0" in text and "target_info" in text


def test_name_filter_uses_the_slow_path():
    """``?name[]=`` is honoured (prometheus_client's restricted registry)."""
    reg = CollectorRegistry()
    full_set(PrometheusExporter(reg))
    body = encode(reg, "", params={"name[]": ["memra_spec_rounds_total"]})[0].decode()
    assert [ln for ln in body.splitlines() if not ln.startswith("#")] == [
        'memra_spec_rounds_total{family="glm5"} 20.0',
        'memra_spec_rounds_total{family="qwen3"} 20.0',
    ]


def test_an_accept_header_prometheus_client_cannot_parse_gets_text_not_a_500():
    """RFC 9110 lets ``version`` be quoted; prometheus_client's parser raised on it (and on
    ``version=abc``): every such scrape was a 500 with a traceback on the loop's stderr."""
    reg = CollectorRegistry()
    full_set(PrometheusExporter(reg))
    for accept in ('application/openmetrics-text; version="1.0.0"', "text/plain;version=abc"):
        body, headers = encode(reg, accept)
        assert body == generate_latest(reg)
        assert headers == [("Content-Type", "text/plain; version=0.0.4; charset=utf-8")]


def test_openmetrics_0_0_1_is_answered_in_openmetrics():
    """OpenMetrics 0.0.1 (Prometheus 2.5-2.32's first choice; all that Datadog's strict
    OpenMetrics check asks for, then parses with an OpenMetrics parser) is 1.0.0's text:
    prometheus_client answered text 0.0.4, so no exemplars, and every such check failed."""
    reg = CollectorRegistry()
    full_set(PrometheusExporter(reg))
    for accept in ("application/openmetrics-text; version=0.0.1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                   "application/openmetrics-text; version=0.0.1; charset=utf-8"):  # fmt: skip
        body, headers = encode(reg, accept)
        assert body == om_latest(reg) and b" # {trace_id=" in body
        assert headers == [
            ("Content-Type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
        ]
        assert len(list(om_parse(body.decode()))) == 22  # DESIGN §5's families: a new one, +1


def test_escaping_dots_is_spelt_as_prometheus_client_spells_it():
    """Prometheus 3 with ``metric_name_escaping_scheme: dots`` asks for ``escaping=dots``: every
    "_" of a name is "__" (``memra__spec__rounds__total``, beside the app's own series
    spelt the same way), where the fast renderer wrote the names as they are."""
    reg = CollectorRegistry()
    Counter("app_requests", "x", registry=reg).inc()
    full_set(PrometheusExporter(reg))
    for accept in ("application/openmetrics-text;version=1.0.0;escaping=dots",
                   "text/plain;version=1.0.0;escaping=dots"):  # fmt: skip
        body = encode(reg, accept)[0]
        encoder, _ = choose_encoder(accept)
        assert body == encoder(reg)
        assert b"\nmemra__spec__rounds__total{" in body and b"\napp__requests__total " in body


def test_gzip():
    """Accept-Encoding: gzip gets a gzip body that decodes to the same text."""
    import gzip

    reg = CollectorRegistry()
    full_set(PrometheusExporter(reg))
    body, headers = encode(reg, "", gzip_ok=True)
    assert ("Content-Encoding", "gzip") in headers
    assert gzip.decompress(body) == encode(reg, "")[0]


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not on PATH (Debian: apt-get install prometheus)",
)
def test_promtool_check_metrics_reports_nothing():
    """promtool check metrics (lint included) says nothing about the full text exposition."""
    reg = CollectorRegistry()
    ex = PrometheusExporter(reg)
    full_set(ex)
    ex.watch("dropped", "records", lambda: 0)
    ex.watch("errors", "records", lambda: 0)
    body = encode(reg, "")[0]
    p = subprocess.run(
        ["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60
    )
    assert (p.returncode, p.stdout, p.stderr) == (0, b"", b"")


@given(st.one_of(st.integers(0, 2_000_000), st.integers(0, 10**15)))
def test_a_bucket_count_is_spelt_as_prometheus_client_spells_it(n: int) -> None:
    """The scrape's shortcut for counts (``f"{n}.0"`` below 10**6) keeps Go's spelling past
    it (``1e+06``), which the byte-for-byte tests' small counts never reach."""
    assert _count(n) == floatToGoString(n)
