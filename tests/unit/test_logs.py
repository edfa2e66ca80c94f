"""Log records as one line each, in logfmt and JSON (exporter/runtime/logs.py): a message with quotes, spaces
and line breaks, and a traceback, stay on their line and read back as they were."""

from __future__ import annotations

import json
import logging
import sys

from devtools.harness import logfmt
from kvcache_exporter.runtime import logs


def record_with_a_traceback() -> logging.LogRecord:
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logging.getLogger("kvcache_exporter.x").makeRecord(
            "kvcache_exporter.x", logging.ERROR, __file__, 1, 'target %s: "%s"\nnext', ("t 1", "a=b"), sys.exc_info())
    return record


def test_each_format_writes_one_line_that_reads_back():
    record = record_with_a_traceback()
    for formatter, parse in ((logs.JSONFormatter(worker=3), json.loads), (logs.LogfmtFormatter(worker=3), logfmt)):
        line = formatter.format(record)
        assert "\n" not in line
        fields = parse(line)
        assert fields["level"] == "error" and fields["logger"] == "kvcache_exporter.x" and fields["worker"] == "3"
        assert fields["message"] == 'target t 1: "a=b"\nnext'
        assert fields["exception"].startswith("Traceback") and fields["exception"].endswith("ValueError: bad\nvalue")


def test_logfmt_leaves_plain_values_bare():
    record = logging.LogRecord("kvcache_exporter.app", logging.INFO, __file__, 1, "ready", None, None)
    line = logs.LogfmtFormatter().format(record)
    assert line.split(" ", 1)[1] == "level=info logger=kvcache_exporter.app message=ready"
