"""Any configuration (and web configuration), however broken, loads as a Config whose parts can all be built, or fails as one ConfigError
line naming the file and the key: never another exception. Hypothesis mutates a valid configuration (keys
removed, added, re-typed, nested; values out of range; the files it names missing, not regular, empty, not UTF-8,
of the wrong format; the YAML text cut) and loads it as the exporter does at start and at a reload."""

from __future__ import annotations

import math
import os
from pathlib import Path

import bcrypt
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from devtools import harness
from kvcache_exporter import config as cfg
from kvcache_exporter.runtime import shard, webconfig
from kvcache_exporter.runtime.app import Exporter
from kvcache_exporter.runtime.target import new_target

LLAMA_8B = ('{"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,'
            ' "torch_dtype": "bfloat16"}')
# What a file a configuration names may turn out to be, by name; made once in the module's directory.
BAD_FILES = ("missing", "directory", "fifo", "dangling-link", "empty", "blank", "not-utf8", "two-lines", "not-pem",
             "private-key", "not-json", "json-list", "json-without-layers")
FILE_KEYS = ("ca_file", "bearer_token_file", "password_file", "config_json", "cert_file", "key_file",
             "client_ca_file")
# Keys whose error a change elsewhere may cause (mutated key -> keys checked against it).
CROSS_KEYS = {"poll_interval": ("timeout", "staleness"), "labels": ("pd_group_label",),
              "probe": ("probe.allow",), "targets": ("targets", "pd_group_label")}
BAD_TEXTS = ("", " ", "0", "-1", "0s", "1ms", "5 parsecs", "1e400", ".inf", "nan", "lots", "yes", "auto", "tcp://*:1",
             "tcp://a:0", "http://", "ftp://x/m", "http://u:p@a:1/m", "http://a:99999/m", "10.0.0.0/33", "1/0", "4/4",
             "-1/4", "a\nb", "__name__", "bad-label", "target", "TLS9", "info\n", "\x00", "√")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Good files for the base configuration, and one file of each BAD_FILES kind."""
    directory = tmp_path_factory.mktemp("named-files")
    certs = harness.make_certs(directory)
    good = {"ca": certs.ca, "cert": certs.server_cert, "key": certs.server_key, "token": directory / "token",
            "password": directory / "password", "config_json": directory / "config.json"}
    good["token"].write_text("t0ken\n")
    good["password"].write_text("pa55word")
    good["config_json"].write_text(LLAMA_8B)
    bad = directory / "bad"
    bad.mkdir()
    (bad / "directory").mkdir()
    os.mkfifo(bad / "fifo")  # opened for reading, it would block until a writer comes
    (bad / "dangling-link").symlink_to(bad / "nowhere")
    for name, content in (("empty", b""), ("blank", b" \n\n"), ("not-utf8", b"\xff\xfe\x00tok"),
                          ("two-lines", b"line one\nline two\n"), ("not-pem", b"not a certificate\n"),
                          ("private-key", certs.client_key.read_bytes()), ("not-json", b"{layers: 32"),
                          ("json-list", b"[32, 8, 128]"), ("json-without-layers", b'{"hidden_size": 4096}')):
        (bad / name).write_bytes(content)
    return {name: str(path) for name, path in {**good, **{name: bad / name for name in BAD_FILES}}.items()}


def base(files: dict[str, str]) -> dict:
    """A valid configuration using every key of the file, and every kind of file it may name."""
    return {
        "poll_interval": "2s", "timeout": "1s", "staleness": "10s", "max_response_bytes": "4MiB",
        "labels": {"cluster": "prod"}, "pressure": {"high_water_ratio": 0.9, "thrashing_preemptions_per_second": 0.02, "shortage_for": "2m"},
        "pd_group_label": "cluster", "listen": "127.0.0.1:10490", "log_level": "info", "workers": 1, "shard": "0/1",
        "probe": {"enabled": True, "allow": ["10.0.0.0/8", "*.svc.cluster.local"], "max_targets": 10},
        "targets": [
            {"name": "plain", "url": "http://10.0.0.1:8000/metrics", "engine": "vllm", "labels": {"pool": "chat"},
             "role": "decode", "model": "meta-llama/Llama-3.1-8B"},
            {"name": "tls", "url": "https://10.0.0.2:30000/metrics", "engine": "sglang", "ca_file": files["ca"],
             "bearer_token_file": files["token"],
             "kv_events": {"endpoint": "tcp://10.0.0.2:5557", "replay_endpoint": "tcp://10.0.0.2:6557",
                           "dp_ranks": 2, "topic": "kv", "max_message_bytes": "1MiB", "top_holders": 3}},
            {"url": "https://10.0.0.3/metrics", "basic_auth": {"username": "u", "password_file": files["password"]},
             "tls_insecure_skip_verify": True, "model_architecture": {"config_json": files["config_json"]}},
            {"url": "http://10.0.0.4:8000/metrics",
             "model_architecture": {"layers": 32, "kv_heads": 8, "head_dim": 128, "kv_cache_dtype": "fp8"}},
        ],
    }


def web_base(files: dict[str, str]) -> dict:
    """A valid web configuration (--web.config.file) using every key it may have."""
    return {
        "tls_server_config": {"cert_file": files["cert"], "key_file": files["key"], "client_ca_file": files["ca"],
                              "client_auth_type": "RequireAndVerifyClientCert", "min_version": "TLS12",
                              "max_version": "TLS13"},
        "basic_auth_users": {"prometheus": bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()},
        "http_server_config": {"http2": False, "headers": {"X-Frame-Options": "deny"}},
    }


def key_paths(node, path: tuple = ()) -> list[tuple]:
    """Every key path of a document, ("targets", 1, "ca_file") for targets[1].ca_file; () is the whole of it."""
    paths = [path]
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        paths += key_paths(child, (*path, key))
    return paths


def key_text(path: tuple) -> str:
    """A key path as a ConfigError names it: targets[1].basic_auth.password_file."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text.replace("\r", "\\r").replace("\n", "\\n")


