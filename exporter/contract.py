"""The kvcache_* contract: one record per family (`FAMILIES`), and the values its labels take.

Everything that names a family derives from this table: the exposition's HELP and TYPE lines
(exporter/exposition.py), docs/metrics.md (devtools/contract_doc.py, `make docs`), the dashboards' and
the rules' lints, the families `top` reads, the adapters' lists of families they cannot fill;
tests/unit/test_contract_table.py fails when any of them names a family the table lacks.
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass

from .thresholds import SHARD_LEAD_RATIO

PREFIX = "kvcache_"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Units a family's name spells out (docs/metrics.md's conventions: base units in the name).
UNITS = ("seconds", "bytes", "tokens", "blocks", "ratio", "requests")


@dataclass(frozen=True)
class Group:
    """What a group of families describes: the labels that name a series' subject (besides the
    configuration's static labels, which every per-target series carries too), and what feeds it."""

    identity: tuple[str, ...]
    # "exporter": the exporter itself (the process, its polls); "poll": the engine's /metrics page, read by
    # its adapter and completed by exporter/derive.py; "events": the engine's KV event stream; "process":
    # prometheus_client's process and platform collectors, read in each of the exporter's processes.
    fed_by: str
    # Prepended to its families' names: the standard process families keep the names every exporter gives them.
    prefix: str = PREFIX


# `role`: the pool's part in disaggregated serving (ROLES), the same for every pool of a target.
_POOL = ("target", "engine", "model", "dp_rank", "role")
GROUPS = {
    "exporter": Group((), "exporter"),  # the process: no static labels either
    "process": Group((), "process", prefix=""),  # process_* and python_info, as every Python exporter has them
    "target": Group(("target", "engine"), "exporter"),  # the outcome of the target's polls
    "pool": Group(_POOL, "poll"),  # one data-parallel replica's KV pool and queue
    "latency": Group(_POOL, "poll"),  # its requests' latency histograms
    "pressure": Group(_POOL, "poll"),
    "offload": Group(_POOL, "poll"),  # KV beyond the GPU pool
    "transfer": Group(_POOL, "poll"),  # KV moved between the pools of disaggregated prefill and decode
    "events": Group(_POOL, "events"),
    # One model's replicas together, from every stream of the exporter process (`fleet_index:`, exporter/fleet.py).
    "fleet": Group(("model",), "events"),
}
# The groups a configuration can turn off (`families: {latency: false}`), as node_exporter's collectors: what the
# engines report and the exporter derives. The exporter's own, its targets' and the process' series always show.
OPTIONAL_GROUPS = ("pool", "pressure", "latency", "offload", "transfer", "events")


@dataclass(frozen=True)
class Family:
    name: str  # without its group's prefix
    type: str  # gauge, counter or histogram
    group: str  # a key of GROUPS
    unit: str  # one of UNITS, or "" for a count of something else, a flag or a state
    help: str
    labels: tuple[str, ...] = ()  # its own labels, beyond the group's identity (and a histogram's `le`)
    # Part of the public contract: renamed or removed only with a migration note. The exporter's other
    # series about itself say how the process runs and may change.
    stable: bool = True

    @property
    def metric(self) -> str:
        return GROUPS[self.group].prefix + self.name

    @property
    def identity(self) -> tuple[str, ...]:
        return GROUPS[self.group].identity

    @property
    def fed_by(self) -> str:
        return GROUPS[self.group].fed_by

    @property
    def series(self) -> tuple[str, ...]:
        """The names its samples carry: a histogram's buckets, sum and count, else its own name."""
        if self.type == "histogram":
            return tuple(self.metric + suffix for suffix in HISTOGRAM_SUFFIXES)
        return (self.metric,)


# The values labels take.
PRESSURE_STATES = ("ok", "tight", "capped", "saturated", "thrashing")  # mildest first; exporter.derive decides
# The states in which requests wait for KV or are recomputed for it: the pool has no room for another request.
KV_SHORT_STATES = ("saturated", "thrashing")
# What each state says, in a few words: the state family's description, and the README's table of states.
PRESSURE_STATE_MEANINGS = {
    "ok": "KV has room and nothing waits for it",
    "tight": "usage at the high-water mark, nothing queued",
    "capped": "requests queue while the KV pool has room: not KV but the running-request cap, the token budget, "
              "or an engine that admits nothing",
    "saturated": "requests queue because KV is short",
    "thrashing": "the engine preempts or retracts requests to free KV",
}


@dataclass(frozen=True)
class Reason:
    """Why a pool is in its pressure state: the rule of exporter.derive that decided it. `words` say it without
    the pool's own numbers (a panel's value mapping, beside the columns that hold them); `text` says it with
    them, its {placeholders} the pool's gauges (contract family names), `preemptions_per_minute` and the marks
    `low_water_ratio` and `high_water_ratio` (exporter.thresholds), each filled by its reader: `top` from the
    page, the alerts by Prometheus template queries (reason_text)."""

    state: str
    words: str
    text: str


