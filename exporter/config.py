"""Exporter configuration: YAML file, command-line flags and environment, validated into one Config.

Defaults < file < environment < flags: `resolve` merges them from plain values (the commands parse
their flags; this module knows their names, to name them in errors). Every problem becomes a
ConfigError that names where it came from (the file, or the flag or environment variable), the key
and what is wrong, printed as one line with exit code 2.
"""

from __future__ import annotations

import fnmatch
import functools
import ipaddress
import math
import os
import re
import stat
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, NamedTuple
from urllib.parse import urlsplit

import yaml

from . import units
from .adapters import ADAPTERS, DEFAULT_KEPT, KeptBounds, kept_bounds
from .contract import DEFAULT_LATENCY_BUCKETS, FAMILIES, OPTIONAL_GROUPS, ROLES, label_names
from .kvmath import ArchitectureError, KVLayout, layout_from_mapping
from .sources.fetch import read_certificates, read_credential
from .thresholds import Thresholds

DEFAULT_LISTEN = "0.0.0.0:10490"
DEFAULT_POLL_INTERVAL = 5.0
# Engines update most of their gauges every few seconds: a faster poll only loads them. The floor
# still lets tests and demos run simulated engines on a fast clock.
MIN_POLL_INTERVAL = 0.1
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
# Labels the exporter sets itself; a static label must not collide with them.
RESERVED_LABELS = label_names()
# The label that groups the pools of one model across prefill and decode roles (`pd_group_label:`).
DEFAULT_PD_GROUP_LABEL = "model"
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


# Setting -> environment variable that gives it when its flag is not given.
ENVIRONMENT = {
    "config": "KVCACHE_EXPORTER_CONFIG",
    "target": "KVCACHE_EXPORTER_TARGETS",
    "listen": "KVCACHE_EXPORTER_LISTEN",
    "poll_interval": "KVCACHE_EXPORTER_POLL_INTERVAL",
    "log_level": "KVCACHE_EXPORTER_LOG_LEVEL",
    "log_format": "KVCACHE_EXPORTER_LOG_FORMAT",
    "workers": "KVCACHE_EXPORTER_WORKERS",
    "shard": "KVCACHE_EXPORTER_SHARD",
    "web_config_file": "KVCACHE_EXPORTER_WEB_CONFIG",
}
# Setting -> its flags: the name the Prometheus exporters give it first, then the name it had before (kept).
FLAGS = {
    "config": ("--config.file", "--config"),
    "target": ("--target",),
    "listen": ("--web.listen-address", "--listen"),
    "poll_interval": ("--poll.interval", "--poll-interval"),
    "log_level": ("--log.level", "--log-level"),
    "log_format": ("--log.format",),
    "workers": ("--workers",),
    "shard": ("--shard",),
    "web_config_file": ("--web.config.file",),
}
# The key of the flags' mapping that says which spelling of a setting's flag the command line used.
TYPED = "typed_flags"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("logfmt", "json")  # the first is the default


# A problem's words at most: a value an error quotes may be a whole section of the file.
MAX_PROBLEM_CHARS = 400


class ConfigError(Exception):
    def __init__(self, source: str, key: str, problem: str):
        if len(problem) > MAX_PROBLEM_CHARS:
            problem = problem[:MAX_PROBLEM_CHARS] + "..."
        # One line whatever a file holds: a key or a path may carry a line break.
        super().__init__(f"{source}: {key}: {problem}".replace("\r", "\\r").replace("\n", "\\n"))


DEFAULT_MAX_EVENT_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_TOP_HOLDERS = 10  # adapters and tenants shown per pool; the rest summed as `other`
# Replica-blocks the fleet index tracks exactly before it samples (about 200 bytes each: bench/fleet_index.py).
DEFAULT_FLEET_MAX_BLOCKS = 1_000_000


@dataclass(frozen=True)
class FleetIndexConfig:
    """The cross-replica block index (`fleet_index:`, exporter/fleet.py): off unless turned on, as it decodes every
    store's token ids."""

    enabled: bool = False
    max_blocks: int = DEFAULT_FLEET_MAX_BLOCKS