def related(error_key: str, mutated: tuple) -> bool:
    """Whether an error's key names the mutated key: itself, a key above or below it, a key beside it in its
    mapping, or a key a rule checks it against."""
    if not mutated:
        return True
    text, parent = key_text(mutated), key_text(mutated[:-1])
    return (error_key == text or error_key.startswith((text + ".", text + "["))
            or text.startswith((error_key + ".", error_key + "["))
            or (len(mutated) > 1 and error_key.startswith((parent + ".", parent + "[")))
            or error_key in CROSS_KEYS.get(str(mutated[0]), ()))


scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**20), st.floats(allow_nan=True),
                    st.sampled_from(BAD_TEXTS), st.text(max_size=12), st.dates(), st.binary(max_size=4))
# A key name that no mapping knows: a number, or any characters but ":", which would end the key in the error's line.
unknown_keys = st.one_of(st.integers(0, 3), st.booleans(),
                         st.text(st.characters(blacklist_characters=":", blacklist_categories=("Cs",)), max_size=10))
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(unknown_keys, scalars, max_size=3))


@st.composite
def mutations(draw, document: dict) -> tuple[str, tuple, object]:
    """(kind, key path, argument) of one change to the document."""
    paths = key_paths(document)
    kind = draw(st.sampled_from(("delete", "replace", "unknown", "nest", "file", "file")))
    if kind == "file":
        file_paths = [p for p in paths if p and p[-1] in FILE_KEYS]
        return kind, draw(st.sampled_from(file_paths)), draw(st.sampled_from(BAD_FILES))
    if kind == "unknown":
        mapping_paths = [p for p in paths if isinstance(_at(document, p), dict)]
        return kind, draw(st.sampled_from(mapping_paths)), draw(unknown_keys)
    return kind, draw(st.sampled_from(paths)), draw(values) if kind == "replace" else draw(st.booleans())


def _at(document, path: tuple):
    for part in path:
        document = document[part]
    return document


