"""Engine adapters, and detection of which one a page belongs to."""

from __future__ import annotations

import re

from .base import Adapter
from .sglang import SglangAdapter
from .vllm import VllmAdapter

ADAPTERS: dict[str, Adapter] = {adapter.engine: adapter for adapter in (VllmAdapter(), SglangAdapter())}
_DETECT = re.compile(
    "^(?:" + "|".join(f"(?P<{name}>{adapter.marker})" for name, adapter in ADAPTERS.items()) + ")", re.MULTILINE
)


def detect(text: str) -> Adapter | None:
    """The adapter whose series the page holds (the first engine-prefixed sample line decides)."""
    match = _DETECT.search(text)
    return ADAPTERS[match.lastgroup] if match else None