@dataclass(frozen=True)
class KVEventsConfig:
    """A target's KV event stream (`kv_events:`): vLLM and SGLang publish one per DP rank, on the base
    port plus the rank (the replay port likewise)."""

    endpoint: str  # the engine's PUB socket, e.g. tcp://10.0.0.1:5557
    replay_endpoint: str | None = None  # its ROUTER socket, to ask for batches a gap lost
    topic: str = ""
    dp_ranks: int = 1
    max_message_bytes: int = DEFAULT_MAX_EVENT_MESSAGE_BYTES
    top_holders: int = DEFAULT_TOP_HOLDERS

    def endpoints(self) -> list[tuple[int, str, str | None]]:
        """(rank, endpoint, replay endpoint) of each DP rank."""
        return [(rank, _offset_port(self.endpoint, rank),
                 _offset_port(self.replay_endpoint, rank) if self.replay_endpoint else None)
                for rank in range(self.dp_ranks)]


def _offset_port(endpoint: str, rank: int) -> str:
    if rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


@dataclass(frozen=True)
class TargetConfig:
    name: str
    url: str
    engine: str = "auto"
    labels: dict[str, str] = field(default_factory=dict)
    bearer_token_file: str | None = None
    basic_auth_username: str | None = None
    basic_auth_password_file: str | None = None
    ca_file: str | None = None
    # The ca_file's PEM text, read and checked at load: a reload or a worker never opens the file again.
    ca_pem: str | None = field(default=None, repr=False)
    tls_insecure_skip_verify: bool = False
    kv_layout: KVLayout | None = None  # from `model_architecture:`; enables the *_bytes series
    kv_events: KVEventsConfig | None = None
    # Its pools' disaggregation role where the page does not say it (contract.ROLES); None: unified.
    role: str | None = None
    # The model it serves, as its engine names it: what it is a replica of before its engine first answers (an
    # autoscaler's new replica), so that the fleet rules count it as starting. The page's word wins once it answers.
    model: str | None = None


@dataclass(frozen=True)
class ProbeConfig:
    """Probe mode (`/probe?target=URL`): off unless the configuration turns it on and says which hosts."""

    enabled: bool = False
    allow: tuple[str, ...] = ()  # host patterns (fnmatch, e.g. *.engines.svc) and CIDRs (e.g. 10.0.0.0/8)
    max_targets: int = 1000  # probed engines whose state is kept; the least recently probed goes first

    def allows(self, host: str) -> bool:
        """Whether `host`, as written in the URL, is allowed: an IP address by the CIDRs, a name by the
        patterns (a name is not resolved: an allowed name is trusted for whatever it resolves to)."""
        networks, patterns = self._allow_parsed
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return any(fnmatch.fnmatchcase(host.lower(), pattern) for pattern in patterns)
        return "*" in patterns or any(address in network for network in networks)

    @functools.cached_property
    def _allow_parsed(self) -> tuple[tuple, tuple[str, ...]]:
        """The allow list split into networks and lower-cased name patterns, once."""
        networks, patterns = [], []
        for pattern in self.allow:
            try:
                networks.append(ipaddress.ip_network(pattern, strict=False))
            except ValueError:
                patterns.append(pattern.lower())
        return tuple(networks), tuple(patterns)


def _is_network(pattern: str) -> bool:
    try:
        ipaddress.ip_network(pattern, strict=False)
        return True
    except ValueError:
        return False


