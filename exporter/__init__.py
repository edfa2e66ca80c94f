"""kvcache-exporter: KV-cache observability for LLM serving fleets (the engines of kvcache_exporter.adapters)."""

import logging
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvcache-exporter")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

# A library's loggers stay silent until the program configures logging (the exporter's CLI does).
logging.getLogger(__name__).addHandler(logging.NullHandler())
