"""Disaggregated prefill/decode: the two sides of each P/D group side by side, the KV transfers between them,
and P/D backpressure. Every panel reads prefill and decode pools only (View.disaggregated)."""

from __future__ import annotations

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Query, describe, no_value_without_source, timeseries, without_source
from kvcache_exporter.dashboards.view import (BYTES_PER_SECOND, FAILURES_PER_SECOND, RATIO, REQUESTS, SECONDS,
                                              TOKENS, View, legend_of, percent)

USED = "kvcache_used_tokens"
CAPACITY = "kvcache_capacity_tokens"
STAGES = "kvcache_kv_transfer_requests"
WAITING_FOR_KV = "kvcache_kv_transfer_requests_waiting_for_kv"
HELD = "kvcache_kv_transfer_held_tokens"
USAGE = "kvcache_usage_ratio"
SECONDS_HISTOGRAM = "kvcache_kv_transfer_seconds"
BYTES_HISTOGRAM = "kvcache_kv_transfer_bytes"
FAILURES = "kvcache_kv_transfer_failures_total"
EXPIRIES = "kvcache_kv_transfer_lease_expiries_total"
AFTER_EXPIRY = "kvcache_kv_transfer_notifications_after_expiry_total"
ABOVE_LINK = "kvcache_kv_transfer_above_link_total"
ONLY_DISAGGREGATED = ("Present only where the engines run disaggregated (a KV connector, SGLang's "
                      "--disaggregation-mode) on pools whose role is prefill or decode; `role` is the page's, else "
                      "the target's `role:`.")


def usage_by_role(v: View):
    v = v.disaggregated()
    by = (v.pd_group, "role")
    return timeseries(
        "KV usage, prefill vs decode",
        describe(
            f"Used tokens / capacity tokens of the pools of each P/D group ({v.pd_group}) and role: "
            "sum(used) / sum(capacity). A prefill side holds the KV of computed prompts until its decode side has "
            "it: its usage rises when the decode side does not keep up. " + ONLY_DISAGGREGATED,
            f"the decode side above {percent(v.thresholds.high_water_ratio)} with transfers waiting (Transfers by "
            "stage) is P/D backpressure: decode is the bottleneck.",
        ),
        RATIO,
        [Query(promql.gauge_ratio(v.scope, USED, CAPACITY, by), legend_of(by))],
        bands.usage(v.thresholds),
        min_max=(0, 1),
    )


def held_for_export(v: View):
    v = v.disaggregated()
    return timeseries(
        f"Prefill KV held for export {v.per}",
        describe(
            "Of each prefill pool's used KV tokens, those it holds only until the decode side has them: prompts "
            "computed that the decode side has not pulled (vLLM: finished requests, neither running nor waiting) or "
            "whose transfer has not finished (SGLang's inflight queue). An estimate while prompts run or are in "
            "flight (docs/metrics.md). Not prefill demand: the fleet rules ask no prefill replica for it and do not "
            "count it as used when they give one back." + without_source(HELD.removeprefix("kvcache_")),
            "no band: held KV that keeps growing with the used KV is decode not keeping up (P/D backpressure): "
            "give decode KV or replicas, not prefill.",
        ),
        TOKENS,
        [Query(promql.total(v.scope, HELD, v.split, role="prefill"), v.line("held for export")),
         Query(promql.total(v.scope, USED, v.split, role="prefill"), v.line("used"))],
        bands.neutral(),
        v.drill_down,
        no_value=no_value_without_source(HELD.removeprefix("kvcache_")),
    )


def transfer_stages(v: View):
    v = v.disaggregated()
    by = (*v.split, "role", "stage")
    return timeseries(
        f"Transfers by stage {v.per}",
        describe(
            "Requests by KV transfer stage, in the same words for every engine: waiting_to_start (waiting for KV to "
            "be allocated on the decode side; SGLang's prefill: its bootstrap queue), in_progress (waiting for the "
            "transfer; SGLang's prefill: computed, sending), completed_waiting (transfer done, waiting to run). A "
            "decode pool's queue is these three." + without_source(STAGES.removeprefix("kvcache_")),
            "no red band: a decode side's waiting_to_start that keeps growing while its KV is short is "
            "P/D backpressure.",
        ),
        REQUESTS,
        [Query(promql.total(v.scope, STAGES, by), v.line("{{role}} {{stage}}"))],
        bands.neutral(),
        v.drill_down,
        no_value=no_value_without_source(STAGES.removeprefix("kvcache_")),
    )