class ShardPosition(NamedTuple):
    """This replica's place among the replicas of one configuration, written as it is given: INDEX/COUNT."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class Config:
    targets: tuple[TargetConfig, ...]
    poll_interval: float = DEFAULT_POLL_INTERVAL
    timeout: float = 0.8 * DEFAULT_POLL_INTERVAL
    staleness: float = 3 * DEFAULT_POLL_INTERVAL
    max_response_bytes: int = DEFAULT_MAX_BYTES
    labels: dict[str, str] = field(default_factory=dict)
    thresholds: Thresholds = field(default_factory=Thresholds)
    listen: str = DEFAULT_LISTEN
    log_level: str = "info"
    log_format: str = LOG_FORMATS[0]
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    pd_group_label: str = DEFAULT_PD_GROUP_LABEL
    workers: int = 1  # processes that poll the targets between them (exporter/runtime/workers.py)
    shard: ShardPosition = ShardPosition(0, 1)  # replicas of one configuration poll a share each
    # The latency histograms' bucket bounds re-exported (`latency_buckets:`); a histogram not named keeps all.
    latency_buckets: KeptBounds = field(default_factory=lambda: DEFAULT_KEPT)
    groups_off: frozenset[str] = frozenset()  # contract groups turned off (`families:`)

    @functools.cached_property
    def hidden_families(self) -> frozenset[str]:
        """The families of the groups turned off: never exposed."""
        return frozenset(name for name, family in FAMILIES.items() if family.group in self.groups_off)

    @functools.cached_property
    def adapted_buckets(self) -> KeptBounds:
        """`latency_buckets` as the adapters take it, with no bound at all for a hidden histogram: not read."""
        return {**self.latency_buckets, **{name: frozenset() for name in self.hidden_families
                                           if FAMILIES[name].type == "histogram"}}
    fleet_index: FleetIndexConfig = field(default_factory=FleetIndexConfig)


def parse_duration(text: Any) -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool) and 0 < text < math.inf:
        return float(text)
    try:
        seconds = units.parse_duration(str(text))
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < math.inf:
        raise ValueError(f"not a positive duration (e.g. 5s, 500ms, 1m): {text!r}")
    return seconds


def parse_poll_interval(text: Any) -> float:
    interval = parse_duration(text)
    if interval < MIN_POLL_INTERVAL:
        raise ValueError(f"must be at least {MIN_POLL_INTERVAL * 1000:g}ms (the default is "
                         f"{DEFAULT_POLL_INTERVAL:g}s), got {text!r}")
    return interval


def parse_size(text: Any) -> int:
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    try:
        size = units.parse_size(str(text))
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(f"not a positive size (e.g. 16MiB): {text!r}")
    return size


def parse_listen(text: Any) -> str:
    host, sep, port = text.rpartition(":") if isinstance(text, str) else ("", "", "")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return text


def target_from_url(url: str) -> TargetConfig:
    url = _check_url(url)
    return TargetConfig(name=_default_name(url), url=url)


def _check_url(url: Any) -> str:
    try:
        parts = urlsplit(str(url))
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number in 0..65535)
    except ValueError:
        raise ValueError(f"is not a valid URL (bad host or port): {redact_url(url)!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL, got {redact_url(url)!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"must not carry credentials ({redact_url(url)!r}): set basic_auth.username and put the "
                         "password in a file named by basic_auth.password_file")
    return str(url)


def redact_url(url: Any) -> str:
    """The URL with any user:password@ replaced by ***@, for messages and logs."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rpartition("@")[2]
    return f"{scheme}://{authority}{slash}{path}"


def _default_name(url: str) -> str:
    """`host:port`, and the path where it is not /metrics: engines behind one address (a gateway
    routing by path) stay apart."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/")
    return parts.netloc if path in ("", "/metrics") else parts.netloc + path


def _labels(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("must be a mapping of label names to values")
    out = {}
    for name, label_value in value.items():
        if not isinstance(name, str) or not _LABEL_NAME.match(name) or name.startswith("__"):
            raise ValueError(f"invalid label name {name!r}")
        if name in RESERVED_LABELS:
            raise ValueError(f"label {name!r} is set by the exporter itself")
        if isinstance(label_value, (dict, list)) or label_value is None:
            raise ValueError(f"label {name!r} must have a scalar value")
        out[name] = str(label_value)
    return out


_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_\-]+$")


def key_name(name: Any) -> str:
    """A key of a file as an error names it: as written, or quoted if that would not show it (an empty key, a
    space, a colon, a line break)."""
    return name if isinstance(name, str) and _PLAIN_KEY.match(name) else repr(name)


class _Reader:
    """Reads keys of one mapping, turning every problem into a ConfigError with the full key path."""

    def __init__(self, source: str, mapping: Any, path: str = ""):
        self.source, self.path = source, path
        if not isinstance(mapping, dict):
            raise ConfigError(source, path or "(top level)", "must be a mapping")
        self.mapping = mapping

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, convert, default=None):
        if name not in self.mapping or self.mapping[name] is None:
            return default
        try:
            return convert(self.mapping[name])
        except (ValueError, TypeError, KeyError) as err:
            raise ConfigError(self.source, self.key(name), str(err.args[0] if err.args else err)) from None

    def reject_unknown(self, known: set[str]) -> None:
        for name in self.mapping:
            if name not in known:
                raise ConfigError(self.source, self.key(key_name(name)),
                                  f"unknown key (known: {', '.join(sorted(known))})")


def _string(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string, got {value!r}")
    return value


def engines() -> tuple[str, ...]:
    """The values `engine:` takes: auto-detection, or one of the registered adapters."""
    return ("auto", *ADAPTERS)


def _role(value: Any) -> str:
    if value not in ROLES:
        raise ValueError(f"must be one of {', '.join(ROLES)}, got {value!r}")
    return value


def _engine(value: Any) -> str:
    if value not in engines():
        raise ValueError(f"must be one of {', '.join(engines())}, got {value!r}")
    return value


def _thresholds(source: str, value: Any) -> Thresholds:
    reader = _Reader(source, value, "pressure")
    reader.reject_unknown({f.name for f in fields(Thresholds)})
    # one key at a time so the error names it; a key without a value keeps its default, as elsewhere
    given = {key: reader.get(key, functools.partial(_threshold, key)) for key in reader.mapping}
    thresholds = Thresholds.from_mapping({key: value for key, value in given.items() if value is not None})
    if thresholds.low_water_ratio >= thresholds.high_water_ratio:
        raise ConfigError(source, "pressure.low_water_ratio" if "low_water_ratio" in given else
                          "pressure.high_water_ratio", f"low_water_ratio ({thresholds.low_water_ratio:g}) must be "
                          f"below high_water_ratio ({thresholds.high_water_ratio:g})")
    return thresholds


def _threshold(key: str, value: Any) -> float | str:
    """One `pressure:` value, of its field's type (TypeError) and in its range (ValueError): a share 0 to 1, a
    number finite and not negative, a window above 0, a duration one a rule's `for:` takes."""
    checked = getattr(Thresholds.from_mapping({key: value}), key)
    if isinstance(checked, str):
        try:
            seconds = units.parse_duration(checked, strict=True)
        except ValueError:
            seconds = 0.0
        if seconds <= 0:
            raise ValueError(f"must be a positive Prometheus duration (e.g. 2m, 1h30m), got {value!r}")
    elif not math.isfinite(checked) or checked < 0 or (key == "window_seconds" and checked == 0):
        raise ValueError(f"must be a finite number {'above' if key == 'window_seconds' else 'at least'} 0, "
                         f"got {value!r}")
    elif any(word in key for word in ("ratio", "fraction", "share")) and checked > 1:
        raise ValueError(f"must be a share from 0 to 1, got {value!r}")
    return checked


