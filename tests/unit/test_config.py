"""Configuration: file, flags and environment merged; every mistake is one line and exit code 2."""

from __future__ import annotations

import math
import textwrap

import pytest

from devtools import harness
from kvcache_exporter import config as cfg
from kvcache_exporter import contract
from kvcache_exporter.commands import serve
from kvcache_exporter.runtime import webconfig


def write(tmp_path, text: str):
    path = tmp_path / "exporter.yml"
    path.write_text(textwrap.dedent(text))
    return path


def load(argv: list[str], environ: dict | None = None) -> cfg.Config:
    return cfg.resolve(vars(serve.parser().parse_args(argv)), environ or {})


def test_full_file(tmp_path):
    certs = harness.make_certs(tmp_path)
    (tmp_path / "token").write_text("s3cret\n")
    path = write(tmp_path, f"""
        poll_interval: 2s
        timeout: 1500ms
        staleness: 1m
        max_response_bytes: 4MiB
        labels: {{cluster: prod}}
        pressure: {{high_water_ratio: 0.8}}
        targets:
          - url: http://10.0.0.1:8000/metrics
          - name: sg-0
            url: https://10.0.0.2:30000/metrics
            engine: sglang
            labels: {{pool: chat}}
            bearer_token_file: {tmp_path / "token"}
            ca_file: {certs.ca}
    """)
    config = load(["--config", str(path)])
    assert (config.poll_interval, config.timeout, config.staleness) == (2.0, 1.5, 60.0)
    assert config.max_response_bytes == 4 * 2**20
    assert config.labels == {"cluster": "prod"}
    assert config.thresholds.high_water_ratio == 0.8
    first, second = config.targets
    assert (first.name, first.engine) == ("10.0.0.1:8000", "auto")
    assert (second.name, second.engine, second.labels) == ("sg-0", "sglang", {"pool": "chat"})
    assert (second.bearer_token_file, second.ca_file) == (str(tmp_path / "token"), str(certs.ca))
    assert second.ca_pem == certs.ca.read_text()  # read once, at load: the fetcher never opens the file


def test_relative_file_paths_are_taken_from_the_configuration_files_directory(tmp_path, monkeypatch):
    """As Prometheus reads its own file paths: the same files whatever directory the exporter starts in."""
    here = tmp_path / "etc"
    here.mkdir()
    certs = harness.make_certs(here)
    (here / "token").write_text("s3cret\n")
    (here / "password").write_text("pa55\n")
    path = write(here, f"""
        targets:
          - url: https://10.0.0.2:30000/metrics
            bearer_token_file: token
            ca_file: {certs.ca.name}
          - url: http://10.0.0.3:30000/metrics
            basic_auth: {{username: u, password_file: password}}
    """)
    (here / "web.yml").write_text(f"tls_server_config: {{cert_file: {certs.server_cert.name}, "
                                  f"key_file: {certs.server_key.name}}}\n")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    token, password = load(["--config", str(path)]).targets
    assert (token.bearer_token_file, token.ca_file) == (str(here / "token"), str(certs.ca))
    assert token.ca_pem == certs.ca.read_text()
    assert password.basic_auth_password_file == str(here / "password")
    assert isinstance(webconfig.load(str(here / "web.yml")), webconfig.WebConfig)
    (here / "token").unlink()  # and a relative path is not looked for in the working directory
    (elsewhere / "token").write_text("other\n")
    with pytest.raises(cfg.ConfigError, match=f"targets\\[0\\].bearer_token_file: .*{here / 'token'}"):
        load(["--config", str(path)])


def test_model_architecture_gives_bytes_per_token(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,'
        ' "torch_dtype": "bfloat16"}')
    path = write(tmp_path, """
        targets:
          - url: http://a:1/metrics
            model_architecture: {layers: 32, kv_heads: 8, head_dim: 128, kv_cache_dtype: fp8}
          - url: http://b:1/metrics
            model_architecture: {config_json: config.json}
    """)
    numbers, from_file = load(["--config", str(path)]).targets
    assert numbers.kv_layout.bytes_per_token() == 65536  # 2 x 32 x 8 x 128 x 1 byte
    assert from_file.kv_layout.bytes_per_token() == 131072  # the same model in BF16, relative path


