"""Disaggregated prefill/decode: per pool the KV transfers' bandwidth and failures, lease expiries and
notifications after them; per P/D group the transfer time's share of TTFT and P/D backpressure; and the alerts
on each."""

from __future__ import annotations

from kvcache_exporter import contract
from kvcache_exporter.alerts.rules.common import PER_TARGET, VALUE_PER_SECOND, WHERE, alert, number, with_traffic
from kvcache_exporter.dashboards.promql import pd_backpressure
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration

# The cross-pool signal and the failed kinds the failure ratio counts (vLLM NIXL's notification failures are in its
# transfer failures since 0.31, so counting them apart would count them twice).
PD_BACKPRESSURE = "kvcache:pd_backpressure:requests"
FAILED_KINDS = "transfer|handshake"
# The pools the P/D rules read: a unified pool's stage gauge (vLLM with an offload connector) counts its loads
# from the offload tier, no transfer between pools.
PD_ROLES = f'role=~"{"|".join(contract.DISAGGREGATED_ROLES)}"'


def recording_rules(t: Thresholds, group: str) -> list[dict]:
    """Disaggregated prefill/decode. Per pool: the effective transfer bandwidth (bytes over seconds of the
    same transfers), believed up to the link rate and flagged above it, and the share of transfers that fail.
    Across the pools of one P/D group (`group`, the configuration's pd_group_label): the mean transfer time as
    a share of the decode pools' mean TTFT, and P/D backpressure."""
    w = format_duration(t.window_seconds)
    link = number(t.kv_transfer_link_bytes_per_second)

    def rate(counter: str, by: str = PER_TARGET, matchers: str = "") -> str:
        return f"sum {by} (rate({counter}{{{', '.join(filter(None, (PD_ROLES, matchers)))}}}[{w}]))"

    bandwidth = (f"{rate('kvcache_kv_transfer_bytes_sum')}\n  /\n  ({rate('kvcache_kv_transfer_seconds_sum')} > 0)")
    failed = rate("kvcache_kv_transfer_failures_total", "without (dp_rank, kind)", f'kind=~"{FAILED_KINDS}"')
    succeeded = rate("kvcache_kv_transfer_seconds_count")
    by_group = f"by ({group})"

    decode = 'role="decode"'

    def mean(histogram: str, matchers: str = "") -> str:
        return (f"{rate(f'{histogram}_sum', by_group, matchers)}\n  /\n"
                f"  ({rate(f'{histogram}_count', by_group, matchers)} > 0)")

    return [
        {"record": "kvcache:kv_transfer_bytes_per_second:ratio", "expr": f"(\n  {bandwidth}\n) <= {link}"},
        # Faster than the link: a broken reading (SGLang's chunked prefill times the last chunk only), not a link.
        {"record": "kvcache:kv_transfer_bytes_per_second_above_link:ratio", "expr": f"(\n  {bandwidth}\n) > {link}"},
        # The transfers the engine itself timed faster than the link (the speed histograms of SGLang and Dynamo's
        # TensorRT-LLM), as a share of those it timed: how much of the quotient above is broken readings.
        {"record": "kvcache:kv_transfer_above_link:ratio", "expr": (
            f"{rate('kvcache_kv_transfer_above_link_total')}\n/\n"
            f"({rate('kvcache_kv_transfer_speed_bytes_per_second_count')} > 0)")},
        # Transfers tried where the pool times its transfers (the side whose failures the ratio can be judged on):
        # succeeded plus failed, or succeeded alone while no failure counter exists yet (SGLang's appear at the first).
        {"record": "kvcache:kv_transfers_tried:rate", "expr": (
            f"(\n  {succeeded}\n  +\n  {failed}\n)\nor\n{succeeded}")},
        {"record": "kvcache:kv_transfer_failures:ratio", "expr": f"{failed}\n/\n(kvcache:kv_transfers_tried:rate > 0)"},
        {"record": "kvcache:kv_transfer_lease_expiries:rate", "expr": rate("kvcache_kv_transfer_lease_expiries_total")},
        {"record": "kvcache:kv_transfer_notifications_after_expiry:increase", "expr": (
            f"sum {PER_TARGET} (increase(kvcache_kv_transfer_notifications_after_expiry_total{{{PD_ROLES}}}[{w}]))")},
        {"record": "kvcache:kv_transfer_share_of_ttft:ratio", "expr": (
            f"(\n  {mean('kvcache_kv_transfer_seconds')}\n)\n/\n"
            f"(\n  {mean('kvcache_time_to_first_token_seconds', decode)}\n)")},
        # Decode pools short of KV hold back transfers whose KV the same group's prefill pools hold (vLLM, until
        # pulled) or wait to compute (SGLang, until pre-allocated).
        {"record": PD_BACKPRESSURE, "expr": pd_backpressure(
            'kvcache_kv_transfer_requests_waiting_for_kv{role="decode"}', 'kvcache_usage_ratio{role="prefill"}', group,
            "\n")},
    ]


