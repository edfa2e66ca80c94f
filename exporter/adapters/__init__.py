"""THE engine registry: every adapter module in this package, found at import, and detection of
which engine a page belongs to. Adding an engine is one module here (a subclass of
`base.Adapter`) and its fixtures; nothing else lists engines."""

from __future__ import annotations

import importlib
import pkgutil
import re

from .base import ADAPTER, DEFAULT_KEPT, Adapter, KeptBounds, kept_bounds


def _discover() -> dict[str, Adapter]:
    found: dict[str, Adapter] = {}
    # base.py and its compiled loops (cfold) are the machinery, every other module an engine.
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in ("base", "cfold")):
        namespace = vars(importlib.import_module(f"{__name__}.{module}"))
        for value in namespace.values():
            if isinstance(value, type) and issubclass(value, Adapter) and value.__module__ == namespace["__name__"]:
                found[value.engine] = value()
    return found


ADAPTERS: dict[str, Adapter] = _discover()


def _markers(last: bool) -> re.Pattern | None:
    alternatives = [f"(?P<{name}>{adapter.marker})" for name, adapter in ADAPTERS.items() if adapter.detect_last == last]
    return re.compile("^(?:" + "|".join(alternatives) + ")", re.MULTILINE) if alternatives else None


# Engines first; then the servers whose own series sit next to the engine pages they pass through.
_DETECT = tuple(pattern for pattern in (_markers(False), _markers(True)) if pattern)


def titles() -> str:
    """The engines' display names, for messages: 'vLLM or SGLang'."""
    names = [adapter.title for adapter in ADAPTERS.values()]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def detect(text: str) -> Adapter | None:
    """The adapter whose series the page holds (the first engine-prefixed sample line decides)."""
    for pattern in _DETECT:
        match = pattern.search(text)
        if match:
            return ADAPTERS[match.lastgroup]
    return None