def test_kv_events_one_endpoint_per_dp_rank(tmp_path):
    path = write(tmp_path, """
        targets:
          - url: http://a:1/metrics
            kv_events: {endpoint: "tcp://10.0.0.1:5557", replay_endpoint: "tcp://10.0.0.1:6557", dp_ranks: 3,
                        topic: kv@a@m, max_message_bytes: 1MiB, top_holders: 3}
    """)
    events = load(["--config", str(path)]).targets[0].kv_events
    assert events.endpoints() == [(0, "tcp://10.0.0.1:5557", "tcp://10.0.0.1:6557"),
                                  (1, "tcp://10.0.0.1:5558", "tcp://10.0.0.1:6558"),
                                  (2, "tcp://10.0.0.1:5559", "tcp://10.0.0.1:6559")]
    assert (events.topic, events.max_message_bytes, events.top_holders) == ("kv@a@m", 2**20, 3)


def test_defaults_from_targets_alone():
    config = load(["--target", "http://a:8000/metrics", "--target", "http://b:8000/metrics"])
    assert [t.name for t in config.targets] == ["a:8000", "b:8000"]
    assert (config.poll_interval, config.timeout, config.staleness) == (5.0, 4.0, 15.0)
    assert config.listen == "0.0.0.0:10490"
    assert config.max_response_bytes == 16 * 2**20


def test_default_names_keep_engines_behind_one_address_apart():
    config = load(["--target", "http://gw:80/engine-a/metrics", "--target", "http://gw:80/engine-b/metrics",
                   "--target", "http://trt:8000/prometheus/metrics", "--target", "http://v:8000/metrics/",
                   "--target", "http://s:30000"])
    assert [t.name for t in config.targets] == ["gw:80/engine-a/metrics", "gw:80/engine-b/metrics",
                                                "trt:8000/prometheus/metrics", "v:8000", "s:30000"]


def test_flags_beat_environment_which_beats_the_file(tmp_path):
    path = write(tmp_path, "poll_interval: 10s\nlisten: 127.0.0.1:1\ntargets: [{url: 'http://f:1/metrics'}]\n")
    environ = {"KVCACHE_EXPORTER_CONFIG": str(path), "KVCACHE_EXPORTER_POLL_INTERVAL": "3s",
               "KVCACHE_EXPORTER_TARGETS": "http://e1:1/metrics, http://e2:1/metrics",
               "KVCACHE_EXPORTER_LISTEN": "127.0.0.1:2"}
    config = load(["--listen", "127.0.0.1:3"], environ)
    assert config.poll_interval == 3.0
    assert config.listen == "127.0.0.1:3"
    assert [t.name for t in config.targets] == ["f:1", "e1:1", "e2:1"]


def test_resolve_takes_plain_values_and_absent_settings_keep_the_file_or_the_default(tmp_path):
    """As `top` calls it: only --config and --target, no environment."""
    path = write(tmp_path, "poll_interval: 10s\ntargets: [{url: 'http://f:1/metrics'}]\n")
    config = cfg.resolve({"config": str(path), "target": ["http://t:1/metrics"]}, {})
    assert [t.name for t in config.targets] == ["f:1", "t:1"]
    assert (config.poll_interval, config.timeout, config.listen) == (10.0, 8.0, "0.0.0.0:10490")


def test_listen_origin_names_where_the_address_came_from(tmp_path):
    path = str(write(tmp_path, "listen: 127.0.0.1:1\n"))
    environ = {"KVCACHE_EXPORTER_LISTEN": "127.0.0.1:2"}
    assert cfg.listen_origin({}, {}) == ("default", "--web.listen-address")
    assert cfg.listen_origin({"config": path}, {}) == (path, "listen")
    assert cfg.listen_origin({"config": path}, environ) == ("environment", "KVCACHE_EXPORTER_LISTEN")
    assert cfg.listen_origin({"config": path, "listen": "127.0.0.1:3"}, environ) == ("command line",
                                                                                      "--web.listen-address")
    typed = {"config": path, "listen": "127.0.0.1:3", cfg.TYPED: {"listen": "--listen"}}
    assert cfg.listen_origin(typed, environ) == ("command line", "--listen")