_TARGET_KEYS = {"name", "url", "engine", "labels", "bearer_token_file", "basic_auth", "ca_file",
                "tls_insecure_skip_verify", "model_architecture", "kv_events", "role", "model"}

_TOP_KEYS = {"poll_interval", "timeout", "staleness", "max_response_bytes", "labels", "pressure", "targets", "listen",
             "log_level", "log_format", "probe", "pd_group_label", "workers", "shard", "latency_buckets", "families",
             "fleet_index"}
_HOST_PATTERN = re.compile(r"^[A-Za-z0-9*?.\-\[\]]+$")


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def _beside(source: str, convert: Callable[[str], Any] = _string) -> Callable[[Any], Any]:
    """A file path, as `convert` takes it, where a relative path is taken from the configuration file's
    directory as Prometheus takes its own: the same file whatever directory the exporter starts in."""
    def resolved(value: Any) -> Any:
        path = _string(value)
        return convert(path if os.path.isabs(path) else os.path.join(os.path.dirname(source), path))
    return resolved


def _credential_file(path: str) -> str:
    """The path of a bearer token's or a password's file that can be read and sent as it is."""
    read_credential(path)
    return path


def _basic_auth(source: str, section: Any, key: str, read_files: bool) -> tuple[str | None, str | None]:
    if section is None:
        return None, None
    reader = _Reader(source, section, key)
    if "password" in reader.mapping:
        raise ConfigError(source, reader.key("password"), "secrets are not written in the configuration: "
                                                          "put the password in a file and set password_file")
    reader.reject_unknown({"username", "password_file"})
    username = reader.get("username", _string)
    password_file = reader.get("password_file", _beside(source, _credential_file if read_files else _string))
    if username is None or password_file is None:
        raise ConfigError(source, key, "needs both username and password_file")
    return username, password_file


