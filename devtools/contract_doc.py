"""docs/metrics.md, the public contract, generated from the code that defines it.

    python -m devtools.contract_doc [--output FILE] [--check]

Names, types, units, labels and meanings come from exporter/contract.py's table of families (in the
order the exporter serves them, so a family added there appears here), per-engine sources from the
adapters' series tables, pressure states from exporter/contract.py and their thresholds' defaults from
exporter/thresholds.py, failure reasons from exporter/contract.py.
What no table says (values read from info labels, values the exporter computes, the rule of each
pressure state) is written below, and generation stops naming any family or state it cannot
document, so the committed file and the code cannot drift apart (tests/unit/test_contract_doc.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvcache_exporter import contract
from kvcache_exporter.adapters import ADAPTERS
from kvcache_exporter.alerts.rules.disaggregated import FAILED_KINDS, PD_BACKPRESSURE
from kvcache_exporter.thresholds import DEFAULT as T

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

# Values an adapter's `complete` hook reads from info-style labels rather than from a series table.
INFO_LABEL_SOURCES = {
    "vllm": {
        "capacity_blocks": "`vllm:cache_config_info{num_gpu_blocks}` / the engines on the page - 1 (the null "
                           "block): with data parallelism vLLM writes the sum over its engines on every engine's "
                           "series, so the split is exact for alike engines and a guess where they differ",
        "block_size_tokens": "`vllm:cache_config_info{block_size}`",
        "prefix_cache_min_hit_tokens": "`vllm:cache_config_info{cache_hit_alignment_tokens}`, else "
                                       "`{effective_attention_block_size}`, else `{block_size}`",
        "capacity_tokens": "`vllm:cache_config_info{kv_cache_size_tokens}` less the null block's share (newer "
                           "vLLM; the first engine's value, not summed)",
        "tier_capacity_tokens": "`vllm:kv_offload_config_info{cpu_kv_cache_size_tokens}` (tier=cpu; each engine "
                                "its own)",
        "kv_transfer_prompt_tokens_total": "`vllm:prompt_tokens_by_source_total{source=\"external_kv_transfer\"}` "
                                           "where the page has a P/D connector's (NIXL's, Mooncake's) transfer "
                                           "series",
    },
    "sglang": {
        "requests_waiting": "on a decode server, the sum of its three P/D queues (`kvcache_kv_transfer_requests`: "
                            "pre-allocation, transfer, waiting)",
        "capacity_blocks": "`sglang:cache_config_info{num_pages}` (0.5.10)",
        "block_size_tokens": "`sglang:cache_config_info{page_size}` (0.5.10)",
    },
    "trtllm": {"block_size_tokens": "`trtllm_kv_cache_config_info{page_size}`"},
    "triton": {"requests_waiting": "before v0.18: `request_type=\"active\"` - `request_type=\"scheduled\"`",
               "kv_transfer_seconds": "`nv_trt_llm_disaggregated_serving_metrics{disaggregated_serving_type="
                                      "\"kv_cache_transfer_ms\"}` / 1000 as the sum and `{disaggregated_serving_type="
                                      "\"request_count\"}` as the count (and the +Inf bucket): a counter pair, no "
                                      "buckets"},
}
# How the exporter computes a family the engine does not report itself (exporter/derive.py).
DERIVED = {
    "usage_ratio": "used tokens / capacity tokens",
    "capacity_blocks": "capacity tokens / block size",
    "prefix_cache_min_hit_tokens": "the block size (hits land on whole blocks)",
    "capacity_tokens": "capacity blocks x block size",
    "used_blocks": "used tokens / block size (rounded up), or usage x capacity blocks",
    "free_blocks": "capacity blocks - used blocks",
    "used_tokens": "used blocks x block size, or usage x capacity tokens",
    "free_tokens": "capacity tokens - used tokens",
    "bytes_per_token": "the target's configured `model_architecture` ([kv-math.md](kv-math.md))",
    "capacity_bytes": "capacity tokens x bytes per token",
    "used_bytes": "used tokens x bytes per token",
    "pressure_state": "the pressure rule below",
    "pressure_reason": "the pressure rule below: which of its tests decided the state",
    "tier_used_tokens": "usage ratio x capacity tokens, per tier",
    "tier_usage_ratio": "used tokens / capacity tokens, per tier",
    "requests_waiting_for_kv": "the queue the pressure rule counts while KV is short (below), else 0",
    "requests_waiting_with_kv_room": "the queue the pressure rule counts while KV has room, less a decode pool's "
                                     "transfers waiting to start, else 0",
    "headroom_requests": "free tokens / live tokens per request; 0 while saturated or thrashing",
    "kv_transfer_above_link_total": "the speed histogram's count less its cumulative count at the smallest bound "
                                    "at or above `kv_transfer_link_bytes_per_second`",
    "kv_transfer_requests_waiting_for_kv": "on a decode pool, its waiting_to_start stage while KV is short (as for "
                                           "requests waiting for KV), else 0",
    "kv_transfer_held_tokens": "on a prefill pool, by how the engine holds it (" + "; ".join(
        f"{hold}: {meaning}" for hold, meaning in contract.EXPORT_HOLDS.items()) + "): used tokens less running "
        "requests x prompt tokens per finished request (finished; exact, the used tokens, while nothing runs), or "
        "the in_progress stage x prompt tokens per finished request, at most the used tokens (inflight). Prompt "
        "tokens per finished request: the increase of prompt_tokens_total over that of requests_finished_total (else "
        "of the e2e latency count) across `window_seconds` (60 s; a counter's drop adds nothing, as for the "
        "preemption rate), over the engine's life where no request finished within it; the transfer table below "
        "says where",
    "live_tokens_per_request": "(used tokens - KV held for export on a prefill pool) / running requests",
}
# Families an engine has no source for (the adapters' `not_reported`): absent for its targets.
NOT_REPORTED = {engine: set(adapter.not_reported) for engine, adapter in ADAPTERS.items()}
# The source of the families folded from a KV event stream, for every engine.
STREAM_SOURCE = ("the engine's KV event stream (`--kv-events-config`, ZMQ) with the target's `kv_events:` "
                 "([kv-events.md](kv-events.md)); absent without it")

# Each state's rule, in the order the exporter tests them: the first that holds is the state.
STATE_RULES = {
    "thrashing": f"preemptions (vLLM) or retractions (SGLang) at `thrashing_preemptions_per_second` "
                 f"({T.thrashing_preemptions_per_second:g}/s) or more over the last `window_seconds` "
                 f"({T.window_seconds:g} s). Engines without a preemption counter never read thrashing "
                 f"(their preemptions are unknown, not 0): " + ", ".join(
                     ADAPTERS[e].title for e in ADAPTERS if "preemptions_total" in NOT_REPORTED.get(e, ())) + ".",
    "saturated": f"requests wait for capacity (vLLM's `capacity` reason; the whole queue where the engine "
                 f"gives no reason, on a decode pool less its transfers under way or done, which hold their KV "
                 f"already) **and** KV is what is short: usage at `low_water_ratio` "
                 f"({T.low_water_ratio:g}) or above, or fewer free tokens than a live request holds on "
                 f"average, or a preemption since the previous poll. Engines keep KV back for the output the "
                 f"running requests will still produce before they admit another one (SGLang's "
                 f"`new_token_ratio`), so a queue waits for KV well below the high-water mark; and a preemption "
                 f"frees the preempted requests' blocks until the next step readmits the queue, so the poll "
                 f"after one reads room that is not there.",
    "capped": f"requests other than a decode pool's transfers wait for capacity while KV has room: usage "
              f"below `low_water_ratio` ({T.low_water_ratio:g}), at least one typical request's worth of free "
              f"tokens and no preemption since the previous poll (a transfer waiting for its KV to be allocated "
              f"is no evidence of a cap: vLLM counts one from its arrival). The "
              f"running-request cap or the token budget binds, not KV; vLLM reports that queue under the "
              f"same `capacity` reason and SGLang gives no reason, so this state is what tells the two apart. "
              f"Only TensorRT-LLM exposes its running-request cap as a series (`kvcache_requests_running_max`); "
              f"vLLM has none for `max_num_seqs`, and SGLang's `max_running_requests` gauge existed only before "
              f"0.3.6. The page does not say what the queue's head needs, so a queue KV holds back beside that "
              f"room also reads capped: a prompt longer than the typical live request, or an engine's reserve for "
              f"the running requests' output to come (SGLang's `new_token_ratio`) at usage below the mark.",
    "tight": f"usage at `high_water_ratio` ({T.high_water_ratio:g}) or above, nothing queued for lack of KV.",
    "ok": "none of the above.",
}

INTRO = """\
# The kvcache_* metric contract