@pytest.mark.parametrize("text, key, problem", [
    ("targets: [{url: 'http://a:1/m'}, {url: 'ftp://b'}]", "targets[1].url", "http:// or https:// URL"),
    ("poll_interval: 5 parsecs", "poll_interval", "not a positive duration"),
    ("poll_interval: 2s\ntimeout: 3s", "timeout", "must be below poll_interval"),
    ("poll_interval: 5ms", "poll_interval", "must be at least 100ms (the default is 5s), got '5ms'"),
    ("staleness: 1s", "staleness", "at least poll_interval"),
    ("targets: [{url: 'http://a:1/m', engine: tgi}]", "targets[0].engine", "one of auto, dynamo, lmcache, lmdeploy, sglang, triton, trtllm, vllm"),
    ("targets: [{url: 'http://a:1/m', labels: {target: x}}]", "targets[0].labels", "set by the exporter"),
    ("targets: [{url: 'http://a:1/m', labels: {'bad-name': x}}]", "targets[0].labels", "invalid label name"),
    ("targets: [{url: 'http://a:1/m'}, {url: 'http://a:1/m'}]", "targets", "used twice"),
    ("targets: [{url: 'http://a:1/m', bogus: 1}]", "targets[0].bogus", "unknown key"),
    ("targets: [{name: x}]", "targets[0].url", "is required"),
    ("pressure: {high_water: 0.9}", "pressure.high_water", "unknown key"),
    ("pressure: {high_water_ratio: high}", "pressure.high_water_ratio", "must be a float, got 'high'"),
    ("max_response_bytes: lots", "max_response_bytes", "not a positive size"),
    ("targets: {url: x}", "targets", "must be a list"),
    ("targets: [{url: 'http://a:1/m', bearer_token: s3cret}]", "targets[0].bearer_token",
     "put the token in a file and set bearer_token_file"),
    ("targets: [{url: 'http://a:1/m', basic_auth: {username: u, password: s3cret}}]",
     "targets[0].basic_auth.password", "put the password in a file"),
    ("targets: [{url: 'http://a:1/m', basic_auth: {username: u}}]", "targets[0].basic_auth",
     "needs both username and password_file"),
    ("targets: [{url: 'http://a:1/m', tls_insecure_skip_verify: 'yes'}]", "targets[0].tls_insecure_skip_verify",
     "must be true or false"),
    ("targets: [{url: 'http://a:1/m', model_architecture: {layers: 32, kv_heads: 8}}]",
     "targets[0].model_architecture.head_dim", ""),
    ("targets: [{url: 'http://a:1/m', model_architecture: {config_json: missing.json}}]",
     "targets[0].model_architecture.config_json", "missing.json"),
    ("targets: [\n  {url: 'http://a:1/m'\n", "line 3", "invalid YAML"),
    ("targets: [{url: 'http://u:pw@a:1/m'}]", "targets[0].url",
     "must not carry credentials ('http://***@a:1/m'): set basic_auth.username and put the password in a file"),
    ("targets: [{url: 'http://a:70000/m'}]", "targets[0].url", "is not a valid URL (bad host or port)"),
    ("probe: {enabled: true}", "probe.allow", "is required with probe.enabled"),
    ("probe: {enabled: yes please}", "probe.enabled", "must be true or false"),
    ("probe: {enabled: true, allow: [10.0.0.0/8, 'bad host!']}", "probe.allow", "not a host pattern"),
    ("probe: {enabled: true, allow: '*'}", "probe.allow", "must be a list"),
    ("probe: {enabled: true, allow: ['*'], max_targets: 0}", "probe.max_targets", "positive whole number"),
    ("probe: {enable: true}", "probe.enable", "unknown key"),
    ("targets: [{url: 'http://a:1/m', kv_events: {topic: kv}}]", "targets[0].kv_events.endpoint", "is required"),
    ("targets: [{url: 'http://a:1/m', kv_events: {endpoint: 'tcp://*:5557'}}]", "targets[0].kv_events.endpoint",
     "must be tcp://HOST:PORT (the engine's address, not tcp://*)"),
    ("targets: [{url: 'http://a:1/m', kv_events: {endpoint: 'tcp://a:5557', replay_endpoint: 'a:5558'}}]",
     "targets[0].kv_events.replay_endpoint", "must be tcp://HOST:PORT"),
    ("targets: [{url: 'http://a:1/m', kv_events: {endpoint: 'tcp://a:5557', dp_ranks: 0}}]",
     "targets[0].kv_events.dp_ranks", "positive whole number"),
    ("targets: [{url: 'http://a:1/m', kv_events: {endpoint: 'tcp://a:65535', dp_ranks: 2}}]",
     "targets[0].kv_events.endpoint", "port plus dp_ranks - 1 (1) is above 65535"),
    ("targets: [{url: 'http://a:1/m', kv_events: {endpoint: 'tcp://a:5557', topic: 7}}]",
     "targets[0].kv_events.topic", "must be a string"),
    ("targets: [{url: 'http://a:1/m', kv_events: {endpoint: 'tcp://a:5557', top_holders: 0}}]",
     "targets[0].kv_events.top_holders", "must be a positive whole number, got 0"),
    ("targets: [{url: 'http://a:1/m', kv_events: {endpoint: 'tcp://a:5557', hwm: 7}}]",
     "targets[0].kv_events.hwm", "unknown key"),
    ("targets: [{url: 'http://a:1/m', role: consumer}]", "targets[0].role",
     "must be one of prefill, decode, unified, got 'consumer'"),
    ("targets: [{url: 'http://a:1/m', labels: {role: decode}}]", "targets[0].labels", "set by the exporter"),
    # the offload, hit-source and holder families' own labels, which a static label would overwrite
    ("targets: [{url: 'http://a:1/m', labels: {tier: ssd}}]", "targets[0].labels", "set by the exporter"),
    ("labels: {source: dc1}\ntargets: [{url: 'http://a:1/m'}]", "labels", "set by the exporter"),
    ("targets: [{url: 'http://a:1/m', labels: {tenant: acme}}]", "targets[0].labels", "set by the exporter"),
    ("workers: 0", "workers", "must be a positive whole number, got 0"),
    ("workers: 65", "workers", "must be at most 64, got 65"),
    ("workers: two", "workers", "must be a positive whole number, got 'two'"),
    ("shard: 4/4", "shard", "INDEX counts from 0 and must be below COUNT, got '4/4'"),
    ("shard: 0/0", "shard", "COUNT must be at least 1, got '0/0'"),
    ("shard: 2", "shard", "must be INDEX/COUNT, e.g. 0/4 for the first of four replicas, got 2"),
    ("shard: -1/4", "shard", "must be INDEX/COUNT, e.g. 0/4 for the first of four replicas, got '-1/4'"),
    ("labels: {cluster: a}\npd_group_label: deployment", "pd_group_label",
     "must be 'model' or 'cluster' (the model, or a static label of the configuration), got 'deployment'"),
    ("poll_interval: .inf", "poll_interval", "not a positive duration (e.g. 5s, 500ms, 1m): inf"),
    ("staleness: .inf", "staleness", "not a positive duration"),
    ("listen: 10490", "listen", "expected HOST:PORT, got 10490"),
    ("pressure: {high_water_ratio: 1.5}", "pressure.high_water_ratio", "must be a share from 0 to 1, got 1.5"),
    ("pressure: {thrashing_preemptions_per_second: -1}", "pressure.thrashing_preemptions_per_second",
     "must be a finite number at least 0, got -1"),
    ("pressure: {window_seconds: .nan}", "pressure.window_seconds", "must be a finite number above 0, got nan"),
    ("pressure: {window_seconds: 0}", "pressure.window_seconds", "must be a finite number above 0, got 0"),
    ("pressure: {shortage_for: 2.5m}", "pressure.shortage_for",
     "must be a positive Prometheus duration (e.g. 2m, 1h30m), got '2.5m'"),
    ("pressure: {low_water_ratio: 0.95}", "pressure.low_water_ratio",
     "low_water_ratio (0.95) must be below high_water_ratio (0.9)"),
    ("pressure: {high_water_ratio: 0.7}", "pressure.high_water_ratio",
     "low_water_ratio (0.75) must be below high_water_ratio (0.7)"),
    ("targets: [{url: 'http://a:1/m', model_architecture: {0: 32}}]", "targets[0].model_architecture.0",
     "unknown key"),
    ("'': 1", "''", "unknown key"),
    ("latency_buckets: some", "latency_buckets", "must be a mapping"),
    ("families: {exporter: false}", "families.exporter",
     "unknown key (known: events, latency, offload, pool, pressure, transfer)"),
    ("families: {latency: 'no'}", "families.latency", "must be true or false, got 'no'"),
    ("families: [latency]", "families", "must be a mapping"),
    ("latency_buckets: {ttft: all}", "latency_buckets.ttft", "unknown key (known: e2e_request_latency_seconds,"),
    ("latency_buckets: {queue_time_seconds: []}", "latency_buckets.queue_time_seconds",
     "must be 'all' or a list of bucket bounds in seconds"),
    ("latency_buckets: {queue_time_seconds: [1, 2s]}", "latency_buckets.queue_time_seconds",
     "a bucket bound must be a finite number of seconds, at least 0 (+Inf is always kept), got '2s'"),
    ("latency_buckets: {queue_time_seconds: [-1]}", "latency_buckets.queue_time_seconds", "got -1"),
    ("latency_buckets: {queue_time_seconds: [.inf]}", "latency_buckets.queue_time_seconds", "got inf"),
    ('"a\\nb": 1', "'a\\nb'", "unknown key"),  # a key with a line break, shown on one line
])
def test_bad_files_name_file_key_and_problem(tmp_path, text, key, problem):
    path = write(tmp_path, text)
    with pytest.raises(cfg.ConfigError) as err:
        load(["--config", str(path)])
    message = str(err.value)
    assert message.startswith(f"{path}: {key}: "), message
    assert problem in message


