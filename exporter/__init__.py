"""kvcache-exporter: KV-cache observability for vLLM and SGLang serving fleets."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvcache-exporter")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