# The reasons, mildest first and grouped by state in PRESSURE_STATES' order, so that the worst reason of a
# target's ranks is also its worst state. A fixed set: `kvcache_pressure_reason{reason}` has one series per reason
# per pool, as the state has one per state; the numbers stay in their own gauges, never in a label.
PRESSURE_REASONS = {
    "room": Reason("ok", "ok", "KV has room and nothing waits for it"),
    "high_water": Reason("tight", "tight: at or above the high-water mark {high_water_ratio}",
                         "{usage_ratio} used (high-water {high_water_ratio}), nothing waiting"),
    "cap": Reason("capped", "capped: a concurrency or batch cap, not KV",
                  "capped: {requests_waiting_with_kv_room} waiting with {headroom_requests} requests of room: "
                  "a concurrency or batch cap, not KV"),
    "admits_nothing": Reason("capped", "capped: none running, the engine admits nothing",
                             "{requests_waiting_with_kv_room} waiting, none running, {free_tokens} tokens free: the "
                             "engine admits nothing (not KV, not a cap); KVCacheAdmissionStalled if it lasts"),
    "preempted": Reason("saturated", "saturated: preempted just now for KV",
                        "{requests_waiting_for_kv} waiting, and the engine preempted since the last poll to free KV"),
    "free_below_request": Reason("saturated", "saturated: less KV free than one request holds",
                                 "{requests_waiting_for_kv} waiting: {free_tokens} tokens free, less than one typical "
                                 "request's {live_tokens_per_request}"),
    "low_water": Reason("saturated", "saturated: queue at or above {low_water_ratio} used",
                        "{requests_waiting_for_kv} waiting at {usage_ratio} used (low-water {low_water_ratio})"),
    "preemptions": Reason("thrashing", "thrashing: preempting to free KV",
                          "thrashing: {preemptions_per_minute} preemptions/min"),
}
REASON_RATIOS = ("usage_ratio", "low_water_ratio", "high_water_ratio")  # placeholders written as a percentage


def reason_text(reason: str, value: Callable[[str], str], words: bool = False) -> str:
    """A reason's text (its words, with `words`), each placeholder replaced by `value(name)`: the reader's number,
    formatted."""
    found = PRESSURE_REASONS[reason]
    text = found.words if words else found.text
    return text.format_map({name: value(name) for _, name, _, _ in string.Formatter().parse(text) if name})


# KV kept beyond the GPU pool: offload tiers, and where cached prompt tokens came from.
TIERS = ("cpu", "disk", "remote")
# `peer`: KV another engine instance sends (disaggregated prefill/decode), not a storage tier; counted when the load
# is planned (vLLM), failed and unfinished loads included.
HIT_SOURCES = ("gpu", "cpu", "disk", "remote", "peer", "other")
TRANSFER_DIRECTIONS = {"load": "tier to GPU", "store": "GPU to tier"}
# Disaggregated prefill/decode: a pool's role (the page's, else the target's `role:`, else unified), the
# stages a request's KV transfer goes through, and the kinds of transfer failure.
ROLES = {
    "prefill": "computes prompts and hands their KV to a decode pool",
    "decode": "receives prompts' KV from a prefill pool and generates",
    "unified": "does both (no disaggregation)",
}
# The roles of disaggregated serving: the P/D rows, rules and alerts read these pools only.
DISAGGREGATED_ROLES = ("prefill", "decode")
# The stages in the same words for every engine: a request's KV is allocated on the decode side, then transferred,
# then the request waits to run (running: requests_running). Each engine's queue for each, in docs/metrics.md.
TRANSFER_STAGES = {
    "waiting_to_start": "waiting for KV to be allocated on the decode side: on a decode pool the request has no "
                        "KV to receive into yet (vLLM's waiting_to_start, SGLang's pre-allocation queue), on a "
                        "prefill pool it waits for its decode peer to allocate it (SGLang's bootstrap queue)",
    "in_progress": "waiting for the transfer: the decode side has allocated the KV and the transfer has not "
                   "finished (vLLM's in_progress and SGLang's transfer queue on a decode pool; SGLang's inflight "
                   "queue on a prefill pool: computed, its KV being sent)",
    "completed_waiting": "transfer done and waiting to run: the decode pool has the KV, the request is not "
                         "running yet (vLLM's completed_waiting, SGLang's waiting queue on a decode server)",
}
# How an engine's prefill pool holds a computed prompt's KV until the decode side has it (an adapter's
# `export_hold`; exporter/derive.py's held_for_export reads each).
EXPORT_HOLDS = {
    "finished": "the request is finished and counted nowhere, its blocks kept until the decode side pulls them "
                "(vLLM)",
    "inflight": "the request waits in a queue of its own while its KV is sent (SGLang's inflight queue)",
}
TRANSFER_FAILURE_KINDS = {
    "transfer": "the KV transfer itself (vLLM NIXL since 0.31 also counts handshake and notification failures here)",
    "handshake": "setting the transfer up with the peer (SGLang's bootstrap)",
    "notification": "telling the peer the transfer is done (vLLM NIXL)",
    "receive": "the receiving side gave up on a transfer whose sender times it (the decode side of vLLM Mooncake "
               "and of SGLang); the sender may count the same transfer as failed",
}
# kvcache_target_scrape_failures_total{reason}, and what each means.
FAILURE_REASONS = {
    "timeout": "no complete response within the timeout",
    "connect": "no connection, a broken one, TLS refused, or an answer that is not HTTP",
    "credentials": "the target's bearer_token_file or password_file cannot be read, is empty or holds a line break",
    "http_status": "an answer other than 200, a redirect to another host, or too many redirects",
    "too_large": "a page above max_response_bytes, decompressed",
    "parse": "a page that is not Prometheus text, not UTF-8, or badly compressed",
    "unknown_engine": "a page with no series of a known engine (or of the configured one)",
}
EVENT_DROP_REASONS = {
    "gap": "messages the sequence numbers say were published but never arrived (nor came back by replay)",
    "decode": "messages that are not a KV event batch: wrong frames, not msgpack, wrong shape, too large",
    "overflow": "messages dropped because the queue between the socket and the tracker was full",
}
EVENT_IGNORED_REASONS = {
    "unknown_type": "events of a type the exporter does not know (skipped)",
    "unknown_field": "events with fields the exporter does not know (decoded, the fields skipped)",
    "other_medium": "blocks of a medium that is neither the GPU pool's nor an offload tier's",
    "other_group": "blocks of a KV cache group other than 0 (sliding-window or Mamba groups of hybrid models)",
}
# The buckets of the histograms the exporter fills itself, from the KV event streams.
# Capacity-miss distance / the pool's capacity: each WHAT_IF_FACTORS - 1 is a bound, so what a larger pool keeps
# is a bucket's count, never an interpolation between two. Halfway from 2 to 4 for the factor 4's 3, it kept 3.0 to
# 3.3 % too few misses on tests/unit/test_kvevents_whatif.py's hot and cold trace, 0.2 to 0.3 % on its simulator
# workload, and between two bounds the error has no bound of its own (all the misses on one side).
DISTANCE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 4.0)
RESIDENCY_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)  # seconds
# The fleet index's isolated-replica heuristic (exporter/fleet.py): a replica that stored this many tracked blocks
# without meeting a sibling's while its siblings met each other's on at least this share of their stores.
ISOLATED_MIN_BLOCKS = 256
ISOLATED_SIBLING_SHARE = 0.01
# Pools 1.25x to 4x as large, the sizes the rules and panels answer for (fp8 KV: x2 tokens per byte); each
# factor - 1 is a bound of DISTANCE_BUCKETS.
WHAT_IF_FACTORS = (1.25, 1.5, 2.0, 4.0)