def test_a_targets_role_and_the_pd_group_label(tmp_path):
    """A role where the page names none; pools grouped across roles by a static label the configuration sets."""
    path = write(tmp_path, "targets: [{url: 'http://p:1/metrics', role: prefill, labels: {pair: a}},\n"
                           "          {url: 'http://d:1/metrics', labels: {pair: a}}]\npd_group_label: pair")
    config = load(["--config", str(path)])
    assert [t.role for t in config.targets] == ["prefill", None]
    assert config.pd_group_label == "pair"
    assert cfg.generator_settings(str(path)).pd_group_label == "pair"
    assert cfg.generator_settings(str(write(tmp_path, "targets: []"))).pd_group_label == "model"


def test_latency_buckets_keep_all_or_name_others(tmp_path):
    """Not given: the contract's default set. `all`: every bound of every histogram (none named). A histogram named
    keeps the bounds listed and +Inf; the others keep their defaults."""
    inf = math.inf
    assert load(["--config", str(write(tmp_path, "targets: []"))]).latency_buckets == {
        name: frozenset((*bounds, inf)) for name, bounds in contract.DEFAULT_LATENCY_BUCKETS.items()}
    assert load(["--config", str(write(tmp_path, "latency_buckets: all"))]).latency_buckets == {}
    chosen = load(["--config", str(write(tmp_path, "latency_buckets: {time_to_first_token_seconds: [0.5, 2],\n"
                                                   "                  queue_time_seconds: all}"))]).latency_buckets
    assert chosen["time_to_first_token_seconds"] == {0.5, 2, inf}
    assert "queue_time_seconds" not in chosen
    assert chosen["e2e_request_latency_seconds"] == {*contract.DEFAULT_LATENCY_BUCKETS["e2e_request_latency_seconds"],
                                                     inf}


