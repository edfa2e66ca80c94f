"""KV memory arithmetic, a library the configuration and the `kv-math` command use: layouts (`layout`)
and reading them from a config.json or `model_architecture:` (`readers`)."""

from .layout import AUTO, DTYPE_BYTES, ArchitectureError, KVLayout, RecurrentState, canonical_dtype
from .readers import MAPPING_KEYS, layout_from_config_json, layout_from_mapping

__all__ = ["AUTO", "DTYPE_BYTES", "ArchitectureError", "KVLayout", "MAPPING_KEYS", "RecurrentState",
           "canonical_dtype", "layout_from_config_json", "layout_from_mapping"]