def _target(source: str, item: Any, path: str, read_files: bool) -> TargetConfig:
    """A `targets:` entry; with `read_files`, the files it names are read and checked (load_file)."""
    reader = _Reader(source, item, path)
    if isinstance(item, dict) and "bearer_token" in item:
        raise ConfigError(source, reader.key("bearer_token"), "secrets are not written in the configuration: "
                                                              "put the token in a file and set bearer_token_file")
    reader.reject_unknown(_TARGET_KEYS)
    username, password_file = _basic_auth(source, reader.mapping.get("basic_auth"), reader.key("basic_auth"),
                                          read_files)
    url = reader.get("url", _check_url)
    if url is None:
        raise ConfigError(source, reader.key("url"), "is required")
    return TargetConfig(
        name=reader.get("name", _string, _default_name(url)),
        url=url,
        engine=reader.get("engine", _engine, "auto"),
        labels=reader.get("labels", _labels, {}),
        bearer_token_file=reader.get("bearer_token_file", _beside(source, _credential_file if read_files else _string)),
        basic_auth_username=username,
        basic_auth_password_file=password_file,
        ca_file=reader.get("ca_file", _beside(source)),
        ca_pem=reader.get("ca_file", _beside(source, read_certificates)) if read_files else None,
        tls_insecure_skip_verify=reader.get("tls_insecure_skip_verify", _boolean, False),
        kv_layout=_kv_layout(source, reader.mapping.get("model_architecture"), reader.key("model_architecture")),
        kv_events=_kv_events(source, reader.mapping.get("kv_events"), reader.key("kv_events")),
        role=reader.get("role", _role),
        model=reader.get("model", _string),
    )


_ZMQ_ENDPOINT = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


def _zmq_endpoint(value: Any) -> str:
    match = _ZMQ_ENDPOINT.match(str(value)) if isinstance(value, str) else None
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"must be tcp://HOST:PORT (the engine's address, not tcp://*), got {value!r}")
    return value


def _topic(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {value!r}")
    return value


def _kv_events(source: str, section: Any, key: str) -> KVEventsConfig | None:
    if section is None:
        return None
    reader = _Reader(source, section, key)
    reader.reject_unknown({"endpoint", "replay_endpoint", "topic", "dp_ranks", "max_message_bytes", "top_holders"})
    endpoint = reader.get("endpoint", _zmq_endpoint)
    if endpoint is None:
        raise ConfigError(source, reader.key("endpoint"), "is required (the engine's --kv-events-config endpoint, "
                                                          "e.g. tcp://10.0.0.1:5557)")
    events = KVEventsConfig(
        endpoint=endpoint, replay_endpoint=reader.get("replay_endpoint", _zmq_endpoint),
        topic=reader.get("topic", _topic, ""), dp_ranks=reader.get("dp_ranks", _positive_int, 1),
        max_message_bytes=reader.get("max_message_bytes", parse_size, DEFAULT_MAX_EVENT_MESSAGE_BYTES),
        top_holders=reader.get("top_holders", _positive_int, DEFAULT_TOP_HOLDERS))
    for rank_key, value in (("endpoint", events.endpoint), ("replay_endpoint", events.replay_endpoint)):
        if value is not None and int(value.rpartition(":")[2]) + events.dp_ranks - 1 > 65535:
            raise ConfigError(source, reader.key(rank_key), f"port plus dp_ranks - 1 ({events.dp_ranks - 1}) "
                                                            "is above 65535")
    return events


def _probe(source: str, section: Any) -> ProbeConfig:
    reader = _Reader(source, section, "probe")
    reader.reject_unknown({"enabled", "allow", "max_targets"})
    allow = tuple(reader.get("allow", _allow_list, ()))
    probe = ProbeConfig(enabled=reader.get("enabled", _boolean, False), allow=allow,
                        max_targets=reader.get("max_targets", _positive_int, ProbeConfig.max_targets))
    if probe.enabled and not allow:
        raise ConfigError(source, "probe.allow", "is required with probe.enabled: list the host patterns and CIDRs "
                                                 "that /probe may poll (e.g. 10.0.0.0/8, *.svc.cluster.local; '*' is any)")
    return probe


def _fleet_index(source: str, section: Any) -> FleetIndexConfig:
    reader = _Reader(source, section, "fleet_index")
    reader.reject_unknown({"enabled", "max_blocks"})
    return FleetIndexConfig(enabled=reader.get("enabled", _boolean, False),
                            max_blocks=reader.get("max_blocks", _positive_int, DEFAULT_FLEET_MAX_BLOCKS))


def _allow_list(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise ValueError("must be a list of host patterns and CIDRs")
    for item in value:
        if not isinstance(item, str) or not (_is_network(item) or _HOST_PATTERN.match(item)):
            raise ValueError(f"not a host pattern (e.g. *.svc.cluster.local) or a CIDR (e.g. 10.0.0.0/8): {item!r}")
    return value


def _groups_off(source: str, section: Any) -> frozenset[str]:
    """`families: {latency: false, ...}`: the contract's groups turned off (true, or a group not named: on)."""
    reader = _Reader(source, section, "families")
    reader.reject_unknown(set(OPTIONAL_GROUPS))
    return frozenset(group for group in reader.mapping if not reader.get(group, _boolean, True))


ALL_BUCKETS = "all"


def _latency_buckets(source: str, section: Any) -> KeptBounds:
    """`latency_buckets: all` keeps every bound of every latency histogram; a mapping names, per histogram, `all`
    or the bounds to keep (seconds; +Inf always kept; a bound the engine lacks is simply not there). Histograms
    not named keep the default set (contract.DEFAULT_LATENCY_BUCKETS)."""
    if section == ALL_BUCKETS:
        return {}
    reader = _Reader(source, section, "latency_buckets")
    reader.reject_unknown(set(DEFAULT_LATENCY_BUCKETS))
    chosen: dict[str, tuple[float, ...] | None] = dict(DEFAULT_LATENCY_BUCKETS)
    for name in reader.mapping:
        chosen[name] = reader.get(name, _bounds)
    return kept_bounds(chosen)


def _bounds(value: Any) -> tuple[float, ...] | None:
    """`all` (None), or a non-empty list of finite bounds of at least 0 seconds."""
    if value == ALL_BUCKETS:
        return None
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be {ALL_BUCKETS!r} or a list of bucket bounds in seconds, e.g. [0.1, 0.5, 1], "
                         f"got {value!r}")
    for bound in value:
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 <= bound < math.inf:
            raise ValueError(f"a bucket bound must be a finite number of seconds, at least 0 (+Inf is always kept), "
                             f"got {bound!r}")
    return tuple(float(bound) for bound in value)


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"must be a positive whole number, got {value!r}")
    return value