<!-- Generated by `python -m devtools.contract_doc` (`make docs`) from exporter/contract.py, the adapters,
exporter/derive.py and exporter/thresholds.py: edit those, not this file. -->

These are the series the exporter serves on its `/metrics`, the project's public interface.
The dashboards and alert rules read these names only, never an engine's own `vllm:*` or
`sglang:*` series, so one set of panels and rules covers every engine and engine version.
Renaming a family or a label, or changing what it means, is a breaking change and gets a
migration note in [CHANGELOG.md](../CHANGELOG.md); new families may be added, none listed here is
removed without one.

Conventions: base units in the name (`_seconds`, `_bytes`, `_tokens`, `_blocks`, `_ratio` for
0..1); counters end in `_total` and mirror the engine's own cumulative counter, so an engine
restart is an ordinary counter reset that `rate()` handles and an exporter restart resets
nothing. A series whose inputs the engine does not expose is absent, never a made-up 0. When a
target stops answering, `kvcache_target_up` drops to 0 at once and its other series vanish after
the staleness period instead of freezing at their last values. The prefix-cache hit ratio is
`rate(hit) / rate(queried)` over a window, never a ratio of the lifetime counters.

Beside them the page has the series every Python exporter has, by prometheus_client's process and
platform collectors: `process_*` (CPU, memory, file descriptors, start time; Linux) and `python_info`.
With `workers` above 1 each worker process reports its own `process_*`, labelled `worker`.
"""


def _labels_section() -> str:
    ranks = ", ".join(f"{adapter.title} `{adapter.rank_label}`" for adapter in ADAPTERS.values() if adapter.rank_label)
    engines = ", ".join(f"`{name}`" for name in ADAPTERS)
    models = ", ".join(f"{adapter.title} `{adapter.model_label}`" for adapter in ADAPTERS.values())
    roles = ", ".join(f"`{role}`" for role in contract.ROLES)
    role_labels = ", ".join(f"{adapter.title} `{adapter.role_label[0]}`" for adapter in ADAPTERS.values()
                            if adapter.role_label)
    return f"""\
## Labels

| label | on | value |
|---|---|---|
| `target` | every per-target series | the target's `name` in the configuration; default `host:port` of its URL, followed by the path where that is not `/metrics` |
| `engine` | every per-target series | {engines}: the engine that produced the numbers (a page Dynamo passes through on a worker's port keeps its engine; `dynamo` is Dynamo's own series) |
| `model` | per-pool series | the served model name the engine reports ({models}), `""` if none |
| `dp_rank` | per-pool series | the data-parallel replica, one KV pool each ({ranks}); `"0"` without one |
| `role` | per-pool series | {roles}: the pool's part in disaggregated prefill/decode, as the page says it ({role_labels}), else the target's `role:`, else `unified` |
| static labels | every per-target series | the configuration's `labels:`, global and per target (e.g. `cluster`, `pool`) |

