"""One target's pipeline: fetch -> parse -> adapt -> derive -> render, and the state it leaves.

Reading less: after a whole page, a target asks its engine for the series its adapter reads only
(`?name[]=`, prometheus_client's filter; docs/performance.md says which engines honour it). The answer
is judged, never trusted: a first one that holds other series is a whole page (the engine ignored
the filter); one that lacks a series the whole page held, or every series, is refused and the whole
page fetched at once (a multiprocess registry answers a filter with nothing). Either way the target asks
for whole pages from then on, until a failed poll (an engine restart is one: engines take far longer
than a poll interval to start), after which it reads a whole page and tries the filter again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from .. import adapters, contract, derive, exposition
from ..config import Config, TargetConfig
from ..sources import parser
from ..sources.fetch import FetchError, Fetcher, FetchSettings
from ..thresholds import Thresholds

log = logging.getLogger(__name__)
# What a target's engine does with a request for only the series its adapter reads.
UNTRIED, HONOURED, IGNORED = "untried", "honoured", "ignored"


@dataclass(frozen=True, slots=True)
class PollOutcome:
    """The result of a target's latest poll; replaced whole after every poll, never mutated."""

    up: bool = False
    engine: str = ""
    model: str = ""
    version: str = ""
    duration: float | None = None
    last_success: float | None = None  # unix time
    ranks: dict[str, derive.DerivedRank] = field(default_factory=dict)
    role: str = "unified"  # the pools' disaggregation role (contract.ROLES)


