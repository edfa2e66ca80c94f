"""KV memory arithmetic, a library the configuration reads (`layout`, `readers`) and a command (`cli`)."""

from .layout import AUTO, DTYPE_BYTES, ArchitectureError, KVLayout, RecurrentState, canonical_dtype
from .readers import MAPPING_KEYS, layout_from_config_json, layout_from_mapping

__all__ = ["AUTO", "DTYPE_BYTES", "ArchitectureError", "KVLayout", "MAPPING_KEYS", "RecurrentState",
           "canonical_dtype", "layout_from_config_json", "layout_from_mapping"]