def test_a_pressure_key_without_a_value_keeps_its_default(tmp_path):
    assert load(["--config", str(write(tmp_path, "pressure: {high_water_ratio: null, shortage_for: 5m}"))]
                ).thresholds == cfg.Thresholds(shortage_for="5m")


def test_missing_file(tmp_path):
    with pytest.raises(cfg.ConfigError, match=r"nope.yml: \(file\): No such file"):
        load(["--config", str(tmp_path / "nope.yml")])


@pytest.mark.parametrize("text", [
    # nine levels of nine aliases: 9**9 = 387,420,489 values, in ten short lines
    "".join(f"l{level}: &l{level} [{', '.join([f'*l{level - 1}' if level else 'x'] * 9)}]\n" for level in range(10)),
    "targets: &self [*self]\n",  # an alias to itself: never ends
])
def test_a_document_whose_aliases_expand_past_a_million_values_is_one_line(tmp_path, text):
    """Every check and message would walk the expansion (a message quoting it was 226 MB at eight levels)."""
    path = write(tmp_path, text)
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load_file(str(path))
    assert str(err.value) == f"{path}: (file): holds over 1,000,000 values once its YAML aliases are expanded"


def test_the_values_are_counted_to_the_limit_and_no_further(tmp_path, monkeypatch):
    monkeypatch.setattr(cfg, "MAX_DOCUMENT_VALUES", 100)
    path = write(tmp_path, "x: &x [%s]\ntargets: *x\n" % ", ".join(["a"] * 47))  # 1 + 2 keys + 2 x (1 + 47) = 99
    assert cfg.read_yaml(str(path))["targets"] == ["a"] * 47
    path = write(tmp_path, "x: &x [%s]\ntargets: *x\n" % ", ".join(["a"] * 48))  # 101: the alias counts again
    with pytest.raises(cfg.ConfigError, match=r"\(file\): holds over 100 values once its YAML aliases"):
        cfg.read_yaml(str(path))


