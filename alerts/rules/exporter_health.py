"""The exporter's own health: targets it cannot poll, replicas of it that do not answer or are gone, and worker
processes that keep failing. While any of these fires, the KV alerts of the engines concerned are blind."""

from __future__ import annotations

from kvcache_exporter.alerts.rules.common import alert
from kvcache_exporter.thresholds import Thresholds
from kvcache_exporter.units import format_duration

# The scrape job of the exporters' own /metrics, as compose, the Kubernetes manifests and docs/scaling.md name it.
EXPORTER_JOB = "kvcache-exporter"


def alerting_rules(t: Thresholds, runbook_base: str) -> list[dict]:
    w = format_duration(t.window_seconds)
    return [
        # Failed polls in every window of `for`: a target that is down, and one that flaps,
        # both alert; a single failed poll does not.
        alert(
            "KVCacheTargetDown", "warning",
            f"(1 - avg_over_time(kvcache_target_up[{w}])) > 0",
            t.target_down_for,
            "{{ $labels.target }}: the exporter cannot poll the engine",
            f"{{{{ $value | humanizePercentage }}}} of the polls of {{{{ $labels.target }}}} "
            f"(engine {{{{ $labels.engine }}}}) failed over the last {w}. Its KV alerts are blind while it does not answer.",
            runbook_base,
        ),
        # One replica of several gone (sharded probe mode): absent() still sees the others, and
        # the engines of its shard vanish without a failed poll. Prometheus' own `up` tells.
        alert(
            "KVCacheExporterDown", "warning",
            f'up{{job="{EXPORTER_JOB}"}} == 0',
            t.target_down_for,
            "{{ $labels.instance }}: a kvcache exporter replica does not answer",
            f"Prometheus cannot scrape the kvcache exporter at {{{{ $labels.instance }}}} (job {EXPORTER_JOB}): "
            "the engines it polls or probes have no KV-cache series and no KV alerts until it is back.",
            runbook_base,
        ),
        # A worker process that keeps failing (`workers:` above 1): its targets' series are absent, not 0,
        # so KVCacheTargetDown cannot tell. Windowed as KVCacheTargetDown: one restart does not fire.
        alert(
            "KVCacheExporterWorkerFailing", "warning",
            f"increase(kvcache_exporter_worker_restarts_total[{w}])\n"
            f"+ increase(kvcache_exporter_worker_missed_replies_total[{w}]) > 0",
            t.target_down_for,
            "{{ $labels.instance }}: an exporter worker process keeps failing",
            f"The kvcache exporter at {{{{ $labels.instance }}}} restarted a worker process or went without a worker's "
            f"answer in every {w} window: the engines that worker polls are missing from its scrapes, so their KV "
            "alerts are blind.",
            runbook_base,
        ),
        alert(
            "KVCacheExporterAbsent", "critical",
            "absent(kvcache_exporter_build_info)",
            t.exporter_absent_for,
            "The kvcache exporter is gone",
            f"Prometheus has had no kvcache_exporter_build_info series for {t.exporter_absent_for}: "
            "the exporter is down or no longer scraped, so every KV-cache alert is blind.",
            runbook_base,
        ),
    ]
