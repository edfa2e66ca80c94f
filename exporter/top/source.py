"""Where `top` gets its numbers: a running exporter's /metrics, or the engines polled directly.

Both sources hand back the same thing, kvcache_* exposition text, which `read_frame` turns into
one reading per pool: a direct poll runs the exporter's own pipeline (fetch, adapt, derive) and
renders its exposition, so the two paths can never disagree on a derived value or a state.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from .. import contract, exposition
from ..config import Config
from ..runtime.direct import DirectPolls
from ..sources import parser
from ..thresholds import DEFAULT as DEFAULT_THRESHOLDS
from ..thresholds import PUBLISHED, Thresholds

# The families `top` reads, all in the contract (tests/unit/test_contract_table.py): a pool's polled gauges
# and counters, its state and TTFT buckets, the capacity misses where a KV event stream is read (their
# column shows only there), and whether each target answered.
P = contract.PREFIX
TTFT = "time_to_first_token_seconds"
STATE = "pressure_state"
REASON = "pressure_reason"
THRESHOLD = "exporter_pressure_threshold"  # an exporter's page: the thresholds its states were derived with
CAPACITY_MISSES = "capacity_miss_blocks_total"
HOLDERS = ("adapter", "tenant")  # who holds a pool's blocks: kvcache_{adapter,tenant}_blocks_resident
_RESIDENT = {holder: f"{holder}_blocks_resident" for holder in HOLDERS}
_GAUGES = contract.names(group="pool", type="gauge")
_COUNTERS = contract.names(group="pool", type="counter") + (CAPACITY_MISSES,)
_LAST_SUCCESS = "target_last_success_timestamp_seconds"
WANTED = frozenset(P + name for name in (*_GAUGES, *_COUNTERS, STATE, REASON, THRESHOLD, "target_up", _LAST_SUCCESS,
                                         TTFT + "_bucket", *_RESIDENT.values()))
_IDENTITY = contract.GROUPS["pool"].identity


class SourceError(Exception):
    """A read that gave no page: the message says where and why, in one line."""


@dataclass(slots=True)
class Pool:
    """One data-parallel pool's values as one read saw them."""

    target: str
    engine: str
    model: str
    dp_rank: str
    role: str  # prefill, decode or unified (disaggregated serving)
    at: float  # unix time of the poll these values come from (the target's last success)
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (le, cumulative count), ascending
    state: str | None = None
    reason: str | None = None  # why the state: a key of contract.PRESSURE_REASONS
    # blocks resident by adapter and by tenant, where the exporter reads the pool's KV event stream
    holders: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, ...]:
        return self.target, self.engine, self.model, self.dp_rank, self.role


@dataclass(slots=True)
class Frame:
    """Everything one read saw: the pools, and which targets answered the exporter's last poll."""

    read_at: float
    pools: dict[tuple[str, ...], Pool]  # by the pool's identity labels (contract GROUPS["pool"])
    targets_up: dict[str, bool]
    # The thresholds the page says its states were derived with (an exporter's); none on a page without them
    # (engines polled directly, an exporter from before they were published).
    thresholds: dict[str, float] = field(default_factory=dict)

    def thresholds_or(self, fallback: Thresholds) -> Thresholds:
        """The thresholds the page was derived with, the source's own (`fallback`) where it does not say."""
        return replace(fallback, **self.thresholds)


def read_frame(text: str, read_at: float) -> Frame:
    """The pools on a kvcache_* page. Raises parser.ParseError on a page that is not exposition text."""
    samples = parser.parse(text, WANTED)
    polled: dict[str, float] = {}
    for sample in samples.get(P + _LAST_SUCCESS, ()):
        polled[sample.labels.get("target", "")] = sample.value
    targets_up = {s.labels.get("target", ""): s.value == 1.0 for s in samples.get(P + "target_up", ())}
    pools: dict[tuple[str, ...], Pool] = {}

    def pool_of(labels: dict[str, str]) -> Pool:
        key = tuple(labels.get(name, "") for name in _IDENTITY)
        found = pools.get(key)
        if found is None:
            found = pools[key] = Pool(*key, at=polled.get(key[0], read_at))
        return found

    for names, into in ((_GAUGES, "gauges"), (_COUNTERS, "counters")):
        for name in names:
            for sample in samples.get(P + name, ()):
                getattr(pool_of(sample.labels), into)[name] = sample.value
    for sample in samples.get(P + STATE, ()):
        if sample.value == 1.0:
            pool_of(sample.labels).state = sample.labels.get("state")
    for sample in samples.get(P + REASON, ()):
        if sample.value == 1.0 and sample.labels.get("reason") in contract.PRESSURE_REASONS:
            pool_of(sample.labels).reason = sample.labels.get("reason")
    for sample in samples.get(P + TTFT + "_bucket", ()):
        labels = sample.labels
        pool_of(labels).ttft.append((float(labels.get("le", "nan")), sample.value))
    for holder, name in _RESIDENT.items():
        for sample in samples.get(P + name, ()):
            pool_of(sample.labels).holders.setdefault(holder, {})[sample.labels.get(holder, "")] = sample.value
    for pool in pools.values():
        pool.ttft.sort()
    thresholds = {sample.labels["name"]: sample.value for sample in samples.get(P + THRESHOLD, ())
                  if sample.labels.get("name") in PUBLISHED}
    return Frame(read_at, pools, targets_up, thresholds)


def metrics_url(url: str) -> str:
    """An exporter's base URL as given (`http://host:10490`) to its /metrics URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL, got {url!r}")
    return url if parts.path not in ("", "/") else url.rstrip("/") + "/metrics"


class ExporterSource:
    """A running exporter's /metrics. Its page says the thresholds it derived with (Frame.thresholds); the defaults
    stand for an exporter that does not."""

    thresholds: Thresholds = DEFAULT_THRESHOLDS

    def __init__(self, url: str, timeout: float):
        self.url = metrics_url(url)
        self.timeout = timeout

    @property
    def description(self) -> str:
        return self.url

    def read(self) -> str:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as response:
                return response.read().decode("utf-8")
        except urllib.error.HTTPError as err:
            raise SourceError(f"{self.url}: HTTP {err.code}") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise SourceError(f"{self.url}: {getattr(reason, 'strerror', None) or reason}") from None
        except UnicodeDecodeError:
            raise SourceError(f"{self.url}: the page is not UTF-8") from None

    def close(self) -> None:
        pass


class DirectSource:
    """The engines of a configuration, polled with the exporter's own pipeline at every read.

    Every method runs in the one thread that reads: the targets' connections belong to its event loop.
    """

    def __init__(self, config: Config):
        self.polls = DirectPolls(config)
        self.thresholds = config.thresholds

    @property
    def description(self) -> str:
        count = len(self.polls.targets)
        return f"{count} target{'s' if count != 1 else ''} polled directly"

    def read(self) -> str:
        # A failed poll is counted by its target and shows as target_up 0: the read itself never fails.
        self.polls.poll_once()
        parts = exposition.render((t.text for t in self.polls.targets), time.time(), self.polls.config.staleness)
        return b"".join(parts).decode("utf-8")

    def close(self) -> None:
        self.polls.close()
