"""The replicas of one model, per P/D group (the configuration's pd_group_label) and role: how evenly its KV is
used, how many replicas its KV demand needs (the signal an autoscaler reads, deploy/kubernetes/autoscaling.py),
and the alert on a router that sends work to full replicas while peers have room.

A pool's series show only while its target's polls are fresh, so every pool these rules see is ready. Scale-out
reads KV-bound waiting, never usage alone: a pool that queues behind its running-request cap has no KV-bound
waiting, and a pool kept full by design (its offload tier serves the hits) queues nothing."""

from __future__ import annotations

from kvcache_exporter.alerts.rules.common import alert, number
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration


def recording_rules(t: Thresholds, group: str) -> list[dict]:
    """The fleet's rules in the order they read each other (`group`: the pd_group_label)."""
    return balance_rules(t, group) + capacity_rules(t, group) + flow_rules(t, group) + scaling_rules(t, group)


def balance_rules(t: Thresholds, group: str) -> list[dict]:
    """How evenly the replicas' KV is used, and how much of the KV-bound waiting their peers could take."""
    by = f"by ({group}, role)"
    w = format_duration(t.window_seconds)
    backlog = f"min_over_time(kvcache_requests_waiting_for_kv[{w}]) * kvcache_live_tokens_per_request"
    return [
        {"record": "kvcache:fleet_usage_ratio:spread", "expr": (
            f"max {by} (kvcache_usage_ratio)\n-\nmin {by} (kvcache_usage_ratio)")},
        {"record": "kvcache:fleet_usage_ratio:stddev", "expr": f"stddev {by} (kvcache_usage_ratio)"},
        {"record": "kvcache:fleet_requests_waiting_for_kv:sum", "expr": f"sum {by} (kvcache_requests_waiting_for_kv)"},
        # Spare KV: free tokens over the ready pools; the peers' share of it is on pools that queue nothing at all
        # (a pool queueing behind its cap would not run more either).
        {"record": "kvcache:fleet_free_tokens:sum", "expr": f"sum {by} (kvcache_free_tokens)"},
        {"record": "kvcache:fleet_peer_free_tokens:sum", "expr": (
            f"sum {by} (\n  kvcache_free_tokens\n  unless on (target, dp_rank) (kvcache_requests_waiting > 0)\n)")},
        # The engines count queued requests, not their tokens: a queued request is taken to need what a running
        # one of the same pool holds now (prompt and output so far). Only the queue held through the whole window
        # counts: a burst that the pool absorbs within it (an offload tier reloading hits) asks for no replica. A
        # prefill pool's KV held for export is room its queue gets as the decode side takes it: that part of the
        # queue asks the decode side (its own queue) for replicas, not this one.
        {"record": "kvcache:fleet_kv_backlog_tokens:sum", "expr": (
            f"sum {by} (\n  clamp_min(\n    {backlog} - kvcache_kv_transfer_held_tokens,\n    0\n  )\n"
            f"  or\n  {backlog}\n)")},
        {"record": "kvcache:fleet_live_tokens_per_request:avg", "expr": f"avg {by} (kvcache_live_tokens_per_request)"},
        # The share of KV-bound waiting on pools whose peers have headroom (a pool below the low-water mark that
        # queues nothing): waiting there is the router's doing (fix the routing), elsewhere a capacity problem.
        {"record": "kvcache:fleet_requests_waiting_for_kv_peer_headroom:ratio", "expr": (
            f"(\n  sum {by} (\n    kvcache_requests_waiting_for_kv\n    and on ({group}, role) (\n"
            f"      kvcache_usage_ratio < {number(t.low_water_ratio)}\n"
            "      unless on (target, dp_rank) (kvcache_requests_waiting > 0)\n    )\n  )\n"
            "  or\n  0 * kvcache:fleet_requests_waiting_for_kv:sum\n)\n/\n(kvcache:fleet_requests_waiting_for_kv:sum > 0)")},
        # Of the KV-bound waiting requests, the share the peers' free KV could hold (a queued request taken as
        # large as a running one): how much of the backlog better routing alone would place.
        {"record": "kvcache:fleet_requests_waiting_for_kv_routable:ratio", "expr": (
            "clamp_max(\n  kvcache:fleet_peer_free_tokens:sum\n  / kvcache:fleet_live_tokens_per_request:avg\n"
            "  / (kvcache:fleet_requests_waiting_for_kv:sum > 0),\n  1\n)")},
    ]


