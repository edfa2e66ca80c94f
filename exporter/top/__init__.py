"""The terminal view of `kvcache-exporter top` (the command is kvcache_exporter.commands.top): the
fleet's KV state, one row per pool, worst first.

A consumer of the kvcache_* contract like the dashboards: it reads an exporter's /metrics, or polls
the engines itself with the exporter's pipeline (`source`); it turns pages into rows (`rows`,
`rates`) and shows them on a live screen (`live`, `screen`) or as one table or JSON (`once`).
"""
