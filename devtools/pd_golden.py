"""The P/D golden pages: tests/fixtures/pd-golden/story.yml's polls as each engine's own metrics code writes them.

    .venv-vllm/bin/python devtools/pd_golden.py vllm     # vLLM 0.32's own PrometheusStatLogger (the CPU build)
    .venv/bin/python -m devtools.pd_golden sglang        # SGLang's families, set as its scheduler sets them

vLLM: for each connector (NixlConnector: pull; NixlPushConnector: push) and role (kv_consumer: decode;
kv_producer: prefill) the engine's config is built by EngineArgs.create_engine_config (the tiny model of
devtools/tiny_model.py, nothing is served), and each poll of the story is recorded through
PrometheusStatLogger.record: a SchedulerStats with the scheduler's counts (num_waiting_reqs not deferred,
num_skipped_waiting_reqs deferred, num_kv_fetch_reqs_by_stage), its connector_prefix_cache_stats (the hits of
the loads planned) and the NixlKVConnectorStats data of the transfers and their failures (on the side that
drives them: decode when pulling, prefill when pushing), and an IterationStats whose prompt tokens came from
external_kv_transfer. The
page is prometheus_client's generate_latest of vLLM's registry, as /metrics serves it.

SGLang is not installed here: its page is rendered by prometheus_client from the names, HELP, label names and
buckets of SchedulerMetricsCollector (srt/observability/metrics_collector.py), with the values
SchedulerMetricsMixin.log_prefill_stats / log_decode_stats set (the lengths of the P/D queues) and the
observations SchedulerReqTimeStats.compute_and_observe_kv_transfer_metrics makes per transfer (latency ms, size
MiB, speed MiB / 1024 over seconds); one registry for both TP ranks (no multiprocess files: the layout quirks are
the sglang-pd-*.txt fixtures'), no _created samples.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "pd-golden"
STORY = GOLDEN / "story.yml"
MODEL_DIR = Path(__file__).resolve().parents[1] / ".venv-vllm" / "tiny-llama"
CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}
ROLES = {"decode": "kv_consumer", "prefill": "kv_producer"}
POOL_BLOCKS = 1000  # usable blocks of each vLLM pool (num_gpu_blocks less the null block)


def page_path(index: int, engine: str, role: str) -> Path:
    return GOLDEN / f"{index:02d}-{engine}-{role}.txt"


def story() -> dict:
    return yaml.safe_load(STORY.read_text())


# -- vLLM ------------------------------------------------------------------------------------------------------


def _vllm_pages(mode: str, role: str, polls: list[dict], model: str) -> list[str]:
    from prometheus_client import REGISTRY, generate_latest
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

    config = EngineArgs(model=str(MODEL_DIR), served_model_name=[model], max_model_len=1024,
                        kv_transfer_config=KVTransferConfig(kv_connector=CONNECTORS[mode],
                                                            kv_role=ROLES[role])).create_engine_config()
    config.cache_config.num_gpu_blocks = POOL_BLOCKS + 1  # as the engine sets it once its pool is allocated
    logger = PrometheusStatLogger(config, [0])
    logger.log_engine_initialized()  # cache_config_info
    times_transfers = (role == "decode") == (mode == "pull")
    pages = []
    for poll in polls:
        connector = NixlKVConnectorStats()
        if role == "decode":
            stages = {"waiting_to_start": poll["waiting_to_start"], "in_progress": poll["in_progress"],
                      "completed_waiting": poll["completed_waiting"]}
            deferred = poll["in_progress"] + poll["completed_waiting"] + poll["other_deferred"]
            scheduler = SchedulerStats(num_running_reqs=poll["running"], num_waiting_reqs=poll["waiting_to_start"],
                                       num_skipped_waiting_reqs=deferred, num_kv_fetch_reqs_by_stage=stages,
                                       kv_cache_usage=poll["usage"])
            # As Scheduler.schedule records a load planned, its hits by the connector's source (the base
            # connector's get_external_cache_hit_sources: NixlConnector._cache_hit_source, p2p).
            planned = poll["planned_tokens"]
            scheduler.connector_prefix_cache_stats = PrefixCacheStats()
            scheduler.connector_prefix_cache_stats.record(num_tokens=planned, num_hits=planned, preempted=False,
                                                          hits_by_source={NixlConnector._cache_hit_source: planned})
        else:
            scheduler = SchedulerStats(num_running_reqs=poll["running"], num_waiting_reqs=poll["waiting"],
                                       kv_cache_usage=poll["usage"])
            for _ in range(poll["expired_leases"]):
                connector.record_kv_expired_req()
            for _ in range(poll["notifications_after_expiry"]):
                connector.record_notification_after_expiry()
        if times_transfers:  # the story lists the transfers and their failures on both sides' polls
            # The side that drives the transfers counts their failures too (NixlBaseConnectorWorker.
            # _pop_done_transfers / _handle_failed_transfer: the reader's when pulling, the writer's when pushing).
            for _ in range(poll["failed_transfers"]):
                connector.record_failed_transfer()
            for seconds, nbytes in poll["transfers"]:
                connector.data["transfer_duration"].append(seconds)
                connector.data["post_duration"].append(seconds / 10)
                connector.data["bytes_transferred"].append(nbytes)
                connector.data["num_descriptors"].append(nbytes // 2**16)
        scheduler.kv_connector_stats = connector.data
        iteration = IterationStats()
        if role == "decode":
            iteration.prompt_token_stats.external_kv_transfer = poll["received_tokens"]
            iteration.prompt_token_stats.cached_tokens = poll["received_tokens"]
            iteration.prompt_token_stats.total = poll["received_tokens"]
        logger.record(scheduler, iteration, engine_idx=0)
        pages.append(generate_latest(REGISTRY).decode())
    return pages


def write_vllm() -> None:
    data = story()
    for mode in CONNECTORS:
        decode = _vllm_pages(mode, "decode", data["vllm"]["decode"], data["model"])
        # The prefill side of a push pair times the transfers the decode side's polls list, and counts their failures.
        prefill_polls = [{**p, "transfers": d["transfers"], "failed_transfers": d["failed_transfers"]}
                         for p, d in zip(data["vllm"]["prefill"], data["vllm"]["decode"])]
        prefill = _vllm_pages(mode, "prefill", prefill_polls, data["model"])
        for index, (d, p) in enumerate(zip(decode, prefill), 1):
            page_path(index, f"vllm-{mode}", "decode").write_text(d)
            page_path(index, f"vllm-{mode}", "prefill").write_text(p)


# -- SGLang ----------------------------------------------------------------------------------------------------

SGLANG_CAPACITY = 16000
SGLANG_PAGE = 16
# Buckets of SchedulerMetricsCollector's transfer histograms (ms, MiB, GB/s).
LATENCY_MS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)
TOTAL_MB = (1, 5, 10, 50, 100, 500, 1000, 5000, 10000)
SPEED_GB_S = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)


def _sglang_page(role: str, polls: list[dict], index: int, model: str) -> str:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
    from prometheus_client import generate_latest
    disable_created_metrics()
    registry = CollectorRegistry()
    names = ("engine_type", "model_name", "moe_ep_rank", "pp_rank", "tp_rank")

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, names, registry=registry)

    running = gauge("sglang:num_running_reqs", "The number of running requests.")
    queue = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
    usage = gauge("sglang:token_usage", "The token usage.")
    used = gauge("sglang:kv_used_tokens", "KV pool tokens held by running requests.")
    capacity = gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.")
    page_size = gauge("sglang:page_size", "Number of tokens per KV cache page.")
    queues = {name: gauge(f"sglang:{name}", f"The number of requests in the {doc}.") for name, doc in (
        ("num_prefill_bootstrap_queue_reqs", "prefill bootstrap queue"),
        ("num_prefill_inflight_queue_reqs", "prefill inflight queue"),
        ("num_decode_prealloc_queue_reqs", "decode prealloc queue"),
        ("num_decode_transfer_queue_reqs", "decode transfer queue"))}
    histograms = {
        "latency": Histogram("sglang:kv_transfer_latency_ms", "Histogram of KV cache transfer latency in ms.", names,
                             buckets=LATENCY_MS, registry=registry),
        "size": Histogram("sglang:kv_transfer_total_mb", "Histogram of KV cache transfer size in MB.", names,
                          buckets=TOTAL_MB, registry=registry),
        "speed": Histogram("sglang:kv_transfer_speed_gb_s", "Histogram of KV cache transfer speed in GB/s.", names,
                           buckets=SPEED_GB_S, registry=registry),
    }
    failures = {"transfer_failures": ("sglang:num_transfer_failed_reqs_total", "The number of transfer failed requests."),
                "bootstrap_failures": ("sglang:num_bootstrap_failed_reqs_total", "The number of bootstrap failed requests.")}
    counters: dict = {}
    for poll in polls[:index]:
        for rank in ("0", "1"):
            labels = (role, model, "0", "0", rank)
            if role == "prefill":
                for (ms, mib), rank1_ms in zip(poll["transfers"], poll["rank1_ms"]):
                    latency = ms if rank == "0" else rank1_ms
                    histograms["latency"].labels(*labels).observe(latency)
                    histograms["size"].labels(*labels).observe(mib)
                    histograms["speed"].labels(*labels).observe(mib / 1024 / (latency / 1000))
                for key, (name, doc) in failures.items():
                    if poll[key]:  # created at the first failure, by every rank that counts one
                        if key not in counters:
                            counters[key] = Counter(name, doc, names, registry=registry)
                        counters[key].labels(*labels).inc(poll[key])
    poll = polls[index - 1]
    for rank in ("0", "1"):
        labels = (role, model, "0", "0", rank)
        running.labels(*labels).set(poll["running"])
        usage.labels(*labels).set(poll["usage"])
        used.labels(*labels).set(round(poll["usage"] * SGLANG_CAPACITY))
        capacity.labels(*labels).set(SGLANG_CAPACITY)
        page_size.labels(*labels).set(SGLANG_PAGE)
        queue.labels(*labels).set(poll["waiting"])
        own = ({"num_prefill_bootstrap_queue_reqs": poll["bootstrap"], "num_prefill_inflight_queue_reqs": poll["inflight"]}
               if role == "prefill" else
               {"num_decode_prealloc_queue_reqs": poll["prealloc"], "num_decode_transfer_queue_reqs": poll["transfer"]})
        for name, gauge_ in queues.items():
            gauge_.labels(*labels).set(own.get(name, 0))  # every scheduler exports every queue gauge
    return generate_latest(registry).decode()


def write_sglang() -> None:
    data = story()
    for role in ("prefill", "decode"):
        polls = data["sglang"][role]
        for index in range(1, len(polls) + 1):
            page_path(index, "sglang", role).write_text(_sglang_page(role, polls, index, data["model"]))


def main(argv: list[str]) -> int:
    if argv[1:] == ["vllm"]:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        write_vllm()
    elif argv[1:] == ["sglang"]:
        write_sglang()
    else:
        print(f"usage: {argv[0]} vllm|sglang", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
