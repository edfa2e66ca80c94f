"""KV memory in bytes, where the exporter knows the model's architecture."""

from __future__ import annotations

from kvcache_exporter.dashboards import bands, promql
from kvcache_exporter.dashboards.panels import Query, describe, stat, timeseries
from kvcache_exporter.dashboards.view import BYTES, View

MEMORY_ONLY_WHERE = "Present only where the target's model architecture is in the exporter's configuration."


def bytes_per_token(v: View):
    return stat(
        "KV bytes per token",
        describe(
            "Bytes of KV one token costs for this model: 2 x layers x KV heads x head dim x bytes per element "
            "(with the MLA, sliding-window and hybrid variants). " + MEMORY_ONLY_WHERE,
            "no red band. A change means a different model, KV dtype or architecture entry: check the deployment.",
        ),
        BYTES,
        [Query(promql.highest(v.scope, "kvcache_bytes_per_token"), "bytes per token")],
        bands.neutral(),
        no_value="No data: no model_architecture configured (docs/kv-math.md)",
    )


def kv_bytes(v: View):
    return timeseries(
        "KV memory",
        describe(
            "KV pool size in bytes, and the bytes held by live requests (tokens x bytes per token). "
            + MEMORY_ONLY_WHERE,
            "no red band; KV usage carries the same fill as a ratio. Use it to size pools: capacity is what the "
            "engine reserved on the GPU, used is what the traffic needs.",
        ),
        BYTES,
        [
            Query(promql.total(v.scope, "kvcache_capacity_bytes", v.split), v.line("capacity")),
            Query(promql.total(v.scope, "kvcache_used_bytes", v.split), v.line("used")),
        ],
        bands.neutral(),
    )
