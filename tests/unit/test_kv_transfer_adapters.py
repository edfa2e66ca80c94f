"""The KV transfer families where a table cannot say it all: vLLM's prompt tokens from a peer (received, not the
`p2p` loads planned), SGLang's queue gauges read on their own role only, and the same numbers under both spellings."""

from __future__ import annotations

import pytest

from devtools import harness
from kvcache_exporter import adapters
from kvcache_exporter.sources import parser


def adapt(text: str):
    adapter = adapters.detect(text)
    return adapter.adapt(parser.parse(text, adapter.wanted))


def without_p2p(text: str) -> str:
    return "".join(line for line in text.splitlines(keepends=True) if 'source="p2p"' not in line)


@pytest.mark.parametrize("transform", [lambda text: text, without_p2p], ids=["with p2p", "before p2p"])
def test_a_connectors_received_prompt_tokens_are_external_kv_transfer_not_p2p(transform):
    """`p2p` (3.1M on the page) counts the loads planned, failed and unfinished ones included; the tokens
    received are `external_kv_transfer` (3M), with or without a `p2p` source on the page."""
    page = transform((harness.FIXTURES / "vllm-pd-decode-nixl.txt").read_text())
    counters = adapt(page).ranks["0"].counters
    assert counters["kv_transfer_prompt_tokens_total"] == 3000000  # source="external_kv_transfer"


def test_without_a_pd_connector_external_prompt_tokens_are_no_peers():
    """LMCache or an offload connector also supplies `external_kv_transfer` tokens: not a peer's."""
    page = without_p2p((harness.FIXTURES / "vllm-pd-decode-nixl.txt").read_text())
    page = "".join(line for line in page.splitlines(keepends=True) if "vllm:nixl_" not in line)
    assert "kv_transfer_prompt_tokens_total" not in adapt(page).ranks["0"].counters


@pytest.mark.parametrize("page", ["sglang-0.5.txt", "sglang-0.4.txt", "sglang-underscore.txt",
                                  "sglang-0.5-no-retractions.txt"])
def test_a_unified_sglang_reads_no_transfer_queue(page):
    """A unified SGLang exports the P/D queue gauges at 0: they are no stage of a transfer that does not exist."""
    text = (harness.FIXTURES / page).read_text()
    snapshot = adapt(text)
    assert "num_decode_prealloc_queue_reqs" in text
    assert snapshot.role == "unified"
    assert all("kv_transfer_requests" not in rank.labelled for rank in snapshot.ranks.values())


@pytest.mark.parametrize("page", ["sglang-pd-prefill.txt", "sglang-pd-decode.txt"])
def test_sglangs_re_exported_spelling_reads_the_same(page):
    text = (harness.FIXTURES / page).read_text()
    assert adapt(text.replace("sglang:", "sglang_")) == adapt(text)

