"""The kvcache_* families the exporter exposes with their HELP texts; docs/metrics.md is generated from them
(`make docs`, devtools/contract_doc.py)."""

from __future__ import annotations

PREFIX = "kvcache_"
_POLLED = "Polled from the engine's /metrics and cached until the next poll."

# Per-rank gauges, by the derived name (without the prefix).
RANK_GAUGES = {
    "usage_ratio": "Fraction (0..1) of the KV pool held by live requests, as the engine reports it; evictable "
                   "prefix-cache blocks count as free. " + _POLLED,
    "capacity_blocks": "Usable KV blocks (pages) in the pool (vLLM: num_gpu_blocks - 1, the null block excluded). "
                       + _POLLED,
    "block_size_tokens": "Tokens per KV block (vLLM block_size, SGLang page_size). " + _POLLED,
    "capacity_tokens": "KV pool capacity in tokens. " + _POLLED,
    "used_blocks": "KV blocks held by live requests; derived by the exporter from the polled usage and capacity.",
    "free_blocks": "KV blocks a new request could get without preempting anyone (evictable prefix-cache blocks "
                   "count as free); capacity minus used, derived by the exporter.",
    "used_tokens": "KV tokens held by live requests; derived by the exporter from the polled values.",
    "free_tokens": "KV tokens a new request could get without preempting anyone; derived by the exporter.",
    "evictable_tokens": "Free KV tokens that still hold reusable prefix-cache content (SGLang kv_evictable_tokens). "
                        + _POLLED,
    "live_tokens_per_request": "Used KV tokens per running request, derived by the exporter; absent while "
                               "nothing runs.",
    "bytes_per_token": "KV bytes one token costs for the target's configured model architecture "
                       "(2 x layers x KV heads x head dim x bytes per element for full attention).",
    "capacity_bytes": "KV pool capacity in bytes: capacity tokens x bytes per token.",
    "used_bytes": "KV bytes held by live requests: used tokens x bytes per token.",
    "requests_running": "Requests in the running batch. " + _POLLED,
    "requests_waiting": "Requests queued, not yet scheduled. " + _POLLED,
    "requests_paused": "Requests the engine paused mid-generation for lack of KV, now (TensorRT-LLM's in-flight "
                       "batcher): a gauge of how many wait to resume, not a count of preemptions, so it never makes "
                       "the state thrashing. " + _POLLED,
    "requests_waiting_for_capacity": "Queued requests waiting for KV or batch capacity (vLLM "
                                     "num_requests_waiting_by_reason{reason=\"capacity\"}, which also counts "
                                     "requests held back by the running-request cap). " + _POLLED,
    "requests_waiting_for_kv": "Queued requests that wait because the KV pool is short (usage at the low-water "
                               "mark or above, or less free than one typical live request): the queue the pressure state "
                               "counts (vLLM's capacity reason, else the whole queue) while KV is short, else 0; "
                               "derived by the exporter for every engine.",
    "requests_waiting_with_kv_room": "Queued requests waiting while the KV pool has room (behind the running-request "
                                     "cap, the token budget, or vLLM's deferred reasons): requests_waiting minus "
                                     "requests_waiting_for_kv; derived by the exporter.",
    "headroom_requests": "Requests of today's typical size that still fit in the free KV: free tokens / live tokens "
                         "per request; derived by the exporter, absent while nothing runs.",
}
COUNTERS = {
    "preemptions_total": "Requests preempted (vLLM) or retracted (SGLang) to free KV; mirrors the engine's counter. "
                         + _POLLED,
    "prefix_cache_queried_tokens_total": "Prompt tokens looked up in the prefix cache; mirrors the engine's counter. "
                                         + _POLLED,
    "prefix_cache_hit_tokens_total": "Prompt tokens served from the prefix cache; mirrors the engine's counter. "
                                     + _POLLED,
    "prompt_tokens_total": "Prompt tokens processed; mirrors the engine's counter. " + _POLLED,
    "generation_tokens_total": "Tokens generated; mirrors the engine's counter. " + _POLLED,
    "external_cache_queried_tokens_total": "Prompt tokens looked up in an external KV cache (a KV connector such as "
                                           "LMCache or vLLM's offloading connector); mirrors the engine's counter. "
                                           + _POLLED,
    "external_cache_hit_tokens_total": "Prompt tokens the external KV cache had; mirrors the engine's counter. "
                                       + _POLLED,
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time to first token, queueing included, in the engine's own buckets. " + _POLLED,
    "inter_token_latency_seconds": "Time between output tokens, in the engine's own buckets. " + _POLLED,
    "queue_time_seconds": "Time requests waited before first being scheduled, in the engine's own buckets. "
                          + _POLLED,
    "e2e_request_latency_seconds": "Request latency from arrival to finish, in the engine's own buckets. " + _POLLED,
}
# KV kept beyond the GPU pool: offload tiers, and where cached prompt tokens came from.
TIERS = ("cpu", "disk", "remote")
HIT_SOURCES = ("gpu", "cpu", "disk", "remote", "other")
TRANSFER_DIRECTIONS = {"load": "tier to GPU", "store": "GPU to tier"}
_TIER = "`tier` is " + ", ".join(TIERS) + ". "
_TRANSFER = _TIER + "`direction` is " + ", ".join(f"{d} ({what})" for d, what in TRANSFER_DIRECTIONS.items()) + ". "
# Per-pool families with labels of their own: name -> (kind, label names, HELP).
TIER_FAMILIES = {
    "tier_capacity_tokens": ("gauge", ("tier",), "Offload tier capacity in tokens. " + _TIER + _POLLED),
    "tier_used_tokens": ("gauge", ("tier",), "Offload tier tokens that cannot be evicted (vLLM) or that the tier "
                                             "holds (SGLang, which reports no evictable split). " + _TIER + _POLLED),
    "tier_usage_ratio": ("gauge", ("tier",), "Fraction (0..1) of the offload tier that used tokens take. " + _TIER
                                             + _POLLED),
    "tier_used_bytes": ("gauge", ("tier",), "Bytes an offload tier holds, where the engine reports bytes only "
                                            "(LMCache; no capacity is exported). " + _TIER + _POLLED),
    "cached_prompt_tokens_total": ("counter", ("source",), "Prompt tokens served from a cache, by where they came "
                                   "from (`source` is " + ", ".join(HIT_SOURCES) + "); the sum over sources is the "
                                   "engine's cached prompt tokens, GPU and offloaded. " + _POLLED),
    "tier_transfer_bytes_total": ("counter", ("tier", "direction"), "Bytes moved between the GPU pool and an offload "
                                  "tier. " + _TRANSFER + _POLLED),
    "tier_transfer_tokens_total": ("counter", ("tier", "direction"), "Tokens moved between the GPU pool and an "
                                   "offload tier, where the engine counts tokens (SGLang; its storage tier's load is "
                                   "storage to host memory, its store host to storage). " + _TRANSFER
                                   + _POLLED),
    "tier_transfer_seconds_total": ("counter", ("tier", "direction"), "Time spent moving KV between the GPU pool and "
                                    "an offload tier. " + _TRANSFER + _POLLED),
    "tier_store_failures_total": ("counter", ("tier",), "Stores to an offload tier that found no room (vLLM "
                                  "allocation failures): the tier is full of KV it cannot evict. " + _TIER + _POLLED),
    "tier_evictions_total": ("counter", ("tier",), "Entries an offload tier evicted to make room for new KV "
                             "(LMCache: keys, one per KV chunk; vLLM and SGLang export none). " + _TIER + _POLLED),
}
# The pressure states, mildest first (exporter.derive.pressure_state says which one applies).
PRESSURE_STATES = ("ok", "tight", "capped", "saturated", "thrashing")
PRESSURE_STATE = ("pressure_state", "KV pressure derived by the exporter, 1 for the current state: ok, tight "
                  "(usage at the high-water mark, nothing queued), capped (requests queue while the KV pool has "
                  "room: the running-request cap or token budget binds), saturated (requests queue because KV is "
                  "short), thrashing (the engine preempts or retracts requests to free KV).")
