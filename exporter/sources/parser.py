"""Prometheus text exposition (0.0.4 and OpenMetrics) to samples, reading only the names asked for.

prometheus_client's parser builds every family of a page; a vLLM page is mostly families
we never read (python_gc_*, dozens of histograms). Here one compiled regex that starts with
a literal (a newline, which the regex engine searches for at C speed) jumps from wanted sample
line to wanted sample line. Two selectors share that shape: the fast one reads a label set as
"everything up to the first `}`", which the regex engine scans as fast as it scans for a newline;
the exact one reads it quote by quote, at about half that speed on engine pages. The fast one is
exact unless a label value holds a `}` or a line is broken, and both show (see `_FAST_LABELS`):
the page is then read again with the exact one. Label sets repeat from poll to poll and from target to target, so their
parsed form is cached. The differential tests prove the samples equal to prometheus_client's;
bench/parser_speed.py measures the difference.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterable, NamedTuple


class ParseError(ValueError):
    """A wanted line that is not valid exposition text."""


class Sample(NamedTuple):
    name: str
    label_text: str  # between the braces, as on the page; parsed only when asked (and then cached)
    value: float

    @property
    def labels(self) -> dict[str, str]:
        """Shared between samples with the same label text: never mutate. Raises ParseError."""
        return parse_labels(self.label_text) if self.label_text else {}


# Possessive throughout: a label set of mostly blanks must not send the regex engine backtracking.
_PAIR = r'\s*+([a-zA-Z_][a-zA-Z0-9_]*+)\s*+=\s*+"((?:[^"\\\n]++|\\.)*+)"\s*+'
_LABEL_PAIR = re.compile(_PAIR)
_LABEL_SET = re.compile(f"(?:{_PAIR},)*+(?:{_PAIR})?+\\s*+")
# After the name: optional label set, value, optional timestamp, optional exemplar, optional CR.
# Possessive quantifiers: a line that does not match fails at once instead of backtracking.
_EXACT_LABELS = (
    # label set, "unrolled" (runs of plain characters between quoted values) so the regex engine
    # moves through it in runs, not character by character
    r'(?:\{([^"}\n]*+(?:"[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"[^"}\n]*+)*+)\})?'
)
_EXACT_TAIL = r'[ \t]++([^ \t\r\n]++)(?:[ \t]++[^ \t\r\n#]++)?[ \t]*+(?:#[^\r\n]*+)?\r?(?=\n|\Z)'
# Up to the first `}`: a one-character exclusion, which the regex engine scans in a tight loop (a
# class of two or more characters costs it about twice as much on engine pages). Where that `}`
# sits inside a quoted value, the rest of the line still holds the value's closing quote, and this
# tail admits no quote: the line falls to the malformed branch. A line with no `}` at all lets the label set
# run into the next line: the parser sees the newline in it. Either way the exact selector decides.
# OpenMetrics exemplars have quoted labels too, so their lines are read by the exact one.
_FAST_LABELS = r'(?:\{([^}]*+)\})?'
_FAST_TAIL = r'[ \t]++([^ \t\r\n"]++)(?:[ \t]++[^ \t\r\n#"]++)?[ \t]*+(?:#[^\r\n"]*+)?\r?(?=\n|\Z)'
_ESCAPES = re.compile(r"\\(.)")
_ESCAPED = {"n": "\n", "\\": "\\", '"': '"'}
_ANY_SAMPLE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{|[ \t]+\S)", re.MULTILINE)


def _unescape(value: str) -> str:
    # Text format 0.0.4 and OpenMetrics escape only \\, \" and \n; other pairs stay as written.
    return _ESCAPES.sub(lambda m: _ESCAPED.get(m.group(1), m.group(0)), value)


_label_cache: dict[str, dict[str, str]] = {}
_LABEL_CACHE_LIMIT = 200_000  # distinct label sets; a fleet of one model shares most of them


def parse_labels(text: str) -> dict[str, str]:
    labels = _label_cache.get(text)
    if labels is not None:
        return labels
    if _LABEL_SET.fullmatch(text) is None:
        raise ParseError(f"bad label set {{{text[:80]}}}")
    labels = {name: _unescape(value) if "\\" in value else value for name, value in _LABEL_PAIR.findall(text)}
    if len(_label_cache) >= _LABEL_CACHE_LIMIT:
        _label_cache.clear()
    _label_cache[text] = labels
    return labels


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


@lru_cache(maxsize=128)
def _selector(names: frozenset[str], exact: bool) -> re.Pattern[str]:
    # A line start is a newline (the caller puts one before the page), then optional blanks. The
    # pattern still begins with a literal the regex engine can search for fast. The name must end where
    # a label set or whitespace starts: `foo` never matches `foo_bar`. A wanted line that is not
    # well formed falls to the last branch, which leaves the value empty.
    well_formed = _EXACT_LABELS + _EXACT_TAIL if exact else _FAST_LABELS + _FAST_TAIL
    return re.compile(r"\n[ \t]*+(" + _trie_pattern(names) + r")(?=[{ \t])(?:" + well_formed + r"|[^\n]*)")


def reference_parse(text: str, names: frozenset[str]) -> dict[str, list[Sample]]:
    """Samples whose name is in `names`, by name, in page order. Raises ParseError on a bad wanted line
    (a bad label set inside it: when its labels are first read). `parse` is this, or the compiled reader
    where it was built, which gives the same answer."""
    if not names:
        return {}
    page = "\n" + text
    found: dict[str, list[Sample]] = {}
    try:
        for name, label_text, value in _selector(names, False).findall(page):
            if "\n" in label_text:
                raise ValueError
            samples = found.get(name)
            if samples is None:
                samples = found[name] = []
            samples.append(_new_sample(Sample, (name, label_text, float(value))))
    except ValueError:  # a malformed line, a bad value, or a `}` inside a label value: read it exactly
        return _parse_exact(page, names)
    return found


def _parse_exact(page: str, names: frozenset[str]) -> dict[str, list[Sample]]:
    found: dict[str, list[Sample]] = {}
    for match in _selector(names, True).finditer(page):
        name, label_text, value = match.groups()
        if not value:
            raise ParseError(f"bad sample line for {name}: {match.group().lstrip()[len(name):][:80]!r}")
        try:
            number = float(value)
        except ValueError:
            raise ParseError(f"bad sample value {value!r}") from None
        found.setdefault(name, []).append(Sample(name, label_text, number))
    return found


_new_sample = tuple.__new__  # Sample(...) without the Python-level __new__ of a NamedTuple: the hot loop


def unread_lines(text: str, found: dict[str, list[Sample]]) -> int:
    """Lines of the page that are neither comments, blank, nor among the samples `parse` found in it:
    series of other names (a server that ignored a filter). Counted in C, a few µs a page; a line that
    is blank but for a CR or spaces counts as unread."""
    lines = text.count("\n") + (not text.endswith("\n") if text else 0)
    comments = text.count("\n#") + text.startswith("#")
    blank = text.count("\n\n") + text.startswith("\n")
    return lines - comments - blank - sum(map(len, found.values()))


def has_samples(text: str) -> bool:
    """Whether the page holds any sample line at all (exposition text rather than, say, HTML)."""
    return _ANY_SAMPLE.search(text) is not None


# The compiled reader (cparser.pyx, issue #33) where the install could build it: it reads the pages it
# can in C and hands the rest to reference_parse. READER says which one runs (kvcache_exporter_build_info).
try:
    from . import cparser
except ImportError:  # no C compiler at install
    READER = "python"
    parse = reference_parse
else:
    cparser.bind(Sample, reference_parse)
    READER = "cython"
    parse = cparser.parse
