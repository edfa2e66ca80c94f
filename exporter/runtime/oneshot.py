"""One poll of one engine, outside the exporter's loop (for `kv-math --target`)."""

from __future__ import annotations

import asyncio

from ..config import DEFAULT_MAX_BYTES, target_from_url
from ..sources.fetch import FetchSettings
from ..thresholds import DEFAULT
from .target import Target


class TargetUnavailable(Exception):
    pass


async def _poll_once(target: Target):
    try:
        return await target.poll()
    finally:
        target.close()


def capacity_tokens(url: str, timeout: float = 10.0) -> int:
    """The engine's KV capacity in tokens, summed over its data-parallel pools."""
    target = Target(target_from_url(url), FetchSettings(timeout=timeout, max_bytes=DEFAULT_MAX_BYTES), DEFAULT, {})
    outcome = asyncio.run(_poll_once(target))
    if not outcome.up:
        reason = next(reason for reason, count in target.failures.items() if count)
        raise TargetUnavailable(f"{url}: poll failed ({reason})")
    capacities = [rank.gauges.get("capacity_tokens") for rank in outcome.ranks.values()]
    if not capacities or None in capacities:
        raise TargetUnavailable(f"{url}: the engine does not report its KV capacity")
    return int(sum(capacities))