# The `reason` label values of kvcache_target_scrape_failures_total, and what each means.
FAILURE_REASONS = {
    "timeout": "no complete response within the timeout",
    "connect": "no connection, a broken one, TLS refused, or an answer that is not HTTP",
    "credentials": "the target's bearer_token_file or password_file cannot be read, or holds a line break",
    "http_status": "an answer other than 200, a redirect to another host, or too many redirects",
    "too_large": "a page above max_response_bytes, decompressed",
    "parse": "a page that is not Prometheus text, not UTF-8, or badly compressed",
    "unknown_engine": "a page with no series of a known engine (or of the configured one)",
}
TARGET_FAMILIES = {
    "target_up": ("gauge", "1 if the last poll of the target succeeded and parsed, else 0."),
    "target_scrape_duration_seconds": ("gauge", "Duration of the last poll of the target."),
    "target_last_success_timestamp_seconds": ("gauge", "Unix time of the last successful poll of the target."),
    "target_scrape_failures_total": ("counter", "Failed polls of the target by reason ("
                                     + ", ".join(FAILURE_REASONS) + ")."),
    "target_info": ("gauge", "1, with the target's URL, detected engine and engine version where known."),
}
BUILD_INFO = ("exporter_build_info", "1, with the exporter's version.")
RELOAD_OK = ("exporter_config_last_reload_successful", "1 if the last configuration reload succeeded (or none was "
             "tried), 0 if it failed and the previous configuration is still running.")
