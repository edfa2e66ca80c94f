"""Prometheus 3's scrape negotiation replayed against the exporter: every Accept header it sends gets a
body it takes. tests/unit/test_promql_compat.py has the rest of the Prometheus 3 compatibility checks."""

from __future__ import annotations

import gzip
import urllib.request
from email.message import Message

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools import harness
from devtools.harness import PageServer, page
from kvcache_exporter.runtime.server import GZIP_MIN_BYTES


# Accept headers Prometheus 3.13 sends (scrape/scrape.go acceptHeader() over config.ScrapeProtocolsHeaders:
# weights from 0.6 down, escaping=allow-utf-8 on the 1.0.0 text formats), by the scrape_protocols setting.
PROMETHEUS3_ACCEPT = {
    "default": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
               "application/openmetrics-text;version=0.0.1;q=0.5,"
               "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "protobuf first": "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;"
                      "q=0.6,application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                      "application/openmetrics-text;version=0.0.1;q=0.4,"
                      "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "prometheus 2.42": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                       "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.25",
    "none": None,
}


@pytest.fixture(scope="module")
def exporter_with_a_target(tmp_path_factory):
    body = (harness.FIXTURES / "vllm-v1.txt").read_text()
    log_dir = tmp_path_factory.mktemp("negotiation")
    # Four engines: a /metrics body above the size from which the exporter compresses.
    paths = [f"/engine-{i}/metrics" for i in range(4)]
    with PageServer({path: page(body) for path in paths}) as engine, \
            harness.exporter(log_dir, *(arg for path in paths for arg in ("--target", engine.url(path))),
                             "--poll-interval", "1s") as proc:
        harness.wait_until(lambda: sum(v for k, v in harness.scrape(proc.url).items()
                                       if k[0] == "kvcache_target_up") == len(paths),
                           timeout=20, what="a first good poll of every engine")
        yield proc


@pytest.mark.parametrize("accept", list(PROMETHEUS3_ACCEPT), ids=list(PROMETHEUS3_ACCEPT))
@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gzip"])
def test_metrics_answer_in_a_format_prometheus3_takes(exporter_with_a_target, accept, compressed):
    headers = {"Accept-Encoding": "gzip"} if compressed else {}
    if PROMETHEUS3_ACCEPT[accept]:
        headers["Accept"] = PROMETHEUS3_ACCEPT[accept]
    request = urllib.request.Request(exporter_with_a_target.url + "/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as response:
        content_type = response.headers["Content-Type"]
        raw = response.read()
        encoding = response.headers.get("Content-Encoding")
    # Prometheus 3 reads the media type with Go's mime.ParseMediaType and takes text/plain as the
    # classic text format; a blank or unknown type fails the scrape unless fallback_scrape_protocol is set.
    parsed = Message()
    parsed["Content-Type"] = content_type
    assert parsed.get_content_type() == "text/plain"
    assert parsed.get_param("version") == "0.0.4"
    assert encoding == ("gzip" if compressed else None)
    text = (gzip.decompress(raw) if compressed else raw).decode()
    assert len(text) >= GZIP_MIN_BYTES
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families["kvcache_target_up"].samples[0].value == 1
    assert families["kvcache_usage_ratio"].type == "gauge"
