"""Probe mode (the multi-target exporter pattern): `/probe?target=URL&engine=auto` polls one engine
now. Each probed engine's Target is kept between probes, so derived series that need history
(pressure state, counter resets) work as in poll mode.

What a prober may cost is bounded, whoever sends the probes:
- probing is off unless the configuration turns it on (`probe.enabled`) and names the hosts it may
  reach (`probe.allow`); the exporter's own address and any request from an exporter (its
  User-Agent) are refused, so a probe never polls a probe;
- at most `probe.max_targets` engines keep state (and a connection); the least recently probed one
  is forgotten first (counted in kvcache_exporter_probe_evictions_total), and any engine is
  forgotten `staleness` after its last probe;
- concurrent probes of one engine share one poll in flight.

Every method runs in the event loop that polls the targets.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict
from typing import Callable
from urllib.parse import urlsplit

from ..config import Config, TargetConfig, engines, target_from_url
from ..contract import ROLES
from ..sources.fetch import USER_AGENT
from .target import Target, new_target

SCRAPE_TIMEOUT_HEADER = "x-prometheus-scrape-timeout-seconds"
# A probe's poll ends this much before Prometheus' scrape timeout (or a tenth of it, if less), so
# that a slow engine shows as a `timeout` failure instead of a lost scrape.
TIMEOUT_MARGIN = 0.5


class _Probed:
    __slots__ = ("target", "last_probe", "poll", "checked_under")

    def __init__(self, target: Target, config: Config):
        self.target = target
        self.last_probe = time.monotonic()
        self.poll: asyncio.Task | None = None  # the poll in flight, shared by every probe that arrives meanwhile
        self.checked_under = config  # the configuration whose allow list admitted this engine


class Prober:
    def __init__(self, config: Callable[[], Config], own_port: Callable[[], int]):
        self._config = config
        self._own_port = own_port
        self._targets: OrderedDict[tuple[str, str], _Probed] = OrderedDict()  # least recently probed first
        self.evictions = 0

    async def probe(self, query: dict[str, list[str]], headers: dict[str, str]) -> tuple[int, Target | str]:
        """(200, the probed target) or (an HTTP status, why not)."""
        config = self._config()
        if not config.probe.enabled:
            return 403, "probe mode is off: set probe.enabled and probe.allow in the configuration"
        if headers.get("user-agent", "").startswith(USER_AGENT):
            return 403, "a probe cannot probe an exporter's /probe"
        url = (query.get("target") or [""])[0]
        engine = (query.get("engine") or ["auto"])[0]
        # What the engine is a replica of until its page says (discovery's labels, relabeled to __param_model
        # and __param_role): a new replica that does not answer yet counts as starting.
        model, role = (query.get("model") or [None])[0], (query.get("role") or [None])[0]
        if role is not None and role not in ROLES:
            return 400, f"role must be one of {', '.join(ROLES)}"
        key = (url, engine)
        known = self._targets.get(key)
        if known is None or known.checked_under is not config:  # checked once per engine and configuration
            refusal = await self._refusal(url, engine, config)
            if refusal is not None:
                if known is not None:
                    self._forget(self._targets.pop(key))
                return refusal
            if known is not None:
                known.checked_under = config
        probed = self._entry(key, config, model, role)
        poll = probed.poll
        if poll is None:
            poll = probed.poll = asyncio.get_running_loop().create_task(probed.target.poll(_timeout(config, headers)))
            poll.add_done_callback(lambda _: setattr(probed, "poll", None))
        try:
            await asyncio.shield(poll)
        except asyncio.CancelledError:
            if not poll.cancelled():
                raise  # this probe was cancelled (the exporter stops), not the shared poll
            return 503, "the engine's state was evicted while its poll ran (more engines probed than probe.max_targets)"
        return 200, probed.target

    async def _refusal(self, url: str, engine: str, config: Config) -> tuple[int, str] | None:
        """Why this engine may not be probed, as (HTTP status, reason), or None."""
        if engine not in engines():
            return 400, f"engine must be one of {', '.join(engines())}"
        try:
            target_from_url(url)
        except ValueError as err:
            return 400, f"target {err}"
        host, port = _host_port(url)
        if not config.probe.allows(host):
            return 403, f"target host {host!r} is not in probe.allow"
        if port == self._own_port() and await _is_local(host):
            return 403, "target is this exporter itself"
        return None

    def _entry(self, key: tuple[str, str], config: Config, model: str | None, role: str | None) -> _Probed:
        """The state kept for this engine, made if new; forgets the stale and the least recently probed."""
        now = time.monotonic()
        while self._targets:
            oldest = next(iter(self._targets.values()))
            if now - oldest.last_probe <= config.staleness:
                break
            self._forget(self._targets.popitem(last=False)[1])
        probed = self._targets.get(key)
        if probed is None:
            while len(self._targets) >= config.probe.max_targets:
                self._forget(self._targets.popitem(last=False)[1])
                self.evictions += 1
            url, engine = key
            target_config = TargetConfig(name=target_from_url(url).name, url=url, engine=engine, role=role,
                                         model=model)
            probed = self._targets[key] = _Probed(new_target(target_config, config), config)
        self._targets.move_to_end(key)
        probed.last_probe = now
        return probed

    @staticmethod
    def _forget(probed: _Probed) -> None:
        if probed.poll is not None:  # closed once the cancelled poll has let go of its connection
            probed.poll.add_done_callback(lambda _: probed.target.close())
            probed.poll.cancel()
        else:
            probed.target.close()

    def probed(self) -> int:
        return len(self._targets)

    async def close(self) -> None:
        """Forget every probed engine and wait for their polls to end."""
        polls = [probed.poll for probed in self._targets.values() if probed.poll is not None]
        while self._targets:
            self._forget(self._targets.popitem()[1])
        await asyncio.gather(*polls, return_exceptions=True)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def _timeout(config: Config, headers: dict[str, str]) -> float:
    """The probe's poll deadline: the configured timeout, shortened to fit Prometheus' scrape timeout."""
    try:
        scrape_timeout = float(headers.get(SCRAPE_TIMEOUT_HEADER, "inf"))
    except ValueError:
        return config.timeout
    if not scrape_timeout > 0:
        return config.timeout
    return min(config.timeout, scrape_timeout - min(TIMEOUT_MARGIN, scrape_timeout / 10))


async def _is_local(host: str) -> bool:
    """Whether `host` names this machine: a loopback or unspecified address, or one of its own."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # the poll will fail as `connect`
    own = await _own_addresses()
    for *_, address in infos:
        ip = ipaddress.ip_address(address[0].split("%")[0])
        if ip.is_loopback or ip.is_unspecified or ip in own:
            return True
    return False


async def _own_addresses() -> set:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {ipaddress.ip_address(address[0].split("%")[0]) for *_, address in infos}
