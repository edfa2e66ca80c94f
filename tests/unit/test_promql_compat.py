"""What we ship holds on Prometheus 2.42 and 3.x and on Alertmanager 0.25 and 0.33 alike.

Only Debian's Prometheus 2.42 and Alertmanager 0.25 can run here, so Prometheus 3 is represented by
its own PromQL grammar (tests/promql3/, the package its web UI parses with: run with promtool in
tests/integration/test_promql_parsers.py), by a lint for the constructs whose meaning changed (here),
and by its scrape negotiation replayed against the exporter (tests/e2e/test_prometheus3_scrape.py);
Alertmanager 0.33 by the keys of its configuration structs (here).
"""

from __future__ import annotations

import re

import pytest
import yaml

from devtools import harness, promql_compat

EXPRESSIONS = promql_compat.all_expressions()
MIN_WINDOW = promql_compat.shortest_scrape_window_seconds()


def test_every_shipped_expression_is_found():
    sources = {where.split(":")[0] for where, _ in EXPRESSIONS}
    assert {"alerts/kvcache-rules.yml", "deploy/kubernetes/base/prometheusrule.yaml", "kvcache-fleet.json",
            "kvcache-target.json", "alerts/runbook.md"} <= sources
    assert len(EXPRESSIONS) >= 100
    # Four times the 5 s scrape interval of the shipped configurations.
    assert MIN_WINDOW == 20


def test_no_shipped_expression_changes_meaning_on_prometheus3():
    found = [(where, problem) for where, expr in EXPRESSIONS
             for problem in promql_compat.problems(expr, MIN_WINDOW, dashboard=where.endswith(".json"))]
    assert found == []


@pytest.mark.parametrize("expr, problem", [
    ('kvcache_time_to_first_token_seconds_bucket{le="1"}', "exact le match"),
    ('kvcache_summary{quantile!="0.9"}', "exact quantile match"),
    ("rate(kvcache_preemptions_total[15s])", "range [15s] is shorter than 4 scrape intervals (20s)"),
    ("max_over_time(kvcache_usage_ratio[10s:5s])", "range [10s] is shorter"),
    ("holt_winters(kvcache_usage_ratio[10m], 0.5, 0.5)", "holt_winters() was removed"),
    ("limitk(3, kvcache_usage_ratio)", "limitk() needs --enable-feature=promql-experimental-functions"),
    ("sort_by_label(kvcache_usage_ratio, \"target\")", "sort_by_label() needs"),
    ("mad_over_time(kvcache_usage_ratio[1h])", "mad_over_time() needs"),
])
def test_lint_catches_each_construct(expr, problem):
    assert any(problem in found for found in promql_compat.problems(expr, 20))


def test_lint_passes_what_both_generations_agree_on():
    for expr in ('kvcache_time_to_first_token_seconds_bucket{le="+Inf"}',
                 'sum by (le) (rate(kvcache_queue_time_seconds_bucket{target="le=\\"1\\""}[1m]))',
                 "rate(kvcache_preemptions_total[20s])", "predict_linear(kvcache_usage_ratio[30m], 1800)"):
        assert promql_compat.problems(expr, 20) == [], expr
    assert promql_compat.problems("rate(kvcache_preemptions_total[$__interval])", 20, dashboard=True)


@pytest.mark.parametrize("text, seconds", [("20s", 20), ("1m30s", 90), ("1h", 3600), ("500ms", 0.5),
                                           ("$__rate_interval", None), ("5", None)])
def test_duration_seconds(text, seconds):
    assert promql_compat.duration_seconds(text) == seconds


# --- Scrape configuration -------------------------------------------------------------------------------


def test_shipped_scrape_configurations_need_no_fallback_protocol():
    # The exporter always names its format (tests/e2e/test_prometheus3_scrape.py), so no scrape job needs fallback_scrape_protocol,
    # a key Prometheus 2.42 would refuse; a job that sets one must be one that scrapes something else.
    for path in promql_compat.SCRAPE_CONFIGS:
        document = yaml.safe_load(path.read_text())
        for job in document["scrape_configs"]:
            assert "fallback_scrape_protocol" not in job, (path, job["job_name"])


# --- Alertmanager 0.25 and 0.33 ---------------------------------------------------------------------