def test_a_quoted_value_is_cut_to_keep_the_line_short(tmp_path):
    path = write(tmp_path, "poll_interval: [%s]\n" % ", ".join(["'ten chars!'"] * 1000))
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load_file(str(path))
    problem = str(err.value).removeprefix(f"{path}: poll_interval: ")
    assert problem.startswith("not a positive duration (e.g. 5s, 500ms, 1m): [")
    assert len(problem) == cfg.MAX_PROBLEM_CHARS + 3 and problem.endswith("...")


def test_shard_from_the_file_the_environment_and_the_command_line(tmp_path):
    path = write(tmp_path, "shard: 1/4\ntargets: [{url: 'http://f:1/metrics'}]\n")
    assert load(["--config", str(path)]).shard == (1, 4)
    assert load(["--config", str(path)], {"KVCACHE_EXPORTER_SHARD": "2/4"}).shard == (2, 4)
    assert load(["--config", str(path), "--shard", " 3/4"], {"KVCACHE_EXPORTER_SHARD": "2/4"}).shard == (3, 4)
    assert load(["--target", "http://a:1/m"]).shard == (0, 1)
    with pytest.raises(cfg.ConfigError, match="^environment: KVCACHE_EXPORTER_SHARD: INDEX counts from 0 and must "
                                              "be below COUNT, got '3/3'$"):
        load(["--target", "http://a:1/m"], {"KVCACHE_EXPORTER_SHARD": "3/3"})


def test_workers_from_the_file_the_environment_and_the_command_line(tmp_path):
    path = write(tmp_path, "workers: 2\ntargets: [{url: 'http://f:1/metrics'}]\n")
    assert load(["--config", str(path)]).workers == 2
    assert load(["--config", str(path)], {"KVCACHE_EXPORTER_WORKERS": "3"}).workers == 3
    assert load(["--config", str(path), "--workers", "4"], {"KVCACHE_EXPORTER_WORKERS": "3"}).workers == 4
    assert load(["--target", "http://a:1/m"]).workers == 1
    with pytest.raises(cfg.ConfigError, match="^command line: --workers: must be a positive whole number, got '-1'$"):
        load(["--target", "http://a:1/m", "--workers", "-1"])


def test_bad_environment_value_names_the_variable():
    with pytest.raises(cfg.ConfigError, match="^environment: KVCACHE_EXPORTER_POLL_INTERVAL: not a positive"):
        load(["--target", "http://a:1/m"], {"KVCACHE_EXPORTER_POLL_INTERVAL": "soon"})


def test_a_command_line_target_named_like_a_file_target_says_to_name_both_in_the_file(tmp_path):
    path = write(tmp_path, "targets: [{url: 'http://a:1/metrics'}]\n")
    with pytest.raises(cfg.ConfigError) as err:
        load(["--config", str(path)], {"KVCACHE_EXPORTER_TARGETS": "http://a:1/"})
    assert str(err.value) == (f"environment: KVCACHE_EXPORTER_TARGETS: http://a:1/ would be named 'a:1' "
                              f"like target 'a:1' of {path}: to poll both, list them in a configuration "
                              "file (--config.file), each with its own `name`")


def test_the_poll_interval_floor_is_allowed():
    assert load(["--target", "http://a:1/m", "--poll-interval", "100ms"]).poll_interval == cfg.MIN_POLL_INTERVAL