_POLLED = "Polled from the engine's /metrics and cached until the next poll."
_STREAMED = "Folded from the engine's KV event stream (ZMQ), GPU pool only."
_TIERED = ("`tier` is " + ", ".join(TIERS) + " (the event's medium: CPU and CPU_PINNED are cpu, DISK and STORAGE "
           "disk, EXTERNAL remote). Folded from the engine's KV event stream (ZMQ).")
_FLEET = ("Folded from the KV event streams of the model's replicas that this exporter process subscribes to; an "
          "estimate scaled by 1 / kvcache_fleet_index_sampling_ratio once sampled.")
_HOLDERS = ("The top kv_events.top_holders by resident blocks, the rest summed as `other` (whose members change "
            "as the ranking does). " + _STREAMED)
_TIER = "`tier` is " + ", ".join(TIERS) + ". "
_KV_TRANSFER = "Disaggregated prefill/decode only (absent without a KV connector). "
_TRANSFER = _TIER + "`direction` is " + ", ".join(f"{d} ({what})" for d, what in TRANSFER_DIRECTIONS.items()) + ". "
# With `workers` above 1 each process reports its own: the serving process without `worker`, a worker with it.
_PROCESS = ("prometheus_client's process collector (Linux: read from /proc). `worker`: absent on the process that "
            "serves /metrics, the worker's index on a worker process's series (`workers` above 1).")