MAX_WORKERS = 64


def parse_workers(value: Any) -> int:
    """A whole number of processes from a file (an int) or a flag or variable (its text)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    count = _positive_int(value)
    if count > MAX_WORKERS:
        raise ValueError(f"must be at most {MAX_WORKERS}, got {count}")
    return count


def parse_shard(value: Any) -> ShardPosition:
    """`INDEX/COUNT` (`1/4`: the second of four replicas), as a file, a flag or a variable gives it."""
    index, sep, count = str(value).strip().partition("/")
    if not (sep and index.isdigit() and count.isdigit()):
        raise ValueError(f"must be INDEX/COUNT, e.g. 0/4 for the first of four replicas, got {value!r}")
    if int(count) == 0:
        raise ValueError(f"COUNT must be at least 1, got {value!r}")
    if int(index) >= int(count):
        raise ValueError(f"INDEX counts from 0 and must be below COUNT, got {value!r}")
    return ShardPosition(int(index), int(count))


def _kv_layout(source: str, section: Any, key: str) -> KVLayout | None:
    if section is None:
        return None
    try:
        # `config_json:` paths are relative to the configuration file.
        return layout_from_mapping(section, base_dir=os.path.dirname(source) or ".", prefix=key + ".")
    except ArchitectureError as err:
        raise ConfigError(source, err.key, err.problem) from None


@dataclass(frozen=True)
class GeneratorSettings:
    """What the rule and dashboard generators follow of a configuration file."""

    thresholds: Thresholds
    static_labels: tuple[str, ...]  # global, then per target
    pd_group_label: str = DEFAULT_PD_GROUP_LABEL


def generator_settings(path: str) -> GeneratorSettings:
    """A configuration file's thresholds, static label names and P/D group label. Raises ConfigError."""
    settings = load_file(path, read_files=False)
    return GeneratorSettings(settings.get("thresholds", Thresholds()), _static_label_names(settings),
                             settings.get("pd_group_label", DEFAULT_PD_GROUP_LABEL))


def _static_label_names(settings: dict[str, Any]) -> tuple[str, ...]:
    names = dict.fromkeys(settings.get("labels", {}))
    for entry in settings.get("targets", ()):
        names.update(dict.fromkeys(entry.labels))
    return tuple(names)


def _pd_group_label(path: str, value: Any, settings: dict[str, Any]) -> str:
    """`model`, or a static label the configuration sets: the label the P/D rules group pools by."""
    known = (DEFAULT_PD_GROUP_LABEL, *_static_label_names(settings))
    if value not in known:
        raise ConfigError(path, "pd_group_label", f"must be {' or '.join(map(repr, known))} (the model, or a "
                                                  f"static label of the configuration), got {value!r}")
    return value


