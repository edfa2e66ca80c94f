"""The standard series about the process (`process_*`, `python_info`), from prometheus_client's process and
platform collectors, as lines by contract family: the exposition joins them to the exporter's own series
under the contract's HELP and TYPE lines, as it joins everything else it serves."""

from __future__ import annotations

from prometheus_client import PlatformCollector, ProcessCollector

from .. import contract, exposition

_PROCESS = ProcessCollector(registry=None)
_PLATFORM = PlatformCollector(registry=None)


def lines(worker: int | None = None) -> dict[str, str]:
    """This process's lines by family: every `process` family the collectors fill here (none off Linux),
    python_info only for the serving process; a worker process's series carry `worker`."""
    extra = {} if worker is None else {"worker": str(worker)}
    out: dict[str, str] = {}
    for metric in (*_PROCESS.collect(), *(_PLATFORM.collect() if worker is None else ())):
        for sample in metric.samples:
            family = contract.family_of(sample.name)
            if family is None or family.group != "process":  # one the contract does not list is not served
                continue
            out[family.name] = out.get(family.name, "") + exposition.line(
                sample.name, exposition.label_text({**sample.labels, **extra}), sample.value)
    return out
