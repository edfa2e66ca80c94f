"""The KV transfer families where a table cannot say it all: vLLM's prompt tokens from a peer (received, not the
`p2p` loads planned), SGLang's queue gauges read on their own role only, TP ranks' histograms taken whole, the
same numbers under both spellings, and speeds reported above the link counted."""

from __future__ import annotations

import pytest

from devtools import harness
from kvcache_exporter import adapters, derive
from kvcache_exporter.sources import parser
from kvcache_exporter.thresholds import DEFAULT as T

# Each test twice: with the adapters' compiled loops and with their pure-Python reference (conftest.py).
pytestmark = pytest.mark.usefixtures("fold")


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


def _latency_ms(tp_rank: str, buckets: tuple[float, ...], total: float) -> str:
    """One TP rank's sglang:kv_transfer_latency_ms as MultiProcessCollector writes it: sum first, cumulative
    buckets 1, 10, 100 ms and +Inf, count last."""
    labels = f'engine_type="prefill",model_name="m",pp_rank="0",tp_rank="{tp_rank}"'
    bucket_labels = [f'engine_type="prefill",le="{le}",model_name="m",pp_rank="0",tp_rank="{tp_rank}"'
                     for le in ("1.0", "10.0", "100.0", "+Inf")]
    return "".join([f"sglang:kv_transfer_latency_ms_sum{{{labels}}} {total}\n",
                    *(f"sglang:kv_transfer_latency_ms_bucket{{{b}}} {n}\n" for b, n in zip(bucket_labels, buckets)),
                    f"sglang:kv_transfer_latency_ms_count{{{labels}}} {buckets[-1]}\n"])


@pytest.mark.parametrize("ranks, expected", [
    # both ranks: rank 0's (the stats rank) whole, never the per-bucket max (1, 5, 6, 6) nor rank 1's larger sum
    (("0", "1"), ((0.001, 1.0), (0.01, 2.0), (0.1, 4.0), (float("inf"), 4.0), 0.09, 4.0)),
    # rank 1 alone: its own whole
    (("1",), ((0.001, 0.0), (0.01, 5.0), (0.1, 6.0), (float("inf"), 6.0), 0.2, 6.0)),
])
def test_tp_ranks_histograms_are_taken_whole_from_one_rank(ranks, expected):
    """Two TP ranks observed different transfers (4 against 6, their buckets crossing): the histogram the
    exporter reads is one rank's buckets, sum and count exactly, ms read as seconds."""
    page = {"0": _latency_ms("0", (1, 2, 4, 4), 90.0), "1": _latency_ms("1", (0, 5, 6, 6), 200.0)}
    text = "# TYPE sglang:kv_transfer_latency_ms histogram\n" + "".join(page[rank] for rank in ranks)
    histogram = adapt(text).ranks["0"].histograms["kv_transfer_seconds"]
    *buckets, total, count = expected
    assert histogram.buckets == list(buckets)
    assert histogram.sum == pytest.approx(total, rel=1e-12) and histogram.count == count


def test_dynamos_tensorrt_llm_speeds_above_the_link_are_counted():
    """Dynamo's TensorRT-LLM worker observes each transfer's bytes / (seconds x 1e9) in GB/s: of 5 transfers, 3 at
    or below 25 GB/s and 2 in the 250 and 500 GB/s buckets, beyond the 50 GB/s link: the exporter reads the speed in
    bytes/s and counts those 2 (above the 50 GB/s bound), never averaging them in silently."""
    labels = 'disaggregation_mode="decode",engine_type="trtllm",model_name="m"'
    cumulative = {"0.1": 0, "0.5": 1, "1.0": 1, "5.0": 2, "10.0": 2, "25.0": 3, "50.0": 3, "100.0": 3, "250.0": 4,
                  "500.0": 5, "+Inf": 5}
    buckets = (f'trtllm_kv_transfer_speed_gb_s_bucket{{{labels},le="{le}"}} {n}\n' for le, n in cumulative.items())
    text = "".join(["# TYPE trtllm_kv_transfer_speed_gb_s histogram\n", *buckets,
                    f"trtllm_kv_transfer_speed_gb_s_count{{{labels}}} 5\n",
                    f"trtllm_kv_transfer_speed_gb_s_sum{{{labels}}} 723.4\n"])
    snapshot = adapt(text)
    ranks, _ = derive.derive(snapshot, {}, 0.0, T, role=snapshot.role)
    speed = ranks["0"].values.histograms["kv_transfer_speed_bytes_per_second"]
    assert snapshot.role == "decode"
    assert speed.sum == pytest.approx(723.4e9) and speed.count == 5
    assert dict(speed.buckets)[50e9] == 3
    assert ranks["0"].gauges["kv_transfer_above_link_total"] == 2


@pytest.mark.parametrize("role, kind", [("prefill", "transfer"), ("decode", "receive")])
def test_sglangs_failed_transfers_are_the_senders_or_the_receivers(role, kind):
    """Both SGLang servers count a failed transfer in num_transfer_failed_reqs_total: the prefill side (the sender,
    which times it) as kind transfer, the decode side (the receiver, which times none) as kind receive."""
    labels = f'engine_type="{role}",model_name="m",tp_rank="0"'
    text = (f"# TYPE sglang:num_transfer_failed_reqs_total counter\n"
            f"sglang:num_transfer_failed_reqs_total{{{labels}}} 3.0\n"
            f"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{{labels}}} 1.0\n")
    assert adapt(text).ranks["0"].labelled["kv_transfer_failures_total"] == {(kind,): 3.0}