# Keys of Alertmanager v0.33.0's configuration, read from the yaml tags of its structs (config/config.go,
# config/notifiers.go, config/common/*.go, notify/webhook/config.go) and of prometheus/common v0.67.5's
# HTTPClientConfig for http_config. Only the sections our configuration uses are listed.
ALERTMANAGER_0_33_KEYS = {
    "": {"global", "route", "inhibit_rules", "receivers", "templates", "mute_time_intervals", "time_intervals",
         "tracing", "event_recorder"},
    "global": {"resolve_timeout", "http_config", "jira_api_url", "smtp_from", "smtp_hello", "smtp_smarthost",
               "smtp_auth_username", "smtp_auth_password", "smtp_auth_password_file", "smtp_auth_secret",
               "smtp_auth_secret_file", "smtp_auth_identity", "smtp_require_tls", "smtp_tls_config",
               "smtp_force_implicit_tls", "slack_api_url", "slack_api_url_file", "slack_app_token",
               "slack_app_token_file", "slack_app_url", "pagerduty_url", "opsgenie_api_url", "opsgenie_api_key",
               "opsgenie_api_key_file", "wechat_api_url", "wechat_api_secret", "wechat_api_secret_file",
               "wechat_api_corp_id", "victorops_api_url", "victorops_api_key", "victorops_api_key_file",
               "telegram_api_url", "telegram_bot_token", "telegram_bot_token_file", "webex_api_url",
               "rocketchat_api_url", "rocketchat_token", "rocketchat_token_file", "rocketchat_token_id",
               "rocketchat_token_id_file", "mattermost_webhook_url", "mattermost_webhook_url_file"},
    "route": {"receiver", "group_by", "match", "match_re", "matchers", "mute_time_intervals",
              "active_time_intervals", "continue", "routes", "group_wait", "group_interval", "repeat_interval"},
    "inhibit_rules": {"name", "source_match", "source_match_re", "source_matchers", "target_match",
                      "target_match_re", "target_matchers", "equal"},
    "receivers": {"name", "labels", "discord_configs", "email_configs", "incidentio_configs", "pagerduty_configs",
                  "slack_configs", "webhook_configs", "opsgenie_configs", "wechat_configs", "pushover_configs",
                  "victorops_configs", "sns_configs", "telegram_configs", "webex_configs", "msteams_configs",
                  "msteamsv2_configs", "jira_configs", "rocketchat_configs", "mattermost_configs"},
    "webhook_configs": {"send_resolved", "http_config", "url", "url_file", "max_alerts", "timeout", "payload"},
    "pagerduty_configs": {"send_resolved", "http_config", "service_key", "service_key_file", "routing_key",
                          "routing_key_file", "url", "client", "client_url", "description", "details", "images",
                          "links", "source", "severity", "class", "component", "group", "timeout"},
    "links": {"href", "text"},
    "slack_configs": {"send_resolved", "http_config", "api_url", "api_url_file", "app_token", "app_token_file",
                      "app_url", "channel", "username", "color", "title", "title_link", "pretext", "text",
                      "message_text", "fields", "short_fields", "footer", "fallback", "callback_id", "icon_emoji",
                      "icon_url", "image_url", "thumb_url", "link_names", "mrkdwn_in", "actions", "update_message",
                      "timeout"},
    "email_configs": {"send_resolved", "to", "from", "hello", "smarthost", "auth_username", "auth_password",
                      "auth_password_file", "auth_secret", "auth_secret_file", "auth_identity", "headers", "html",
                      "text", "require_tls", "tls_config", "force_implicit_tls", "threading"},
    "http_config": {"authorization", "basic_auth", "oauth2", "bearer_token", "bearer_token_file", "tls_config",
                    "proxy_url", "no_proxy", "proxy_from_environment", "proxy_connect_header", "follow_redirects",
                    "enable_http2", "http_headers"},
    "authorization": {"type", "credentials", "credentials_file", "credentials_ref"},
}
# A matcher both parsers read alike: 0.25's classic one and the UTF-8 one that 0.27+ use by default
# (double-quoted values; the two disagree on unquoted values with special characters).
MATCHER = r'^[a-zA-Z_][a-zA-Z0-9_]*(=|!=|=~|!~)"(?:[^"\\]|\\.)*"$'
ROUTE_CHILDREN = {"routes": "route"}


def _unknown_keys(node, section: str = "", path: str = "") -> list[str]:
    if isinstance(node, list):
        return [problem for i, item in enumerate(node) for problem in _unknown_keys(item, section, f"{path}[{i}]")]
    if not isinstance(node, dict):
        return []
    allowed = ALERTMANAGER_0_33_KEYS[section]
    problems = [f"{path}.{key}" for key in node if key not in allowed]
    for key, value in node.items():
        child = ROUTE_CHILDREN.get(key, key) if section == "route" else key
        if child in ALERTMANAGER_0_33_KEYS:
            problems += _unknown_keys(value, child, f"{path}.{key}")
    return problems


def test_alertmanager_config_uses_only_keys_that_0_33_knows():
    config = yaml.safe_load((harness.REPO / "alerts" / "alertmanager.yml").read_text())
    assert _unknown_keys(config) == []
    assert _unknown_keys({"route": {"routes": [{"match_typo": {}}]}}) == [".route.routes[0].match_typo"]
    assert _unknown_keys({"receivers": [{"name": "x", "webhook_configs": [{"urls": "y"}]}]}) == \
        [".receivers[0].webhook_configs[0].urls"]


def test_alertmanager_matchers_read_alike_in_both_parsers():
    config = yaml.safe_load((harness.REPO / "alerts" / "alertmanager.yml").read_text())
    matchers = [m for route in config["route"]["routes"] for m in route["matchers"]]
    matchers += [m for rule in config["inhibit_rules"] for key in ("source_matchers", "target_matchers")
                 for m in rule[key]]
    assert len(matchers) >= 6
    assert [m for m in matchers if not re.match(MATCHER, m)] == []
    # None of the deprecated match/match_re forms, which 0.33 still reads but warns about.
    deprecated = {"match", "match_re", "source_match", "source_match_re", "target_match", "target_match_re"}
    routes = [config["route"], *config["route"]["routes"]]
    assert [key for node in routes + config["inhibit_rules"] for key in node if key in deprecated] == []
