"""The one place where KV-pressure thresholds live.

The exporter's pressure state (exporter.derive), the alert rules (alerts/rules/) and the
dashboards (dashboards/build.py) all read these values; the exporter configuration's
`pressure:` section overrides them for the exporter, and the generators take the same file
(`--config exporter.yml`) so that rules and panels follow a deployment's overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class Thresholds:
    # Usage (0..1) at or above which a pool counts as nearly full: pressure `tight`,
    # the KVCacheNearlyFull alert and the red band of every usage panel.
    high_water_ratio: float = 0.90
    # Usage below which the pool has room to spare: the amber band of usage panels, and the mark under
    # which a queue counts as waiting with KV room (pressure `capped`) rather than for KV (`saturated`).
    low_water_ratio: float = 0.75
    # Preemptions/retractions per second over `window_seconds` that make the state `thrashing`.
    thrashing_preemptions_per_second: float = 0.02
    # Window over which the exporter and the rules look at counters and queues.
    window_seconds: float = 60.0
    # KVCachePreemptionStorm: warning and critical rates (per second, over `window_seconds`).
    preemption_storm_warning_per_second: float = 0.1
    preemption_storm_critical_per_second: float = 1.0
    # Finished requests per second below which rate-based alerts stay quiet (idle engine).
    traffic_floor_requests_per_second: float = 0.05
    # Queried prompt tokens per second below which the hit-ratio alert stays quiet.
    traffic_floor_prefix_tokens_per_second: float = 50.0
    # KVCachePrefixHitRateDrop: hit ratio below this fraction of its own baseline.
    prefix_hit_drop_fraction: float = 0.5
    # Baseline offset for the hit-ratio comparison.
    prefix_hit_baseline_offset: str = "1h"
    # KVCacheCapacityMisses (info): prompt tokens recomputed after their blocks were evicted for room
    # (the KV event streams' capacity misses), as a share of the prompt tokens looked up.
    capacity_miss_share: float = 0.1
    # KVCacheRoutingLoss (info): prompt tokens a replica computed while a sibling of the same model held them (the
    # fleet index's routing loss), as a share of the prefill the model's replicas stored.
    routing_loss_share: float = 0.1
    # KVCacheQueueDominatesTTFT: share of TTFT spent in the queue (queue-time seconds per TTFT second).
    queue_share_of_ttft: float = 0.5
    # KVCacheNearlyFull by trend: predict_linear says the pool is full within this many seconds.
    nearly_full_horizon_seconds: float = 1800.0
    # KVCacheOffloadLoadSlow: seconds to load one token back from an offload tier above which loading
    # costs about what computing its prefill again would (set it to the model's prefill seconds per token on
    # its GPUs: 5e-5 is 20,000 prompt tokens/s).
    offload_load_max_seconds_per_token: float = 5e-5
    # Disaggregated prefill/decode. KVCacheTransfersFailing: failed KV transfers (kinds transfer and handshake)
    # as a share of the transfers tried, above this, while at least the floor of transfers per second is tried.
    kv_transfer_failure_ratio: float = 0.05
    traffic_floor_transfers_per_second: float = 0.05
    # The link between prefill and decode pools, in bytes per second of transfer (one TP rank's NIC where the
    # engine times each rank's shard, vLLM): an effective bandwidth above it is a broken reading (SGLang's
    # chunked-prefill timing), flagged and not believed; below kv_transfer_bandwidth_low_fraction of it is
    # KVCacheTransferBandwidthLow. 50e9: a 400 Gb/s NIC. Measured on the engines' clock, so --time-scale
    # leaves it as it is.
    kv_transfer_link_bytes_per_second: float = 50e9
    kv_transfer_bandwidth_low_fraction: float = 0.1
    # KVCacheRoutingImbalance (info): the share of a model's KV-bound waiting requests that wait on pools whose
    # peers (ready pools of the same P/D group and role) have headroom (queue nothing, below the low-water mark).
    routing_imbalance_share: float = 0.5
    # Autoscaling: a replica starting for a model, which the scale-out signal does not ask for again, is a target
    # that was a pool of the model within this lookback and no longer answers (restarting, rescheduled), or one
    # configured or probed for the model (kvcache_target_replica_info) that does not answer yet; one that was
    # already down this long ago is broken, not starting.
    replica_starting_lookback: str = "10m"
    # Autoscaling: the flow asks for its whole count at once (beyond the KV-bound backlog's size in pools) only for
    # the queue's growth it is sure of: the growth over the window less this many standard deviations of the
    # Poisson arrival count over it (the square root of the window's completions); 1.645: a one-sided 95% bound.
    flow_confidence_sigmas: float = 1.645
    # Autoscaling: preemption is demand (where no KV-bound queue stands through the window) when the model's
    # preemptions over the window are at least this share of its completions, in each of the last two windows (one
    # burst shows in one). Each preemption recomputes a request: the share is the part of the requests done again.
    # 0.25: in the closed loop (tests/e2e/test_fleet_scaling.py) pools kept full by a load they serve preempted up to
    # 0.10 of their completions (5 replicas at 12.6 requests a second: 0.27 a second each, 13 times the thrashing
    # rate), pools whose running requests outgrow them 0.79; a quarter sits 2.5 times above the one, 3 below the other.
    preemption_demand_share: float = 0.25
    # KVCacheShortageQueueing pages (critical) only on user impact: besides a KV-bound queue held for `shortage_for`,
    # the queue grows over the window, or the mean time to first token over the window exceeds this many seconds.
    # 2 s: MLPerf Inference's bound on the first token for its llama2-70b server scenario; a chat user waiting
    # longer on average is waiting on the queue, not on prefill.
    shortage_critical_ttft_seconds: float = 2.0
    # `for:` durations of the alerts.
    shortage_for: str = "2m"
    nearly_full_for: str = "10m"
    preemption_storm_for: str = "5m"
    prefix_hit_drop_for: str = "15m"
    queue_dominates_for: str = "10m"
    target_down_for: str = "2m"
    exporter_absent_for: str = "5m"
    capacity_miss_for: str = "30m"
    routing_loss_for: str = "30m"
    offload_full_for: str = "5m"
    offload_slow_for: str = "15m"
    transfer_failures_for: str = "5m"
    lease_expiries_for: str = "2m"
    notifications_after_expiry_for: str = "30s"
    pd_backpressure_for: str = "2m"
    transfer_bandwidth_low_for: str = "15m"
    routing_imbalance_for: str = "5m"
    # KVCacheAdmissionStalled: a pool with requests waiting and KV below the low-water mark that completed no
    # prefill and generated no token over the window, at every evaluation for this long (window + for without
    # progress: longer than any one prefill or any output a healthy engine finishes in).
    admission_stalled_for: str = "5m"

    @classmethod
    def from_mapping(cls, values: dict[str, Any] | None) -> "Thresholds":
        """Defaults overridden by `values`; unknown keys raise KeyError, wrong types TypeError."""
        if not values:
            return cls()
        known = {f.name: f for f in fields(cls)}
        base = cls()
        changes: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise KeyError(key)
            expected = type(getattr(base, key))
            if expected is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                changes[key] = float(value)
            elif isinstance(value, expected) and not isinstance(value, bool):
                changes[key] = value
            else:
                raise TypeError(f"{key} must be a {expected.__name__}, got {value!r}")
        return replace(base, **changes)


DEFAULT = Thresholds()

# The thresholds the exporter derives with that its page publishes (kvcache_exporter_pressure_threshold{name}), so
# that a reader of the page (`top --exporter`) quotes the marks and the window the state was derived with.
PUBLISHED = ("high_water_ratio", "low_water_ratio", "thrashing_preemptions_per_second", "window_seconds")

# The poll lead (kvcache_exporter_poll_lead_ratio: how early the earliest poll starts before a scrape, over the poll
# interval) above which one exporter process reads its fleet too slowly to keep its data within a second of a direct
# scrape's at a 5 s interval, ingestion included (docs/performance.md): the point to add a replica (`--shard`).
SHARD_LEAD_RATIO = 0.2