def capacity_rules(t: Thresholds, group: str) -> list[dict]:
    """The backlog the peers cannot take, and the replicas ready and starting to hold it."""
    by = f"by ({group}, role)"
    w = format_duration(t.window_seconds)
    start = t.replica_starting_lookback
    return [
        # Backlog the peers cannot take: what new replicas must hold.
        {"record": "kvcache:fleet_kv_short_tokens:sum", "expr": (
            "clamp_min(kvcache:fleet_kv_backlog_tokens:sum - kvcache:fleet_peer_free_tokens:sum, 0)\n"
            "or\nkvcache:fleet_kv_backlog_tokens:sum")},
        # A replica is a target (its data-parallel ranks are its pools).
        {"record": "kvcache:fleet_replicas_ready:count", "expr": (
            f"count {by} (group without (dp_rank) (kvcache_capacity_tokens))")},
        {"record": "kvcache:fleet_replica_capacity_tokens:avg", "expr": (
            f"avg {by} (sum without (dp_rank) (kvcache_capacity_tokens))")},
        # The KV the ready pools' requests hold, averaged over the window: what the replicas left after a scale-in
        # must hold. Not a prefill pool's KV held for export, which the decode side frees as it takes it.
        {"record": "kvcache:fleet_used_tokens:sum", "expr": (
            f"sum {by} (\n  (\n    avg_over_time(kvcache_used_tokens[{w}])\n"
            f"    - avg_over_time(kvcache_kv_transfer_held_tokens[{w}])\n"
            f"    or\n    avg_over_time(kvcache_used_tokens[{w}])\n  )\n  and\n  kvcache_used_tokens\n)")},
        # Starting: targets that do not answer now and were a pool of the model within the lookback (restarting,
        # rescheduled), or are a replica of it by the exporter's word (kvcache_target_replica_info: an
        # autoscaler's new replica, its model configured or probed) and did answer, or were not there, a lookback
        # ago (one down since is broken, not starting). Counting them keeps the signal from asking for them again.
        {"record": "kvcache:fleet_replicas_starting:count", "expr": (
            f"count {by} (\n  group by (target, {group}, role) (\n"
            f"    group without (dp_rank) (last_over_time(kvcache_capacity_tokens[{start}]))\n"
            f"    or\n    (kvcache_target_replica_info unless on (target) (kvcache_target_up offset {start} == 0))\n"
            "  )\n  unless on (target) kvcache_capacity_tokens\n  and on (target) (kvcache_target_up == 0)\n)")},
    ]


def held_at_low_water(t: Thresholds, indent: str = "") -> str:
    """The replicas that hold the ready pools' used KV at the low-water mark (kvcache:fleet_used_tokens:sum:
    averaged over the window, as a pool's usage moves with each request's arrival and end)."""
    return (f"ceil(\n{indent}  kvcache:fleet_used_tokens:sum\n"
            f"{indent}  / (kvcache:fleet_replica_capacity_tokens:avg * {number(t.low_water_ratio)})\n{indent})")