# In the order the exporter serves them.
_TABLE = (
    # The exporter itself.
    Family("exporter_build_info", "gauge", "exporter", "",
           "1, with the exporter's version, the page reader it runs (`reader`) and the adapters' fold of the samples "
           "(`adapter`): `cython` (compiled at install) or `python` (no C compiler was there; the same output, more "
           "CPU).", ("version", "reader", "adapter")),
    Family("exporter_config_last_reload_successful", "gauge", "exporter", "",
           "1 if the last configuration reload succeeded (or none was tried), 0 if it failed and the previous "
           "configuration is still running.", stable=False),
    Family("exporter_config_last_reload_success_timestamp_seconds", "gauge", "exporter", "seconds",
           "Unix time of the last successful configuration load.", stable=False),
    Family("exporter_probed_targets", "gauge", "exporter", "",
           "Engines probed through /probe whose state this exporter keeps (forgotten after the staleness period "
           "without a probe).", stable=False),
    Family("exporter_probe_evictions_total", "counter", "exporter", "",
           "Probed engines forgotten before their staleness period because probe.max_targets others were probed "
           "more recently.", stable=False),
    Family("exporter_poll_phase_locked", "gauge", "exporter", "",
           "1 while the polls are phase-locked to a regular scraper of /metrics (each target's poll timed to "
           "complete just before that scraper's next scrape), 0 on the exporter's own cadence (no regular scraper, "
           "or its interval no whole multiple of poll_interval).", stable=False),
    Family("exporter_scrape_interval_seconds", "gauge", "exporter", "seconds",
           "Interval between the scrapes of /metrics by the scraper the polls lock onto (or would, were it a whole "
           "multiple of poll_interval), measured from their arrivals; 0 while no client scrapes regularly.",
           stable=False),
    Family("exporter_poll_lead_ratio", "gauge", "exporter", "ratio",
           "How early the fleet's earliest poll starts before a scrape, over the poll interval: the longest "
           "expected poll (the longest of a target's recent ones), the window the polls are spread over (1.25 times the "
           "poll loop's CPU per interval) and a margin. The data a scrape reads is up to this much of an interval "
           "old; above " + f"{SHARD_LEAD_RATIO:g}" + " it is more than a second older than a direct scrape's at 5 s "
           "(docs/scaling.md): add a replica (`--shard`) or a worker.", stable=False),
    Family("exporter_pressure_threshold", "gauge", "exporter", "",
           "The thresholds the pressure state and the waiting split are derived with (exporter/thresholds.py, "
           "overridden by the configuration's `pressure:`), by name: the marks as ratios, the preemption rate per "
           "second, the window in seconds. `top --exporter` reads them, so its reasons and per-minute figures "
           "quote what the exporter used.", ("name",), stable=False),
    Family("exporter_group_enabled", "gauge", "exporter", "",
           "1 for each group of families the exporter exposes, 0 for one its configuration turned off (`families:`): "
           "a dashboard panel over a group that is off says so instead of showing no data.", ("group",),
           stable=False),
    Family("exporter_workers", "gauge", "exporter", "",
           "Processes that poll the targets between them (`workers`, 1 by default: this process alone).",
           stable=False),
    Family("exporter_worker_restarts_total", "counter", "exporter", "",
           "Worker processes started again after they ended; until the new one has polled them, the targets "
           "of its share are absent from /metrics.", stable=False),
    Family("exporter_worker_missed_replies_total", "counter", "exporter", "",
           "Requests to a worker process (a scrape of /metrics, a /ready) it did not answer within the poll "
           "timeout: the targets of its share were absent from that response.", stable=False),
    # The processes, as prometheus_client's collectors describe any Python program.
    Family("process_cpu_seconds_total", "counter", "process", "seconds", "User and system CPU time the process "
           "has used. " + _PROCESS, ("worker",)),
    Family("process_resident_memory_bytes", "gauge", "process", "bytes", "Resident memory of the process. "
           + _PROCESS, ("worker",)),
    Family("process_virtual_memory_bytes", "gauge", "process", "bytes", "Virtual memory of the process. "
           + _PROCESS, ("worker",)),
    Family("process_start_time_seconds", "gauge", "process", "seconds", "Unix time the process started. "
           + _PROCESS, ("worker",)),
    Family("process_open_fds", "gauge", "process", "", "File descriptors the process holds open (sockets to the "
           "targets included). " + _PROCESS, ("worker",)),
    Family("process_max_fds", "gauge", "process", "", "The process's limit on open file descriptors. " + _PROCESS,
           ("worker",)),
    Family("python_info", "gauge", "process", "", "1, with the Python that runs the exporter (prometheus_client's "
           "platform collector); from the serving process only.",
           ("implementation", "major", "minor", "patchlevel", "version")),
    # Its polls, per target.
    Family("target_up", "gauge", "target", "", "1 if the last poll of the target succeeded and parsed, else 0."),
    Family("target_scrape_duration_seconds", "gauge", "target", "seconds", "Duration of the last poll of the target."),
    Family("target_last_success_timestamp_seconds", "gauge", "target", "seconds",
           "Unix time of the last successful poll of the target."),
    Family("target_scrape_failures_total", "counter", "target", "",
           "Failed polls of the target by reason (" + ", ".join(FAILURE_REASONS) + ").", ("reason",)),
    Family("target_info", "gauge", "target", "",
           "1, with the target's URL, detected engine and engine version where known.", ("url", "version")),
    Family("target_replica_info", "gauge", "target", "",
           "1, with the model the target serves and its pools' role, whether or not it answers: as its page last "
           "said them, else as its configuration (`model:`, `role:`) or its probe (`model`, `role` parameters) "
           "says. What a replica that has not answered yet (an autoscaler's new one) is a replica of: the fleet "
           "rules count it as starting.", ("model", "role")),
    # Per pool: the KV pool and the queue.
    Family("usage_ratio", "gauge", "pool", "ratio",
           "Fraction (0..1) of the KV pool held by live requests, as the engine reports it; evictable prefix-cache "
           "blocks count as free. " + _POLLED),
    Family("capacity_blocks", "gauge", "pool", "blocks",
           "Usable KV blocks (pages) in the pool (vLLM: num_gpu_blocks - 1, the null block excluded). " + _POLLED),
    Family("block_size_tokens", "gauge", "pool", "tokens",
           "Tokens per KV block (vLLM block_size, SGLang page_size). " + _POLLED),
    Family("prefix_cache_min_hit_tokens", "gauge", "pool", "tokens",
           "The shortest shared prefix that can be a prefix-cache hit: hits land on whole blocks of this many "
           "tokens, so a shorter shared prefix is never one (and a prompt needs one token more, which the engine "
           "computes). vLLM: cache_config_info's cache_hit_alignment_tokens, else effective_attention_block_size "
           "(a hybrid model's full-attention block, often far above block_size), else block_size; the other "
           "engines: their block size (SGLang page_size). " + _POLLED),
    Family("capacity_tokens", "gauge", "pool", "tokens", "KV pool capacity in tokens. " + _POLLED),
    Family("used_blocks", "gauge", "pool", "blocks",
           "KV blocks held by live requests; derived by the exporter from the polled usage and capacity."),
    Family("free_blocks", "gauge", "pool", "blocks",
           "KV blocks a new request could get without preempting anyone (evictable prefix-cache blocks count as "
           "free); capacity minus used, derived by the exporter."),
    Family("used_tokens", "gauge", "pool", "tokens",
           "KV tokens held by live requests; derived by the exporter from the polled values."),
    Family("free_tokens", "gauge", "pool", "tokens",
           "KV tokens a new request could get without preempting anyone; derived by the exporter."),
    Family("evictable_tokens", "gauge", "pool", "tokens",
           "Free KV tokens that still hold reusable prefix-cache content (SGLang kv_evictable_tokens). " + _POLLED),
    Family("live_tokens_per_request", "gauge", "pool", "tokens",
           "Used KV tokens per running request, on a prefill pool less kvcache_kv_transfer_held_tokens (KV of "
           "requests that no longer run); derived by the exporter, absent while nothing runs."),
    Family("bytes_per_token", "gauge", "pool", "bytes",
           "KV bytes one token costs for the target's configured model architecture (2 x layers x KV heads x "
           "head dim x bytes per element for full attention)."),
    Family("capacity_bytes", "gauge", "pool", "bytes", "KV pool capacity in bytes: capacity tokens x bytes per token."),
    Family("used_bytes", "gauge", "pool", "bytes", "KV bytes held by live requests: used tokens x bytes per token."),
    Family("requests_running", "gauge", "pool", "requests", "Requests in the running batch. " + _POLLED),
    Family("requests_running_max", "gauge", "pool", "requests",
           "The most requests the engine keeps running at once, its running-request cap (TensorRT-LLM's "
           "maxNumActiveRequests; vLLM's max_num_seqs and SGLang's max_running_requests are not exported). "
           + _POLLED),
    Family("requests_waiting", "gauge", "pool", "requests",
           "Requests queued, not yet scheduled; on a decode pool every request from its arrival until it runs (the "
           "three stages of kvcache_kv_transfer_requests: SGLang's pre-allocation, transfer and waiting queues "
           "added up, as vLLM's queue holds them). " + _POLLED),
    Family("requests_paused", "gauge", "pool", "requests",
           "Requests the engine paused mid-generation for lack of KV, now (TensorRT-LLM's in-flight batcher): a "
           "gauge of how many wait to resume, not a count of preemptions, so it never makes the state thrashing. "
           + _POLLED),
    Family("requests_waiting_for_capacity", "gauge", "pool", "requests",
           "Queued requests waiting for KV or batch capacity (vLLM num_requests_waiting_by_reason{reason="
           "\"capacity\"}, which also counts requests held back by the running-request cap). " + _POLLED),
    Family("requests_waiting_for_kv", "gauge", "pool", "requests",
           "Queued requests that wait because the KV pool is short (preemptions at the thrashing rate, usage at "
           "the low-water mark or above, less free than one typical live request, or a preemption since the last "
           "poll): the queue the pressure state counts (vLLM's capacity reason, else "
           "the whole queue; on a decode pool never the transfers that hold their KV already) while KV is short, "
           "else 0; derived by the exporter for every engine."),
    Family("requests_waiting_with_kv_room", "gauge", "pool", "requests",
           "Queued requests waiting while the KV pool has room (behind the running-request cap or the token "
           "budget): the queue the pressure state counts while KV has room, less a decode pool's transfers "
           "waiting to start, else 0; derived by the exporter. Neither this nor requests_waiting_for_kv counts "
           "requests that wait for something else (vLLM's deferred reasons: a KV transfer under way or done, a "
           "LoRA slot, a grammar)."),
    Family("headroom_requests", "gauge", "pool", "requests",
           "Requests of today's typical size that still fit in the free KV: free tokens / live tokens per request, "
           "and 0 while the pool is saturated or thrashing (its queue waits for KV: engines reserve KV ahead for "
           "the running requests' output and admission watermarks, so what is free then is no room a request is "
           "admitted into); derived by the exporter, absent while nothing runs."),
    Family("preemptions_total", "counter", "pool", "",
           "Requests preempted (vLLM) or retracted (SGLang) to free KV; mirrors the engine's counter. " + _POLLED),
    Family("prefix_cache_queried_tokens_total", "counter", "pool", "tokens",
           "Prompt tokens looked up in the prefix cache; mirrors the engine's counter. " + _POLLED),
    Family("prefix_cache_hit_tokens_total", "counter", "pool", "tokens",
           "Prompt tokens served from the prefix cache; mirrors the engine's counter. " + _POLLED),
    Family("prompt_tokens_total", "counter", "pool", "tokens", "Prompt tokens processed; mirrors the engine's counter. "
           + _POLLED),
    Family("requests_finished_total", "counter", "pool", "requests",
           "Requests finished, whatever the reason (stopped, at their length, aborted); mirrors the engine's counter. "
           "It counts what e2e_request_latency_seconds counts, and stands where the latency group is turned off: "
           "kv_transfer_held_tokens reads it. " + _POLLED),
    Family("generation_tokens_total", "counter", "pool", "tokens", "Tokens generated; mirrors the engine's counter. "
           + _POLLED),
    Family("external_cache_queried_tokens_total", "counter", "pool", "tokens",
           "Prompt tokens looked up in an external KV cache (a KV connector such as LMCache or vLLM's offloading "
           "connector); mirrors the engine's counter. " + _POLLED),
    Family("external_cache_hit_tokens_total", "counter", "pool", "tokens",
           "Prompt tokens the external KV cache had; mirrors the engine's counter. " + _POLLED),
    Family("time_to_first_token_seconds", "histogram", "latency", "seconds",
           "Time to first token, queueing included, at the engine's bucket bounds kept (`latency_buckets`). " + _POLLED),
    Family("inter_token_latency_seconds", "histogram", "latency", "seconds",
           "Time between output tokens, at the engine's bucket bounds kept (`latency_buckets`). " + _POLLED),
    Family("queue_time_seconds", "histogram", "latency", "seconds",
           "Time requests waited before first being scheduled, at the engine's bucket bounds kept "
           "(`latency_buckets`). " + _POLLED),
    Family("e2e_request_latency_seconds", "histogram", "latency", "seconds",
           "Request latency from arrival to finish, at the engine's bucket bounds kept (`latency_buckets`). " + _POLLED),
    Family("pressure_state", "gauge", "pressure", "",
           "KV pressure derived by the exporter, 1 for the current state: "
           + ", ".join(f"{state} ({PRESSURE_STATE_MEANINGS[state]})" for state in PRESSURE_STATES) + ".", ("state",)),
    Family("pressure_reason", "gauge", "pressure", "",
           "Why the pool is in its pressure state, 1 for the rule that decided it (one series per reason, a fixed "
           "set): " + ", ".join(f"{reason} ({PRESSURE_REASONS[reason].state})" for reason in PRESSURE_REASONS)
           + ". The numbers behind it are the pool's own gauges; docs/metrics.md gives each reason's text.",
           ("reason",)),
    # Per pool: KV beyond the GPU pool.
    Family("tier_capacity_tokens", "gauge", "offload", "tokens", "Offload tier capacity in tokens. " + _TIER + _POLLED,
           ("tier",)),
    Family("tier_used_tokens", "gauge", "offload", "tokens",
           "Offload tier tokens that cannot be evicted (vLLM) or that the tier holds (SGLang, which reports no "
           "evictable split). " + _TIER + _POLLED, ("tier",)),
    Family("tier_usage_ratio", "gauge", "offload", "ratio",
           "Fraction (0..1) of the offload tier that used tokens take. " + _TIER + _POLLED, ("tier",)),
    Family("tier_used_bytes", "gauge", "offload", "bytes",
           "Bytes an offload tier holds, where the engine reports bytes only (LMCache; no capacity is exported). "
           + _TIER + _POLLED, ("tier",)),
    Family("cached_prompt_tokens_total", "counter", "offload", "tokens",
           "Prompt tokens served from a cache, by where they came from (`source` is " + ", ".join(HIT_SOURCES)
           + "); the sum over sources is the engine's cached prompt tokens, GPU and offloaded. Counted when the "
           "engine counts the hit: vLLM at admission, before a load from an offload tier or a peer has run (a "
           "load that fails later is still counted; `peer` counts the loads a P/D connector started, the tokens "
           "received are kvcache_kv_transfer_prompt_tokens_total). " + _POLLED,
           ("source",)),
    Family("tier_transfer_bytes_total", "counter", "offload", "bytes",
           "Bytes moved between the GPU pool and an offload tier. " + _TRANSFER + _POLLED, ("tier", "direction")),
    Family("tier_transfer_tokens_total", "counter", "offload", "tokens",
           "Tokens moved between the GPU pool and an offload tier, where the engine counts tokens (SGLang; its "
           "storage tier's load is storage to host memory, its store host to storage). " + _TRANSFER + _POLLED,
           ("tier", "direction")),
    Family("tier_transfer_seconds_total", "counter", "offload", "seconds",
           "Time spent moving KV between the GPU pool and an offload tier. " + _TRANSFER + _POLLED,
           ("tier", "direction")),
    Family("tier_store_failures_total", "counter", "offload", "",
           "Stores to an offload tier that found no room (vLLM allocation failures): the tier is full of KV it "
           "cannot evict. " + _TIER + _POLLED, ("tier",)),
    Family("tier_evictions_total", "counter", "offload", "",
           "Entries an offload tier evicted to make room for new KV (LMCache: keys, one per KV chunk; vLLM and "
           "SGLang export none). " + _TIER + _POLLED, ("tier",)),
    # Per pool: KV moved between prefill and decode pools.
    Family("kv_transfer_seconds", "histogram", "transfer", "seconds",
           "Duration of KV transfers between a prefill and a decode pool, in the engine's own buckets (Triton: "
           "sum and count only), on the side that times them (vLLM's NixlConnector pulling and TensorRT-LLM: "
           "decode; vLLM's NixlPushConnector and MooncakeConnector, which push, and SGLang: prefill). "
           "vLLM observes one transfer per TP rank. " + _KV_TRANSFER + _POLLED),
    Family("kv_transfer_bytes", "histogram", "transfer", "bytes",
           "Bytes per KV transfer between a prefill and a decode pool (vLLM: each TP rank's shard), in the "
           "engine's own buckets. " + _KV_TRANSFER + _POLLED),
    Family("kv_transfer_speed_bytes_per_second", "histogram", "transfer", "bytes",
           "Speed of each KV transfer as the engine computes it, in the engine's own buckets (SGLang's "
           "kv_transfer_speed_gb_s: the transfer's bytes over its latency, in GiB/s; Dynamo's TensorRT-LLM "
           "trtllm_kv_transfer_speed_gb_s, in GB/s). With chunked prefill or an "
           "early prefix send SGLang's latency covers the last chunk while the bytes cover every chunk, so the speed "
           "can exceed the link's: kvcache_kv_transfer_above_link_total counts those. " + _KV_TRANSFER + _POLLED),
    Family("kv_transfer_above_link_total", "counter", "transfer", "",
           "KV transfers the engine reported faster than the configured link (kv_transfer_link_bytes_per_second): "
           "broken readings, not fast transfers, which the bandwidth (bytes over seconds of every transfer) "
           "includes. Derived by the exporter from kvcache_kv_transfer_speed_bytes_per_second: the transfers above "
           "its smallest bucket bound at or above the link rate (fewer than above the link rate itself where that "
           "is no bound). " + _KV_TRANSFER),
    Family("kv_transfer_failures_total", "counter", "transfer", "",
           "Failed KV transfers by kind (`kind` is " + ", ".join(TRANSFER_FAILURE_KINDS) + "). The kinds may "
           "overlap (vLLM NIXL since 0.31 counts notification failures under transfer too). " + _KV_TRANSFER
           + _POLLED, ("kind",)),
    Family("kv_transfer_lease_expiries_total", "counter", "transfer", "",
           "Requests whose KV the prefill side freed because the decode side had not pulled it within the lease "
           "(vLLM kv_lease_duration, default 30 s; Mooncake 480 s): the decode side is too slow or too full. "
           "Counted on the prefill side. " + _KV_TRANSFER + _POLLED),
    Family("kv_transfer_notifications_after_expiry_total", "counter", "transfer", "",
           "Transfer completions the prefill side received for requests whose lease had expired: the KV blocks "
           "may have been reused before the transfer finished (possible corruption). " + _KV_TRANSFER + _POLLED),
    Family("kv_transfer_requests", "gauge", "transfer", "requests",
           "Requests by KV transfer stage (`stage` is " + ", ".join(TRANSFER_STAGES) + "). On a unified pool "
           "(vLLM with an offload connector) the stages are its loads from the offload tier, not transfers between "
           "pools: the P/D dashboards, rules and alerts read prefill and decode pools only. " + _KV_TRANSFER
           + _POLLED, ("stage",)),
    Family("kv_transfer_requests_waiting_for_kv", "gauge", "transfer", "requests",
           "Decode-side requests whose transfer cannot start because the pool's KV is short (the "
           "waiting_to_start stage while KV is short, as for requests_waiting_for_kv, else 0): the decode half "
           "of P/D backpressure; derived by the exporter on decode pools."),
    Family("kv_transfer_held_tokens", "gauge", "transfer", "tokens",
           "KV tokens a prefill pool holds only until the decode side has them: prompts computed whose KV the decode "
           "side has not pulled yet (vLLM: the requests are finished, neither running nor waiting, their blocks "
           "kept for the pull or until the lease expires) or whose transfer has not finished (SGLang's inflight "
           "queue). Part of used_tokens, left out of live_tokens_per_request. Not prefill demand: it frees as the "
           "decode side takes it, which more prefill replicas would not hasten. Derived by the exporter on prefill "
           "pools, an estimate where a prompt is running or in flight: each taken as one prompt of the mean over "
           "the requests finished within the pressure window (`window_seconds`, 60 s; over the engine's life where "
           "none finished within it), so a shift of prompt lengths reads right one window and one poll after the "
           "last prompt of the old lengths finished (docs/metrics.md)."),
    Family("kv_transfer_prompt_tokens_total", "counter", "transfer", "tokens",
           "Prompt tokens whose KV a decode pool received from a prefill pool instead of computing them, counted "
           "once the request has run (its first token out): not the transfers started (vLLM's `p2p` cache hits, "
           "counted when a load is planned: the `peer` source of kvcache_cached_prompt_tokens_total), nor those "
           "that failed (kvcache_kv_transfer_failures_total) or are under way (kvcache_kv_transfer_requests). "
           + _KV_TRANSFER + _POLLED),
    # Per pool: from the engine's KV event stream (a target's `kv_events:`).
    Family("events_blocks_stored_total", "counter", "events", "blocks",
           "Blocks the pool cached (BlockStored). " + _STREAMED),
    Family("events_blocks_evicted_total", "counter", "events", "blocks",
           "Blocks the pool evicted (BlockRemoved; vLLM reports an eviction when the block is reallocated, not "
           "when it is freed). " + _STREAMED),
    Family("capacity_miss_blocks_total", "counter", "events", "blocks",
           "Blocks stored again while their hash was in the list of recent evictions: evicted for room, needed "
           "again, recomputed. " + _STREAMED),
    Family("recomputed_blocks_total", "counter", "events", "blocks",
           "Blocks stored again after an eviction that a pool of any size computes again, left out of "
           "kvcache_capacity_miss_blocks_total: the last block of a store, the block of the storing request's last "
           "prompt token (vLLM and SGLang never count it as a hit: they need that token's logits) or one filled "
           "while decoding, and a block the storing request evicted itself (cached at its lookup, not a hit). "
           + _STREAMED),
    Family("capacity_miss_distance_ratio", "histogram", "events", "ratio",
           "Per capacity-miss block: blocks the pool evicted after it and not stored again before the lookup of "
           "the request storing it again (how far below the pool it lay then, under LRU), divided by the pool's "
           "capacity in blocks. Under LRU, the "
           "misses at or below x are those a pool (1 + x) times as large would have kept. " + _STREAMED),
    Family("block_residency_seconds", "histogram", "events", "seconds",
           "Time from a block's store to its eviction, by the batches' timestamps. " + _STREAMED),
    Family("events_messages_total", "counter", "events", "",
           "Event batches received and decoded from the pool's stream."),
    Family("events_dropped_total", "counter", "events", "",
           "Event batches lost or refused, by reason (" + ", ".join(EVENT_DROP_REASONS) + ").", ("reason",)),
    Family("events_ignored_total", "counter", "events", "",
           "Events or blocks the pool's state leaves out, by reason (" + ", ".join(EVENT_IGNORED_REASONS) + ").",
           ("reason",)),
    Family("events_publisher_restarts_total", "counter", "events", "",
           "Times the stream's sequence number went back (the publisher restarted): the pool's state was dropped "
           "and started anew."),
    Family("events_rank_mismatches_total", "counter", "events", "",
           "Event batches whose envelope names another DP rank than the stream's configured one (its place in "
           "the target's `kv_events:` endpoints); the envelope's rank labels the pool's series."),
    Family("events_last_message_timestamp_seconds", "gauge", "events", "seconds",
           "Unix time the exporter received the pool's last event batch."),
    # Per pool and offload tier, from the same stream's events of the tier's medium (exporter/tiers.py).
    *(Family(f"tier_{name}", type, "events", unit, f"{what} " + _TIERED, ("tier",)) for name, type, unit, what in (
        ("events_blocks_stored_total", "counter", "blocks",
         "Blocks an offload tier stored (BlockStored of its medium: vLLM CPU offload, SGLang HiCache)."),
        ("events_blocks_evicted_total", "counter", "blocks", "Blocks an offload tier evicted (BlockRemoved of its "
                                                             "medium)."),
        ("blocks_resident", "gauge", "blocks",
         "Blocks an offload tier holds now, by its stores and evictions since the exporter joined the stream."),
        ("capacity_miss_blocks_total", "counter", "blocks",
         "Blocks stored to an offload tier again while on its list of recent evictions: evicted from the tier, "
         "computed again on the GPU and offloaded again."),
        ("capacity_miss_distance_ratio", "histogram", "ratio",
         "Per capacity miss of an offload tier: blocks the tier evicted after it and not stored again before its "
         "re-store, divided by the tier's capacity in blocks (kvcache_tier_capacity_tokens / "
         "kvcache_block_size_tokens). Under LRU the misses at or below x are those a tier (1 + x) times as large "
         "would have served."),
        ("block_residency_seconds", "histogram", "seconds",
         "Time from a block's store to an offload tier to its eviction from it, by the batches' timestamps."),
        ("served_blocks_total", "counter", "blocks",
         "Blocks the GPU pool stored while an offload tier held them: loaded from that tier, not computed (its "
         "offload hits, by the tier that served them)."))),
    Family("events_block_size_tokens", "gauge", "events", "tokens",
           "Tokens per block the GPU pool's last store named (BlockStored block_size, KV cache group 0): on a "
           "hybrid model the full-attention block, the shortest shared prefix that can hit. " + _STREAMED),
    # Per pool and holder, from the stream's stores: the LoRA adapter (`base` without one) and the tenant (a
    # keyed hash of the request's cache salt, `none` without one); the top kv_events.top_holders holders by
    # resident blocks, the rest summed as `other`.
    *(Family(f"{holder}_{name}", type, "events", "blocks", f"{what} {holder_help} " + _HOLDERS, (holder,),
             stable=False)
      for holder, holder_help in (("adapter", "By LoRA adapter (`base`: none)."),
                                  ("tenant", "By tenant (a keyed hash of the cache salt; `none`: no salt)."))
      for name, type, what in (
          ("blocks_resident", "gauge", "Blocks resident in the pool."),
          ("blocks_stored_total", "counter", "Blocks the pool cached (BlockStored)."),
          ("blocks_evicted_total", "counter", "Blocks the pool evicted (BlockRemoved) that the stream saw stored."),
          ("capacity_miss_blocks_total", "counter", "Blocks stored again while in the list of recent evictions "
                                                    "(who loses the pool)."))),
    Family("events_holders_folded", "gauge", "events", "",
           "Holders (adapters or tenants, by `holder`) with blocks resident beyond the top kv_events.top_holders, "
           "summed into the `other` series (which also keeps the counts of holders that left the pool).",
           ("holder",), stable=False),
    # Per model, from every replica's stream together (`fleet_index: {enabled: true}`): the routing loss.
    Family("routing_recomputed_tokens_total", "counter", "fleet", "tokens",
           "Prompt tokens a replica computed and stored (whole blocks it did not hold) while another replica of the "
           "same model held the same blocks, matched by content (token ids chained to their parent): what a "
           "prefix-affinity router would have served from the sibling's cache. " + _FLEET),
    Family("fleet_stored_tokens_total", "counter", "fleet", "tokens",
           "Prompt tokens in the whole blocks the model's replicas computed and stored (BlockStored, GPU pool): "
           "the prefill the routing loss is a share of. " + _FLEET),
    Family("fleet_hash_only_blocks_total", "counter", "fleet", "blocks",
           "Blocks stored without token ids, matched by their engine hash: they meet a sibling's only where the "
           "fleet shares the hash seed (vLLM: the same PYTHONHASHSEED and prefix_caching_hash_algo). " + _FLEET),
    Family("fleet_hash_mismatch_blocks_total", "counter", "fleet", "blocks",
           "Blocks matched by content whose engine hash differs from the sibling's: the fleet does not share a "
           "hash seed, so routers and indexes that match engine hashes (KV-event-driven prefix scorers) miss "
           "them. " + _FLEET),
    Family("fleet_replicas", "gauge", "fleet", "",
           "Replicas (pools: a target's DP rank) of the model whose streams feed the index.", stable=False),
    Family("fleet_isolated_replicas", "gauge", "fleet", "",
           f"Replicas that stored at least {ISOLATED_MIN_BLOCKS} tracked blocks and never met a sibling's while "
           f"their siblings met each other's on at least {ISOLATED_SIBLING_SHARE:.0%} of their stores (three "
           "replicas or more): a different hash "
           "seed on hash-only streams, another model revision or tokenizer.", stable=False),
    Family("fleet_index_blocks", "gauge", "fleet", "blocks",
           "Replica-blocks the index tracks for the model (bounded by fleet_index.max_blocks over every model).",
           stable=False),
    Family("fleet_index_sampling_ratio", "gauge", "fleet", "ratio",
           "Share of the content-key space the index tracks: 1 while exact, halved each time the index fills "
           "(spatial sampling); the fleet counters are scaled by its inverse.", stable=False),
)
FAMILIES: dict[str, Family] = {family.name: family for family in _TABLE}

