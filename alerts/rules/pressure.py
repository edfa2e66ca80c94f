"""KV pressure: how full each pool is, the requests queued for want of KV, preemptions, and the alerts that page
on them (a KV shortage that users wait on, a wedged rank, a preemption storm, a pool about to fill). Their
descriptions say why, in the exporter's own reasons (`reasons`)."""

from __future__ import annotations

from kvcache_exporter import contract
from kvcache_exporter.alerts.rules.common import (
    PER_TARGET,
    VALUE_PER_SECOND,
    WHERE,
    alert,
    number,
    target_rate,
    with_traffic,
)
from kvcache_exporter.contract import KV_SHORT_STATES
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration

# kvcache_target_up has no model or role label; joining it with per-target series ignores them.
UP_JOIN = "ignoring (model, role)"
KV_BOUND_STATES = "|".join(KV_SHORT_STATES)
PER_MINUTE = "60 * "  # a per-second rate's factor to per minute: seconds in a minute, no threshold


def recording_rules(t: Thresholds) -> list[dict]:
    w = format_duration(t.window_seconds)
    return [
        # Any replica's pool counts: one full replica queues its own requests.
        {"record": "kvcache:usage_ratio:max", "expr": f"max {PER_TARGET} (kvcache_usage_ratio)"},
        # Requests queued on replicas whose queue the exporter attributes to KV (not to a
        # concurrency cap or compute): the headline alert's signal.
        {"record": "kvcache:requests_waiting_for_kv:sum", "expr": (
            f"sum {PER_TARGET} (\n"
            f"  kvcache_requests_waiting > 0\n"
            f"  and ignoring (state) (kvcache_pressure_state{{state=~\"{KV_BOUND_STATES}\"}} == 1)\n"
            f")"
        )},
        # How fast a target's queue grows (requests per second, a regression over the window): a KV-bound queue
        # that grows is one that users wait longer on with every minute, which is what pages.
        {"record": "kvcache:requests_waiting:deriv", "expr": f"sum {PER_TARGET} (deriv(kvcache_requests_waiting[{w}]))"},
        {"record": "kvcache:preemptions:rate", "expr": target_rate("kvcache_preemptions_total", w)},
    ]


def queue_alerts(t: Thresholds, runbook_base: str) -> list[dict]:
    """Requests that wait: for KV (a warning, and a page once users wait longer), or on a wedged rank."""
    w = format_duration(t.window_seconds)
    shortage = ("kvcache:requests_waiting_for_kv:sum\n"
                f"and {UP_JOIN} (max_over_time(kvcache_target_up[{w}]) == 1)")
    ttft = number(t.shortage_critical_ttft_seconds)
    low = number(t.low_water_ratio)
    return [
        alert(
            "KVCacheShortageQueueing", "warning", shortage, t.shortage_for,
            f"{WHERE}: requests are queueing because the KV cache is full",
            f"{{{{ $value | humanize }}}} requests wait for KV on {WHERE} while the engine answers. "
            "GPU memory looks flat because the KV pool is reserved at start; users see this as rising time to first token."
            + reasons(t, KV_SHORT_STATES),
            runbook_base,
        ),
        # Pages only on user impact: the queue keeps growing, or the first tokens it lets through come late.
        alert(
            "KVCacheShortageQueueing", "critical",
            f"{shortage}\nand on (target) (\n  kvcache:requests_waiting:deriv > 0\n"
            f"  or\n  kvcache:time_to_first_token_seconds:mean > {ttft}\n)",
            t.shortage_for,
            f"{WHERE}: requests are queueing because the KV cache is full, and users wait (the queue grows, or mean "
            f"TTFT above {ttft} s)",
            f"{{{{ $value | humanize }}}} requests wait for KV on {WHERE} while the engine answers, and the queue grew "
            f"over {w} or the mean time to first token is above {ttft} s: users wait longer the longer it lasts. "
            "GPU memory looks flat because the KV pool is reserved at start." + reasons(t, KV_SHORT_STATES),
            runbook_base,
        ),
        # Per pool: a wedged data-parallel rank stalls while its peers serve, which a sum over ranks would hide.
        # Requests wait, KV has room, and over the window no prefill completed and no token came out: neither a KV
        # shortage (KV has room) nor a running-request cap (a capped engine generates).
        alert(
            "KVCacheAdmissionStalled", "critical",
            "kvcache_requests_waiting > 0\n"
            f"and kvcache_usage_ratio < {low}\n"
            f"and rate(kvcache_prompt_tokens_total[{w}]) == 0\n"
            f"and rate(kvcache_generation_tokens_total[{w}]) == 0",
            t.admission_stalled_for,
            f"{WHERE}: requests wait and the engine admits and generates nothing",
            f"{{{{ $value | humanize }}}} requests wait on {WHERE}, rank {{{{ $labels.dp_rank }}}}, while it completed no "
            f"prefill and generated no token over {w}, with KV below {number(t.low_water_ratio * 100)}% used: the "
            "engine is wedged, not short of KV nor capped. Only a restart is known to recover it.",
            runbook_base,
        ),
    ]