def apply(document, mutation: tuple, files: dict[str, str]):
    """The document changed by one mutation (in place, or a new one for the top level); a path an earlier
    mutation removed or re-typed is left as it is."""
    kind, path, argument = mutation
    holder = {"": document}  # the top level's parent
    try:
        parent = _at(document, path[:-1]) if path else holder
        key = path[-1] if path else ""
        if not isinstance(parent, (dict, list)):
            return document
        current = parent[key]
    except (KeyError, IndexError, TypeError):
        return document
    if kind == "delete":
        del parent[key]
    elif kind == "unknown":
        if isinstance(current, dict):
            current[argument] = 1
    else:
        parent[key] = {"replace": lambda: argument, "file": lambda: files[argument],
                       "nest": lambda: [current] if argument else {"value": current}}[kind]()
    return holder.get("")


def write_mutated(data: st.DataObject, document: dict, files: dict[str, str], path: Path) -> list[tuple]:
    """Write the document with one to three mutations drawn from `data` to `path`; the mutations."""
    mutated = data.draw(st.lists(mutations(document), min_size=1, max_size=3))
    for mutation in mutated:
        document = apply(document, mutation, files)
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    return mutated


def text_cut(text: str, at: float, insert: str) -> str:
    position = int(len(text) * at)
    return text[:position] + insert + text[position:]


@pytest.fixture(scope="module")
def running(files, tmp_path_factory):
    """An exporter (never started: nothing polled or bound) whose configuration file the examples rewrite."""
    path = tmp_path_factory.mktemp("reloaded") / "exporter.yml"
    path.write_text(yaml.safe_dump(base(files)))
    exporter = Exporter(cfg.resolve({"config": str(path)}, {}),
                        lambda: (cfg.resolve({"config": str(path)}, {}), None))
    yield exporter, path
    exporter.stop()


def assert_names_file_and_key(err: cfg.ConfigError, path: Path, mutated: list[tuple] | None) -> None:
    message = str(err)
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith(f"{path}: "), message
    key, sep, problem = message[len(f"{path}: "):].partition(": ")
    assert key and sep and problem, message
    assert mutated is None or any(related(key, path) for _, path, _ in mutated), (message, mutated)


def check_load(path: Path, mutated: list[tuple] | None) -> cfg.Config | None:
    """Load the file as the exporter does at start: a Config whose targets can all be built, or one ConfigError
    line naming the file and a key related to a mutated one (mutated None: the text was cut, any key)."""
    try:
        config = cfg.resolve({"config": str(path)}, {})
    except cfg.ConfigError as err:
        assert_names_file_and_key(err, path, mutated)
        return None
    numbers = [config.poll_interval, config.timeout, config.staleness,
               *(value for value in vars(config.thresholds).values() if isinstance(value, float))]
    assert all(math.isfinite(number) and number >= 0 for number in numbers), config
    for target in config.targets:  # what start and a reload build: never fails on a loaded configuration
        new_target(target, config).fetcher.close()
    return config


@settings(max_examples=300, deadline=None, derandomize=True,  # the same examples every run: no CI luck
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_configuration_loads_or_is_one_line_naming_file_and_key(files, running, tmp_path, data):
    path = tmp_path / "exporter.yml"
    mutated = write_mutated(data, base(files), files, path)
    loaded = check_load(path, mutated)

    exporter, reloaded = running  # the same file at a reload: kept running configuration and a 0 gauge, or applied
    reloaded.write_text(path.read_text())
    before = exporter.config
    ok, message = exporter.reload()
    assert ok == (loaded is not None) == exporter.state.reload_ok, message
    if not ok:
        assert message.startswith(f"reload failed: {reloaded}: ") and exporter.config is before, message


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.floats(0, 1), insert=st.sampled_from(("", "[", "{", ":", "- ", "\t", "'", "&a", "*b", "!!python/none",
                                                   "\n  x", "\x07", "\ufeff")))