class PollFailed(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class Target:
    def __init__(self, config: TargetConfig, settings: FetchSettings, thresholds: Thresholds, static_labels: dict,
                 kept: adapters.KeptBounds = adapters.DEFAULT_KEPT):
        self.fetcher = Fetcher(config.url, settings)
        self.failures = dict.fromkeys(contract.FAILURE_REASONS, 0)
        self.outcome = PollOutcome(engine="" if config.engine == "auto" else config.engine,
                                   role=config.role or "unified")
        self._histories: dict[str, derive.RankHistory] = {}
        self._last_reason: str | None = None
        self.name_filter = UNTRIED
        # The adapter and the wanted names the last whole page held; None: read a whole page next.
        self._whole: tuple[adapters.Adapter, frozenset[str]] | None = None
        self.update(config, thresholds, static_labels, kept)

    def update(self, config: TargetConfig, thresholds: Thresholds, static_labels: dict,
               kept: adapters.KeptBounds = adapters.DEFAULT_KEPT) -> None:
        """A reload that keeps the target: new labels, thresholds, bucket bounds or architecture, same state."""
        self.config = config
        self.thresholds = thresholds
        self.kept = kept  # the latency histograms' bucket bounds re-exported
        self._adapted: dict = {}  # the adapter's memo of this target's unchanged histograms (Adapter.adapt)
        if self.outcome.last_success is None:  # what it is a replica of, until its page says
            self.outcome = replace(self.outcome, model=config.model or "", role=config.role or "unified")
        self.labels = {**static_labels, **config.labels}
        self._prefixes = exposition.Prefixes()  # label strings change with the labels
        # KV bytes of one token of the whole model (all TP shards): a pool's tokens span every shard.
        self.bytes_per_token = config.kv_layout.bytes_per_token() if config.kv_layout else None
        self._render()

    @property
    def name(self) -> str:
        return self.config.name

    async def poll(self, timeout: float | None = None) -> PollOutcome:
        """Fetch, then read the page; only the fetch waits, the rest runs at once in the event loop.
        `timeout`, if given, replaces the configured one for this poll (a probe's scrape timeout)."""
        started = time.monotonic()
        previous = self.outcome
        try:
            adapter, samples = await self._fetch_and_read(timeout)
            try:
                snapshot = adapter.adapt(samples, self.kept, self._adapted)
            except parser.ParseError as err:  # a bad label set, found when the adapter reads it
                raise PollFailed("parse", str(err)) from None
            if not snapshot.ranks:
                raise PollFailed("unknown_engine", f"no {adapter.engine} series on the page")
            now = time.time()
            # The page's word first (SGLang engine_type, Dynamo's disaggregation_mode), then the configuration's.
            role = snapshot.role or self.config.role or "unified"
            ranks, self._histories = derive.derive(
                snapshot, self._histories, now, self.thresholds, self.bytes_per_token, role)
            outcome = PollOutcome(True, snapshot.engine, snapshot.model, snapshot.version,
                                  time.monotonic() - started, now, ranks, role)
            if self._last_reason is not None:
                log.info("target %s recovered", self.name)
                self._last_reason = None
        except (FetchError, PollFailed) as err:
            outcome = self._failed(previous, err.reason, str(err), started)
        except Exception:  # an adapter bug must cost one target one poll, never the process
            log.exception("target %s: unexpected error while reading its page", self.name)
            outcome = self._failed(previous, "parse", "unexpected error", started)
        self.outcome = outcome
        self._render()
        return outcome

    def _render(self) -> None:
        # Rendered here, after the poll, so that a scrape of /metrics only joins text.
        self.text = exposition.render_target(self.name, self.labels, self.config.url, self.outcome, self.failures,
                                             self._prefixes)

    async def _fetch_and_read(self, timeout: float | None) -> tuple[adapters.Adapter, dict]:
        """The adapter and the samples it wants: from a filtered answer where the engine honours the
        filter, else from the whole page."""
        deadline = time.monotonic() + (self.fetcher.settings.timeout if timeout is None else timeout)
        if self._whole is None or self.name_filter == IGNORED:
            return self._read_whole(_text(await self.fetcher.fetch(timeout)))
        adapter, held = self._whole
        try:
            text = _text(await self.fetcher.fetch(timeout, adapter.wanted))
        except FetchError as err:
            refused = err.status is not None and 400 <= err.status < 500
            choked = err.status is None and self.name_filter == UNTRIED
            # Refused (a URL too long, a query not understood), or a first filtered request that broke the
            # connection (a server choking on the long query): the filter's fault. An error the engine
            # answered with (5xx), or a broken request once the filter has worked, is the engine's, and
            # counted: a flapping engine's failures must not hide behind the fallback.
            if not (refused or choked):
                raise
            log.info("target %s: a filtered request failed (%s); reading whole pages", self.name, err)
            self.name_filter = IGNORED
            return self._read_whole(_text(await self.fetcher.fetch(_remaining(deadline))))
        samples = _parse(text, adapter)
        # Other series in the first answer: the engine ignored the filter, this is the whole page. Counted
        # once (a few tens of µs a page); an answer taken for a filtered one later still reads right.
        if self.name_filter == UNTRIED and parser.unread_lines(text, samples):
            self.name_filter = IGNORED
            return self._read_whole(text, (adapter, samples))
        if not samples or not held <= samples.keys():
            # Expected of an engine that does not filter (SGLang's and trtllm-serve's multiprocess registries
            # answer with no series): nothing is wrong, so not said at info.
            log.debug("target %s: the engine does not filter its page by ?name[]= (its answer lacks series its whole "
                      "page holds), as expected of engines that ignore the filter: reading whole pages", self.name)
            self.name_filter = IGNORED
            return self._read_whole(_text(await self.fetcher.fetch(_remaining(deadline))))
        self.name_filter = HONOURED
        return adapter, samples

    def _read_whole(self, text: str, parsed: tuple[adapters.Adapter, dict] | None = None
                    ) -> tuple[adapters.Adapter, dict]:
        """`parsed`: the page's samples as one adapter already read them, reused if it is the page's."""
        engine = self.config.engine
        adapter = adapters.ADAPTERS[engine] if engine != "auto" else adapters.detect(text)
        if adapter is None:
            if parser.has_samples(text):
                raise PollFailed("unknown_engine", f"no {adapters.titles()} series on the page")
            raise PollFailed("parse", "page is not Prometheus exposition text")
        samples = parsed[1] if parsed is not None and parsed[0] is adapter else _parse(text, adapter)
        self._whole = adapter, frozenset(samples)
        return adapter, samples

    def _failed(self, previous: PollOutcome, reason: str, detail: str, started: float) -> PollOutcome:
        self.failures[reason] += 1
        self._whole, self.name_filter = None, UNTRIED  # a whole page next, then the filter tried again
        if reason != self._last_reason:  # log a change of state, not every failed poll
            log.warning("target %s: poll failed (%s): %s", self.name, reason, detail)
            self._last_reason = reason
        # Keep the last good values; the exposition hides them once they are older than the staleness period.
        return PollOutcome(False, previous.engine, previous.model, previous.version, time.monotonic() - started,
                           previous.last_success, previous.ranks, previous.role)

    def close(self) -> None:
        """In the event loop thread that polls the target (its connection belongs to that loop)."""
        self.fetcher.close()


def _text(body: bytes) -> str:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise PollFailed("parse", "page is not UTF-8") from None


def _parse(text: str, adapter: adapters.Adapter) -> dict:
    try:
        return parser.parse(text, adapter.wanted)
    except parser.ParseError as err:
        raise PollFailed("parse", str(err)) from None


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def fetch_settings(config: Config, target: TargetConfig) -> FetchSettings:
    return FetchSettings(timeout=config.timeout, max_bytes=config.max_response_bytes,
                         bearer_token_file=target.bearer_token_file, basic_auth_username=target.basic_auth_username,
                         basic_auth_password_file=target.basic_auth_password_file, ca_pem=target.ca_pem,
                         verify_tls=not target.tls_insecure_skip_verify)


def new_target(target: TargetConfig, config: Config) -> Target:
    """A configured engine as a Target, fetched, judged and labelled as `config` says: the one way the
    exporter, /probe, `top` and `kv-math` make one."""
    return Target(target, fetch_settings(config, target), config.thresholds, config.labels, config.adapted_buckets)
