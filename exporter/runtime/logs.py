"""The exporter's log records on stderr, one line each: logfmt (the Prometheus exporters' default) or JSON
(`log_format`), with the same keys in both: time (RFC 3339, UTC), level, logger, message; `worker` in a
worker process, `exception` where a record carries one (its traceback escaped into the line)."""

from __future__ import annotations

import json
import logging
import sys
import time


def _fields(record: logging.LogRecord, formatter: logging.Formatter, worker: int | None) -> dict[str, str]:
    seconds = time.gmtime(record.created)
    fields = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", seconds) + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "message": record.getMessage(),
    }
    if worker is not None:
        fields["worker"] = str(worker)
    if record.exc_info:
        fields["exception"] = formatter.formatException(record.exc_info)
    return fields


class JSONFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record, self, self.worker), ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None):
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in _fields(record, self, self.worker).items())


def _logfmt_value(value: str) -> str:
    """Bare where logfmt allows it, else quoted with JSON's escapes (a line break never ends the record)."""
    if value and value.isprintable() and not any(c in value for c in ' ="\\'):
        return value
    return json.dumps(value, ensure_ascii=False)


FORMATTERS = {"logfmt": LogfmtFormatter, "json": JSONFormatter}


def configure(level: str, log_format: str, worker: int | None = None) -> None:
    """Send the records at `level` and above to stderr in `log_format` (config.LOG_FORMATS), once per process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FORMATTERS[log_format](worker))
    logging.basicConfig(level=level.upper(), handlers=[handler])