def flow_rules(t: Thresholds, group: str) -> list[dict]:
    """The replicas the model's flow of requests needs, and those its KV shortage needs."""
    by = f"by ({group}, role)"
    w = format_duration(t.window_seconds)
    backlog_pools = "ceil(kvcache:fleet_kv_short_tokens:sum / kvcache:fleet_replica_capacity_tokens:avg)"
    sure_growth = ("kvcache:fleet_requests_waiting:deriv\n"
                   f"    - {number(t.flow_confidence_sigmas)} * sqrt(kvcache:fleet_requests_finished:rate / {number(t.window_seconds)})")
    share = number(t.preemption_demand_share)
    held = held_at_low_water(t, "  ")
    return [
        # The flow: requests the model finishes a second, and how fast its queue grows (the arrivals beyond them).
        {"record": "kvcache:fleet_requests_finished:rate", "expr": (
            f"sum {by} (rate(kvcache_e2e_request_latency_seconds_count[{w}]))")},
        # A decode side's queue goes on past its pools: once a prefill pool is full of KV the decode side has not
        # pulled, the arrivals beyond what decode serves queue on the prefill side, waiting for that KV, while the
        # decode queue stands level. So decode's growth is its queue's and the prefill queue's waiting for KV; when
        # a decode replica is added, the prefill queue drains first and the decode queue only after it.
        {"record": "kvcache:fleet_requests_waiting:deriv", "expr": (
            f"sum {by} (deriv(kvcache_requests_waiting[{w}]))\n"
            f"+ on ({group}, role)\n"
            f"label_replace(\n  sum by ({group}) (deriv(kvcache_requests_waiting_for_kv{{role=\"prefill\"}}[{w}])),\n"
            '  "role", "decode", "", ""\n)\n'
            f"or\nsum {by} (deriv(kvcache_requests_waiting[{w}]))")},
        # Replicas the flow needs, where the model's completions are known and go on: while the queue does not
        # shrink, one more than its growth is in ready replicas' worth of completions (that stops it growing, then
        # drains it); 0 while it drains.
        {"record": "kvcache:fleet_replicas_flow:count", "expr": (
            "(\n  floor(\n    kvcache:fleet_replicas_ready:count * kvcache:fleet_requests_waiting:deriv\n"
            "    / (kvcache:fleet_requests_finished:rate > 0)\n  ) + 1\n"
            "  and\n  kvcache:fleet_requests_waiting:deriv >= 0\n)\n"
            "or\n0 * (kvcache:fleet_requests_finished:rate > 0)")},
        # The same count for the growth the window is sure of: less `flow_confidence_sigmas` standard deviations of
        # the Poisson arrival count over the window (about the square root of its completions), so that the queue's
        # noise asks for nothing; 0 while that is not growth.
        {"record": "kvcache:fleet_replicas_flow_confident:count", "expr": (
            f"(\n  floor(\n    kvcache:fleet_replicas_ready:count * ({sure_growth})\n"
            "    / (kvcache:fleet_requests_finished:rate > 0)\n  ) + 1\n"
            f"  and\n  ({sure_growth}) >= 0\n)\n"
            "or\n0 * (kvcache:fleet_requests_finished:rate > 0)")},
        # The share of the model's completions over the window that were preempted (vLLM) or retracted (SGLang):
        # each is a request computed again, so the share is the part of the work done twice.
        {"record": "kvcache:fleet_requests_preempted:ratio", "expr": (
            f"sum {by} (rate(kvcache_preemptions_total[{w}]))\n/ (kvcache:fleet_requests_finished:rate > 0)")},
        # Replicas the preemption asks for, where the share is at least `preemption_demand_share` in each of the
        # last two windows (one burst shows in one): those that hold the ready pools' used KV (averaged over the
        # window) at the low-water mark beyond the ready ones, at least one. The scale-in's own arithmetic, so that
        # what preemption asks for is not given back. A pool kept full by the load it serves preempts now and then
        # and redoes a few percent of its requests; running requests that do not fit redo far more, whether or not
        # a queue stands between polls.
        {"record": "kvcache:fleet_replicas_preempting:count", "expr": (
            f"clamp_min(\n  {held}\n  - kvcache:fleet_replicas_ready:count,\n  1\n)\n"
            f"and on ({group}, role) (kvcache:fleet_requests_preempted:ratio >= {share})\n"
            f"and on ({group}, role) (kvcache:fleet_requests_preempted:ratio offset {w} >= {share})")},
        # Replicas the KV shortage needs: the backlog's size in pools (what would hold today's queue at once), no
        # more than the flow needs; and where there is a backlog, whatever its size, what the flow is sure of. Sized
        # by the backlog alone, a queue that built up while replicas started asks for replicas to run all of it at once: far more
        # than the load needs once it has drained; capped by it, a young queue (a step in the load) asks for one
        # replica a window. The backlog alone sizes it only where the flow cannot: the engine has no completion
        # count, or the model finished nothing in the window; while the flow is unknown for want of samples (a gap
        # in the scrapes), nothing. Where no KV-bound queue stood through this window or the one before, what the
        # preemption asks for (a standing queue is sized by its flow, and the pools that drain it preempt: the
        # queue's doing).
        {"record": "kvcache:fleet_replicas_short:count", "expr": (
            "(\n  kvcache:fleet_replicas_preempting:count\n"
            f"  unless on ({group}, role) (kvcache:fleet_kv_short_tokens:sum > 0)\n"
            f"  unless on ({group}, role) (kvcache:fleet_kv_short_tokens:sum offset {w} > 0)\n)\n"
            f"or on ({group}, role)\n"
            f"(\n  (\n    {backlog_pools}\n    <= on ({group}, role)\n    kvcache:fleet_replicas_flow:count\n  )\n"
            f"  or on ({group}, role)\n"
            f"  (kvcache:fleet_replicas_flow:count and on ({group}, role) kvcache:fleet_kv_short_tokens:sum)\n"
            f")\n>= on ({group}, role)\nkvcache:fleet_replicas_flow_confident:count\n"
            f"or on ({group}, role)\n"
            f"(kvcache:fleet_replicas_flow_confident:count and on ({group}, role) (kvcache:fleet_kv_short_tokens:sum > 0))\n"
            f"or on ({group}, role)\n"
            "0 * (kvcache:fleet_kv_short_tokens:sum == 0)\n"
            f"or on ({group}, role)\n"
            f"(\n  {backlog_pools}\n  and on ({group}, role) (kvcache:fleet_requests_finished:rate == 0)\n)\n"
            f"or on ({group}, role)\n"
            f"(\n  {backlog_pools}\n"
            f"  unless on ({group}, role) group {by} (kvcache_e2e_request_latency_seconds_count)\n)")},
    ]