PROBED_TARGETS = ("exporter_probed_targets", "Engines probed through /probe whose state this exporter keeps (forgotten "
                  "after the staleness period without a probe).")
PROBE_EVICTIONS = ("exporter_probe_evictions_total", "Probed engines forgotten before their staleness period "
                   "because probe.max_targets others were probed more recently.")
RELOAD_TIME = ("exporter_config_last_reload_success_timestamp_seconds", "Unix time of the last successful "
               "configuration load.")
# From the engines' KV event streams (a target's `kv_events:`), per pool, keyed by the name without the prefix.
_STREAMED = "Folded from the engine's KV event stream (ZMQ), GPU pool only."
EVENT_DROP_REASONS = {
    "gap": "messages the sequence numbers say were published but never arrived (nor came back by replay)",
    "decode": "messages that are not a KV event batch: wrong frames, not msgpack, wrong shape, too large",
    "overflow": "messages dropped because the queue between the socket and the tracker was full",
}
EVENT_IGNORED_REASONS = {
    "unknown_type": "events of a type the exporter does not know (skipped)",
    "unknown_field": "events with fields the exporter does not know (decoded, the fields skipped)",
    "other_medium": "blocks of another tier than the GPU pool (CPU offload, disk, ...)",
    "other_group": "blocks of a KV cache group other than 0 (sliding-window or Mamba groups of hybrid models)",
}
EVENT_FAMILIES = {
    "events_blocks_stored_total": ("counter", "Blocks the pool cached (BlockStored). " + _STREAMED),
    "events_blocks_evicted_total": ("counter", "Blocks the pool evicted (BlockRemoved; vLLM reports an eviction "
                                               "when the block is reallocated, not when it is freed). " + _STREAMED),
    "capacity_miss_blocks_total": ("counter", "Blocks stored again while their hash was in the list of recent "
                                              "evictions: evicted for room, needed again, recomputed. " + _STREAMED),
    "capacity_miss_distance_ratio": ("histogram", "Per capacity-miss block: blocks the pool evicted after it "
                                                  "and not stored again before its re-store (how far below the "
                                                  "pool it lay under LRU), divided by the pool's capacity in "
                                                  "blocks. Under LRU, the misses at or below x are those a pool "
                                                  "(1 + x) times as large would have kept. " + _STREAMED),
    "block_residency_seconds": ("histogram", "Time from a block's store to its eviction, by the batches' "
                                             "timestamps. " + _STREAMED),
    "events_messages_total": ("counter", "Event batches received and decoded from the pool's stream."),
    "events_dropped_total": ("counter", "Event batches lost or refused, by reason ("
                                        + ", ".join(EVENT_DROP_REASONS) + ")."),
    "events_ignored_total": ("counter", "Events or blocks the pool's state leaves out, by reason ("
                                        + ", ".join(EVENT_IGNORED_REASONS) + ")."),
    "events_publisher_restarts_total": ("counter", "Times the stream's sequence number went back (the publisher "
                                                   "restarted): the pool's state was dropped and started anew."),
    "events_last_message_timestamp_seconds": ("gauge", "Unix time the exporter received the pool's last event "
                                                       "batch."),
}