def backpressure(v: View):
    v = v.disaggregated()
    group = (v.pd_group,)
    expr = promql.pd_backpressure(v.selector(WAITING_FOR_KV, role="decode"), v.selector(USAGE, role="prefill"),
                                  v.pd_group)
    return timeseries(
        "P/D backpressure",
        describe(
            f"Per P/D group ({v.pd_group}): the decode pools' transfers that wait for KV (waiting to start while "
            "the pool's KV is short), where the group has prefill pools, which hold those requests' KV (vLLM) or "
            "wait to compute them (SGLang). A signal of its own: neither side's pressure state says it for sure.",
            "any request: decode holds the group back (KVCachePDBackpressure): give decode KV or replicas.",
        ),
        REQUESTS,
        [Query(expr, legend_of(group))],
        bands.any_present(),
    )


def transfer_time(v: View):
    v = v.disaggregated()
    by = (*v.split, "role")
    return timeseries(
        f"Transfer time p90 {v.per}",
        describe(
            "90th percentile of the KV transfers' duration over the window, on the side that times them (vLLM "
            "pulling with NIXL: decode; vLLM pushing, NIXL push or Mooncake: prefill; one observation per TP rank; "
            "SGLang: prefill). Triton has no buckets: no line."
            + without_source(SECONDS_HISTOGRAM.removeprefix("kvcache_")),
            "no absolute red: compare it with the time to first token (Latency) and with the bytes it moves "
            "(Transfer bandwidth).",
        ),
        SECONDS,
        [Query(promql.quantile(0.9, v.scope, SECONDS_HISTOGRAM, by), v.line("{{role}} p90"))],
        bands.neutral(),
        v.drill_down,
        no_value=no_value_without_source(SECONDS_HISTOGRAM.removeprefix("kvcache_")),
    )


def bandwidth(v: View):
    v = v.disaggregated()
    t = v.thresholds
    link = t.kv_transfer_link_bytes_per_second
    quotient = promql.ratio(promql.rate(v.scope, BYTES_HISTOGRAM + "_sum", v.split),
                            promql.rate(v.scope, SECONDS_HISTOGRAM + "_sum", v.split))
    return timeseries(
        f"Transfer bandwidth {v.per}",
        describe(
            "Bytes over seconds of the same KV transfers: sum(rate(bytes sum)) / sum(rate(seconds sum)) (vLLM: one "
            "TP rank's), every transfer the engine timed, those it reported faster than the link included (SGLang "
            "times only the last chunk of a chunked prefill; how many is the 'reported above the link' line of "
            "Transfer failures). Believed up to the link rate "
            f"({link / 1e9:g} GB/s, kv_transfer_link_bytes_per_second); above it the quotient itself is broken, not "
            "fast, and drawn as its own line.",
            f"below {percent(t.kv_transfer_bandwidth_low_fraction)} of the link rate (KVCacheTransferBandwidthLow): "
            "a host-staged or misrouted path, or a congested link.",
        ),
        BYTES_PER_SECOND,
        [Query(f"({quotient}) <= {link:g}", v.line()),
         Query(f"({quotient}) > {link:g}", v.line("above the link: broken reading"))],
        ((None, "red"), (t.kv_transfer_bandwidth_low_fraction * link, "green"), (link, "purple")),
        v.drill_down,
    )


def failures_and_expiries(v: View):
    v = v.disaggregated()
    return timeseries(
        f"Transfer failures and lease expiries {v.per}",
        describe(
            "Per second: failed KV transfers by kind (transfer, handshake, notification, receive: they may overlap, "
            "vLLM NIXL counts every failure under transfer since 0.31; the decode side of vLLM Mooncake and SGLang "
            "counts the receives it gave up on, which its prefill side may count too), prefill KV freed at lease "
            "expiry before the decode side pulled it, transfers completed after their lease (the KV may have been "
            "reused), and transfers the engine reported faster than the link (broken readings the bandwidth averages "
            "in; the speed histograms of SGLang and Dynamo's TensorRT-LLM)."
            + without_source(FAILURES.removeprefix("kvcache_")),
            "any transfer completed after its lease (KVCacheTransferNotificationsAfterExpiry, critical); "
            "expiries all along (KVCacheTransferLeaseExpiries: decode too slow or too full); failures above "
            f"{percent(v.thresholds.kv_transfer_failure_ratio)} of the transfers (KVCacheTransfersFailing).",
        ),
        FAILURES_PER_SECOND,
        [Query(promql.rate(v.scope, FAILURES, (*v.split, "kind")), v.line("failed {{kind}}")),
         Query(promql.rate(v.scope, EXPIRIES, v.split), v.line("lease expired")),
         Query(promql.rate(v.scope, AFTER_EXPIRY, v.split), v.line("completed after expiry")),
         Query(promql.rate(v.scope, ABOVE_LINK, v.split), v.line("reported above the link"))],
        bands.neutral(),
        v.drill_down,
        no_value=no_value_without_source(FAILURES.removeprefix("kvcache_")),
    )