# The bucket bounds (seconds) re-exported of each latency histogram by default, where the engine has them (a bound
# it lacks is not there; +Inf always is): the round SLO targets people set (1-2-5 steps), the nearest bounds of the
# engines whose grids miss them (SGLang's 0.2, 0.4, 4, 40, 100, vLLM's 0.04, 0.075, 120, 240), so that on each
# engine's grid two kept bounds are at most 2.5 times apart up to minutes, where a shortage puts queueing and TTFT
# (a quantile above the top bound kept would read as that bound). Dropping bounds of a
# cumulative histogram is exact at the bounds kept: an SLO ratio or a quantile at a kept bound is what all of them
# give. `latency_buckets:` in the configuration keeps all, or names others.
DEFAULT_LATENCY_BUCKETS: dict[str, tuple[float, ...]] = {
    "time_to_first_token_seconds": (0.04, 0.1, 0.2, 0.25, 0.4, 0.5, 1, 2, 2.5, 4, 5, 10, 20, 40, 80, 100, 160, 200,
                                    400, 640),
    "inter_token_latency_seconds": (0.01, 0.02, 0.025, 0.04, 0.05, 0.06, 0.075, 0.1, 0.15, 0.2, 0.4, 0.5, 1, 2.5),
    "queue_time_seconds": (0.1, 0.3, 0.5, 1, 2, 2.5, 5, 10, 20, 30, 60, 100, 120, 200, 240, 480, 500, 1000),
    "e2e_request_latency_seconds": (0.5, 1, 2, 2.5, 4, 5, 10, 20, 30, 40, 60, 100, 120, 200, 240, 400, 480, 600,
                                    1200),
}


def names(group: str | None = None, type: str | None = None, fed_by: str | None = None) -> tuple[str, ...]:
    """The names of the families of a group, type and source (any, where not given), in the table's order."""
    return tuple(name for name, family in FAMILIES.items()
                 if (group is None or family.group == group) and (type is None or family.type == type)
                 and (fed_by is None or family.fed_by == fed_by))


def label_names() -> frozenset[str]:
    """Every label name the exporter writes on a kvcache_* series: the groups' identities, the families' own
    labels and a histogram's `le`. A static label of the configuration must take none of them."""
    return frozenset({"le"}.union(*(family.identity + family.labels for family in FAMILIES.values()
                                    if family.metric.startswith(PREFIX))))


_BY_METRIC = {family.metric: family for family in FAMILIES.values()}


def family_of(series: str) -> Family | None:
    """The family a series name belongs to (`kvcache_x`, a histogram's `kvcache_x_bucket`, `process_x`); None
    if none."""
    family = _BY_METRIC.get(series)
    if family is not None and family.type != "histogram":
        return family
    for suffix in HISTOGRAM_SUFFIXES:
        if series.endswith(suffix):
            family = _BY_METRIC.get(series[:-len(suffix)])
            if family is not None and family.type == "histogram":
                return family
    return None
