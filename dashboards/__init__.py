"""Grafana dashboards for the kvcache_* contract, as code (grafana-foundation-sdk).

`python -m devtools.build_dashboards` writes dashboards/generated/*.json; `--check` fails when the
committed JSON differs from what this source builds. See docs/dashboards.md.
"""