A per-pool series is one per (target, `dp_rank`). Tensor- and pipeline-parallel ranks repeat the
same pool's values: the exporter takes them once and never sums them. A histogram is taken whole from one
rank (its buckets, sum and count from the same rank's series, TP rank 0 where it is on the page), never merged
bucket by bucket.
"""


def _engine_source(engine: str, family: str) -> str:
    if contract.FAMILIES[family].fed_by == "events":
        return STREAM_SOURCE
    adapter = ADAPTERS[engine]
    parts = []
    for series in adapter.series:
        if series.concept == family:
            match = ",".join(f'{k}="{"|".join(v) if isinstance(v, tuple) else v}"' for k, v in series.match.items())
            names = " / ".join(f"`{name}{{{match}}}`" if match else f"`{name}`" for name in series.names)
            summed = f", summed over {', '.join(f'`{label}`' for label in series.sum_over)}" if series.sum_over else ""
            parts.append(names + _contract_labels(series, family) + summed)
    if family in INFO_LABEL_SOURCES.get(engine, {}):
        parts.append(INFO_LABEL_SOURCES[engine][family])
    if not parts and family in NOT_REPORTED.get(engine, ()):
        return "none"
    if family in DERIVED:
        parts.append(("else " if parts else "") + "derived: " + DERIVED[family])
    if parts:
        return "; ".join(parts)
    raise LookupError(f"{engine} {family}")


def _contract_labels(series, family: str) -> str:
    """` (tier=cpu, direction=load)` for a series that fills a labelled family; how a breakdown maps."""
    names = contract.FAMILIES[family].labels
    fixed = [f"{label}={value}" for label, value in zip(names, series.labels)]
    if series.label_from:
        wire, values = series.label_from
        mapped = ", ".join(f"{k}->{v}" if v else f"{k} left out" for k, v in values.items())
        fixed.append(f"{names[len(series.labels)]} from `{wire}`: {mapped}, any other->other")
    return f" ({'; '.join(fixed)})" if fixed else ""


def _per_pool(family: contract.Family) -> bool:
    return "dp_rank" in family.identity


def _family_labels(family: contract.Family) -> str:
    own = (*family.labels, "le") if family.type == "histogram" else family.labels
    scope = "per pool" if _per_pool(family) else "per target" if family.identity else ""
    return ", ".join([scope] * bool(scope) + [f"`{label}`" for label in own]) or "none"


def _families_section() -> str:
    engines = list(ADAPTERS)
    head = "| family | type | unit | labels | meaning | " + " | ".join(ADAPTERS[e].title for e in engines) + " |"
    rows = [head, "|---|---|---|---|---|" + "---|" * len(engines)]
    undocumented = []
    for name, family in contract.FAMILIES.items():
        meaning = family.help.replace("|", "\\|")
        if not family.stable:  # how this process runs
            meaning += " (Beyond the contract: may change without a migration note.)"
        sources = []
        for engine in engines:
            if not _per_pool(family):
                sources.append("")  # the exporter's own
                continue
            try:
                sources.append(_engine_source(engine, name).replace("|", "\\|"))
            except LookupError as err:
                undocumented.append(str(err))
        rows.append(f"| `{family.metric}` | {family.type} | {family.unit or '-'} | {_family_labels(family)} | "
                    f"{meaning} | " + " | ".join(sources) + " |")
    if undocumented:
        raise LookupError("no source documented for " + ", ".join(undocumented)
                          + ": add it to an adapter's series, or to INFO_LABEL_SOURCES, DERIVED or NOT_REPORTED "
                            "in devtools/contract_doc.py")
    return ("## Families\n\nIn the order the exporter serves them. \"per pool\": the per-target labels plus "
            "`model`, `dp_rank` and `role`; \"per target\": `target`, `engine` and the static labels. Units are the "
            "base units the names spell out (`-`: a count of something else, a flag or a state). An engine "
            "column names the engine's series, preferred first (`a` / `b`: the first one on the page wins).\n\n"
            + "\n".join(rows) + "\n")


# What a reader of an engine's numbers must know that no table says.
ENGINE_NOTES = {
    "trtllm": "`trtllm-serve` serves the page on `/prometheus/metrics` only with `return_perf_metrics: true`, and "
              "the KV and queue gauges need `enable_iter_perf_stats: true` too. It refreshes those gauges when a "
              "request finishes: on an idle server, or one where nothing finishes, they keep their last values "
              "while `kvcache_target_up` stays 1, so a frozen usage is not proof of a steady pool. Names are read "
              "in all three generations (`trtllm_`, `trtllm:` as Dynamo 0.7 re-exported them, and the unprefixed "
              "request families before 1.3.0rc5, which have no KV or queue series). Do not poll its JSON "
              "`/metrics` as well: both drain the same stats queue.",
    "triton": "Triton's metrics port (8002). `requests_waiting` is active minus scheduled requests (admitted, not "
              "scheduled this iteration), not the executor's own queue, which is not exported.",
    "lmcache": "LMCache's own page, served by its internal API server (`internal_api_server_enabled: true`, env "
               "`LMCACHE_INTERNAL_API_SERVER_ENABLED=true`; it listens on 127.0.0.1 unless "
               "`internal_api_server_host` says otherwise, and only vLLM's data-parallel rank 0 starts it). Give "
               "each TP worker a target of its own: worker i on `internal_api_server_port_start` + 1 + i "
               "(7000, 7001, ... by default). The scheduler's port (6999) has values only with "
               "`enable_scheduler_bypass_lookup`. A worker's tier bytes are its shard of the KV (the instance "
               "holds the sum over its workers' targets); every worker counts every lookup and evicts the same "
               "chunks, so those counters are read from any one worker, not added up. The page has no vLLM "
               "series, hence no GPU pool, queue or pressure state: poll vLLM's own `/metrics` as a target "
               "too. Where vLLM's page already carries the `lmcache:*` series (PROMETHEUS_MULTIPROC_DIR set for "
               "`vllm serve`) the vLLM target reads them the same way and LMCache's ports add nothing. "
               "LMCache's multi-process server (OpenTelemetry `lmcache_mp_*`) is not read.",
    "dynamo": "Dynamo's own series, read only where no engine page is on the target: a worker port's "
              "`dynamo_component_*` (usage and blocks copied from the engine's KV stats) or the frontend's "
              "`dynamo_frontend_*`. Frontend values are measured at the frontend, not in the engine: in-flight "
              "counts every request it holds, queued those without a first response (prefill included), and the "
              "latencies include the network hop. The router's per-worker KV blocks and prefix-hit tokens are "
              "predictions, not engine truth, and are not read.",
}


def _engine_notes_section() -> str:
    unknown = set(ENGINE_NOTES) - set(ADAPTERS)
    if unknown:
        raise LookupError(f"ENGINE_NOTES in devtools/contract_doc.py names unknown engines {sorted(unknown)}")
    notes = "\n".join(f"- {ADAPTERS[engine].title}: {note}" for engine, note in ENGINE_NOTES.items())
    return f"## Engine notes\n\n{notes}\n"


def _failure_reasons_section() -> str:
    rows = "\n".join(f"| `{reason}` | {meaning} |" for reason, meaning in contract.FAILURE_REASONS.items())
    return f"""\
## Failure reasons

`kvcache_target_scrape_failures_total{{reason}}` counts a target's failed polls by reason; each
reason's series exists from the start at 0. A failed poll sets `kvcache_target_up` to 0 and
logs the reason and its detail once, when the reason changes.

| reason | the poll failed because of |
|---|---|
{rows}
"""


def _event_streams_section() -> str:
    def rows(reasons: dict[str, str]) -> str:
        return "\n".join(f"| `{reason}` | {meaning} |" for reason, meaning in reasons.items())

    return f"""\
## KV event streams

With a target's `kv_events:`, the exporter subscribes to the engine's KV event stream and keeps each
pool's resident blocks and its recent evictions ([kv-events.md](kv-events.md)). Every series of a
stream but the last-message time exists from its start, at 0. Its `dp_rank` is the rank its batches
name (vLLM's `data_parallel_rank`, SGLang's `attn_dp_rank`), else the stream's place in the target's
endpoints; `kvcache_events_rank_mismatches_total` counts the batches where the two differ (logged once
per stream). Where two of a target's streams name the same rank, all its streams keep their places.
`kvcache_events_dropped_total{{reason}}`:

| reason | batches |
|---|---|
{rows(contract.EVENT_DROP_REASONS)}

`kvcache_events_ignored_total{{reason}}`:

| reason | what |
|---|---|
{rows(contract.EVENT_IGNORED_REASONS)}
"""


def _pressure_section() -> str:
    if set(STATE_RULES) != set(contract.PRESSURE_STATES):
        raise LookupError(f"STATE_RULES in devtools/contract_doc.py covers {sorted(STATE_RULES)}, "
                          f"exporter/contract.py has {sorted(contract.PRESSURE_STATES)}")
    rules = "\n".join(f"{i}. `{state}`: {rule}" for i, (state, rule) in enumerate(STATE_RULES.items(), 1))
    reasons = "\n".join(f"| `{name}` | {reason.state} | {reason.text} |"
                        for name, reason in contract.PRESSURE_REASONS.items())
    return f"""\
## The pressure state

`kvcache_pressure_state{{state}}` has one series per state for each pool, 1 for the current state
and 0 for the others; it is absent where the engine reports no usage at all. The exporter tests
the rules in this order and the first that holds is the state (thresholds from
`exporter/thresholds.py`, defaults in parentheses, overridden by the configuration's `pressure:`):

{rules}

A decrease of the preemption counter (an engine restart) adds nothing to the window's rate, so a
restart never reads as a preemption burst.

### Why: the reason

`kvcache_pressure_reason{{reason}}` says which test decided the state, one series per reason for each pool (1
for the current one, 0 for the others), so a pool has exactly {len(contract.PRESSURE_REASONS)} of them whatever
its numbers: the numbers stay in the pool's gauges and never enter a label. The reasons are ordered mildest first
and grouped by state, so the largest reason index over a target's ranks is also its worst state. The dashboards
show the words (with the configured marks) beside the columns that hold the numbers; `top` and the alerts' descriptions
show the text, its numbers read from the same series (`{{placeholder}}`: the pool's gauge of that name, the
preemptions per minute, or a mark from `exporter/thresholds.py`):

| reason | state | text |
| --- | --- | --- |
{reasons}

`kvcache_headroom_requests` is 0 while the state is saturated or thrashing: the queue waits for KV, and engines
reserve KV ahead (the running requests' output to come, admission watermarks), so the free KV then is no room a
request would be admitted into; a saturated pool never shows room.
"""


def _offload_section() -> str:
    return f"""\
## Offload tiers

KV kept beyond the GPU pool (vLLM's native CPU offload, LMCache, SGLang's hierarchical cache) has
per-pool families of its own, labelled `tier` ({", ".join(f"`{t}`" for t in contract.TIERS)}),
`direction` ({", ".join(f"`{d}` ({what})" for d, what in contract.TRANSFER_DIRECTIONS.items())}) or
`source` ({", ".join(f"`{s}`" for s in contract.HIT_SOURCES)}). A tier or a source an engine does not
report has no series, not one at 0; a source's series appears once the engine counts its first token.

- Hit ratio by source: `rate(kvcache_cached_prompt_tokens_total{{source}})` over
  `rate(kvcache_prefix_cache_queried_tokens_total)`; summed over sources it is the share of prompt tokens
  served from any cache. `kvcache_prefix_cache_hit_tokens_total` stays the engine's own prefix-cache
  counter (vLLM: the GPU pool only; SGLang: every source).
- External caches: `kvcache_external_cache_hit_tokens_total` over `kvcache_external_cache_queried_tokens_total`
  is the external cache's own hit ratio. For LMCache it is the lookup counters' ratio, never its
  retrieve-path hit rate, which asks only for tokens LMCache has and reads about 1. LMCache's
  `POST /metrics/reset` clears its counters: `rate()` reads that as a counter reset.
- Usage: vLLM reports the share of its CPU tier that cannot be evicted (chunks pinned by transfers in
  flight), like the GPU pool's usage; SGLang reports the tokens its host tier holds, evictable ones
  included. LMCache reports bytes only (`kvcache_tier_used_bytes`), no capacity.
- SGLang HiCache (names from its `observability/metrics_collector.py`, 0.5.19 and 0.5.23): the host tier's
  load is `load_back_*`, its store `hicache_backup_*` (GPU to host, whatever the write policy), both `pool="kv"`
  for tokens; `evicted_tokens_total` counts GPU slots freed, backed up or not, and is not read. Bytes are per TP
  rank's shard and are added up over ranks; token counts repeat on every TP rank and are read once. Before
  0.5.23 these counters carry no rank labels, so SGLang's own registry adds up every scheduler: the counts are
  the whole server's, TP times the logical count, under rank "0". The storage tier (`--hicache-storage-backend`)
  is `disk` for the `file` backend and `remote` for the distributed stores (mooncake, hf3fs, nixl, aibrix, eic,
  simm, mori); `shm` and custom backends have no tier. Its load is `prefetched_tokens_total` (storage to host
  memory, the first hop toward the GPU), its store `backuped_tokens_total` (host to storage). Storage hits
  (`cache_source="storage_<class>"`, from 0.5.23 `"storage"`) take the tier of the page's `storage_backend`,
  else `other`.
- Evictions from a tier (`kvcache_tier_evictions_total`): LMCache counts the keys (chunks) its CPU backend
  evicts, per TP worker for its own shard (read once). vLLM's native offload reports its CPU tier's evictions
  only on the KV event stream (BlockRemoved with medium CPU), and SGLang none for its host tier; its
  `hicache_dropped_tokens_total` (GPU tokens destroyed without a host copy) is not read.

The pressure state is the GPU pool's and does not look at the tiers. A full tier does not make the
GPU pool fuller; it stops relieving it: blocks the GPU pool evicts are then kept nowhere and every later
hit on them is prefill computed again. A saturated GPU pool with a tier refusing stores
(`kvcache_tier_store_failures_total` rising) is KVCacheOffloadTierFull; a tier whose loads take
longer per token than recomputing is KVCacheOffloadLoadSlow ([runbook](../alerts/runbook.md)).
"""


# Where each engine's P/D queues and transfer series come from: the engine function that fills the series, in the
# engine's source (vLLM 0.32-0.34, SGLang 0.5.2x). A request goes through the stages in this order, then runs.
PD_STAGE_SOURCES = (
    ("waiting_to_start",
     "decode: `num_requests_kv_fetch_by_stage{stage=\"waiting_to_start\"}`, set by `Scheduler._set_kv_fetch_stage` "
     "from `Scheduler.add_request` (a `do_remote_prefill` request, at arrival) until `Scheduler.schedule` has "
     "allocated its blocks; such a request stays in the plain waiting queue (`reason=\"capacity\"`)",
     "decode: `num_decode_prealloc_queue_reqs` = `len(disagg_decode_prealloc_queue.queue)` "
     "(`SchedulerMetricsMixin.log_decode_stats`): the handshake, then KV pre-allocated once the pool has room "
     "(`DecodePreallocQueue`); prefill: `num_prefill_bootstrap_queue_reqs` = `len(disagg_prefill_bootstrap_queue"
     ".queue)` (`log_prefill_stats`), waiting for the decode side's allocation"),
    ("in_progress",
     "decode: `stage=\"in_progress\"`, from the allocation (`WAITING_FOR_REMOTE_KVS`) until the connector reports "
     "the request received (`Scheduler._update_from_kv_xfer_finished`); `skip_request` defers it "
     "(`reason=\"deferred\"`)",
     "decode: `num_decode_transfer_queue_reqs` = `len(disagg_decode_transfer_queue.queue)` (`DecodeTransferQueue`); "
     "prefill: `num_prefill_inflight_queue_reqs` = `len(disagg_prefill_inflight_queue)`, computed, KV being sent"),
    ("completed_waiting",
     "decode: `stage=\"completed_waiting\"`, from `_update_from_kv_xfer_finished` until `Scheduler.schedule` runs "
     "it; still deferred",
     "decode: `num_queue_reqs` = `len(waiting_queue)` (`log_decode_stats`): `DecodeTransferQueue.pop_transferred` "
     "moves a received request there; read as this stage on a decode server only"),
    ("(running)",
     "`num_requests_running` (`requests_running`)",
     "`num_running_reqs` (`requests_running`)"),
)


# Where each engine's transfer series are filled (the same sources as PD_STAGE_SOURCES): family, vLLM NIXL,
# vLLM Mooncake, SGLang, TensorRT-LLM under Dynamo, Triton's TensorRT-LLM backend.
PD_SERIES_SOURCES = (
    ("kv_transfer_seconds, kv_transfer_bytes",
     "`nixl_xfer_time_seconds`, `nixl_bytes_transferred`: `NixlKVConnectorStats.record_transfer` (NIXL telemetry "
     "of each done transfer handle, per TP rank, in the worker's `_pop_done_transfers`: the reader's receives when "
     "pulling, the writer's sends when pushing), observed by `NixlPromMetrics.observe`",
     "`mooncake_xfer_time_seconds`, `mooncake_bytes_transferred`: `MooncakeKVConnectorStats.record_transfer` in "
     "the prefill worker's `MooncakeConnectorWorker._send_blocks` (each `batch_transfer_sync_write`, per TP rank: "
     "Mooncake pushes, the decode side observes none), observed by `MooncakePromMetrics.observe`",
     "`kv_transfer_latency_ms`, `kv_transfer_total_mb`: `SchedulerReqTimeStats.compute_and_observe_kv_transfer_"
     "metrics`, once per request the prefill side finished sending (its inflight queue)",
     "`trtllm_kv_transfer_latency_seconds`, `trtllm_kv_transfer_bytes`: Dynamo's "
     "`AdditionalMetricsCollector.record_kv_transfer_perf` on the decode worker, per request, from TensorRT-LLM's "
     "timing metrics (`kv_cache_transfer_start` to `kv_cache_transfer_end`, `kv_cache_size`)",
     "seconds only: `nv_trt_llm_disaggregated_serving_metrics{kv_cache_transfer_ms, request_count}`, counters the "
     "backend's custom metrics reporter adds up from the executor's request stats "
     "(`DisServingRequestStats.kvCacheTransferMS`)"),
    ("kv_transfer_speed_bytes_per_second, kv_transfer_above_link_total",
     "none (no speed of one transfer)",
     "none (no speed of one transfer)",
     "`kv_transfer_speed_gb_s`: the same function, MiB / 1024 over the latency",
     "`trtllm_kv_transfer_speed_gb_s`: the same function, bytes / (seconds x 1e9)",
     "none"),
    ("kv_transfer_failures_total",
     "`nixl_num_failed_transfers_total` (`record_failed_transfer` from `_pop_done_transfers` / "
     "`_handle_failed_transfer` on the side that drives the transfer: the reader pulling, the writer pushing; plus "
     "handshake and notification failures in `NixlPromMetrics.observe`), `nixl_num_failed_notifications_total` "
     "(`record_failed_notification`)",
     "`mooncake_num_failed_transfers_total` (`record_failed_transfer`: a write that failed, on the prefill side, "
     "kind transfer); `mooncake_num_failed_recvs_total` (`record_failed_recv`: a load the decode worker gave up "
     "on, kind receive)",
     "`num_transfer_failed_reqs_total`, `num_bootstrap_failed_reqs_total`: the collector's "
     "`increment_transfer_failed_reqs` / `increment_bootstrap_failed_reqs` when a sender (the prefill side's "
     "inflight queue: kind transfer) or a receiver (the decode side's transfer queue: kind receive) fails",
     "none",
     "none"),
    ("kv_transfer_lease_expiries_total, kv_transfer_notifications_after_expiry_total",
     "`record_kv_expired_req` (the prefill worker frees KV not pulled within the lease), "
     "`record_notification_after_expiry`",
     "`mooncake_num_kv_expired_reqs_total`: `record_kv_expired_req` (the prefill worker frees KV not sent within "
     "`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`, 480 s); no notification after expiry",
     "none (no lease)",
     "none",
     "none"),
    ("kv_transfer_held_tokens",
     "derived (the prefill side): `Scheduler._free_request` -> `_connector_finished` -> NIXL's `request_finished` "
     "returns delay_free_blocks for a finished request with `do_remote_decode` (its blocks stay in "
     "`kv_cache_usage_perc`, the request leaves `num_requests_running`), freed by `_update_from_kv_xfer_finished` once "
     "the worker reports it sent (pulled, or its lease expired): the used tokens beyond running requests x prompt "
     "tokens per finished request (the increase of `prompt_tokens_total` over that of `request_success_total`, "
     "all finish reasons, over the window; `e2e_request_latency_seconds_count` where the counter is missing: "
     "`PrometheusStatLogger.record` counts both for each finished request, at its one token here). Exact while "
     "nothing runs, and while every running prompt and every one finished within the window and the poll before "
     "it is of one length: one window and one poll after the last prompt of an old length finished; else off by "
     "the running prompts' difference from the mean (at most one prompt and one block each)",
     "the same (Mooncake's `request_finished` delays the free until its sends are done)",
     "derived (the prefill side): `num_prefill_inflight_queue_reqs` (`process_batch_result_disagg_prefill` queues a "
     "computed request with its KV allocated, `process_disagg_prefill_inflight_queue` releases it when the transfer "
     "is done) x prompt tokens per finished request (the increase of `prompt_tokens_total` over that of "
     "`num_requests_total` over the window; `e2e_request_latency_seconds_count` where the counter is missing: "
     "`TokenizerMetricsCollector.observe_one_finished_request` counts all three when the tokenizer sees the "
     "request finish, after its transfer), at most the used tokens. Exact while every inflight prompt and every one "
     "finished within the window and the poll before it is of one length and whole pages; else off by the inflight "
     "prompts' difference from the mean, by their last partial page, and by what prefixes they share",
     "none",
     "none"),
    ("kv_transfer_prompt_tokens_total",
     "`prompt_tokens_by_source_total{source=\"external_kv_transfer\"}`: `PromptTokenStats.update_from_output` at "
     "the request's first token; not `prompt_tokens_cached_by_source_total{source=\"p2p\"}` "
     "(`PrefixCacheStats.record` at admission, when the load is planned)",
     "the same (Mooncake's hits are `p2p` too)",
     "none",
     "none",
     "none"),
)


def _series_table() -> str:
    named = {name for names, *_ in PD_SERIES_SOURCES for name in names.split(", ")}
    # The stages have their own table; the exporter derives the stage waiting for KV.
    missing = set(contract.names(group="transfer")) - named - {"kv_transfer_requests", "kv_transfer_requests_waiting_for_kv"}
    if missing:
        raise LookupError(f"PD_SERIES_SOURCES in devtools/contract_doc.py lacks {sorted(missing)}")
    rows = "\n".join(f"| {', '.join(f'`{n}`' for n in names.split(', '))} | {' | '.join(sources)} |"
                     for names, *sources in PD_SERIES_SOURCES)
    return f"""\
Where each engine fills the transfer series (families without their `kvcache_` prefix):

| family | vLLM NIXL | vLLM Mooncake | SGLang | TensorRT-LLM (Dynamo) | Triton (TensorRT-LLM backend) |
|---|---|---|---|---|---|
{rows}"""


def _stage_table() -> str:
    rows = "\n".join(f"| `{stage}` | {contract.TRANSFER_STAGES.get(stage, 'running: in the batch')} | {vllm} | "
                     f"{sglang} |" if stage in contract.TRANSFER_STAGES else
                     f"| {stage} | in the running batch | {vllm} | {sglang} |"
                     for stage, vllm, sglang in PD_STAGE_SOURCES)
    return f"""\
`stage` of `kvcache_kv_transfer_requests`, in the same words for every engine, and where each engine fills it
(its metrics code: vLLM `vllm/v1/core/sched/scheduler.py`, read out by `PrometheusStatLogger.record` in
`vllm/v1/metrics/loggers.py`; SGLang `srt/managers/scheduler_metrics_mixin.py` from the queues of
`srt/disaggregation/decode.py` and `prefill.py`). The queue the pressure state counts holds no stage but
waiting_to_start: vLLM's `capacity` reason holds no deferred request, and SGLang's decode queue is read less
the transfer and waiting queues. A waiting_to_start request counts as waiting for KV while the pool is short,
and is never evidence of room or of a cap.

| stage | requests | vLLM | SGLang |
|---|---|---|---|
{rows}"""


def _disaggregation_section() -> str:
    kinds = "\n".join(f"| `{kind}` | {meaning} |" for kind, meaning in contract.TRANSFER_FAILURE_KINDS.items())
    return f"""\
## Disaggregated prefill/decode

Where prefill and decode run on different engines (vLLM with a KV connector such as NIXL or Mooncake,
SGLang's `--disaggregation-mode`, TensorRT-LLM under Dynamo or Triton), the KV cache is produced in one pool
and consumed in another. Every pool series carries `role`: what the page says (SGLang `engine_type`, Dynamo's
TensorRT-LLM `disaggregation_mode`), else the target's `role:` in the configuration (vLLM, Triton and Dynamo's
own series do not say it), else `unified`. The rules group the pools of one model across roles by the
configuration's `pd_group_label` (default `model`; any static label the configuration sets, e.g. one that
names the deployment: `model` alone merges clusters that serve the same model).

The KV transfer families are absent where the engine has no KV connector, never 0. Caveats:

- **Which side.** vLLM pulling (NixlConnector) and Dynamo's TensorRT-LLM time transfers on the decode side
  (the reader); vLLM pushing (NixlPushConnector: the prefill worker's `_pop_done_transfers` over its sends),
  vLLM's MooncakeConnector (it pushes: the prefill worker's `_send_blocks`; its decode side counts failed
  receives only) and SGLang on the prefill side (the sender); lease expiries and notifications after expiry
  are the prefill side's (vLLM). vLLM's stage gauge exists only on a KV consumer; SGLang exports every queue gauge on every role
  and the exporter reads each on its own role only.
- **Units and granularity.** SGLang observes latency in ms and size in MiB (2^20 bytes): the exporter
  converts both, buckets included. vLLM appends one observation per TP rank, each of its shard: counts are
  per-rank transfers and bytes / seconds is one rank's bandwidth. Triton's backend has only two counters
  (transfer milliseconds, requests), exposed as a histogram with its `+Inf` bucket alone.
- **Failure kinds** (`kind`) overlap where the engine counts one failure twice: since vLLM 0.31 NIXL's
  failed transfers include handshake and notification failures, and its notification counter is kept "for
  compatibility". The failure ratio counts kinds `{FAILED_KINDS}` only, on the side that times the transfers:
  not `receive` (a decode side that times none, and its sender may count the same transfer). SGLang's
  counters appear at their first failure; Dynamo's TensorRT-LLM series have none.
- **Bandwidth.** `kvcache:kv_transfer_bytes_per_second:ratio` is bytes over seconds of the same transfers
  (`rate()` of the two histograms' sums), believed up to the configured link rate
  (`kv_transfer_link_bytes_per_second`, default {T.kv_transfer_link_bytes_per_second / 1e9:g} GB/s); above it
  the reading is broken, not fast (SGLang counts every chunk's bytes over the last chunk's time with chunked
  prefill or early prefix send), and it is recorded apart as
  `kvcache:kv_transfer_bytes_per_second_above_link:ratio` instead. That quotient averages every transfer:
  the per-transfer speed histogram of SGLang and of Dynamo's TensorRT-LLM
  (`kvcache_kv_transfer_speed_bytes_per_second`) says how many of them
  it timed faster than the link, counted by the exporter as `kvcache_kv_transfer_above_link_total` and, as a
  share of the transfers, `kvcache:kv_transfer_above_link:ratio`; the bandwidth panel shows the quotient and,
  next to the failures, those transfers.
- **Prompt tokens from a peer.** `kvcache_kv_transfer_prompt_tokens_total` is vLLM's
  `prompt_tokens_by_source_total{{source="external_kv_transfer"}}` where a P/D connector's series are on the
  page (elsewhere those tokens come from LMCache or an offload connector): tokens that arrived, counted at the
  request's first token. vLLM's `prompt_tokens_cached_by_source_total{{source="p2p"}}` (0.32) counts the hits a
  load was planned for, at admission, failed and unfinished loads included: it is the `peer` source of
  `kvcache_cached_prompt_tokens_total` (not a storage tier), never the tokens received. Failed loads are
  `kvcache_kv_transfer_failures_total`, loads under way `kvcache_kv_transfer_requests{{stage="in_progress"}}`.
- **A real pair here.** vLLM's CPU build (0.32) runs NIXL over UCX on host memory (the `nixl` and `nixl-cu12`
  packages, which load without CUDA): tests/real/test_vllm_pd_pair.py runs a prefill and a decode engine, a
  proxy and the exporter, and checks roles, received prompt tokens, transfer bytes and counts and the decode
  queue against the engines' own pages. Every P/D mapping (vLLM NIXL pull and push, SGLang) is also checked on
  golden pages written by the engines' own metrics code (tests/fixtures/pd-golden/).
- **Unified pools.** A vLLM pool with an offload connector (a KV consumer too) exports the same stage gauge for
  its loads from the offload tier. The P/D dashboards' rows, the P/D rules and alerts and `top`'s ROLE column
  read pools whose role is prefill or decode only.

{_stage_table()}

{_series_table()}

`kind` of `kvcache_kv_transfer_failures_total`:

| kind | failed |
|---|---|
{kinds}

### P/D backpressure: a signal of its own, not a pressure state

Backpressure is decode pools short of KV while the same model's prefill pools hold finished KV waiting to be
pulled (vLLM: its decode side pulls, and a request waiting to start holds its KV on the prefill side until
pulled or its lease expires) or wait to compute it (SGLang: its decode side pre-allocates before the prefill
side computes, so the prefill side's bootstrap queue backs up instead). It is
`{PD_BACKPRESSURE}`, a recording rule per P/D group: the group's decode-side
`kvcache_kv_transfer_requests_waiting_for_kv` (transfers waiting to start while the pool's KV is short, derived
per pool by the exporter), where the group has prefill pools. Not a sixth pressure state, because:

- it is a property of two pools, mostly on different targets, and the exporter judges each target from its
  own page alone (a poll, a `/probe`, a shard of a sharded fleet never sees the peer);
- neither pool's state says it alone: the prefill pool holds KV without a queue of its own (`ok` or
  `tight`); the decode pool reads `saturated` (its transfers waiting for KV to be allocated are part of its
  queue on both engines, the simulator's `pd-decode-short` scenario shows it), as it would for any queue short
  of KV, which does not say that a prefill pool waits on it;
- the pressure state is one-hot per pool and already answers "is this pool short"; backpressure answers "is
  decode what holds this model back", which needs the group, i.e. the `pd_group_label`.

Derived from these, per P/D group: `kvcache:kv_transfer_share_of_ttft:ratio`, the mean transfer time over
the decode pools' mean TTFT. KVCachePDBackpressure, KVCacheTransfersFailing, KVCacheTransferLeaseExpiries,
KVCacheTransferNotificationsAfterExpiry and KVCacheTransferBandwidthLow are in the
[runbook](../alerts/runbook.md).
"""


def _latency_buckets_section() -> str:
    rows = "\n".join(f"| `{name}` | {', '.join(f'{bound:g}' for bound in bounds)}, +Inf |"
                     for name, bounds in contract.DEFAULT_LATENCY_BUCKETS.items())
    return f"""
## Latency buckets

The latency histograms (group `latency`) are re-exported at a subset of the engine's bucket bounds: by default
these, where the engine's grid has them (a bound it lacks is simply not there; +Inf always is):

| `latency_buckets` key (the family without `{contract.PREFIX}`) | bounds kept by default, seconds |
|---|---|
{rows}

Why these: they are the round targets latency objectives are written in (1-2-5 steps: a TTFT under 0.5 s, an
inter-token latency under 50 ms), plus the nearest bounds of the engines whose grids miss them (SGLang's 0.2, 0.4,
4, 40 and 100, vLLM's 0.04, 0.075, 120 and 240), so that on each engine's grid two kept bounds are at most 2.5
times apart, and a tail of minutes, where a KV shortage puts queueing and TTFT (a quantile above the top bound
kept reads as that bound). Dropping bounds of a cumulative histogram is exact at the bounds kept: the share of
requests under a kept bound, an SLO ratio at it, and `_sum` and `_count` are what all of the engine's bounds give.
A quantile between two kept bounds is interpolated over a wider bucket: how far that moves p50, p90 and p99 on the
real vLLM tier's page and on the simulator's is measured in [performance.md](performance.md#latency-buckets-what-the-default-set-loses)
(`python -m bench.bucket_loss`). Of its bounds (+Inf included) vLLM keeps 14 of 23 for TTFT, 12 of 20 inter-token,
14 of 22 for queue time and end-to-end latency; SGLang 14 of 19, 10 of 24, 14 of 37 and 13 of 23. The dashboards and rules use no particular
bound of these histograms (quantiles over whatever bounds are there, heatmaps, `_sum` and `_count`).

`latency_buckets:` in the configuration changes it: `latency_buckets: all` keeps every bound of every histogram;
a mapping names, per key of the table above, `all` or the bounds to keep, e.g.
`latency_buckets: {{time_to_first_token_seconds: [0.2, 0.5, 1, 2]}}`; a family not named keeps the set above.
"""


def markdown() -> str:
    return "\n".join((INTRO, _labels_section(), _families_section(), _latency_buckets_section(),
                      _engine_notes_section(), _pressure_section(),
                      _offload_section(), _disaggregation_section(), _failure_reasons_section(),
                      _event_streams_section()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.contract_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DOC_PATH, help="file to write, `-` for stdout (%(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file differs")
    args = parser.parse_args(argv)
    try:
        text = markdown()
    except LookupError as err:
        print(f"python -m devtools.contract_doc: {err.args[0]}", file=sys.stderr)
        return 2
    if args.check:
        if not args.output.is_file() or args.output.read_text() != text:
            print(f"{args.output} is out of date: run `make docs`", file=sys.stderr)
            return 1
        return 0
    if str(args.output) == "-":
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