def storm_alert(t: Thresholds, severity: str, per_second: float, runbook_base: str) -> dict:
    w = format_duration(t.window_seconds)
    return alert(
        "KVCachePreemptionStorm", severity,
        with_traffic(f"kvcache:preemptions:rate > {number(per_second)}", "kvcache:requests_finished:rate",
                     t.traffic_floor_requests_per_second),
        t.preemption_storm_for,
        f"{WHERE}: the engine keeps preempting requests to free KV, more than {number(per_second)}/s",
        f"{WHERE} preempts {VALUE_PER_SECOND} requests/s over {w}, above {number(per_second)}/s, while "
        "requests still finish. Preempted requests lose their KV and are recomputed: throughput falls and latency climbs."
        + reasons(t, ("thrashing",)),
        runbook_base,
    )


def fill_alerts(t: Thresholds, runbook_base: str) -> list[dict]:
    """A pool that preempts to free KV, and one that is (or soon will be) full."""
    w = format_duration(t.window_seconds)
    horizon = number(t.nearly_full_horizon_seconds)
    return [
        storm_alert(t, "warning", t.preemption_storm_warning_per_second, runbook_base),
        storm_alert(t, "critical", t.preemption_storm_critical_per_second, runbook_base),
        alert(
            "KVCacheNearlyFull", "warning",
            f"kvcache:usage_ratio:max >= {number(t.high_water_ratio)}\n"
            "or (\n"
            f"  kvcache:usage_ratio:max >= {number(t.low_water_ratio)}\n"
            f"  and max {PER_TARGET} (predict_linear(kvcache_usage_ratio[{w}], {horizon})) >= 1\n"
            ")",
            t.nearly_full_for,
            f"{WHERE}: the KV cache is nearly full",
            f"KV usage {{{{ $value | humanizePercentage }}}} on {WHERE} (high-water mark "
            f"{number(t.high_water_ratio * 100)}%, or {number(t.low_water_ratio * 100)}% on a trend over {w} "
            f"that fills it within {format_duration(t.nearly_full_horizon_seconds)}). Once it is full, new requests queue for KV."
            + reasons(t, contract.PRESSURE_STATES[1:]),
            runbook_base,
        ),
    ]


def reasons(t: Thresholds, states: tuple[str, ...]) -> str:
    """Template text: for each rank of the alert's target whose pressure state is one of `states`, its reason in
    the contract's words (contract.reason_text, as `top` shows it), the numbers queried from the rank's own series
    when the alert is evaluated. Nothing where the exporter gives no reason."""
    names = [name for name, reason in contract.PRESSURE_REASONS.items() if reason.state in states]
    pool = "target=%q,model=%q,dp_rank=%q"
    per_minute = f"{PER_MINUTE}rate(kvcache_preemptions_total{{{pool}}}[{format_duration(t.window_seconds)}])"

    def value(name: str) -> str:
        if name in ("low_water_ratio", "high_water_ratio"):
            return f"{getattr(t, name) * 100:.0f}%"
        expr, format_ = {
            "usage_ratio": (f"100 * kvcache_usage_ratio{{{pool}}}", "%.0f%%"),
            "headroom_requests": (f"floor(kvcache_headroom_requests{{{pool}}})", "%.0f"),
            "preemptions_per_minute": (per_minute, "%.1f"),
        }.get(name, (f"kvcache_{name}{{{pool}}}", "%.0f"))
        return (f"{{{{ with query (printf `{expr}` $labels.target $labels.model $rank) }}}}"
                f'{{{{ . | first | value | printf "{format_}" }}}}{{{{ end }}}}')

    branches = "".join(
        f'{{{{ {"else if" if i else "if"} eq .Labels.reason "{name}" }}}}{contract.reason_text(name, value)}'
        for i, name in enumerate(names))
    ranks = f'kvcache_pressure_reason{{target=%q,model=%q,reason=~"{"|".join(names)}"}} > 0'
    return (f"{{{{ range query (printf `{ranks}` $labels.target $labels.model) | sortByLabel \"dp_rank\" }}}}"
            f"{{{{ $rank := .Labels.dp_rank }}}}"
            f" Rank {{{{ $rank }}}}: {branches}{{{{ end }}}}.{{{{ end }}}}")
