"""Prometheus text exposition (0.0.4 and OpenMetrics) to samples, reading only the names asked for.

prometheus_client's parser builds every family of a page; a vLLM page is mostly families
we never read (python_gc_*, dozens of histograms). Here one compiled regex, anchored at line
starts, jumps from wanted sample line to wanted sample line, so the rest of the page costs a
C-level scan. The differential tests prove the samples equal to prometheus_client's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable


class ParseError(ValueError):
    """A wanted line that is not valid exposition text."""


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


# A label value: any chars but quote, backslash and newline, or an escape sequence.
_VALUE = r'"(?:[^"\\\n]|\\.)*"'
_LABEL_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"\s*(?:,|$)')
# After the name: optional label set, value, optional timestamp, optional exemplar, optional CR.
_REST = re.compile(
    r'(?:\{(?P<labels>(?:[^"}\n]|' + _VALUE + r')*)\})?[ \t]+(?P<value>[^ \t\r\n]+)'
    r'(?:[ \t]+[^ \t\r\n#]+)?[ \t]*(?:#[^\r\n]*)?\r?'
)
_ESCAPES = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n", "\\": "\\", '"': '"'}
_ANY_SAMPLE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{|[ \t]+\S)", re.MULTILINE)


def _unescape(value: str) -> str:
    # Text format 0.0.4 and OpenMetrics escape only \\, \" and \n; other pairs stay as written.
    return _ESCAPES.sub(lambda m: _ESCAPED.get(m.group(1), m.group(0)), value)


def parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos, end = 0, len(text)
    while pos < end:
        if text[pos:].strip() == "":
            break
        match = _LABEL_PAIR.match(text, pos)
        if match is None:
            raise ParseError(f"bad label set {{{text}}}")
        name, value = match.group(1), match.group(2)
        labels[name] = _unescape(value) if "\\" in value else value
        pos = match.end()
    return labels


def parse_value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ParseError(f"bad sample value {text!r}") from None


def _trie_pattern(names: Iterable[str]) -> str:
    """An alternation factored by common prefixes, so the regex engine compares each character once."""
    trie: dict = {}
    for name in names:
        node = trie
        for char in name:
            node = node.setdefault(char, {})
        node[""] = {}

    def render(node: dict) -> str:
        branches = [re.escape(char) + render(child) for char, child in sorted(node.items()) if char]
        optional = "" in node
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if optional:
            return "(?:" + body + ")?" if len(branches) > 1 or len(body) > 1 else body + "?"
        return body

    return render(trie)


@lru_cache(maxsize=64)
def _selector(names: frozenset[str]) -> re.Pattern[str]:
    # The name must end where a label set or whitespace starts: `foo` never matches `foo_bar`.
    return re.compile(r"^(" + _trie_pattern(names) + r")(?=[{ \t])([^\n]*)", re.MULTILINE)


def parse(text: str, names: frozenset[str]) -> dict[str, list[Sample]]:
    """Samples whose name is in `names`, by name, in page order. Raises ParseError on a bad wanted line."""
    found: dict[str, list[Sample]] = {}
    if not names:
        return found
    rest_match = _REST.fullmatch
    for match in _selector(names).finditer(text):
        name, rest = match.group(1), match.group(2)
        parts = rest_match(rest)
        if parts is None:
            raise ParseError(f"bad sample line for {name}: {rest[:80]!r}")
        label_text = parts.group("labels")
        labels = parse_labels(label_text) if label_text else {}
        found.setdefault(name, []).append(Sample(name, labels, parse_value(parts.group("value"))))
    return found


def has_samples(text: str) -> bool:
    """Whether the page holds any sample line at all (exposition text rather than, say, HTML)."""
    return _ANY_SAMPLE.search(text) is not None
