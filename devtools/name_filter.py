"""What an engine that honours prometheus_client's `?name[]=` filter answers, from the page it sends whole:
the sample lines of the names asked for (sample names: a counter's `_total`, a histogram's `_bucket`,
`_sum` and `_count` each asked for by name), each family's HELP and TYPE before its first one, nothing
else (prometheus_client: `CollectorRegistry.restricted_registry`, `Metric._restricted_metric`). For
page servers in tests and for bench/read_less.py; the simulator uses prometheus_client's own."""

from __future__ import annotations

from typing import AbstractSet


def answer(page: str, names: AbstractSet[str]) -> str:
    kept: list[str] = []
    header: list[str] = []  # the HELP and TYPE lines of the family being read, until one of its samples is kept
    for line in page.splitlines(keepends=True):
        if line.startswith("# HELP "):
            header = [line]
        elif line.startswith("# TYPE "):
            family = line.split(" ", 3)[2]
            same = header and header[-1].startswith(f"# HELP {family} ")
            header = [*header, line] if same else [line]
        elif line.strip() and not line.startswith("#"):
            if line.split("{", 1)[0].split(" ", 1)[0].strip() in names:
                kept.extend(header)
                header = []
                kept.append(line)
    return "".join(kept)
