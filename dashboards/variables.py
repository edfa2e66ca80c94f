"""Template variables: the datasource, then one filter per label, each narrowed by the ones before it."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as builders
from grafana_foundation_sdk.models import dashboard as models

from kvcache_exporter.dashboards.panels import DATASOURCE, DATASOURCE_VARIABLE
from kvcache_exporter.dashboards.promql import Scope

# The Prometheus datasource that the project's Grafana provisioning creates.
PROVISIONED_DATASOURCE_UID = "kvcache-prometheus"

# Where a label's values are listed: every target has kvcache_target_up (whether it answers or
# not), but `model` exists only on per-target series, of which kvcache_usage_ratio is the core one.
VALUES_SOURCE = {"model": "kvcache_usage_ratio"}
DEFAULT_VALUES_SOURCE = "kvcache_target_up"

# "All" matches series that lack the label too (a static label not every target has).
MATCH_ALL = ".*"
# The labels Kubernetes probe mode's relabeling puts on every probed series (deploy/kubernetes/probe.py): where the
# engine pod runs. Elsewhere no series has them, the filters list nothing and All matches everything.
NAMESPACE, POD = "namespace", "pod"


def filtered(*labels: str) -> tuple[str, ...]:
    """The labels in order, each once: a static label may be named like a discovery label."""
    return tuple(dict.fromkeys(labels))


def datasource():
    return (
        builders.DatasourceVariable(DATASOURCE_VARIABLE)
        .label("Data source")
        .type("prometheus")
        .current(models.VariableOption(selected=True, text=PROVISIONED_DATASOURCE_UID,
                                       value=PROVISIONED_DATASOURCE_UID))
    )


def label_filters(labels: tuple[str, ...], single: frozenset[str] = frozenset()) -> list[builders.QueryVariable]:
    """One query variable per label; `single` ones take exactly one value, the rest many or All."""
    variables = []
    for index, label in enumerate(labels):
        upstream = Scope(labels[:index])
        query = f"label_values({upstream.selector(VALUES_SOURCE.get(label, DEFAULT_VALUES_SOURCE))}, {label})"
        variable = (
            builders.QueryVariable(label)
            .label(label)
            .datasource(DATASOURCE)
            .query(query)
            .definition(query)
            .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(models.VariableSort.ALPHABETICAL_ASC)
        )
        if label not in single:
            variable.multi(True).include_all(True).all_value(MATCH_ALL).current(
                models.VariableOption(selected=True, text=["All"], value=["$__all"]))
        variables.append(variable)
    return variables