def test_a_cut_or_spliced_text_loads_or_is_one_line(files, tmp_path, at, insert):
    path = tmp_path / "exporter.yml"
    path.write_text(text_cut(yaml.safe_dump(base(files)), at, insert))
    check_load(path, None)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_web_configuration_loads_or_is_one_line_naming_file_and_key(files, tmp_path, data):
    path = tmp_path / "web.yml"
    mutated = write_mutated(data, web_base(files), files, path)
    try:
        assert isinstance(webconfig.load(str(path)), webconfig.WebConfig)
    except cfg.ConfigError as err:
        assert_names_file_and_key(err, path, mutated)


def test_every_bad_file_kind_is_refused_under_each_key_that_names_a_file(files, tmp_path):
    """The mutations' files, each under every key that names a file: none loads (exists, regular, readable,
    UTF-8, one line for a credential, a PEM certificate for a CA, a config.json for an architecture)."""
    refused = {key: [] for key in FILE_KEYS}
    for path in key_paths(base(files)):
        if not path or path[-1] not in FILE_KEYS:
            continue
        for kind in BAD_FILES:
            document = apply(base(files), ("file", path, kind), files)
            (tmp_path / "exporter.yml").write_text(yaml.safe_dump(document))
            if check_load(tmp_path / "exporter.yml", [("file", path, kind)]) is None:
                refused[path[-1]].append(kind)
    for path in key_paths(web_base(files)):
        if not path or path[-1] not in FILE_KEYS:
            continue
        for kind in BAD_FILES:
            (tmp_path / "web.yml").write_text(yaml.safe_dump(apply(web_base(files), ("file", path, kind), files)))
            try:
                webconfig.load(str(tmp_path / "web.yml"))
            except cfg.ConfigError as err:
                assert_names_file_and_key(err, tmp_path / "web.yml", [("file", path, kind)])
                refused[path[-1]].append(kind)
    # a token or a password is any one line of text, JSON or not; every other file has a format
    assert refused == {
        "ca_file": list(BAD_FILES),
        "bearer_token_file": [k for k in BAD_FILES if k not in ("not-pem", "not-json", "json-list",
                                                                "json-without-layers")],
        "password_file": [k for k in BAD_FILES if k not in ("not-pem", "not-json", "json-list",
                                                            "json-without-layers")],
        "config_json": list(BAD_FILES),
        "cert_file": list(BAD_FILES), "key_file": list(BAD_FILES), "client_ca_file": list(BAD_FILES),
    }


def test_a_fault_while_applying_a_reload_fails_it_and_changes_no_running_target(files, tmp_path, monkeypatch, caplog):
    """The last resort: whatever building the new configuration's parts raises is a failed reload, logged with its
    traceback; the new targets are built before any running one changes, so nothing half-applies."""
    path = tmp_path / "exporter.yml"
    path.write_text(yaml.safe_dump(base(files)))
    exporter = Exporter(cfg.resolve({"config": str(path)}, {}),
                        lambda: (cfg.resolve({"config": str(path)}, {}), None))
    try:
        running, labels = list(exporter.shard.targets), [target.labels for target in exporter.shard.targets]
        document = base(files)
        document["labels"] = {"cluster": "staging"}  # every running target's labels would change...
        document["targets"].append({"name": "new", "url": "http://10.0.0.9:8000/metrics"})  # ...and one is built
        path.write_text(yaml.safe_dump(document))

        def fault(target, config):
            raise RuntimeError("a fault of ours")

        monkeypatch.setattr(shard, "new_target", fault)
        assert exporter.reload() == (False, "reload failed: unexpected error: RuntimeError: a fault of ours")
        assert exporter.state.reload_ok is False
        assert exporter.shard.targets == running and [target.labels for target in running] == labels
        assert exporter.config.labels == {"cluster": "prod"}
        assert "Traceback" in caplog.text and "RuntimeError: a fault of ours" in caplog.text

        monkeypatch.undo()
        assert exporter.reload() == (True, "reloaded") and exporter.state.reload_ok
        assert [target.labels["cluster"] for target in exporter.shard.targets] == ["staging"] * 5
    finally:
        exporter.stop()
