"""What every signal's rules share: how they aggregate a target's ranks, how they print a threshold, and the
shape and wording of an alert."""

from __future__ import annotations

# Per-target series carry dp_rank (one KV pool per data-parallel replica); the rules look at a
# whole target, so they aggregate it away and keep every other label (target, engine, model,
# static labels, instance, job).
PER_TARGET = "without (dp_rank)"
# Annotation template fragments.
WHERE = "{{ $labels.target }} (model {{ $labels.model }})"
PER_SECOND = 'printf "%.2f"'  # rates read better as 0.25/s than as humanize's 250m/s
VALUE_PER_SECOND = "{{ $value | " + PER_SECOND + " }}"


def number(value: float) -> str:
    """A threshold as PromQL prints it: no trailing `.0`."""
    return f"{value:g}"


def target_rate(counter: str, window: str, offset: str = "") -> str:
    """A counter's per-second rate over `window` (optionally `offset` back in time), summed over a target's ranks."""
    return f"sum {PER_TARGET} (rate({counter}[{window}]{offset}))"


def with_traffic(condition: str, traffic: str, floor: float) -> str:
    """`condition` where `traffic` (a rate the rules record) is at least `floor`: a ratio or rate over a handful of
    events alerts on nothing."""
    return f"{condition}\nand {traffic} >= {number(floor)}"


def alert(name: str, severity: str, expr: str, for_: str, summary: str, description: str, runbook_base: str) -> dict:
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": f"{runbook_base}#{name.lower()}",
        },
    }