def scaling_rules(t: Thresholds, group: str) -> list[dict]:
    """Replicas to add or remove, and what an autoscaler targets."""
    by = f"by ({group}, role)"
    w = format_duration(t.window_seconds)
    return [
        # Ready replicas that were not a window ago (new, or back from a restart): the window's queue and
        # completions do not show what they serve yet.
        {"record": "kvcache:fleet_replicas_joined:count", "expr": (
            f"count {by} (\n  group without (dp_rank) (kvcache_capacity_tokens)\n"
            f"  unless on (target) (kvcache_capacity_tokens offset {w})\n)\n"
            "or\n0 * kvcache:fleet_replicas_ready:count")},
        # Replicas to add (> 0) for the shortage, less those starting and those that joined within the window; or,
        # while the model's queue averaged under one request per ready replica over the window, replicas to remove
        # (< 0) down to what holds the ready pools' used KV (averaged over the window: a pool's usage moves with each
        # request's arrival and end) at the low-water mark (at least one); else 0. Not "nothing queued at any scrape":
        # requests waiting for their first step show at a scrape now and then at any load, and would hold the fleet
        # up for good.
        {"record": "kvcache:fleet_replicas:delta", "expr": (
            "(\n  clamp_min(\n"
            "    (\n      kvcache:fleet_replicas_short:count - kvcache:fleet_replicas_starting:count\n"
            "      - kvcache:fleet_replicas_joined:count\n    )\n"
            "    or\n    kvcache:fleet_replicas_short:count - kvcache:fleet_replicas_joined:count,\n"
            "    0\n  ) > 0\n)\nor\n(\n  0 - clamp_min(\n    kvcache:fleet_replicas_ready:count\n    - clamp_min(\n"
            f"      {held_at_low_water(t, '      ')},\n"
            "      1\n    ),\n    0\n  )\n"
            f"  and on ({group}, role) (\n"
            f"    sum {by} (avg_over_time(kvcache_requests_waiting[{w}])) < kvcache:fleet_replicas_ready:count\n  )\n)\n"
            "or\n0 * kvcache:fleet_replicas_ready:count")},
        # What an autoscaler targets (external metric, AverageValue 1 per replica): ready + starting + delta.
        {"record": "kvcache:fleet_replicas:desired", "expr": (
            "(kvcache:fleet_replicas_ready:count + kvcache:fleet_replicas:delta + kvcache:fleet_replicas_starting:count)"
            "\nor\n(kvcache:fleet_replicas_ready:count + kvcache:fleet_replicas:delta)")},
    ]



def alerting_rules(t: Thresholds, group: str, runbook_base: str) -> list[dict]:
    where = f"{{{{ $labels.{group} }}}} ({{{{ $labels.role }}}})"
    return [alert(
        "KVCacheRoutingImbalance", "info",
        f"kvcache:fleet_requests_waiting_for_kv_peer_headroom:ratio >= {number(t.routing_imbalance_share)}",
        t.routing_imbalance_for,
        f"{where}: requests wait for KV on some replicas while others have room",
        f"{{{{ $value | humanizePercentage }}}} of the requests waiting for KV on the replicas of {where} wait "
        "while a peer queues nothing below the low-water mark: the router sends work to full replicas. Fix the "
        "routing (KV- or load-aware); kvcache:fleet_requests_waiting_for_kv_routable:ratio says how much of the "
        "backlog the peers' free KV could take.",
        runbook_base,
    )]