def alerting_rules(t: Thresholds, group: str, runbook_base: str) -> list[dict]:
    w = format_duration(t.window_seconds)
    tried, floor = "kvcache:kv_transfers_tried:rate", t.traffic_floor_transfers_per_second
    low = number(t.kv_transfer_bandwidth_low_fraction * t.kv_transfer_link_bytes_per_second)
    where_group = f"{{{{ $labels.{group} }}}}"
    return [
        alert(
            "KVCacheTransfersFailing", "warning",
            with_traffic(f"kvcache:kv_transfer_failures:ratio > {number(t.kv_transfer_failure_ratio)}", tried, floor),
            t.transfer_failures_for,
            f"{WHERE}: KV transfers between prefill and decode fail",
            f"{{{{ $value | humanizePercentage }}}} of the KV transfers (and their handshakes) on {WHERE} failed over "
            f"{w}, above {number(t.kv_transfer_failure_ratio * 100)}%. Each failed request is computed again or "
            "dropped: its prefill was wasted.",
            runbook_base,
        ),
        alert(
            "KVCacheTransferLeaseExpiries", "warning",
            "kvcache:kv_transfer_lease_expiries:rate > 0",
            t.lease_expiries_for,
            f"{WHERE}: prefill KV expires before the decode side pulls it",
            f"{WHERE} frees {VALUE_PER_SECOND} requests' KV per second over {w} because the decode side "
            "did not pull it within the lease: the decode side is too slow or too full. Scale decode or give it KV.",
            runbook_base,
        ),
        alert(
            "KVCacheTransferNotificationsAfterExpiry", "critical",
            "kvcache:kv_transfer_notifications_after_expiry:increase > 0",
            t.notifications_after_expiry_for,
            f"{WHERE}: KV transfers finished after their lease expired: possible corruption",
            f"{{{{ $value | humanize }}}} of the KV transfers from {WHERE} over {w} completed after it had freed "
            "their KV at lease expiry: the blocks may have been reused before the transfer finished, and the "
            "decode side may generate from wrong KV.",
            runbook_base,
        ),
        alert(
            "KVCachePDBackpressure", "warning",
            f"{PD_BACKPRESSURE} > 0",
            t.pd_backpressure_for,
            f"{where_group}: decode pools short of KV back up into prefill",
            f"{{{{ $value | humanize }}}} requests of {where_group} wait for decode-side KV to receive their prefill "
            "into, while the prefill side holds their KV or waits to compute them: decode is the bottleneck. "
            "Give decode KV or replicas; more prefill would only hold more KV.",
            runbook_base,
        ),
        alert(
            "KVCacheTransferBandwidthLow", "warning",
            with_traffic(f"kvcache:kv_transfer_bytes_per_second:ratio < {low}", tried, floor),
            t.transfer_bandwidth_low_for,
            f"{WHERE}: KV transfers run far below the link rate",
            f"KV transfers of {WHERE} move {{{{ $value | humanize1024 }}}}B per second of transfer over {w}, below "
            f"{number(t.kv_transfer_bandwidth_low_fraction * 100)}% of the link's "
            f"{number(t.kv_transfer_link_bytes_per_second / 1e9)} GB/s: a host-staged or misrouted path, or a "
            "congested link.",
            runbook_base,
        ),
    ]