def read_yaml(path: str) -> Any:
    """A YAML file's document (None if it is empty); raises ConfigError."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would hang the start, or a reload for good
            raise ConfigError(path, "(file)", "not a regular file")
        with open(path, encoding="utf-8") as handle:
            document = yaml.safe_load(handle)
    except OSError as err:
        raise ConfigError(path, "(file)", err.strerror or str(err)) from None
    except UnicodeDecodeError:
        raise ConfigError(path, "(file)", "not UTF-8 text") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "(file)"
        raise ConfigError(path, where, f"invalid YAML: {getattr(err, 'problem', None) or err}") from None
    _check_values(path, document)
    return document


# Values a document may hold once its YAML aliases are expanded: far above a fleet's file (2,000 targets are some
# 30,000), far below what a few lines of nested aliases make (nine levels of nine: 387 million), which every check
# and error message would walk.
MAX_DOCUMENT_VALUES = 1_000_000


def _check_values(path: str, document: Any) -> None:
    """Raises ConfigError for a document of over MAX_DOCUMENT_VALUES values, counted as aliases expand them (an
    alias to itself never ends)."""
    pending, counted = [document], 0
    while pending:
        node = pending.pop()
        counted += 1
        if counted > MAX_DOCUMENT_VALUES:
            raise ConfigError(path, "(file)", f"holds over {MAX_DOCUMENT_VALUES:,} values once its YAML aliases "
                                              "are expanded")
        if isinstance(node, dict):
            pending += node.keys()
            pending += node.values()
        elif isinstance(node, list):
            pending += node


def load_file(path: str, read_files: bool = True) -> dict[str, Any]:
    """The file's settings as keyword arguments for build(); raises ConfigError. The TLS and credential files it
    names are read and checked too, unless `read_files` is false: for what only reads the file's thresholds and
    labels (the rule and dashboard generators), never for a configuration that runs."""
    data = read_yaml(path)
    reader = _Reader(path, data if data is not None else {})
    reader.reject_unknown(_TOP_KEYS)
    raw_targets = reader.mapping.get("targets") or []
    if not isinstance(raw_targets, list):
        raise ConfigError(path, "targets", "must be a list")
    settings: dict[str, Any] = {
        "targets": [_target(path, item, f"targets[{i}]", read_files) for i, item in enumerate(raw_targets)],
    }
    for key, convert in (("poll_interval", parse_poll_interval), ("timeout", parse_duration),
                         ("staleness", parse_duration), ("max_response_bytes", parse_size),
                         ("labels", _labels), ("listen", parse_listen),
                         ("log_level", parse_log_level), ("log_format", parse_log_format), ("workers", parse_workers),
                         ("shard", parse_shard)):
        value = reader.get(key, convert)
        if value is not None:
            settings[key] = value
    if reader.mapping.get("pressure") is not None:
        settings["thresholds"] = _thresholds(path, reader.mapping["pressure"])
    if reader.mapping.get("probe") is not None:
        settings["probe"] = _probe(path, reader.mapping["probe"])
    if reader.mapping.get("fleet_index") is not None:
        settings["fleet_index"] = _fleet_index(path, reader.mapping["fleet_index"])
    if reader.mapping.get("pd_group_label") is not None:
        settings["pd_group_label"] = _pd_group_label(path, reader.mapping["pd_group_label"], settings)
    if reader.mapping.get("latency_buckets") is not None:
        settings["latency_buckets"] = _latency_buckets(path, reader.mapping["latency_buckets"])
    if reader.mapping.get("families") is not None:
        settings["groups_off"] = _groups_off(path, reader.mapping["families"])
    return settings


def parse_log_level(value: Any) -> str:
    level = str(value).lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"must be {', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]}, got {value!r}")
    return level


def parse_log_format(value: Any) -> str:
    if value not in LOG_FORMATS:
        raise ValueError(f"must be {' or '.join(LOG_FORMATS)}, got {value!r}")
    return value


def build(source: str, settings: dict[str, Any]) -> Config:
    """A validated Config from merged settings; `source` names where cross-key problems are reported."""
    targets = tuple(settings.get("targets", ()))
    names = [t.name for t in targets]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(source, "targets", f"target name {name!r} is used twice; give each target a `name`")
    interval = settings.get("poll_interval", DEFAULT_POLL_INTERVAL)
    timeout = settings.get("timeout", 0.8 * interval)
    if timeout >= interval:
        raise ConfigError(source, "timeout", f"must be below poll_interval ({interval:g}s), got {timeout:g}s")
    staleness = settings.get("staleness", 3 * interval)
    if staleness < interval:
        raise ConfigError(source, "staleness", f"must be at least poll_interval ({interval:g}s), got {staleness:g}s")
    fleet_index = settings.get("fleet_index", FleetIndexConfig())
    if fleet_index.enabled and (settings.get("workers", 1) > 1 or settings.get("shard", ShardPosition(0, 1)).count > 1):
        raise ConfigError(source, "fleet_index.enabled", "needs every replica's stream in one process: workers 1 "
                                                         "and no shard")
    return Config(
        targets=targets,
        poll_interval=interval,
        timeout=timeout,
        staleness=staleness,
        max_response_bytes=settings.get("max_response_bytes", DEFAULT_MAX_BYTES),
        labels=settings.get("labels", {}),
        thresholds=settings.get("thresholds", Thresholds()),
        listen=settings.get("listen", DEFAULT_LISTEN),
        log_level=settings.get("log_level", "info"),
        log_format=settings.get("log_format", LOG_FORMATS[0]),
        probe=settings.get("probe", ProbeConfig()),
        pd_group_label=settings.get("pd_group_label", DEFAULT_PD_GROUP_LABEL),
        workers=settings.get("workers", 1),
        shard=settings.get("shard", ShardPosition(0, 1)),
        latency_buckets=settings.get("latency_buckets", DEFAULT_KEPT),
        groups_off=settings.get("groups_off", frozenset()),
        fleet_index=fleet_index,
    )


def flag_name(setting: str, flags: Mapping[str, object] | None = None) -> str:
    """The command-line flag of a setting as `flags` says it was typed, else its name (`listen` ->
    `--web.listen-address`)."""
    typed = (flags or {}).get(TYPED) or {}
    return typed.get(setting) or FLAGS[setting][0]


def given(flags: Mapping[str, object], environ: Mapping[str, str], setting: str) -> tuple[str, str, object] | None:
    """(where, flag or variable, value) of a setting given as a flag (None: not given) or in the environment."""
    value = flags.get(setting)
    if value is not None:
        return "command line", flag_name(setting, flags), value
    if environ.get(ENVIRONMENT[setting]):
        return "environment", ENVIRONMENT[setting], environ[ENVIRONMENT[setting]]
    return None


def resolve(flags: Mapping[str, object], environ: Mapping[str, str]) -> Config:
    """Defaults < config file < environment < flags. `flags` maps a setting to its flag's value (None
    or absent: not given; `target` a list of URLs). Raises ConfigError."""
    settings: dict = {}
    source = "command line"
    config_path = given(flags, environ, "config")
    if config_path:
        source = str(config_path[2])
        settings = load_file(source)
    targets = given(flags, environ, "target")
    if targets:
        origin, key, value = targets
        urls = value if isinstance(value, list) else [u.strip() for u in str(value).split(",") if u.strip()]
        named = {t.name: f"target {t.name!r} of {source}" for t in settings.get("targets", [])}
        extra = []
        for url in urls:
            try:
                target = target_from_url(url)
            except ValueError as err:
                raise ConfigError(origin, key, str(err)) from None
            if named.get(target.name) == url:
                raise ConfigError(origin, key, f"{url} is given twice")
            if target.name in named:  # the command line has no way to name a target
                raise ConfigError(origin, key, f"{url} would be named {target.name!r} like "
                                  f"{named[target.name]}: to poll both, list them in a configuration file "
                                  f"({FLAGS['config'][0]}), each with its own `name`")
            named[target.name] = url
            extra.append(target)
        settings["targets"] = list(settings.get("targets", [])) + extra
    for name, convert in (("listen", parse_listen), ("poll_interval", parse_poll_interval),
                          ("log_level", parse_log_level), ("log_format", parse_log_format), ("workers", parse_workers),
                          ("shard", parse_shard)):
        found = given(flags, environ, name)
        if found:
            try:
                settings[name] = convert(found[2])
            except ValueError as err:
                raise ConfigError(found[0], found[1], str(err)) from None
    return build(source, settings)


def listen_origin(flags: Mapping[str, object], environ: Mapping[str, str]) -> tuple[str, str]:
    """(where, key) of the listen address `resolve` chose, for an error that names it."""
    found = given(flags, environ, "listen")
    if found:
        return found[0], found[1]
    config_path = given(flags, environ, "config")
    if config_path and "listen" in load_file(str(config_path[2]), read_files=False):
        return str(config_path[2]), "listen"
    return "default", flag_name("listen")
